"""Turn a batch of logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

All rows are handled as one tensor. Random rows use the exponential-race trick (argmax of p / Exp(1) noise,
equivalent to drawing from p); a seeded request draws its noise row from its own generator, so its output does
not depend on which other requests share the batch.
"""
from __future__ import annotations

import torch

from trellm_backend.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] (int64, on CPU)."""
    greedy_ids = logits.argmax(dim=-1)
    temps = [r.params.temperature for r in requests]
    if all(t == 0.0 for t in temps):
        return greedy_ids.cpu()
    device = logits.device
    temp = torch.tensor([t if t > 0 else 1.0 for t in temps], device=device, dtype=torch.float32)
    logits = logits / temp[:, None]

    top_k = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))

    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(requests) if r.generator is not None]
    if len(seeded) < len(requests):
        noise.exponential_()
    for i in seeded:
        # Drawn on CPU from the request's own generator: reproducible on any device and in any batch.
        noise[i] = torch.empty(probs.shape[1]).exponential_(generator=requests[i].generator).to(device)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0.0 for t in temps], device=device)
    return torch.where(is_greedy, greedy_ids, sampled).cpu()


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass strictly above each token
    drop |= before >= p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
