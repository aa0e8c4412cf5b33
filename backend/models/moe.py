"""The sparse feed-forward of Mixtral, Qwen2-MoE and Qwen3-MoE layers: a router, the experts, and Qwen2-MoE's shared
expert. Weights are read from the checkpoint's per-expert names; the arithmetic is kernels/moe.py's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm_backend.models.config import ModelConfig, ModelConfigError
from trellm_backend.models.weights import Checkpoint
from trellm_kernels.activation import silu_and_mul
from trellm_kernels.linear import Weight, linear
from trellm_kernels.moe import Experts, fused_moe, route, use_stacked_experts

# Where each family keeps a layer's router and experts, and each expert's gate, up and down projections.
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp.gate", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
}


@dataclass
class SharedExpert:
    """Qwen2-MoE: a dense SwiGLU MLP every token goes through, scaled by sigmoid(x . gate)."""
    gate_up: Weight
    down: Weight
    gate: torch.Tensor          # [1, H]


@dataclass
class SparseMlp:
    router: torch.Tensor        # [E, H], in the activations' dtype (a small GEMM; its softmax runs in float32)
    experts: Experts
    top_k: int
    renormalize: bool
    shared: SharedExpert | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x @ self.router.T, self.top_k, self.renormalize)
        out = fused_moe(x, self.experts, weights, ids)
        if self.shared is not None:
            s = self.shared
            out = out + torch.sigmoid(x @ s.gate.T) * linear(silu_and_mul(linear(x, s.gate_up)), s.down)
        return out


def load_sparse_mlp(ck: Checkpoint, cfg: ModelConfig, layer_prefix: str) -> SparseMlp:
    """Layer `layer_prefix`'s router and experts, stacked for the Triton kernel on a GPU, or each expert's linears
    prepared for `linear` (INT8 included) elsewhere."""
    moe = cfg.moe
    router_name, expert_prefix, (gate, up, down) = EXPERT_NAMES[cfg.family]
    router = ck.take(layer_prefix + router_name + ".weight")
    if router.shape != (moe.num_experts, cfg.hidden_size):
        raise ModelConfigError(f"{cfg.path}: {layer_prefix}{router_name}.weight has shape {tuple(router.shape)}, "
                               f"config.json says {moe.num_experts} experts of hidden_size={cfg.hidden_size}")
    names = [layer_prefix + expert_prefix.format(e) for e in range(moe.num_experts)]
    if use_stacked_experts(ck.device):
        if ck.quantization != "none":
            raise ModelConfigError(f"{cfg.path}: quantization={ck.quantization!r} on the experts of a {cfg.family} "
                                   "model runs on the CPU only; on a GPU the experts keep the model's dtype")
        w13 = torch.stack([ck.stacked(n + gate + ".weight", n + up + ".weight") for n in names])
        w2 = torch.stack([ck.take(n + down + ".weight") for n in names])
        experts = Experts([], [], (w13.contiguous(), w2.contiguous()))
    else:
        experts = Experts([ck.linear(n + gate, n + up) for n in names], [ck.linear(n + down) for n in names])
    shared = None
    if moe.shared_intermediate_size:
        p = layer_prefix + "mlp.shared_expert."
        shared = SharedExpert(ck.linear(p + "gate_proj", p + "up_proj"), ck.linear(p + "down_proj"),
                              ck.take(layer_prefix + "mlp.shared_expert_gate.weight"))
    return SparseMlp(router, experts, moe.top_k, moe.renormalize, shared)
