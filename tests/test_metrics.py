"""The llm model's metrics on Triton's metrics endpoint, checked against what a handful of requests sent."""
from __future__ import annotations

import time

import pytest

from trellm_client.client import LLMClient
from trellm_backend.tools.testbed import metric_samples

pytestmark = pytest.mark.server

PROMPTS = ["The Python language", "A class", "Exceptions are raised when an error", "with"]
MAX_TOKENS = 6


def scrape(server) -> dict[str, float]:
    """Every sample of the llm model: 'name{labels}' (labels without model/version) -> value."""
    out = {}
    for s in metric_samples(server.metrics_port):
        if s.name.startswith(("vllm:", "trellm:")) and s.labels.get("model") == "llm":
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k not in ("model", "version"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_match_the_requests_sent(triton_server):
    before = scrape(triton_server)
    for family in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                   "vllm:request_queue_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                   "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                   "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                   "trellm:kv_cache_used_blocks", "trellm:kv_cache_total_blocks"):
        assert f"{family}{{}}" in before, f"{family} is missing from the metrics endpoint"

    prompt_tokens = output_tokens = 0
    with LLMClient(triton_server.grpc_url) as client:
        for p in PROMPTS:
            *_, last = client.stream_chunks(p, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                            return_num_input_tokens=True, return_num_output_tokens=True)
            prompt_tokens += last.num_input_tokens
            output_tokens += last.num_output_tokens
    assert output_tokens == MAX_TOKENS * len(PROMPTS)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    deadline = time.monotonic() + 10
    while True:   # the reporter updates a few times a second
        after = scrape(triton_server)
        if delta("vllm:e2e_request_latency_seconds_count{}") >= len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    n = len(PROMPTS)
    assert delta("vllm:prompt_tokens_total{}") == prompt_tokens
    assert delta("vllm:generation_tokens_total{}") == output_tokens
    assert delta('vllm:request_success_total{finished_reason="length"}') == n
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{hist}_count{{}}") == n, hist
        assert delta(f"vllm:{hist}_sum{{}}") > 0, hist
        assert delta(f'vllm:{hist}_bucket{{le="+Inf"}}') == n, hist
    assert after["vllm:num_requests_running{}"] == 0 and after["trellm:kv_cache_used_blocks{}"] == 0
    assert after["trellm:kv_cache_total_blocks{}"] > 0


def test_server_with_metrics_off_still_serves(default_model_path, tmp_path):
    from conftest import REPO, free_ports
    from trellm_backend.tools.launch import TritonServer
    server = TritonServer(f"{REPO}/model_repository", *free_ports(3), log_path=str(tmp_path / "server.log"),
                          extra_args=["--allow-metrics=false"]).start()
    try:
        with LLMClient(server.grpc_url) as client:
            assert client.generate(PROMPTS[0], max_tokens=4, min_tokens=4, exclude_input_in_output=True)
    finally:
        server.stop()
