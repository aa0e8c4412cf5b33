"""Start a real tritonserver on a model repository, wait until its models are ready, stop it cleanly.

    python -m trellm_backend.tools.launch [--model-repository model_repository] [--http-port 8000] ...

tritonserver's own log goes to a file (its path printed; `--verbose` shows it live instead): on a CPU host it is
some eighty lines, among them harmless errors about CUDA, NVML and DCGM, which would bury the launcher's summary
and break into the demo answer. When the server fails to start, the launcher prints the log's error lines.

The server binary is `tritonserver` from PATH (the NGC container) or, without Docker, the Triton 2.51 that the
`nvidia-pytriton` wheel carries: that copy is prepared once next to the virtual environment (the wheel's folder
holds one Python-backend stub per Python version; the backend wants one at a fixed place). The server runs in its
own process group, which also holds its Python-backend stubs, so stopping the group leaves no process behind.
While it runs, tools/supervisor.py watches it and restarts it when a stub dies or the server exits (--no-restart:
exit instead).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request

from trellm_backend.tools.repository import default_repository
from trellm_backend.tools.supervisor import Supervisor, remove_shm_regions, server_children, stub_shm_regions
from trellm_backend.tools.testbed import metric_samples
from trellm_backend.tracing import traces_endpoint
from trellm_openai.tools import TOOL_CALL_PARSERS

DEFAULT_REPOSITORY = default_repository()
# Triton's APIs that change or expose the server (a model.py uploaded with a load runs inside it): on a public port
# they want ADMIN_HEADER with the launcher's admin key (Triton's --http-restricted-api, --grpc-restricted-protocol).
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_HEADER = "triton-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER    # Triton prefixes the metadata key a gRPC call sends
ADMIN_KEY_ENV = "TRELLM_TRITON_ADMIN_KEY"     # how the front door learns it (its model list reads the repository index)
MODEL_CONTROL_MODES = ("none", "poll", "explicit")
# Error lines of tritonserver's log that a CPU-only host always prints: not failures of this repository.
HARMLESS_ERRORS = ("cuda", "nvml", "dcgm", "gpu", "pinned memory")
# The stub links libpython3.X.so: it must be this interpreter's, whose standard library the stub then imports (a
# distribution's libpython of another patch release fails on extension modules such as _ssl). Read at import, once:
# sysconfig fills its table on first use, and on Python 3.11 a second thread can read it half-filled, which gave the
# second of two servers started at once the distribution's libpython.
PYTHON_LIBDIR = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None


def log_errors(log_path: str) -> list[str]:
    """tritonserver's error lines (glog `E...`) in its log, without the ones every CPU host prints."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [line for line in lines if line[:1] == "E" and line[1:5].isdigit()
            and not any(word in line.lower() for word in HARMLESS_ERRORS)]


def _pytriton_dirs() -> tuple[str, str]:
    import pytriton
    site = os.path.dirname(os.path.dirname(pytriton.__file__))
    return os.path.join(os.path.dirname(pytriton.__file__), "tritonserver"), os.path.join(site, "nvidia_pytriton.libs")


def _python_env(libs: str) -> dict[str, str]:
    """What the server and its stubs need of this interpreter: its libpython and `libs` on the library path, and
    its `python` first on PATH (the stub runs the first one there)."""
    return {
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in (PYTHON_LIBDIR, libs, os.environ.get("LD_LIBRARY_PATH")) if p),
        "PATH": os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", ""))),
    }


def prepare_server() -> tuple[list[str], dict[str, str]]:
    """The tritonserver command prefix and the environment additions it needs: TRELLM_TRITONSERVER_HOME's server
    (a folder of perf/pack_tritonserver.py's layout, for a host without the wheel, such as a GPU image), else a
    `tritonserver` on PATH, else the nvidia-pytriton wheel's."""
    home = os.environ.get("TRELLM_TRITONSERVER_HOME")
    if home:
        server = os.path.join(home, "bin", "tritonserver")
        if not os.path.isfile(server):
            raise RuntimeError(f"TRELLM_TRITONSERVER_HOME={home} has no bin/tritonserver")
        return [server, f"--backend-directory={os.path.join(home, 'backends')}"], _python_env(
            os.path.join(home, "libs"))
    on_path = shutil.which("tritonserver")
    if on_path:
        return [on_path], {}
    src, libs = _pytriton_dirs()
    dest = os.path.join(sys.prefix, "trellm-tritonserver")
    stub_src = os.path.join(src, "python_backend_stubs", f"{sys.version_info.major}.{sys.version_info.minor}",
                            "triton_python_backend_stub")
    stub = os.path.join(dest, "backends", "python", "triton_python_backend_stub")
    if not os.path.isfile(stub):
        if not os.path.isfile(stub_src):
            raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {sys.version.split()[0]}")
        tmp = dest + f".tmp{os.getpid()}"
        shutil.copytree(src, tmp, symlinks=True, ignore=shutil.ignore_patterns("python_backend_stubs"))
        shutil.copy2(stub_src, os.path.join(tmp, "backends", "python", "triton_python_backend_stub"))
        os.chmod(os.path.join(tmp, "backends", "python", "triton_python_backend_stub"), 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:   # another process prepared it first
            shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(dest, "bin", "tritonserver"), f"--backend-directory={os.path.join(dest, 'backends')}"], \
        _python_env(libs)


def openmp_wait_defaults(environ) -> dict[str, str]:
    """How long an idle OpenMP worker of torch spins before it sleeps, unless the caller chose (torch's wheels use
    libgomp). The server, the stubs and the engine share the cores: libgomp's default (~3 ms of spinning) cut
    streamed throughput severalfold on 2 cores (perf/RESULTS.md, section "CPU (2 cores, 24 GiB, default model
    `hf_models/tiny-llama`, float32)"), while sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a futex wake-up on
    every parallel region of a step. ~0.1 ms keeps the workers awake between the back-to-back operations of one
    forward pass and asleep between steps: more engine tokens/s than sleeping at once, on a small model too
    (perf/RESULTS.md, section "OpenMP wait: ~0.1 ms of spinning against sleeping at once")."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": "10000"}


def trace_args(endpoint: str | None) -> list[str]:
    """tritonserver's flags for OpenTelemetry traces of every request to `endpoint` (none without one). A client's
    `traceparent` (HTTP header, gRPC metadata) makes its span the parent of the request's."""
    if not endpoint:
        return []
    return [f"--trace-config={setting}" for setting in (
        "mode=opentelemetry", "level=TIMESTAMPS", "rate=1", "count=-1", f"opentelemetry,url={endpoint}",
        "opentelemetry,resource=service.name=tritonserver")]


def trace_env(endpoint: str | None) -> dict[str, str]:
    """What the engine and the front door read to trace to `endpoint` (tracing.traces_endpoint)."""
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint} if endpoint else {}


# How long a stop may take in all before the server's process group is killed: the engines' drain, then the server's
# own exit (its exit timeout and the unload). A stub inside a native call that does not return (a kernel that runs for
# minutes) ignores SIGTERM and keeps its request in flight, and the server waits for it past its exit timeout.
STOP_GRACE_S = 30.0
KILL_WAIT_S = 5.0      # after SIGKILL: a process inside an uninterruptible call dies only when the call returns


class TritonServer:
    """A tritonserver process. Use as a context manager, or call start() and stop()."""

    def __init__(self, model_repository: str = DEFAULT_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log_path: str | None = None, extra_args: list[str] | None = None,
                 model_control_mode: str = "none", load_models: list[str] | None = None,
                 otlp_traces_endpoint: str | None = None, http_public: bool = False, grpc_public: bool = False,
                 admin_key: str | None = None):
        """model_control_mode "explicit" loads only `load_models` at start (all models with "*"); others are then
        loaded and unloaded through the repository API (POST /v2/repository/models/<name>/load|unload).
        `otlp_traces_endpoint` (an OTLP/HTTP URL, .../v1/traces): every request is traced there, by tritonserver
        (its ensemble and step spans) and by the engine (tracing.py); a front door started for this server too.
        Triton's HTTP and gRPC ports listen on 127.0.0.1 unless `http_public`/`grpc_public`; a public one serves
        ADMIN_APIS only to calls with ADMIN_HEADER: `admin_key` (required then)."""
        if model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode={model_control_mode!r}; one of {MODEL_CONTROL_MODES}")
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit' (the other modes load every model)")
        self.model_repository = os.path.abspath(model_repository)
        self.model_control_mode, self.load_models = model_control_mode, list(load_models or [])
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_path = log_path
        self.extra_args = extra_args or []
        self.otlp_traces_endpoint = otlp_traces_endpoint
        if (http_public or grpc_public) and not admin_key:
            raise ValueError("a public Triton port needs an admin key for its repository, shared-memory, trace and "
                             "logging APIs")
        self.http_public, self.grpc_public, self.admin_key = http_public, grpc_public, admin_key
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """What an HTTP call to ADMIN_APIS sends (nothing while the HTTP port is on loopback)."""
        return {ADMIN_HEADER: self.admin_key} if self.http_public else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """What a gRPC call to ADMIN_APIS sends (nothing while the gRPC port is on loopback)."""
        return {GRPC_ADMIN_HEADER: self.admin_key} if self.grpc_public else {}

    def address_args(self) -> list[str]:
        """tritonserver's flags for where its HTTP and gRPC ports listen, and which of their APIs want the key."""
        restricted = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        return [*(["--http-restricted-api=" + restricted] if self.http_public else ["--http-address=127.0.0.1"]),
                *(["--grpc-restricted-protocol=" + restricted] if self.grpc_public else ["--grpc-address=127.0.0.1"])]

    def start(self, timeout: float = 300.0) -> "TritonServer":
        cmd, env_add = prepare_server()
        cmd = cmd + [
            f"--model-repository={self.model_repository}", f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}", "--exit-timeout-secs=10",
            f"--model-control-mode={self.model_control_mode}", *(f"--load-model={m}" for m in self.load_models),
            *self.address_args(), *trace_args(self.otlp_traces_endpoint), *self.extra_args]
        env = {**os.environ, **openmp_wait_defaults(os.environ), **env_add, **trace_env(self.otlp_traces_endpoint)}
        self._log = open(self.log_path, "ab") if self.log_path else None
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=self._log,
                                     stderr=subprocess.STDOUT if self._log else None)
        try:
            self.wait_ready(timeout)
        except BaseException:     # not ready: no stream to drain, and a loading server may take long over SIGTERM
            self.kill()
            raise
        return self

    def kill(self, regions: set[str] | None = None) -> None:
        """SIGKILL the server's process group at once (its stubs are in it), wait for the server (KILL_WAIT_S at
        most), and remove its stubs' shared memory (`regions`: read earlier, while the stubs lived)."""
        if self.proc is None:
            return
        if regions is None:
            regions = stub_shm_regions(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:    # init reaps it once it dies; the stop stays bounded
            print(f"tritonserver (pid {self.proc.pid}) has not exited {KILL_WAIT_S:.0f} s after SIGKILL; leaving it",
                  file=sys.stderr, flush=True)
        remove_shm_regions(regions)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None

    def drain(self, timeout: float) -> None:
        """End every stream while the whole server still runs: SIGTERM to the stubs alone (an llm model then refuses
        new requests and ends those in flight with finish_reason abort within its shutdown_grace_s; the other stubs
        ignore the signal), then wait until no request is running or waiting (the engines' metrics), at most
        `timeout` seconds. Why first: on 2.51 a SIGTERM to the server stops every model's scheduler at once, so an
        llm response after it can no longer pass the ensemble's postprocess step, and that stream hangs until the
        exit timeout cuts it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for pid, child in server_children(self.proc.pid).items():
            if child.is_stub and child.state != "Z":
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        start = time.monotonic()
        idle_reads = 0
        # Twice idle: the gauges refresh every 0.1 s.
        while idle_reads < 2 and (left := start + timeout - time.monotonic()) > 0:
            n = self.requests_in_flight(timeout=min(left, 2.0))     # a slow read must not outlast the drain
            if n is None and time.monotonic() > start + 3:
                break    # no metrics to read (--allow-metrics=false): nothing tells when the streams have ended
            idle_reads = idle_reads + 1 if n == 0 else 0
            time.sleep(0.1)

    def requests_in_flight(self, timeout: float = 2.0) -> int | None:
        """Requests running or waiting in the server's engines; None when the metrics cannot be read."""
        try:
            samples = metric_samples(self.metrics_port, timeout=timeout)
        except OSError:
            return None
        queues = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        return int(sum(s.value for s in samples if s.name in queues))

    def wait_ready(self, timeout: float) -> None:
        """Block until /v2/health/ready answers 200 (every model loaded), or raise."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s" +
                           (f"; see {self.log_path}" if self.log_path else ""))

    def stop(self, timeout: float = STOP_GRACE_S, drain_s: float | None = None) -> None:
        """Stop the server within `timeout` seconds in all: drain the engines (`drain_s` seconds at most; by default
        half the timeout, the other half being the server's own exit), SIGTERM the server's process group and wait
        for it until the timeout has passed, then SIGKILL the group. A caller that drained already passes
        `drain_s=0`."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        pgid = self.proc.pid
        regions = stub_shm_regions(pgid)     # read while the stubs live: a stub killed below leaves its region
        self.drain(timeout / 2 if drain_s is None else min(drain_s, timeout))
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
        self.kill(regions)     # stubs that outlived the server, or a server that did not stop in time

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def parser() -> argparse.ArgumentParser:
    """The launcher's command line (deploy/k8s/ and docker-compose.yml rely on its defaults)."""
    ap = argparse.ArgumentParser(description="Start tritonserver on the model repository and keep it running.")
    ap.add_argument("--model-repository", default=DEFAULT_REPOSITORY)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES, default="none",
                    help="explicit: load only --load-model names at start, then load/unload through the repository "
                         "API; poll: follow changes to the repository folder")
    ap.add_argument("--load-model", action="append", default=[], metavar="NAME",
                    help="with --model-control-mode=explicit, a model to load at start (repeatable; '*' for all)")
    ap.add_argument("--demo-prompt", default=None, help="once ready, stream an answer to this prompt")
    ap.add_argument("--exit-after-demo", action="store_true", help="stop the server after the demo answer")
    ap.add_argument("--log-file", default=None,
                    help="where tritonserver's log goes (default: a file in the temporary folder, named by port)")
    ap.add_argument("--verbose", action="store_true", help="show tritonserver's log live instead of writing a file")
    ap.add_argument("--no-restart", action="store_true",
                    help="exit when tritonserver stops serving instead of restarting it (tools/supervisor.py)")
    ap.add_argument("--stop-grace-s", type=float, default=STOP_GRACE_S, metavar="S",
                    help="on SIGTERM or Ctrl-C, how long the stop may take in all (the engines' drain, then "
                         "tritonserver's own exit) before tritonserver's process group is killed (default 30)")
    ap.add_argument("--probe-interval", type=float, default=0.0, metavar="S",
                    help="also restart after 3 failed one-token generate probes, one every S seconds (default 0: "
                         "off; a dead stub and a server exit are noticed without it)")
    ap.add_argument("--recycle-above-mib", type=float, default=0.0, metavar="MIB",
                    help="restart tritonserver, its streams ended first, when its resident memory passes MIB (default "
                         "0: no bound; tritonserver 2.51 keeps what a gRPC stream cancelled just after its final "
                         "response held, fixed in 2.57)")
    ap.add_argument("--probe-model", default="ensemble", help="the model the generate probe asks (default ensemble)")
    ap.add_argument("--openai-port", type=int, default=0, metavar="PORT",
                    help="also start the OpenAI-compatible front door (python -m trellm_openai) on this port "
                         "(default 0: not started; `make serve` starts it on 9000)")
    ap.add_argument("--openai-keys-file", default=None, metavar="FILE",
                    help="the front door's API keys and limits (openai_api/keys.py); without one it is open")
    ap.add_argument("--openai-tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                    help="the format the models write tool calls in, for the front door's tool_choice \"auto\" "
                         "(the default model writes hermes; without one, auto is refused)")
    ap.add_argument("--otlp-traces-endpoint", default=traces_endpoint(), metavar="URL",
                    help="trace every request over OTLP/HTTP to URL (e.g. http://localhost:4318/v1/traces): the "
                         "front door's, tritonserver's and the engine's spans in one trace (default: "
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces)")
    ap.add_argument("--http-public", action="store_true",
                    help="tritonserver's own HTTP port on every interface; by default it listens on 127.0.0.1 only, "
                         "and the front door's port (--openai-port) serves its KServe v2 routes, relayed after a "
                         "check of each body (Triton 2.51's HTTP parser crashes on a deeply nested one)")
    ap.add_argument("--grpc-public", action="store_true",
                    help="tritonserver's own gRPC port on every interface; by default it listens on 127.0.0.1 only, "
                         "and the front door's gRPC port (--openai-grpc-port) relays its health, metadata and "
                         "inference calls, with keys and limits")
    ap.add_argument("--openai-grpc-port", type=int, default=0, metavar="PORT",
                    help="with --openai-port, the front door also serves Triton's KServe gRPC API on this port "
                         "(default 0: not served; `make serve`, compose and Kubernetes use 9001)")
    ap.add_argument("--admin-key-file", default=None, metavar="FILE",
                    help="with --http-public or --grpc-public: the value Triton's repository, shared-memory, trace "
                         f"and logging APIs then want in a `{ADMIN_HEADER}` header (default: a new random key, "
                         "written to a file only its owner reads, its path printed)")
    return ap


def admin_key(path: str | None) -> tuple[str, str]:
    """(the admin key, the file holding it): read from `path`, or a new random one in a new owner-only file."""
    if path:
        with open(path) as f:
            key = f.read().strip()
        if not key or any(c.isspace() or c in ",:=" for c in key):
            raise ValueError(f"{path}: an admin key is one word without ',', ':' or '=' (Triton's flag syntax)")
        return key, path
    import secrets
    key = secrets.token_urlsafe(32)
    fd, path = tempfile.mkstemp(prefix="trellm-admin-key-")     # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if args.openai_grpc_port and not args.openai_port:
        ap.error("--openai-grpc-port needs --openai-port: the gRPC relay is part of the front door")
    key = key_file = None
    if args.http_public or args.grpc_public:
        try:
            key, key_file = admin_key(args.admin_key_file)
        except (OSError, ValueError) as e:
            ap.error(str(e))

    log_path = None if args.verbose else (
        args.log_file or os.path.join(tempfile.gettempdir(), f"trellm-tritonserver-{args.http_port}.log"))
    if log_path and os.path.exists(log_path):
        os.remove(log_path)   # this run's log only
    try:
        server = TritonServer(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                              log_path=log_path, extra_args=extra, model_control_mode=args.model_control_mode,
                              load_models=args.load_model, otlp_traces_endpoint=args.otlp_traces_endpoint,
                              http_public=args.http_public, grpc_public=args.grpc_public, admin_key=key)
    except ValueError as e:
        ap.error(str(e))
    stop = {"now": False}

    def on_signal(signum, frame):
        # The first SIGINT or SIGTERM stops the launcher wherever it is (serving, supervising, waiting out a
        # back-off, starting a server); later ones are ignored, so they cannot cut the stop itself short and leave
        # a server behind.
        if stop["now"]:
            return
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    front_door = None
    if log_path:
        print(f"starting tritonserver on {server.model_repository} (log: {log_path})", flush=True)
    try:
        try:
            server.start()
        except (RuntimeError, TimeoutError) as e:
            errors = log_errors(log_path) if log_path else []
            print(f"error: {e}" + "".join(f"\n  {line}" for line in errors), file=sys.stderr, flush=True)
            return 1
        log_line = f"\n  log     {log_path}" if log_path else ""
        admin_line = (f"\n  admin   {', '.join(ADMIN_APIS)} on the public Triton ports want the key in {key_file}: "
                      f"HTTP header {ADMIN_HEADER}, gRPC metadata {GRPC_ADMIN_HEADER}") if key_file else ""
        where = {True: "every interface", False: "127.0.0.1 only"}
        http_line = (f"\n  HTTP    http://localhost:{args.http_port}  (Triton's own, on {where[args.http_public]}: "
                     "POST /v2/models/ensemble/generate_stream)")
        grpc_line = f"\n  gRPC    localhost:{args.grpc_port}  (Triton's own, on {where[args.grpc_public]})"
        if args.openai_port:
            front_door = start_front_door(server, args.openai_port, args.openai_keys_file,
                                          args.openai_tool_call_parser, grpc_port=args.openai_grpc_port)
            http_line = (f"\n  HTTP    http://localhost:{args.openai_port}  (the front door: OpenAI "
                         f"/v1/chat/completions, and Triton's KServe v2 routes, relayed to 127.0.0.1:{args.http_port})"
                         ) + (
                             http_line if args.http_public else "")
            if args.openai_grpc_port:
                grpc_line = (f"\n  gRPC    localhost:{args.openai_grpc_port}  (the front door: Triton's KServe gRPC "
                             f"inference and metadata, relayed to 127.0.0.1:{args.grpc_port})") + (
                                 grpc_line if args.grpc_public else "")
        print(f"\ntritonserver is ready{http_line}{grpc_line}\n  metrics http://localhost:"
              f"{args.metrics_port}/metrics{admin_line}{log_line}\nStop with Ctrl-C.\n", flush=True)
        if args.demo_prompt:
            from trellm_client.client import LLMClient
            print(f"> {args.demo_prompt}", flush=True)
            with LLMClient(server.grpc_url) as client:
                # Seeded sampling: deterministic, and more readable than greedy from a model this small.
                for delta in client.stream(args.demo_prompt, max_tokens=64, temperature=0.7, top_p=0.9, seed=0):
                    print(delta, end="", flush=True)
            print("\n", flush=True)
            if args.exit_after_demo:
                return 0
        if not args.no_restart:
            Supervisor(server, probe_interval=args.probe_interval, probe_model=args.probe_model,
                       recycle_above_mib=args.recycle_above_mib).run()
        while server.proc.poll() is None:
            time.sleep(0.5)
        errors = log_errors(log_path) if log_path else []
        print(f"tritonserver exited with code {server.proc.returncode}" + "".join(f"\n  {line}" for line in errors),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nstopping tritonserver (at most {args.stop_grace_s:g} s) ...", file=sys.stderr, flush=True)
        return 0
    finally:
        stop["now"] = True    # a signal from here on is ignored: it must not cut short the stop, which is bounded
        # One deadline for the whole stop, past which the server's process group is killed.
        deadline = time.monotonic() + args.stop_grace_s
        drain_s = None
        if front_door is not None:
            # The front door still relays its streams' ends (abort) while the engines drain.
            server.drain(args.stop_grace_s / 2)
            stop_front_door(front_door, timeout=min(10.0, max(deadline - time.monotonic(), 0.0)))
            drain_s = 0.0
        server.stop(max(deadline - time.monotonic(), 0.0), drain_s=drain_s)


def start_front_door(server: "TritonServer", port: int, keys_file: str | None,
                     tool_call_parser: str | None = None, traced: bool = True, grpc_port: int = 0,
                     host: str = "0.0.0.0") -> subprocess.Popen:
    """The front door as a child process: OpenAI's routes, talking to `server` over gRPC, the KServe v2 HTTP
    routes relayed to its HTTP port, and with `grpc_port` the KServe gRPC API relayed to its gRPC port; returns once
    it listens. It traces where the server does, unless `traced` is false (perf/trace_overhead.py compares the
    two)."""
    cmd = [sys.executable, "-m", "trellm_openai", "--triton-url", server.grpc_url, "--port", str(port),
           "--triton-http-url", f"127.0.0.1:{server.http_port}",
           "--triton-metrics-url", f"http://localhost:{server.metrics_port}/metrics",
           "--model-repository", server.model_repository, "--host", host]
    if grpc_port:
        cmd += ["--grpc-port", str(grpc_port)]
    if keys_file:
        cmd += ["--keys-file", keys_file]
    if tool_call_parser:
        cmd += ["--tool-call-parser", tool_call_parser]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **trace_env(server.otlp_traces_endpoint if traced else None),
                                 **({ADMIN_KEY_ENV: server.admin_key} if server.grpc_public else {})})
    line = proc.stdout.readline()   # its "OpenAI-compatible API on ..." line, or nothing if it failed to start
    if proc.poll() is not None or "OpenAI-compatible API" not in line:
        raise RuntimeError(f"the OpenAI front door did not start (exit {proc.wait()}): {line.strip()}")
    return proc


def stop_front_door(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a front door start_front_door started: SIGTERM, then SIGKILL if it has not exited within `timeout`
    seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
