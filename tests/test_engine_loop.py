"""The engine loop without Triton: cancellation seen through a sink, aborts by client id, and the bounded queue."""
from __future__ import annotations

import threading
import time

import pytest

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.loop import DuplicateClientId, EngineLoop, QueueFull
from trellm_backend.engine.request import SamplingParams
from trellm_backend.tools.testbed import wait_until
from trellm_backend.triton.tokenization import load_tokenizer

LONG = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)


class Sink:
    def __init__(self):
        self.outputs, self.errors = [], []
        self.cancelled = False
        self.done = threading.Event()

    def send(self, output):
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, message):
        self.errors.append(message)
        self.done.set()

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture
def loop(default_model_path):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20, max_num_seqs=1,
                                    max_queue_size=2))
    loop = EngineLoop(engine)
    yield loop
    loop.stop()


def submit(loop, rid, client_id=None, n=1):
    """Submit one client request of `n` engine requests (ids rid, rid.1, ...); returns the sink, or the n sinks."""
    sinks = [Sink() for _ in range(n)]
    loop.submit([loop.engine.make_request(rid if i == 0 else f"{rid}.{i}", [1, 50, 60, 70], LONG) for i in range(n)],
                sinks, client_id=client_id)
    return sinks[0] if n == 1 else sinks


def test_cancelled_sink_is_aborted_and_frees_blocks(loop):
    sink = submit(loop, "a")
    wait_until(lambda: len(sink.outputs) >= 3)
    assert loop.engine.kv_blocks_used() > 0
    sink.cancelled = True
    assert sink.done.wait(5), "a cancelled request was not aborted"
    assert sink.outputs[-1].finish_reason == "abort"
    wait_until(lambda: loop.engine.kv_blocks_used() == 0, timeout=5)


class CountingSink(Sink):
    def __init__(self):
        super().__init__()
        self.asks = 0

    def is_cancelled(self):
        self.asks += 1
        return self.cancelled


def test_cancellation_asks_stay_bounded_however_many_requests_wait(default_model_path):
    """Each is_cancelled() is an IPC round trip through tritonserver; asking each of 100 requests every 50 ms would
    be 2,000 a second. The watcher spreads its sweep instead, and still sees a cancel."""
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20, max_num_seqs=2,
                                    max_queue_size=200))
    loop = EngineLoop(engine)
    try:
        sinks = [CountingSink() for _ in range(100)]
        loop.submit([engine.make_request(f"r{i}", [1, 50, 60, 70], LONG) for i in range(100)], sinks)
        wait_until(lambda: all(s.asks for s in sinks))
        before = sum(s.asks for s in sinks)
        time.sleep(2.0)
        asks = sum(s.asks for s in sinks) - before
        assert asks <= 2.0 * 200 + len(sinks), asks      # 200 a second, and one sweep of slack
        sinks[-1].cancelled = True
        assert sinks[-1].done.wait(5) and sinks[-1].outputs[-1].finish_reason == "abort"
    finally:
        loop.stop()


def test_abort_by_client_id_and_bounded_queue(loop):
    running = submit(loop, "r", client_id="job-1")
    wait_until(lambda: len(running.outputs) >= 1)
    waiting = submit(loop, "w", client_id="job-2", n=2)      # two samples of one client request
    with pytest.raises(QueueFull, match=r"max_queue_size=2"):
        submit(loop, "too-many")
    loop.abort_client_id("job-2")                      # both waiting requests share this client id
    for s in waiting:
        assert s.done.wait(5) and s.outputs[-1].finish_reason == "abort"
    loop.abort_client_id("job-1")
    assert running.done.wait(5) and running.outputs[-1].finish_reason == "abort"
    wait_until(lambda: loop.engine.kv_blocks_used() == 0 and loop.num_waiting() == 0, timeout=5)
    accepted = submit(loop, "after")                    # room again once the queue drained
    wait_until(lambda: len(accepted.outputs) >= 1)


def test_a_request_id_in_flight_is_refused_until_it_finishes(loop):
    """A stop request names a request id, so two running requests may not share one; the id is free again once
    every sample under it is over (here: aborted)."""
    first = submit(loop, "x", client_id="job", n=2)     # one sample runs, the other waits (max_num_seqs 1)
    wait_until(lambda: len(first[0].outputs) >= 1)
    with pytest.raises(DuplicateClientId, match="'job' is already in flight"):
        submit(loop, "y", client_id="job")
    loop.abort_client_id("job")
    assert all(s.done.wait(5) for s in first)
    wait_until(lambda: loop.engine.kv_blocks_used() == 0, timeout=5)
    again = submit(loop, "z", client_id="job")
    wait_until(lambda: len(again.outputs) >= 1)
    anonymous = [submit(loop, f"anon{i}") for i in range(2)]     # no request id: never refused
    loop.abort_client_id("job")
    wait_until(lambda: len(anonymous[0].outputs) >= 1)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(loop, monkeypatch):
    """An exception in a step (or in taking a request in) ends the requests in flight with a named error, frees
    their blocks, and the loop thread keeps serving: it can never die silently with requests hanging."""
    real_step, real_add = loop.engine.step, loop.engine.add
    broken = {"step": True, "add": True}

    def step():
        if broken["step"]:
            broken["step"] = False
            raise RuntimeError("simulated kernel failure")
        return real_step()

    def add(request):
        if broken["add"]:
            broken["add"] = False
            raise KeyError("simulated bookkeeping bug")
        return real_add(request)

    monkeypatch.setattr(loop.engine, "add", add)
    first = submit(loop, "bad-add")
    assert first.done.wait(5) and "KeyError" in first.errors[0]
    monkeypatch.setattr(loop.engine, "step", step)
    second = submit(loop, "bad-step")
    assert second.done.wait(5) and "simulated kernel failure" in second.errors[0]
    wait_until(lambda: loop.engine.kv_blocks_used() == 0, timeout=5)
    healthy = submit(loop, "after")
    wait_until(lambda: len(healthy.outputs) >= 2)


def test_shut_down_refuses_new_requests_and_ends_those_in_flight_after_the_grace(loop):
    running, waiting = submit(loop, "a"), submit(loop, "b")       # max_num_seqs 1: b waits
    wait_until(lambda: len(running.outputs) > 2)
    loop.shut_down(0.3, reason="tritonserver is stopping")
    with pytest.raises(QueueFull, match="tritonserver is stopping; retry"):
        submit(loop, "c")
    time.sleep(0.1)
    assert not running.done.is_set(), "requests in flight go on during the grace"
    assert running.done.wait(10) and waiting.done.wait(10)
    assert running.outputs[-1].finish_reason == waiting.outputs[-1].finish_reason == "abort"
    wait_until(lambda: loop.engine.kv.num_used == 0)


class SlowSink(Sink):
    """A client whose responses take `delay` seconds each: longer than a step, as a busy server's IPC does."""
    delay = 0.03

    def send(self, output):
        time.sleep(self.delay)
        super().send(output)


def test_a_responder_behind_the_steps_sends_each_request_one_merged_response_losing_nothing(default_model_path):
    tokenizer = load_tokenizer(default_model_path)
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20, max_num_seqs=4),
                       tokenizer=tokenizer)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[1, 50, 60, 70], [1, 80, 90], [1, 7, 8, 9, 10]]
    expected = engine.generate(prompts, params)
    loop = EngineLoop(engine)
    try:
        sinks = [SlowSink() for _ in prompts]
        loop.submit([engine.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)], sinks)
        for s in sinks:
            assert s.done.wait(60)
    finally:
        loop.stop()
    for sink, tokens in zip(sinks, expected):
        outs = sink.outputs
        assert len(outs) < len(tokens), "a responder slower than the steps must send fewer responses than tokens"
        assert [t for o in outs for t in o.new_token_ids] == tokens
        assert [len(o.logprobs) for o in outs] == [len(o.new_token_ids) for o in outs]
        assert [len(o.top_logprobs) for o in outs] == [len(o.new_token_ids) for o in outs]
        assert "".join(o.text for o in outs) == tokenizer.decode(tokens)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].num_output_tokens == len(tokens) and outs[-1].finish_reason == "length"


def test_a_guided_request_waits_for_its_grammar_while_others_run_and_times_out_by_name(default_model_path,
                                                                                        monkeypatch):
    """A guided request joins the engine only once its grammar is compiled; one whose compile does not finish in
    COMPILE_TIMEOUT_S fails with a named error, a stop request reaches one still compiling, and the others run."""
    from concurrent.futures import Future

    from trellm_backend.engine import loop as loop_module
    from trellm_backend.engine.structured_output import Guide
    monkeypatch.setattr(loop_module, "COMPILE_TIMEOUT_S", 0.5)
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20),
                       tokenizer=load_tokenizer(default_model_path))
    lp = EngineLoop(engine)
    try:
        stuck = engine.make_request("stuck", [1, 50, 60], SamplingParams(max_tokens=4, guide=Guide("regex", "a+")))
        stuck.grammar_future = Future()          # a compile that never ends
        held = engine.make_request("held", [1, 50, 60], SamplingParams(max_tokens=4, guide=Guide("regex", "b+")))
        held_future = held.grammar_future = Future()
        sinks = {name: Sink() for name in ("stuck", "held", "free", "guided")}
        lp.submit([stuck], [sinks["stuck"]])
        lp.submit([held], [sinks["held"]], client_id="client-held")
        lp.submit([engine.make_request("free", [1, 50, 60], SamplingParams(max_tokens=4))], [sinks["free"]])
        lp.submit([engine.make_request("guided", [1, 50, 60], SamplingParams(
            max_tokens=8, guide=Guide("choice", '["yes", "no"]')))], [sinks["guided"]])
        lp.abort_client_id("client-held")
        assert sinks["held"].done.wait(30)
        assert sinks["held"].errors == ["aborted while its grammar compiled"]
        for name in ("stuck", "free", "guided"):
            assert sinks[name].done.wait(30), name
        assert sinks["stuck"].errors == ["compiling the regex guide took longer than 0.5 s; send a smaller one"]
        assert sinks["free"].outputs[-1].finished and not sinks["free"].errors
        assert "".join(o.text for o in sinks["guided"].outputs) in ("yes", "no")
        held_future.set_result(engine.grammars.compile(Guide("regex", "b+")).result())   # its compile ends later
        time.sleep(0.2)
        assert sinks["held"].errors == ["aborted while its grammar compiled"] and not sinks["held"].outputs
        wait_until(lambda: engine.kv_blocks_used() == 0 and not engine.has_unfinished())
    finally:
        lp.stop()
