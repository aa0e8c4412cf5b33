"""Write a Hugging Face folder as a GGUF file, laid out as llama.cpp's `convert_hf_to_gguf.py` lays it out.

    python -m trellm_backend.tools.write_gguf hf_models/anchor anchor-q8_0.gguf --type Q8_0
    python -m trellm_backend.tools.write_gguf hf_models/anchor anchor-q4_k_m.gguf --type Q4_K_M

Why here: no hub is reachable, so the GGUF reader (models/gguf.py) is tested on files this writes from the
project's own checkpoints, and perf/benchmark.py hands the same file to llama.cpp's server. What it writes follows
llama.cpp's conventions, which the reader and transformers' GGUF loader both undo:
- tensors under GGUF's names (gguf-py's TensorNameMap), each linear and the embeddings in the chosen type, norms
  and biases in F32;
- Llama's q and k rows permuted to llama.cpp's rotary order (pairs (i, i + d/2) stored as neighbours);
- Gemma's norms stored as 1 + w (what the model multiplies by);
- Llama 3's rope scaling as `rope_freqs` (a divisor per frequency) and Phi-3's longrope as its factor tensors;
- the tokenizer as `tokenizer.ggml.*` (byte-level BPE: tokens, merges, token types, special ids) and the chat
  template.
The K-quant quantizers (Q4_K, Q5_K, Q6_K), which gguf-py does not have, round to nearest within llama.cpp's block
layouts; the files are valid for any reader, not tuned for quality.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

# our family -> GGUF architecture name
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe"}
# --type: the linears' type; Q4_K_M is llama.cpp's mix (Q4_K, with Q6_K for attn_v, ffn_down and the LM head)
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
MORE_BITS = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")


# ------------------------------------------------------------------------------------------------ K-quants

def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[B, 8] 6-bit scales and mins -> [B, 12] bytes, as ggml's get_scale_min_k4 reads them."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _scale_min_blocks(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's grid: w ~ d*sc*q - dmin*m per 32, q in 0..levels, sc and m 6-bit. Returns d, dmin, sc, m, q."""
    sub = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - lo) / levels
    d = _fp16(step.max(axis=1) / 63).astype(np.float32)
    dmin = _fp16(-lo.min(axis=1) / 63).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * mn)[:, :, None]) / np.where(scale > 0, scale, 1)[:, :, None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _scale_min_blocks(w, 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_fp16(d)[:, None].view(np.uint8), _fp16(dmin)[:, None].view(np.uint8),
                           _pack_k_scales(sc, mn), qs], axis=1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _scale_min_blocks(w, 31)
    q = q.reshape(-1, 4, 2, 32)
    lo = q & 15
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).astype(np.uint8)        # [B, 4, 2, 32]: bit 2*j + h of qh[l] for sub-block 2*j + h
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(4):
        for h in range(2):
            qh |= hi[:, j, h] << (2 * j + h)
    return np.concatenate([_fp16(d)[:, None].view(np.uint8), _fp16(dmin)[:, None].view(np.uint8),
                           _pack_k_scales(sc, mn), qh, qs], axis=1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: w ~ d*sc*(q - 32) per 16, q 6-bit, sc int8."""
    sub = w.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(sub).max(axis=2)
    step = amax / 31
    d = _fp16(step.max(axis=1) / 127).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 0, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = np.clip(np.round(sub / np.where(scale > 0, scale, 1)[:, :, None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)          # halves of 128, each four runs of 32
    lo = q & 15
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)  # [B, 2, 64]
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                           _fp16(d)[:, None].view(np.uint8)], axis=1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data, GGMLQuantizationType) of a float [N, K] array in `type_name`."""
    from gguf import GGMLQuantizationType, quants
    qtype = GGMLQuantizationType[type_name]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if type_name == "F32":
        return w, qtype
    if type_name == "F16":
        return w.astype(np.float16), qtype
    if type_name in K_QUANTIZERS:
        blocks = K_QUANTIZERS[type_name](w.reshape(-1, 256))
        return blocks.reshape(*w.shape[:-1], -1), qtype
    return quants.quantize(w, qtype), qtype


def tensor_type(gguf_name: str, shape: tuple[int, ...], file_type: str) -> str:
    """The type a tensor is written in: F32 for norms, biases and routers; the file's type for the rest (falling back
    to Q8_0, then F16, where a row is not whole blocks of the type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    if len(shape) < 2 or "ffn_gate_inp" in gguf_name:
        return "F32"
    want = file_type
    if file_type == "Q4_K_M":
        want = "Q6_K" if gguf_name.endswith(MORE_BITS) or gguf_name == "output.weight" else "Q4_K"
    for t in (want, "Q8_0", "F16"):
        if shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] == 0:
            return t
    return "F32"


# ------------------------------------------------------------------------------------------------ tensors

def llama_rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows from transformers' rotary halves to llama.cpp's neighbour pairs (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(folder: str, cfg, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor of the folder, in llama.cpp's conventions."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    from trellm_backend.models.weights import load_state_dict
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, cfg.num_layers)
    state = load_state_dict(folder, torch.float32)
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    out = []
    for hf_name, t in state.items():
        w = t.numpy()
        parts = hf_name.split(".")
        if ".experts." in hf_name and parts[parts.index("experts") + 1].isdigit():   # one expert of a stack
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            stacked = stacked.replace("block_sparse_moe.experts.w1", "mlp.experts.gate_proj") \
                .replace("block_sparse_moe.experts.w3", "mlp.experts.up_proj") \
                .replace("block_sparse_moe.experts.w2", "mlp.experts.down_proj")
            experts.setdefault(stacked, []).append((int(parts[i + 1]), w))
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{folder}: tensor {hf_name} has no GGUF name for architecture {arch}")
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = llama_rotary_order(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = llama_rotary_order(w, cfg.num_kv_heads)
        if cfg.gemma is not None and hf_name.endswith("norm.weight"):
            w = w + 1
        if hf_name.endswith("shared_expert_gate.weight"):     # llama.cpp keeps the shared expert's gate 1-D
            w = w.reshape(-1)
        out.append((gguf_name, w))
    for stacked, ws in experts.items():
        gguf_name = names.get_name(stacked, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"{folder}: experts {stacked} have no GGUF name for architecture {arch}")
        out.append((gguf_name, np.stack([w for _, w in sorted(ws, key=lambda e: e[0])])))
    return out


def rope_tensors(cfg) -> list[tuple[str, np.ndarray]]:
    """The rope settings llama.cpp keeps as tensors: Llama 3's scaling as one divisor per frequency, Phi-3's
    longrope as its factor lists."""
    import torch

    from trellm_backend.models.rope import default_inv_freq, llama3_inv_freq
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "llama3":
        inv = default_inv_freq(cfg.rotary_dim, cfg.rope_theta).double()
        return [("rope_freqs.weight", (inv / llama3_inv_freq(inv, s)).float().numpy())]
    if s.get("rope_type") == "longrope":
        return [(f"rope_factors_{which}.weight", np.asarray(s[f"{which}_factor"], dtype=np.float32))
                for which in ("long", "short")]
    return []


# ------------------------------------------------------------------------------------------------ metadata

def write_metadata(writer, folder: str, cfg, config: dict, arch: str) -> None:
    from gguf import RopeScalingType
    from transformers import PreTrainedTokenizerFast

    from trellm_backend.models.rope import longrope_attention_factor
    writer.add_name("mistral" if cfg.family == "mistral" else os.path.basename(os.path.normpath(folder)))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_vocab_size(cfg.vocab_size)
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif scaling["rope_type"] == "longrope":      # the factors go in tensors (rope_tensors)
        orig = scaling["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(orig)
        attn = scaling.get("attention_factor")
        writer.add_rope_scaling_attn_factors(
            longrope_attention_factor(cfg.max_position_embeddings / orig, orig) if attn is None else float(attn))
    windows = [w for w in cfg.layer_windows if w]
    if windows:
        writer.add_sliding_window(windows[0])
    if cfg.gemma is not None:
        if cfg.family == "gemma3":
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.gemma.layer_types])
        if cfg.gemma.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.gemma.attn_logit_softcapping)
        if cfg.gemma.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.gemma.final_logit_softcapping)
    if cfg.moe is not None:
        writer.add_expert_count(cfg.moe.num_experts)
        writer.add_expert_used_count(cfg.moe.top_k)
        if cfg.family != "mixtral":
            writer.add_expert_feed_forward_length(cfg.moe.intermediate_size)
        if cfg.moe.shared_intermediate_size:
            writer.add_expert_shared_feed_forward_length(cfg.moe.shared_intermediate_size)

    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    spec = json.loads(tok.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{folder}/tokenizer.json: only a byte-level BPE tokenizer is written "
                         f"(model {spec['model']['type']}, pre_tokenizer {spec.get('pre_tokenizer')})")
    vocab = spec["model"]["vocab"]
    tokens = [""] * cfg.vocab_size
    types = [1] * cfg.vocab_size                       # NORMAL
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec.get("added_tokens", []) if t["special"]}
    for i in range(cfg.vocab_size):
        if i in special:
            types[i] = 3                               # CONTROL
        elif not tokens[i]:
            tokens[i], types[i] = f"[PAD{i}]", 5       # UNUSED: rows past the tokenizer's vocabulary
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, setter in (("bos_token_id", writer.add_bos_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(config.get(key), int):
            setter(config[key])
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    if len(cfg.eos_token_ids) > 1:     # a second stop id (the chat template's end of turn)
        writer.add_eot_token_id(cfg.eos_token_ids[1])
    if tok.unk_token_id is not None:
        writer.add_unk_token_id(tok.unk_token_id)
    ids = tok("a").input_ids
    writer.add_add_bos_token(bool(ids) and tok.bos_token_id is not None and ids[0] == tok.bos_token_id)
    if getattr(tok, "chat_template", None):
        writer.add_chat_template(tok.chat_template)


def write_gguf(folder: str, out_file: str, file_type: str = "Q8_0") -> str:
    """Write `folder` (a Hugging Face model folder of a family we serve) to `out_file` in `file_type`."""
    from gguf import GGUFWriter, LlamaFileType

    from trellm_backend.models.config import load_model_config
    if file_type not in FILE_TYPES:
        raise ValueError(f"--type {file_type!r}: one of {', '.join(FILE_TYPES)}")
    cfg = load_model_config(folder)
    if cfg.quant is not None:
        raise ValueError(f"{folder}: a {cfg.quant.method} checkpoint; write a float folder")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    arch = GGUF_ARCH[cfg.family]
    scaling = (cfg.rope_scaling or {}).get("rope_type", "default")
    if scaling not in ("default", "linear", "llama3", "longrope"):
        raise ValueError(f"{folder}: rope scaling {scaling!r} is not written (default, linear, llama3, longrope)")
    writer = GGUFWriter(out_file, arch)
    write_metadata(writer, folder, cfg, config, arch)
    writer.add_file_type(getattr(LlamaFileType, "MOSTLY_" + file_type, LlamaFileType.ALL_F32)
                         if file_type != "F32" else LlamaFileType.ALL_F32)
    for name, w in rope_tensors(cfg) + gguf_tensors(folder, cfg, arch):
        data, qtype = quantize(w, tensor_type(name, w.shape, file_type))
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def write_gguf_folder(folder: str, out_folder: str, file_type: str) -> str:
    """`folder` written as `out_folder`/model.gguf, with the config.json and tokenizer a served GGUF folder has
    derived beside it (models/gguf.py); returns `out_folder`."""
    from trellm_backend.models.gguf import write_hf_files
    os.makedirs(out_folder, exist_ok=True)
    return write_hf_files(write_gguf(folder, os.path.join(out_folder, "model.gguf"), file_type))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_folder")
    ap.add_argument("out_file")
    ap.add_argument("--type", default="Q8_0", choices=FILE_TYPES)
    args = ap.parse_args(argv)
    try:
        write_gguf(args.hf_folder, args.out_file, args.type)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
