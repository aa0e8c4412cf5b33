"""Cancellation and backpressure on a real tritonserver, watched through the llm model's KV-block gauge.

The server here runs a copy of the repository whose llm admits one request at a time (max_num_seqs 1) and lets
two wait (max_queue_size 2), so a third waiting request is refused with UNAVAILABLE; its vllm_model serves two
streams at once (max_concurrent_requests 2).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from trellm_backend.tools.testbed import metric_samples, private_repository
from trellm_client.client import infer_input, llm_inputs as client_llm_inputs, vllm_inputs as client_vllm_inputs

from conftest import REPO, free_ports

pytestmark = pytest.mark.server

SETTINGS = {"llm": {"max_num_seqs": "1", "max_queue_size": "2"}, "vllm_model": {"max_concurrent_requests": "2"}}


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    from trellm_backend.tools.launch import TritonServer
    root = tmp_path_factory.mktemp("cancel")
    repo = private_repository(os.path.join(REPO, "model_repository"), str(root / "model_repository"), SETTINGS)
    s = TritonServer(repo, *free_ports(3), log_path=str(root / "server.log")).start()
    yield s
    s.stop()


def gauge(server, name: str) -> float:
    values = [s.value for s in metric_samples(server.metrics_port) if s.name == name and s.labels["model"] == "llm"]
    assert values, f"{name} is not on the metrics endpoint"
    return values[0]


def wait_for_blocks(server, predicate, timeout=10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = gauge(server, "trellm:kv_cache_used_blocks")
        if predicate(used):
            return used
        time.sleep(0.05)
    return gauge(server, "trellm:kv_cache_used_blocks")


def tensor(name, value, dtype):
    return infer_input(grpcclient, name, np.array([[value]], dtype=dtype))


def llm_inputs(max_tokens=5000):
    return client_llm_inputs(grpcclient, [1, 100, 200, 300, 400], max_tokens=max_tokens, ignore_eos=True, stream=True)


def open_stream(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    return client, results


def first_error(results, timeout=10.0):
    """The first error on a stream within `timeout` seconds, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result, error = results.get(timeout=timeout)
        if error is not None:
            return error
    return None


def first_responses(results, n=3):
    for _ in range(n):
        result, error = results.get(timeout=60)
        assert error is None, error


def test_grpc_stream_cancel_frees_blocks(server):
    client, results = open_stream(server)
    client.async_stream_infer("llm", llm_inputs(), request_id="cancel-me")
    first_responses(results)
    assert wait_for_blocks(server, lambda used: used > 0) > 0
    client.stop_stream(cancel_requests=True)
    assert wait_for_blocks(server, lambda used: used == 0, timeout=5) == 0, "blocks still held after the cancel"
    client.close()


def test_stop_request_ends_a_running_ensemble_request(server):
    """A client cancel does not reach a running ensemble step on Triton 2.51; a stop request sent to llm with the
    ensemble request's id does, and the ensemble stream ends with finish_reason abort."""
    client, results = open_stream(server)
    inputs = [tensor("text_input", b"The Python language", np.object_), tensor("max_tokens", 3000, np.int32),
              tensor("min_tokens", 3000, np.int32), tensor("stream", True, np.bool_)]
    client.async_stream_infer("ensemble", inputs, request_id="ensemble-42")
    first_responses(results)
    stopper, acks = open_stream(server)
    stopper.async_stream_infer("llm", [tensor("stop", True, np.bool_)], request_id="ensemble-42")
    ack, error = acks.get(timeout=10)
    assert error is None, error
    assert wait_for_blocks(server, lambda used: used == 0, timeout=5) == 0
    reasons = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        result, error = results.get(timeout=10)
        assert error is None, error
        reasons.append(result.as_numpy("finish_reason").reshape(-1)[0])
        if reasons[-1]:
            break
    assert reasons[-1] == b"abort", f"the stopped stream ended with {reasons[-1]!r}"
    stopper.close()
    client.stop_stream()
    client.close()


def test_client_disconnect_frees_blocks(server, tmp_path):
    """A client process killed mid-stream: the server notices the broken stream and aborts the request."""
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_cancel import llm_inputs, open_stream, first_responses
        class S: grpc_url = {server.grpc_url!r}
        client, results = open_stream(S)
        client.async_stream_infer("llm", llm_inputs(), request_id="disconnect-me")
        first_responses(results)
        print("streaming", flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert wait_for_blocks(server, lambda used: used > 0) > 0
    finally:
        proc.kill()
        proc.wait()
    assert wait_for_blocks(server, lambda used: used == 0, timeout=5) == 0, "blocks still held after disconnect"


def test_full_queue_answers_unavailable(server):
    client, results = open_stream(server)
    client.async_stream_infer("llm", llm_inputs(), request_id="running")
    first_responses(results)                                   # it holds the only sequence slot
    for rid in ("waiting-1", "waiting-2"):
        client.async_stream_infer("llm", llm_inputs(), request_id=rid)
    time.sleep(0.5)
    client.async_stream_infer("llm", llm_inputs(), request_id="one-too-many")
    refused = first_error(results)
    assert refused is not None, "the fourth request was not refused"
    assert "max_queue_size=2" in str(refused), str(refused)
    # The model answers with TritonError.UNAVAILABLE, but Triton 2.51 passes only the message on: a gRPC stream
    # has no status per response, and HTTP generate turns every response error into 400.
    body = json.dumps({"input_ids": [1, 100, 200], "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    detail = e.value.read().decode()
    assert "at capacity" in detail and "max_queue_size=2" in detail, (e.value.code, detail)
    client.stop_stream(cancel_requests=True)
    assert wait_for_blocks(server, lambda used: used == 0, timeout=10) == 0
    client.close()


def vllm_inputs(max_tokens: int):
    return client_vllm_inputs(grpcclient, "The Python language", {"max_tokens": max_tokens, "ignore_eos": True})


def test_vllm_model_refuses_past_its_concurrency_and_frees_the_slots(server):
    """Two vllm_model streams in flight (one running in llm, one waiting there): a third is refused at once with a
    named error instead of queueing; once the two are cancelled, their slots serve new requests again."""
    client, results = open_stream(server)
    client.async_stream_infer("vllm_model", vllm_inputs(5000), enable_empty_final_response=True)
    first_responses(results)
    client.async_stream_infer("vllm_model", vllm_inputs(5000), enable_empty_final_response=True)
    time.sleep(0.5)
    client.async_stream_infer("vllm_model", vllm_inputs(4), enable_empty_final_response=True)
    refused = first_error(results)
    assert refused is not None, "the third vllm_model stream was not refused"
    assert "vllm_model is at capacity" in str(refused) and "max_concurrent_requests=2" in str(refused), refused
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for_blocks(server, lambda used: used == 0, timeout=20) == 0
    deadline, error = time.monotonic() + 20, "no answer"
    while time.monotonic() < deadline:      # the cancelled streams give their slots back once vllm_model sees it
        client, results = open_stream(server)
        client.async_stream_infer("vllm_model", vllm_inputs(4), enable_empty_final_response=True)
        result, error = results.get(timeout=30)
        client.stop_stream()
        client.close()
        if error is None:
            break
        time.sleep(0.5)
    assert error is None, error
    assert result.as_numpy("text_output") is not None


def test_client_leaving_an_ensemble_stream_early_frees_blocks(server):
    """LLMClient sends the stop request itself when the caller stops reading (the cancel alone would not reach)."""
    from trellm_client.client import LLMClient
    with LLMClient(server.grpc_url) as client:
        stream = client.stream("The Python language", max_tokens=3000, min_tokens=3000)
        for _ in range(3):
            next(stream)
        assert wait_for_blocks(server, lambda used: used > 0) > 0
        stream.close()
    assert wait_for_blocks(server, lambda used: used == 0, timeout=5) == 0, "the ensemble request kept its blocks"


def test_async_client_leaving_an_ensemble_stream_early_frees_blocks(server):
    """AsyncLLMClient sends the same stop request as LLMClient when the caller stops reading."""
    import asyncio

    from trellm_client.client import AsyncLLMClient

    async def leave_early():
        async with AsyncLLMClient(server.grpc_url) as client:
            stream = client.stream("The Python language", max_tokens=3000, min_tokens=3000)
            for _ in range(3):
                await stream.__anext__()
            held = await asyncio.to_thread(wait_for_blocks, server, lambda used: used > 0)
            await stream.aclose()
            return held

    assert asyncio.run(leave_early()) > 0
    assert wait_for_blocks(server, lambda used: used == 0, timeout=5) == 0, "the ensemble request kept its blocks"


def test_request_id_in_flight_is_refused(server):
    """Two running generations may not share a request id (a stop request names one): the second is refused by
    name while the first runs on; requests without an id are never refused (reuse after the end: test_engine_loop)."""
    client, results = open_stream(server)
    client.async_stream_infer("llm", llm_inputs(), request_id="twice")
    first_responses(results)
    client.async_stream_infer("llm", llm_inputs(max_tokens=2), request_id="twice")
    refused = first_error(results)
    assert refused is not None and "'twice' is already in flight" in str(refused), refused
    stopper = grpcclient.InferenceServerClient(server.grpc_url)
    stopper.start_stream(callback=lambda result, error: None)
    stopper.async_stream_infer("llm", [tensor("stop", True, np.bool_)], request_id="twice")
    assert wait_for_blocks(server, lambda used: used == 0, timeout=10) == 0
    again = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate",
                                   data=json.dumps({"input_ids": [1, 100, 200], "max_tokens": 2}).encode())
    stopper.stop_stream()
    stopper.close()
    client.stop_stream(cancel_requests=True)
    client.close()
    with urllib.request.urlopen(again, timeout=30) as r:   # HTTP generate sends no id: never refused
        assert r.status == 200
