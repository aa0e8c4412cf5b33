"""How a checkpoint splits across the ranks of a tensor-parallel group (Megatron's split, as vLLM makes it).

Each rank holds 1/N of every layer:
- q/k/v and gate/up by their outputs (whole heads; whole rows of the MLP), o and down by their inputs, so each rank's
  o and down give partial sums that an all-reduce adds (their biases are added by rank 0 alone);
- a mixture of experts' every expert, and Qwen2-MoE's shared expert, as a dense MLP (each rank holds 1/N of every
  expert: all ranks route every token alike, from the whole router they each hold);
- K/V heads split as the query heads are; with fewer K/V heads than ranks, each rank keeps the one its query heads
  read (ranks share it);
- the embeddings and the LM head by vocabulary rows, padded to equal shares: a rank looks up the tokens of its rows
  (the others' rows are zero, and the all-reduce adds them), and its logits are gathered.
Norms, q/k norms and rope stay whole on every rank. The split is made on the checkpoint's float tensors, before
`Checkpoint` prepares them, so INT8/INT4/W8A8 quantize each rank's share as they would the whole.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from trellm_backend.models.config import ModelConfig, ModelConfigError
from trellm_backend.models.gguf import gguf_file_of


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: which heads, MLP rows and vocabulary rows it holds."""
    rank: int
    world: int
    num_heads: int       # query heads held
    num_kv_heads: int    # K/V heads held
    first_kv_head: int
    intermediate: int    # MLP rows held
    vocab: int           # the model's vocabulary
    vocab_rows: int      # vocabulary rows held, padded: every rank holds as many

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ModelConfigError naming what keeps `cfg` from splitting `world` ways."""
    cfg_file = os.path.join(cfg.path, "config.json")
    if world == 1:
        return
    if cfg.quant is not None:
        raise ModelConfigError(f"{cfg_file}: tensor_parallel_size={world}: {cfg.quant.method} checkpoints are not "
                               "split across ranks yet; serve a float checkpoint with quantization=int4 instead")
    if gguf_file_of(cfg.path) is not None:
        raise ModelConfigError(f"{cfg.path}: tensor_parallel_size={world}: GGUF files are not split across ranks "
                               "yet; serve it with tensor_parallel_size 1")
    if cfg.num_heads % world:
        raise ModelConfigError(f"{cfg_file}: tensor_parallel_size={world} must divide num_attention_heads="
                               f"{cfg.num_heads}")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        raise ModelConfigError(f"{cfg_file}: tensor_parallel_size={world} must divide num_key_value_heads="
                               f"{cfg.num_kv_heads} or be a multiple of it")
    sizes = {"intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        sizes["moe_intermediate_size (each expert's)"] = cfg.moe.intermediate_size
        if cfg.moe.shared_intermediate_size:
            sizes["shared_expert_intermediate_size"] = cfg.moe.shared_intermediate_size
    for key, size in sizes.items():
        if size % world:
            raise ModelConfigError(f"{cfg_file}: tensor_parallel_size={world} must divide {key}={size}")


def shard_of(cfg: ModelConfig, rank: int, world: int) -> Shard:
    check_shardable(cfg, world)
    if cfg.num_kv_heads % world == 0:
        kv, first_kv = cfg.num_kv_heads // world, rank * cfg.num_kv_heads // world
    else:   # fewer K/V heads than ranks: world // num_kv_heads ranks share each
        kv, first_kv = 1, rank // (world // cfg.num_kv_heads)
    return Shard(rank, world, cfg.num_heads // world, kv, first_kv, cfg.intermediate_size // world,
                 cfg.vocab_size, -(-cfg.vocab_size // world))


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The model as one rank holds it: its heads, MLP rows and vocabulary rows."""
    moe = cfg.moe and replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // shard.world,
                              shared_intermediate_size=cfg.moe.shared_intermediate_size // shard.world)
    return replace(cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                   intermediate_size=shard.intermediate, vocab_size=shard.vocab_rows, moe=moe)


def splits_inputs(name: str) -> bool:
    """Whether the checkpoint's tensor `name` is a weight split by its inputs (o, down, Mixtral's w2)."""
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in ("o_proj", "down_proj", "w2")


def shard_tensor(cfg: ModelConfig, s: Shard, name: str, t) -> torch.Tensor:
    """Rank `s`'s share of the checkpoint's tensor `name`. `t`: the tensor, or safetensors' slice of it (read only
    where it is indexed, so a rank reads its share of the file, not the whole)."""
    d = cfg.head_dim
    q_rows = (s.rank * s.num_heads * d, s.num_heads * d)
    kv_rows = (s.first_kv_head * d, s.num_kv_heads * d)
    mlp_size = cfg.intermediate_size   # this MLP's rows: a dense layer's, an expert's or the shared expert's
    if ".experts." in name:
        mlp_size = cfg.moe.intermediate_size
    elif ".shared_expert." in name:
        mlp_size = cfg.moe.shared_intermediate_size
    mlp_rows = (s.rank * mlp_size // s.world, mlp_size // s.world)
    q_total, kv_total = cfg.num_heads * d, cfg.num_kv_heads * d
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""

    def rows(*picks):   # (start, count) runs of rows, joined (several: each part of a merged tensor)
        return torch.cat([t[start:start + n] for start, n in picks])
    if leaf == "q_proj":
        return rows(q_rows)
    if leaf in ("k_proj", "v_proj"):
        return rows(kv_rows)
    if leaf == "qkv_proj":   # Phi-3: q, k and v stored one after the other
        return rows(q_rows, (q_total + kv_rows[0], kv_rows[1]), (q_total + kv_total + kv_rows[0], kv_rows[1]))
    if leaf in ("gate_proj", "up_proj", "w1", "w3"):   # w1, w3, w2: Mixtral's experts' gate, up and down
        return rows(mlp_rows)
    if leaf == "gate_up_proj":   # Phi-3: gate, then up
        return rows(mlp_rows, (mlp_size + mlp_rows[0], mlp_rows[1]))
    if leaf in ("o_proj", "down_proj", "w2"):
        if name.endswith(".bias"):   # added once, after the partial sums meet
            return t[:] if s.rank == 0 else torch.zeros_like(t[:])
        start, n = q_rows if leaf == "o_proj" else mlp_rows
        return t[:, start:start + n]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = t[s.vocab_start:min(s.vocab_start + s.vocab_rows, s.vocab)]
        return torch.cat([part, part.new_zeros(s.vocab_rows - part.shape[0], *part.shape[1:])])
    return t[:]
