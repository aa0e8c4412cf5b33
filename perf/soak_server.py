"""The server under perf/soak.py: the launcher (`python -m trellm_backend.tools.launch`, so the supervisor that
restarts a server whose stub died is the real one) as a subprocess, and what its processes look like from outside:
resident memory, the /dev/shm regions of the Python-backend stubs, the engine's metrics."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

from trellm_backend.tools.supervisor import stub_command
from trellm_backend.tools.testbed import command_line, free_ports, metric_samples, processes_mentioning, rss_bytes


class Launcher:
    """`python -m trellm_backend.tools.launch` as a subprocess on free ports (or --base-port, +1, +2, +3), with its
    front door, whose port the HTTP traffic goes to (`traffic_http_port`: the door relays Triton's v2 routes, as a
    deployment has it), or with `direct_http` none, and HTTP straight to Triton's port. gRPC traffic goes to
    Triton's own port, or with `grpc_through_door` to the front door's gRPC relay (`traffic_grpc_port`)."""

    def __init__(self, repo: str, root: str, base_port: int = 0, direct_http: bool = False,
                 grpc_through_door: bool = False):
        self.repo, self.root = repo, root
        if base_port:
            ports = [base_port + i for i in range(5)]
        else:
            ports = free_ports(5)
        self.http_port, self.grpc_port, self.metrics_port = ports[:3]
        self.door_port = 0 if direct_http and not grpc_through_door else ports[3]
        self.traffic_http_port = self.http_port if direct_http else self.door_port
        self.door_grpc_port = ports[4] if grpc_through_door else 0
        self.traffic_grpc_port = self.door_grpc_port or self.grpc_port
        self.log = os.path.join(root, "server.log")
        self.stdout_path, self.stderr_path = os.path.join(root, "launcher.out"), os.path.join(root, "launcher.err")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={self.repo}",
                 f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                 f"--metrics-port={self.metrics_port}", f"--log-file={self.log}",
                 *([f"--openai-port={self.door_port}"] if self.door_port else []),
                 *([f"--openai-grpc-port={self.door_grpc_port}"] if self.door_grpc_port else [])],
                stdout=out, stderr=err)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited with code {self.proc.returncode}:\n{self.stderr()}")
            if "tritonserver is ready" in self.stdout():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; see {self.log}")

    def server_version(self) -> tuple[int, ...]:
        """tritonserver's version, from its own HTTP port (/v2)."""
        with urllib.request.urlopen(f"http://localhost:{self.http_port}/v2", timeout=10) as r:
            return tuple(int(p) for p in json.load(r)["version"].split(".")[:3] if p.isdigit())

    def stdout(self) -> str:
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def log_size(self) -> int:
        """How far tritonserver's log has been written (every server of the run appends to it)."""
        try:
            return os.path.getsize(self.log)
        except OSError:
            return 0

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

    def processes(self) -> dict[int, tuple[str, str]]:
        """{pid: (name, region)} of the tritonserver ("tritonserver", "") and the Python-backend stubs ("stub:MODEL",
        the /dev/shm region it was started with) serving the repository, found by its path on their command lines."""
        out = {}
        for pid in processes_mentioning(self.repo):
            cmdline = command_line(pid)
            stub = stub_command(cmdline)
            if stub:
                out[pid] = (f"stub:{stub[0]}", os.path.basename(stub[1]))
            elif os.path.basename(cmdline.split(b"\0")[0]) == b"tritonserver":
                out[pid] = ("tritonserver", "")
        return out

    def dump_stacks(self, path: str) -> dict[str, str]:
        """What every server process is doing, for a request that hung: each stub writes its threads' Python stacks
        to the server log (SIGUSR1, backend/triton/stack_dumps.py), one stub at a time; then, where gdb is installed,
        the native stacks of every thread of tritonserver and the stubs go to `path`. Returns {process: the server
        log's text of its Python stacks}."""
        python: dict[str, str] = {}
        procs = self.processes()
        for pid, (name, _) in sorted(procs.items()):
            if name.startswith("stub:"):
                at = self.log_size()
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
                time.sleep(1.0)
                with open(self.log, "rb") as f:
                    f.seek(at)
                    python[f"{name} ({pid})"] = f.read().decode(errors="replace")
        with open(path, "w") as out:
            for key, text in python.items():
                out.write(f"=== Python stacks of {key}\n{text}\n")
            gdb = shutil.which("gdb")
            for pid, (name, _) in sorted(procs.items()):
                if gdb is None:
                    break
                out.write(f"=== native stacks of {name} ({pid})\n")
                out.flush()
                try:
                    r = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 16"],
                                       capture_output=True, text=True, timeout=120)
                    out.write(r.stdout + r.stderr[-2000:])
                except subprocess.TimeoutExpired:
                    out.write("gdb: no answer in 120 s\n")
        return python

    def rss(self) -> dict[str, float]:
        """Resident MiB of tritonserver and each stub serving the repository, and their total."""
        out: dict[str, float] = defaultdict(float)
        for pid, (name, _) in self.processes().items():
            out[name] += rss_bytes(pid) / 2**20
        return {**{k: round(v, 1) for k, v in sorted(out.items())}, "total": round(sum(out.values()), 1)}

    def stub_regions(self) -> dict[str, str]:
        """{/dev/shm region: "MODEL (stub PID)"} of the live stubs serving the repository."""
        return {region: f"{name[len('stub:'):]} (stub {pid})" for pid, (name, region) in self.processes().items()
                if region}

    def metrics(self) -> dict[str, dict[str, float]]:
        """{model: {metric: value}} of the server's trellm: and vllm: gauges and counters."""
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for s in metric_samples(self.metrics_port):
            if s.name.startswith(("trellm:", "vllm:")) and "model" in s.labels:
                reason = s.labels.get("finished_reason")
                out[s.labels["model"]][s.name + (f"[{reason}]" if reason else "")] = s.value
        return out


def shm_left(regions: dict[str, str]) -> dict[str, str]:
    """Which of these regions still exist in /dev/shm: {name: "MODEL (stub PID): N MiB"}."""
    out = {}
    for name, owner in sorted(regions.items(), key=lambda x: x[1]):
        try:
            out[name] = f"{owner}: {os.path.getsize(os.path.join('/dev/shm', name)) / 2**20:.0f} MiB"
        except OSError:
            pass
    return out
