"""Triton rotary position embedding (rotate-half convention), applied in place to q and k.

Grid: one program per token. All heads of a token share one position, so the program looks the position up once,
loads its cos/sin row (R/2 values each) once, and rotates every query head and every key head with it as
[heads, R/2] tiles: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, where x1 = x[:R/2] and x2 = x[R/2:R].
Columns past the rotated width R are never touched, which is exactly "pass through" when working in place.
cos/sin are rounded to the activation dtype first, as the reference does; the products are formed in fp32.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, s_h, n_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < n_heads) & (r < half)
    p1 = base_ptr + h * s_h + r
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    c = cos.to(x1.dtype).to(tl.float32)
    s = sin.to(x1.dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(p1 + half, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, s_cs, half, BLOCK_R: tl.constexpr):
    """Token t's position and its cos and sin rows, [1, BLOCK_R] fp32 each (zero past half)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cs_ptr + pos * s_cs + r, mask=r < half, other=0.0)
    sin = tl.load(cs_ptr + pos * s_cs + half + r, mask=r < half, other=0.0)
    return pos, cos, sin


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, s_qt, s_qh, s_kt, s_kh, s_cs, n_q_heads, n_k_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos, cos, sin = _cos_sin(pos_ptr, cs_ptr, t, s_cs, half, BLOCK_R)
    _rotate_heads(q_ptr + t * s_qt, s_qh, n_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr + t * s_kt, s_kh, n_k_heads, cos, sin, half, BLOCK_HK, BLOCK_R)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """q: [T, H, D], k: [T, KVH, D], positions: [T], cos_sin_cache: [max_pos, R] fp32 (cos | sin).
    Rotates q and k in place and returns them."""
    T, H, D = q.shape
    rot = cos_sin_cache.shape[1]
    assert rot % 2 == 0 and rot <= D and q.stride(-1) == 1 and k.stride(-1) == 1
    if T == 0:
        return q, k
    cs = cos_sin_cache.contiguous()
    _rotary_kernel[(T,)](q, k, positions.contiguous(), cs, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cs.stride(0), H, k.shape[1], rot // 2, BLOCK_HQ=triton.next_power_of_2(H),
                         BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_R=triton.next_power_of_2(rot // 2))
    return q, k
