"""Keep a launched tritonserver serving: notice when it stops being able to, fail its clients fast, start it again.

tritonserver 2.51 does not notice a Python-backend stub that dies (OOM killer, kill -9, a crash in native code): the
stub stays an unreaped zombie, requests already inside it hang until their clients give up, every later request of
that model fails with "Stub process ... is not healthy", and `/v2/health/ready` stays 200. Nothing in the server
restarts it. So the supervisor looks among the server's children twice a second for a zombie stub whose model is
still READY in the repository index with no live stub left (an unload leaves a zombie too, but its model is no
longer READY; a reload has started a new stub). A model with several instances that loses one is not seen this way;
the generate probe covers it. On that sign, on the server's own exit (a
crash), or on a failed generate probe (opt-in: `probe_interval`), it kills the server's process group, which ends
every open stream with a connection error at once, and starts the server again with the models that were loaded,
as the index said just before (or, where the server is already gone or too busy to answer, at the last look, taken
every `index_interval` seconds while it serves), at once the first time and after 1, 2, 4 ... 30 s when restarts
follow each other closely.

With a memory bound (`recycle_above_mib`), a server whose resident memory passes it is recycled: its streams are
ended first (TritonServer.drain: each gets its final response, finish_reason abort), then it restarts at once. That
contains what tritonserver 2.51 keeps of a gRPC stream cancelled just after its final response (its request and its
model stay held; fixed upstream in 2.57, the server of the Docker image), which nothing outside the server can
reach.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import NamedTuple

from trellm_backend.tools.healthcheck import generate_probe
from trellm_backend.tools.testbed import rss_bytes

STUB_NAME = "triton_python_backend_stub"
SHM_PREFIX = "triton_python_backend_shm_region_"
RECYCLE = "recycle"            # the reason's first word for a restart on the memory bound: planned, not a fault
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0          # a server healthy this long resets the back-off


def next_backoff(seconds: float) -> float:
    return min(max(1.0, 2 * seconds), MAX_BACKOFF_S)


def _read(path: str, mode: str = "r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


class Child(NamedTuple):
    """A child process of the server. A live stub's command line names its model and shared-memory region
    (`<stub> <repository>/<model>/<version>/model.py <region> ...`); a zombie's is empty, but its name still says
    it was a stub."""
    state: str            # /proc state: "Z" for a zombie
    is_stub: bool
    model: str = ""
    region: str = ""


def proc_stat(path: str) -> tuple[str, list[str]] | None:
    """A /proc/PID/stat (or /proc/PID/task/TID/stat) file as (comm, the fields after it: state, ppid, ...); None once
    the process or thread is gone."""
    stat = _read(path)
    if not stat:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
    return stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()


def server_children(server_pid: int) -> dict[int, Child]:
    """The server's child processes by pid."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(f"/proc/{entry}/stat")
        if stat is None:
            continue
        comm, (state, ppid) = stat[0], stat[1][:2]
        if int(ppid) != server_pid:
            continue
        stub = stub_command(_read(f"/proc/{entry}/cmdline", "rb") or b"")
        if stub:
            children[int(entry)] = Child(state, True, *stub)
        else:   # the kernel keeps 15 characters of a process's name
            children[int(entry)] = Child(state, comm == STUB_NAME[:15])
    return children


def stub_command(cmdline: bytes) -> tuple[str, str] | None:
    """(model, shared-memory region) of a live stub's command line (/proc/PID/cmdline); None for another process."""
    argv = cmdline.split(b"\0")
    if argv[0].endswith(STUB_NAME.encode()) and len(argv) > 2:
        return (os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace")))),
                argv[2].decode(errors="replace"))
    return None


def stub_shm_regions(server_pid: int) -> set[str]:
    """The shared-memory regions of the server's live stubs."""
    return {c.region for c in server_children(server_pid).values() if c.region}


def remove_shm_regions(regions: set[str]) -> None:
    """Unlink the regions of stubs that were killed: a stub removes its own only when it is unloaded, so each kill
    left ~1-64 MiB in /dev/shm for good (270 regions, 273 MiB, on one development machine)."""
    for region in regions:
        name = os.path.basename(region)
        if name.startswith(SHM_PREFIX):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:      # already removed by its stub or server
                pass


def ready_models(http_url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> list[str]:
    """Names of the models the server reports READY in its repository index (`headers`: the admin key, where the
    HTTP port is public and its repository API wants one)."""
    req = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b'{"ready": true}', method="POST",
                                 headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return sorted({m["name"] for m in json.load(r) if m.get("state") == "READY"})


def python_model_without_stub(http_url: str, models: set[str], backends: dict[str, str]) -> str:
    """The first of `models` (READY, no live stub) that the Python backend serves, or "": a stub that died unseen
    belonged to it. An ensemble has no stub of its own. `backends` remembers each model's backend."""
    for name in sorted(models):
        if name not in backends:
            try:
                with urllib.request.urlopen(f"http://{http_url}/v2/models/{name}/config", timeout=5) as r:
                    backends[name] = json.load(r).get("backend", "")
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
                continue
        if backends[name] == "python":
            return name
    return ""


@dataclass
class Supervisor:
    """Watches one launch.TritonServer (started) and restarts it when it can no longer serve.

    check() names the first fault found (or None); run() loops check/restart until `should_stop()` is true."""
    server: object                        # launch.TritonServer
    poll_s: float = 0.5
    probe_interval: float = 0.0           # seconds between generate probes; 0: no probe
    probe_model: str = "ensemble"
    probe_failures: int = 3               # consecutive failed probes that count as a fault
    index_interval: float = 5.0           # seconds between looks at which models are loaded (explicit mode)
    recycle_above_mib: float = 0.0        # tritonserver's resident memory that recycles it; 0: no bound
    drain_s: float = 30.0                 # how long a recycle waits for the streams to end before the restart
    log: object = sys.stderr
    restarts: list[dict] = field(default_factory=list)   # {"reason", "down_s"} per restart, for the caller
    _stub_models: dict[int, str] = field(default_factory=dict)
    _zombie_seen: dict[int, int] = field(default_factory=dict)
    _backends: dict[str, str] = field(default_factory=dict)   # model -> backend, asked of the server when needed
    _failed_probes: int = 0
    _next_probe: float = 0.0
    _probe: tuple[threading.Thread, list] | None = None    # the probe in flight and the list its answer goes into
    _regions: set[str] = field(default_factory=set)      # shared memory of every stub seen, for after a kill
    _loaded: list[str] = field(default_factory=list)   # READY models at the last look; [] before the first
    _next_index: float = 0.0

    def _look_at_index(self) -> list[str]:
        """The READY models now, remembered for a restart that finds the server gone or unresponsive."""
        try:
            models = ready_models(self.server.http_url, headers=self.server.admin_headers)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
            return self._loaded
        if models:
            self._loaded = models
        return self._loaded

    def check(self) -> str | None:
        proc = self.server.proc
        if proc.poll() is not None:
            return f"tritonserver exited with code {proc.returncode}"
        children = server_children(proc.pid)
        for pid, child in children.items():
            if child.model:
                self._stub_models[pid] = child.model
                self._regions.add(child.region)
        # A zombie keeps the stub's name; one that died before the first look here (while the server started, or
        # just after) was never seen alive, so its model is unknown ("").
        zombies = {pid for pid, c in children.items() if c.state == "Z" and c.is_stub}
        self._zombie_seen = {pid: self._zombie_seen.get(pid, 0) + 1 for pid in zombies}
        self._stub_models = {pid: m for pid, m in self._stub_models.items() if pid in children}
        live = {c.model for c in children.values() if c.model and c.state != "Z"}
        suspects = {pid for pid, seen in self._zombie_seen.items()
                    if seen >= 2 and self._stub_models.get(pid, "") not in live}
        if suspects:
            # An unload also leaves its stub unreaped for a while, and a reload starts a new one: only a model that is
            # still READY with no live stub has lost it.
            try:
                ready = set(ready_models(self.server.http_url, headers=self.server.admin_headers))
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
                ready = set()
            for pid in sorted(suspects):
                model = self._stub_models.get(pid) or python_model_without_stub(self.server.http_url, ready - live,
                                                                            self._backends)
                if model in ready:
                    return f"the Python-backend stub of model '{model}' (pid {pid}) died"
        if self.recycle_above_mib > 0 and (mib := rss_bytes(proc.pid) / 2**20) > self.recycle_above_mib:
            return f"{RECYCLE}: tritonserver holds {mib:.0f} MiB, above its bound of {self.recycle_above_mib:.0f} MiB"
        if self.server.model_control_mode == "explicit" and time.monotonic() >= self._next_index:
            self._next_index = time.monotonic() + self.index_interval
            self._look_at_index()
        if self.probe_interval > 0:
            return self._probe_result()
        return None

    def _probe_result(self) -> str | None:
        """Count the probe that has answered, start the next when it is due. A probe runs in its own thread: one
        sent just before a stub died hangs until its timeout, and must not hold up the look at the children (the
        streams of a dead stub then hung for seconds more)."""
        if self._probe is not None and not self._probe[0].is_alive():
            [problem] = self._probe[1]
            self._probe = None
            self._failed_probes = self._failed_probes + 1 if problem else 0
            if self._failed_probes >= self.probe_failures:
                return f"{self._failed_probes} generate probes of '{self.probe_model}' failed; last: {problem}"
        if self._probe is None and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.probe_interval
            answer: list = []
            url, model, timeout = self.server.http_url, self.probe_model, max(self.probe_interval, 5.0)
            thread = threading.Thread(target=lambda: answer.append(generate_probe(url, model, timeout=timeout)),
                                      name="supervisor-probe", daemon=True)
            thread.start()
            self._probe = (thread, answer)
        return None

    def restart(self, reason: str, backoff: float) -> None:
        """Kill the server's process group at once (open streams end with a connection error instead of hanging)
        and start it again after `backoff` seconds, loading the models that were loaded. A recycle drains the
        streams first: the server still serves, so each can end with its final response."""
        down = time.monotonic()
        proc = self.server.proc          # None after a start that failed (TritonServer.start stops what it began)
        running = proc is not None and proc.poll() is None
        models = []
        if self.server.model_control_mode == "explicit":
            models = self._look_at_index() if running else self._loaded
        print(f"supervisor: {reason}; restarting tritonserver in {backoff:.0f} s", file=self.log, flush=True)
        if running and reason.startswith(RECYCLE):
            self.server.drain(self.drain_s)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.server.stop(timeout=5)
        remove_shm_regions(self._regions)
        self._regions.clear()
        time.sleep(backoff)
        if models:
            self.server.load_models = models
        self.server.start()
        self._stub_models.clear()
        self._zombie_seen.clear()
        self._backends.clear()
        self._failed_probes = 0
        self._probe = None     # a probe of the old server may still be in flight: its answer is not counted
        self._next_index = 0.0
        self.restarts.append({"reason": reason, "down_s": round(time.monotonic() - down, 1)})
        print(f"supervisor: tritonserver is ready again after {self.restarts[-1]['down_s']} s", file=self.log,
              flush=True)

    def run(self, should_stop=lambda: False) -> None:
        backoff, healthy_since = 0.0, time.monotonic()
        while not should_stop():
            try:
                reason = self.check()
            except Exception as e:   # noqa: BLE001 - a failed look must not end the supervision of the server
                print(f"supervisor: a check failed ({type(e).__name__}: {e}); checking again", file=self.log,
                      flush=True)
                time.sleep(self.poll_s)
                continue
            if reason is None:
                if time.monotonic() - healthy_since > STABLE_AFTER_S:
                    backoff = 0.0
                time.sleep(self.poll_s)
                continue
            planned = reason.startswith(RECYCLE)
            while True:
                try:
                    self.restart(reason, 0.0 if planned else backoff)
                    break
                except (RuntimeError, TimeoutError) as e:      # the new server did not come up: try again, slower
                    reason, planned = f"restart failed: {e}", False
                    backoff = next_backoff(backoff)
            if not planned:    # a recycle is no fault: it neither waits out nor lengthens the back-off
                backoff, healthy_since = next_backoff(backoff), time.monotonic()
