"""The fused mixture-of-experts feed-forward in Triton: two grouped GEMMs over (token, slot) pairs sorted by expert.

`align_by_expert` sorts the T * k pairs by expert and pads each expert's run to a multiple of BLOCK_M, so every
block of BLOCK_M sorted pairs belongs to one expert (`block_experts`; -1 past the last run). One kernel serves both
GEMMs: a program takes one such block and BLOCK_N output columns, gathers its rows of A (x by token for gate/up, the
activations by pair for down), reads its expert's weight tile, and writes each row back at its pair's index. The
down GEMM multiplies each row by its routing weight before the store, so what is left is the sum over the k slots
of each token. Sorting and padding are tensor operations with no host synchronisation (the padded length is bounded
by T * k + E * (BLOCK_M - 1)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from trellm_kernels.activation import silu_and_mul


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, weights_ptr, N, K, num_pairs,
                     s_am, s_we, s_wn, s_om, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                     MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        if A_BY_TOKEN:
            a_row = pair // TOP_K
        else:
            a_row = pair
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * s_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + a_row[:, None].to(tl.int64) * s_am + kk[None, :],
                        mask=valid[:, None] & (kk[None, :] < K), other=0.0)
            w = tl.load(w_base + rn[None, :].to(tl.int64) * s_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PREC)
            else:
                acc += tl.dot(a, w, input_precision=PREC)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (rn[None, :] < N))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [P]: pair indices t * k + j sorted by expert, each expert's run padded to a multiple of
    block_m with T * k; block_experts [P / block_m]: each block's expert, -1 for blocks past the last run)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    size = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    pairs[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return pairs, block_experts


def _grouped_gemm(a, w, out, pairs, block_experts, weights, top_k, by_token, mul_weight, block_m):
    N, K = w.shape[1], w.shape[2]
    BLOCK_N, BLOCK_K = 64, 32
    grid = (block_experts.numel(), triton.cdiv(N, BLOCK_N))
    prec = "ieee" if a.dtype == torch.float32 else "tf32"
    upcast = a.dtype == torch.bfloat16 and not isinstance(_moe_gemm_kernel, triton.runtime.JITFunction)
    _moe_gemm_kernel[grid](a, w, out, pairs, block_experts, weights, N, K, out.shape[0], a.stride(0), w.stride(0),
                           w.stride(1), out.stride(0), TOP_K=top_k, A_BY_TOKEN=by_token, MUL_WEIGHT=mul_weight,
                           BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PREC=prec, UPCAST=upcast)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2 * I, H]; w2 [E, H, I] (contiguous, x's dtype); weights float32, ids [T, k] -> [T, H]."""
    T, k = ids.shape
    x = x.contiguous()
    block_m = 16 if T * k <= 64 else 64
    pairs, block_experts = align_by_expert(ids, w13.shape[0], block_m)
    gate_up = torch.empty((T * k, w13.shape[1]), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(x, w13, gate_up, pairs, block_experts, flat_weights, k, True, False, block_m)
    act = silu_and_mul(gate_up)
    down = torch.empty((T * k, w2.shape[1]), dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, pairs, block_experts, flat_weights, k, False, True, block_m)
    return down.view(T, k, -1).sum(dim=1).to(x.dtype)
