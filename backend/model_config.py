"""What the engine needs to know about a Hugging Face Llama-family folder, read from its config files.

One function, `load_model_config`, turns `config.json` (and `generation_config.json`) into a plain dataclass and
fails with a message naming the file and the value when something is outside what the engine supports.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelConfigError(ValueError):
    """A model folder the engine cannot serve; the message names the file and the value at fault."""


@dataclass
class ModelConfig:
    path: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict | None
    partial_rotary_factor: float
    sliding_window: int | None
    torch_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:   # the Python-backend stub may run under an ASCII locale
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from None


def load_model_config(path: str) -> ModelConfig:
    """Parse `path/config.json` (+ `generation_config.json` when present) of a Llama/Mistral/Qwen2/Qwen3 folder."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelConfigError(f"{cfg_file}: missing; the model folder must be a Hugging Face model folder")
    c = _read_json(cfg_file)
    archs = c.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ModelConfigError(
            f"{cfg_file}: architectures={archs} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{cfg_file}: hidden_act={act!r} is not supported (only 'silu')")

    num_heads = int(c["num_attention_heads"])
    num_kv_heads = int(c.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"{cfg_file}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    head_dim = int(c.get("head_dim") or c["hidden_size"] // num_heads)

    # transformers 5 writes rope settings as `rope_parameters` (theta inside); older folders use rope_theta and
    # rope_scaling. Read both.
    rope_params = dict(c.get("rope_parameters") or {})
    rope_theta = float(rope_params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    rope_scaling = c.get("rope_scaling") or (rope_params or None)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope_scaling["rope_type"] = rope_type
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ModelConfigError(
                f"{cfg_file}: rope_scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")
        if rope_type == "default":
            rope_scaling = None
    partial = float(rope_params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))

    dtype_name = c.get("dtype") or c.get("torch_dtype") or "float32"
    if dtype_name not in DTYPES:
        raise ModelConfigError(f"{cfg_file}: dtype {dtype_name!r} is not supported ({sorted(DTYPES)})")

    sliding = c.get("sliding_window")
    if family == "qwen2" and not c.get("use_sliding_window", False):
        sliding = None

    eos = _as_list(c.get("eos_token_id"))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        for i in _as_list(_read_json(gen_file).get("eos_token_id")):
            if i not in eos:
                eos.append(i)

    attention_bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        path=path,
        family=family,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama, Mistral and Qwen3 have them (and o_proj's) with attention_bias.
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial,
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=DTYPES[dtype_name],
        eos_token_ids=eos,
    )


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (fp32) and the cos/sin scale, following transformers' rope types."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq, 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old_ctx = float(s.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    factor = float(s["factor"])
    old_ctx = float(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rot):
        return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_extra, inv_inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq, float(attention_factor)


def cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos of each position's angles, then sin."""
    inv_freq, scale = rope_inv_freq(cfg)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
