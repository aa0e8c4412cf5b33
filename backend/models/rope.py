"""Rotary position embeddings: the inverse frequencies of each rope type (transformers' formulas) and the cos/sin
table the attention layers index by position."""
from __future__ import annotations

import math

import torch

from trellm_backend.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (fp32) and the cos/sin scale, following transformers' rope types."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    inv_freq = default_inv_freq(dim, base)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq, 1.0
    kind = s["rope_type"]
    if kind == "longrope":
        return _longrope_inv_freq(cfg, "short_factor")
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, s), 1.0
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


def llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3's scaling of the default frequencies: the low ones divided by `factor`, the high ones kept, a smooth
    blend between (wavelengths measured against the pretraining length)."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """The unscaled inverse frequencies [rotary_dim/2] (fp32), as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _longrope_inv_freq(cfg: ModelConfig, which: str) -> tuple[torch.Tensor, float]:
    """Longrope's frequencies with its short or long factors, and the attention factor both share."""
    s, dim = cfg.rope_scaling, cfg.rotary_dim
    orig = s["original_max_position_embeddings"]
    factor = float(s.get("factor") or cfg.max_position_embeddings / orig)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = longrope_attention_factor(factor, orig)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(s[which], dtype=torch.float32) * cfg.rope_theta ** shape), float(attention_factor)


def longrope_attention_factor(factor: float, pretraining_length: int) -> float:
    """Longrope's cos/sin scale when a setting does not give it: grows with the context's stretch `factor`."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(pretraining_length))


def long_rope_from(cfg: ModelConfig) -> int | None:
    """For longrope, the sequence length past which a token's rotation uses the long factors (transformers' rule:
    the longest position of the forward that computes it, so a whole prompt longer than this, and each later
    token past it); None for the other rope types."""
    s = cfg.rope_scaling
    return s["original_max_position_embeddings"] if s is not None and s["rope_type"] == "longrope" else None


def cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos of each position's angles, then sin. For longrope, the table of the
    short factors and then the long factors' ([2 * max_positions, rotary_dim]): a token's row is its position, plus
    max_positions where it takes the long ones."""
    tables = [rope_inv_freq(cfg)]
    if long_rope_from(cfg) is not None:
        tables.append(_longrope_inv_freq(cfg, "long_factor"))
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    return torch.cat([torch.cat(((positions * f).cos() * scale, (positions * f).sin() * scale), dim=-1)
                      for f, scale in tables])
