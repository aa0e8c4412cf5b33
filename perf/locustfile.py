"""Locust users for the `ensemble`: a gRPC streaming user and an HTTP `generate_stream` (SSE) user. Each request
is reported as three locust events, `ttft`, `inter_token` and `e2e` (milliseconds), under the request types
`grpc-stream` and `http-sse`.

    .venv-locust/bin/locust -f perf/locustfile.py --headless -u 8 -r 4 -t 60s \\
        --host http://localhost:9000 --grpc-url localhost:9001 [--api-key KEY] [--max-tokens 64] \
        [GrpcStreamUser|HttpStreamUser]

(the front door's HTTP port and gRPC relay, as `make serve` starts them; Triton's own ports on the server's host
work too, without a key.)

Runs from `.venv-locust` (locust + tritonclient[grpc]; see scripts/setup.sh).
"""
import grpc.experimental.gevent as grpc_gevent

# gRPC's own threads deadlock under gevent's monkey-patching unless gRPC is told first.
grpc_gevent.init_gevent()

import json  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import requests  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from locust import User, between, events, task  # noqa: E402

PROMPTS = [
    "The import statement",
    "A function definition is an executable statement. Its execution binds the function name",
    "Lists are mutable sequences, typically used to store collections of homogeneous items.",
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
    "Exceptions can be raised with the raise statement and handled with try and except clauses",
]


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton gRPC address for GrpcStreamUser")
    parser.add_argument("--model", default="ensemble", help="entry point (TRT-LLM-shaped tensors)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--api-key", default="", help="the front door's API key, sent as `authorization: Bearer KEY` "
                                                      "on gRPC and HTTP (none by default)")


def _report(user, request_type: str, sent: float, arrivals: list, n_tokens: int, error: Exception | None):
    fire = user.environment.events.request.fire
    if error is not None or not arrivals:
        error = error or RuntimeError("no streamed response carried text_output")
        fire(request_type=request_type, name="e2e", response_time=(time.perf_counter() - sent) * 1e3,
             response_length=0, exception=error, context={})
        return
    fire(request_type=request_type, name="ttft", response_time=(arrivals[0] - sent) * 1e3, response_length=0,
         exception=None, context={})
    if n_tokens > 1:
        fire(request_type=request_type, name="inter_token",
             response_time=(arrivals[-1] - arrivals[0]) / (n_tokens - 1) * 1e3, response_length=n_tokens,
             exception=None, context={})
    fire(request_type=request_type, name="e2e", response_time=(arrivals[-1] - sent) * 1e3,
         response_length=n_tokens, exception=None, context={})


class GrpcStreamUser(User):
    """One tritonclient gRPC client and one bidirectional stream per user, one request in flight at a time."""
    wait_time = between(0.0, 0.1)

    def on_start(self):
        opts = self.environment.parsed_options
        self.client = grpcclient.InferenceServerClient(opts.grpc_url)
        self.responses = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result,
                                                                                    error)),
                                 headers={"authorization": f"Bearer {opts.api_key}"} if opts.api_key else None)

    def on_stop(self):
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def _inputs(self, prompt: str, max_tokens: int):
        # Built here rather than by trellm_client's build_inputs: this file runs in .venv-locust, without the project.
        values = [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
                  ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                  ("stream", np.array([[True]]), "BOOL"),
                  ("return_num_output_tokens", np.array([[True]]), "BOOL")]
        inputs = []
        for name, arr, dtype in values:
            tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        return inputs

    @task
    def generate(self):
        opts = self.environment.parsed_options
        sent = time.perf_counter()
        self.client.async_stream_infer(opts.model, self._inputs(random.choice(PROMPTS), opts.max_tokens),
                                       enable_empty_final_response=True)
        arrivals, n_tokens, error = [], 0, None
        while True:
            try:
                now, result, err = self.responses.get(timeout=120)
            except queue.Empty:
                error = TimeoutError("no response for 120 s")
                break
            if err is not None:
                error = err
                break
            if result.as_numpy("text_output") is not None:
                arrivals.append(now)
                count = result.as_numpy("num_output_tokens")
                n_tokens = int(count.reshape(-1)[-1]) if count is not None else len(arrivals)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        _report(self, "grpc-stream", sent, arrivals, n_tokens, error)


class HttpStreamUser(User):
    """POST /v2/models/<model>/generate_stream and read the server-sent events as they arrive."""
    wait_time = between(0.0, 0.1)

    def on_start(self):
        self.session = requests.Session()
        api_key = self.environment.parsed_options.api_key
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def on_stop(self):
        self.session.close()

    @task
    def generate(self):
        opts = self.environment.parsed_options
        body = {"text_input": random.choice(PROMPTS), "max_tokens": opts.max_tokens, "stream": True}
        sent = time.perf_counter()
        arrivals, n_tokens, error = [], 0, None
        try:
            with self.session.post(f"{self.environment.host}/v2/models/{opts.model}/generate_stream", json=body,
                                   stream=True, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[len(b"data: "):])
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    if "text_output" in event:
                        arrivals.append(time.perf_counter())
                        n_tokens = int(event.get("num_output_tokens", len(arrivals)))
        except Exception as e:  # reported as a failed request, the user carries on
            error = e
        _report(self, "http-sse", sent, arrivals, n_tokens, error)
