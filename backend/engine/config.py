"""Engine settings. In Triton they come from the `llm` model's config.pbtxt parameters (docs/operating.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from trellm_backend.engine.request import parse_bool
from trellm_kernels import kv_cache
from trellm_kernels.attention import CPU_OP_MAX_Q_LEN


SPECULATIVE_METHODS = ("none", "ngram", "draft")
# auto: the model's dtype; else a quantized cache of kernels/kv_cache.py (per token and KV head, float16 scales)
KV_CACHE_DTYPES = ("auto", *kv_cache.KV_CACHE_DTYPES)
# A verified chunk (guesses + 1 rows) then stays within the CPU attention operator's short chunks.
MAX_SPECULATIVE_TOKENS = CPU_OP_MAX_Q_LEN - 1


@dataclass
class EngineConfig:
    model_path: str
    device: str = "auto"                  # auto: cuda when available, else cpu
    dtype: str = "auto"                   # auto: the checkpoint's dtype on GPU, float32 on CPU
    quantization: str = "none"            # int8 (weight-only), w8a8, int4: the layers' linears (kernels/linear.py)
    kv_cache_dtype: str = "auto"          # auto (the model's dtype), int8 or fp8_e4m3: the KV cache's values
    block_size: int = 0                   # tokens per KV block; 0: 128 on CPU, 16 on CUDA (limits.resolve_block_size)
    kv_cache_bytes: int = 512 << 20       # KV pool on CPU
    gpu_memory_utilization: float = 0.9   # KV pool on GPU: this fraction of the memory free after loading weights
    num_kv_blocks: int = 0                # >0: exactly this many KV blocks, overriding both budgets above
    max_num_seqs: int = 64                # most requests running at once
    max_num_batched_tokens: int = 2048    # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 0                # 0: the model's max_position_embeddings (or sliding window)
    enforce_eager: bool = True            # false: decode steps padded to a batch-size bucket over persistent
                                          # buffers, replayed from CUDA graphs on a GPU (engine/cuda_graphs.py)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 512   # most prompt tokens of one request per step (0: the whole budget)
    enable_prefix_caching: bool = True    # reuse the KV blocks of prompt prefixes seen before
    enable_metrics: bool = True           # the Triton model reports vLLM-named metrics (backend/triton/metrics.py)
    max_queue_size: int = 512             # waiting requests beyond this are refused with UNAVAILABLE (backpressure)
    stream_interval: int = 1              # a streamed response every this many tokens after the first (vLLM's name)
    cpu_serving_threads: str = "idle"     # CPU engine: idle puts the loop's helpers and tritonserver's threads in
                                          # SCHED_IDLE (engine/cores.py); normal leaves every thread's class alone
    speculative_method: str = "none"      # none, ngram (prompt lookup) or draft (a smaller model): engine/proposers.py
    num_speculative_tokens: int = 4       # most tokens proposed per sequence and step
    prompt_lookup_max: int = 4            # ngram: longest suffix matched against the earlier tokens
    prompt_lookup_min: int = 2            # ngram: shortest suffix that may propose
    draft_model_path: str = ""            # draft: a smaller model folder with the target's tokenizer
    speculative_disable_batch_size: int = 4   # no speculation in a step with more running sequences than this
    lora_adapters: str = ""               # JSON {adapter name: PEFT folder}: LoRA adapters served beside the base
    max_lora_rank: int = 64               # adapters of a higher rank are refused at load
    max_loras: int = 4                    # most adapters in one step (requests of another one wait); 0: no limit
    max_cpu_loras: int = 0                # most adapters kept in memory (LRU; the others reread on use); 0: all
    tensor_parallel_size: int = 1         # processes that each hold 1/N of every layer (models/sharding.py), on
                                          # a CPU each with 1/N of the cores; the KV pool's budget is theirs together
    pipeline_parallel_size: int = 1       # processes that each run a run of the decoder's layers, in turn
                                          # (distributed/pipeline.py); the KV pool's budget is theirs together
    distributed_init: str = ""            # with a pipeline: tcp://HOST:PORT where the stages started on other hosts
                                          # join rank 0; empty: rank 0 starts them on this host
    parallel_timeout_s: float = 5.0       # most a rank waits for another at a collective or a transfer: past it
                                          # the group counts as lost (distributed/group.py, pipeline.py)
    shutdown_grace_s: float = 7.0         # once the server stops: how long requests in flight may go on before they
                                          # end with finish_reason abort (under the server's exit timeout, 10 s here)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1 (1: a response every token)")
        if self.cpu_serving_threads not in ("idle", "normal"):
            raise ValueError(f"cpu_serving_threads={self.cpu_serving_threads!r} is not one of idle, normal")
        check_speculation(self)
        check_tensor_parallel(self)

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineConfig":
        """Build from string values (Triton parameters), converting each by its field's type; unknown keys are
        an error so a typo in config.pbtxt does not go unnoticed."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(known)}")
        kwargs = {}
        for key, raw in values.items():
            default = known[key].default
            try:
                if isinstance(default, bool):
                    kwargs[key] = parse_bool(raw)
                elif isinstance(default, int):
                    kwargs[key] = int(raw)
                elif isinstance(default, float):
                    kwargs[key] = float(raw)
                else:
                    kwargs[key] = raw
            except ValueError:
                raise ValueError(f"engine parameter {key}={raw!r} is not a valid {type(default).__name__}") from None
        return cls(**kwargs)


def check_speculation(cfg: EngineConfig) -> None:
    """Raise ValueError naming the speculative decoding setting at fault and what it allows."""
    if cfg.speculative_method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method={cfg.speculative_method!r} is not one of "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    if cfg.speculative_method == "none":
        return
    if not 1 <= cfg.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={cfg.num_speculative_tokens} must be in "
                         f"[1, {MAX_SPECULATIVE_TOKENS}]")
    if cfg.speculative_disable_batch_size < 0:
        raise ValueError(f"speculative_disable_batch_size={cfg.speculative_disable_batch_size} must be >= 0 "
                         "(0: speculation in no step)")
    if cfg.speculative_method == "ngram":
        check_prompt_lookup(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.speculative_method == "draft" and not cfg.draft_model_path:
        raise ValueError("speculative_method=draft needs draft_model_path (a model folder with the target's "
                         "tokenizer)")


def check_prompt_lookup(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min={min_n} and prompt_lookup_max={max_n} must satisfy "
                         "1 <= prompt_lookup_min <= prompt_lookup_max")


def check_tensor_parallel(cfg: EngineConfig) -> None:
    """Raise ValueError naming the setting that keeps the model from splitting across processes."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    for key, n in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if n < 1:
            raise ValueError(f"{key}={n} must be >= 1")
    if cfg.distributed_init and pp == 1:
        raise ValueError(f"distributed_init={cfg.distributed_init!r} is for a pipeline across hosts; it needs "
                         "pipeline_parallel_size > 1")
    if tp == 1 and pp == 1:
        return
    if cfg.parallel_timeout_s <= 0:
        raise ValueError(f"parallel_timeout_s={cfg.parallel_timeout_s} must be > 0")
    split = f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}"
    why = {"tensor_parallel_size": tp > 1 and pp > 1 and "a model is split one way or the other, not both,",
           "device": cfg.device not in ("cpu", "auto") and "a split model runs on CPU processes only",
           "speculative_method": cfg.speculative_method == "draft" and "draft models are not split across ranks"}
    for key, reason in why.items():
        if reason:
            raise ValueError(f"{split} with {key}={getattr(cfg, key)!r}: {reason} so far")
    cores = len(os.sched_getaffinity(0))
    if not cfg.distributed_init and tp * pp > cores:
        raise ValueError(f"{split}: {tp * pp} processes on this host, which lets this server use {cores} cores; "
                         "each needs one at least")
