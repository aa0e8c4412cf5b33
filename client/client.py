"""A Python client for the repository's `ensemble` over tritonclient gRPC (streaming) and HTTP (generate).

    with LLMClient("localhost:8001") as c:
        for delta in c.stream("Hello", max_tokens=32):
            print(delta, end="")
"""
from __future__ import annotations

import json
import queue
import urllib.request
from typing import Iterator

import numpy as np

# Types of the ensemble's optional inputs; the value a caller passes is converted to this numpy type.
INPUT_TYPES = {
    "max_tokens": np.int32, "stream": np.bool_, "exclude_input_in_output": np.bool_, "temperature": np.float32,
    "top_k": np.int32, "top_p": np.float32, "seed": np.uint64, "random_seed": np.uint64, "end_id": np.int32,
}


class ServerUnavailable(ConnectionError):
    """No Triton server answers at the given address."""


class LLMClient:
    def __init__(self, url: str = "localhost:8001", model: str = "ensemble"):
        import tritonclient.grpc as grpcclient
        self._grpc = grpcclient
        self.url, self.model = url, model
        self.client = grpcclient.InferenceServerClient(url)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.client.close()

    def _inputs(self, prompt: str, params: dict):
        g = self._grpc
        t = g.InferInput("text_input", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[prompt.encode("utf-8")]], dtype=np.object_))
        inputs = [t]
        for name, value in params.items():
            if name not in INPUT_TYPES:
                raise ValueError(f"unknown request field {name!r}; known: {sorted(INPUT_TYPES)}")
            arr = np.array([[value]], dtype=INPUT_TYPES[name])
            i = g.InferInput(name, [1, 1], {np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32",
                                            np.uint64: "UINT64"}[INPUT_TYPES[name]])
            i.set_data_from_numpy(arr)
            inputs.append(i)
        return inputs

    def stream(self, prompt: str, **params) -> Iterator[str]:
        """Yield text deltas as the server produces them (gRPC bidirectional stream)."""
        from tritonclient.utils import InferenceServerException
        responses: queue.Queue = queue.Queue()
        try:
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        except InferenceServerException as e:
            raise ServerUnavailable(f"no Triton server at {self.url}: {e}") from None
        try:
            self.client.async_stream_infer(self.model, self._inputs(prompt, {"stream": True, **params}),
                                           enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=600)
                if error is not None:
                    raise _as_error(error, self.url)
                response = result.get_response()
                if result.as_numpy("text_output") is not None:
                    yield _text(result.as_numpy("text_output"))
                if response.parameters.get("triton_final_response") and \
                        response.parameters["triton_final_response"].bool_param:
                    return
        finally:
            self.client.stop_stream(cancel_requests=True)

    def generate(self, prompt: str, **params) -> str:
        """The whole answer in one response."""
        return "".join(self.stream(prompt, **{"stream": False, **params}))

    def models(self) -> list[dict]:
        """Models in the repository with their state."""
        from tritonclient.utils import InferenceServerException
        try:
            index = self.client.get_model_repository_index(as_json=True)
        except InferenceServerException as e:
            raise ServerUnavailable(f"no Triton server at {self.url}: {e}") from None
        return index.get("models", [])


def http_generate(url: str, prompt: str, model: str = "ensemble", stream: bool = False, **params) -> list[dict]:
    """POST to Triton's /generate (one JSON response) or /generate_stream (SSE events); returns the JSON objects."""
    endpoint = "generate_stream" if stream else "generate"
    body = json.dumps({"text_input": prompt, "stream": stream, **params}).encode()
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read().decode("utf-8")
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
