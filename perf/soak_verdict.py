"""What a run of perf/soak.py found: the summary (requests by kind and outcome, idle gauges, RSS, TTFT, the stub kill
and the recovery, the server log, /dev/shm), and its verdict.

The verdict is `failures` (any one makes the run fail, exit status 1) and `unexpected` (soft observations, printed
and kept in the JSON, never failing a run):

- failures: a request that hung (or a worker still inside one at the end); the server not idle (a KV block, a
  running or a waiting request left) before the kill or at the end; vllm_model refusing a burst of its own size at
  idle (a slot leak); no successful generate after the stub kill; a stream in flight at the kill that did not fail
  within 5 s; a malformed request served (or neither served nor refused) outside the restart; a well-formed, cancel
  or disconnect request that failed outside the restart (a refusal at capacity aside); a /dev/shm region of this
  run's stubs left after the launcher stopped; a crash line in tritonserver's log (a signal other than the SIGTERM
  that stops it, an uncaught C++ exception, a stub's fatal Python error, a stop that hit the exit timeout with
  inferences still counted in flight); a process left after the launcher stopped.
- unexpected: the server idle only after more than 10 s.

"The restart" is the stub kill to the first successful generate after it: requests that overlap it may fail.
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict

import numpy as np

from soak_requests import Record, error_class
from trellm_backend.tools.launch import log_errors

# tritonserver 2.51's own abort on a shared-memory lock (upstream triton-inference-server/server#8882): a stub killed
# while it holds the lock can bring it about, so the soak's own kill may (tests/rerun_on_upstream_abort.py).
UPSTREAM_ABORT = b"boost::interprocess::lock_exception"
CRASH = re.compile(r"Signal \((?!15\))\d+\) received|terminate called|Fatal Python error|  what\(\):")
# A stop that waited out the exit timeout. A failure when the server still counted an inference in flight that had
# ended for its client (INFLIGHT: 2.51's dynamic batcher made such a leak of each cancelled ensemble stream). Excused,
# with the abort that may follow it, when only models were left to unload: 2.51 never unloads a model that a gRPC
# stream request with a wrong input datatype addressed (the soak sends such requests; perf/RESULTS.md).
STOP_TIMEOUT = "Exit timeout expired"
# The kinds that leave a model 2.51 will not unload (a gRPC stream request with a wrong input datatype): the final
# stop's exit timeout is excused only in a run that sent one of them.
STUCK_MODEL_KINDS = ("grpc_max_tokens_fp32", "grpc_llm_input_ids_fp32")
# Memory: tritonserver's resident set may grow at most this much from the end of the warm-up (or the recovery after
# the stub kill, when the supervisor started a new server) to the last sample.
RSS_WARMUP_S = 300.0
RSS_GROWTH_LIMIT_MIB = 20.0
INFLIGHT = re.compile(rb"has [1-9]\d* in-flight inferences")
SIGTERM_LINE = b"Signal (15) received."


def in_restart(r: Record, kill: dict) -> bool:
    killed, recovered = kill.get("killed_at_s"), kill.get("recovered_at_s")
    return killed is not None and r.t_end >= killed and (recovered is None or r.t_start <= recovered)


def at_capacity(outcome: str) -> bool:
    return "capacity" in outcome or "queue full" in outcome


def crash_lines(log: bytes, kill_span: tuple[int, int] | None = None,
                stuck_models_sent: bool = True) -> tuple[list[str], list[str]]:
    """(crashes, excused): the crash lines of tritonserver's log (a signal other than the SIGTERM that stops it, an
    uncaught C++ exception; a stub's fatal error, which Python's fault handler, enabled by the models, names; a stop
    that hit the exit timeout). Excused are those of 2.51's own abort on a shared-memory lock written between the
    soak's stub kill and the recovery (`kill_span`, offsets in the log): the kill may cause that abort, and the
    supervisor restarts the server for it; and the final stop's exit timeout (and abort) when no inference was
    counted in flight, only models left to unload, in a run that sent a request that leaves one (`stuck_models_sent`:
    STOP_TIMEOUT's comment)."""
    crashes, excused = [], []
    abort_in_span = kill_span is not None and UPSTREAM_ABORT in log[kill_span[0]:kill_span[1]]
    last_stop = log.rfind(SIGTERM_LINE)
    models_stuck_at_stop = stuck_models_sent and last_stop >= 0 and STOP_TIMEOUT.encode() in log[last_stop:] \
        and not INFLIGHT.search(log[last_stop:])
    at = 0
    for raw in log.splitlines(keepends=True):
        start, at = at, at + len(raw)
        line = raw.decode(errors="replace").rstrip()
        if not (CRASH.match(line) or STOP_TIMEOUT in line):
            continue
        # "terminate called recursively": a second thread throwing while the first abort runs, part of the same one
        of_the_abort = UPSTREAM_ABORT.decode() in line or line.startswith(("Signal (6)", "terminate called recursively"))
        if abort_in_span and of_the_abort and kill_span[0] <= start < kill_span[1]:
            excused.append(line.strip())
        elif models_stuck_at_stop and start > last_stop and (STOP_TIMEOUT in line or line.startswith("Signal (6)")):
            excused.append(line.strip())
        else:
            crashes.append(line.strip())
    return crashes, excused


def rss_growth(timeline: list[dict], kill: dict, warmup_s: float = RSS_WARMUP_S) -> tuple[float, float, float] | None:
    """(MiB grown, from s, to s) of tritonserver's resident set between the first sample after the warm-up (and after
    the recovery from the stub kill, whose restart starts a new server) and the last; None with fewer than two."""
    after = max(warmup_s, kill.get("recovered_at_s") or 0.0)
    samples = [s for s in timeline if s["t"] >= after and "tritonserver" in s]
    if len(samples) < 2:
        return None
    return samples[-1]["tritonserver"] - samples[0]["tritonserver"], samples[0]["t"], samples[-1]["t"]


def verdict(records: list[Record] = (), hung: list = (), kill: dict | None = None, idle: dict | None = None,
            vllm_slots: dict | None = None, shm_left: dict | None = None, crashes: list[str] = (),
            processes_left: list[int] = (), kill_planned: bool = False,
            rss_timeline: list[dict] = (), rss_warmup_s: float = RSS_WARMUP_S) -> tuple[list[str], list[str]]:
    """(failures, unexpected) of what a run found (the module's docstring says which is which)."""
    kill, idle, shm_left = kill or {}, idle or {}, shm_left or {}
    failures, unexpected = [], []
    growth = rss_growth(list(rss_timeline), kill, rss_warmup_s)
    if growth is not None and growth[0] > RSS_GROWTH_LIMIT_MIB:
        failures.append(f"tritonserver's RSS grew {growth[0]:.1f} MiB from {growth[1]:.0f} s to {growth[2]:.0f} s "
                        f"(at most {RSS_GROWTH_LIMIT_MIB:.0f} MiB after the warm-up)")
    if hung:
        failures.append(f"{len(hung)} hung request(s)")
    for name, state in idle.items():
        if not state.get("idle"):
            failures.append(f"not idle {name}: {state}")
        elif state.get("after_s", 0) > 10:
            unexpected.append(f"idle {name} only after {state['after_s']} s")
    if vllm_slots and vllm_slots["served"] != vllm_slots["requests"]:
        failures.append(f"vllm_model refused requests at idle (a slot leak?): {vllm_slots}")
    if kill_planned and "recovered_after_s" not in kill:
        failures.append(f"the server never recovered after the stub kill: {kill}")
    for name, s in kill.get("inflight_streams", {}).items():
        if s["outcome"] == "ok" or s["ended_after_kill_s"] > 5:
            failures.append(f"stream in flight at the kill ({name}): {s['outcome']} {s['ended_after_kill_s']} s "
                            "after the kill")
    outside_restart: dict[str, list[Record]] = defaultdict(list)     # what went wrong -> the requests it did to
    for r in records:
        if r.category == "malformed" and r.outcome == "accepted":
            outside_restart[f"malformed request served: {r.kind}"].append(r)    # in the restart too
        elif r.outcome in ("ok", "hung") or in_restart(r, kill) or at_capacity(r.outcome):
            continue
        elif r.category == "malformed" and not r.outcome.startswith("error"):
            outside_restart[f"malformed {r.kind}: {r.outcome}"].append(r)
        elif r.category in ("wellformed", "cancel", "disconnect"):
            outside_restart[f"{r.category} {r.kind}: {r.outcome}"].append(r)
    for what, rs in outside_restart.items():
        failures.append(f"{what} ({len(rs)}x, first at {rs[0].t_start:.1f} s: {rs[0].message[:160]})")
    # No region is excused, the killed stub's neither: a stub unlinks its own only when its model unloads, and the
    # supervisor unlinks those of every stub it saw when it restarts the server (the kill's restart included), as
    # TritonServer.stop does at the end. A region left is memory lost until the next reboot.
    if shm_left:
        failures.append(f"{len(shm_left)} /dev/shm region(s) of this run's stubs left after the launcher stopped: "
                        f"{'; '.join(f'{n} {owner}' for n, owner in shm_left.items())}")
    failures += [f"server log: {line}" for line in crashes]
    if processes_left:
        failures.append(f"processes left after the launcher stopped: {list(processes_left)}")
    return failures, unexpected


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.array(values), p))


def summarize(soak, args, startup: dict, launcher, left_processes: list[int]) -> dict:
    """The summary of a finished soak (a soak.Soak) and its launcher (soak_server.Launcher), verdict included;
    `startup`: the command, startup_s, settings and model_path."""
    records, k = soak.records, soak.kill
    by_kind: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    samples: dict[str, str] = {}
    for r in records:
        by_kind[r.category][r.kind][r.outcome] += 1
        if r.outcome != "ok" and r.message:
            samples.setdefault(f"{r.kind} | {r.outcome}", r.message)
    hung = [asdict(r) for r in records if r.outcome == "hung"] + [dict(s, outcome="stuck") for s in soak.stuck]
    wf = [r for r in records if r.category == "wellformed"]
    wf_out_of_restart = [r for r in wf if not in_restart(r, k)]
    capacity = [r for r in wf_out_of_restart if at_capacity(r.outcome)]
    wf_ok = [r for r in wf_out_of_restart if r.outcome == "ok"]
    ttfts = [r.ttft for r in wf if r.ttft is not None]
    malformed = [r for r in records if r.category == "malformed"]
    overload = [r for r in records if r.category == "overload"]
    try:
        with open(launcher.log, "rb") as f:
            log = f.read()
    except OSError:
        log = b""
    crashes, excused = crash_lines(log, soak.kill_log_span,
                                   stuck_models_sent=any(r.kind in STUCK_MODEL_KINDS for r in records))
    errors = log_errors(launcher.log)
    error_classes = Counter(error_class(re.sub(r"^E\d{4} [\d:.]+ +\d+ \S+\] ", "", line)) for line in errors)
    vllm_slots = getattr(soak, "vllm_slots", None)
    failures, unexpected = verdict(records, hung, k, soak.idle, vllm_slots, soak.shm_left, crashes, left_processes,
                                   kill_planned=not args.no_kill, rss_timeline=soak.rss_timeline,
                                   rss_warmup_s=min(RSS_WARMUP_S, args.duration / 6))
    return {
        "command": startup["command"],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {"duration_s": args.duration, "traffic_s": soak.traffic_s, "workers": args.workers,
                     "deadline_s": args.deadline, "burst_size": args.burst_size, "burst_every_s": args.burst_every,
                     "repository_settings": startup["settings"], "model_path": startup["model_path"],
                     "cpus": os.cpu_count()},
        "startup_s": startup["startup_s"],
        "requests": len(records),
        "by_category": {c: sum(sum(o.values()) for o in kinds.values()) for c, kinds in by_kind.items()},
        "by_kind": {c: {kind: dict(o) for kind, o in sorted(kinds.items())} for c, kinds in sorted(by_kind.items())},
        "kinds_planned": {category: sorted(k for k in kinds if k not in soak.left_out) for category, kinds in (
            ("wellformed", soak.wellformed()), ("malformed", soak.malformed()), ("cancel", soak.cancels()),
            ("disconnect", soak.disconnects()), ("overload", soak.bursts()))},
        "outcomes": dict(Counter(r.outcome for r in records).most_common()),
        "error_samples": samples,
        "hung": len(hung),
        "hung_requests": hung[:50],
        "kv_blocks_at_idle": {name: idle.get("trellm:kv_cache_used_blocks") for name, idle in soak.idle.items()},
        "idle": soak.idle,
        "vllm_slots_at_idle": vllm_slots,
        "rss_mib": soak.rss,
        "rss_timeline": soak.rss_timeline,
        "ttft_ms": {"n": len(ttfts), "p50": _ms(percentile(ttfts, 50)), "p90": _ms(percentile(ttfts, 90)),
                    "p99": _ms(percentile(ttfts, 99)), "max": _ms(max(ttfts) if ttfts else None)},
        "wellformed": {"requests": len(wf), "during_restart": len(wf) - len(wf_out_of_restart),
                       "outside_restart": len(wf_out_of_restart), "ok": len(wf_ok), "refused_at_capacity":
                       len(capacity), "other_errors": len(wf_out_of_restart) - len(wf_ok) - len(capacity),
                       "ok_fraction": round(len(wf_ok) / max(1, len(wf_out_of_restart) - len(capacity)), 4)},
        "malformed": {"requests": len(malformed), "refused": sum(r.outcome.startswith("error") for r in malformed),
                      "accepted": sum(r.outcome == "accepted" for r in malformed)},
        "overload": {"requests": len(overload), "ok": sum(r.outcome == "ok" for r in overload),
                     "refused_at_capacity": sum(at_capacity(r.outcome) for r in overload)},
        "kill": k,
        "recovery_s": k.get("recovered_after_s"),
        "supervisor": launcher.supervisor_lines(),
        "engine_counters": {key: v for key, v in getattr(soak, "final_metrics", {}).items()
                            if key.startswith("vllm:request_success_total") or key == "vllm:num_preemptions_total"},
        "server_log": {"error_lines": len(errors), "tracebacks": log.count(b"Traceback (most recent call last)"),
                       "crash_lines": crashes, "crash_lines_excused": excused,
                       "error_classes": dict(error_classes.most_common(20))},
        "shm_regions": {"used": len(soak.shm_regions), "left_after_stop": soak.shm_left},
        "stack_dump": soak.stack_dump,
        "unexpected": unexpected[:200],
        "unexpected_count": len(unexpected),
        "processes_left": left_processes,
        "failures": failures,
        "passed": not failures,
    }


def compact_stacks(text: str, frames: int = 5) -> str:
    """faulthandler's dump of every thread, one line per thread: its innermost `frames` calls, innermost first."""
    threads: list[list[str]] = []
    for line in text.splitlines():
        if "(most recent call first)" in line:
            threads.append([])
        elif threads and "<no Python frame>" in line:
            threads[-1].append("(native code only)")
        elif threads and line.strip().startswith("File "):
            m = re.match(r'\s*File "([^"]+)", line (\d+) in (\S+)', line)
            if m and len(threads[-1]) < frames:
                threads[-1].append(f"{m.group(3)} ({os.path.basename(m.group(1))}:{m.group(2)})")
    return "\n".join("  " + " < ".join(t) for t in threads) or "  (no stacks written)"


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
    for kind, why in s.get("left_out", {}).items():
        print(f"left out: {kind} ({why})")
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
        print("  tritonserver (s: MiB)   " + ", ".join(f"{x['t']:.0f}: {x.get('tritonserver', 0):.1f}"
                                                      for x in timeline[::step]))
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
          f"{len(log['crash_lines'])} crash lines (and {len(log['crash_lines_excused'])} excused: 2.51's abort after the "
          "stub kill, its exit timeout with models it could not unload)")
    shm = s["shm_regions"]
    print(f"/dev/shm regions of this run's stubs: {shm['used']}, {len(shm['left_after_stop'])} left after the stop")
    for cls, n in log["error_classes"].items():
        print(f"  {n:6d}  {cls}")
    if s["unexpected_count"]:
        print(f"unexpected ({s['unexpected_count']}):")
        for line in s["unexpected"][:30]:
            print(f"  {line}")
    print("\nPASS" if s["passed"] else "\nFAIL:" + "".join(f"\n  {line}" for line in s["failures"]))
    if s["hung"]:
        print_hung(s, sys.stderr)


def print_hung(s: dict, out) -> None:
    """Which requests hung, from when, and the stubs' stacks taken meanwhile, one line per thread (the soak prints
    them on stderr, whose tail a test's report keeps)."""
    starts = Counter((h["kind"], f"@ {h['t_start']:.0f} s" if "t_start" in h else f"in it for {h['since_s']} s")
                     for h in s["hung_requests"])
    print("hung (kind, start: count): " + ", ".join(f"{k} {t}: {n}" for (k, t), n in starts.items()), file=out)
    dump = s.get("stack_dump") or {}
    if dump:
        print(f"stacks at {dump['at_s']} s (late: {', '.join(dump['late_kinds'])}; all in {dump['path']}):", file=out)
        for process, text in dump.get("python", {}).items():
            print(f"{process}:\n{compact_stacks(text)}", file=out)
