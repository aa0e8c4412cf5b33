"""Triton LoRA kernels for a batch that mixes adapters (Punica's BGMV on a GPU): each token picks its adapter's
matrices through a token -> slot index, so one launch serves every adapter of the step.

shrink: t[tok, r] = sum_k x[tok, k] * A[slot, r, k]; grid (tokens, rank blocks).
expand: out[tok, col0 + n] += scale[slot] * sum_r t[tok, r0 + r] * B[slot, n, r]; grid (tokens, column blocks).
A token of slot -1 (no adapter) writes zeros (shrink) or leaves `out` alone (expand). Each program reduces one
token's row with fp32 accumulation (a decode step has one row per sequence: a matrix-vector product, no tl.dot).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, t_ptr, K, R, s_x, s_al, s_ar, s_t,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            xv = tl.load(x_ptr + tok * s_x + ks, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * s_al + rows[:, None] * s_ar + ks[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(t_ptr + tok * s_t + rows, acc, mask=rmask)


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, slot_ptr, scale_ptr, out_ptr, N, R, s_t, s_bl, s_bn, s_o, col0, r0,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for rr in range(0, R, BLOCK_R):
            rs = rr + tl.arange(0, BLOCK_R)
            rmask = rs < R
            tv = tl.load(t_ptr + tok * s_t + r0 + rs, mask=rmask, other=0.0).to(tl.float32)
            bv = tl.load(b_ptr + slot * s_bl + ns[:, None] * s_bn + rs[None, :],
                         mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(bv * tv[None, :], axis=1)
        scale = tl.load(scale_ptr + slot).to(tl.float32)
        o = tl.load(out_ptr + tok * s_o + col0 + ns, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok * s_o + col0 + ns, (o + acc * scale).to(out_ptr.dtype.element_ty), mask=nmask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [L, R, K], slots [T] int32 (-1: none) -> t [T, R] fp32."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    R = a.shape[1]
    t = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if T and R:
        block_r = min(64, triton.next_power_of_2(R))
        block_k = min(128, triton.next_power_of_2(K))
        _lora_shrink_kernel[(T, triton.cdiv(R, block_r))](x, a, slots, t, K, R, x.stride(0), a.stride(0),
                                                          a.stride(1), t.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    return t


def lora_expand_triton(out: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       scales: torch.Tensor, col0: int, r0: int) -> None:
    """out[:, col0:col0 + N] += scales[slot] * (t[:, r0:r0 + R] @ b[slot]^T) per token, in place; b [L, N, R]."""
    T = out.shape[0]
    N, R = b.shape[1], b.shape[2]
    if T and N and R:
        block_n = min(128, triton.next_power_of_2(N))
        block_r = min(64, triton.next_power_of_2(R))
        _lora_expand_kernel[(T, triton.cdiv(N, block_n))](t, b, slots, scales, out, N, R, t.stride(0), b.stride(0),
                                                          b.stride(1), out.stride(0), col0, r0,
                                                          BLOCK_N=block_n, BLOCK_R=block_r)
