"""The launcher: starts tritonserver, reports readiness, and on SIGTERM leaves no process behind."""
import asyncio
import contextlib
import functools
import http.server
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import REPO, free_ports
from repository_helpers import processes_mentioning
from trellm_backend.tools.launch import TritonServer, openmp_wait_defaults
from trellm_backend.tools.supervisor import Supervisor, server_children, stub_shm_regions
from trellm_backend.tools.testbed import listening_addresses, private_repository, rss_bytes, wait_until
from trellm_client.client import LLMClient

pytestmark = pytest.mark.server


def test_openmp_wait_default_leaves_a_callers_choice_alone():
    assert openmp_wait_defaults({}) == {"GOMP_SPINCOUNT": "10000"}
    assert openmp_wait_defaults({"OMP_WAIT_POLICY": "PASSIVE"}) == {}, "an operator's wait policy must win"
    assert openmp_wait_defaults({"GOMP_SPINCOUNT": "0"}) == {}


def test_servers_started_from_several_threads_at_once_link_this_interpreters_libpython():
    """Python 3.11's sysconfig fills its table on first use without a lock: two servers started at once from threads
    (as the deployment tests do) once gave the second one the distribution's libpython, whose stubs then failed to
    import _ssl. In a fresh interpreter, 8 threads prepare the server's environment together."""
    import sysconfig
    probe = ("import threading\nfrom trellm_backend.tools.launch import prepare_server\n"
             "barrier, paths = threading.Barrier(8), []\n"
             "def go():\n    barrier.wait()\n    paths.append(prepare_server()[1]['LD_LIBRARY_PATH'])\n"
             "threads = [threading.Thread(target=go) for _ in range(8)]\n"
             "[t.start() for t in threads]\n[t.join() for t in threads]\nprint('\\n'.join(paths))\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    paths = run.stdout.split()
    assert len(paths) == 8, run.stderr[-2000:]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        assert all(p.startswith(sysconfig.get_config_var("LIBDIR") + os.pathsep) for p in paths), set(paths)
    assert len(set(paths)) == 1, set(paths)


def test_a_packed_server_folder_is_started_when_named(tmp_path, monkeypatch):
    """TRELLM_TRITONSERVER_HOME (perf/pack_tritonserver.py's layout; gpu_check.sh's served step) wins over the wheel,
    with its libs and this interpreter's libpython on the library path; a folder without the server is refused by
    name. tests/test_gpu_check.py serves from a real pack."""
    from trellm_backend.tools.launch import prepare_server
    monkeypatch.setenv("TRELLM_TRITONSERVER_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="TRELLM_TRITONSERVER_HOME=.* has no bin/tritonserver"):
        prepare_server()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").write_text("")
    cmd, env = prepare_server()
    assert cmd == [str(tmp_path / "bin" / "tritonserver"), f"--backend-directory={tmp_path / 'backends'}"]
    assert str(tmp_path / "libs") in env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_load_models_need_explicit_model_control():
    """Explicit model control itself is exercised by test_add_model.py, test_load_errors.py and test_deploy.py."""
    with pytest.raises(ValueError, match="explicit"):
        TritonServer(load_models=["ensemble"])
    with pytest.raises(ValueError, match="model_control_mode='manual'"):
        TritonServer(model_control_mode="manual")
    r = subprocess.run([sys.executable, "-m", "trellm_backend.tools.launch", "--load-model", "ensemble"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "load_models needs model_control_mode='explicit'" in r.stderr


class _Index(http.server.BaseHTTPRequestHandler):
    """A repository index as tritonserver answers it: vllm_model was unloaded, the rest are READY."""
    def do_POST(self):
        body = json.dumps([{"name": "ensemble", "version": "1", "state": "READY"},
                           {"name": "llm", "version": "1", "state": "READY"},
                           {"name": "preprocess", "version": "1", "state": "READY"},
                           {"name": "vllm_model", "state": "UNAVAILABLE", "reason": "unloaded"}]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _FakeServer:
    """What Supervisor uses of launch.TritonServer; start() records the models it was asked to load."""
    model_control_mode = "explicit"
    admin_headers: dict = {}      # its HTTP port on loopback: the repository index wants no admin key

    def __init__(self, http_url):
        self.http_url, self.load_models, self.started_with = http_url, ["*"], []
        self.proc = subprocess.Popen(["sleep", "60"])

    def stop(self, timeout):
        self.proc.kill()
        self.proc.wait()

    def start(self):
        self.started_with.append(list(self.load_models))
        self.proc = subprocess.Popen(["sleep", "60"])


@contextlib.contextmanager
def _fake_server_behind(handler, server_cls=_FakeServer):
    """A fake server (`server_cls`) whose HTTP front end answers with `handler`, stopped afterwards."""
    front = http.server.ThreadingHTTPServer(("localhost", 0), handler)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    server = server_cls(f"localhost:{front.server_address[1]}")
    try:
        yield server
    finally:
        if server.proc is not None:
            server.stop(timeout=1)
        front.shutdown()


class _CutIndex(http.server.BaseHTTPRequestHandler):
    """A front end that dies while answering: a body shorter than its Content-Length (http.client's IncompleteRead,
    which is no OSError)."""
    def do_POST(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'[{"name": "llm"')

    def log_message(self, *args):
        pass


class _FailsToStartOnce(_FakeServer):
    """A server whose first restart dies while starting (2.51 sometimes aborts during start-up): like
    TritonServer.start, it stops what it began, leaving no process, and raises."""
    def start(self):
        if not self.started_with:
            self.started_with.append(None)
            self.proc = None
            raise RuntimeError("tritonserver exited with code -6 while starting")
        super().start()


def test_a_restart_that_fails_to_start_is_tried_again():
    with _fake_server_behind(_Index, _FailsToStartOnce) as server:
        supervisor = Supervisor(server, log=open(os.devnull, "w"))
        assert supervisor.check() is None
        server.proc.kill()
        supervisor.run(should_stop=lambda: len(supervisor.restarts) >= 1)
        assert server.started_with == [None, ["ensemble", "llm", "preprocess"]]
        assert "restart failed: tritonserver exited with code -6" in supervisor.restarts[0]["reason"]


def test_a_front_end_dying_mid_answer_does_not_end_the_supervision():
    """The supervisor looks at the index and probes over HTTP; a crash of the HTTP front end in the middle of an
    answer raised out of check() and ended the supervisor, so nothing restarted the crashed server."""
    with _fake_server_behind(_CutIndex) as server:
        supervisor = Supervisor(server, log=open(os.devnull, "w"), probe_interval=0.01, probe_failures=1)
        reason = wait_until(supervisor.check, 10, "a reason to restart", 0.01)
        assert reason and "generate probes" in reason and "IncompleteRead" in reason, reason


class _SlowGenerate(_Index):
    """A front end whose generate answers only after the probe's timeout (a probe sent just before a stub died)."""
    def do_POST(self):
        if self.path.endswith("/generate"):
            time.sleep(7)
        super().do_POST()


def test_a_hanging_probe_does_not_hold_up_noticing_a_crash():
    """The streams of a dead stub failed 7 s after its death in a full run: the look at the children waited for a
    generate probe sent just before, which hung until its 5 s timeout."""
    with _fake_server_behind(_SlowGenerate) as server:
        supervisor = Supervisor(server, log=open(os.devnull, "w"), probe_interval=0.01)
        started = time.monotonic()
        assert supervisor.check() is None                  # sends a probe that hangs
        server.proc.kill()
        server.proc.wait()
        assert supervisor.check() == "tritonserver exited with code -9"
        assert time.monotonic() - started < 2


def test_a_server_that_crashed_comes_back_with_the_models_loaded_before_not_all_of_them():
    """tritonserver 2.51 sometimes aborts on its own when a stub dies; the supervisor can then no longer ask it what
    was loaded and must use what it saw last, or an unloaded model comes back."""
    with _fake_server_behind(_Index) as server:
        supervisor = Supervisor(server, log=open(os.devnull, "w"))
        assert supervisor.check() is None
        server.proc.kill()
        server.proc.wait()
        reason = supervisor.check()
        assert reason and "exited" in reason
        supervisor.restart(reason, backoff=0)
        assert server.started_with == [["ensemble", "llm", "preprocess"]]


class _IndexAndConfigs(_Index):
    """The index above, and each model's configuration: the ensemble has no backend, the others are Python's."""
    def do_GET(self):
        name = self.path.split("/")[3]          # /v2/models/<name>/config
        body = json.dumps({"name": name, "backend": "" if name == "ensemble" else "python"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _ServerWhoseStubDiedUnseen(_FakeServer):
    """A server with one child, a Python-backend stub that exited at once and was never reaped (a zombie named like
    the stub, its command line gone): one that died before the supervisor's first look."""
    def __init__(self, http_url, stub_program):
        super().__init__(http_url)
        self.proc.kill()
        self.proc.wait()
        self.proc = subprocess.Popen([sys.executable, "-c", "import os, sys, time; "
                                      "os.posix_spawn(sys.argv[1], [sys.argv[1]], {}); time.sleep(60)", stub_program])


def test_a_stub_that_died_before_the_supervisor_first_looked_is_noticed(tmp_path):
    """The supervisor knew a dead stub's model only from having seen the stub alive, so a stub that died while the
    server started (or just after a restart) went unnoticed and its model's requests hung."""
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(shutil.which("true"))
    with _fake_server_behind(_IndexAndConfigs, functools.partial(_ServerWhoseStubDiedUnseen,
                                                                 stub_program=str(stub))) as server:
        wait_until(lambda: any(c.state == "Z" for c in server_children(server.proc.pid).values()), 30,
                   "the stand-in stub becoming a zombie", 0.05)
        supervisor = Supervisor(server, log=open(os.devnull, "w"))
        reasons = [supervisor.check(), supervisor.check()]     # a zombie counts when seen twice
        assert reasons[0] is None and reasons[1] is not None
        assert "the Python-backend stub of model 'llm'" in reasons[1], reasons


def test_a_server_whose_stubs_are_killed_at_stop_leaves_no_shared_memory(default_model_path, tmp_path):
    """A stub removes its /dev/shm region only when its model unloads; one killed (a stop past the exit timeout, or
    at once as here) left its region for good, 1-64 MiB each."""
    server = TritonServer(os.path.join(REPO, "model_repository"), *free_ports(3),
                          log_path=str(tmp_path / "server.log")).start()
    regions = stub_shm_regions(server.proc.pid)
    python_models = [m for m in os.listdir(os.path.join(REPO, "model_repository"))
                     if os.path.exists(os.path.join(REPO, "model_repository", m, "1", "model.py"))]
    assert len(regions) == len(python_models) == 4 and all(os.path.exists(f"/dev/shm/{r.lstrip('/')}") for r in regions), regions
    server.stop(timeout=0)       # SIGTERM, then SIGKILL to the group at once
    assert [r for r in regions if os.path.exists(f"/dev/shm/{r.lstrip('/')}")] == []


def test_a_server_that_streamed_to_asyncio_clients_stops_without_waiting_out_the_exit_timeout(tmp_path):
    """AsyncLLMClient (the OpenAI front door's) once cancelled each gRPC call just after its final response; with
    16 streams at once tritonserver 2.51 then kept the ensemble loaded at stop until the 10 s exit timeout ran out
    (3 of 3 runs), a stop of 14 s instead of 4. It now reads each call to its end."""
    from trellm_client.client import AsyncLLMClient
    log = tmp_path / "server.log"
    server = TritonServer(os.path.join(REPO, "model_repository"), *free_ports(3), log_path=str(log)).start()
    try:
        async def streams():
            async with AsyncLLMClient(server.grpc_url) as c:
                async def one():
                    return [chunk async for chunk in c.stream_chunks("The Python language " * 10, max_tokens=16)]
                return await asyncio.gather(*(one() for _ in range(16)))
        assert all(chunks[-1].final for chunks in asyncio.run(streams()))
    finally:
        server.stop()
    assert "successfully unloaded 'ensemble'" in log.read_text() and "Exit timeout expired" not in log.read_text()


def test_sigterm_stops_server_and_stubs(default_model_path, tmp_path):
    # A private copy of the repository, so this test's server and stubs are recognisable by their paths.
    repo = tmp_path / "model_repository"
    private_repository(os.path.join(REPO, "model_repository"), str(repo))
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "server.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
         f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--log-file={log}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300
        before_ready = []
        for line in launcher.stdout:
            if "tritonserver is ready" in line or time.monotonic() > deadline:
                break
            before_ready.append(line)
        summary = "".join(launcher.stdout.readline() for _ in range(4))
        assert f"localhost:{grpc}" in summary and str(log) in summary
        # tritonserver's own log (glog lines such as "I1123 ...") is in the file, not among the launcher's lines.
        assert not any(re.match(r"[IWE]\d{4} ", line) for line in before_ready), before_ready
        assert "Started GRPCInferenceService" in log.read_text()
        assert listening_addresses(http) == {"127.0.0.1"}, "Triton's own HTTP port is on loopback by default"
        assert listening_addresses(grpc) == {"127.0.0.1"}, "Triton's own gRPC port is on loopback by default"
        assert len(processes_mentioning(str(repo))) >= 4      # the server and a stub per Python model
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        assert processes_mentioning(str(repo)) == []
    finally:
        stop_launcher(launcher, str(repo))


def stop_launcher(launcher: subprocess.Popen, repo: str) -> None:
    """After a failed test too: SIGTERM (the launcher stops its server), then kill whatever is left of the repo's."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
    for pid in processes_mentioning(repo):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_generate(grpc: int, since: float, what: str, limit_s: float = 180, launcher=None,
                      launcher_err: str | None = None) -> None:
    """Until a real generate answers (not only the ready endpoint), failing with `what` after `limit_s`, or at once
    with its error output (the file `launcher_err`) when the `launcher` process has ended."""
    while True:
        if launcher is not None and launcher.poll() is not None:
            pytest.fail(f"{what}: the launcher exited ({launcher.returncode}): {_read(launcher_err)}")
        try:
            with LLMClient(f"localhost:{grpc}") as c:
                assert c.generate("Hello", max_tokens=3, min_tokens=3)
            return
        except ConnectionError:
            assert time.monotonic() - since < limit_s, what
            time.sleep(0.5)


def _read(path: str | None) -> str:
    if path is None:
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def wait_for_supervisor_ready(launcher_err: str, limit_s: float = 120) -> None:
    """Until the supervisor's last line says the server is ready again. A client can be served a moment before the
    supervisor's own readiness poll sees it; a crash caused in that moment is then reported as "restart failed", so
    the test waits for the supervisor before causing the next one."""
    deadline = time.monotonic() + limit_s
    while True:
        lines = [line for line in _read(launcher_err).splitlines() if line.startswith("supervisor:")]
        if lines and "ready again after" in lines[-1]:
            return
        assert time.monotonic() < deadline, f"the supervisor did not report the server ready: {lines}"
        time.sleep(0.5)


def _post(url: str) -> int:
    req = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def _ready(http: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{http}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def long_stream(grpc: int, outcomes: dict, i: int, after_three) -> None:
    """A stream of 2,000 tokens from localhost:`grpc`: outcomes[i] = ("finished" or "error", responses, when it ended
    [, the error]); `after_three()` once its third response has come."""
    n = 0
    try:
        with LLMClient(f"localhost:{grpc}") as c:
            for _ in c.stream("Once upon a time", max_tokens=2000, min_tokens=2000):
                n += 1
                if n == 3:
                    after_three()
        outcomes[i] = ("finished", n, time.monotonic())
    except Exception as e:   # noqa: BLE001 - the error itself is what is checked
        outcomes[i] = ("error", n, time.monotonic(), str(e))


def test_a_killed_llm_stub_fails_its_streams_at_once_and_the_launcher_restarts_the_server(tmp_path):
    """tritonserver 2.51 alone leaves a dead stub's streams hanging and reports READY forever; the launcher's
    supervisor must end those streams with an error, and serve again with the models that were loaded. An orderly
    unload (whose stub also exits) must not count as a death."""
    repo = tmp_path / "model_repository"
    private_repository(os.path.join(REPO, "model_repository"), str(repo))
    http, grpc, metrics = free_ports(3)
    err_path = str(tmp_path / "launcher.err")    # a file, read at any time: the supervisor's lines
    with open(err_path, "w") as err_file:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--log-file={tmp_path / 'server.log'}",
             "--model-control-mode=explicit", "--load-model=*", "--probe-interval=5"],
            stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + 300
        while not _ready(http):
            assert launcher.poll() is None and time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.5)
        # An orderly unload: vllm_model's stub exits, and that is no fault (the server is not ready for a few
        # seconds while it unloads, but it must be the same server).
        def server_pids():
            return [p for p in processes_mentioning(f"--model-repository={repo}\0") if p != launcher.pid]
        [server_pid] = server_pids()
        assert _post(f"http://localhost:{http}/v2/repository/models/vllm_model/unload") == 200
        time.sleep(3)
        while not _ready(http):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert server_pids() == [server_pid], \
            "the supervisor restarted the server after an orderly unload"

        outcomes: dict[int, tuple] = {}
        started = threading.Event()
        threads = [threading.Thread(target=long_stream, args=(grpc, outcomes, i, started.set)) for i in range(3)]
        for t in threads:
            t.start()
        assert started.wait(60)
        [stub] = processes_mentioning(f"{repo}/llm/1/model.py")
        regions = stub_shm_regions(server_pid)
        assert len(regions) == 3 and all(os.path.exists(f"/dev/shm/{r.lstrip('/')}") for r in regions), regions
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        assert all(not t.is_alive() for t in threads), "a stream of the dead stub hung"
        assert sorted(o[0] for o in outcomes.values()) == ["error"] * 3, outcomes
        assert max(o[2] for o in outcomes.values()) - killed < 5, "streams must fail within seconds of the death"

        wait_for_generate(grpc, since=killed, what="the server did not come back", launcher=launcher,
                          launcher_err=err_path)
        wait_for_supervisor_ready(err_path)
        assert [r for r in regions if os.path.exists(f"/dev/shm/{r.lstrip('/')}")] == [], \
            "the killed server's stubs left their shared memory behind"
        health = subprocess.run([sys.executable, "-m", "trellm_backend.tools.healthcheck", f"--url=localhost:{http}"],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stderr
        index = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://localhost:{http}/v2/repository/index", data=b'{"ready": true}', method="POST")).read())
        assert sorted(m["name"] for m in index) == ["ensemble", "llm", "postprocess", "preprocess"], \
            "a restart loads what was loaded before it, not what was unloaded"
        # Triton 2.51's HTTP front end crashes (SIGSEGV) on a 50,000-deep JSON array; the supervisor restarts it.
        deep = b'{"text_input": ' + b"[" * 50000 + b"]" * 50000 + b"}"
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(urllib.request.Request(
                f"http://localhost:{http}/v2/models/ensemble/generate", data=deep, method="POST"), timeout=60)
        wait_for_generate(grpc, since=time.monotonic(), what="the server did not come back after its crash",
                          launcher=launcher, launcher_err=err_path)
        wait_for_supervisor_ready(err_path)
        # A third death, and Ctrl-C while the supervisor waits out its back-off or starts the server again: the
        # launcher and every process of the server are gone within 15 s (before, it went on, and left a defunct
        # tritonserver).
        restarts = _read(err_path).count("restarting tritonserver in")
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(urllib.request.Request(
                f"http://localhost:{http}/v2/models/ensemble/generate", data=deep, method="POST"), timeout=60)
        while _read(err_path).count("restarting tritonserver in") == restarts:
            assert launcher.poll() is None and time.monotonic() < deadline + 120
            time.sleep(0.2)
        time.sleep(1.5)
        launcher.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        assert launcher.wait(timeout=15) == 0
        wait_until(lambda: processes_mentioning(str(repo)) == [], timeout=15 - (time.monotonic() - interrupted))
        err = _read(err_path)
        # The reason: the dead stub, or tritonserver's own abort, which 2.51 sometimes does first on a stub's death.
        assert ("supervisor: the Python-backend stub of model 'llm'" in err
                or "supervisor: tritonserver exited with code -6" in err) and "ready again after" in err, err
        assert "supervisor: tritonserver exited with code -11" in err, err
    finally:
        stop_launcher(launcher, str(repo))


def test_healthcheck_fails_by_name_where_nothing_generates():
    [port] = free_ports(1)
    r = subprocess.run([sys.executable, "-m", "trellm_backend.tools.healthcheck", f"--url=localhost:{port}",
                        "--timeout=5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"unhealthy: ensemble at localhost:{port}" in r.stderr


# How the launcher (and compose, through it) stops a server. A bare SIGTERM to tritonserver 2.51 stops every model's
# scheduler at once: the llm responses that follow can no longer pass the ensemble's postprocess step, and those
# streams hang until the exit timeout (TritonServer.drain's docstring). So the stop drains the engines first.
def test_stopping_the_server_ends_ensemble_streams_with_a_final_abort(tmp_path):
    """The stop signals the stubs first: the llm model ends every stream with finish_reason abort after
    shutdown_grace_s (1 s here), through the whole ensemble, and only then is the server itself stopped. A stream the
    client cancelled earlier is not still counted in flight then (2.51's dynamic batcher in postprocess made each
    such stream a leak that kept every stop waiting out the exit timeout)."""
    repo = tmp_path / "model_repository"
    private_repository(os.path.join(REPO, "model_repository"), str(repo), {"llm": {"shutdown_grace_s": "1"}})
    log = tmp_path / "server.log"
    server = TritonServer(str(repo), *free_ports(3), log_path=str(log)).start()
    try:
        cancel_ensemble_stream_midway(server.grpc_url)
        ends: dict[int, tuple] = {}
        started = threading.Barrier(4)

        def stream(i):
            chunks = []
            try:
                with LLMClient(server.grpc_url) as c:
                    for chunk in c.stream_chunks("Once upon a time", stream=True, max_tokens=2000, min_tokens=2000):
                        chunks.append(chunk)
                        if len(chunks) == 3:
                            started.wait(timeout=60)
                ends[i] = ("final", chunks[-1].finish_reason, chunks[-1].final, time.monotonic())
            except Exception as e:   # noqa: BLE001 - the outcome itself is what is checked
                ends[i] = ("error", str(e), len(chunks), time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        signalled_at = time.monotonic()
        stopper = threading.Thread(target=server.stop, kwargs={"timeout": 15})
        stopper.start()
        for t in threads:
            t.join(timeout=30)
        stopper.join(timeout=60)
        assert all(not t.is_alive() for t in threads), "a stream hung after the stop"
        assert [e[:3] for e in ends.values()] == [("final", "abort", True)] * 3, ends
        assert max(e[3] for e in ends.values()) - signalled_at < 5, "the streams must end within the grace"
        counted = re.findall(r"Model '\w+' \(version \d+\) has \d+ in-flight inferences", log.read_text())
        assert not counted, f"the stopping server still counted inferences in flight: {counted[:1]}"
    finally:
        server.stop(timeout=15)    # past its exit timeout (10 s), 2.51 may linger for minutes: no need to wait


def test_a_server_past_its_memory_bound_is_recycled_with_its_streams_ended_first(tmp_path):
    """On 2.51 a gRPC stream cancelled just after its final response keeps its state in tritonserver for good; the
    supervisor's memory bound contains that by restarting the server. The streams in flight are ended first, each
    with its final response (abort), not cut by the kill, and the restart neither waits out nor counts as a fault."""
    repo = tmp_path / "model_repository"
    private_repository(os.path.join(REPO, "model_repository"), str(repo), {"llm": {"shutdown_grace_s": "1"}})
    server = TritonServer(str(repo), *free_ports(3), log_path=str(tmp_path / "server.log")).start()
    try:
        end: list = []
        streaming = threading.Event()

        def stream():
            chunks = []
            try:
                with LLMClient(server.grpc_url) as c:
                    for chunk in c.stream_chunks("Once upon a time", stream=True, max_tokens=2000, min_tokens=2000):
                        chunks.append(chunk)
                        streaming.set()
                end.append(("final", chunks[-1].finish_reason, chunks[-1].final))
            except Exception as e:   # noqa: BLE001 - the outcome itself is what is checked
                end.append(("error", str(e), len(chunks)))

        thread = threading.Thread(target=stream)
        thread.start()
        assert streaming.wait(timeout=60)
        old_pid = server.proc.pid
        bound = rss_bytes(old_pid) / 2**20 / 2
        supervisor = Supervisor(server, log=open(os.devnull, "w"), recycle_above_mib=bound)
        supervisor.run(should_stop=lambda: len(supervisor.restarts) >= 1)
        thread.join(timeout=30)
        assert end == [("final", "abort", True)], end
        assert supervisor.restarts[0]["reason"].startswith("recycle: tritonserver holds "), supervisor.restarts
        assert server.proc.pid != old_pid
        with LLMClient(server.grpc_url) as c:
            assert c.generate("Once upon a time", max_tokens=4)
    finally:
        server.stop(timeout=15)


def cancel_ensemble_stream_midway(url: str) -> None:
    """An ensemble stream the client cancels (gRPC stop_stream with cancel_requests) after 3 responses, while llm still
    generates; returns once llm has had the time to end it (64 tokens of the default model: well under 3 s)."""
    import tritonclient.grpc as grpcclient
    from trellm_client.client import build_inputs
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put(error))
    client.async_stream_infer("ensemble", build_inputs(grpcclient, "Once upon a time",
                                                       dict(max_tokens=64, min_tokens=64, stream=True)))
    for _ in range(3):
        assert responses.get(timeout=60) is None
    client.stop_stream(cancel_requests=True)
    client.close()
    time.sleep(3)
