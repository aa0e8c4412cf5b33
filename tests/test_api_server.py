"""Both request contracts on a real tritonserver: the TRT-LLM-shaped `ensemble` and the vLLM-shaped `vllm_model`,
driven by tritonclient gRPC streaming, HTTP generate / generate_stream and perf_analyzer."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from trellm_client.client import LLMClient, http_generate, vllm_inputs
from trellm_backend.tools.testbed import metric_sum, perf_analyzer_env, wait_until

pytestmark = pytest.mark.server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The import statement"


def vllm_stream(url, prompt, sampling: dict | str, **switches) -> list[dict]:
    """One vllm_model request over gRPC streaming ([1]-shaped tensors); returns each response's outputs."""
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("vllm_model", vllm_inputs(grpcclient, prompt, sampling, **switches),
                              enable_empty_final_response=True)
    responses = []
    try:
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                raise error
            out = {o["name"]: result.as_numpy(o["name"]) for o in result.get_response(as_json=True)["outputs"]}
            out["final"] = result.get_response().parameters["triton_final_response"].bool_param
            responses.append(out)
            if out["final"]:
                return responses
    finally:
        client.stop_stream()
        client.close()


def text_of(responses) -> str:
    return "".join(r["text_output"][0].decode() for r in responses if "text_output" in r)


@pytest.fixture(scope="module")
def greedy_text(triton_server):
    with LLMClient(triton_server.grpc_url) as c:
        return "".join(c.stream(PROMPT, max_tokens=20))


def test_vllm_model_streams_what_the_ensemble_streams(triton_server, greedy_text):
    responses = vllm_stream(triton_server.grpc_url, PROMPT, {"max_tokens": "20", "temperature": "0"}, stream=True)
    assert text_of(responses) == greedy_text and len(responses) > 1
    # No empty chunk, and FINAL rides on the last data response (what genai-perf counts on).
    assert all(r["text_output"][0] for r in responses[:-1]) and "text_output" in responses[-1]
    assert [r["final"] for r in responses] == [False] * (len(responses) - 1) + [True]


def test_vllm_model_return_switches_and_prompt_echo(triton_server, greedy_text):
    responses = vllm_stream(triton_server.grpc_url, PROMPT, {"max_tokens": 20, "temperature": 0, "logprobs": 2},
                            stream=False, return_finish_reason=True, return_cumulative_logprob=True,
                            return_logprobs=True, return_num_input_tokens=True, return_num_output_tokens=True)
    (r,) = responses
    assert r["text_output"][0].decode() == PROMPT + greedy_text    # exclude_input_in_output not set: echoed
    assert r["finish_reason"][0] == b"length" and r["num_output_tokens"].tolist() == [20]
    positions = json.loads(r["logprobs"][0])
    assert len(positions) == 20 and all(len(p) == 2 for p in positions)     # greedy: the pick is in the top 2
    assert r["cumulative_logprob"][0] == pytest.approx(
        sum(max(v["logprob"] for v in p.values()) for p in positions), rel=1e-4)
    assert r["num_input_tokens"].dtype == np.uint32 and r["num_input_tokens"][0] > 0


def test_vllm_model_over_http(triton_server, greedy_text):
    sp = json.dumps({"max_tokens": 20, "temperature": 0})
    (one,) = http_generate(triton_server.http_url, PROMPT, model="vllm_model", sampling_parameters=sp,
                           exclude_input_in_output=True, return_finish_reason=True)
    assert one["text_output"] == greedy_text and one["finish_reason"] == "length"
    events = http_generate(triton_server.http_url, PROMPT, model="vllm_model", stream=True, sampling_parameters=sp)
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == greedy_text


@pytest.mark.parametrize("sampling, message", [
    ('{"max_tokens": "0"}', r"sampling_parameters.max_tokens must be in [1, 1048576]"),
    ('{"max_tokens": 8, "temprature": 0.5}', "unknown field(s) temprature"),
    ('{"top_p": "none"}', "sampling_parameters.top_p must be a number"),
    ('{"n": 3, "logprobs": 99}', r"sampling_parameters.logprobs must be in [0, 20]"),
    ("{max_tokens: 3}", "sampling_parameters is not valid JSON"),
    # What HTTP generate cannot check on the ensemble's INT32 inputs (docs/requests.md), vllm_model checks from the JSON.
    ('{"max_tokens": 4294967301}', r"sampling_parameters.max_tokens must be in [1, 1048576], got 4294967301"),
    ('{"max_tokens": 1.5}', "sampling_parameters.max_tokens must be an integer, got 1.5"),
])
def test_vllm_model_errors_are_named_and_the_server_keeps_serving(triton_server, greedy_text, sampling, message):
    with pytest.raises(urllib.error.HTTPError) as e:
        http_generate(triton_server.http_url, PROMPT, model="vllm_model", sampling_parameters=sampling)
    assert e.value.code == 400 and message in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:     # an unknown top-level field is reported too
        http_generate(triton_server.http_url, PROMPT, model="vllm_model", max_tokens=5)
    assert "unknown request field(s) max_tokens" in json.loads(e.value.read())["error"]
    ok = vllm_stream(triton_server.grpc_url, PROMPT, {"max_tokens": 20, "temperature": 0}, stream=True)
    assert text_of(ok) == greedy_text


def test_vllm_model_passes_llm_refusals_on(triton_server):
    """A refusal made by llm (here: a prompt longer than the context) reaches the vllm_model client by its own
    message, not as a failure of vllm_model."""
    with pytest.raises(urllib.error.HTTPError) as e:
        http_generate(triton_server.http_url, "import os. " * 4000, model="vllm_model",
                      sampling_parameters='{"max_tokens": 4}')
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and "max_model_len" in error and "vllm_model:" not in error, error


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body to the HTTP port; the status and the JSON answer, error statuses included."""
    import urllib.request
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_generate_answers_triton_decides_before_the_models(triton_server):
    """docs/requests.md's table of what Triton 2.51's HTTP generate front end answers on the ensemble before (or after)
    any model of ours runs. None of these is ours to change (see docs/requests.md); if one fails after a Triton upgrade,
    the front end changed: update the table."""
    path = "/v2/models/ensemble/generate"
    # The JSON integer is cast to the declared INT32: 2**32 + 5 arrives as 5 (and min_tokens makes it 5 tokens).
    status, body = _post(triton_server, path, {"text_input": PROMPT, "max_tokens": 2**32 + 5, "min_tokens": 5,
                                               "return_num_output_tokens": True})
    assert (status, body.get("num_output_tokens")) == (200, 5), body
    # [2**31, 2**32) arrives negative: refused by our range check, naming the wrapped value.
    status, body = _post(triton_server, path, {"text_input": PROMPT, "max_tokens": 2**31})
    assert status == 400 and "max_tokens must be in [1, 1048576], got -2147483648" in body["error"]
    # A value of the wrong JSON type never reaches a model: Triton's INTERNAL conversion error, no field named.
    for value in ("abc", 1.5):
        status, body = _post(triton_server, path, {"text_input": PROMPT, "max_tokens": value})
        assert status == 500 and body["error"].startswith("Unable to parse 'data'"), body
    # More than one response: the 200 went out with the first one, the error comes in the body. Two sequences are
    # always two responses; a stream's tokens may be merged into one when the responder fell behind (loop.py).
    status, body = _post(triton_server, path, {"text_input": PROMPT, "max_tokens": 2, "num_return_sequences": 2})
    assert status == 200 and "generate expects model to produce exactly 1 response" in body["error"], body
    # The same requests on generate_stream are served.
    events = http_generate(triton_server.http_url, PROMPT, stream=True, max_tokens=2, num_return_sequences=2)
    assert sorted(e["sequence_index"] for e in events if e["finish_reason"]) == [0, 1]


def test_ensemble_stop_words_finish_reason_and_min_length(triton_server, greedy_text):
    stop = greedy_text[5:8]
    with LLMClient(triton_server.grpc_url) as c:
        chunks = list(c.stream_chunks(PROMPT, stream=True, max_tokens=20, stop_words=[stop, "never seen"]))
        assert "".join(ch.text for ch in chunks) == greedy_text[:greedy_text.index(stop)]
        assert chunks[-1].finish_reason == "stop" and chunks[-1].final
        assert all(ch.text for ch in chunks[:-1])
        assert c.stream_chunks(PROMPT, max_tokens=20).__next__().finish_reason == "length"
        # min_length (genai-perf's alias of min_tokens) holds off every EOS id and end_id.
        forced = list(c.stream_chunks(PROMPT, stream=True, max_tokens=12, min_length=12, end_id=0,
                                          return_num_output_tokens=True))
        assert forced[-1].num_output_tokens == 12


def test_ensemble_chat_messages_use_the_chat_template(triton_server, default_model_path):
    from transformers import AutoTokenizer
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a list?"}]
    expected_ids = AutoTokenizer.from_pretrained(default_model_path).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    with LLMClient(triton_server.grpc_url) as c:
        chunks = list(c.stream_chunks(messages=messages, stream=True, max_tokens=8, return_num_input_tokens=True))
    assert chunks[-1].num_input_tokens == len(expected_ids)
    assert "".join(ch.text for ch in chunks)


def test_ensemble_parallel_samples_logprobs_and_perf_metrics(triton_server):
    with LLMClient(triton_server.grpc_url) as c:
        chunks = list(c.stream_chunks(PROMPT, stream=True, max_tokens=10, num_return_sequences=2, temperature=1.0,
                                      seed=7, return_log_probs=True))
        single = {s: "".join(c.stream(PROMPT, max_tokens=10, temperature=1.0, seed=s)) for s in (7, 8)}
    by_seq = {i: "".join(ch.text for ch in chunks if ch.sequence_index == i) for i in (0, 1)}
    assert by_seq == {0: single[7], 1: single[8]}        # sample i draws with seed + i
    assert sum(ch.final for ch in chunks) == 1 and chunks[-1].final
    lps = [lp for ch in chunks if ch.sequence_index == 0 for lp in ch.output_log_probs]
    last0 = [ch for ch in chunks if ch.sequence_index == 0][-1]
    assert len(lps) == 10 and last0.cum_log_probs == pytest.approx(sum(lps), rel=1e-4)
    (one,) = http_generate(triton_server.http_url, PROMPT, max_tokens=4, return_perf_metrics=True)
    times = [one[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                              "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0
    assert one["kv_cache_alloc_total_blocks"] == one["kv_cache_alloc_new_blocks"] + one["kv_cache_reused_blocks"] > 0


def perf_analyzer(server, model: str, input_data: str, export, concurrency: int, requests: int) -> None:
    """perf_analyzer (tritonclient's wheel) streaming over gRPC, its per-request export written to `export`. Run
    again once if it exits 0 with an empty export: 2.51's perf_analyzer did so once in a full suite run on a busy
    2-core host (2026-11-27) and not in isolation; a second empty export fails the test with its output."""
    env = perf_analyzer_env()
    for attempt in range(2):
        run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "perf_analyzer"), "-m", model,
                              "-u", server.grpc_url, "-i", "grpc", "--streaming", "--input-data", input_data,
                              "--concurrency-range", str(concurrency), "--request-count", str(requests),
                              "--profile-export-file", str(export)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        if os.path.exists(export) and os.path.getsize(export) > 0:
            return
        if os.path.exists(export):
            os.unlink(export)        # perf_analyzer refuses to write over an existing export
    raise AssertionError(f"perf_analyzer exited 0 twice with an empty {export}:\n{run.stdout}{run.stderr}")


@pytest.mark.parametrize("model, inputs", [("ensemble", "tensorrtllm.json"), ("vllm_model", "vllm.json")])
def test_perf_analyzer_with_genai_perf_shaped_inputs(triton_server, tmp_path, model, inputs):
    export = tmp_path / "profile.json"
    perf_analyzer(triton_server, model, os.path.join(ROOT, "perf", "inputs", inputs), export, concurrency=2,
                  requests=4)
    requests = json.loads(export.read_text())["experiments"][0]["requests"]
    assert len(requests) >= 4
    for r in requests:
        texts = [o["text_output"] for o in r["response_outputs"]]
        # 16 tokens forced by min_length / min_tokens; every response carries text (no empty chunk).
        assert 1 < len(texts) <= 16 and all(texts), texts


def test_perf_analyzer_exports_exact_values_for_switched_on_outputs(triton_server, tmp_path):
    """perf_analyzer 2.51 exports garbage for a declared output a response does not carry (docs/requests.md); the
    outputs a request switches on come in every response, so their exported values are exact."""
    data = {"data": [{"text_input": ["Lists are mutable sequences"], "max_tokens": [8], "min_length": [8],
                      "stream": [True], "return_num_output_tokens": [True], "return_log_probs": [True],
                      "return_perf_metrics": [True]}]}
    inputs, export = tmp_path / "inputs.json", tmp_path / "profile.json"
    inputs.write_text(json.dumps(data))
    perf_analyzer(triton_server, "ensemble", str(inputs), export, concurrency=1, requests=2)
    for r in json.loads(export.read_text())["experiments"][0]["requests"]:
        outs = r["response_outputs"]
        assert [o["num_output_tokens"] for o in outs] == sorted(o["num_output_tokens"] for o in outs)
        assert outs[-1]["num_output_tokens"] == 8 and all(1 <= o["num_output_tokens"] <= 8 for o in outs)
        # One value per token of the response (a busy CPU server may merge tokens into one response).
        logprobs = [v for o in outs for v in np.ravel(o["output_log_probs"])]
        assert len(logprobs) == 8 and max(logprobs) <= 0 and all(o["cum_log_probs"] <= 0 for o in outs), outs
        assert all(o["kv_cache_alloc_total_blocks"] >= 1 and o["first_token_time_ns"] >= o["arrival_time_ns"] > 0
                   for o in outs)


def _metric(server, name, **labels) -> float:
    return metric_sum(server.metrics_port, name, timeout=10, **labels)


def test_vllm_model_client_cancel_aborts_the_generation(triton_server):
    aborted = dict(name="vllm:request_success_total", finished_reason="abort")
    before = _metric(triton_server, **aborted)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = vllm_inputs(grpcclient, PROMPT, {"max_tokens": 1000, "min_tokens": 1000, "ignore_eos": True})
    client.async_stream_infer("vllm_model", inputs)
    for _ in range(3):
        assert q.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_until(lambda: _metric(triton_server, **aborted) != before, 30, "the cancelled request to end as aborted", 0.2)
    assert _metric(triton_server, **aborted) == before + 1, "the engine kept generating for a cancelled client"
