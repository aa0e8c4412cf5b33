"""Checks a model must pass before the llm entry loads it, each failing with the file and the number at fault.

`serving_config` is what `model_repository/*llm/1/model.py` calls in `initialize`: it reads the entry's parameters,
then checks the Hugging Face folder (config.json's architecture, the safetensors headers, the tokenizer against the
vocabulary), the KV budget against one maximum-length sequence, and weights + KV cache against the memory there
is, all before a byte of weights is read. The engine itself accepts smaller KV pools (tests use them); a served
model does not, since a pool that cannot hold one full-length sequence would refuse requests the model advertises.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.draft import load_draft_config
from trellm_backend.models.config import ModelConfig, ModelConfigError, load_model_config
from trellm_backend.models.lora import adapter_table
from trellm_backend.engine.limits import (context_limit, kv_budget, kv_bytes_per_block, resolve_block_size,
                                         resolve_device_dtype, resolve_kv_cache_dtype)
from trellm_backend.triton.parameters import resolve_model_path
from trellm_backend.triton.tokenization import require_tokenizer_files
from trellm_kernels.linear import QUANTIZATIONS
from trellm_backend.models.gguf import gguf_file_of, gguf_weight_bytes
from trellm_backend.models.weights import safetensors_files, tensor_header


def serving_config(params: dict[str, str], model_dir: str) -> EngineConfig:
    """The llm entry's EngineConfig from its config.pbtxt parameters (`model_dir`: the entry's folder, as Triton
    passes it), after every check of this module."""
    config_file = os.path.join(model_dir, "config.pbtxt")
    params = dict(params)
    if "model_path" not in params:
        raise ModelConfigError(f"{config_file}: parameter model_path is missing (the Hugging Face folder)")
    params["model_path"] = resolve_model_path(params["model_path"], model_dir)
    if params.get("draft_model_path"):
        params["draft_model_path"] = resolve_model_path(params["draft_model_path"], model_dir)
    try:
        if params.get("lora_adapters"):
            params["lora_adapters"] = json.dumps({name: resolve_model_path(path, model_dir) for name, path in
                                                  adapter_table(params["lora_adapters"]).items()})
        cfg = EngineConfig.from_strings(params)
    except ValueError as e:
        raise ModelConfigError(f"{config_file}: {e}") from None
    check_model(cfg, config_file)
    return cfg


def check_model(cfg: EngineConfig, config_file: str) -> ModelConfig:
    if not os.path.isdir(cfg.model_path):
        raise ModelConfigError(f"{config_file}: model_path={cfg.model_path} is not a folder")
    mc = load_model_config(cfg.model_path)            # architecture and config.json values
    check_tokenizer(mc)
    device, dtype = resolve_device_dtype(cfg, mc)
    if cfg.quantization not in QUANTIZATIONS:
        raise ModelConfigError(f"{config_file}: quantization={cfg.quantization!r} is not one of "
                               f"{', '.join(QUANTIZATIONS)}")
    if mc.quant is not None and cfg.quantization != "none":   # a GPTQ/AWQ checkpoint is read as it is stored
        raise ModelConfigError(f"{config_file}: quantization={cfg.quantization!r}, but "
                               f"{os.path.join(mc.path, 'config.json')} is already a {mc.quant.method} checkpoint; "
                               "set quantization to none")
    try:
        cfg = dataclasses.replace(cfg, block_size=resolve_block_size(cfg, device))
    except ValueError as e:
        raise ModelConfigError(f"{config_file}: {e}") from None
    try:
        draft = load_draft_config(cfg, mc, context_limit(cfg, mc))
    except ValueError as e:
        raise ModelConfigError(f"{config_file}: {e}") from None
    weights = weight_bytes(mc.path, dtype)            # also rejects missing, truncated or corrupt files
    if draft is not None:
        weights += weight_bytes(draft.path, dtype)
    kv = check_kv_budget(cfg, mc, device, dtype, weights, config_file, draft)
    check_memory(mc.path, device, weights, kv, config_file)
    return mc


def tokenizer_size(path: str) -> int:
    """Number of token ids the tokenizer of `path` can produce (what len(AutoTokenizer) gives)."""
    require_tokenizer_files(path)
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        try:
            with open(tj, encoding="utf-8") as f:
                t = json.load(f)
            vocab = t["model"]["vocab"]
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
            ids += [a["id"] for a in t.get("added_tokens") or []]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelConfigError(f"{tj}: not a tokenizers file ({e})") from None
        return max(ids) + 1 if ids else 0
    from transformers import AutoTokenizer   # slow-tokenizer files only: the import costs seconds
    return len(AutoTokenizer.from_pretrained(path))


def check_tokenizer(mc: ModelConfig) -> None:
    n = tokenizer_size(mc.path)
    if n > mc.vocab_size:
        raise ModelConfigError(
            f"{os.path.join(mc.path, 'config.json')}: vocab_size={mc.vocab_size} but the folder's tokenizer has {n} "
            f"tokens: the tokenizer does not belong to this model (ids {mc.vocab_size}..{n - 1} have no embedding)")


INTEGER_BYTES = {"I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}   # kept as stored (GPTQ/AWQ packed weights)


def weight_bytes(path: str, dtype: torch.dtype) -> int:
    """Bytes the weights take once the floating ones are cast to `dtype`, from the safetensors headers."""
    item = torch.finfo(dtype).bits // 8
    if gguf_file_of(path) is not None:
        return gguf_weight_bytes(path, item)
    return sum(math.prod(shape) * INTEGER_BYTES.get(kind, item)
               for f in safetensors_files(path) for shape, kind in tensor_header(f).values())


def check_kv_budget(cfg: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype, weights: int,
                    config_file: str, draft: ModelConfig | None = None) -> int:
    """Raise unless the KV pool holds one sequence of max_model_len tokens; return the pool's bytes. A draft
    model's K/V share the blocks (engine/draft.py), so each block is sized for both."""
    per_block = kv_bytes_per_block(mc, cfg.block_size, resolve_kv_cache_dtype(cfg, dtype), draft)
    try:
        max_len = context_limit(cfg, mc)
    except ValueError as e:
        raise ModelConfigError(f"{config_file}: {e}") from None
    need_blocks = -(-max_len // cfg.block_size)
    given, param = kv_budget(cfg, device, per_block, weights_to_load=weights)
    blocks = given // per_block
    if blocks < need_blocks:
        raise ModelConfigError(
            f"{config_file}: KV cache too small: {param} gives {given} bytes ({blocks} blocks), but one sequence of "
            f"max_model_len={max_len} tokens needs {need_blocks * per_block} bytes ({need_blocks} blocks of "
            f"{cfg.block_size} tokens x {per_block} bytes); raise {param.split('=')[0]} or lower max_model_len")
    return blocks * per_block


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free for this model on `device`, and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device} (torch.cuda.mem_get_info)"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def check_memory(path: str, device: torch.device, weights: int, kv: int, config_file: str) -> None:
    available, source = available_memory(device)
    # On a GPU the KV pool is sized from what the weights leave free, so only the weights must fit.
    need = weights if device.type == "cuda" else weights + kv
    if need > available:
        raise ModelConfigError(
            f"{config_file}: the model does not fit in memory: weights of {path} take {weights} bytes"
            + (f" + KV cache {kv} bytes = {need} bytes" if device.type != "cuda" else "")
            + f", but {source} is {available} bytes; lower kv_cache_bytes, use a smaller dtype or a larger machine")
