"""End to end on a real tritonserver: client -> ensemble (preprocess -> llm) -> engine.

The text that comes back is compared with what Hugging Face transformers generates greedily from the same
weights, decoded by the same tokenizer."""
from __future__ import annotations

import concurrent.futures
import json
import queue
import time
import urllib.error

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from repository_helpers import greedy_texts
from trellm_client.client import LLMClient, http_generate, infer_input

pytestmark = pytest.mark.server

PROMPTS = ["The Python language", "A function definition", "Exceptions are raised when",
           "The import statement", "Lists", "class", "for loops iterate over the items of any sequence",
           "with statement"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(default_model_path):
    """transformers' greedy text for each prompt (stopping at EOS like the engine does)."""
    out = greedy_texts(default_model_path, PROMPTS, MAX_TOKENS)
    assert any(out.values()), "the reference produced no text at all"
    return out


def stream_deltas(url, prompt, **params):
    with LLMClient(url) as c:
        return list(c.stream(prompt, max_tokens=MAX_TOKENS, **params))


def test_grpc_stream_matches_transformers(triton_server, expected):
    deltas = stream_deltas(triton_server.grpc_url, PROMPTS[0])
    assert len(deltas) > 1, "a stream must arrive in several responses"
    assert "".join(deltas) == expected[PROMPTS[0]]
    assert not deltas[0].startswith(PROMPTS[0]), "the prompt must not be echoed in a stream"


def test_grpc_non_streaming_echoes_prompt_unless_excluded(triton_server, expected):
    with LLMClient(triton_server.grpc_url) as c:
        assert c.generate(PROMPTS[1], max_tokens=MAX_TOKENS, exclude_input_in_output=True) == expected[PROMPTS[1]]
        full = c.generate(PROMPTS[1], max_tokens=MAX_TOKENS)
    assert full == PROMPTS[1] + expected[PROMPTS[1]]


def test_eight_concurrent_streams(triton_server, expected):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: "".join(stream_deltas(triton_server.grpc_url, p)), PROMPTS))
    for p, text in zip(PROMPTS, results):
        assert text == expected[p], p


def test_http_generate_and_generate_stream(triton_server, expected):
    p = PROMPTS[2]
    one = http_generate(triton_server.http_url, p, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    assert len(one) == 1 and one[0]["text_output"] == expected[p]
    events = http_generate(triton_server.http_url, p, stream=True, max_tokens=MAX_TOKENS)
    assert len(events) > 1
    assert "".join(e.get("text_output", "") for e in events) == expected[p]


def _infer_error(url, inputs) -> str:
    """Send one streamed ensemble request; return the error message it gets."""
    client = grpcclient.InferenceServerClient(url)
    q = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("ensemble", inputs)
    result, error = q.get(timeout=60)
    client.stop_stream()
    client.close()
    assert error is not None, "a malformed request must get an error"
    return str(error)


def _input(name, value, dtype):
    return infer_input(grpcclient, name, np.array([[value]], dtype=dtype))


def _words(name, words):
    return infer_input(grpcclient, name, np.array([[w if isinstance(w, bytes) else w.encode() for w in words]],
                                                  dtype=np.object_))


def _text(prompt):
    return _input("text_input", prompt.encode(), np.object_)


@pytest.mark.parametrize("inputs, message", [
    (lambda: [_input("max_tokens", 5, np.int32)], "text_input"),
    (lambda: [_input("text_input", 3, np.int32)], "text_input"),
    (lambda: [_text("hello"), _input("max_tokens", 0, np.int32)], "max_tokens"),
    (lambda: [_text("hello"), _input("max_tokens", -3, np.int32)], "max_tokens"),
    (lambda: [_text("")], "empty"),
    (lambda: [_text("hello " * 3000)], "context length"),
    (lambda: [_text("x" * 70000)], "text_input has 70000 characters; at most 65536 are allowed"),
    (lambda: [_text("hello"), _input("top_p", 1.5, np.float32)], "top_p must be in (0, 1]"),
    (lambda: [_text("hello"), _input("min_p", -0.1, np.float32)], "min_p must be in [0, 1]"),
    (lambda: [_text("hello"), _input("repetition_penalty", 0.0, np.float32)],
     "repetition_penalty must be in (0, 100]"),
    (lambda: [_text("hello"), _input("presence_penalty", 9.0, np.float32)], "presence_penalty must be in"),
    (lambda: [_text("hello"), _input("min_length", -1, np.int32)], "min_length must be in [0, 1048576]"),
    (lambda: [_text("hello"), _input("num_return_sequences", 0, np.int32)],
     "num_return_sequences must be in [1, 16]"),
    (lambda: [_text("hello"), _input("beam_width", 4, np.int32)], "beam_width must be in [1, 1]"),
    (lambda: [_text("hello"), _input("end_id", 99999, np.int32)], "stop token ids"),
    (lambda: [_text("hello"), _input("seed", 1, np.uint64), _input("random_seed", 2, np.uint64)],
     "aliases"),
    (lambda: [_text("hello"), _words("bad_words", ["w"] * 1025)], "bad_words has 1025 entries; at most 1024"),
    (lambda: [_text("hello"), _words("bad_words", [b"\xff"])], "bad_words is not valid UTF-8"),
    (lambda: [_text("hello"), _words("stop_words", ["w"] * 65)], "stop_words / stop has 65 entries; at most 64"),
    (lambda: [_input("messages", b"[{\"role\": \"user\"}]", np.object_)], "messages[0]"),
    (lambda: [_input("messages", b"not json", np.object_)], "messages is not valid JSON"),
    (lambda: [_input("messages", b"[" * 20_000, np.object_)], "messages is not valid JSON"),
    (lambda: [_input("messages", b'[{"role": "assistant", "content": null, "tool_calls": ["abc"]}]', np.object_)],
     "messages[0].tool_calls[0] must be"),
    (lambda: [_text("hello"), _input("tools", b"[]", np.object_)], "tools go with messages"),
    (lambda: [_text("hello"), _input("logit_bias", b'{"5": 300}', np.object_)], "logit_bias values must be"),
    (lambda: [_text("hello"), _input("messages", b"[]", np.object_)], "not both"),
])
def test_malformed_requests_get_named_errors_while_others_stream(triton_server, expected, inputs, message):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        healthy = pool.submit(lambda: "".join(stream_deltas(triton_server.grpc_url, PROMPTS[3])))
        err = _infer_error(triton_server.grpc_url, inputs())
        assert message in err, err
        assert healthy.result(timeout=120) == expected[PROMPTS[3]]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    assert client.is_server_live() and client.is_model_ready("ensemble")


def test_a_heavy_request_does_not_hold_up_a_light_one(triton_server):
    """16 samples with the most bad words allowed, and a short request sent just after it: the short one's first
    token may wait for a step or two, not for the heavy request's preparation (27 s before the word lists were
    tokenized once per request, bounded, and looked up by table)."""
    import random
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12))) for _ in range(1024)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        heavy = pool.submit(lambda: LLMClient(triton_server.grpc_url).generate(
            "Once upon a time", max_tokens=64, num_return_sequences=16, temperature=1.0, bad_words=words))
        time.sleep(0.3)
        start = time.monotonic()
        with LLMClient(triton_server.grpc_url) as c:
            first = next(iter(c.stream_chunks(PROMPTS[0], max_tokens=4, stream=True)))
        ttft = time.monotonic() - start
        assert first.text and heavy.result(timeout=120)
    assert ttft < 2.0, f"the light request's first token took {ttft:.2f} s"


def test_http_error_is_a_clean_400(triton_server):
    with pytest.raises(urllib.error.HTTPError) as e:
        http_generate(triton_server.http_url, "hello", max_tokens=0)
    assert e.value.code == 400 and "max_tokens must be in [1, 1048576]" in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:      # a misspelt field is reported, not ignored
        http_generate(triton_server.http_url, "hello", max_tokns=5)
    assert e.value.code == 400 and "unknown request field(s) max_tokns" in json.loads(e.value.read())["error"]


def test_client_reports_a_server_that_is_down():
    from trellm_client.client import ServerUnavailable
    from conftest import free_ports
    with pytest.raises((ServerUnavailable, InferenceServerException)):
        with LLMClient(f"localhost:{free_ports(1)[0]}") as c:
            list(c.stream("hello"))
