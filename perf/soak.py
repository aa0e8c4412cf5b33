"""A bounded soak of a real tritonserver on loopback: mixed traffic for a fixed time, one llm stub killed halfway,
and what the server looks like afterwards.

    .venv/bin/python perf/soak.py [--duration 600] [--out perf/results/soak.json] [--model-repository DIR]

It starts its own server through the launcher (`python -m trellm_backend.tools.launch`, so the supervisor that
restarts a server whose stub died is the real one) on a private copy of the model repository, whose llm admits few
requests (`max_num_seqs` 8, `max_queue_size` 16) and whose vllm_model serves 16 streams at once (`--set
MODEL.KEY=VALUE` changes any config.pbtxt parameter), so that bursts really meet the limits. Then, for `--duration`
seconds, `--workers` threads each take the next action of a shuffled deck that holds every kind below:

- well-formed: gRPC streams to `ensemble` (text, chat messages, sampling, stop words, n=2; streamed and not), `llm`
  (token ids) and `vllm_model`; HTTP generate and generate_stream;
- malformed: wrong types, values out of range, empty and oversize prompts, invalid UTF-8, too many or too long
  bad/stop words, token ids outside the vocabulary, broken JSON, unknown fields and models, a unary gRPC infer on
  a decoupled model; each must be refused;
- cancels: gRPC stream cancel (llm, vllm_model, ensemble), a cancel right after sending, LLMClient and
  AsyncLLMClient leaving early (they send the stop request), an explicit stop request for an ensemble request;
- disconnects: the gRPC channel closed mid-stream, a client process killed (kill -9) mid gRPC stream and mid HTTP
  generate_stream, the HTTP socket closed mid generate_stream, closed before a generate's answer, and closed
  halfway through sending a request body;

while another thread sends an overload burst (`--burst-size` requests at once on one target, cycling llm,
ensemble, vllm_model and HTTP generate) every `--burst-every` seconds. At `--kill-at` of the duration the workers
pause until the server is idle (KV blocks, running and waiting requests all 0: the first half's leak check), resume,
and three long streams (ensemble, llm, vllm_model) start; then the llm stub is killed with SIGKILL. The streams must
fail at once, and a probe measures the recovery (kill -> first successful generate). Traffic goes on at least
`--after-recovery` seconds after it.

Every request has a deadline (`--deadline`, 60 s): one that neither finishes nor fails by then is hung. At the end:
the server idle again (the llm's `trellm:kv_cache_used_blocks`, `vllm:num_requests_running` and
`vllm:num_requests_waiting` all 0 within `--idle-timeout`), vllm_model's slots all free (a burst of exactly
`max_concurrent_requests` is served without a refusal), the resident memory of tritonserver and its stubs at the
start (after a warm-up), before the kill, after the recovery and at the end (and every `--rss-every` s), TTFT
percentiles of well-formed streams, the outcome of every request by kind and error class, the server log's error
lines, tracebacks and crashes, and the /dev/shm regions of this run's stubs still there after the launcher stopped.
Exit status 1 when a request hung, a KV block or request stayed in use at idle, vllm_model kept a slot, or the
server never recovered; what else looks wrong is listed as "unexpected". `--out` writes the summary as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import http.client
import json
import os
import queue
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REPOSITORY = os.path.join(REPO, "model_repository")
DEFAULT_MODEL = os.path.join(REPO, "hf_models", "tiny-llama")
# Private-copy settings: few sequence slots and a short queue, so a burst meets both limits.
DEFAULT_SETTINGS = {"llm": {"max_num_seqs": "8", "max_queue_size": "16"},
                    "vllm_model": {"max_concurrent_requests": "16"}}
PROMPTS = ["The Python language", "A function definition", "Lists and tuples", "The import statement",
           "Once upon a time", "Exceptions are raised when", "A dictionary maps", "Modules and packages"]
IDLE_GAUGES = ("trellm:kv_cache_used_blocks", "vllm:num_requests_running", "vllm:num_requests_waiting")
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


# -- the server ---------------------------------------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def set_parameter(text: str, key: str, value: str) -> str:
    text = re.sub(rf'parameters: {{ key: "{re.escape(key)}" value: {{ string_value: "[^"]*" }} }}\n', "", text)
    return text + f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def private_repository(src: str, root: str, settings: dict[str, dict[str, str]]) -> str:
    """A copy of `src` under `root`, its relative model_path values made absolute, with `settings` applied."""
    src = os.path.abspath(src)
    dst = os.path.join(root, "model_repository")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for cfg in glob.glob(os.path.join(dst, "*", "config.pbtxt")):
        with open(cfg) as f:
            text = f.read()

        def absolute(m):
            path = m.group(2)
            return m.group(1) + (path if os.path.isabs(path) else os.path.normpath(os.path.join(src, path))) + m.group(3)
        text = re.sub(r'(key: "model_path" value: \{ string_value: ")([^"]*)(")', absolute, text)
        for key, value in settings.get(os.path.basename(os.path.dirname(cfg)), {}).items():
            text = set_parameter(text, key, value)
        with open(cfg, "w") as f:
            f.write(text)
    return dst


def config_parameter(repo: str, model: str, key: str) -> str | None:
    try:
        with open(os.path.join(repo, model, "config.pbtxt")) as f:
            m = re.search(rf'key: "{re.escape(key)}" value: {{ string_value: "([^"]*)" }}', f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def server_rss(repo: str, exclude: set[int]) -> dict[str, float]:
    """Resident MiB of tritonserver and each Python-backend stub serving `repo` (found by the path in their command
    lines), and their total."""
    out: dict[str, float] = defaultdict(float)
    for pid in processes_mentioning(repo):
        if pid in exclude:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0) / 1024
        except (OSError, StopIteration, ValueError):
            continue
        exe = os.path.basename(argv[0].decode(errors="replace"))
        if exe == "tritonserver":
            name = "tritonserver"
        elif exe == "triton_python_backend_stub" and len(argv) > 1:
            name = "stub:" + os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace"))))
        else:
            continue
        out[name] += rss
    total = sum(out.values())
    return {**{k: round(v, 1) for k, v in sorted(out.items())}, "total": round(total, 1)}


SHM_REGION = re.compile(rb"triton_python_backend_shm_region_[0-9a-f-]+")


def stub_shm_regions(repo: str) -> dict[str, str]:
    """{name: "server PID, MODEL"} of the /dev/shm regions that the Python-backend stubs serving `repo` were started
    with (a stub's command line: `<stub> <repository>/<model>/1/model.py <region> <size> <growth> <server pid> ...`)."""
    regions = {}
    for pid in processes_mentioning(repo):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv):
            if SHM_REGION.fullmatch(arg):
                model = os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace"))))
                server = argv[i + 3].decode() if len(argv) > i + 3 else "?"
                regions[arg.decode()] = f"server {server}, {model}"
    return regions


def shm_left(regions: dict[str, str]) -> dict[str, str]:
    """Which of these regions still exist in /dev/shm: {name: "server PID, MODEL: N MiB"}."""
    out = {}
    for name, owner in sorted(regions.items(), key=lambda x: x[1]):
        try:
            out[name] = f"{owner}: {os.path.getsize(os.path.join('/dev/shm', name)) / 2**20:.0f} MiB"
        except OSError:
            pass
    return out


def metrics(metrics_port: int) -> dict[str, dict[str, float]]:
    """{model: {metric: value}} of the gauges and counters the soak reads."""
    import urllib.request
    text = urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for m in re.finditer(r'^(trellm:\w+|vllm:\w+)\{([^}]*)\} (\S+)$', text, re.M):
        name, labels, value = m.groups()
        model = re.search(r'model="([^"]*)"', labels)
        reason = re.search(r'finished_reason="([^"]*)"', labels)
        key = name + (f"[{reason.group(1)}]" if reason else "")
        if model:
            out[model.group(1)][key] = float(value)
    return out


class Launcher:
    """`python -m trellm_backend.tools.launch` as a subprocess on free ports (or --base-port, +1, +2)."""

    def __init__(self, repo: str, root: str, base_port: int = 0):
        self.repo, self.root = repo, root
        if base_port:
            self.http_port, self.grpc_port, self.metrics_port = base_port, base_port + 1, base_port + 2
        else:
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.log = os.path.join(root, "server.log")
        self.stdout_path, self.stderr_path = os.path.join(root, "launcher.out"), os.path.join(root, "launcher.err")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={self.repo}",
                 f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                 f"--metrics-port={self.metrics_port}", f"--log-file={self.log}"], stdout=out, stderr=err)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited with code {self.proc.returncode}:\n{self.stderr()}")
            if "tritonserver is ready" in self.stdout():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; see {self.log}")

    def stdout(self) -> str:
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def supervisor_lines(self) -> list[str]:
        """What the launcher's supervisor said so far (each restart and its reason)."""
        return [line for line in self.stderr().splitlines() if line.startswith("supervisor:")]

    def stop(self) -> list[int]:
        """SIGTERM the launcher (it stops the server and its stubs); returns the pids still mentioning the
        repository afterwards (killed)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = processes_mentioning(self.repo)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


# -- request builders ---------------------------------------------------------------------------------------------
def _grpc():
    import tritonclient.grpc as grpcclient
    return grpcclient


def tensor(name: str, array, triton_type: str):
    t = _grpc().InferInput(name, list(np.shape(array)), triton_type)
    t.set_data_from_numpy(np.asarray(array))
    return t


def ensemble_inputs(prompt: str | bytes | None, **fields) -> list:
    from trellm_client.client import build_inputs
    inputs = build_inputs(_grpc(), None, fields)
    if prompt is not None:
        raw = prompt if isinstance(prompt, bytes) else prompt.encode()
        inputs.insert(0, tensor("text_input", np.array([[raw]], dtype=np.object_), "BYTES"))
    return inputs


def llm_inputs(ids: list[int] | None, ignore_eos: bool | None = None, **fields) -> list:
    from trellm_client.client import build_inputs
    inputs = build_inputs(_grpc(), None, fields)
    if ignore_eos is not None:        # an llm field the ensemble does not have
        inputs.append(tensor("ignore_eos", np.array([[ignore_eos]]), "BOOL"))
    if ids is not None:
        inputs.insert(0, tensor("input_ids", np.array([ids], dtype=np.int32), "INT32"))
    return inputs


def vllm_inputs(prompt: str | bytes, sampling: dict | str | None = None, stream: bool = True) -> list:
    raw = prompt if isinstance(prompt, bytes) else prompt.encode()
    inputs = [tensor("text_input", np.array([raw], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL")]
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(tensor("sampling_parameters", np.array([text.encode()], dtype=np.object_), "BYTES"))
    return inputs


def words(name: str, items: list[bytes]):
    return tensor(name, np.array([items], dtype=np.object_), "BYTES")


def send(client, q: queue.Queue, model: str, inputs: list, request_id: str = ""):
    """async_stream_infer on a started stream whose callback puts (time, result, error) on `q`; returns None, or
    the error when the stream broke before the request went out (its cause, from the queue, when there is one:
    tritonclient itself only says the stream "is no longer in valid state")."""
    from tritonclient.utils import InferenceServerException
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        return None
    except InferenceServerException as e:
        try:
            _, _, cause = q.get(timeout=5)
            return cause or e
        except queue.Empty:
            return e


# -- the soak -----------------------------------------------------------------------------------------------------
@dataclass
class StreamOutcome:
    outcome: str
    ttft: float | None = None
    responses: int = 0
    finish_reason: str = ""
    message: str = ""


class Soak:
    def __init__(self, args, launcher: Launcher, vocab_size: int, prompt_char_limit: int):
        self.args, self.server = args, launcher
        self.ensemble = args.model
        self.llm = "llm" if args.model == "ensemble" else f"{args.model}_llm"
        vllm = "vllm_model" if args.model == "ensemble" else f"{args.model}_vllm_model"
        self.vllm = vllm if os.path.isdir(os.path.join(launcher.repo, vllm)) else None
        self.vocab_size, self.prompt_char_limit = vocab_size, prompt_char_limit
        self.t0 = time.monotonic()
        self.records: list[Record] = []
        self.inflight: dict[int, tuple[str, float]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.down = threading.Event()         # between the kill and the recovery: bursts wait
        self.deck: list = []
        self.deck_rng = random.Random(args.seed)
        self.kill: dict = {}
        self.rss: dict[str, dict] = {}
        self.rss_timeline: list[dict] = []      # {"t": s, "total": MiB, per process: MiB} every --rss-every s
        self.shm_regions: dict[str, str] = {}   # named by the stubs of every server of this run: their owners
        self.shm_left: dict[str, str] = {}
        self.idle: dict[str, dict] = {}

    # bookkeeping
    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)

    def begin(self, kind: str) -> int:
        token = uuid.uuid4().int
        with self.lock:
            self.inflight[token] = (kind, self.now())
        return token

    def end(self, token: int) -> None:
        with self.lock:
            self.inflight.pop(token, None)

    def record(self, kind, category, outcome, start, ttft=None, message="") -> Record:
        r = Record(kind, category, outcome, round(start, 3), round(self.now(), 3),
                   None if ttft is None else round(ttft, 4), message[:300])
        self.add(r)
        return r

    # gRPC and HTTP primitives
    def grpc_stream(self, model, inputs, request_id="", after=None, after_n=3, deadline=None) -> StreamOutcome:
        """One request on its own gRPC stream, until its final response, an error or the deadline. `after(client)`,
        if given, runs once `after_n` responses arrived, and the call returns "ok" at once (cancel, disconnect)."""
        from trellm_client.client import chunk_from_result
        grpc = _grpc()
        q: queue.Queue = queue.Queue()
        start = time.monotonic()
        end = start + (deadline or self.args.deadline)
        client = grpc.InferenceServerClient(self.server_grpc)
        ttft, n, reason = None, 0, ""
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
                remaining = end - time.monotonic()
                try:
                    if remaining <= 0:
                        raise queue.Empty
                    t, result, error = q.get(timeout=remaining)
                except queue.Empty:
                    return StreamOutcome("hung", ttft, n, reason, f"no final response after {self.args.deadline} s")
                if error is not None:
                    outcome, msg = grpc_error_outcome(error)
                    return StreamOutcome(outcome, ttft, n, reason, msg)
                chunk = chunk_from_result(result)
                n += 1
                if chunk.text and ttft is None:
                    ttft = t - start
                reason = chunk.finish_reason or reason
                if after is not None and n >= after_n:
                    after(client)
                    return StreamOutcome("ok", ttft, n, reason)
                if chunk.final:
                    return StreamOutcome("ok", ttft, n, reason)
        finally:
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:  # noqa: BLE001 - a closed channel: nothing left to clean
                pass

    @property
    def server_grpc(self) -> str:
        return f"localhost:{self.server.grpc_port}"

    def http(self, path: str, body, stream: bool, close_after_events: int | None = None,
             close_before_answer: bool = False) -> StreamOutcome:
        """POST `body` (dict or raw bytes) to Triton's HTTP endpoint; SSE events when `stream`. Outcomes: ok, error
        HTTP <status>: <class>, error HTTP 200: <class> (an error body or SSE error event), error <connection>, hung."""
        start = time.monotonic()
        end = start + self.args.deadline
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("localhost", self.server.http_port, timeout=self.args.deadline)
        ttft, n = None, 0
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            if close_before_answer:
                conn.sock.shutdown(socket.SHUT_RDWR)
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
                    return StreamOutcome("hung", ttft, n, message=f"stream not ended after {self.args.deadline} s")
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
                if close_after_events and n >= close_after_events:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    return StreamOutcome("ok", ttft, n)
        except (socket.timeout, TimeoutError):
            return StreamOutcome("hung", ttft, n, message=f"no answer after {self.args.deadline} s")
        except (OSError, http.client.HTTPException) as e:
            return StreamOutcome(f"error: {error_class(f'{type(e).__name__} {e}')}", ttft, n,
                                 message=f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    # -- the kinds of traffic --------------------------------------------------------------------------------------
    def random_ids(self, rng, n=None) -> list[int]:
        n = n or rng.randint(4, 24)
        return [1] + [rng.randrange(4, self.vocab_size) for _ in range(n - 1)]

    def wellformed(self) -> dict:
        kinds = {
            "grpc_ensemble_stream": self._wf_ensemble_stream,
            "grpc_ensemble_generate": self._wf_ensemble_generate,
            "grpc_ensemble_chat": self._wf_ensemble_chat,
            "grpc_llm_stream": self._wf_llm_stream,
            "http_ensemble_generate": self._wf_http_generate,
            "http_ensemble_generate_stream": self._wf_http_generate_stream,
        }
        if self.vllm:
            kinds["grpc_vllm_stream"] = self._wf_vllm_stream
            kinds["http_vllm_generate_stream"] = self._wf_http_vllm_stream
        return kinds

    def _wf_ensemble_stream(self, rng):
        fields = {"max_tokens": rng.randint(8, 48), "stream": True}
        roll = rng.random()
        if roll < 0.3:
            fields.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32))
        elif roll < 0.45:
            fields.update(stop_words=[".", "\n\n"], bad_words=["the"])
        elif roll < 0.55:
            fields.update(num_return_sequences=2, temperature=1.0, seed=rng.randrange(2**32))
        elif roll < 0.65:
            fields.update(repetition_penalty=1.2, min_tokens=4, return_num_output_tokens=True)
        return self.grpc_stream(self.ensemble, ensemble_inputs(rng.choice(PROMPTS), **fields)), True

    def _wf_ensemble_generate(self, rng):
        fields = {"max_tokens": rng.randint(8, 48), "stream": False, "exclude_input_in_output": rng.random() < 0.5}
        return self.grpc_stream(self.ensemble, ensemble_inputs(rng.choice(PROMPTS), **fields)), False

    def _wf_ensemble_chat(self, rng):
        msgs = json.dumps([{"role": "user", "content": rng.choice(PROMPTS)}]).encode()
        inputs = ensemble_inputs(None, max_tokens=rng.randint(8, 32), stream=True)
        inputs.append(tensor("messages", np.array([[msgs]], dtype=np.object_), "BYTES"))
        return self.grpc_stream(self.ensemble, inputs), True

    def _wf_llm_stream(self, rng):
        inputs = llm_inputs(self.random_ids(rng), max_tokens=rng.randint(8, 48), stream=True)
        return self.grpc_stream(self.llm, inputs), True

    def _wf_vllm_stream(self, rng):
        sampling = {"max_tokens": rng.randint(8, 48), "temperature": 0.7, "seed": rng.randrange(2**32)}
        if rng.random() < 0.3:
            sampling.update(stop=["."], n=2)
        return self.grpc_stream(self.vllm, vllm_inputs(rng.choice(PROMPTS), sampling)), True

    def _wf_http_generate(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48)}
        return self.http(f"/v2/models/{self.ensemble}/generate", body, stream=False), False

    def _wf_http_generate_stream(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48), "stream": True}
        return self.http(f"/v2/models/{self.ensemble}/generate_stream", body, stream=True), True

    def _wf_http_vllm_stream(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": rng.randint(8, 48)})}
        return self.http(f"/v2/models/{self.vllm}/generate_stream", body, stream=True), True

    def malformed(self) -> dict:
        """name -> a callable(rng) returning a StreamOutcome; every one must be refused."""
        e, lm = self.ensemble, self.llm
        over = "x" * (self.prompt_char_limit + 100)
        many = [b"w%d" % i for i in range(1025)]
        g = self.grpc_stream
        kinds = {
            "grpc_text_input_int32": lambda rng: g(e, [tensor("text_input", np.array([[3]], dtype=np.int32), "INT32")]),
            "grpc_max_tokens_fp32": lambda rng: g(e, ensemble_inputs("hello") + [
                tensor("max_tokens", np.array([[5.0]], dtype=np.float32), "FP32")]),
            "grpc_max_tokens_zero": lambda rng: g(e, ensemble_inputs("hello", max_tokens=0)),
            "grpc_max_tokens_negative": lambda rng: g(e, ensemble_inputs("hello", max_tokens=-3)),
            "grpc_top_p_1.5": lambda rng: g(e, ensemble_inputs("hello", top_p=1.5)),
            "grpc_temperature_nan": lambda rng: g(e, ensemble_inputs("hello", temperature=float("nan"))),
            "grpc_n_17": lambda rng: g(e, ensemble_inputs("hello", num_return_sequences=17)),
            "grpc_beam_width_4": lambda rng: g(e, ensemble_inputs("hello", beam_width=4)),
            "grpc_end_id_out_of_vocab": lambda rng: g(e, ensemble_inputs("hello", end_id=self.vocab_size + 10)),
            "grpc_empty_prompt": lambda rng: g(e, ensemble_inputs("")),
            "grpc_missing_prompt": lambda rng: g(e, ensemble_inputs(None, max_tokens=4)),
            "grpc_invalid_utf8_prompt": lambda rng: g(e, ensemble_inputs(b"\xff\xfe bad \xc3\x28")),
            "grpc_oversize_prompt": lambda rng: g(e, ensemble_inputs(over)),
            "grpc_prompt_past_context": lambda rng: g(e, ensemble_inputs("hello " * 3000)),
            "grpc_1025_bad_words": lambda rng: g(e, ensemble_inputs("hello") + [words("bad_words", many)]),
            "grpc_257_char_bad_word": lambda rng: g(e, ensemble_inputs("hello") + [words("bad_words", [b"y" * 257])]),
            "grpc_invalid_utf8_bad_word": lambda rng: g(e, ensemble_inputs("hello") + [
                words("bad_words", [b"ok", b"\xff\xfe"])]),
            "grpc_65_stop_words": lambda rng: g(e, ensemble_inputs("hello") + [words("stop_words", many[:65])]),
            "grpc_messages_not_json": lambda rng: g(e, [tensor("messages", np.array([[b"not json"]], dtype=np.object_),
                                                               "BYTES")]),
            "grpc_prompt_and_messages": lambda rng: g(e, ensemble_inputs("hello") + [
                tensor("messages", np.array([[b'[{"role": "user", "content": "hi"}]']], dtype=np.object_), "BYTES")]),
            "grpc_llm_id_out_of_vocab": lambda rng: g(lm, llm_inputs([1, self.vocab_size + 5, 7], max_tokens=4)),
            "grpc_llm_negative_id": lambda rng: g(lm, llm_inputs([1, -5, 7], max_tokens=4)),
            "grpc_llm_missing_input_ids": lambda rng: g(lm, llm_inputs(None, max_tokens=4)),
            "grpc_llm_input_ids_fp32": lambda rng: g(lm, [tensor("input_ids", np.array([[1.0, 2.0]], dtype=np.float32),
                                                                 "FP32")]),
            "grpc_llm_prompt_past_context": lambda rng: g(lm, llm_inputs(self.random_ids(rng, 2100), max_tokens=4)),
            "grpc_llm_input_lengths_mismatch": lambda rng: g(lm, llm_inputs([1, 5, 6], max_tokens=4) + [
                tensor("input_lengths", np.array([[9]], dtype=np.int32), "INT32")]),
            "grpc_unary_infer_on_decoupled": self._mf_unary,
            "grpc_unknown_model": lambda rng: g("no_such_model", ensemble_inputs("hello")),
            "http_body_not_json": lambda rng: self.http(f"/v2/models/{e}/generate", b"{not json", stream=False),
            "http_empty_body": lambda rng: self.http(f"/v2/models/{e}/generate", b"", stream=False),
            "http_max_tokens_string": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                            {"text_input": "hello", "max_tokens": "abc"}, stream=False),
            "http_unknown_field": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                        {"text_input": "hello", "max_tokns": 5}, stream=False),
            "http_top_p_out_of_range": lambda rng: self.http(f"/v2/models/{e}/generate_stream",
                                                             {"text_input": "hi", "top_p": 2.0, "stream": True},
                                                             stream=True),
            "http_invalid_utf8_body": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                            b'{"text_input": "\xff\xfe", "max_tokens": 4}', stream=False),
            "http_unknown_model": lambda rng: self.http("/v2/models/no_such_model/generate", {"text_input": "hi"},
                                                        stream=False),
        }
        if self.vllm:
            v = self.vllm
            kinds.update({
                "grpc_vllm_sampling_not_json": lambda rng: g(v, vllm_inputs("hello", "{max_tokens")),
                "grpc_vllm_unknown_key": lambda rng: g(v, vllm_inputs("hello", {"max_tokns": 5})),
                "grpc_vllm_max_tokens_string": lambda rng: g(v, vllm_inputs("hello", {"max_tokens": "abc"})),
                "grpc_vllm_n_zero": lambda rng: g(v, vllm_inputs("hello", {"n": 0})),
                "grpc_vllm_invalid_utf8_prompt": lambda rng: g(v, vllm_inputs(b"\xff bad")),
                "http_vllm_max_tokens_huge": lambda rng: self.http(
                    f"/v2/models/{v}/generate", {"text_input": "hi", "sampling_parameters":
                                                 json.dumps({"max_tokens": 4294967301})}, stream=False),
            })
        return kinds

    def _mf_unary(self, rng):
        from tritonclient.utils import InferenceServerException
        client = _grpc().InferenceServerClient(self.server_grpc)
        try:
            client.infer(self.ensemble, ensemble_inputs("hello", max_tokens=2), client_timeout=self.args.deadline)
            return StreamOutcome("ok")
        except InferenceServerException as e:
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)
        finally:
            client.close()

    def cancels(self) -> dict:
        long_llm = dict(max_tokens=2000, ignore_eos=True, stream=True)
        kinds = {
            "grpc_cancel_llm": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm),
                after=lambda c: c.stop_stream(cancel_requests=True)),
            # On Triton 2.51 a cancel does not reach the ensemble's running llm step: it runs to its end, so bounded.
            "grpc_cancel_ensemble": lambda rng: self.grpc_stream(
                self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=64, min_tokens=64, stream=True),
                after=lambda c: c.stop_stream(cancel_requests=True)),
            "grpc_cancel_right_after_send": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm), after_n=0,
                after=lambda c: c.stop_stream(cancel_requests=True)),
            "llmclient_leave_early": self._cancel_llmclient,
            "async_llmclient_leave_early": self._cancel_async_llmclient,
            "stop_request_ensemble": self._cancel_stop_request,
        }
        if self.vllm:
            kinds["grpc_cancel_vllm"] = lambda rng: self.grpc_stream(
                self.vllm, vllm_inputs(rng.choice(PROMPTS), {"max_tokens": 2000, "ignore_eos": True}),
                after=lambda c: c.stop_stream(cancel_requests=True))
        return kinds

    def _cancel_llmclient(self, rng):
        from trellm_client.client import LLMClient
        start = time.monotonic()
        try:
            with LLMClient(self.server_grpc, model=self.ensemble) as c:
                chunks = c.stream_chunks(rng.choice(PROMPTS), max_tokens=2000, min_tokens=2000, stream=True)
                ttft = None
                for i, chunk in enumerate(chunks):
                    if chunk.text and ttft is None:
                        ttft = time.monotonic() - start
                    if i == 2 or chunk.final:
                        break
                chunks.close()          # the stop request goes out here
            return StreamOutcome("ok", ttft, 3)
        except Exception as e:  # noqa: BLE001 - the error is the outcome
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)

    def _cancel_async_llmclient(self, rng):
        from trellm_client.client import AsyncLLMClient

        async def leave_early():
            async with AsyncLLMClient(self.server_grpc, model=self.ensemble) as c:
                stream = c.stream(rng.choice(PROMPTS), max_tokens=2000, min_tokens=2000)
                for _ in range(3):
                    await asyncio.wait_for(stream.__anext__(), self.args.deadline)
                await stream.aclose()
        try:
            asyncio.run(asyncio.wait_for(leave_early(), self.args.deadline))
            return StreamOutcome("ok", responses=3)
        except asyncio.TimeoutError:
            return StreamOutcome("hung", message=f"not done after {self.args.deadline} s")
        except Exception as e:  # noqa: BLE001
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)

    def _cancel_stop_request(self, rng):
        """An ensemble stream stopped by a stop request to llm naming its request id: it must end with
        finish_reason abort."""
        from tritonclient.utils import InferenceServerException

        from trellm_client.client import chunk_from_result
        grpc = _grpc()
        q: queue.Queue = queue.Queue()
        rid = f"soak-{uuid.uuid4().hex}"
        start = time.monotonic()
        end = start + self.args.deadline
        client = grpc.InferenceServerClient(self.server_grpc)
        n, reason, ttft = 0, "", None
        try:
            client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
            broken = send(client, q, self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=2000,
                                                                    min_tokens=2000, stream=True), rid)
            if broken is not None:
                outcome, msg = grpc_error_outcome(broken)
                return StreamOutcome(outcome, message=msg)
            while True:
                remaining = end - time.monotonic()
                try:
                    if remaining <= 0:
                        raise queue.Empty
                    _, result, error = q.get(timeout=remaining)
                except queue.Empty:
                    return StreamOutcome("hung", ttft, n, reason, f"not ended {self.args.deadline} s after the stop")
                if error is not None:
                    outcome, msg = grpc_error_outcome(error)
                    return StreamOutcome(outcome, ttft, n, reason, msg)
                chunk = chunk_from_result(result)
                n += 1
                if chunk.text and ttft is None:
                    ttft = time.monotonic() - start
                reason = chunk.finish_reason or reason
                if n == 3:   # the stop goes on a second stream (this one keeps receiving); its answer is awaited
                    self.grpc_stream(self.llm, [tensor("stop", np.array([[True]]), "BOOL")], request_id=rid,
                                     deadline=10)
                if chunk.final:
                    if reason == "abort":
                        return StreamOutcome("ok", ttft, n, reason)
                    return StreamOutcome(f"ended with finish_reason {reason or 'none'}", ttft, n, reason)
        except InferenceServerException as e:
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)
        finally:
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def disconnects(self) -> dict:
        def close_channel(client):
            client._channel.close()      # the connection goes, no stop_stream: a client vanishing mid-stream
        long_llm = dict(max_tokens=2000, ignore_eos=True, stream=True)
        kinds = {
            "grpc_channel_close_llm": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm), after=close_channel),
            "grpc_channel_close_ensemble": lambda rng: self.grpc_stream(
                self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=64, min_tokens=64, stream=True),
                after=close_channel),
            "kill_grpc_client_process": lambda rng: self.killed_client("grpc", rng),
            "kill_http_client_process": lambda rng: self.killed_client("http", rng),
            "http_close_mid_generate_stream": lambda rng: self.http(
                f"/v2/models/{self.ensemble}/generate_stream",
                {"text_input": rng.choice(PROMPTS), "max_tokens": 64, "min_tokens": 64, "stream": True},
                stream=True, close_after_events=2),
            "http_close_before_generate_answer": lambda rng: self.http(
                f"/v2/models/{self.ensemble}/generate",
                {"text_input": rng.choice(PROMPTS), "max_tokens": 64, "min_tokens": 64},
                stream=False, close_before_answer=True),
            "http_close_mid_request_body": self._half_sent_body,
        }
        if self.vllm:
            kinds["grpc_channel_close_vllm"] = lambda rng: self.grpc_stream(
                self.vllm, vllm_inputs(rng.choice(PROMPTS), {"max_tokens": 2000, "ignore_eos": True}),
                after=close_channel)
            kinds["http_close_mid_vllm_generate_stream"] = lambda rng: self.http(
                f"/v2/models/{self.vllm}/generate_stream",
                {"text_input": rng.choice(PROMPTS), "stream": True,
                 "sampling_parameters": json.dumps({"max_tokens": 2000, "ignore_eos": True})},
                stream=True, close_after_events=2)
        return kinds

    def _half_sent_body(self, rng):
        try:
            with socket.create_connection(("localhost", self.server.http_port), timeout=10) as s:
                s.sendall(b"POST /v2/models/%s/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                          b"\r\nContent-Length: 4000\r\n\r\n{\"text_input\": \"Lists\", \"max_tok" % self.ensemble.encode())
                time.sleep(0.05)
            return StreamOutcome("ok")
        except OSError as e:
            return StreamOutcome(f"error: {error_class(f'{type(e).__name__} {e}')}", message=str(e))

    def killed_client(self, how: str, rng) -> StreamOutcome:
        """A client process (this file, --child) that streams until told it is streaming, then gets SIGKILL."""
        target = rng.choice(["llm", "vllm"] if self.vllm else ["llm"]) if how == "grpc" else \
            rng.choice(["ensemble", "vllm"] if self.vllm else ["ensemble"])
        model = {"llm": self.llm, "vllm": self.vllm, "ensemble": self.ensemble}[target]
        port = self.server.grpc_port if how == "grpc" else self.server.http_port
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", how, str(port), target, model,
                                 str(self.vocab_size)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + self.args.deadline
            line = b""
            while time.monotonic() < end:
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
                if ready:
                    line = proc.stdout.readline()
                    break
            text = line.decode(errors="replace").strip()
            if text == "streaming":
                return StreamOutcome("ok", responses=1)
            if text.startswith("error "):
                code, _, rest = text[len("error "):].partition("|")
                return StreamOutcome(f"error {code}: {error_class(rest)}".replace("error : ", "error: "), message=rest)
            if not text and proc.poll() is None:
                return StreamOutcome("hung", message=f"the client process did not stream within {self.args.deadline} s")
            return StreamOutcome(f"error: client process ended ({text[:60] or proc.poll()})", message=text)
        finally:
            proc.kill()
            proc.wait()

    def bursts(self) -> list:
        targets = ["burst_grpc_llm", "burst_grpc_ensemble", "burst_http_ensemble_generate"]
        if self.vllm:
            targets.insert(2, "burst_grpc_vllm")
        return targets

    def burst(self, kind: str, size: int, max_tokens: int = 16) -> list[Record]:
        """`size` requests at once: on one gRPC stream, or one HTTP connection each."""
        start = self.now()
        if kind == "burst_http_ensemble_generate":
            results: list = [None] * size

            def one(i):
                results[i] = self.http(f"/v2/models/{self.ensemble}/generate",
                                       {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                        "min_tokens": max_tokens}, stream=False)
            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.args.deadline + 5)
            return [self.record(kind, "overload", r.outcome if r else "hung", start, message=r.message if r else "")
                    for r in results]
        from trellm_client.client import chunk_from_result
        grpc = _grpc()
        q: queue.Queue = queue.Queue()
        client = grpc.InferenceServerClient(self.server_grpc)
        outcomes: list[tuple[str, str]] = []
        try:
            client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
            for i in range(size):
                if kind == "burst_grpc_llm":
                    inputs = llm_inputs([1, 100 + i, 200, 300], max_tokens=max_tokens, ignore_eos=True, stream=True)
                    model = self.llm
                elif kind == "burst_grpc_vllm":
                    inputs = vllm_inputs(PROMPTS[i % len(PROMPTS)], {"max_tokens": max_tokens, "ignore_eos": True})
                    model = self.vllm
                else:
                    inputs = ensemble_inputs(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, min_tokens=max_tokens,
                                             stream=True)
                    model = self.ensemble
                broken = send(client, q, model, inputs, f"burst-{uuid.uuid4().hex}")
                if broken is not None:
                    outcomes += [grpc_error_outcome(broken)] * (size - i)
                    break
            end = time.monotonic() + self.args.deadline
            finals: set[str] = set()
            errors: list[tuple[str, str]] = []
            while len(finals) + len(errors) + len(outcomes) < size:
                remaining = end - time.monotonic()
                try:
                    if remaining <= 0:
                        raise queue.Empty
                    _, result, error = q.get(timeout=remaining)
                except queue.Empty:
                    break
                if error is not None:
                    errors.append(grpc_error_outcome(error))
                    if not errors[-1][0].startswith("error:"):  # a gRPC status: the stream itself broke, and
                        # every request still on it with it (model errors on a stream carry no status on 2.51)
                        errors.extend([errors[-1]] * (size - len(finals) - len(errors) - len(outcomes)))
                elif chunk_from_result(result).final:
                    finals.add(result.get_response().id)
            outcomes += [("ok", "")] * len(finals) + errors
            outcomes += [("hung", f"no final response after {self.args.deadline} s")] * (size - len(outcomes))
        finally:
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:  # noqa: BLE001
                pass
        return [self.record(kind, "overload", o, start, message=m) for o, m in outcomes]

    # -- threads -------------------------------------------------------------------------------------------------
    def build_deck(self) -> list:
        """One round: every malformed, cancel and disconnect kind once, every well-formed kind
        `--wellformed-copies` times, shuffled."""
        deck = []
        for category, kinds, copies in (("wellformed", self.wellformed(), self.args.wellformed_copies),
                                         ("malformed", self.malformed(), 1), ("cancel", self.cancels(), 1),
                                         ("disconnect", self.disconnects(), 1)):
            for name, fn in kinds.items():
                deck += [(category, name, fn)] * copies
        self.deck_rng.shuffle(deck)
        return deck

    def next_action(self):
        with self.lock:
            if not self.deck:
                self.deck = self.build_deck()
            return self.deck.pop()

    def run_action(self, category, kind, fn, rng) -> Record:
        token = self.begin(kind)
        start = self.now()
        try:
            res = fn(rng)
            if category == "wellformed":
                res, streamed = res
            else:
                streamed = False
        except Exception as e:  # noqa: BLE001 - a client-side failure is an outcome too, never a dead worker
            res, streamed = StreamOutcome(f"client exception {type(e).__name__}", message=repr(e)), False
        finally:
            self.end(token)
        outcome = res.outcome
        if category == "malformed" and outcome == "ok":
            outcome = "accepted"
        return self.record(kind, category, outcome, start, res.ttft if (streamed and outcome == "ok") else None,
                           res.message)

    def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            if self.pause.is_set():
                time.sleep(0.05)
                continue
            category, kind, fn = self.next_action()
            r = self.run_action(category, kind, fn, rng)
            if is_connection_error(r.outcome) or "not healthy" in r.outcome:
                time.sleep(0.5)      # the server is away (the kill): retry a little later, as a client would
            else:
                time.sleep(rng.uniform(0, 0.05))

    def burster(self) -> None:
        targets = self.bursts()
        i = 0
        next_at = self.now() + min(2.0, self.args.burst_every)
        while not self.stop.is_set():
            if self.pause.is_set() or self.down.is_set() or self.now() < next_at:
                time.sleep(0.1)
                continue
            kind = targets[i % len(targets)]
            token = self.begin(kind)
            try:
                self.burst(kind, self.args.burst_size)
            finally:
                self.end(token)
            i += 1
            next_at = self.now() + self.args.burst_every

    def rss_sampler(self) -> None:
        while not self.stop.wait(self.args.rss_every):
            self.rss_timeline.append({"t": round(self.now(), 1),
                                      **server_rss(self.server.repo, {self.server.proc.pid})})
            self.shm_regions.update(stub_shm_regions(self.server.repo))

    def wait_idle(self, timeout: float) -> dict:
        """Poll the engine's gauges until KV blocks, running and waiting requests are all 0."""
        start = time.monotonic()
        last: dict = {}
        while True:
            try:
                m = metrics(self.server.metrics_port)
                last = {g: m.get(self.llm, {}).get(g) for g in IDLE_GAUGES}
            except OSError as e:
                last = {"error": str(e)}
            if all(last.get(g) == 0 for g in IDLE_GAUGES):
                return {"idle": True, "after_s": round(time.monotonic() - start, 2), **last}
            if time.monotonic() - start > timeout:
                return {"idle": False, "after_s": round(time.monotonic() - start, 2), **last}
            time.sleep(0.2)

    def wait_no_inflight(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if not self.inflight:
                    return True
            time.sleep(0.05)
        return False

    def kill_stub(self) -> None:
        """Pause the traffic until idle (the first half's leak check), resume it, open three long streams, kill
        the llm stub, and time the failures and the recovery."""
        k = self.kill
        self.pause.set()
        k["paused_at_s"] = round(self.now(), 1)
        k["drained"] = self.wait_no_inflight(self.args.deadline + 10)
        self.idle["before_kill"] = self.wait_idle(self.args.idle_timeout)
        self.rss["before_kill"] = server_rss(self.server.repo, {self.server.proc.pid})
        self.shm_regions.update(stub_shm_regions(self.server.repo))
        self.pause.clear()
        streams = {"ensemble": lambda: self.grpc_stream(self.ensemble, ensemble_inputs(
                       "Once upon a time", max_tokens=2000, min_tokens=2000, stream=True), deadline=self.args.deadline),
                   "llm": lambda: self.grpc_stream(self.llm, llm_inputs([1, 100, 200, 300], max_tokens=2000,
                                                                         ignore_eos=True, stream=True))}
        if self.vllm:
            streams["vllm_model"] = lambda: self.grpc_stream(self.vllm, vllm_inputs(
                "Once upon a time", {"max_tokens": 2000, "ignore_eos": True}))
        ended: dict[str, tuple[float, StreamOutcome]] = {}

        def run(name, fn):
            start = self.now()
            token = self.begin(f"kill_inflight_{name}")
            try:
                res = fn()
            finally:
                self.end(token)
            ended[name] = (time.monotonic(), res)
            self.record(f"kill_inflight_{name}", "kill", res.outcome, start, message=res.message)
        threads = [threading.Thread(target=run, args=item, daemon=True) for item in streams.items()]
        for t in threads:
            t.start()
        time.sleep(2.0)                       # the streams are running (and the workers busy) when the stub dies
        stubs = processes_mentioning(os.path.join(self.server.repo, self.llm, "1", "model.py"))
        if len(stubs) != 1:   # e.g. the stub died by itself and the supervisor is restarting the server
            k["error"] = (f"expected one {self.llm} stub, found {stubs}; "
                          f"supervisor so far: {self.server.supervisor_lines()}")
            return
        self.down.set()
        os.kill(stubs[0], signal.SIGKILL)
        killed = time.monotonic()
        k.update(stub_pid=stubs[0], killed_at_s=round(self.now(), 2))
        for t in threads:
            t.join(self.args.deadline + 5)
        k["inflight_streams"] = {n: {"outcome": r.outcome, "responses": r.responses,
                                     "ended_after_kill_s": round(t - killed, 2)} for n, (t, r) in ended.items()}
        # Recovery: the first successful generate after the kill.
        probes = Counter()
        while time.monotonic() - killed < self.args.recovery_timeout:
            start = self.now()
            res = self.grpc_stream(self.ensemble, ensemble_inputs("Hello", max_tokens=2, stream=False), deadline=20)
            self.record("recovery_probe", "recovery", res.outcome, start, message=res.message)
            probes[res.outcome] += 1
            if res.outcome == "ok":
                k["recovered_after_s"] = round(time.monotonic() - killed, 2)
                k["recovered_at_s"] = round(self.now(), 2)
                break
            time.sleep(0.25)
        k["probes"] = dict(probes)
        self.down.clear()
        if "recovered_after_s" in k:
            self.rss["after_recovery"] = server_rss(self.server.repo, {self.server.proc.pid})
            self.shm_regions.update(stub_shm_regions(self.server.repo))

    def run(self) -> None:
        self.t0 = time.monotonic()
        workers = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.args.workers)]
        burster = threading.Thread(target=self.burster, daemon=True)
        for t in workers + [burster, threading.Thread(target=self.rss_sampler, daemon=True)]:
            t.start()
        kill_at = self.args.duration * self.args.kill_at
        while self.now() < kill_at:
            time.sleep(0.2)
        if not self.args.no_kill:
            self.kill_stub()
        end_at = self.args.duration
        if "recovered_at_s" in self.kill:
            end_at = max(end_at, self.kill["recovered_at_s"] + self.args.after_recovery)
        while self.now() < end_at:
            time.sleep(0.2)
        self.stop.set()
        self.traffic_s = round(self.now(), 1)
        for t in workers + [burster]:
            t.join(self.args.deadline + 15)
        with self.lock:
            self.stuck = [{"kind": kind, "since_s": round(self.now() - started, 1)}
                          for kind, started in self.inflight.values()]

    def final_checks(self) -> None:
        self.idle["end"] = self.wait_idle(self.args.idle_timeout)
        self.rss["end"] = server_rss(self.server.repo, {self.server.proc.pid})
        self.shm_regions.update(stub_shm_regions(self.server.repo))
        if self.vllm:
            slots = int(config_parameter(self.server.repo, self.vllm, "max_concurrent_requests") or 256)
            n = len(self.records)
            records = self.burst("burst_grpc_vllm", min(slots, 64), max_tokens=4)
            del self.records[n:]          # not traffic of the soak: a check
            self.vllm_slots = {"requests": len(records), "served": sum(r.outcome == "ok" for r in records),
                               "refused": dict(Counter(r.outcome for r in records if r.outcome != "ok"))}
            self.idle["after_slot_check"] = self.wait_idle(self.args.idle_timeout)
        try:
            self.final_metrics = metrics(self.server.metrics_port).get(self.llm, {})
        except OSError:
            self.final_metrics = {}


# -- the summary --------------------------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.array(values), p))


def summarize(soak: Soak, args, startup: dict, launcher: Launcher, left_processes: list[int]) -> dict:
    records = soak.records
    k = soak.kill
    killed, recovered = k.get("killed_at_s"), k.get("recovered_at_s")

    def in_restart(r: Record) -> bool:
        return killed is not None and r.t_end >= killed and (recovered is None or r.t_start <= recovered)

    by_kind: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    samples: dict[str, str] = {}
    for r in records:
        by_kind[r.category][r.kind][r.outcome] += 1
        if r.outcome != "ok" and r.message:
            samples.setdefault(f"{r.kind} | {r.outcome}", r.message)
    hung = [asdict(r) for r in records if r.outcome == "hung"] + [dict(s, outcome="stuck") for s in soak.stuck]
    wf = [r for r in records if r.category == "wellformed"]
    wf_out_of_restart = [r for r in wf if not in_restart(r)]
    capacity = [r for r in wf_out_of_restart if "capacity" in r.outcome or "queue full" in r.outcome]
    wf_ok = [r for r in wf_out_of_restart if r.outcome == "ok"]
    wf_other = [r for r in wf_out_of_restart if r.outcome != "ok" and r not in capacity]
    ttfts = [r.ttft for r in records if r.category == "wellformed" and r.ttft is not None]
    malformed = [r for r in records if r.category == "malformed"]
    overload = [r for r in records if r.category == "overload"]
    unexpected = []
    for r in malformed:
        if r.outcome == "accepted":
            unexpected.append(f"malformed request served: {r.kind}")
        elif not r.outcome.startswith("error") and not in_restart(r):
            unexpected.append(f"malformed {r.kind}: {r.outcome}")
    for r in wf_other:
        unexpected.append(f"well-formed {r.kind} at {r.t_start:.1f} s: {r.outcome}: {r.message[:160]}")
    for r in records:
        if r.category in ("cancel", "disconnect") and r.outcome != "ok" and not in_restart(r) \
                and "capacity" not in r.outcome and "queue full" not in r.outcome:
            unexpected.append(f"{r.category} {r.kind} at {r.t_start:.1f} s: {r.outcome}: {r.message[:160]}")
    for name, s in k.get("inflight_streams", {}).items():
        if s["outcome"] == "ok" or s["ended_after_kill_s"] > 5:
            unexpected.append(f"stream in flight at the kill ({name}): {s['outcome']} {s['ended_after_kill_s']} s "
                              "after the kill")
    for name, idle in soak.idle.items():
        if idle.get("idle") and idle.get("after_s", 0) > 10:
            unexpected.append(f"idle {name} only after {idle['after_s']} s")
    if soak.shm_left:
        unexpected.append(f"{len(soak.shm_left)} of the {len(soak.shm_regions)} /dev/shm regions of this run's stubs "
                          f"are still there after the launcher stopped: {'; '.join(soak.shm_left.values())}")

    try:
        with open(launcher.log, errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    from trellm_backend.tools.launch import log_errors
    errors = log_errors(launcher.log)
    # tritonserver's own crashes (a signal other than the SIGTERM that stops it, an uncaught C++ exception), and a
    # stub's (Python's fault handler, which the models enable, names the signal; the thread stacks follow it)
    crashes = [line.strip() for line in log.splitlines()
               if (re.match(r"Signal \((\d+)\) received", line) and not line.startswith("Signal (15)"))
               or line.startswith(("terminate called", "Fatal Python error")) or "  what():" in line]
    for line in crashes:
        unexpected.append(f"server log: {line}")
    error_classes = Counter(error_class(re.sub(r"^E\d{4} [\d:.]+ +\d+ \S+\] ", "", line)) for line in errors)
    supervisor = launcher.supervisor_lines()

    kv = {name: idle.get("trellm:kv_cache_used_blocks") for name, idle in soak.idle.items()}
    failures = []
    if hung:
        failures.append(f"{len(hung)} hung request(s)")
    for name, idle in soak.idle.items():
        if not idle.get("idle"):
            failures.append(f"not idle {name}: {idle}")
    if not args.no_kill and "recovered_after_s" not in k:
        failures.append(f"the server never recovered after the stub kill: {k}")
    vllm_slots = getattr(soak, "vllm_slots", None)
    if vllm_slots and vllm_slots["served"] != vllm_slots["requests"]:
        failures.append(f"vllm_model refused requests at idle (a slot leak?): {vllm_slots}")
    if left_processes:
        failures.append(f"processes left after the launcher stopped: {left_processes}")

    return {
        "command": " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0].startswith(REPO) else sys.argv[0],
                             *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {"duration_s": args.duration, "traffic_s": soak.traffic_s, "workers": args.workers,
                     "deadline_s": args.deadline, "burst_size": args.burst_size, "burst_every_s": args.burst_every,
                     "repository_settings": startup["settings"], "model_path": startup["model_path"],
                     "cpus": os.cpu_count()},
        "startup_s": startup["startup_s"],
        "requests": len(records),
        "by_category": {c: sum(sum(o.values()) for o in kinds.values()) for c, kinds in by_kind.items()},
        "by_kind": {c: {kind: dict(o) for kind, o in sorted(kinds.items())} for c, kinds in sorted(by_kind.items())},
        "kinds_planned": {"wellformed": sorted(soak.wellformed()), "malformed": sorted(soak.malformed()),
                          "cancel": sorted(soak.cancels()), "disconnect": sorted(soak.disconnects()),
                          "overload": sorted(soak.bursts())},
        "outcomes": dict(Counter(r.outcome for r in records).most_common()),
        "error_samples": samples,
        "hung": len(hung),
        "hung_requests": hung[:50],
        "kv_blocks_at_idle": kv,
        "idle": soak.idle,
        "vllm_slots_at_idle": vllm_slots,
        "rss_mib": soak.rss,
        "rss_timeline": soak.rss_timeline,
        "ttft_ms": {"n": len(ttfts), "p50": _ms(percentile(ttfts, 50)), "p90": _ms(percentile(ttfts, 90)),
                    "p99": _ms(percentile(ttfts, 99)), "max": _ms(max(ttfts) if ttfts else None)},
        "wellformed": {"requests": len(wf), "during_restart": len(wf) - len(wf_out_of_restart),
                       "outside_restart": len(wf_out_of_restart), "ok": len(wf_ok), "refused_at_capacity":
                       len(capacity), "other_errors": len(wf_other),
                       "ok_fraction": round(len(wf_ok) / max(1, len(wf_out_of_restart) - len(capacity)), 4)},
        "malformed": {"requests": len(malformed), "refused": sum(r.outcome.startswith("error") for r in malformed),
                      "accepted": sum(r.outcome == "accepted" for r in malformed)},
        "overload": {"requests": len(overload), "ok": sum(r.outcome == "ok" for r in overload),
                     "refused_at_capacity": sum("capacity" in r.outcome or "queue full" in r.outcome
                                                for r in overload)},
        "kill": k,
        "recovery_s": k.get("recovered_after_s"),
        "supervisor": supervisor,
        "engine_counters": {key: v for key, v in getattr(soak, "final_metrics", {}).items()
                            if key.startswith("vllm:request_success_total") or key == "vllm:num_preemptions_total"},
        "server_log": {"error_lines": len(errors), "tracebacks": log.count("Traceback (most recent call last)"),
                       "crash_lines": crashes, "error_classes": dict(error_classes.most_common(20))},
        "shm_regions": {"used": len(soak.shm_regions), "left_after_stop": soak.shm_left},
        "unexpected": unexpected[:200],
        "unexpected_count": len(unexpected),
        "processes_left": left_processes,
        "failures": failures,
        "passed": not failures,
    }


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def print_summary(s: dict) -> None:
    print(f"\nsoak: {s['settings']['traffic_s']} s of traffic, {s['requests']} requests, "
          f"{s['settings']['workers']} workers, bursts of {s['settings']['burst_size']} every "
          f"{s['settings']['burst_every_s']} s (server start {s['startup_s']} s)\n")
    rows = [("category", "kind", "outcome", "count")]
    for category, kinds in s["by_kind"].items():
        for kind, outcomes in kinds.items():
            for outcome, n in sorted(outcomes.items(), key=lambda x: -x[1]):
                rows.append((category, kind, outcome[:72], str(n)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>6}")
    print("\nby outcome:")
    for outcome, n in s["outcomes"].items():
        print(f"  {n:6d}  {outcome}")
    wf, k = s["wellformed"], s["kill"]
    print(f"\nhung requests:        {s['hung']}")
    print("KV blocks at idle:    " + ", ".join(f"{name} {v}" for name, v in s["kv_blocks_at_idle"].items()))
    if s["vllm_slots_at_idle"]:
        v = s["vllm_slots_at_idle"]
        print(f"vllm_model slots:     {v['served']} of {v['requests']} served at idle")
    print("RSS MiB (server+stubs): " + ", ".join(f"{name} {r['total']}" for name, r in s["rss_mib"].items()))
    for name in ("start", "end"):
        if name in s["rss_mib"]:
            print(f"  {name:5s} " + ", ".join(f"{p} {v}" for p, v in s["rss_mib"][name].items() if p != "total"))
    timeline = s["rss_timeline"]
    if timeline:
        step = max(1, len(timeline) // 12)
        print("  timeline (s: total MiB) " + ", ".join(f"{x['t']:.0f}: {x['total']:.0f}" for x in timeline[::step]))
    t = s["ttft_ms"]
    print(f"TTFT well-formed streams: p50 {t['p50']} ms, p90 {t['p90']} ms, p99 {t['p99']} ms, max {t['max']} ms "
          f"(n={t['n']})")
    print(f"well-formed:          {wf['ok']} ok of {wf['outside_restart']} outside the restart "
          f"({wf['refused_at_capacity']} refused at capacity, {wf['other_errors']} other errors), "
          f"{wf['during_restart']} during it")
    m, o = s["malformed"], s["overload"]
    print(f"malformed:            {m['refused']} refused, {m['accepted']} served, of {m['requests']}")
    print(f"overload bursts:      {o['ok']} served, {o['refused_at_capacity']} refused at capacity, of {o['requests']}")
    if "killed_at_s" in k:
        streams = ", ".join(f"{n} {v['outcome']} after {v['ended_after_kill_s']} s"
                            for n, v in k.get("inflight_streams", {}).items())
        print(f"stub kill at {k['killed_at_s']} s: streams in flight: {streams}")
        print(f"recovery (kill -> first generate): {s['recovery_s']} s; supervisor: {' / '.join(s['supervisor'])}")
    log = s["server_log"]
    print(f"server log: {log['error_lines']} error lines, {log['tracebacks']} tracebacks, "
          f"{len(log['crash_lines'])} crash lines")
    shm = s["shm_regions"]
    print(f"/dev/shm regions of this run's stubs: {shm['used']}, {len(shm['left_after_stop'])} left after the stop")
    for cls, n in log["error_classes"].items():
        print(f"  {n:6d}  {cls}")
    if s["unexpected_count"]:
        print(f"unexpected ({s['unexpected_count']}):")
        for line in s["unexpected"][:30]:
            print(f"  {line}")
    print("\nPASS" if s["passed"] else "\nFAIL: " + "; ".join(s["failures"]))


# -- client processes killed mid-stream (--child) -------------------------------------------------------------------
def child(how: str, port: int, target: str, model: str, vocab_size: int) -> None:
    """Stream one long request; print "streaming" once it streams (or "error CODE|message"), then wait to be
    killed."""
    if how == "http":
        body = {"text_input": "Once upon a time", "stream": True}
        if target == "vllm":
            body["sampling_parameters"] = json.dumps({"max_tokens": 2000, "ignore_eos": True})
        else:
            body.update(max_tokens=64, min_tokens=64)
        conn = http.client.HTTPConnection("localhost", port, timeout=60)
        try:
            conn.request("POST", f"/v2/models/{model}/generate_stream", body=json.dumps(body).encode())
            resp = conn.getresponse()
            if resp.status != 200:
                print(f"error HTTP {resp.status}|{resp.read().decode(errors='replace')}", flush=True)
                return
            while True:
                line = resp.readline()
                if not line:
                    print("error |stream ended before the kill", flush=True)
                    return
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    print(f"error HTTP 200|{event['error']}" if "error" in event else "streaming", flush=True)
                    break
        except OSError as e:
            print(f"error |{type(e).__name__} {e}", flush=True)
            return
        time.sleep(600)
        return
    grpc = _grpc()
    q: queue.Queue = queue.Queue()
    client = grpc.InferenceServerClient(f"localhost:{port}")
    client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
    if target == "vllm":
        inputs = vllm_inputs("Once upon a time", {"max_tokens": 2000, "ignore_eos": True})
    else:
        inputs = llm_inputs([1] + [random.randrange(4, vocab_size) for _ in range(8)], max_tokens=2000,
                            ignore_eos=True, stream=True)
    error = send(client, q, model, inputs)
    if error is None:
        try:
            _, _, error = q.get(timeout=60)
        except queue.Empty:
            print("error |no response within 60 s", flush=True)
            return
    if error is not None:
        outcome, msg = grpc_error_outcome(error)
        code = outcome.split(":")[0][len("error "):] if not outcome.startswith("error:") else ""
        print(f"error {code}|{msg}", flush=True)
        return
    print("streaming", flush=True)
    time.sleep(600)


# -- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--model-repository", default=DEFAULT_REPOSITORY,
                    help="repository to copy and serve (default: the checkout's, on hf_models/tiny-llama)")
    ap.add_argument("--model", default="ensemble",
                    help="the ensemble entry (an added model's name: its NAME_llm and NAME_vllm_model are used)")
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                    help="a config.pbtxt parameter of the private copy (defaults: llm.max_num_seqs=8, "
                         "llm.max_queue_size=16, vllm_model.max_concurrent_requests=16)")
    ap.add_argument("--workers", type=int, default=4, help="threads sending the mixed traffic (default 4)")
    ap.add_argument("--wellformed-copies", type=int, default=3,
                    help="copies of each well-formed kind per round of the deck (others: 1; default 3)")
    ap.add_argument("--deadline", type=float, default=60.0, help="a request not done after this many s is hung")
    ap.add_argument("--burst-size", type=int, default=50)
    ap.add_argument("--burst-every", type=float, default=None,
                    help="seconds between overload bursts (default: duration/8, at most 20)")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the duration when the stub dies")
    ap.add_argument("--no-kill", action="store_true", help="no stub kill")
    ap.add_argument("--after-recovery", type=float, default=10.0,
                    help="traffic goes on at least this many s after the recovery, past --duration if needed")
    ap.add_argument("--recovery-timeout", type=float, default=300.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="how long the server may take to become idle")
    ap.add_argument("--base-port", type=int, default=0, help="HTTP port (gRPC +1, metrics +2); default: free ports")
    ap.add_argument("--rss-every", type=float, default=15.0, help="seconds between RSS samples (the timeline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="where the repository copy and logs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (kept anyway when the soak fails)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.burst_every is None:
        args.burst_every = min(20.0, max(2.0, args.duration / 8))
    settings = {m: dict(s) for m, s in DEFAULT_SETTINGS.items()}
    for item in args.set:
        m = re.fullmatch(r"([^.=]+)\.([^=]+)=(.*)", item)
        if not m:
            ap.error(f"--set {item!r}: expected MODEL.KEY=VALUE")
        settings.setdefault(m.group(1), {})[m.group(2)] = m.group(3)
    if args.model != "ensemble":
        settings = {(f"{args.model}_{m}" if m in ("llm", "vllm_model") else m): s for m, s in settings.items()}
    args.settings = settings
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        how, port, target, model, vocab = argv[1:6]
        child(how, int(port), target, model, int(vocab))
        return 0
    args = parse_args(argv)
    root = args.work_dir or tempfile.mkdtemp(prefix="trellm-soak-")
    os.makedirs(root, exist_ok=True)
    repo = private_repository(args.model_repository, root, args.settings)
    llm = "llm" if args.model == "ensemble" else f"{args.model}_llm"
    model_path = config_parameter(repo, llm, "model_path")
    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        if model_path and os.path.normpath(model_path) == os.path.normpath(DEFAULT_MODEL):
            from trellm_backend.tools.default_model import build
            build(DEFAULT_MODEL)
        else:
            print(f"error: {llm}'s model_path {model_path} holds no config.json", file=sys.stderr)
            return 2
    from trellm_backend.triton.tokenization import prompt_char_limit
    with open(os.path.join(model_path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]

    launcher = Launcher(repo, root, args.base_port)
    print(f"soak: serving {repo} (log {launcher.log}) on HTTP {launcher.http_port}, gRPC {launcher.grpc_port}, "
          f"metrics {launcher.metrics_port}", flush=True)
    left: list[int] = []
    summary = None
    try:
        startup_s = launcher.start()
        soak = Soak(args, launcher, vocab_size, prompt_char_limit(model_path))
        rng = random.Random(args.seed)
        for name, fn in soak.wellformed().items():         # warm-up: every path once, not counted
            res, _ = fn(rng)
            if res.outcome != "ok":
                print(f"warm-up {name}: {res.outcome} {res.message}", file=sys.stderr, flush=True)
        soak.rss["start"] = server_rss(repo, {launcher.proc.pid})
        soak.shm_regions.update(stub_shm_regions(repo))
        print(f"soak: server ready after {startup_s:.1f} s; {args.duration:.0f} s of traffic begins", flush=True)
        soak.run()
        soak.final_checks()
        left = launcher.stop()
        time.sleep(1)
        soak.shm_left = shm_left(soak.shm_regions)
        summary = summarize(soak, args, {"startup_s": round(startup_s, 1), "settings": args.settings,
                                         "model_path": model_path}, launcher, left)
    finally:
        if summary is None:
            launcher.stop()
            print(f"soak: aborted; logs in {root}", file=sys.stderr)
    print_summary(summary)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary written to {args.out}")
    if summary["passed"] and not args.keep and not args.work_dir:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"logs kept in {root}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
