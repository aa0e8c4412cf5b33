"""Mixture-of-experts feed-forward: route each token to its top-k experts, run each chosen expert's SwiGLU MLP on
the tokens routed to it, and add the outputs weighted by the router's scores.

`route` turns router logits into (weights, expert ids) as Mixtral, Qwen2-MoE and Qwen3-MoE do. `fused_moe` runs the
experts: on a GPU (or with TRELLM_FORCE_TRITON) the two grouped GEMMs of kernels/triton_moe.py over tokens sorted by
expert; elsewhere a loop over only the experts the step hits, each on its tokens gathered into one block, through
the same `linear` (C++ operators, oneDNN, INT8) and `silu_and_mul` as the dense layers. The reference, a plain torch
loop over experts, is the tests' oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm_kernels.activation import silu_and_mul, silu_and_mul_reference
from trellm_kernels.dispatch import use_triton
from trellm_kernels.linear import Weight, linear


@dataclass
class Experts:
    """One layer's experts. `gate_up[e]` is expert e's [gate; up] rows [2 * I, H] and `down[e]` its [H, I], each
    prepared for `linear`; or, for the Triton kernel, `stacked` = (w13 [E, 2 * I, H], w2 [E, H, I]) in the
    activations' dtype. One of the two forms is kept, never both."""
    gate_up: list[Weight]
    down: list[Weight]
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up) if self.stacked is None else self.stacked[0].shape[0]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]): the softmax over all
    experts (in float32), its top-k, divided by their sum with `renormalize` (Mixtral always; Qwen with
    norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2 * I, H]; w2 [E, H, I]; weights, ids [T, k] -> [T, H] in x's dtype. Expert by expert,
    in ascending order, each weighted output added to its token's row (transformers' order)."""
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        y = silu_and_mul_reference(x[tokens] @ w13[e].T) @ w2[e].T
        out.index_add_(0, tokens, y.to(out.dtype) * weights[tokens, slots, None].to(out.dtype))
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The layer's experts on x [T, H] routed by (weights, ids) [T, k] -> [T, H] in x's dtype."""
    if experts.stacked is not None:
        from trellm_kernels.triton_moe import fused_moe_triton
        return fused_moe_triton(x, *experts.stacked, weights, ids)
    return _grouped_by_expert(x, experts, weights, ids)


def _grouped_by_expert(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert, each expert's rows one contiguous block through its two linears;
    experts no token chose are not touched. The weighted rows are added back per token in expert order."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    rows = x[tokens]
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=experts.num_experts).tolist()):
        if n:
            block = rows[start:start + n]
            out_rows[start:start + n] = linear(silu_and_mul(linear(block, experts.gate_up[e])), experts.down[e])
            start += n
    scaled = out_rows.to(torch.float32) * weights.reshape(-1)[order, None]
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, scaled).to(x.dtype)


def use_stacked_experts(device: torch.device) -> bool:
    """Whether a model on `device` keeps its experts stacked for the Triton kernel."""
    return use_triton(torch.empty(0, device=device))
