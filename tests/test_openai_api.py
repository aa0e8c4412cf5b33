"""The OpenAI-compatible front door (openai_api/) against a real tritonserver: the `openai` SDK on every endpoint,
answers equal to the ensemble's over gRPC, errors in OpenAI's shape with honest status codes, API keys and per-key
limits, and a client that leaves mid-stream freeing its engine request."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import time
import urllib.request

import httpx2 as httpx   # the HTTP client the openai SDK (pinned) brings
import pytest

from conftest import free_ports
from trellm_backend.tools import launch
from trellm_backend.tools.launch import stop_front_door
from trellm_client.client import LLMClient
from trellm_openai import protocol
from trellm_openai.keys import Key, Limiter, parse_keys

PROMPT = "The import statement"
MESSAGES = [{"role": "user", "content": "What is a list?"}]
KEYS = """# name and limits per key
sk-a name=a rpm=2
sk-b name=b
sk-t name=t tpm=30
sk-c name=c concurrency=1
"""


def start_front_door(triton_server, keys_file=None) -> tuple[subprocess.Popen, str]:
    """The launcher's front door (`python -m trellm_openai` as `launch --openai-port` starts it), on a free port."""
    port = free_ports(1)[0]
    return launch.start_front_door(triton_server, port, None if keys_file is None else str(keys_file)), \
        f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def door(triton_server):
    proc, url = start_front_door(triton_server)
    yield url
    stop_front_door(proc)


@pytest.fixture(scope="module")
def keyed_door(triton_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    proc, url = start_front_door(triton_server, keys)
    yield url, keys
    stop_front_door(proc)


def sdk(url, key="none", async_=False):
    import openai
    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=url + "/v1", api_key=key, max_retries=0)


def ensemble_text(triton_server, **kw) -> str:
    with LLMClient(triton_server.grpc_url) as c:
        if "messages" in kw:
            return "".join(c.chat(kw.pop("messages"), **kw))
        return c.generate(kw.pop("prompt"), exclude_input_in_output=True, **kw)


@pytest.mark.server
def test_sdk_sync_and_async_streaming_and_not_equal_the_ensemble(triton_server, door):
    want = ensemble_text(triton_server, prompt=PROMPT, max_tokens=24)
    want_chat = ensemble_text(triton_server, messages=MESSAGES, max_tokens=24)
    client = sdk(door)
    assert [m.id for m in client.models.list().data] == ["ensemble"]
    done = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=24, temperature=0)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens > 0
    streamed = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    chat = client.chat.completions.create(model="ensemble", messages=MESSAGES, max_completion_tokens=24, temperature=0)
    assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="ensemble", messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat
    assert chunks[-1].choices[0].finish_reason == "length"

    async def async_calls():
        a = sdk(door, async_=True)
        done = await a.chat.completions.create(model="ensemble", messages=MESSAGES, max_tokens=24, temperature=0)
        parts = [c.choices[0].text async for c in await a.completions.create(
            model="ensemble", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)]
        return done.choices[0].message.content, "".join(parts)
    assert asyncio.run(async_calls()) == (want_chat, want)


@pytest.mark.server
def test_parallel_samples_usage_and_stop(door):
    client = sdk(door)
    out = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=12, n=3, seed=5, temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1, "samples with seeds seed, seed+1, seed+2 differ"
    assert out.usage.completion_tokens == 36 and out.usage.total_tokens == 36 + out.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model="ensemble", messages=MESSAGES, max_tokens=6, n=2, seed=1,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}
    free = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free.strip()[:3]
    cut = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free[:free.index(stop)]
    more = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 5, "top_k": 5,
                                                 "repetition_penalty": 1.1})
    assert more.usage.completion_tokens == 5


@pytest.mark.server
def test_logprobs_in_both_shapes(door):
    client = sdk(door)
    out = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(logprob)   # greedy: the best
    chat = client.chat.completions.create(model="ensemble", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


@pytest.mark.server
def test_response_format_constrains_the_answer(door):
    client = sdk(door)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="ensemble", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    answer = json.loads(out.choices[0].message.content)
    assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 9
    assert out.choices[0].finish_reason == "stop"
    r = post(door, {"model": "ensemble", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert r.status_code == 400 and "'uniqueItems'" in r.json()["error"]["message"], r.text


def post(url, body, key=None, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", content=raw if raw is not None else json.dumps(body),
                      headers=headers, timeout=60)


ERROR_CASES = [  # body, status, param
    ({"model": "nope", "prompt": "a"}, 404, "model"),
    ({"model": "ensemble", "prompt": "a", "max_tokens": 10 ** 30}, 400, "max_tokens"),
    ({"model": "ensemble", "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "ensemble", "prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"model": "ensemble", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "ensemble", "prompt": "a", "n": 0}, 400, "n"),
    ({"model": "ensemble", "prompt": "a", "stop": [1, 2]}, 400, "stop"),
    ({"model": "ensemble", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": "ensemble", "prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"model": "ensemble", "prompt": "a", "unknown_knob": 1}, 400, "unknown_knob"),
    ({"model": "ensemble", "prompt": "a", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": "ensemble", "prompt": "a", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"model": "ensemble", "prompt": ""}, 400, "prompt"),
    ({"model": "ensemble"}, 400, "prompt"),
    ({"prompt": "a"}, 400, "model"),
    ([1, 2, 3], 400, None),
]


@pytest.mark.server
def test_errors_have_openai_shape_and_status_and_everything_keeps_serving(triton_server, door):
    for body, status, param in ERROR_CASES:
        r = post(door, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"], body
    for raw, status in ((b"{", 400), (b"[" * 50_000, 400), (b'{"a": ' * 50_000, 400), (b"\xff\xfe", 400),
                        (b'{"model": "ensemble", "prompt": "' + b"a" * (5 << 20) + b'"}', 413)):
        r = post(door, None, raw=raw)
        assert r.status_code == status and r.json()["error"]["message"], (raw[:20], r.text[:200])
    chat = httpx.post(door + "/v1/chat/completions", json={"model": "ensemble", "messages": "hi"}, timeout=30)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    # a value only the server's own checks catch (the prompt's length against the context) is a 400 too
    r = post(door, {"model": "ensemble", "prompt": "word " * 5000, "max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert sdk(door).completions.create(model="ensemble", prompt="a", max_tokens=2).usage.completion_tokens == 2
    assert ensemble_text(triton_server, prompt="a", max_tokens=2)
    assert httpx.get(door + "/health").json() == {"status": "ok"}


@pytest.mark.server
def test_keys_and_per_key_limits(keyed_door):
    url, keys_file = keyed_door
    body = {"model": "ensemble", "prompt": PROMPT, "max_tokens": 2}
    for key in (None, "sk-wrong", "sk-a "):
        r = post(url, body, key=key) if key != "sk-a " else httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": "Basic sk-a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    # rpm: two requests, then 429 with when to retry; key b is not affected
    assert [post(url, body, "sk-a").status_code for _ in range(2)] == [200, 200]
    r = post(url, body, "sk-a")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 60 and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    assert all(post(url, body, "sk-b").status_code == 200 for _ in range(4))
    # tpm: a request is admitted while the minute's tokens last, and counted in full when it ends
    big = {**body, "max_tokens": 40, "ignore_eos": True}
    assert post(url, big, "sk-t").status_code == 200
    r = post(url, body, "sk-t")
    assert r.status_code == 429 and r.headers["x-ratelimit-remaining-tokens"] == "0"
    # concurrency: a second stream while the first runs is refused, and admitted once it ended
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": "Bearer sk-c"},
                      json={**big, "max_tokens": 2000, "stream": True}, timeout=60) as first:
        lines = first.iter_lines()     # held: a dropped line iterator closes the stream (the client leaves)
        line = next(lines)
        assert first.status_code == 200 and line.startswith("data: "), line
        second = post(url, body, "sk-c")
        assert second.status_code == 429, (line, second.text)
    deadline = time.time() + 5
    while post(url, body, "sk-c").status_code != 200:
        assert time.time() < deadline, "the stream's slot was not given back"
    # the keys file is read again when it changes: a new key works without a restart
    keys_file.write_text(KEYS + "sk-new name=new\n")
    time.sleep(1.2)
    assert post(url, body, "sk-new").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert 'trellm_openai_rate_limited_total{key="a"} 1' in metrics
    assert re.search(r'trellm_openai_requests_total\{key="b",endpoint="/v1/completions",status="200"\} 4', metrics)
    assert re.search(r'trellm_openai_tokens_total\{key="t",kind="completion"\} 40', metrics)


def running_requests(triton_server) -> float:
    with urllib.request.urlopen(f"http://localhost:{triton_server.metrics_port}/metrics") as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r'^vllm:num_requests_running\{[^}]*\} (\S+)', text, re.M))


@pytest.mark.server
def test_a_client_that_leaves_mid_stream_frees_its_engine_request(triton_server, door):
    for stream in (True, False):
        body = {"model": "ensemble", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": stream}
        with httpx.Client(timeout=60) as c:
            try:
                with c.stream("POST", door + "/v1/completions", json=body, timeout=1.0 if not stream else 60) as r:
                    if stream:
                        next(r.iter_lines())
            except httpx.ReadTimeout:
                pass   # the non-streamed request: left after a second
            deadline = time.time() + 3
            while running_requests(triton_server) > 0:
                assert time.time() < deadline, f"stream={stream}: the engine still runs the abandoned request"
                time.sleep(0.1)

    def leave_early(_):
        body = {"model": "ensemble", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", door + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
    with concurrent.futures.ThreadPoolExecutor(16) as pool:    # a storm of clients that leave
        list(pool.map(leave_early, range(32)))
    deadline = time.time() + 3
    while running_requests(triton_server) > 0:
        assert time.time() < deadline, "abandoned streams still run in the engine"
        time.sleep(0.1)
    assert sdk(door).completions.create(model="ensemble", prompt="a", max_tokens=2).usage.completion_tokens == 2


# -- without a server ----------------------------------------------------------------------------------------------
def test_keys_file_lines_are_checked_by_name():
    keys = parse_keys("sk-1 name=x rpm=3 tpm=100 concurrency=2  # comment\n\n# only a comment\nsk-2\n")
    assert sorted(keys.values(), key=lambda k: k.name) == [Key("key-4"), Key("x", 3, 100, 2)]
    assert all(len(d) == 32 for d in keys)   # held as digests, never as the keys
    for bad, why in (("sk-1 rpm=0", "rpm='0' must be a positive integer"), ("sk-1 burst=3", "'burst=3' is not")):
        with pytest.raises(ValueError, match=re.escape(f"keys.txt:1: {why}")):
            parse_keys(bad, "keys.txt")


def test_limiter_counts_tokens_when_a_request_ends_and_frees_its_stream():
    limiter, key = Limiter(), Key("k", tpm=10, concurrency=1)
    assert limiter.admit(key).allowed
    assert not limiter.admit(key).allowed          # one stream at a time
    limiter.finish(key, 25)                       # more than the minute's budget: counted in full
    refused = limiter.admit(key)
    assert not refused.allowed and 1 <= refused.retry_after_s <= 60 and "tokens" in refused.reason


def test_openai_bodies_map_to_the_field_table():
    g = protocol.parse({"model": "m", "prompt": "p", "max_completion_tokens": 7, "stop": "x", "seed": 3,
                        "top_k": 4, "user": "u"}, chat=False)
    assert g.params["max_tokens"] == 7 and g.params["stop_words"] == ["x"] and g.params["seed"] == 3
    assert g.params["temperature"] == 1.0 and g.params["top_k"] == 4    # OpenAI's default temperature
    with pytest.raises(protocol.APIError) as e:
        protocol.parse({"model": "m", "prompt": "p", "max_completion_tokens": 0}, chat=False)
    assert e.value.param == "max_completion_tokens" and "max_completion_tokens must be in" in e.value.message
    chat = protocol.parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]}],
                           "logprobs": True, "top_logprobs": 2}, chat=True)
    assert chat.messages == [{"role": "user", "content": "ab"}] and chat.params["logprobs"] == 2


def test_keys_a_router_adds_are_taken_at_the_value_this_server_behaves_as():
    """SGLang's router adds its own keys to every body it forwards: at their defaults they change nothing here and
    pass; another value would, and is refused by name."""
    routed = {"model": "m", "prompt": "p", "skip_special_tokens": True, "no_stop_trim": False,
              "return_hidden_states": False}
    assert protocol.parse(routed, chat=False).prompt == "p"
    with pytest.raises(protocol.APIError) as e:
        protocol.parse({**routed, "no_stop_trim": True}, chat=False)
    assert e.value.param == "no_stop_trim" and "no_stop_trim=true is not supported; only false" in e.value.message


def test_a_failure_after_the_answer_began_is_an_error_event_or_a_500():
    """The server fails a request after its first response (its model process died): a stream, whose headers are
    out, gets the error as an event and still ends with [DONE]; a whole answer gets a 500 in OpenAI's shape."""
    from aiohttp.test_utils import TestClient, TestServer
    from trellm_client.client import Chunk
    from trellm_openai.server import FrontDoor, make_app

    class FailingStream:
        async def stream_chunks(self, prompt, messages, **params):
            yield Chunk(text="Hello", num_input_tokens=3, num_output_tokens=1)
            raise RuntimeError("the llm stub died")

    async def run():
        door = FrontDoor("localhost:1")        # never dialled: the model list and the stream are stand-ins
        door.clients["m"] = FailingStream()

        async def models():
            return {"m": ("m", None)}
        door.models = models
        async with TestClient(TestServer(make_app(door))) as c:
            streamed = await c.post("/v1/completions", json={"model": "m", "prompt": "p", "stream": True})
            whole = await c.post("/v1/completions", json={"model": "m", "prompt": "p"})
            return streamed.status, await streamed.text(), whole.status, await whole.json()
    status, body, whole_status, whole = asyncio.run(run())
    events = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
    assert status == 200 and events[0]["choices"][0]["text"] == "Hello"
    assert "the llm stub died" in events[-1]["error"]["message"] and body.endswith("data: [DONE]\n\n")
    assert whole_status == 500 and whole["error"]["type"] == "server_error"
