"""A snapshot of the scheduler's state for metrics (vLLM's SchedulerStats): made on the engine thread after each
step, read by any thread, so a metrics reporter never reaches into the scheduler or the KV cache manager."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    num_preemptions: int = 0          # since start
    prefix_cache_queries: int = 0     # prompt blocks looked up, since start
    prefix_cache_hits: int = 0        # of which found in the cache
    spec_num_drafts: int = 0          # speculative decoding, since start: chunks that carried guesses,
    spec_num_draft_tokens: int = 0    # the guessed tokens,
    spec_num_accepted_tokens: int = 0  # the accepted ones,
    spec_accepted_per_pos: tuple[int, ...] = ()   # and the accepted ones by position in the guess
    grammar_compile_requests: int = 0  # structured output, since start (structured_output.CompileStats)
    grammar_cache_hits: int = 0
    grammar_compile_s: float = 0.0
    grammar_mask_s: float = 0.0
    grammar_mask_steps: int = 0
    max_loras: int = 0                 # LoRA (0 when the model declares no adapter): the max_loras setting,
    running_loras: tuple[str, ...] = ()   # the adapters of running requests and of waiting ones (sorted),
    waiting_loras: tuple[str, ...] = ()
    lora_loads: int = 0                # and since start, adapters read again after an eviction, and evictions
    lora_evictions: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / max(1, self.kv_total_blocks)
