"""engine/cores.py's two rules and the engine loop's latency guard. The stepping thread must own the process's only
OpenMP pool: with a second pool left on the thread that loaded the model, libgomp throttles every worker's spinning
and each parallel region of a step sleeps and wakes a worker (those cases run in a fresh interpreter, so its OpenMP
state is its own). The serving threads go to SCHED_IDLE, and a lone stream still gets one response per token."""
import os
import subprocess
import sys
import textwrap

import pytest

from test_engine_loop import SlowSink
from trellm_backend.engine.loop import EngineLoop
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams
from trellm_backend.tools.testbed import wait_until

# A thread (the stepping thread's place) runs 300 parallel regions back to back; the process's context switches
# meanwhile count how often a worker slept between them. All cores are used, so the loading thread's pool plus the
# stepping thread's exceed the cores on any machine.
SCRIPT = textwrap.dedent("""
    import os, resource, sys, threading
    import torch
    from trellm_backend.engine.cores import release_thread_pool
    torch.set_num_threads(os.cpu_count())
    x = torch.randn(1 << 18)
    for _ in range(20):
        x.mul(1.0001)                      # the loading thread's own parallel work: its pool now exists
    released = release_thread_pool() if sys.argv[1] == "release" else False
    switches = []
    def step():
        for _ in range(20):
            x.mul(1.0001)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(300):
            x.mul(1.0001)
        switches.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
    t = threading.Thread(target=step)
    t.start()
    t.join()
    print(released, switches[0])
""")


def run_case(mode: str) -> tuple[bool, int]:
    env = {**os.environ, "GOMP_SPINCOUNT": "10000"}    # the launcher's default (tools/launch.py)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, switches = out.stdout.split()
    return released == "True", int(switches)


@pytest.mark.skipif(os.cpu_count() < 2, reason="one core: no worker threads at all")
def test_released_pool_lets_the_stepping_thread_spin():
    kept_released, kept = run_case("keep")
    assert not kept_released
    # Throttled: a worker sleeps between nearly every two regions. Released: workers spin across them, and only
    # another process taking the cores makes them sleep, so the quietest of three runs is the one that counts.
    assert kept > 150, f"the premise failed: only {kept} context switches in 300 regions with two pools"
    runs = []
    for _ in range(3):
        released, after = run_case("release")
        assert released, "libgomp's omp_pause_resource_all was not found"
        runs.append(after)
        if after < 60:
            break
    assert min(runs) < 60, f"{runs} context switches in 300 regions after the loading thread's pool was released"


@pytest.mark.parametrize("setting", ["idle", "normal"])
def test_loop_helpers_yield_the_cores_to_the_stepping_thread(default_model_path, setting):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20,
                                    cpu_serving_threads=setting))
    loop = EngineLoop(engine)
    try:
        policy = os.sched_getscheduler
        helpers = os.SCHED_IDLE if setting == "idle" else os.SCHED_OTHER
        assert policy(loop._responder.native_id) == helpers
        assert policy(loop._watcher.native_id) == helpers
        assert policy(loop._thread.native_id) == os.SCHED_OTHER, "the stepping thread must keep its class"
        assert policy(0) == os.SCHED_OTHER, "the thread that made the loop must keep its class"
    finally:
        loop.stop()


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="cpu_serving_threads='low' is not one of idle, normal"):
        EngineConfig(model_path="unused", cpu_serving_threads="low")


def test_yield_process_lowers_every_thread_of_a_process():
    from trellm_backend.engine.cores import yield_process
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]\n"
                              "time.sleep(30)"])
    try:
        wait_until(lambda: len(os.listdir(f"/proc/{child.pid}/task")) >= 4, 10, "the child's four threads")
        assert yield_process(child.pid) == 4
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{child.pid}/task")} == {os.SCHED_IDLE}
    finally:
        child.kill()
        child.wait()


class IpcSink(SlowSink):
    """A sink whose send blocks like an IPC round trip through tritonserver (2 ms)."""
    delay = 0.002


def test_a_lone_stream_gets_every_token_in_its_own_response(default_model_path):
    """With idle-class helpers a step's responses wait for the compute's gaps and merge; a stream alone (at most
    LATENCY_STREAMS) must still see each token as it is made, so the stepping thread waits for its delivery."""
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20))
    loop = EngineLoop(engine)
    try:
        sink = IpcSink()
        params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
        loop.submit([engine.make_request("lone", [1, 2, 3, 4], params)], [sink])
        assert sink.done.wait(60)
        assert [len(o.new_token_ids) for o in sink.outputs] == [1] * 24
    finally:
        loop.stop()
