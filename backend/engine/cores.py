"""How a CPU engine's compute and the threads that serve it share the cores: two rules, each measured on the
anchor workload served on 2 cores (perf/RESULTS.md).

1. The stepping thread owns the process's only OpenMP pool (the runtime that torch's CPU operators and ours,
   kernels/cpu/, share; how long its idle workers spin is set before torch loads, tools/launch.py's
   openmp_wait_defaults). libgomp keeps one pool of workers per thread that starts parallel regions, counts the
   workers of every pool, and once they outnumber the cores cuts each worker's spinning to 100 rounds: a worker
   then sleeps between any two operators and every parallel region pays a futex wake-up. The Triton stub loads
   the model on its main thread (a pool) and steps on another (engine/loop.py, a second pool), so on 2 cores every
   operator of every step ran throttled: a decode-sized linear layer took longer on the stepping thread, and the
   anchor workload ran slower through the engine loop than stepped on the main thread (perf/RESULTS.md, section
   "What the served run lost, and the two fixes").
   `release_thread_pool()` on the loading thread, once its work is done, ends its pool.

2. Every other busy thread, the engine loop's responder and cancellation watcher and tritonserver's own threads,
   runs in Linux's SCHED_IDLE class (`cpu_serving_threads`, default idle). Those threads wake thousands of times a
   second while tokens stream; in the normal class each wake-up could preempt the stepping thread or its OpenMP
   worker, and a preempted worker holds the step at the next barrier. In SCHED_IDLE they take a core only when
   the compute leaves it, between operators and between steps; when the cores stay busy the responder falls
   behind and merges the tokens queued meanwhile into one response (engine/loop.py), so serving costs less
   exactly when the compute needs the cores. Served `llm` (and `ensemble`) got faster with the loop's helpers
   idle, and faster again with tritonserver's threads idle as well (the same section). The other models'
   stubs (the ensemble's postprocess detokenizes every streamed response) join them. Under full load a
   stream's tokens then come a few at a time; with at most 4 streams the stepping thread waits for each step's
   responses to go out (engine/loop.py), so an interactive stream still gets every token as it is made. Lowering
   a thread's class needs no privilege, and threads started later inherit it from the thread that starts them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger("trellm")

OMP_PAUSE_HARD = 2   # omp_pause_resource_kind: free the calling thread's pool as well
PR_SET_NAME = 15     # prctl option: the calling thread's name


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None (another OpenMP runtime, or not on Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)   # already loaded: this returns the same handle
        except OSError:
            continue
    return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP workers (the next parallel region on it would start new ones). Call it on a
    thread that has finished its torch work, before another thread takes over the computing. Returns whether a
    pool was released; False where the runtime is not libgomp or is older than OpenMP 5.0's pause."""
    lib = _loaded_libgomp()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    if pause(OMP_PAUSE_HARD) != 0:
        log.debug("omp_pause_resource_all failed; the thread's OpenMP pool stays")
        return False
    return True


def yield_to_compute(native_id: int) -> bool:
    """Put one thread (a native thread id, as in /proc/PID/task) in SCHED_IDLE. Returns whether it took: False off
    Linux, or for a thread that is gone or not ours to change."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(native_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


def name_os_thread() -> bool:
    """Give the calling thread's Python name to its OS thread (15 bytes, as Linux keeps them), so `top -H`, perf and
    /proc/PID/task tell the engine's threads apart; OpenMP workers the thread starts inherit the name. Returns whether
    it took: False off Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def yield_threads(threads: list[threading.Thread]) -> None:
    """Started helper threads of this process to SCHED_IDLE."""
    for t in threads:
        yield_to_compute(t.native_id)


def yield_process(pid: int, with_children: bool = False) -> int:
    """Every thread of process `pid` (tritonserver: the stub's parent) to SCHED_IDLE; the threads it starts later
    inherit the class. `with_children`: its child processes' threads too, except the caller's own process (the
    other models' stubs: the ensemble's preprocess and postprocess, which wake per request and per streamed
    response as tritonserver's threads do; stubs started later inherit the class from the thread that forks them).
    Returns how many threads took it."""
    pids = [pid]
    if with_children:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                    pids.append(int(entry))
    count = 0
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        count += sum(yield_to_compute(int(t)) for t in tids)
    return count
