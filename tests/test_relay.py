"""The KServe v2 HTTP routes on the front door's port (openai_api/relay.py), relayed to a real tritonserver: what
tritonclient's HTTP client and curl use works through it, a body Triton 2.51 would crash on is refused with Triton's
error shape while a stream in flight goes on, admin routes stay on loopback, and bad connections cost one log line.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.http as httpclient

from conftest import free_ports
from trellm_backend.tools import launch
from trellm_backend.tools.testbed import perf_analyzer_env
from trellm_client.client import http_generate
from trellm_openai.relay import nests_deeper_than

pytestmark = pytest.mark.server
PROMPT = "The Python language"


@pytest.fixture(scope="module")
def door(triton_server):
    port = free_ports(1)[0]
    proc = launch.start_front_door(triton_server, port, None)
    yield f"127.0.0.1:{port}"
    launch.stop_front_door(proc)


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_tritonclient_http_and_generate_work_through_the_door_as_on_triton(triton_server, door):
    client = httpclient.InferenceServerClient(door)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
    assert client.get_server_metadata()["name"] == "triton"
    assert client.get_model_metadata("ensemble") == httpclient.InferenceServerClient(
        triton_server.http_url).get_model_metadata("ensemble")
    assert client.get_model_config("llm")["model_transaction_policy"]["decoupled"] is True
    assert client.get_inference_statistics("ensemble")["model_stats"][0]["name"] == "ensemble"
    params = dict(max_tokens=12, ignore_eos=True, exclude_input_in_output=True)
    direct = http_generate(triton_server.http_url, PROMPT, **params)[0]["text_output"]
    assert http_generate(door, PROMPT, **params)[0]["text_output"] == direct
    events = http_generate(door, PROMPT, stream=True, **params)
    assert len(events) > 1 and "".join(e.get("text_output", "") for e in events) == direct
    # a non-decoupled model's infer, with the binary tensor extension (the JSON header, then raw bytes)
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    import numpy as np
    text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=np.object_), binary_data=True)
    ids = client.infer("preprocess", [text], outputs=[httpclient.InferRequestedOutput("input_ids", binary_data=True)])
    assert ids.as_numpy("input_ids").shape[-1] > 1


def test_perf_analyzer_measures_through_the_door(door, tmp_path):
    """perf_analyzer (libcurl, which does not decode gzip) over HTTP through the door: the relay asks Triton with the
    client's Accept-Encoding only (aiohttp's default one made Triton gzip the answers perf_analyzer then could not
    read: "failed to parse the request JSON buffer")."""
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"data": [{"text_input": [PROMPT]}]}))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "perf_analyzer"), "-m", "preprocess", "-u", door,
                        "-i", "http", "--input-data", str(inputs), "--concurrency-range", "2", "--measurement-mode",
                        "count_windows", "--measurement-request-count", "10", "--stability-percentage", "100"],
                       capture_output=True, text=True, timeout=300, env=perf_analyzer_env())
    assert r.returncode == 0 and "Throughput:" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_deep_body_is_refused_by_the_door_and_a_stream_in_flight_goes_on(triton_server, door):
    """50,000 nested arrays crashed tritonserver 2.51's HTTP front end (every stream lost); the door answers 400 in
    Triton's shape and the server never sees it."""
    got = {}
    stream = threading.Thread(target=lambda: got.update(events=http_generate(
        door, PROMPT, stream=True, max_tokens=48, ignore_eos=True)))
    stream.start()
    time.sleep(0.3)
    for path in ("/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream", "/v2/models/llm/infer"):
        body = b'{"text_input": ' + b"[" * 50000 + b"]" * 50000 + b"}"
        status, answer = post(door, path, body)
        assert status == 400 and json.loads(answer) == {"error": "the request body nests deeper than 64 levels"}
    # binary infer: only the JSON header is read for its depth
    header = b'{"inputs": [' + b"[" * 100 + b"]" * 100 + b"]}"
    status, answer = post(door, "/v2/models/preprocess/infer", header + b"[[[[" * 100,
                          {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and b"nests deeper than 64" in answer
    stream.join(timeout=120)
    assert len(got["events"]) > 40 and got["events"][-1]["finish_reason"] == "length"
    assert triton_server.proc.poll() is None
    status, answer = post(door, "/v2/models/ensemble/generate", b'{"text_input": "' + b"[" * 500 + b'", "max_tokens": 1}')
    assert status == 200, answer    # brackets inside a string are text, not nesting


def test_stream_true_on_generate_is_refused_before_triton_runs_it(triton_server, door):
    """2.51 answers a streamed request on /generate with an error at once while the generation runs on unread; a
    client repeating that (genai-perf's `--endpoint-type generate --streaming`) left a soak's engine busy with work
    nobody read. The door refuses it and Triton never counts it."""
    def ensemble_requests() -> int:
        with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/ensemble/stats", timeout=10) as r:
            return json.load(r)["model_stats"][0]["inference_stats"]["success"]["count"]
    before = ensemble_requests()
    for body in (b'{"text_input": "hi", "stream": true, "max_tokens": 8}', b'{"text_input": ["hi"], "stream" : [ true ]}'):
        status, answer = post(door, "/v2/models/ensemble/generate", body)
        assert status == 400 and json.loads(answer)["error"].startswith("stream=true needs the generate_stream route"), \
            answer
    assert ensemble_requests() == before
    status, answer = post(door, "/v2/models/ensemble/generate", b'{"text_input": "\\"stream\\": true", "max_tokens": 2}')
    assert status == 200 and json.loads(answer)["text_output"], answer     # the words in a prompt are text
    events = http_generate(door, PROMPT, stream=True, max_tokens=4)        # the streaming route takes it
    assert events[-1]["finish_reason"] == "length"


def test_only_the_client_routes_are_relayed(door):
    for path in ("/v2/repository/index", "/v2/repository/models/ensemble/unload", "/v2/systemsharedmemory/status",
                 "/v2/trace/setting", "/v2/logging", "/v2/models/ensemble/load"):
        status, answer = post(door, path, b"{}")
        assert status == 404 and json.loads(answer)["error"].endswith("is not served on this port"), path
    request = urllib.request.Request(f"http://{door}/v2/models/ensemble", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 405
    status, answer = post(door, "/v2/models/ensemble/generate", b"x", {"Content-Encoding": "gzip"})
    assert status == 415 and b"uncompressed" in answer
    # a body announced past the bound is refused from its Content-Length, before a byte of it is read
    import http.client
    host, port = door.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v2/models/ensemble/generate")
    conn.putheader("Content-Length", str((64 << 20) + 1))
    conn.endheaders(b'{"text_input": "')
    answer = conn.getresponse()
    assert answer.status == 413 and b"larger than 67108864 bytes" in answer.read()
    conn.close()


@pytest.fixture(scope="module")
def keyed_door(triton_server, tmp_path_factory):
    """A front door with a keys file: a key without limits, one of 2 requests a minute, one of 60 tokens a minute."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("sk-relay name=relay\nsk-twice name=twice rpm=2\nsk-tokens name=tokens tpm=60\n")
    port = free_ports(1)[0]
    proc = launch.start_front_door(triton_server, port, str(keys))
    yield f"127.0.0.1:{port}"
    launch.stop_front_door(proc)


def test_with_a_keys_file_the_v2_routes_want_a_key_but_health(keyed_door):
    url = keyed_door
    with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=10) as r:
        assert r.status == 200
    body = json.dumps({"text_input": PROMPT, "max_tokens": 2}).encode()
    status, answer = post(url, "/v2/models/ensemble/generate", body)
    assert status == 401 and b"API key" in answer
    status, _ = post(url, "/v2/models/ensemble/generate", body, {"Authorization": "Bearer sk-relay"})
    assert status == 200


def test_the_v2_routes_count_against_the_keys_limits(triton_server, keyed_door):
    """A key's requests a minute hold on the v2 routes as on OpenAI's (429 with Retry-After), and a token limit
    counts the model's own counts: the relay asks for them and takes them out of the answer again, streamed or
    whole, so the client reads what Triton's own port gives."""
    url = keyed_door
    same = {"max_tokens": 8, "ignore_eos": True, "exclude_input_in_output": True}
    body = json.dumps({"text_input": PROMPT, **same}).encode()
    twice = {"Authorization": "Bearer sk-twice"}
    assert [post(url, "/v2/models/ensemble/generate", body, twice)[0] for _ in range(2)] == [200, 200]
    request = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", data=body, headers=twice)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 429 and 1 <= int(refused.value.headers["Retry-After"]) <= 60
    assert "2 requests per minute" in json.loads(refused.value.read())["error"]

    direct = http_generate(triton_server.http_url, PROMPT, **same, return_num_input_tokens=True,
                           return_num_output_tokens=True)[0]
    per_request = direct["num_input_tokens"] + direct["num_output_tokens"]
    tokens = {"Authorization": "Bearer sk-tokens"}
    status, whole = post(url, "/v2/models/ensemble/generate", body, tokens)
    assert status == 200 and json.loads(whole)["text_output"] == direct["text_output"]
    assert not {"num_input_tokens", "num_output_tokens"} & set(json.loads(whole))
    stream_body = json.dumps({"text_input": PROMPT, **same, "stream": True}).encode()
    status, streamed = post(url, "/v2/models/ensemble/generate_stream", stream_body, tokens)
    events = [json.loads(line[5:]) for line in streamed.decode().splitlines() if line.startswith("data:")]
    assert status == 200 and "".join(e["text_output"] for e in events) == direct["text_output"]
    assert not any({"num_input_tokens", "num_output_tokens"} & set(e) for e in events)
    admitted = 2
    while post(url, "/v2/models/ensemble/generate", body, tokens)[0] == 200:
        admitted += 1
        assert admitted < 20, "the token limit never refused"
    assert admitted == -(-60 // per_request)      # admitted while the minute's 60 tokens were not all used


@pytest.mark.unit
def test_token_counts_are_read_and_taken_out_of_events_cut_anywhere():
    """generate_stream's events arrive in chunks cut at any byte: each event is rewritten whole, the counts read
    once each (TRT-LLM's tokens so far: the last; vLLM's new tokens: summed), and the bytes that are not counts pass
    as they are."""
    from trellm_openai.relay import TokenCounts
    events = [{"text_output": "a", "num_input_tokens": 5, "num_output_tokens": n} for n in (1, 2, 3)]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    for cut in range(1, len(stream)):
        for cumulative, output in ((True, 3), (False, 6)):
            counts = TokenCounts(cumulative, strip=True)
            out = counts.events(stream[:cut]) + counts.events(stream[cut:]) + counts.events(b"", end=True)
            assert out == b"data: {\"text_output\": \"a\"}\n\n" * 3, (cut, out)
            assert counts.total() == 5 + output
    kept = TokenCounts(True, strip=False)
    assert kept.events(stream) == stream and kept.total() == 8


def test_a_bad_connection_costs_the_door_one_log_line(triton_server, tmp_path):
    """sglang-router opens each worker with an HTTP/2 prior-knowledge preface: answered 400, logged in one line
    (aiohttp's default put a traceback in the log for each)."""
    port = free_ports(1)[0]
    log = tmp_path / "door.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trellm_openai", "--triton-url", triton_server.grpc_url,
                                 "--triton-http-url", triton_server.http_url, "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert "OpenAI-compatible API" in proc.stdout.readline()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                assert b" 400 Bad Request" in s.recv(100)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert "Traceback" not in log.read_text()
    assert len([line for line in lines if "BadHttpMessage" in line or "BadStatusLine" in line
                or "HttpProcessingError" in line]) == 3, lines


@pytest.mark.unit
def test_a_client_gone_mid_answer_is_one_log_line():
    """aiohttp logs a handler whose write found the client gone ("Cannot write to closing transport", seen in a
    soak through the relay) with a traceback; the door's filter makes it one line, and leaves other errors alone."""
    import logging
    from aiohttp.client_exceptions import ClientConnectionResetError
    from trellm_openai.relay import OneLineBadRequests

    def record(exc):
        try:
            raise exc
        except Exception:
            return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                     ("127.0.0.1",), sys.exc_info())
    gone = record(ClientConnectionResetError("Cannot write to closing transport"))
    assert OneLineBadRequests().filter(gone) and gone.exc_info is None
    assert "went away" in gone.getMessage() and "127.0.0.1" in gone.getMessage()
    other = record(KeyError("x"))
    assert OneLineBadRequests().filter(other) and other.exc_info is not None


@pytest.mark.unit
def test_tritonserver_gone_mid_stream_is_an_error_event_and_one_log_line(caplog):
    """An upstream that dies mid-answer (tritonserver crashing under a relayed stream): the client's stream gets an
    error event, as Triton's own errors come, and the door logs one line instead of an 'internal error' traceback."""
    import asyncio
    from aiohttp import ClientSession, web
    from trellm_openai.keys import KeyStore
    from trellm_openai.relay import Relay

    async def dying_upstream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text_output": "Hel"}\n\n')
        await asyncio.sleep(0.05)
        request.transport.close()     # no closing chunk: the body ends early
        return response

    async def run():
        up_port, door_port = free_ports(2)
        upstream = web.Application()
        upstream.router.add_post("/v2/models/ensemble/generate_stream", dying_upstream)
        relay = Relay(f"127.0.0.1:{up_port}", KeyStore(None), 64)
        door = web.Application()
        door.router.add_route("*", "/v2{tail:.*}", relay.handle)
        runners = [web.AppRunner(upstream), web.AppRunner(door)]
        for runner, port in zip(runners, (up_port, door_port)):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{door_port}/v2/models/ensemble/generate_stream",
                                        json={"text_input": "Hi"}) as r:
                    return r.status, await r.read()
        finally:
            await relay.close()
            for runner in runners:
                await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="trellm.openai"):
        status, body = asyncio.run(run())
    events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
    assert status == 200 and events[0] == {"text_output": "Hel"} and "went away" in events[-1]["error"]
    lines = [r for r in caplog.records if r.name == "trellm.openai"]
    assert len(lines) == 1 and "mid-answer" in lines[0].getMessage() and lines[0].exc_info is None


@pytest.mark.unit
def test_the_depth_scan_agrees_with_a_parse():
    """nests_deeper_than reads depth from bytes: strings (with escaped quotes and backslashes) are skipped."""
    import random
    rng = random.Random(3)

    def value(levels):
        if levels == 0 or rng.random() < 0.3:
            return rng.choice(['a\\"[{', "\\\\", "[", 1, None, "x]", "plain"])
        if rng.random() < 0.5:
            return [value(levels - 1) for _ in range(rng.randint(0, 3))]
        return {f'k{i}"{{': value(levels - 1) for i in range(rng.randint(0, 3))}

    def depth(v):
        if not isinstance(v, (dict, list)):
            return 0
        return 1 + max((depth(x) for x in (v.values() if isinstance(v, dict) else v)), default=0)
    for _ in range(2000):
        v = value(rng.randint(0, 9))
        text = json.dumps(v).encode()
        for limit in (0, 1, 2, 4):
            assert nests_deeper_than(text, limit) == (depth(v) > limit), text
    assert not nests_deeper_than(os.urandom(0), 0)
