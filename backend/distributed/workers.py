"""Rank 0's side of a split model's workers (`WorkerSet`: what a tensor-parallel group and a pipeline share), and of a
tensor-parallel group on one host (`Workers`): it starts ranks 1..N-1 as processes of their own (a fresh
interpreter each, never a fork of a server process), joins the group with them, and before each forward sends them
that step's plan (the forward's inputs: token ids, positions, KV slots, block tables, the rows to sample) over a
local socket; the scheduler, the KV block manager and the sampler stay in rank 0.

A lost worker is seen two ways: a collective of the step in progress fails at once when a peer's connection closes
(it died) or at its deadline when a peer stopped (group.py), and between steps a watcher thread notices a worker
that exited or stays stopped. Either way `failure` names the rank and what the group was doing, the next step
raises GroupFailure, and `on_lost` (set by the server) is called once.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

from trellm_backend.distributed.group import GroupFailure, TensorGroup, create_region
from trellm_backend.distributed.messages import pack_step, recv_msg, send_msg
from trellm_backend.models.sharding import Shard

log = logging.getLogger("trellm")

LOAD_TIMEOUT_S = 3600.0   # to read a rank's share of the weights
WATCH_INTERVAL_S = 0.2


def python_executable() -> str:
    """The interpreter to start a worker with: this one, or where this process embeds Python (a Triton stub), the
    `python3` of its prefix."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    candidate = os.path.join(sys.prefix, "bin", "python3")
    return candidate if os.path.exists(candidate) else (shutil.which("python3") or "python3")


def threads_per_rank(world: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world)


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class WorkerSet:
    """Rank 0's record of the processes that hold the rest of a model (`kind` names one in messages, e.g.
    "tensor-parallel rank"): their sockets, what the group is doing, the first loss; and the plan of each step."""
    kind = "rank"

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.doing = "loading"
        self.steps = 0
        self._closed = threading.Event()
        self._procs: dict[int, subprocess.Popen] = {}   # the workers started here, by rank
        self._socks: dict[int, socket.socket] = {}      # every worker's, by rank
        self._files: list[str] = []                     # removed at close, if still there
        self._finalizer = weakref.finalize(self, _close, self._closed, self._procs, self._socks, self._files)

    def _start(self, rank: int, args: list[str], **popen) -> None:
        self._procs[rank] = subprocess.Popen([python_executable(), "-m", "trellm_backend.distributed.worker", *args],
                                             stdin=subprocess.DEVNULL, **popen)

    def _check_started(self, what: str) -> None:
        """Raise RuntimeError (after closing everything) if a worker started here has exited before `what`."""
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                self.close()
                raise RuntimeError(f"{self.kind} {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} before it "
                                   f"could {what}; its log lines are above")

    def _start_all(self, num_blocks: int) -> list[int]:
        """Give every worker the KV pool's size and wait until each has its weights and cache (a worker started here
        that exits, or any past the load deadline, fails the load). Returns their bytes of weights in rank order,
        with the watchers started; RuntimeError naming a worker that failed instead."""
        for sock in self._socks.values():
            send_msg(sock, {"num_blocks": num_blocks})
        answers: dict[int, dict | None] = {}

        def read(rank, sock):   # a blocking read each: a frame is never cut by a timeout
            try:
                answers[rank] = recv_msg(sock)
            except (OSError, ValueError):   # BadMessage included
                answers[rank] = None
        readers = [threading.Thread(target=read, args=item, daemon=True) for item in self._socks.items()]
        for r in readers:
            r.start()
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while any(r.is_alive() for r in readers):
            self._check_started("load its weights")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{self.kind}s did not load their weights within {LOAD_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        for rank, answer in sorted(answers.items()):
            if not answer or "error" in answer:
                self.close()
                raise RuntimeError(f"{self.kind} {rank}: {answer['error'] if answer else 'closed its connection'}")
        self.doing = "waiting for a step"
        if self._procs:
            threading.Thread(target=self._watch, daemon=True, name="split-watch").start()
        self.start_sizes = [answers[r]["weight_bytes"] for r in sorted(answers)]
        return self.start_sizes

    def send_step(self, batches) -> None:
        """Before rank 0's own forward: the step's plan to every worker, each (micro-)batch's inputs
        (input_ids, meta, logits_indices, lora)."""
        if self.failure is not None:
            raise GroupFailure(self.failure)
        self.steps += 1
        self.doing = f"step {self.steps}"
        msg = [pack_step(*batch) for batch in batches]
        for rank, sock in self._socks.items():
            try:
                send_msg(sock, msg)
            except OSError as e:
                raise GroupFailure(self._lost(f"{self.kind} {rank} cannot be sent step {self.steps} ({e})")) from None

    def step_done(self) -> None:
        self.doing = "waiting for a step"

    def step_failed(self, e: GroupFailure) -> GroupFailure:
        """The error to raise for a collective or transfer that failed: which worker is lost, if it can be told."""
        return GroupFailure(self._lost(self._diagnose(settle_s=1.0) or str(e)))

    def _diagnose(self, settle_s: float = 0.0) -> str | None:
        """Which worker started here has exited or is stopped. `settle_s`: how long to let one that is dying finish
        (its connections close before it has exited)."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and all(p.poll() is None and not is_stopped(p.pid)
                                                  for p in self._procs.values()):
            time.sleep(0.01)
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                return f"{self.kind} {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} during {self.doing}"
            if is_stopped(proc.pid):
                return f"{self.kind} {rank} (pid {proc.pid}) is stopped (SIGSTOP) during {self.doing}"
        return None

    def _on_loss(self) -> None:
        """What else a loss must do at once (a subclass's)."""

    def _lost(self, message: str) -> str:
        """Record the first loss, log it and tell `on_lost`; returns the recorded message."""
        if self.failure is None and not self._closed.is_set():
            self.failure = message
            self._on_loss()
            log.error("%s; the model cannot step any more", message)
            if self.on_lost is not None:
                threading.Thread(target=self.on_lost, args=(message,), daemon=True, name="split-lost").start()
        return self.failure or message

    def _watch(self) -> None:
        """Between steps too: a worker started here that exits, or stays stopped past the deadline."""
        stopped_since: dict[int, float] = {}
        while not self._closed.wait(WATCH_INTERVAL_S) and self.failure is None:
            for rank, proc in self._procs.items():
                if proc.poll() is not None:
                    self._lost(f"{self.kind} {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} while the "
                               f"group was {self.doing}")
                    break
                if not is_stopped(proc.pid):
                    stopped_since.pop(rank, None)
                elif time.monotonic() - stopped_since.setdefault(rank, time.monotonic()) > self.timeout_s:
                    self._lost(f"{self.kind} {rank} (pid {proc.pid}) has been stopped (SIGSTOP) for "
                               f"{self.timeout_s:.0f} s while the group was {self.doing}")
                    break

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def close(self) -> None:
        self._finalizer()


class Workers(WorkerSet):
    """Ranks 1..N-1 of a tensor-parallel group, started here, each on a socket pair with rank 0."""
    kind = "tensor-parallel rank"

    def __init__(self, engine_config: dict, shard: Shard, max_model_len: int, timeout_s: float):
        """Start ranks 1..world-1 and join the group with them (rank 0's `shard`). Each worker reads its own share of
        the weights meanwhile; `start` then gives them the KV pool's size and waits for them to be ready."""
        super().__init__(timeout_s)
        world = shard.world
        self._region = create_region(world)
        self._files.append(self._region)
        for rank in range(1, world):
            ours, theirs = socket.socketpair()
            self._start(rank, [str(theirs.fileno())], pass_fds=(theirs.fileno(),))
            theirs.close()
            self._socks[rank] = ours
            send_msg(ours, {"rank": rank, "world": world, "region": self._region, "config": engine_config,
                            "max_model_len": max_model_len, "timeout_s": timeout_s,
                            "threads": threads_per_rank(world)})
        self.group = TensorGroup(self._region, shard, timeout_s)

    def start(self, num_blocks: int) -> list[int]:
        """Give the workers the KV pool's size and wait until each has its weights and cache. Returns each worker's
        bytes of weights."""
        sizes = self._start_all(num_blocks)
        os.unlink(self._region)   # every rank has it mapped; nothing is left behind once they end
        return sizes

    def _on_loss(self) -> None:
        self.group.mark_lost()   # a collective waiting on the lost rank fails now


def _close(closed: threading.Event, procs: dict[int, subprocess.Popen], socks: dict[int, socket.socket],
           files: list[str]) -> None:
    """End the workers: their sockets close (a worker exits at the end of its input), then any left are killed.
    `closed` is set first, so that the watchers do not take those exits for losses (at interpreter exit too)."""
    closed.set()
    for path in files:
        if os.path.exists(path):
            os.unlink(path)
    for sock in socks.values():
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
    deadline = time.monotonic() + 5.0
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
