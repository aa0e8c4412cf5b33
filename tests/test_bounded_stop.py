"""The launcher's stop is bounded: whatever the server's stubs are doing, the server, its stubs and the front door
are gone within the stop's grace (--stop-grace-s) and a few seconds more. A stub inside a native call that does not
return ignores SIGTERM and keeps its request in flight, and tritonserver waits for it past its own exit timeout; so
the drain, the front door's stop and the server's exit share one deadline, at which the launcher kills the server's
process group. Waits that each had their own timeout, one after the other, made a server whose engine sat in a long
kernel take minutes to exit after Ctrl-C."""
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from conftest import free_ports
from repository_helpers import processes_mentioning
from trellm_backend.tools import launch
from trellm_backend.tools.launch import TritonServer
from trellm_backend.tools.supervisor import proc_stat, stub_shm_regions
from trellm_backend.tools.testbed import metric_samples, wait_until

# A Python-backend model whose execute never returns. Before it blocks it reports one request running on the gauge
# the launcher's drain waits on (an engine stuck in a step reports its request running forever). It then blocks in a
# native call that neither returns nor lets any Python of the stub run again: the second lock of a pthread mutex the
# thread already holds, called through ctypes.PyDLL, which keeps the GIL, as an extension that launches a kernel
# without releasing it does. The stub's signal handlers never run, and a signal does not end the wait (a mutex lock
# is not interrupted by one, unlike sleep()). Unlike a real kernel it spends no CPU, so the test stays cheap.
STUCK_MODEL = textwrap.dedent('''\
    import ctypes

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.family = pb_utils.MetricFamily(name="vllm:num_requests_running", description="requests running",
                                                kind=pb_utils.MetricFamily.GAUGE)
            self.running = self.family.Metric(labels={"model": args["model_name"]})

        def execute(self, requests):
            self.running.set(len(requests))
            libc = ctypes.PyDLL(None)
            mutex = ctypes.create_string_buffer(64)      # zeroes: PTHREAD_MUTEX_INITIALIZER, a normal mutex
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)               # never returns
    ''')
STUCK_CONFIG = textwrap.dedent('''\
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
    instance_group [ { kind: KIND_CPU, count: 1 } ]
    ''')


def live_processes_in_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are not zombies (an orphaned stub's zombie waits for init)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = proc_stat(f"/proc/{pid}/stat")
        if stat is not None and stat[1][0] != "Z" and int(stat[1][2]) == pgid:    # state, ppid, pgrp
            found.append(int(pid))
    return found


def alive(pid: int) -> bool:
    stat = proc_stat(f"/proc/{pid}/stat")
    return stat is not None and stat[1][0] != "Z"


def send(request: urllib.request.Request) -> None:
    """A request whose answer never comes: the stop ends its connection."""
    try:
        urllib.request.urlopen(request, timeout=300).read()
    except OSError:
        pass


def test_the_stop_grace_is_30_s_by_default():
    assert launch.parser().parse_args([]).stop_grace_s == 30.0
    assert inspect.signature(TritonServer.stop).parameters["timeout"].default == 30.0


def test_a_stop_ends_a_group_that_ignores_sigterm_within_its_timeout():
    """A stand-in server in its own process group whose child ignores SIGTERM, as a stub inside a long native call
    does, and no metrics to read: the whole stop (drain, SIGTERM, wait, SIGKILL) keeps to its timeout."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    proc = subprocess.Popen([sys.executable, "-c", ignore + "import subprocess, sys; "
                             f"subprocess.Popen([sys.executable, '-c', {ignore + 'time.sleep(600)'!r}]); "
                             "print('ready', flush=True); time.sleep(600)"],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        wait_until(lambda: len(live_processes_in_group(proc.pid)) == 2, 10, "the stand-in's child")
        server = TritonServer(metrics_port=free_ports(1)[0])     # nothing listens there
        server.proc = proc
        started = time.monotonic()
        server.stop(timeout=2)
        assert time.monotonic() - started < 3, "the stop must not take its timeout more than once"
        assert server.proc is None
        wait_until(lambda: live_processes_in_group(proc.pid) == [], 2, "the end of the stand-in's group")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.server
def test_ctrl_c_with_a_stub_inside_a_native_call_that_never_returns_stops_everything_within_the_grace(tmp_path):
    """The launcher as in production (supervisor, front door), a request inside the stuck model's execute, then
    SIGINT: the launcher, tritonserver, the stub and the front door are gone within the grace and a few seconds, and
    the stub's shared memory is removed. The grace here is shorter than tritonserver's exit timeout, so only the kill
    at the deadline can end the stop in time."""
    grace = 6
    repo = tmp_path / "repository"
    (repo / "stuck" / "1").mkdir(parents=True)
    (repo / "stuck" / "config.pbtxt").write_text(STUCK_CONFIG)
    (repo / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    http, grpc, metrics, openai = free_ports(4)
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--openai-port={openai}",
             f"--log-file={tmp_path / 'server.log'}", f"--stop-grace-s={grace}"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        for line in launcher.stdout:
            if "tritonserver is ready" in line:
                break
        assert launcher.poll() is None, err_path.read_text()
        [server_pid] = [p for p in processes_mentioning(f"--model-repository={repo}\0") if p != launcher.pid]
        [stub] = processes_mentioning(f"{repo}/stuck/1/model.py")
        regions = stub_shm_regions(server_pid)
        assert len(regions) == 1, regions

        body = b'{"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [1.0]}]}'
        request = urllib.request.Request(f"http://localhost:{http}/v2/models/stuck/infer", data=body, method="POST")
        threading.Thread(target=send, args=(request,), daemon=True).start()
        wait_until(lambda: any(s.name == "vllm:num_requests_running" and s.value == 1
                               for s in metric_samples(metrics)), 30, "the request inside the stuck model", 0.1)
        time.sleep(0.5)    # from the gauge's update into the mutex wait

        launcher.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        assert launcher.wait(timeout=grace + 5) == 0, err_path.read_text()
        # The stub is looked for by pid too: one outside the server's process group would not be in its list.
        while processes_mentioning(str(repo)) or live_processes_in_group(server_pid) or alive(stub):
            assert time.monotonic() - interrupted < grace + 5, (processes_mentioning(str(repo)),
                                                                live_processes_in_group(server_pid), alive(stub))
            time.sleep(0.1)
        assert [r for r in regions if os.path.exists(f"/dev/shm/{r.lstrip('/')}")] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in processes_mentioning(str(repo)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
