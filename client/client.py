"""Python clients of the repository's `ensemble` (TRT-LLM-shaped contract): sync and asyncio over tritonclient
gRPC streaming, and HTTP generate / generate_stream.

    with LLMClient("localhost:8001") as c:
        for delta in c.stream("Hello", max_tokens=32):
            print(delta, end="")

    async with AsyncLLMClient("localhost:8001") as c:
        print(await c.generate("Hello", max_tokens=32))

Request fields are the ensemble's inputs (docs/requests.md); `stop_words` and `bad_words` take a
list of strings, `messages` a list of {"role", "content"} dicts, `tools` (with messages) a list of OpenAI-shaped
function tools for the chat template.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import numpy as np
from tritonclient.utils import np_to_triton_dtype

# numpy type of each ensemble input (tests/test_api.py checks this against backend/triton/fields.py FIELDS).
INPUT_TYPES = {
    "max_tokens": np.int32, "min_tokens": np.int32, "min_length": np.int32, "temperature": np.float32,
    "top_k": np.int32, "top_p": np.float32, "min_p": np.float32, "repetition_penalty": np.float32,
    "presence_penalty": np.float32, "frequency_penalty": np.float32, "seed": np.uint64, "random_seed": np.uint64,
    "end_id": np.int32, "pad_id": np.int32, "stop_token_ids": np.int32, "ignore_eos": np.bool_,
    "stop_words": np.object_, "bad_words": np.object_, "logit_bias": np.object_, "logprobs": np.int32,
    "num_return_sequences": np.int32, "return_log_probs": np.bool_, "beam_width": np.int32,
    "length_penalty": np.float32, "stream": np.bool_, "exclude_input_in_output": np.bool_,
    "return_num_input_tokens": np.bool_, "return_num_output_tokens": np.bool_, "return_perf_metrics": np.bool_,
    "guided_decoding_guide_type": np.object_, "guided_decoding_guide": np.object_, "lora_name": np.object_,
}
LIST_INPUTS = {"stop_words", "bad_words"}
INT_LIST_INPUTS = {"stop_token_ids"}
JSON_INPUTS = {"tools", "logit_bias"}      # a JSON value (sent as its text), as `messages` is
STOP_REQUEST_TIMEOUT_S = 10.0              # how long a stream left early waits for its stop request's answer


class ServerUnavailable(ConnectionError):
    """No Triton server answers at the given address."""


@dataclass
class Chunk:
    """One response of a stream."""
    text: str
    sequence_index: int = 0
    finish_reason: str = ""          # set on the last response of a sequence: stop, length or abort
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    cum_log_probs: float = 0.0
    output_log_probs: list[float] | None = None
    final: bool = False              # the request's last response
    token_ids: list[int] | None = None        # this response's new tokens
    top_logprobs: list | None = None          # per token [rank, [[id, logprob], ...]] (logprobs >= 0 asked)


def build_inputs(grpc_module, prompt: str | bytes | None, params: dict, messages: list[dict] | None = None) -> list:
    """InferInput objects for the ensemble ([1, 1] tensors; [1, n] for word lists). A prompt given as bytes goes
    as it is (a test's invalid UTF-8)."""
    inputs = []

    def add(name, array):
        inputs.append(infer_input(grpc_module, name, array))

    if prompt is not None:
        raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
        add("text_input", np.array([[raw]], dtype=np.object_))
    if messages is not None:
        add("messages", np.array([[json.dumps(messages).encode("utf-8")]], dtype=np.object_))
    for name, value in params.items():
        if value is None:
            continue
        if name in JSON_INPUTS and not isinstance(value, str):
            add(name, np.array([[json.dumps(value).encode("utf-8")]], dtype=np.object_))
            continue
        if name not in INPUT_TYPES:
            raise ValueError(f"unknown request field {name!r}; known: {', '.join(sorted(INPUT_TYPES))}")
        dtype = INPUT_TYPES[name]
        if name in LIST_INPUTS:
            words = [value] if isinstance(value, str) else list(value)
            add(name, np.array([[w.encode("utf-8") for w in words]], dtype=np.object_))
        elif name in INT_LIST_INPUTS:
            add(name, np.array([list(value)], dtype=dtype))
        elif dtype is np.object_:
            add(name, np.array([[value.encode("utf-8")]], dtype=np.object_))
        else:
            add(name, np.array([[value]], dtype=dtype))
    return inputs


def infer_input(grpc_module, name: str, array):
    """The input `name` holding `array`, its Triton type read from the numpy dtype (an object array is BYTES).
    `grpc_module`: tritonclient.grpc or tritonclient.http."""
    array = np.asarray(array)
    i = grpc_module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    i.set_data_from_numpy(array)
    return i


def llm_inputs(grpc_module, ids: list[int] | None, **fields) -> list:
    """Inputs for `llm` directly: prompt token ids and the same fields as the ensemble's."""
    inputs = build_inputs(grpc_module, None, fields)
    if ids is not None:
        inputs.append(infer_input(grpc_module, "input_ids", np.array([ids], dtype=np.int32)))
    return inputs


def vllm_inputs(grpc_module, prompt: str | bytes, sampling: dict | str | None = None, stream: bool = True,
                **switches: bool) -> list:
    """Inputs for `vllm_model` (vllm_backend's contract: [1]-shaped tensors, settings as a JSON string); `switches`
    are its other BOOL inputs (exclude_input_in_output, return_finish_reason, return_logprobs, ...)."""
    raw = prompt if isinstance(prompt, bytes) else prompt.encode()
    inputs = [infer_input(grpc_module, "text_input", np.array([raw], dtype=np.object_))]
    inputs += [infer_input(grpc_module, k, np.array([v])) for k, v in {"stream": stream, **switches}.items()]
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(infer_input(grpc_module, "sampling_parameters", np.array([text.encode()], dtype=np.object_)))
    return inputs


def chunk_from_result(result) -> Chunk:
    def scalar(name, default):
        a = result.as_numpy(name)
        if a is None or a.size == 0:
            return default
        v = a.reshape(-1)[0]
        return v.item() if isinstance(v, np.generic) else v

    text = result.as_numpy("text_output")
    reason = scalar("finish_reason", b"")
    lps = result.as_numpy("output_log_probs")
    ids = result.as_numpy("token_ids")
    top = scalar("top_logprobs", b"")
    response = result.get_response()
    final = response.parameters.get("triton_final_response")
    return Chunk(text=_text(text) if text is not None else "", sequence_index=scalar("sequence_index", 0),
                 finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
                 num_input_tokens=scalar("num_input_tokens", 0), num_output_tokens=scalar("num_output_tokens", 0),
                 cum_log_probs=scalar("cum_log_probs", 0.0),
                 output_log_probs=None if lps is None else lps.reshape(-1).tolist(),
                 final=bool(final and final.bool_param),
                 token_ids=None if ids is None else ids.reshape(-1).tolist(),
                 top_logprobs=json.loads(top) if top else None)


# At most this long between a gRPC channel's attempts to reach a server that went away (gRPC's own backoff grows to
# 120 s): a long-lived client, the front door's, serves again within it once the server is back.
MAX_RECONNECT_BACKOFF_MS = 1000


def stop_stream(client, cancel: bool) -> None:
    """`client.stop_stream(cancel_requests=cancel)` (a tritonclient.grpc client), without the thread tritonclient
    leaves behind on a cancel: gRPC's thread that reads the stream's request queue waits on it for good, as the
    cancel puts no end on it (one blocked thread per cancelled stream, which a long-running client runs out of)."""
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=cancel)
    queue_ = getattr(stream, "_request_queue", None)
    if cancel and queue_ is not None:
        queue_.put(None)


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's gRPC channel options, plus a connection of the channel's own and a short reconnect backoff.
    gRPC shares one connection per address among a process's channels, and with it its reconnect backoff: after a
    server restart a new client failed "failed to connect to all addresses" while another client's channel waited
    out its backoff, the server up meanwhile."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions
    keepalive = KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


class LLMClient:
    def __init__(self, url: str = "localhost:8001", model: str = "ensemble"):
        import tritonclient.grpc as grpcclient
        self._grpc = grpcclient
        self.url, self.model = url, model
        self.client = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        self._engine_model: str | None = None    # an ensemble's decoupled step, found on first use

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.client.close()

    def stream_chunks(self, prompt: str | None = None, messages: list[dict] | None = None,
                      **params) -> Iterator[Chunk]:
        """Every response of one request as a Chunk (gRPC bidirectional stream), until the final one."""
        from tritonclient.utils import InferenceServerException
        responses: queue.Queue = queue.Queue()
        try:
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        except InferenceServerException as e:
            raise ServerUnavailable(f"no Triton server at {self.url}: {e}") from None
        request_id = uuid.uuid4().hex
        finished = False
        try:
            try:
                self.client.async_stream_infer(self.model, build_inputs(self._grpc, prompt, params, messages),
                                               request_id=request_id, enable_empty_final_response=True)
            except InferenceServerException as e:
                # The stream broke before the request went out (nothing listening): the cause is in the queue.
                try:
                    raise _as_error(responses.get(timeout=5)[1], self.url) from None
                except queue.Empty:
                    raise _as_error(e, self.url) from None
            while True:
                result, error = responses.get(timeout=600)
                if error is not None:
                    raise _as_error(error, self.url)
                chunk = chunk_from_result(result)
                finished = chunk.final
                yield chunk
                if chunk.final:
                    return
        finally:
            # A finished call is closed, not cancelled (AsyncLLMClient.stream_chunks says why).
            stop_stream(self.client, cancel=not finished)
            if not finished:
                self._stop_engine_request(request_id)

    def _stop_engine_request(self, request_id: str) -> None:
        """A stream left early. A cancel does not reach the running engine step of an ensemble on Triton 2.51,
        so send that step a TRT-LLM-style stop request (`stop`=true, the same request_id); it frees the blocks."""
        from tritonclient.utils import InferenceServerException
        try:
            if self._engine_model is None:
                steps = ensemble_steps(self.client.get_model_config(self.model, as_json=True))
                self._engine_model = next((m for m in steps
                                           if is_decoupled(self.client.get_model_config(m, as_json=True))), "")
            if not self._engine_model:
                return   # not an ensemble: the cancel above reached the model itself
            stop = self._grpc.InferInput("stop", [1, 1], "BOOL")
            stop.set_data_from_numpy(np.array([[True]]))
            done: queue.Queue = queue.Queue()
            self.client.start_stream(callback=lambda result, error: done.put(error))
            try:
                self.client.async_stream_infer(self._engine_model, [stop], request_id=request_id)
                done.get(timeout=STOP_REQUEST_TIMEOUT_S)
            finally:
                self.client.stop_stream()
        except (InferenceServerException, queue.Empty):
            pass   # the server is gone, or the request already ended: nothing left to free

    def stream(self, prompt: str | None = None, **params) -> Iterator[str]:
        """Yield text deltas as the server produces them."""
        for chunk in self.stream_chunks(prompt, **{"stream": True, **params}):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt: str | None = None, **params) -> str:
        """The whole answer in one response."""
        return "".join(self.stream(prompt, **{"stream": False, **params}))

    def chat(self, messages: list[dict], **params) -> Iterator[str]:
        """Stream the assistant's answer to a chat (rendered by the model's chat template on the server)."""
        for chunk in self.stream_chunks(None, messages, **{"stream": True, **params}):
            if chunk.text:
                yield chunk.text

    def models(self) -> list[dict]:
        """Models in the repository with their state."""
        from tritonclient.utils import InferenceServerException
        try:
            index = self.client.get_model_repository_index(as_json=True)
        except InferenceServerException as e:
            raise ServerUnavailable(f"no Triton server at {self.url}: {e}") from None
        return index.get("models", [])


class AsyncLLMClient:
    """The same over tritonclient.grpc.aio, for asyncio programs (one stream per request)."""

    def __init__(self, url: str = "localhost:8001", model: str = "ensemble"):
        import tritonclient.grpc.aio as aio
        self._grpc = aio
        self.url, self.model = url, model
        self.client = aio.InferenceServerClient(url, channel_args=channel_args())
        self._engine_model: str | None = None    # an ensemble's decoupled step, found on first use
        self._stops: set = set()                 # stop requests on their way (held so they are not collected)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        await self.client.close()

    async def stream_chunks(self, prompt: str | None = None, messages: list[dict] | None = None,
                            headers: dict[str, str] | None = None, **params) -> AsyncIterator[Chunk]:
        """The responses to one prompt (or chat), as they come; `headers` go with the call as gRPC metadata (a
        W3C `traceparent` makes the caller's span the parent of tritonserver's)."""
        request_id = uuid.uuid4().hex
        request = {"model_name": self.model, "inputs": build_inputs(self._grpc, prompt, params, messages),
                   "request_id": request_id, "parameters": {"triton_enable_empty_final_response": True}}
        finished = False

        async def one_request():
            yield request

        responses = self.client.stream_infer(one_request(), headers=headers)
        try:
            async for result, error in responses:
                if error is not None:
                    raise _as_error(error, self.url)
                chunk = chunk_from_result(result)
                finished = chunk.final
                yield chunk
                if chunk.final:
                    # Read the call to its end (the server closes it at once: our side sent its one request) rather
                    # than cancel it: tritonserver 2.51 can keep an ensemble loaded for good after a stream cancelled
                    # just after its final response, so its stop then waits out the whole exit timeout.
                    try:
                        async for _ in responses:
                            pass
                    except Exception:   # noqa: BLE001 - the answer is whole; how the call closes changes nothing
                        pass
                    return
        except Exception as e:
            finished = True   # the request failed: nothing runs on
            if "unavailable" in str(e).lower() or "failed to connect" in str(e).lower():
                raise ServerUnavailable(f"no Triton server at {self.url}: {e}") from None
            raise
        finally:
            responses.cancel()
            if not finished:
                # A task of its own, shielded: a caller cancelled again while the stop is on its way (an HTTP
                # server's handler whose client left) must not cut the stop off and leave the request running.
                stop = asyncio.ensure_future(self._stop_engine_request(request_id))
                self._stops.add(stop)
                stop.add_done_callback(self._stops.discard)
                await asyncio.shield(stop)

    async def _stop_engine_request(self, request_id: str) -> None:
        """As LLMClient._stop_engine_request: a stream left early gets a stop request to the ensemble's engine."""
        from tritonclient.utils import InferenceServerException
        try:
            if self._engine_model is None:
                # Found into a local first: concurrent stops (a storm of clients leaving) must not read a
                # half-done lookup ("" = not an ensemble) and skip their stop request.
                found = ""
                for m in ensemble_steps(await self.client.get_model_config(self.model, as_json=True)):
                    if is_decoupled(await self.client.get_model_config(m, as_json=True)):
                        found = m
                        break
                self._engine_model = found
            if not self._engine_model:
                return
            stop = self._grpc.InferInput("stop", [1, 1], "BOOL")
            stop.set_data_from_numpy(np.array([[True]]))

            async def one_stop():
                yield {"model_name": self._engine_model, "inputs": [stop], "request_id": request_id}

            async def read_to_end():
                # The stop request's one (empty, final) response, then the call's end: leaving the call after the
                # final response cancels it, and tritonserver 2.51 keeps a stream cancelled just after its final
                # response (its state, the model's reference, the memory) for good.
                async for _ in self.client.stream_infer(one_stop()):
                    pass
            await asyncio.wait_for(read_to_end(), STOP_REQUEST_TIMEOUT_S)
        except (InferenceServerException, asyncio.TimeoutError):
            pass   # the server is gone, or the request already ended: nothing left to free

    async def stream(self, prompt: str | None = None, **params) -> AsyncIterator[str]:
        # Closed with this generator, so a caller leaving early gets the stop request sent now, not at collection.
        async with contextlib.aclosing(self.stream_chunks(prompt, **{"stream": True, **params})) as chunks:
            async for chunk in chunks:
                if chunk.text:
                    yield chunk.text

    async def generate(self, prompt: str | None = None, **params) -> str:
        async with contextlib.aclosing(self.stream_chunks(prompt, **{"stream": False, **params})) as chunks:
            return "".join([c.text async for c in chunks])


class OpenAIError(RuntimeError):
    """An error the OpenAI front door answered (its message names the parameter at fault)."""


class OpenAIHTTPClient:
    """LLMClient's `stream`, `chat` and `models` through the OpenAI front door (openai_api/, server-sent events over
    HTTP, the standard library only). Field names are the ensemble's, renamed where OpenAI's differ; without a
    temperature the answer is greedy, as the ensemble's is (OpenAI's own default is 1)."""
    RENAMED = {"stop_words": "stop", "num_return_sequences": "n", "min_length": "min_tokens", "random_seed": "seed"}

    def __init__(self, url: str = "http://localhost:9000", model: str = "ensemble", api_key: str | None = None):
        self.url, self.model, self.api_key = url.rstrip("/").removesuffix("/v1"), model, api_key

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass   # a connection per request

    def _request(self, path: str, body: dict | None = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers=headers, method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(e)
            raise OpenAIError(f"{e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise ServerUnavailable(f"no OpenAI front door at {self.url}: {e.reason}") from None

    def _events(self, path: str, params: dict, **fields) -> Iterator[dict]:
        body = {self.RENAMED.get(k, k): v for k, v in params.items() if v is not None}
        body.setdefault("temperature", 0.0)
        body.update(model=self.model, stream=True, **fields)
        with self._request(path, body) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    event = json.loads(line[len(b"data: "):])
                    if "error" in event:
                        raise OpenAIError(event["error"]["message"])
                    yield event

    def stream(self, prompt: str, **params) -> Iterator[str]:
        for event in self._events("/v1/completions", params, prompt=prompt):
            text = event["choices"][0]["text"] if event["choices"] else ""
            if text:
                yield text

    def chat(self, messages: list[dict], **params) -> Iterator[str]:
        for event in self._events("/v1/chat/completions", params, messages=messages):
            text = event["choices"][0]["delta"].get("content") if event["choices"] else None
            if text:
                yield text

    def models(self) -> list[dict]:
        with self._request("/v1/models") as response:
            return [{"name": m["id"], "state": "READY"} for m in json.load(response)["data"]]


def ensemble_steps(model_config: dict) -> list[str]:
    """The step models of a model whose config (get_model_config as JSON) is an ensemble; [] for any other."""
    config = model_config["config"]
    if config.get("platform") != "ensemble":
        return []
    return [step["model_name"] for step in config.get("ensemble_scheduling", {}).get("step", [])]


def is_decoupled(model_config: dict) -> bool:
    return bool(model_config["config"].get("model_transaction_policy", {}).get("decoupled"))


def http_generate(url: str, prompt: str | None, model: str = "ensemble", stream: bool = False,
                  timeout: float = 600.0, **params) -> list[dict]:
    """POST to Triton's /generate (one JSON response) or /generate_stream (SSE events); returns the JSON objects.
    Raises urllib.error.HTTPError for an error status, ServerUnavailable when nothing listens, TimeoutError after
    `timeout` seconds without an answer."""
    endpoint = "generate_stream" if stream else "generate"
    body = {"stream": stream, **params}
    if prompt is not None:
        body["text_input"] = prompt
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode("utf-8")
    except urllib.error.URLError as e:
        if isinstance(e, urllib.error.HTTPError):
            raise
        raise ServerUnavailable(f"no Triton server at {url}: {e.reason}") from None
    if not stream:
        return [json.loads(raw)]
    return [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def _text(arr) -> str:
    v = np.asarray(arr).reshape(-1)
    return "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in v)


def _as_error(error, url):
    msg = str(error)
    if "unavailable" in msg.lower() or "failed to connect" in msg.lower():
        return ServerUnavailable(f"no Triton server at {url}: {msg}")
    return error
