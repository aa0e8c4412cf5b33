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
    """The launcher's front door (`python -m trellm_openai` as `launch --openai-port` starts it), on a free port,
    reading `auto` tool calls in the default model's format."""
    port = free_ports(1)[0]
    return launch.start_front_door(triton_server, port, None if keys_file is None else str(keys_file), "hermes"), \
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
    second = "A list is"
    alone = [client.completions.create(model="ensemble", prompt=p, max_tokens=6, temperature=0) for p in
             (PROMPT, second)]
    batch = client.completions.create(model="ensemble", prompt=[PROMPT, second], max_tokens=6, temperature=0, n=2)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == \
        [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    r = post(door, {"model": "ensemble", "prompt": ["a", "word " * 5000], "max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


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
    forced = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={"17": 100}).choices[0].logprobs     # biased before logprobs
    assert len(set(forced.tokens)) == 1 and all(lp > -1e-3 for lp in forced.token_logprobs), forced


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


WEATHER = [{"type": "function", "function": {
                "name": "get_weather", "description": "Today's weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                               "required": ["city"], "additionalProperties": False}}},
           {"type": "function", "function": {"name": "get_time"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def template_tokens(model_path, messages, tools) -> int:
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(model_path).apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False))


@pytest.mark.server
def test_tool_calls_for_each_tool_choice_streamed_and_not(door, default_model_path):
    """Named and required calls are constrained to the tools' schemas; `auto` reads the model's own call format
    (hermes: a guided regex makes this small model write one); the tools reach the chat template, and a call's
    result goes back to the model in the history, rendered as transformers renders it."""
    client = sdk(door)
    named = dict(model="ensemble", messages=ASK, tools=WEATHER, max_tokens=40, temperature=1.0, seed=3,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**named)
    assert out.usage.prompt_tokens == template_tokens(default_model_path, ASK, WEATHER)
    choice = out.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert choice.message.content is None and choice.finish_reason == "stop" and call.id.startswith("call_")
    parts = [c.choices[0].delta.tool_calls[0] for c in client.chat.completions.create(**named, stream=True)
             if c.choices and c.choices[0].delta.tool_calls]
    assert parts[0].function.name == "get_weather" and parts[0].id and all(p.index == 0 for p in parts)
    assert "".join(p.function.arguments for p in parts) == call.function.arguments      # the same seed

    required = client.chat.completions.create(**{**named, "tool_choice": "required", "max_tokens": 100,
                                                 "parallel_tool_calls": False})
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1, required
    for c in calls:
        assert c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments), dict)

    said = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    auto = dict(model="ensemble", messages=ASK, tools=WEATHER, max_tokens=120, temperature=0,
                extra_body={"guided_regex": said})
    out = client.chat.completions.create(**auto)
    assert out.choices[0].message.content == "Checking. " and out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(client.chat.completions.create(**auto, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking. "
    streamed_calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed_calls] == \
        [("get_weather", call.function.arguments)] and chunks[-1].choices[0].finish_reason == "tool_calls"

    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    follow = client.chat.completions.create(model="ensemble", messages=history, tools=WEATHER, tool_choice="none",
                                            max_tokens=6, temperature=0)
    rendered = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
    assert follow.usage.prompt_tokens == template_tokens(default_model_path, rendered, WEATHER)
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason == "length"
    bad = httpx.post(door + "/v1/chat/completions", timeout=30, json={
        "model": "ensemble", "messages": ASK, "tools": WEATHER, "tool_choice": {"type": "function",
                                                                              "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice" and "get_time" in bad.text


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
    ({"model": "ensemble", "prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "ensemble", "prompt": "a", "logit_bias": {"99999": 1}}, 400, None),   # the engine's vocabulary check
    ({"model": "ensemble", "prompt": "a", "tools": WEATHER}, 400, "tools"),
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
    assert protocol.parse(routed, chat=False).prompts == ["p"]
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


def test_tool_choice_becomes_a_guide_and_bad_tools_are_named():
    chat = {"model": "m", "messages": ASK, "tools": WEATHER}
    named = protocol.parse({**chat, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, True)
    assert json.loads(named.params["guided_decoding_guide"]) == WEATHER[0]["function"]["parameters"]
    required = protocol.parse({**chat, "tool_choice": "required", "parallel_tool_calls": False}, True)
    schema = json.loads(required.params["guided_decoding_guide"])
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    assert "guided_decoding_guide" not in protocol.parse({**chat, "tool_choice": "none"}, True).params
    assert protocol.parse(chat, True, tool_call_parser="hermes").tools.mode == "auto"
    bad_args = [ASK[0], {"role": "assistant", "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": "{"}}]}]
    for body, param, words in [
            ({}, "tool_choice", "--tool-call-parser"),
            ({"tool_choice": "bogus"}, "tool_choice", '"bogus"'),
            ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tools": [{"type": "x"}]}, "tools", "tools[0]"),
            ({"tools": [WEATHER[0], WEATHER[0]], "tool_choice": "required"}, "tools", "names two tools"),
            ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"uniqueItems": True}}}],
              "tool_choice": "required"}, "tools", "tools[0].function.parameters/uniqueItems"),
            ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "combined"),
            ({"tool_choice": "required", "logprobs": True}, "logprobs", "tool calls"),
            ({"tool_choice": "none", "messages": bad_args}, "messages[1].tool_calls[0].function.arguments", "JSON")]:
        with pytest.raises(protocol.APIError) as e:
            protocol.parse({**chat, **body}, True)
        assert e.value.param == param and words in e.value.message, (body, e.value.message)


def test_required_calls_keep_each_tools_definitions_and_are_checked_whole():
    """Pydantic-made parameters (the SDK's pydantic_function_tool) reference their own $defs: moved under the list
    `required` sends, they still compile, even where two tools name a definition alike. What the list adds (depth,
    size) is checked before the request goes out, named as the tools'."""
    import xgrammar
    from trellm_openai.tools import parse_tool_choice

    def tool(name, field):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
            "$defs": {"Place": {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}}}}}
    choice = parse_tool_choice({"tools": [tool("a", "city"), tool("b", "street")], "tool_choice": "required"}, None)
    schema = choice.guide["guided_json"]
    assert sorted(schema["$defs"]) == ["a.Place", "b.Place"]
    xgrammar.Grammar.from_json_schema(json.dumps(schema))          # compiles: every $ref resolves
    deep = {"type": "object"}
    for _ in range(30):
        deep = {"type": "object", "properties": {"x": deep}}
    for tools, words in (([{"type": "function", "function": {"name": "d", "parameters": deep}}], "deeper than 32"),
                         ([tool("r", "c") | {"function": {"name": "r", "parameters": {"$ref": "#"}}}], "$ref '#'")):
        with pytest.raises(protocol.APIError) as e:
            protocol.parse({"model": "m", "messages": ASK, "tools": tools, "tool_choice": "required"}, True)
        assert e.value.param == "tools" and words in e.value.message, e.value.message
    nested = [ASK[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]
    with pytest.raises(protocol.APIError) as e:
        protocol.parse({"model": "m", "messages": nested, "tools": WEATHER, "tool_choice": "none"}, True)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert protocol.parse({"model": "m", "messages": ASK, "tools": WEATHER, "tool_choice": "required",
                           "parallel_tool_calls": None}, True).tools.parallel
    from trellm_openai.tools import ToolChoice, parse_answer
    assert len(parse_answer(ToolChoice("auto", tuple(WEATHER), parallel=False), CALL + CALL).calls) == 1


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@pytest.mark.parametrize("mode, text, reason", [
    ("auto", "Let me look. " + CALL + "\n" + CALL.replace("Rome", "Paris"), "stop"),
    ("auto", CALL, "stop"),
    ("auto", "a < b, and <tool_ca", "length"),                      # held back while it could start a call
    ("auto", "<tool_call>{not json}</tool_call>", "stop"),          # malformed: stays content
    ("auto", CALL.replace("get_weather", "launch"), "stop"),        # none of the tools: stays content
    ("auto", CALL.replace("Rome", "</tool_call> Rome"), "stop"),    # the closing tag inside an argument
    ("auto", CALL[:-len("</tool_call>")], "stop"),                  # left unclosed by a stop
    ("required", "[]", "stop"),
    ("auto:llama3_json", ' {"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", '
                         '"parameters": {}}', "stop"),
    ("auto:llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}};', "stop"),
    ("auto:llama3_json", 'Rome is {"name": "get_time"}', "stop"),              # not a call: content
    ("auto:llama3_json", '{"name": "get_time", "parameters": {}} and more', "stop"),
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]',
     "stop"),
    ("required", '[{"name": "get_ti', "length"),
    ("named", '{"city": "Paris"}', "stop")])
def test_streamed_tool_calls_join_to_the_whole_answer(mode, text, reason):
    """However the answer's text arrives, the streamed content and calls are the whole answer's, and no delta
    carries text that later turns out to be a call."""
    import random
    from trellm_openai.tools import CallStream, ToolChoice, final_message
    mode, _, parser = mode.partition(":")
    choice = ToolChoice(mode, tuple(WEATHER), "get_weather" if mode == "named" else None, parser=parser or "hermes")
    whole, whole_reason = final_message(choice, text, reason)
    rng = random.Random(0)
    for _ in range(20):
        stream, deltas, at = CallStream(choice), [], 0
        while at < len(text):
            at = min(len(text), at + rng.randint(1, 6))
            got, _ = stream.deltas(text[:at], None)
            deltas += got
        got, streamed_reason = stream.deltas(text, reason)
        deltas += got
        calls = [t for d in deltas for t in d.get("tool_calls", [])]
        if mode == "named":
            calls = [{"function": {"name": calls[0]["function"]["name"],
                                   "arguments": "".join(c["function"]["arguments"] for c in calls)}}]
        assert "".join(d.get("content") or "" for d in deltas) == (whole["content"] or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
        assert streamed_reason == whole_reason and deltas[0]["role"] == "assistant"
    assert whole_reason == ("tool_calls" if mode != "named" and whole.get("tool_calls") else reason)
    assert bool(whole.get("tool_calls")) == (mode == "named" or (reason == "stop" and "launch" not in text and
                                                                 "not json" not in text and text != "[]" and
                                                                 "Rome is" not in text and "more" not in text))


def test_several_prompts_are_choices_in_order_and_a_refused_one_fails_before_any_answer():
    """prompt p's sample j is choice p * n + j, whatever order the streams answer in; usage counts each prompt
    once; a prompt the server refuses makes the request a 400 with nothing answered (its mates' streams closed)."""
    from aiohttp.test_utils import TestClient, TestServer
    from trellm_client.client import Chunk
    from trellm_openai.server import FrontDoor, make_app
    closed = []

    class Streams:
        async def stream_chunks(self, prompt, messages, **params):
            try:
                if prompt == "bad":
                    await asyncio.sleep(0.05)              # refused after its mates' first responses came
                    raise RuntimeError("the prompt is too long")
                if prompt == "slow":
                    await asyncio.sleep(5)                 # a long prefill: the refusal must not wait for it
                for k in range(3):
                    for j in range(2):
                        await asyncio.sleep(0.01 * (len(prompt) % 3))
                        yield Chunk(text=f"{prompt}.{j}.{k} ", sequence_index=j, num_input_tokens=len(prompt),
                                    num_output_tokens=k + 1, finish_reason="length" if k == 2 else "",
                                    final=k == 2 and j == 1)
            finally:
                closed.append(prompt)

    async def run():
        door = FrontDoor("localhost:1")
        door.clients["m"] = Streams()

        async def models():
            return {"m": ("m", None)}
        door.models = models
        async with TestClient(TestServer(make_app(door))) as c:
            body = {"model": "m", "prompt": ["a", "bb", "ccc"], "n": 2}
            whole = await (await c.post("/v1/completions", json=body)).json()
            streamed = await (await c.post("/v1/completions", json={**body, "stream": True})).text()
            refused = await c.post("/v1/completions", json={**body, "prompt": ["a", "bad"]})
            start = time.monotonic()
            assert (await c.post("/v1/completions", json={**body, "prompt": ["slow", "bad"]})).status == 400
            return whole, streamed, refused.status, await refused.json(), time.monotonic() - start
    whole, streamed, status, refused, refusal_s = asyncio.run(run())
    want = [" ".join(f"{p}.{j}.{k}" for k in range(3)) + " " for p in ("a", "bb", "ccc") for j in range(2)]
    assert [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])] == want
    assert whole["usage"]["prompt_tokens"] == 6 and whole["usage"]["completion_tokens"] == 18
    events = [json.loads(line[6:]) for line in streamed.split("\n\n") if line.startswith("data: {")]
    joined = {}
    for e in events:
        for c in e["choices"]:
            joined[c["index"]] = joined.get(c["index"], "") + c["text"]
    assert [joined[i] for i in range(6)] == want
    assert status == 400 and "too long" in refused["error"]["message"] and closed.count("a") == 3
    assert refusal_s < 2 and "slow" in closed
