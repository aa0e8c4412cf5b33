"""MetricsReporter against a fake pb_utils: gauges come from the stats snapshot it is given, counters advance by
the snapshot's deltas, and finished outputs become histogram observations (no server, no engine)."""
from __future__ import annotations

from trellm_backend.engine.request import RequestOutput, RequestTimes
from trellm_backend.engine.stats import SchedulerStats
from trellm_backend.triton.metrics import MetricsReporter


class FakeMetric:
    def __init__(self):
        self.value, self.observed = 0.0, []

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.value += v

    def observe(self, v):
        self.observed.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        m = FakeMetric()
        m.labels = labels
        FakeMetricFamily.created[(self.name, labels.get("finished_reason", labels.get("position")))] = m
        return m


class FakePbUtils:
    MetricFamily = FakeMetricFamily


CACHE_CONFIG = {"block_size": "128", "num_gpu_blocks": "512", "cache_dtype": "auto",
                "enable_prefix_caching": "True"}


def test_gauges_and_counters_follow_the_snapshot():
    reporter = MetricsReporter(FakePbUtils, {"model": "llm"}, interval_s=3600)   # updated by hand below
    m = FakeMetricFamily.created
    stats = [SchedulerStats(2, 3, 10, 40, 1, 8, 4)]
    reporter.start(lambda: stats[0], CACHE_CONFIG)
    reporter.update()
    assert m[("vllm:cache_config_info", None)].value == 1
    assert m[("vllm:cache_config_info", None)].labels == {"model": "llm", **CACHE_CONFIG}
    assert m[("vllm:num_requests_running", None)].value == 2 and m[("vllm:num_requests_waiting", None)].value == 3
    assert m[("vllm:kv_cache_usage_perc", None)].value == 0.25 and m[("trellm:kv_cache_total_blocks", None)].value == 40
    stats[0] = SchedulerStats(0, 0, 0, 40, 3, 12, 9)
    reporter.update()
    assert m[("vllm:num_preemptions_total", None)].value == 3
    assert m[("vllm:prefix_cache_queries_total", None)].value == 12 and m[("vllm:prefix_cache_hits_total", None)].value == 9

    s = 1_000_000_000
    reporter.record(RequestOutput("a", [1], True, "length", num_prompt_tokens=5, num_output_tokens=3,
                                  times=RequestTimes(s, 2 * s, 3 * s, 5 * s)))
    reporter.update()
    assert m[("vllm:request_queue_time_seconds", None)].observed == [1.0]
    assert m[("vllm:time_to_first_token_seconds", None)].observed == [2.0]
    assert m[("vllm:e2e_request_latency_seconds", None)].observed == [4.0]
    assert m[("vllm:request_time_per_output_token_seconds", None)].observed == [1.0]
    assert m[("vllm:request_success_total", "length")].value == 1 and m[("vllm:prompt_tokens_total", None)].value == 5
    reporter.stop()


def test_speculative_decoding_counters_follow_the_snapshot():
    reporter = MetricsReporter(FakePbUtils, {"model": "llm"}, interval_s=3600)
    m = FakeMetricFamily.created
    stats = [SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                            spec_accepted_per_pos=(2, 2, 1, 0))]
    reporter.start(lambda: stats[0], CACHE_CONFIG)
    reporter.update()
    stats[0] = SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=8,
                              spec_accepted_per_pos=(3, 3, 1, 1))
    reporter.update()
    assert m[("vllm:spec_decode_num_drafts_total", None)].value == 3
    assert m[("vllm:spec_decode_num_draft_tokens_total", None)].value == 12
    assert m[("vllm:spec_decode_num_accepted_tokens_total", None)].value == 8
    per_pos = [m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))].value for p in range(4)]
    assert per_pos == [3, 3, 1, 1]


def test_structured_output_counters_follow_the_snapshot():
    reporter = MetricsReporter(FakePbUtils, {"model": "llm"}, interval_s=3600)
    m = FakeMetricFamily.created
    stats = [SchedulerStats(grammar_compile_requests=3, grammar_cache_hits=1, grammar_compile_s=0.5)]
    reporter.start(lambda: stats[0], CACHE_CONFIG)
    reporter.update()
    stats[0] = SchedulerStats(grammar_compile_requests=5, grammar_cache_hits=3, grammar_compile_s=0.75,
                              grammar_mask_s=0.01, grammar_mask_steps=4)
    reporter.update()
    assert m[("trellm:structured_output_compile_requests_total", None)].value == 5
    assert m[("trellm:structured_output_compile_cache_hits_total", None)].value == 3
    assert m[("trellm:structured_output_compile_seconds_total", None)].value == 0.75
    assert m[("trellm:structured_output_mask_steps_total", None)].value == 4


def test_lora_gauge_names_the_running_and_waiting_adapters():
    reporter = MetricsReporter(FakePbUtils, {"model": "llm"}, interval_s=3600)
    m = FakeMetricFamily.created
    made = []
    metric = FakeMetricFamily.Metric

    def spy(self, labels, buckets=None):
        if self.name == "vllm:lora_requests_info":
            made.append(labels)
        return metric(self, labels, buckets)
    FakeMetricFamily.Metric = spy
    try:
        stats = [SchedulerStats()]
        reporter.start(lambda: stats[0], CACHE_CONFIG)
        reporter.update()
        assert made == [], "no series for a model without adapters"
        stats[0] = SchedulerStats(max_loras=4, running_loras=("chat", "sql"), waiting_loras=("sql",), lora_loads=2,
                                  lora_evictions=3)
        reporter.update()
        reporter.update()
        assert made == [{"model": "llm", "max_lora": "4", "running_lora_adapters": "chat,sql",
                         "waiting_lora_adapters": "sql"}], "one series per label set"
        assert m[("trellm:lora_evictions_total", None)].value == 3 and m[("trellm:lora_loads_total", None)].value == 2
    finally:
        FakeMetricFamily.Metric = metric
