"""GGUF checkpoints (llama.cpp's single-file format, which Ollama and LM Studio use too): the hyperparameters, the
tokenizer and the tensors of one `.gguf` file, read as the engine reads a Hugging Face folder.

A GGUF model is served from a folder holding the file. `write_hf_files` derives config.json,
generation_config.json and the tokenizer files from the file's metadata and writes them beside it, so every entry
point (preprocess, vllm_model, the OpenAI door, the checks) reads one kind of folder; only the weights come from
the GGUF file itself (`GgufState`). config.json names the file (`gguf_file`), which is how a folder is known to
be one.

What is read, per GGUF architecture (general.architecture): llama (Llama, Mistral, and Mixtral when it has
experts), qwen2, qwen3, phi3, gemma2, gemma3, qwen2moe, qwen3moe. Every `<arch>.*` key is either mapped to a
config.json key (ARCH_KEYS) or refused by name, as is a tensor or tensor type the engine does not read; nothing
in the file is ignored except descriptive `general.*` and `quantize.*` entries.

llama.cpp's conventions are undone here: Llama's q/k rows are stored in rotary-pair order (convert_hf_to_gguf's
permute), Gemma's norms as 1 + w, experts stacked in one tensor per projection, and shapes listed innermost first.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from trellm_backend.models.config import ModelConfigError

log = logging.getLogger(__name__)

# GGML tensor types the engine reads: kept as stored where a kernel reads the format, else dequantized at load
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# GGUF architecture -> (architectures of config.json, model_type); llama becomes Mixtral with experts and Mistral
# with a sliding window
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# `<arch>.KEY` -> config.json key, for every architecture (None: read with another key, see hf_config)
COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.value_length": None,
    "rope.dimension_count": None,
    "rope.freq_base": None,
    "rope.scaling.type": None,
    "rope.scaling.factor": None,
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}
ARCH_KEYS = {
    "llama": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"rope.scaling.attn_factor": None, "rope.scaling.original_context_length": None},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window_pattern": None, "final_logit_softcapping": "final_logit_softcapping"},
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
}
ROPE_SCALING_TYPES = ("none", "linear")
# Rope settings llama.cpp keeps as tensors (read into config.json by rope_from_tensors), and the architectures whose
# files carry them
ROPE_TENSORS = {"rope_freqs.weight": ("llama",), "rope_factors_long.weight": ("phi3",),
                "rope_factors_short.weight": ("phi3",)}


@dataclass
class GgufTensor:
    """One tensor of the file as stored: `data` is the file's bytes (a read-only memory map) laid out as rows of
    `shape[-1]` elements in `type_name`'s blocks; `shape` is in torch's order (outermost first)."""
    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES


# ------------------------------------------------------------------------------------------------ the file

def gguf_file_of(path: str) -> str | None:
    """The GGUF file a model folder is served from (config.json's gguf_file), else None."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file, encoding="utf-8") as f:
        name = json.load(f).get("gguf_file")
    if name is None:
        return None
    file = os.path.join(path, str(name))
    if not os.path.isfile(file):
        raise ModelConfigError(f"{cfg_file}: gguf_file={name!r} is not a file in the folder")
    return file


def read_gguf(file: str):
    """(metadata {key: value}, tensors {GGUF name: GgufTensor}) of a GGUF file; errors name the file."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(file, "r")
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        tensors = {t.name: GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data)
                   for t in reader.tensors}
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ModelConfigError(f"{file}: not a readable GGUF file ({e})") from None
    return meta, tensors


def check_gguf(file: str, meta: dict, tensors: dict[str, GgufTensor]) -> str:
    """The file's architecture, after refusing by name what the engine does not read."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(f"{file}: general.architecture={arch!r} is not supported (one of "
                               f"{', '.join(ARCHITECTURES)})")
    known = {**COMMON_KEYS, **ARCH_KEYS[arch]}
    for key in meta:
        prefix, _, rest = key.partition(".")
        if prefix in ("general", "tokenizer", "quantize"):
            continue
        if prefix == "split":
            raise ModelConfigError(f"{file}: {key}: split GGUF files are not supported (merge them with "
                                   "llama-gguf-split --merge)")
        if prefix != arch or rest not in known:
            raise ModelConfigError(f"{file}: metadata key {key} is not supported for architecture {arch} (the "
                                   f"engine reads {', '.join(sorted(arch + '.' + k for k in known))})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ROPE_SCALING_TYPES:
        raise ModelConfigError(f"{file}: {arch}.rope.scaling.type={scaling!r} is not supported "
                               f"({', '.join(ROPE_SCALING_TYPES)})")
    for name, t in tensors.items():
        if name in ROPE_TENSORS and arch not in ROPE_TENSORS[name]:
            raise ModelConfigError(f"{file}: tensor {name} (rope settings) is read for architecture "
                                   f"{'/'.join(ROPE_TENSORS[name])} only, not {arch}")
        if t.type_name not in SUPPORTED_TYPES:
            raise ModelConfigError(f"{file}: tensor {name} has type {t.type_name}, which is not supported (one of "
                                   f"{', '.join(SUPPORTED_TYPES)})")
    return arch


# ------------------------------------------------------------------------------------------------ config.json

def _float(x) -> float:
    """A float32 of the file as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(repr(np.float32(x)))


def served_dtype(tensors: dict[str, GgufTensor]) -> str:
    """config.json's dtype: the linears' float type, else bfloat16 for a quantized file."""
    types = {t.type_name for t in tensors.values() if len(t.shape) >= 2}
    floats = {FLOAT_TYPES[t] for t in types if t in FLOAT_TYPES}
    return floats.pop() if len(floats) == 1 and len(types) == 1 else "bfloat16"


def hf_config(file: str, meta: dict, tensors: dict[str, GgufTensor]) -> dict:
    """config.json of the model the file holds, from its metadata (and, where llama.cpp keeps a setting in the
    tensors only, from which tensors exist)."""
    arch = check_gguf(file, meta, tensors)

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    architecture, model_type = ARCHITECTURES[arch]
    c = {hf: get(key) for key, hf in {**COMMON_KEYS, **ARCH_KEYS[arch]}.items() if hf and get(key) is not None}
    for key in ("rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping"):
        if key in c:
            c[key] = _float(c[key])
    if isinstance(c.get("num_key_value_heads"), list):
        kv = set(c["num_key_value_heads"])
        if len(kv) != 1:
            raise ModelConfigError(f"{file}: {arch}.attention.head_count_kv={sorted(kv)} differs between layers, "
                                   "which is not supported")
        c["num_key_value_heads"] = kv.pop()
    if "vocab_size" not in c:
        c["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or [])
    layers = c.get("num_hidden_layers", 0)
    head_dim = c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    if get("attention.value_length", head_dim) != head_dim:
        raise ModelConfigError(f"{file}: {arch}.attention.value_length={get('attention.value_length')} differs from "
                               f"the key length {head_dim}, which is not supported")
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        if arch != "phi3":
            raise ModelConfigError(f"{file}: {arch}.rope.dimension_count={rotary} is not the head size {head_dim} "
                                   f"(partial rotary is read for phi3 only)")
        c["partial_rotary_factor"] = rotary / head_dim
    rope = {"rope_type": "default", "rope_theta": _float(get("rope.freq_base", 10000.0))}
    if get("rope.scaling.type", "none") == "linear":
        rope.update(rope_type="linear", factor=_float(get("rope.scaling.factor")))
    rope.update(rope_from_tensors(file, arch, meta, tensors, rope["rope_theta"], rotary))
    if rope["rope_type"] == "longrope":
        c["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if arch == "gemma3":
        c["rope_parameters"] = {"full_attention": rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):    # newer files: one flag per layer, true where the layer slides
            c["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            c["sliding_window_pattern"] = int(pattern)
    else:
        c["rope_parameters"] = rope
    names = set(tensors)
    c["tie_word_embeddings"] = "output.weight" not in names
    if arch in ("llama", "phi3", "gemma2", "gemma3"):
        c["attention_bias"] = "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names
    if arch == "llama":
        c["mlp_bias"] = "blk.0.ffn_down.bias" in names
        if "num_local_experts" in c:
            architecture, model_type = "MixtralForCausalLM", "mixtral"
        elif "sliding_window" in c:
            architecture, model_type = "MistralForCausalLM", "mistral"
    if arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe") and "sliding_window" in c:
        c["use_sliding_window"], c["max_window_layers"] = True, 0
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's attention scale: 1/sqrt(head size), but 1/sqrt(hidden / heads) in the 27B models
        big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
        c["query_pre_attn_scalar"] = c["hidden_size"] // c["num_attention_heads"] if big else head_dim
        c["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "qwen2moe":
        c["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        c["norm_topk_prob"] = False
    if arch == "qwen3moe":
        c["norm_topk_prob"] = True
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            c[hf] = int(meta[f"tokenizer.ggml.{key}"])
    return {"architectures": [architecture], "model_type": model_type, **c, "dtype": served_dtype(tensors),
            "gguf_file": os.path.basename(file)}


LLAMA3_PRETRAINING_LENGTH = 8192    # Llama 3's original_max_position_embeddings; only ratios to it are in a file


def rope_from_tensors(file: str, arch: str, meta: dict, tensors: dict[str, GgufTensor], theta: float,
                      rotary: int) -> dict:
    """The rope settings llama.cpp stores as tensors, as config.json's rope parameters (empty where there are none).

    Llama 3's scaling is `rope_freqs`: one divisor per frequency. It is read back as the llama3 rope type whose
    formula gives those divisors, so config.json stays what transformers reads; the file keeps only the band edges'
    ratios to the pretraining length, which is taken as Llama 3's own. Phi-3's longrope is its two factor lists,
    with the pretraining length and the attention factor in the metadata."""
    from trellm_backend.models.rope import default_inv_freq, llama3_inv_freq, longrope_attention_factor
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        lists = {}
        for which in ("long", "short"):
            t = tensors.get(f"rope_factors_{which}.weight")
            if t is None or t.type_name != "F32" or t.shape != (rotary // 2,):
                raise ModelConfigError(f"{file}: longrope needs rope_factors_long.weight and rope_factors_short.weight"
                                       f" as F32 [{rotary // 2}] tensors (one factor per rotary frequency)")
            lists[which] = [_float(v) for v in np.asarray(t.data)]
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is None:
            raise ModelConfigError(f"{file}: longrope tensors without {arch}.rope.scaling.original_context_length")
        longest = meta.get(f"{arch}.context_length", orig)
        rope = {"rope_type": "longrope", "long_factor": lists["long"], "short_factor": lists["short"],
                "original_max_position_embeddings": int(orig)}
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        derived = longrope_attention_factor(longest / orig, orig)
        if attn is not None and not math.isclose(float(attn), derived, rel_tol=1e-6):
            rope["attention_factor"] = _float(attn)
        return rope
    t = tensors.get("rope_freqs.weight")
    if t is None:
        return {}
    if t.type_name != "F32" or t.shape != (rotary // 2,):
        raise ModelConfigError(f"{file}: tensor rope_freqs.weight must be F32 [{rotary // 2}] (one divisor per rotary "
                               f"frequency), got {t.type_name} {list(t.shape)}")
    divisors = np.asarray(t.data, dtype=np.float64)
    inv = default_inv_freq(rotary, theta).double().numpy()
    if not np.isfinite(divisors).all() or divisors.min() < 1 - 1e-6:
        raise ModelConfigError(f"{file}: tensor rope_freqs.weight holds divisors below 1 or not finite, which no "
                               "Llama 3 rope scaling gives")
    if np.allclose(divisors, 1.0, rtol=1e-6):
        return {}
    edges = llama3_band_edges(inv / (2 * math.pi), divisors)
    old = LLAMA3_PRETRAINING_LENGTH
    rope = {"rope_type": "llama3", "factor": _float(divisors.max()), "low_freq_factor": float(f"{edges[0] * old:.10g}"),
            "high_freq_factor": float(f"{edges[1] * old:.10g}"), "original_max_position_embeddings": old}
    import torch
    got = llama3_inv_freq(torch.from_numpy(inv), rope).numpy()
    if edges[0] <= 0 or not np.allclose(inv / got, divisors, rtol=1e-5):
        raise ModelConfigError(f"{file}: tensor rope_freqs.weight does not follow Llama 3's rope scaling (divisors "
                               f"{np.round(divisors, 4).tolist()}), which is the one read")
    return rope


def llama3_band_edges(u: np.ndarray, divisors: np.ndarray) -> tuple[float, float]:
    """(low, high): the inverse wavelengths where Llama 3's blend starts and ends (low_freq_factor and
    high_freq_factor over the pretraining length), from the per-frequency divisors. A divisor of 1 is a kept
    frequency, the largest one is `factor`, and between, 1/divisor moves linearly in the inverse wavelength."""
    factor = divisors.max()
    kept, scaled = np.isclose(divisors, 1.0, rtol=1e-6), np.isclose(divisors, factor, rtol=1e-6)
    blend = ~kept & ~scaled
    s = (1 / divisors[blend] - 1 / factor) / (1 - 1 / factor)     # 0 at the low edge, 1 at the high one
    if blend.sum() >= 2:
        slope, at0 = np.polyfit(u[blend], s, 1)
        return -at0 / slope, (1 - at0) / slope
    # too few blended frequencies to fix the edges: any edges between the kept and the scaled ones give the same model
    below = u[scaled].max() if scaled.any() else 0.0
    above = u[kept].min() if kept.any() else 2 * u.max()
    if blend.sum() == 1:
        u1, s1 = u[blend][0], s[0]
        width = 0.5 * min((u1 - below) / s1, (above - u1) / (1 - s1))
        return u1 - s1 * width, u1 - s1 * width + width
    return below + (above - below) / 3, below + 2 * (above - below) / 3


def stop_token_ids(meta: dict) -> list[int]:
    """End-of-generation ids: EOS, and the end-of-turn and end-of-message tokens llama.cpp also stops on."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def write_tokenizer(file: str, folder: str, n_tokens: int) -> None:
    """tokenizer.json and tokenizer_config.json (chat template inside) from the file's tokenizer.ggml.* keys, built
    by transformers' GGUF converter. Tokens the converter adds beyond the file's list (its GPT-2 defaults) are
    dropped: they have no row in the embeddings."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=os.path.basename(file))
    tok.save_pretrained(folder)
    tj = os.path.join(folder, "tokenizer.json")
    with open(tj, encoding="utf-8") as f:
        spec = json.load(f)
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] < n_tokens]
    with open(tj, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    tc = os.path.join(folder, "tokenizer_config.json")
    with open(tc, encoding="utf-8") as f:
        config = json.load(f)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            config["chat_template"] = f.read()
        os.remove(jinja)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key, value in list(config.items()):
        if isinstance(value, str) and value not in spec["model"]["vocab"] and key.endswith("_token") \
                and value not in {t["content"] for t in spec["added_tokens"]}:
            config.pop(key)          # a special token the file does not have (the converter's GPT-2 default)
    with open(tc, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)


def write_hf_files(file: str) -> str:
    """Derive config.json, generation_config.json and the tokenizer files of `file` into its folder; return the
    folder. Refuses, before writing anything, a folder that is a Hugging Face folder of its own or holds another
    GGUF file, and what check_gguf refuses."""
    folder = os.path.dirname(os.path.abspath(file))
    others = sorted(f for f in os.listdir(folder) if f.endswith(".gguf") and f != os.path.basename(file))
    if others:
        raise ModelConfigError(f"{file}: its folder holds other GGUF files ({', '.join(others)}); give each model "
                               "a folder of its own")
    cfg_file = os.path.join(folder, "config.json")
    if os.path.isfile(cfg_file) and gguf_file_of(folder) is None:
        raise ModelConfigError(f"{cfg_file}: the folder of {os.path.basename(file)} is a Hugging Face folder; give "
                               "the GGUF file a folder of its own")
    meta, tensors = read_gguf(file)
    config = hf_config(file, meta, tensors)
    write_tokenizer(file, folder, len(meta.get("tokenizer.ggml.tokens") or []))
    with open(cfg_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    generation = {"eos_token_id": stop_token_ids(meta)}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
    return folder


# ------------------------------------------------------------------------------------------------ tensors

def dequantize(t: GgufTensor):
    """The tensor as float32 torch values [shape] (gguf-py's reference dequantizers)."""
    import torch
    from gguf import GGMLQuantizationType, quants
    if t.type_name == "BF16":
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).float().reshape(t.shape)
    values = quants.dequantize(np.asarray(t.data), GGMLQuantizationType[t.type_name])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(t.shape)   # a copy: the map is read-only


# ------------------------------------------------------------------------------------------------ block formats
# Each decoder: the file's blocks of one tensor [rows, bytes] -> (q [rows, K], scales float32 [rows, K/g], mins
# float32 [rows, K/g] or None, g), with W = q * scale - min exactly as gguf-py's dequantizers compute it (ggml's
# block layouts, ggml-common.h). q is int8, or uint8 0..15 for the 4-bit formats (kernels/group_quant.py holds those
# two to a byte); Q4_0's offset of 8 becomes a minimum of 8 * scale, exact in float32.

def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones (Q4_0/Q4_1's order within a block)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and minimums (ggml's get_scale_min_k4)."""
    lo = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4), (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return np.concatenate([lo[0], hi[0]], axis=-1), np.concatenate([lo[1], hi[1]], axis=-1)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes [..., 128] -> 256 4-bit values: each 32 bytes hold a pair of sub-blocks, low then high."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 256)


def decode_q8_0(b):
    return b[..., 2:].view(np.int8), _half(b[..., :2])[..., 0], None, 32


def decode_q4_0(b):
    d = _half(b[..., :2])[..., 0]
    return _nibbles(b[..., 2:]), d, 8 * d, 32


def decode_q4_1(b):
    return _nibbles(b[..., 4:]), _half(b[..., :2])[..., 0], -_half(b[..., 2:4])[..., 0], 32


def decode_q4_k(b):
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    return _k_low(b[..., 16:144]), d * sc, dmin * mn, 32


def decode_q5_k(b):
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    qh = b[..., 16:48]
    high = np.stack([(qh >> i) & 1 for i in range(8)], axis=-2).reshape(*qh.shape[:-1], 256)
    return (_k_low(b[..., 48:176]) + 16 * high).astype(np.int8), d * sc, dmin * mn, 32


def decode_q6_k(b):
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 64), b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    runs = [(ql[..., 0:32] & 15) | ((qh & 3) << 4), (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4),
            (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.stack(runs, axis=-2).reshape(*b.shape[:-1], 256).astype(np.int8) - 32
    return q, _half(b[..., 208:210]) * b[..., 192:208].view(np.int8), None, 16


# GGML type -> (bytes per block, decoder)
BLOCK_FORMATS = {"Q8_0": (34, decode_q8_0), "Q4_0": (18, decode_q4_0), "Q4_1": (20, decode_q4_1),
                 "Q4_K": (144, decode_q4_k), "Q5_K": (176, decode_q5_k), "Q6_K": (210, decode_q6_k)}


def decode_blocks(t: GgufTensor, rows: slice | int = slice(None)):
    """A quantized 2-D (or stacked 3-D, `rows` an expert) tensor as (q [N, K], scales [N, K/g], mins or None, g)."""
    size, decoder = BLOCK_FORMATS[t.type_name]
    data = np.asarray(t.data)[rows]
    blocks = data.reshape(data.shape[0], -1, size)
    q, scales, mins, g = decoder(blocks)
    n = blocks.shape[0]
    return q.reshape(n, -1), scales.reshape(n, -1), None if mins is None else mins.reshape(n, -1), g


def rotary_halves(w, heads: int):
    """Undo convert_hf_to_gguf's permute of Llama's q/k rows (neighbour pairs back to rotary halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufState:
    """The state dict of a GGUF folder, under Hugging Face names, as `Checkpoint` takes it: each tensor is read when
    taken (so the host copy lives only until the model's copy is made) and converted from llama.cpp's conventions.
    `pop` gives float32 values (a quantized tensor outside the linears is dequantized, logged once per type);
    `pop_blocks` a quantized linear's own values; `leftover` names what no layer took."""

    def __init__(self, path: str):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        self.file = gguf_file_of(path)
        self.meta, self.tensors = read_gguf(self.file)
        self.arch = arch = check_gguf(self.file, self.meta, self.tensors)
        self.heads = int(self.meta[f"{arch}.attention.head_count"])
        kv = self.meta.get(f"{arch}.attention.head_count_kv", self.heads)
        self.kv_heads = int(kv[0] if isinstance(kv, list) else kv)
        arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
        self.names = get_tensor_name_map(arch_id, int(self.meta[f"{arch}.block_count"]))
        self.taken: set[str] = set()
        self.logged: set[str] = set()    # the types `pop` has dequantized
        self.stack = (None, None)   # the experts' tensor last read: (GGUF name, float32 values)

    def locate(self, hf_name: str) -> tuple[str, int | None] | None:
        """(GGUF name, expert index or None) of a Hugging Face tensor name, None when the file has none."""
        parts, expert = hf_name.split("."), None
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            expert = int(parts[i + 1])
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(parts[i + 2], parts[i + 2])
            hf_name = ".".join(parts[:i - 1] + ["mlp", "experts", proj] + parts[i + 3:])
        elif hf_name.endswith("block_sparse_moe.gate.weight"):
            hf_name = hf_name.replace("block_sparse_moe.gate", "mlp.gate")
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return None if name is None or name not in self.tensors else (name, expert)

    def type_of(self, hf_name: str) -> str | None:
        """The GGML type the file stores `hf_name` in, None when it has no such tensor."""
        where = self.locate(hf_name)
        return None if where is None else self.tensors[where[0]].type_name

    def pop_blocks(self, hf_name: str):
        """A quantized linear's weight as the file's own values (GroupWeight, on the CPU)."""
        import torch

        from trellm_kernels.group_quant import GroupWeight
        name, expert = self.locate(hf_name)
        self.taken.add(name)
        q, scales, mins, g = decode_blocks(self.tensors[name], slice(None) if expert is None else expert)
        q, scales = self.convert(hf_name, torch.from_numpy(q.copy())), self.convert(hf_name, torch.from_numpy(scales))
        if mins is not None:
            mins = self.convert(hf_name, torch.from_numpy(mins)).t().contiguous()
        return GroupWeight(q.contiguous(), scales.t().contiguous(), mins, g)

    def pop(self, hf_name: str, default=None):
        where = self.locate(hf_name)
        if where is None:
            return default
        name, expert = where
        self.taken.add(name)
        t = self.tensors[name]
        if t.quantized and t.type_name not in self.logged:
            self.logged.add(t.type_name)
            log.info("%s: %s tensors outside the linears (%s first) are dequantized to float at load", self.file,
                     t.type_name, name)
        if expert is None:
            w = dequantize(t)
        else:
            if self.stack[0] != name:
                self.stack = (name, dequantize(t))
            w = self.stack[1][expert]
        return self.convert(hf_name, w).contiguous()

    def convert(self, hf_name: str, w):
        if self.arch == "llama" and ".q_proj." in hf_name:
            return rotary_halves(w, self.heads)
        if self.arch == "llama" and ".k_proj." in hf_name:
            return rotary_halves(w, self.kv_heads)
        if self.arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            return w - 1
        if hf_name.endswith("shared_expert_gate.weight"):     # 1-D in the file, one row in the model
            return w.reshape(1, -1)
        return w

    def leftover(self) -> list[str]:
        """What no layer took; the rope tensors were read into config.json."""
        return sorted(set(self.tensors) - self.taken - set(ROPE_TENSORS))


HELD_BLOCK_BYTES = 1.5    # bytes a quantized weight takes at most held: int8, a scale and a minimum per 16


def gguf_weight_bytes(path: str, item_bytes: int) -> int:
    """Bytes the folder's GGUF weights take once loaded, at most: float tensors at `item_bytes` an element, quantized
    ones (the linears, and the embeddings, which a tied LM head shares) at HELD_BLOCK_BYTES."""
    _, tensors = read_gguf(gguf_file_of(path))
    return sum(int(np.prod(t.shape) * (HELD_BLOCK_BYTES if t.quantized else item_bytes)) for t in tensors.values())
