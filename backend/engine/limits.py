"""The engine's size rules, each written once: the device and dtype a config resolves to, the context length it
serves, the tokens and bytes of one KV block, and the KV pool those settings give. The engine sizes itself with them, and
the load-time checks (triton/checks.py) predict the same numbers before a byte of weights is read."""
from __future__ import annotations

import torch

from trellm_backend.engine.config import EngineConfig
from trellm_backend.models.config import DTYPES, ModelConfig
from trellm_kernels.kv_cache import KV_CACHE_DTYPES, QMAX, SCALE_DTYPE


def resolve_device_dtype(cfg: EngineConfig, model_cfg: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dtype = model_cfg.torch_dtype if device.type == "cuda" else torch.float32
    elif cfg.dtype in DTYPES:
        dtype = getattr(torch, cfg.dtype)
    else:
        raise ValueError(f"dtype={cfg.dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return device, dtype


def context_limit(cfg: EngineConfig, mc: ModelConfig) -> int:
    """The served max_model_len: the parameter, else the model's own limit (max_position_embeddings; sliding layers
    attend within their window at any length). Raises ValueError past the model's limit."""
    limit = mc.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds what {mc.path}/config.json allows ({limit})")
    return cfg.max_model_len or limit


def kv_window(*configs: ModelConfig | None) -> int:
    """The window past which no layer of these models (the target, and the draft that shares its block tables)
    reads a key, or 0 when any layer attends to the whole context: the KV manager then keeps every block."""
    windows = [w for mc in configs if mc is not None for w in (mc.layer_windows or (0,))]
    return max(windows) if windows and all(windows) else 0


# Tokens per KV block when the parameter is 0. CUDA: the Triton kernels' key tile. CPU: the C++ attention reads a
# block's keys for all heads front to back, so longer blocks mean longer streams and fewer softmax rescales;
# decoding 192 sequences of 1k tokens, 128-token blocks were clearly faster than 16-token ones (perf/RESULTS.md,
# section "CPU attention options now").
# vLLM's CPU build picks 128 too. The cost is coarser prefix caching: only whole blocks are shared.
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}


def resolve_block_size(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.block_size < 0:
        raise ValueError(f"block_size={cfg.block_size} must be a positive number of tokens, or 0 for the "
                         f"device's default ({DEFAULT_BLOCK_SIZE['cpu']} on CPU, {DEFAULT_BLOCK_SIZE['cuda']} on CUDA)")
    return cfg.block_size or DEFAULT_BLOCK_SIZE.get(device.type, DEFAULT_BLOCK_SIZE["cuda"])


def resolve_kv_cache_dtype(cfg: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensor's dtype: the model's `dtype` (kv_cache_dtype auto), else int8 or float8_e4m3fn."""
    return dtype if cfg.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[cfg.kv_cache_dtype]


def kv_bytes_per_block(mc: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                       draft: ModelConfig | None = None) -> int:
    """Bytes of one KV block in a cache of `kv_dtype` (resolve_kv_cache_dtype); an INT8/FP8 cache adds its float16
    scale per token and KV head. With a speculative `draft` model, whose K/V share the blocks (draft.py) in the same
    kv_dtype, for both."""
    per_model = [m for m in (mc, draft) if m is not None]
    per_value = kv_dtype.itemsize
    per_head = sum(m.num_layers * 2 * block_size * m.num_kv_heads for m in per_model)
    head_dims = sum(m.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim for m in per_model)
    scale_bytes = per_head * SCALE_DTYPE.itemsize if kv_dtype in QMAX else 0
    return head_dims * per_value + scale_bytes


def kv_budget(cfg: EngineConfig, device: torch.device, per_block: int, weights_to_load: int = 0) -> tuple[int, str]:
    """Bytes of the KV pool, and the setting that decides them. On a GPU: a fraction of the memory the weights
    leave free (`weights_to_load`: bytes of weights not on the device yet)."""
    if cfg.num_kv_blocks > 0:
        return cfg.num_kv_blocks * per_block, f"num_kv_blocks={cfg.num_kv_blocks}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (int(max(free - weights_to_load, 0) * cfg.gpu_memory_utilization),
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}")
    return cfg.kv_cache_bytes, f"kv_cache_bytes={cfg.kv_cache_bytes}"
