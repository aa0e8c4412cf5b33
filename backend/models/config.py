"""What the engine needs to know about a Hugging Face Llama-family folder, read from its config files.

One function, `load_model_config`, turns `config.json` (and `generation_config.json`) into a plain dataclass and
fails with a message naming the file and the value when something is outside what the engine supports.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trellm_kernels.formats import GROUP_SIZES

if TYPE_CHECKING:
    import torch


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
LAYER_TYPES = ("sliding_attention", "full_attention")


class ModelConfigError(ValueError):
    """A model folder the engine cannot serve; the message names the file and the value at fault."""


QUANT_METHODS = ("gptq", "awq")


@dataclass(frozen=True)
class QuantFormat:
    method: str            # gptq or awq
    group_size: int
    desc_act: bool = False
    sym: bool = False
    zero_offset: int = 0   # added to a stored zero: 1 for GPTQ's original layout


def parse_quantization_config(qc, cfg_file: str) -> QuantFormat | None:
    """config.json's quantization_config -> QuantFormat, None when the checkpoint is not pre-quantized.
    Raises ModelConfigError naming `cfg_file` and the value for what the engine cannot read."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelConfigError(f"{cfg_file}: quantization_config must be an object, not {qc!r}")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ModelConfigError(f"{cfg_file}: quantization_config.quant_method={method!r} is not supported "
                               f"(supported: {', '.join(QUANT_METHODS)})")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelConfigError(f"{cfg_file}: quantization_config.bits={bits!r} is not supported ({method}: 4 only)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise ModelConfigError(f"{cfg_file}: quantization_config.group_size={group!r} is not supported "
                               f"(one of {', '.join(map(str, GROUP_SIZES))})")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelConfigError(f"{cfg_file}: quantization_config.version={qc.get('version')!r} is not supported "
                                   "(awq: gemm; gemv packs another layout)")
        if qc.get("zero_point", True) is not True:
            raise ModelConfigError(f"{cfg_file}: quantization_config.zero_point={qc.get('zero_point')!r} is not "
                                   "supported (awq: true)")
        return QuantFormat("awq", group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelConfigError(f"{cfg_file}: quantization_config.checkpoint_format={fmt!r} is not supported "
                               "(gptq, gptq_v2)")
    if qc.get("lm_head", False):
        raise ModelConfigError(f"{cfg_file}: quantization_config.lm_head=true is not supported (a float LM head)")
    for key in ("desc_act", "sym"):
        if not isinstance(qc.get(key, False), bool):
            raise ModelConfigError(f"{cfg_file}: quantization_config.{key}={qc.get(key)!r} is not a boolean")
    return QuantFormat("gptq", group, desc_act=qc.get("desc_act", False), sym=qc.get("sym", False),
                       zero_offset=1 if fmt == "gptq" else 0)


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward (kernels/moe.py): which layers have it, and its router."""
    num_experts: int
    top_k: int
    intermediate_size: int          # each expert's
    renormalize: bool               # the top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    shared_intermediate_size: int = 0   # Qwen2-MoE's shared expert, gated by a sigmoid; 0: none
    sparse_step: int = 1            # every sparse_step-th layer is sparse ...
    dense_layers: tuple[int, ...] = ()  # ... except these (Qwen's mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def positive(value, key: str, cfg_file: str, integer: bool = True):
    """`value` of config.json's `key` when it is a positive integer (or, without `integer`, number); else an error
    naming the file, the key and the value."""
    kinds = int if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{cfg_file}: {key}={value!r} must be " +
                               ("an integer >= 1" if integer else "a positive number"))
    return value


def parse_moe(c: dict, family: str, num_layers: int, cfg_file: str) -> MoeConfig:
    """config.json's expert settings for a MoE family, each checked and named when out of range."""
    def setting(key: str, default=None) -> int:
        return positive(c.get(key, default), key, cfg_file)

    if family == "mixtral":
        num_experts, size, renormalize = setting("num_local_experts"), setting("intermediate_size"), True
        shared, step, dense = 0, 1, ()
    else:
        # Qwen's folders say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts
        num_experts = setting("num_experts" if "num_experts" in c else "num_local_experts")
        size = setting("moe_intermediate_size")
        renormalize = c.get("norm_topk_prob", False)
        if not isinstance(renormalize, bool):
            raise ModelConfigError(f"{cfg_file}: norm_topk_prob={renormalize!r} must be true or false")
        shared = setting("shared_expert_intermediate_size") if family == "qwen2_moe" else 0
        step = setting("decoder_sparse_step", 1)
        dense = c.get("mlp_only_layers") or []
        if not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
            raise ModelConfigError(f"{cfg_file}: mlp_only_layers={dense!r} must list layer indices in "
                                   f"[0, {num_layers})")
    top_k = setting("num_experts_per_tok")
    if top_k > num_experts:
        raise ModelConfigError(f"{cfg_file}: num_experts_per_tok={top_k} is more than the {num_experts} experts")
    return MoeConfig(num_experts, top_k, size, renormalize, shared, step, tuple(sorted(set(dense))))


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma 2 and Gemma 3's text model do beyond the Llama forward: norms of weight (1 + w) around both halves
    of each layer, embeddings scaled by sqrt(hidden), GELU-tanh, their own attention scale, sliding layers (with
    their own rope base in Gemma 3), and optional tanh caps on the attention scores and the logits."""
    layer_types: tuple[str, ...]          # "sliding_attention" or "full_attention", one per layer
    local_rope_theta: float               # the sliding layers' rope base (default rope); the full layers' is rope_theta
    attention_scale: float                # query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None


def parse_layer_types(c: dict, num_layers: int, default: list[str], cfg_file: str) -> tuple[str, ...]:
    """config.json's layer_types (else `default`), checked: one of LAYER_TYPES per layer."""
    types = c.get("layer_types") or default
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise ModelConfigError(f"{cfg_file}: layer_types={types!r} must name sliding_attention or full_attention for "
                               f"each of the {num_layers} layers")
    return tuple(types)


# transformers' defaults where config.json leaves a Gemma key out
GEMMA_DEFAULTS = {"gemma2": dict(pattern=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                  "gemma3": dict(pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None)}


def parse_gemma(c: dict, family: str, num_layers: int, cfg_file: str) -> tuple[GemmaConfig, dict]:
    """Gemma 2 or 3's settings, and the full-attention layers' rope settings for the common reading (Gemma 3 in
    transformers 5 keeps one rope dict per layer type; older Gemma 3 folders keep rope_theta, rope_scaling and
    rope_local_base_freq; Gemma 2 has one rope for all layers)."""
    defaults = GEMMA_DEFAULTS[family]
    if c.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{cfg_file}: use_bidirectional_attention={c['use_bidirectional_attention']!r} is "
                               "not supported (a causal language model only)")
    pattern = int(c.get("sliding_window_pattern", defaults["pattern"]))
    types = parse_layer_types(c, num_layers, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                              for i in range(num_layers)], cfg_file)
    per_type = c.get("rope_parameters") or {}
    if "full_attention" in per_type or "sliding_attention" in per_type:
        local = dict(per_type.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ModelConfigError(f"{cfg_file}: rope_parameters.sliding_attention.rope_type="
                                   f"{local['rope_type']!r} is not supported (default)")
        local_theta = float(local.get("rope_theta", 10000.0))
        full = {"rope_parameters": dict(per_type.get("full_attention") or {})}
    else:
        full = {k: c[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in c}
        shared_theta = per_type.get("rope_theta", c.get("rope_theta", 10000.0))
        local_theta = float(c.get("rope_local_base_freq", 10000.0) if family == "gemma3" else shared_theta)
    scalar = positive(c.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar", cfg_file, integer=False)
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = c.get(key, defaults[key])
        caps[key] = None if cap is None else float(positive(cap, key, cfg_file, integer=False))
    return GemmaConfig(types, local_theta, float(scalar) ** -0.5, **caps), full


def layer_windows(c: dict, family: str, num_layers: int, window: int | None, gemma: GemmaConfig | None,
                  cfg_file: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads the family: Gemma's and Qwen2/3's
    layer_types (Qwen's defaults from max_window_layers), every layer for the others."""
    if not window:
        return (0,) * num_layers
    if gemma is not None:
        types = gemma.layer_types
    elif family in ("qwen2", "qwen3", "qwen2_moe"):
        first = int(c.get("max_window_layers", 28))
        default = [("sliding_attention" if (i >= first if family != "qwen2_moe" else (i + 1) % 2 and i < first)
                    else "full_attention") for i in range(num_layers)]
        types = parse_layer_types(c, num_layers, default, cfg_file)
    else:
        types = ("sliding_attention",) * num_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


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
    dtype: str                                      # config.json's: one of DTYPES
    eos_token_ids: list[int] = field(default_factory=list)
    quant: QuantFormat | None = None   # a GPTQ/AWQ checkpoint: config.json's quantization_config
    moe: MoeConfig | None = None       # a mixture-of-experts family's experts and router
    gemma: GemmaConfig | None = None   # Gemma 2 and 3's differences from the Llama forward
    layer_windows: tuple[int, ...] = ()   # each layer's sliding window, 0 for full attention

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch   # here, not at the top: preprocess reads a model's config without loading torch
        return getattr(torch, self.dtype)


DTYPES = ("float32", "float16", "bfloat16")   # torch's names
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def check_longrope(scaling: dict, c: dict, half_rotary: int, cfg_file: str) -> dict:
    """Phi-3's longrope: a short and a long factor per rotary frequency, and the pretraining length past which a
    sequence uses the long ones (in the rope settings, or, in older folders, at the top level)."""
    orig = positive(scaling.get("original_max_position_embeddings", c.get("original_max_position_embeddings")),
                    "original_max_position_embeddings", cfg_file)
    for key in ("short_factor", "long_factor"):
        f = scaling.get(key)
        if not isinstance(f, list) or len(f) != half_rotary or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in f):
            raise ModelConfigError(f"{cfg_file}: rope_scaling.{key} must list {half_rotary} positive numbers (one per "
                                   f"rotary frequency), got {f!r}")
    return {**scaling, "original_max_position_embeddings": orig}


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
    """Parse `path/config.json` (+ `generation_config.json` when present) of a folder of one of
    SUPPORTED_ARCHITECTURES."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelConfigError(f"{cfg_file}: missing; the model folder must be a Hugging Face model folder")
    c = _read_json(cfg_file)
    archs = c.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ModelConfigError(
            f"{cfg_file}: architectures={archs} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    gemma_family = family in GEMMA_FAMILIES
    act_key, want_act = ("hidden_activation", "gelu_pytorch_tanh") if gemma_family else ("hidden_act", "silu")
    act = c.get(act_key, want_act)
    if act != want_act:
        raise ModelConfigError(f"{cfg_file}: {act_key}={act!r} is not supported (only {want_act!r})")
    gemma = None
    if family in GEMMA_FAMILIES:
        gemma, rope_source = parse_gemma(c, family, int(c["num_hidden_layers"]), cfg_file)
        c = {**{k: v for k, v in c.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling")},
             **rope_source}

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
        if rope_type == "su":    # Phi-3's first name for longrope
            rope_type = rope_scaling["rope_type"] = "longrope"
        if rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"{cfg_file}: rope_scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        if rope_type == "default":
            rope_scaling = None
    partial = float(rope_params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
        head_dim_ = int(c.get("head_dim") or c["hidden_size"] // int(c["num_attention_heads"]))
        rope_scaling = check_longrope(rope_scaling, c, int(head_dim_ * partial) // 2, cfg_file)

    dtype_name = c.get("dtype") or c.get("torch_dtype") or "float32"
    if dtype_name not in DTYPES:
        raise ModelConfigError(f"{cfg_file}: dtype {dtype_name!r} is not supported ({sorted(DTYPES)})")

    sliding = c.get("sliding_window", 4096 if family in GEMMA_FAMILIES else None)   # transformers' defaults
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not c.get("use_sliding_window", False):
        sliding = None
    if sliding is not None:
        sliding = positive(sliding, "sliding_window", cfg_file)

    eos = _as_list(c.get("eos_token_id"))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        for i in _as_list(_read_json(gen_file).get("eos_token_id")):
            if i not in eos:
                eos.append(i)

    attention_bias = bool(c.get("attention_bias", False))
    quant = parse_quantization_config(c.get("quantization_config"), cfg_file)
    num_layers = int(c["num_hidden_layers"])
    moe = parse_moe(c, family, num_layers, cfg_file) if family in MOE_FAMILIES else None
    if moe is not None and quant is not None:
        raise ModelConfigError(f"{cfg_file}: quantization_config with experts ({family}) is not supported: a "
                               "GPTQ/AWQ mixture-of-experts checkpoint cannot be read yet")
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(c.get("qkv_bias", True))}.get(family, attention_bias)
    return ModelConfig(
        path=path,
        family=family,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", family in GEMMA_FAMILIES)),   # transformers' defaults
        # Qwen2 always has q/k/v biases (Qwen2-MoE unless qkv_bias is false); the others have them, and o_proj's,
        # with attention_bias.
        qkv_bias=qkv_bias,
        o_bias=family not in ("qwen2", "qwen2_moe") and attention_bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial,
        dtype=dtype_name,
        eos_token_ids=eos,
        quant=quant,
        moe=moe,
        gemma=gemma,
        layer_windows=layer_windows(c, family, num_layers, sliding, gemma, cfg_file),
    )
