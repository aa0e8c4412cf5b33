"""Where a served run's CPU goes: the CPU seconds of tritonserver, each model's stub (the llm stub by engine thread:
its stepping thread with the OpenMP workers it starts, the responder, the cancellation watcher, the rest), the
front door and the client, between two snapshots of /proc/PID/task/TID/stat (Linux). perf/benchmark.py
`--cpu-by-process` prints it per level, in CPU milliseconds per output token: on a host whose cores the compute
fills, what serving a response costs beside the tokens."""
from __future__ import annotations

import os
from collections import defaultdict

from trellm_backend.tools.supervisor import proc_stat, server_children

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# The engine loop names its OS threads (engine/cores.py name_os_thread); the stepping thread's OpenMP workers
# inherit its name. Other threads of a stub are counted together.
ENGINE_THREADS = ("trellm-engine", "trellm-response", "trellm-cancel")


def thread_ticks(pid: int) -> dict[str, int]:
    """{thread name: user + system clock ticks} of the live threads of `pid`, threads of one name summed."""
    out: dict[str, int] = defaultdict(int)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        stat = proc_stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:
            name, fields = stat
            out[name] += int(fields[11]) + int(fields[12])    # utime, stime (fields 14 and 15 of stat)
    return out


class CPUUse:
    """Snapshots of the CPU time of a server (`server_pid`, its stubs found as its children), `others` ({label:
    pid}, e.g. the front door) and this process (the client)."""

    def __init__(self, server_pid: int, others: dict[str, int] | None = None):
        self.server_pid, self.others = server_pid, dict(others or {})

    def processes(self) -> dict[int, str]:
        procs = {self.server_pid: "tritonserver", os.getpid(): "client"}
        procs.update({pid: f"stub:{c.model}" for pid, c in server_children(self.server_pid).items() if c.model})
        procs.update({pid: label for label, pid in self.others.items()})
        return procs

    def snapshot(self) -> dict[tuple[int, str], int]:
        """{(pid, row): ticks}; a row is a process label, or `stub:llm <thread>` for the engine's threads."""
        out: dict[tuple[int, str], int] = defaultdict(int)
        for pid, label in self.processes().items():
            threads = thread_ticks(pid)
            engine = any(name in ENGINE_THREADS for name in threads)
            for name, ticks in threads.items():
                row = f"{label} {name}" if name in ENGINE_THREADS else f"{label} other" if engine else label
                out[(pid, row)] += ticks
        return out


def cpu_seconds(before: dict[tuple[int, str], int], after: dict[tuple[int, str], int]) -> dict[str, float]:
    """{row: CPU seconds} between two snapshots; a process that appeared meanwhile counts from zero."""
    rows: dict[str, float] = defaultdict(float)
    for key, ticks in after.items():
        rows[key[1]] += (ticks - before.get(key, 0)) / TICKS_PER_S
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def table(levels: list[dict]) -> str:
    """CPU ms per output token by row for each level that carries `cpu_s` (and its `wall_s`, `output_tokens`)."""
    levels = [lv for lv in levels if lv.get("cpu_s")]
    if not levels:
        return ""
    rows = sorted({r for lv in levels for r in lv["cpu_s"]}, key=lambda r: -max(lv["cpu_s"].get(r, 0) for lv in levels))
    head = ["CPU ms per output token"] + [f"{lv['profile']} c={lv['concurrency']}" for lv in levels]
    lines = [head]
    for r in rows:
        lines.append([r] + [f"{1000 * lv['cpu_s'].get(r, 0.0) / max(1, lv['output_tokens']):.3f}" for lv in levels])
    lines.append(["all"] + [f"{1000 * sum(lv['cpu_s'].values()) / max(1, lv['output_tokens']):.3f}" for lv in levels])
    lines.append(["cores busy (CPU s / wall s)"] + [f"{sum(lv['cpu_s'].values()) / lv['wall_s']:.2f}" for lv in levels])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(line))
                     for line in lines)
