"""Triton kernel that scatters this step's K and V rows into the paged KV cache, quantizing them for an INT8 or FP8
cache (kv_cache.py's docstring defines the quantizer and why scales are per token and head).

Grid: one program per token. A token's keys (and values) for all KV heads are one small [KVH, D] tile, so a
program moves the whole token with one load and one store per cache; tokens never share a slot, so programs are
independent. slot = block_id * block_size + offset_in_block; a slot of -1 marks padding and the program stores
nothing, leaving that part of the cache untouched.

Quantized, a program also reduces each head's row to its absolute maximum and stores the head's float16 scale.

`rotary_write_kv_triton` is the same write with the rotary embedding before it, in one launch instead of two: the
program rotates its token's query heads in place (triton_rotary.py's arithmetic) and its key heads in registers,
each column from its own value and its partner's half a rotation away, then stores the rotated keys and the values
in the cache. The cache gets the bits the two kernels one after the other give.
FP8 values are encoded with integer arithmetic into the cache's bytes (passed as uint8): the same bits as
torch's float8_e4m3fn cast on every GPU, including those without FP8 conversion instructions, and in the
interpreter, whose own float8 cast rounds some values across an exponent boundary wrongly.
"""
import torch
import triton
import triton.language as tl

from trellm_kernels.triton_rotary import _cos_sin, _rotate_heads

RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to the nearest even integer


@triton.jit
def _round_even(y):
    return (y + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def _encode_fp8_e4m3(y):
    """float32 y with |y| <= 448 -> the float8_e4m3fn bits (as int32 0..255), rounding half to even."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2**-6): round the float32 mantissa to 3 bits; a carry moves into the exponent by itself.
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormals: multiples of 2**-9 (a result of 8 is the smallest normal's code, 0x08, as it should be).
    sub = _round_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, code | 0x80, code)   # the sign bit: -0.0 too


@triton.jit
def _quantize_store(x, c_ptr, s_ptr, mask, hmask, QUANT: tl.constexpr):
    """Quantize x [BLOCK_H, BLOCK_D] (float32) per row; store the values at c_ptr and the row scales at s_ptr."""
    QMAX: tl.constexpr = 127.0 if QUANT == 1 else 448.0
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    s = tl.maximum(tl.div_rn(amax, QMAX), 0.00006103515625).to(tl.float16)
    y = tl.div_rn(x, s.to(tl.float32)[:, None])
    if QUANT == 1:
        q = tl.minimum(tl.maximum(_round_even(y), -127.0), 127.0).to(tl.int32).to(tl.int8)
    else:
        q = _encode_fp8_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.uint8)
    tl.store(c_ptr, q, mask=mask)
    tl.store(s_ptr, s, mask=hmask)


@triton.jit
def _token_tile(slot, block_size, num_kv_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """A slot's block and offset, and the [BLOCK_H, BLOCK_D] tile of a token's heads: head indices (flat and as a
    column), column indices, and the masks of real heads and of real elements."""
    hh = tl.arange(0, BLOCK_H)
    h = hh[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    return slot // block_size, slot % block_size, hh, h, d, hh < num_kv_heads, (h < num_kv_heads) & (d < head_dim)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, block_size, num_kv_heads, head_dim,
                     s_kt, s_kh, s_vt, s_vh,
                     s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk, off, hh, h, d, hmask, mask = _token_tile(slot, block_size, num_kv_heads, head_dim, BLOCK_H, BLOCK_D)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * s_kt + h * s_kh + d, mask=mask)
        v = tl.load(v_ptr + t64 * s_vt + h * s_vh + d, mask=mask)
        tl.store(kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_quant_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, block_size, num_kv_heads,
                           head_dim, s_kt, s_kh, s_vt, s_vh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                           s_ksb, s_kss, s_vsb, s_vss,
                           QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk, off, hh, h, d, hmask, mask = _token_tile(slot, block_size, num_kv_heads, head_dim, BLOCK_H, BLOCK_D)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * s_kt + h * s_kh + d, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * s_vt + h * s_vh + d, mask=mask, other=0.0).to(tl.float32)
        _quantize_store(k, kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d, ks_ptr + blk * s_ksb + off * s_kss + hh,
                        mask, hmask, QUANT)
        _quantize_store(v, vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d, vs_ptr + blk * s_vsb + off * s_vss + hh,
                        mask, hmask, QUANT)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, KVH, D] (any row strides); caches: [num_blocks, block_size, KVH, D]; slot_mapping: [T]; INT8/FP8
    caches: k_scale, v_scale [num_blocks, block_size, KVH] float16 (head stride 1)."""
    T, KVH, D = k.shape
    if T == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    common = (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    blocks = dict(BLOCK_H=triton.next_power_of_2(KVH), BLOCK_D=triton.next_power_of_2(D))
    if k_cache.dtype not in (torch.int8, torch.float8_e4m3fn):
        _write_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping.contiguous(), k_cache.shape[1], KVH, D,
                               *common, **blocks)
        return
    assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1
    raw = torch.int8 if k_cache.dtype == torch.int8 else torch.uint8
    _write_kv_quant_kernel[(T,)](
        k, v, k_cache.view(raw), v_cache.view(raw), k_scale, v_scale, slot_mapping.contiguous(), k_cache.shape[1],
        KVH, D, *common, k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        QUANT=1 if k_cache.dtype == torch.int8 else 2, **blocks)


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pos_ptr, cs_ptr, slot_ptr,
                            block_size, n_q_heads, num_kv_heads, head_dim, half,
                            s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cs, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                            s_ksb, s_kss, s_vsb, s_vss,
                            QUANT: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos, cos, sin = _cos_sin(pos_ptr, cs_ptr, t, s_cs, half, BLOCK_R)
    _rotate_heads(q_ptr + t * s_qt, s_qh, n_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_R)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk, off, hh, h, d, hmask, mask = _token_tile(slot, block_size, num_kv_heads, head_dim, BLOCK_H, BLOCK_D)
        k_row = k_ptr + t * s_kt + h * s_kh
        x = tl.load(k_row + d, mask=mask, other=0.0)
        # Column d < half pairs with d + half (x1*cos - x2*sin); half <= d < 2*half with d - half (x2*cos + x1*sin);
        # columns past the rotated width pass through (cos 1, sin 0).
        first, rotated = d < half, d < 2 * half
        partner = tl.where(first, d + half, d - half)
        y = tl.load(k_row + partner, mask=mask & rotated, other=0.0)
        col = tl.where(first, d, d - half)
        c = tl.load(cs_ptr + pos * s_cs + col, mask=mask & rotated, other=1.0).to(x.dtype).to(tl.float32)
        sn = tl.load(cs_ptr + pos * s_cs + half + col, mask=mask & rotated, other=0.0).to(x.dtype).to(tl.float32)
        a, b = x.to(tl.float32), y.to(tl.float32)
        k = tl.where(first, a * c - b * sn, a * c + b * sn)   # the two halves' expressions of _rotate_heads
        k = tl.where(rotated, k, a).to(x.dtype)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask, other=0.0)
        kc = kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d
        vc = vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d
        if QUANT == 0:
            tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)
        else:
            _quantize_store(k.to(tl.float32), kc, ks_ptr + blk * s_ksb + off * s_kss + hh, mask, hmask, QUANT)
            _quantize_store(v.to(tl.float32), vc, vs_ptr + blk * s_vsb + off * s_vss + hh, mask, hmask, QUANT)


def rotary_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q in place and store the rotated k and v at their slots (k itself is left as it was). Shapes as in
    rotary_triton and write_kv_triton. Returns q."""
    T, H, D = q.shape
    KVH = k.shape[1]
    rot = cos_sin_cache.shape[1]
    assert rot % 2 == 0 and rot <= D and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"
    if T == 0:
        return q
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    quant = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0)
    if quant:
        assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1
        raw = torch.int8 if quant == 1 else torch.uint8
        kc, vc, scales = k_cache.view(raw), v_cache.view(raw), (k_scale, v_scale, k_scale.stride(0),
                                                                 k_scale.stride(1), v_scale.stride(0),
                                                                 v_scale.stride(1))
    else:
        kc, vc, scales = k_cache, v_cache, (k_cache, v_cache, 0, 0, 0, 0)   # no scales: never read
    cs = cos_sin_cache.contiguous()
    _rotary_write_kv_kernel[(T,)](
        q, k, v, kc, vc, scales[0], scales[1], positions.contiguous(), cs, slot_mapping.contiguous(),
        k_cache.shape[1], H, KVH, D, rot // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cs.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), *scales[2:], QUANT=quant, BLOCK_HQ=triton.next_power_of_2(H),
        BLOCK_R=triton.next_power_of_2(rot // 2), BLOCK_H=triton.next_power_of_2(KVH),
        BLOCK_D=triton.next_power_of_2(D))
    return q
