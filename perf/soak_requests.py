"""One soak request on its own connection, and what became of it (perf/soak.py): the outcome records and their
error classes, the request tensors (the client's build_inputs where the ensemble's fields do), gRPC streams and HTTP
requests with a deadline, and the client process that perf/soak.py kills mid-stream (`soak.py --child`)."""
from __future__ import annotations

import functools
import http.client
import json
import queue
import random
import re
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from trellm_client.client import build_inputs, channel_args, chunk_from_result, infer_input, stop_stream
from trellm_client.client import llm_inputs as client_llm_inputs, vllm_inputs as client_vllm_inputs

CONNECTION_WORDS = ("socket closed", "connect", "connection", "unavailable", "not healthy", "broken pipe", "reset",
                    "refused", "eof")

# -- records ----------------------------------------------------------------------------------------------------
@dataclass
class Record:
    kind: str
    category: str          # wellformed, malformed, cancel, disconnect, overload, kill, recovery, final
    outcome: str           # ok | error <code>: <class> | hung | accepted (a malformed request that was served)
    t_start: float         # seconds since the soak began
    t_end: float
    ttft: float | None = None
    message: str = ""


def error_class(message: str) -> str:
    """A short, bounded name for an error message: known causes by name, others with numbers and quoted values
    blanked so that one cause gives one class."""
    m = message.lower()
    known = [("vllm_model is at capacity", "vllm_model at capacity"), ("requests are waiting", "llm queue full"),
             ("is at capacity", "at capacity"), ("socket closed", "socket closed"), ("not healthy", "stub not healthy"),
             ("failed to connect", "connect failed"), ("connection refused", "connect failed"),
             ("connect failed", "connect failed"), ("connection reset", "connection reset"),
             ("remote end closed", "connection closed"), ("broken pipe", "broken pipe"),
             ("is not ready", "model not ready"), ("unknown model", "unknown model"), ("not found", "not found")]
    for needle, name in known:
        if needle in m:
            return name
    s = re.sub(r"^in ensemble '[^']*', ", "", message.strip())
    s = re.sub(r"^\[request id: [^]]*\] ", "", s)
    s = re.sub(r"'[^']*'", "'X'", s)
    s = re.sub(r"\d+(\.\d+)?", "N", s)
    return re.sub(r"\s+", " ", s)[:80]


def grpc_error_outcome(error) -> tuple[str, str]:
    status = None
    try:
        status = error.status()
    except Exception:  # noqa: BLE001 - not an InferenceServerException
        pass
    code = str(status).replace("StatusCode.", "") if status else ""
    msg = error.message() if hasattr(error, "message") else str(error)
    msg = msg or str(error)
    return f"error {code}: {error_class(msg)}".replace("error : ", "error: "), msg


def is_connection_error(outcome: str) -> bool:
    return outcome.startswith("error") and any(w in outcome.lower() for w in CONNECTION_WORDS)


# -- request builders (the client's, on gRPC) -----------------------------------------------------------------------
tensor = functools.partial(infer_input, grpcclient)
llm_inputs = functools.partial(client_llm_inputs, grpcclient)
vllm_inputs = functools.partial(client_vllm_inputs, grpcclient)


def ensemble_inputs(prompt: str | bytes | None, **fields) -> list:
    return build_inputs(grpcclient, prompt, fields)


def words(name: str, items: list[bytes]):
    return tensor(name, np.array([items], dtype=np.object_))


def send(client, q: queue.Queue, model: str, inputs: list, request_id: str = ""):
    """async_stream_infer on a started stream whose callback puts (time, result, error) on `q`; returns None, or
    the error when the stream broke before the request went out (its cause, from the queue, when there is one:
    tritonclient itself only says the stream "is no longer in valid state")."""
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        return None
    except InferenceServerException as e:
        try:
            _, _, cause = q.get(timeout=5)
            return cause or e
        except queue.Empty:
            return e


def next_response(q: queue.Queue, end: float):
    """The next (time, result, error) that a stream's callback put on `q`, or None once time.monotonic() is `end`."""
    remaining = end - time.monotonic()
    try:
        return q.get(timeout=remaining) if remaining > 0 else None
    except queue.Empty:
        return None


def close_stream(client, settled: bool = False) -> None:
    """Close the client's stream, cancelling what still runs on it. A stream whose every request has ended (a final
    response or an error) is closed without a cancel: tritonserver 2.51 leaks the state, and holds the model, of a
    request cancelled just after its final response (triton-inference-server/server#8078, fixed in 2.57)."""
    try:
        stop_stream(client, cancel=not settled)
        client.close()
    except Exception:  # noqa: BLE001 - a closed channel: nothing left to clean
        pass


@dataclass
class StreamOutcome:
    outcome: str
    ttft: float | None = None
    responses: int = 0
    finish_reason: str = ""
    message: str = ""

class Requests:
    """Requests to `server` (a soak_server.Launcher), each on its own connection, each given up after `deadline` s."""

    def __init__(self, server, deadline: float):
        self.server, self.deadline = server, deadline

    @property
    def server_grpc(self) -> str:
        return f"localhost:{getattr(self.server, 'traffic_grpc_port', self.server.grpc_port)}"

    def grpc_stream(self, model, inputs, request_id="", after=None, after_n=3, deadline=None,
                    read_on=False, cancel_at_close=False) -> StreamOutcome:
        """One request on its own gRPC stream, until its final response, an error or the deadline. `after(client)`,
        if given, runs once `after_n` responses arrived, and the call returns "ok" at once (cancel, disconnect), or
        reads on to the end with `read_on` (a stop request sent on another stream). `cancel_at_close` cancels the
        stream even when its request has ended."""
        q: queue.Queue = queue.Queue()
        start = time.monotonic()
        end = start + (deadline or self.deadline)
        client = grpcclient.InferenceServerClient(self.server_grpc, channel_args=channel_args())
        ttft, n, reason, settled = None, 0, "", False
        try:
            client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
            broken = send(client, q, model, inputs, request_id)
            if broken is not None:
                outcome, msg = grpc_error_outcome(broken)
                return StreamOutcome(outcome, message=msg)
            if after is not None and after_n == 0:
                after(client)
                return StreamOutcome("ok")
            while True:
                got = next_response(q, end)
                if got is None:
                    return StreamOutcome("hung", ttft, n, reason, f"no final response after {self.deadline} s")
                t, result, error = got
                if error is not None:
                    settled = True
                    outcome, msg = grpc_error_outcome(error)
                    return StreamOutcome(outcome, ttft, n, reason, msg)
                chunk = chunk_from_result(result)
                settled = chunk.final
                n += 1
                if chunk.text and ttft is None:
                    ttft = t - start
                reason = chunk.finish_reason or reason
                if after is not None and n == after_n:
                    after(client)
                    if not read_on:
                        return StreamOutcome("ok", ttft, n, reason)
                if chunk.final:
                    return StreamOutcome("ok", ttft, n, reason)
        finally:
            close_stream(client, settled and not cancel_at_close)

    def http(self, path: str, body, stream: bool, after=None, after_n=2) -> StreamOutcome:
        """POST `body` (dict or raw bytes) to Triton's HTTP endpoint; SSE events when `stream`. Outcomes: ok, error
        HTTP <status>: <class>, error HTTP 200: <class> (an error body or SSE error event), error <connection>, hung.
        `after(connection)`, if given, runs once `after_n` events arrived (0: once the request is sent), and the call
        returns "ok" at once."""
        start = time.monotonic()
        end = start + self.deadline
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("localhost", self.server.traffic_http_port, timeout=self.deadline)
        ttft, n = None, 0
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            if after is not None and after_n == 0:
                after(conn)
                return StreamOutcome("ok")
            resp = conn.getresponse()
            if resp.status != 200 or not stream:
                raw = resp.read().decode("utf-8", "replace")
                if raw.startswith("data: "):      # generate_stream answers an error as one SSE event
                    raw = raw[len("data: "):].strip()
                try:
                    doc = json.loads(raw)
                except ValueError:
                    doc = {"error": raw}
                err = doc.get("error") if isinstance(doc, dict) else None
                if resp.status != 200 or err:
                    return StreamOutcome(f"error HTTP {resp.status}: {error_class(str(err or raw))}",
                                         message=str(err or raw))
                return StreamOutcome("ok", responses=1)
            while True:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return StreamOutcome("hung", ttft, n, message=f"stream not ended after {self.deadline} s")
                conn.sock.settimeout(remaining)
                line = resp.readline()
                if not line:
                    return StreamOutcome("ok", ttft, n)
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                n += 1
                if "error" in event:
                    return StreamOutcome(f"error HTTP 200: {error_class(str(event['error']))}", ttft, n,
                                         message=str(event["error"]))
                if event.get("text_output") and ttft is None:
                    ttft = time.monotonic() - start
                if after is not None and n == after_n:
                    after(conn)
                    return StreamOutcome("ok", ttft, n)
        except (socket.timeout, TimeoutError):
            return StreamOutcome("hung", ttft, n, message=f"no answer after {self.deadline} s")
        except (OSError, http.client.HTTPException) as e:
            return StreamOutcome(f"error: {error_class(f'{type(e).__name__} {e}')}", ttft, n,
                                 message=f"{type(e).__name__}: {e}")
        finally:
            conn.close()


def child(how: str, port: int, target: str, model: str, vocab_size: int) -> None:
    """Stream one long request; print "streaming" once it streams (or "OUTCOME|message" if it does not), then wait
    to be killed."""
    def streaming(_):
        print("streaming", flush=True)
        time.sleep(600)
    requests = Requests(SimpleNamespace(traffic_http_port=port, grpc_port=port), deadline=60)
    if how == "http":
        body = {"text_input": "Once upon a time", "stream": True}
        if target == "vllm":
            body["sampling_parameters"] = json.dumps({"max_tokens": 2000, "ignore_eos": True})
        else:
            body.update(max_tokens=64, min_tokens=64)
        res = requests.http(f"/v2/models/{model}/generate_stream", body, stream=True, after=streaming, after_n=1)
    elif target == "vllm":
        res = requests.grpc_stream(model, vllm_inputs("Once upon a time", {"max_tokens": 2000, "ignore_eos": True}),
                                   after=streaming, after_n=1)
    else:
        ids = [1] + [random.randrange(4, vocab_size) for _ in range(8)]
        res = requests.grpc_stream(model, llm_inputs(ids, max_tokens=2000, ignore_eos=True, stream=True),
                                   after=streaming, after_n=1)
    outcome = "error: the stream ended before the kill" if res.outcome == "ok" else res.outcome
    print(f"{outcome}|{' '.join(res.message.split())}", flush=True)
