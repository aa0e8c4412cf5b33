"""LLM metrics for Triton's metrics endpoint (Prometheus), under vLLM's names so existing dashboards work.

Families are created once at load through the Python backend's custom-metrics API (`pb_utils.MetricFamily`,
passed in so this module imports without Triton). Every metric update is an IPC to the server, so none happens
on the stepping thread: the engine loop only hands finished outputs to `record` (a queue put), and a reporter
thread turns them into histogram and counter updates and samples the gauges from the loop's stats snapshot
(engine/stats.py) a few times a second.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from typing import Callable

from trellm_backend.engine.request import RequestOutput
from trellm_backend.engine.stats import SchedulerStats

log = logging.getLogger("trellm")

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5]

HISTOGRAMS = {   # name: (description, buckets)
    "vllm:time_to_first_token_seconds": ("Time from arrival to the first generated token", LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("Mean time between output tokens, per request", TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Time from arrival to the last token", LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Time from arrival to first being scheduled", LATENCY_BUCKETS),
}
COUNTERS = {
    "vllm:prompt_tokens_total": "Prompt tokens of finished requests",
    "vllm:generation_tokens_total": "Generated tokens of finished requests",
    "vllm:request_success_total": "Finished requests, by finished_reason (stop, length, abort)",
    "vllm:num_preemptions_total": "Requests preempted (their KV blocks freed, to be recomputed)",
    "vllm:prefix_cache_queries_total": "Prompt blocks looked up in the prefix cache",
    "vllm:prefix_cache_hits_total": "Prompt blocks found in the prefix cache",
    "vllm:spec_decode_num_drafts_total": "Speculative decoding: sequence steps that carried guessed tokens",
    "vllm:spec_decode_num_draft_tokens_total": "Speculative decoding: guessed tokens verified",
    "vllm:spec_decode_num_accepted_tokens_total": "Speculative decoding: guessed tokens accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total":
        "Speculative decoding: guessed tokens accepted, by position in the guess (label position, from 0)",
    "trellm:structured_output_compile_requests_total": "Structured output: guides asked to be compiled",
    "trellm:structured_output_compile_cache_hits_total": "Structured output: guides found already compiled",
    "trellm:structured_output_compile_seconds_total": "Structured output: seconds spent compiling guides",
    "trellm:structured_output_mask_seconds_total": "Structured output: seconds spent filling token masks",
    "trellm:structured_output_mask_steps_total": "Structured output: steps that filled token masks",
    "trellm:lora_loads_total": "LoRA adapters read again from their folder after an eviction (max_cpu_loras)",
    "trellm:lora_evictions_total": "LoRA adapters dropped from memory, least recently used first (max_cpu_loras)",
}
# Counters sampled from the stats snapshot (the others count finished requests): {name: SchedulerStats field}.
SNAPSHOT_COUNTERS = {"vllm:num_preemptions_total": "num_preemptions",
                     "vllm:prefix_cache_queries_total": "prefix_cache_queries",
                     "vllm:prefix_cache_hits_total": "prefix_cache_hits",
                     "vllm:spec_decode_num_drafts_total": "spec_num_drafts",
                     "vllm:spec_decode_num_draft_tokens_total": "spec_num_draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens_total": "spec_num_accepted_tokens",
                     "trellm:structured_output_compile_requests_total": "grammar_compile_requests",
                     "trellm:structured_output_compile_cache_hits_total": "grammar_cache_hits",
                     "trellm:structured_output_compile_seconds_total": "grammar_compile_s",
                     "trellm:structured_output_mask_seconds_total": "grammar_mask_s",
                     "trellm:structured_output_mask_steps_total": "grammar_mask_steps",
                     "trellm:lora_loads_total": "lora_loads",
                     "trellm:lora_evictions_total": "lora_evictions"}
# vLLM's LoRA gauge: its labels say which adapters run and wait (comma lists) and max_lora; its value is the time
# of the sample. One series at a time: a new label set replaces the previous one.
LORA_INFO = "vllm:lora_requests_info"
# vLLM's cache-configuration gauge: value 1, the settings as labels. An endpoint picker (Gateway API Inference
# Extension) reads block_size and num_gpu_blocks from it to hash prompts in this server's block size.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
GAUGES = {
    "vllm:num_requests_running": "Requests in the running batch",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled",
    "vllm:kv_cache_usage_perc": "Fraction of KV cache blocks in use (0-1)",
    "trellm:kv_cache_used_blocks": "KV cache blocks referenced by requests",
    "trellm:kv_cache_total_blocks": "KV cache blocks in the pool",
}
FINISH_REASONS = ("stop", "length", "abort")


def cache_config_labels(engine) -> dict[str, str]:
    """vllm:cache_config_info's labels for an LLMEngine, under vLLM's names."""
    c = engine.config
    return {"block_size": str(c.block_size), "num_gpu_blocks": str(engine.kv.num_blocks),
            "cache_dtype": c.kv_cache_dtype, "enable_prefix_caching": str(c.enable_prefix_caching)}


class MetricsReporter:
    """Owns the metric families of one model and the thread that updates them."""

    def __init__(self, pb_utils, labels: dict[str, str], interval_s: float = 0.1):
        """Creates the families (raises where the server has metrics off); `start` begins reporting."""
        self.interval_s = interval_s
        self._finished: queue.Queue[RequestOutput] = queue.Queue()
        kind = pb_utils.MetricFamily
        self._families = []   # kept alive: a family that is garbage-collected leaves the endpoint

        def family(name, description, k):
            f = kind(name=name, description=description, kind=k)
            self._families.append(f)
            return f
        self.hist = {n: family(n, d, kind.HISTOGRAM).Metric(labels=labels, buckets=b)
                     for n, (d, b) in HISTOGRAMS.items()}
        counters = {n: family(n, d, kind.COUNTER) for n, d in COUNTERS.items()}
        self.success = {r: counters["vllm:request_success_total"].Metric(labels={**labels, "finished_reason": r})
                        for r in FINISH_REASONS}
        per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        self.counter = {n: f.Metric(labels=labels) for n, f in counters.items()
                        if n not in ("vllm:request_success_total", per_pos)}
        self._per_pos = lambda pos: counters[per_pos].Metric(labels={**labels, "position": str(pos)})
        self.accepted_per_pos: list = []          # one counter per position, made when first reported
        self.gauge = {n: family(n, d, kind.GAUGE).Metric(labels=labels) for n, d in GAUGES.items()}
        self._labels = labels
        self._lora_family = family(LORA_INFO, "Running and waiting LoRA adapters (labels); the sample's time", kind.GAUGE)
        self._lora_info: tuple[tuple, object] | None = None    # (its label values, the series)
        self._cache_family = family(CACHE_CONFIG_INFO, "KV cache settings (labels); always 1", kind.GAUGE)
        self._reported = dict.fromkeys(SNAPSHOT_COUNTERS, 0)
        self._reported_per_pos: list[int] = []
        self._stats: Callable[[], SchedulerStats] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trellm-metrics", daemon=True)

    def record(self, out: RequestOutput) -> None:
        """A finished request's output, to be recorded by the reporter thread (safe on the stepping thread)."""
        self._finished.put(out)

    def start(self, stats: Callable[[], SchedulerStats], cache_config: dict[str, str]) -> None:
        """Report from now on, sampling the gauges from `stats()` (EngineLoop.stats); `cache_config` (label:
        value, vLLM's names) is published once as vllm:cache_config_info."""
        self._stats = stats
        self._cache_config = self._cache_family.Metric(labels={**self._labels, **cache_config})
        self._cache_config.set(1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.update()
            except Exception:  # metrics must never take serving down
                log.exception("updating metrics failed")

    def _report_loras(self, s: SchedulerStats) -> None:
        if not s.max_loras and not s.running_loras and not s.waiting_loras:
            return
        key = (str(s.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras))
        if self._lora_info is None or self._lora_info[0] != key:
            self._lora_info = (key, self._lora_family.Metric(labels={
                **self._labels, "max_lora": key[0], "running_lora_adapters": key[1], "waiting_lora_adapters": key[2]}))
        self._lora_info[1].set(time.time())

    def update(self) -> None:
        """Record every finished request since the last call and sample the gauges."""
        while True:
            try:
                out = self._finished.get_nowait()
            except queue.Empty:
                break
            self.record_finished(out)
        s = self._stats()
        self.gauge["vllm:num_requests_running"].set(s.num_running)
        self.gauge["vllm:num_requests_waiting"].set(s.num_waiting)
        self.gauge["trellm:kv_cache_used_blocks"].set(s.kv_used_blocks)
        self.gauge["trellm:kv_cache_total_blocks"].set(s.kv_total_blocks)
        self.gauge["vllm:kv_cache_usage_perc"].set(s.kv_usage)
        self._report_loras(s)
        for name, attr in SNAPSHOT_COUNTERS.items():
            now = getattr(s, attr)
            if now > self._reported[name]:
                self.counter[name].increment(now - self._reported[name])
                self._reported[name] = now
        for pos, now in enumerate(s.spec_accepted_per_pos):
            if pos == len(self.accepted_per_pos):
                self.accepted_per_pos.append(self._per_pos(pos))
                self._reported_per_pos.append(0)
            if now > self._reported_per_pos[pos]:
                self.accepted_per_pos[pos].increment(now - self._reported_per_pos[pos])
                self._reported_per_pos[pos] = now

    def record_finished(self, out: RequestOutput) -> None:
        t = out.times
        arrival, scheduled, first, last = t.arrival_ns, t.first_scheduled_ns, t.first_token_ns, t.last_token_ns
        self.counter["vllm:prompt_tokens_total"].increment(out.num_prompt_tokens)
        self.counter["vllm:generation_tokens_total"].increment(out.num_output_tokens)
        self.success.get(out.finish_reason or "abort", self.success["abort"]).increment(1)
        if scheduled:
            self.hist["vllm:request_queue_time_seconds"].observe((scheduled - arrival) / 1e9)
        if first:
            self.hist["vllm:time_to_first_token_seconds"].observe((first - arrival) / 1e9)
            self.hist["vllm:e2e_request_latency_seconds"].observe((last - arrival) / 1e9)
        if out.num_output_tokens > 1 and last > first:
            self.hist["vllm:request_time_per_output_token_seconds"].observe(
                (last - first) / 1e9 / (out.num_output_tokens - 1))
