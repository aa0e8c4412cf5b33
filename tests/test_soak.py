"""The soak (perf/soak.py) for 60 s, what CI runs: its own launcher and tritonserver, every kind of traffic, one llm
stub killed halfway. Nothing may hang or stay allocated, every malformed request must be refused, and the server
must come back. About 2 minutes on 2 quiet cores (server start and restart included). And its verdict on made-up
findings: what fails a run, and what the deliberate stub kill excuses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "perf"))
ABORT = (b"terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
         b"  what():  boost::interprocess::lock_exception\nSignal (6) received.\n")


def test_the_verdict_fails_on_a_shared_memory_region_left_and_on_a_crash_in_the_server_log():
    from soak_requests import Record
    from soak_verdict import crash_lines, verdict
    served = [Record("grpc_llm_stream", "wellformed", "ok", 1.0, 2.0)]
    assert verdict(served) == ([], [])
    failures, _ = verdict(served, shm_left={"triton_python_backend_shm_region_1": "llm (stub 42): 1 MiB"})
    assert len(failures) == 1 and "/dev/shm" in failures[0] and "llm (stub 42)" in failures[0], failures
    crashes, excused = crash_lines(b"I1127 ready\nSignal (11) received.\n 0# 0x5 in tritonserver\nSignal (15) "
                                   b"received.\nFatal Python error: Segmentation fault\n"
                                   b"I1127 Model 'ensemble' (version 1) has 3 in-flight inferences\n"
                                   b'E1127 main.cc:535] "failed to stop server: Internal - Exit timeout expired."\n')
    assert crashes[:2] == ["Signal (11) received.", "Fatal Python error: Segmentation fault"] and excused == []
    assert len(crashes) == 3 and "Exit timeout expired" in crashes[2], "a stop that waited for a leaked inference"
    crashes = crashes[:2]
    failures, _ = verdict(served, crashes=crashes)
    assert failures == ["server log: Signal (11) received.", "server log: Fatal Python error: Segmentation fault"]
    failures, unexpected = verdict(served, idle={"end": {"idle": True, "after_s": 12}})
    assert failures == [] and unexpected == ["idle end only after 12 s"]


def test_the_verdict_fails_on_memory_that_keeps_growing_and_on_an_unexplained_stop_timeout():
    """tritonserver's RSS grew 11.7 MiB a minute in an 18-minute soak that printed PASS: growth past the limit after
    the warm-up (and after the restart of a stub kill) fails the run now. And the final stop's exit timeout is
    excused only in a run that sent a request known to leave a model 2.51 does not unload."""
    from soak_verdict import RSS_GROWTH_LIMIT_MIB, STUCK_MODEL_KINDS, crash_lines, verdict
    growing = [{"t": t, "tritonserver": 43.0 + 0.2 * t / 60 * 58.5, "total": 900.0} for t in range(0, 1081, 60)]
    failures, _ = verdict(rss_timeline=growing)
    assert len(failures) == 1 and failures[0].startswith("tritonserver's RSS grew"), failures
    flat = [{"t": t, "tritonserver": 43.0 + (30.0 if t < 300 else 0.01 * t), "total": 900.0} for t in range(0, 1081, 60)]
    assert verdict(rss_timeline=flat) == ([], []), "growth during the warm-up is not counted"
    restarted = [{"t": t, "tritonserver": 80.0 if t < 600 else 40.0 + t / 1000, "total": 900.0}
                 for t in range(0, 1081, 60)]
    assert verdict(rss_timeline=restarted, kill={"recovered_at_s": 600.0}) == ([], [])
    assert verdict(rss_timeline=growing[:1]) == ([], []), "one sample measures nothing"
    assert RSS_GROWTH_LIMIT_MIB == 20.0
    stop = (b"I1127 ready\nSignal (15) received.\n"
            b'E1127 main.cc:535] "failed to stop server: Internal - Exit timeout expired."\n')
    assert crash_lines(stop, stuck_models_sent=True) == ([], [
        'E1127 main.cc:535] "failed to stop server: Internal - Exit timeout expired."'])
    crashes, excused = crash_lines(stop, stuck_models_sent=False)
    assert len(crashes) == 1 and "Exit timeout expired" in crashes[0] and excused == []
    with open(os.path.join(REPO, "perf", "soak_traffic.py")) as f:
        traffic = f.read()
    assert all(f'"{kind}": ' in traffic for kind in STUCK_MODEL_KINDS), "the excuse names kinds the soak sends"


def test_the_verdict_excuses_only_what_the_stub_kill_causes():
    from soak_requests import Record
    from soak_verdict import crash_lines, verdict
    kill = {"killed_at_s": 10.0, "recovered_at_s": 20.0, "recovered_after_s": 10.0,
            "inflight_streams": {"llm": {"outcome": "error UNAVAILABLE: socket closed", "ended_after_kill_s": 0.8}}}
    lost = "error UNAVAILABLE: socket closed"
    excused = [Record("grpc_llm_stream", "wellformed", lost, 9.0, 10.5),        # inside the restart
               Record("grpc_cancel_llm", "cancel", lost, 19.0, 21.0),
               Record("grpc_llm_stream", "wellformed", "error: llm queue full", 30.0, 31.0)]    # a refusal
    assert verdict(excused, kill=kill, kill_planned=True) == ([], [])
    failures, _ = verdict([Record("grpc_llm_stream", "wellformed", lost, 25.0, 26.0),
                           Record("grpc_n_17", "malformed", "accepted", 12.0, 13.0)], kill=kill, kill_planned=True)
    assert len(failures) == 2 and "malformed request served: grpc_n_17" in failures[1], failures
    assert verdict(kill={}, kill_planned=True)[0], "no recovery is a failure"
    # tritonserver 2.51's abort on a shared-memory lock, which the kill may cause: excused between the kill and the
    # recovery, a failure anywhere else.
    log = b"I1127 ready\n" + ABORT + b"I1127 ready again\n" + ABORT
    start = len(b"I1127 ready\n")
    crashes, excused_lines = crash_lines(log, (start, start + len(ABORT)))
    assert len(excused_lines) == 3 and len(crashes) == 3 and crashes[2] == "Signal (6) received.", crashes
    assert crash_lines(b"Signal (11) received.\n", (0, 100)) == (["Signal (11) received."], [])
    # The same abort hit by two threads at once (a soak with bursts every 2 s, perf/RESULTS.md): its second
    # "terminate" is that abort too.
    twice = ABORT + b"terminate called recursively\nSignal (6) received.\n"
    crashes, excused_lines = crash_lines(twice, (0, len(twice)))
    assert crashes == [] and len(excused_lines) == 5, (crashes, excused_lines)
    assert "terminate called recursively" in crash_lines(twice)[0]
    # A final stop that waited out the exit timeout: excused (with its abort) when only models were left to unload,
    # a failure when an inference was still counted in flight (a leak of this server's making).
    stop = (b"Signal (15) received.\nI1127 server.cc:321] \"Timeout 10: Found 0 model versions that have in-flight "
            b"inferences\"\n%sE1127 main.cc:535] \"failed to stop server: Internal - Exit timeout expired.\"\n"
            b"Signal (6) received.\n")
    crashes, excused_lines = crash_lines(stop % b"I1127 \"Timeout 0: Found 2 live models\"\n")
    assert crashes == [] and len(excused_lines) == 2, (crashes, excused_lines)
    crashes, excused_lines = crash_lines(stop % b"I1127 \"Model 'ensemble' (version 1) has 20 in-flight inferences\"\n")
    assert len(crashes) == 2 and excused_lines == [], (crashes, excused_lines)


@pytest.mark.server
def test_soak_for_a_minute(default_model_path, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "perf", "soak.py"), "--duration", "60",
                        "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    report = r.stdout[-8000:] + r.stderr[-3000:]
    assert out.exists(), report
    s = json.loads(out.read_text())
    assert r.returncode == 0, report
    assert s["passed"] and s["hung"] == 0, report
    assert s["kv_blocks_at_idle"] and all(v == 0 for v in s["kv_blocks_at_idle"].values()), s["idle"]
    assert all(idle["vllm:num_requests_running"] == 0 and idle["vllm:num_requests_waiting"] == 0
               for idle in s["idle"].values()), s["idle"]
    assert s["vllm_slots_at_idle"]["served"] == s["vllm_slots_at_idle"]["requests"], s["vllm_slots_at_idle"]

    # Every kind of traffic happened, and did what it is for (a connection error during the restart does not count).
    def served(outcomes):
        return outcomes.get("ok", 0)

    def refused_by_the_server(outcomes):
        return sum(n for o, n in outcomes.items() if o.startswith("error") and "connect failed" not in o
                   and "socket closed" not in o)
    for category, kinds in s["kinds_planned"].items():
        for kind in kinds:
            outcomes = s["by_kind"].get(category, {}).get(kind, {})
            if category == "malformed":
                assert refused_by_the_server(outcomes) > 0, (kind, outcomes)
            else:
                assert served(outcomes) > 0, (category, kind, outcomes)
    assert s["malformed"]["accepted"] == 0 and s["malformed"]["refused"] == s["malformed"]["requests"], s["malformed"]
    assert s["overload"]["refused_at_capacity"] > 0 and s["overload"]["ok"] > 0, s["overload"]

    # The stub kill: the streams inside it failed within seconds, and a generate answered again afterwards.
    kill = s["kill"]
    assert kill["inflight_streams"] and all(
        st["outcome"].startswith("error") and st["ended_after_kill_s"] < 5 for st in kill["inflight_streams"].values()
    ), kill
    assert s["recovery_s"] is not None and s["recovery_s"] > 0, kill
    # The supervisor's reason: the dead stub, or tritonserver's own exit when 2.51 aborts first (it sometimes does,
    # with boost::interprocess::lock_exception, on a stub killed while holding a shared-memory lock).
    assert any("restarting tritonserver" in line for line in s["supervisor"]) and any(
        "ready again" in line for line in s["supervisor"]), s["supervisor"]

    # Well-formed requests outside the restart succeeded, but for refusals at capacity during bursts.
    wf = s["wellformed"]
    assert wf["outside_restart"] > 50 and wf["ok_fraction"] >= 0.95, wf
    assert s["ttft_ms"]["n"] > 20 and s["ttft_ms"]["p99"] is not None, s["ttft_ms"]
    assert s["rss_mib"]["start"]["total"] > 0 and s["rss_mib"]["end"]["total"] > 0, s["rss_mib"]
    assert s["processes_left"] == [], s["processes_left"]


def test_a_stub_on_sigusr1_writes_every_threads_stack_and_goes_on():
    """What the soak's watchdog (and an operator) asks of a stub that stopped answering: its threads' Python
    stacks on stderr (tritonserver's log), the process still running, and the soak's one-line-per-thread digest of
    them naming the call each thread waits in."""
    import io
    import signal
    import time
    from soak_verdict import compact_stacks, print_hung
    code = ("import sys, threading\n"
            "from trellm_backend.triton.stack_dumps import enable_stack_dumps; enable_stack_dumps();"
            "ev = threading.Event()\n"
            "def waiting_for_the_engine(): ev.wait()\n"
            "threading.Thread(target=waiting_for_the_engine, daemon=True).start()\n"
            "print('ready', flush=True); sys.stdin.readline(); print('alive', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        out, err = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
    assert out.strip() == "alive"
    assert err.count("(most recent call first)") >= 2, err
    digest = compact_stacks(err).splitlines()
    assert any(line.strip().startswith("wait (threading.py") and "waiting_for_the_engine" in line for line in digest), \
        digest
    # A soak's report of a hang: the hung requests by kind and start, then the stubs' stacks in that digest.
    report = io.StringIO()
    print_hung({"hung_requests": [{"kind": "burst_grpc_llm", "t_start": 2.2}] * 50 + [
                    {"kind": "grpc_llm_stream", "since_s": 70.0, "outcome": "stuck"}],
                "stack_dump": {"at_s": 32.2, "late_kinds": ["burst_grpc_llm"], "path": "stacks.txt",
                               "python": {"stub:llm (123)": err}}}, report)
    text = report.getvalue()
    assert "burst_grpc_llm @ 2 s: 50" in text and "grpc_llm_stream in it for 70.0 s: 1" in text, text
    assert "stub:llm (123):" in text and "waiting_for_the_engine" in text, text
