"""Runs an LLMEngine in a background thread, so a server thread can submit and abort while it steps.

Other threads only put commands in a queue; the loop thread alone touches the engine, and drains the queue
before every step, so a submit or an abort takes effect within one step. A watcher thread asks each request's
sink whether its client cancelled (in Triton an IPC round trip per request, so it stays off the stepping thread)
and queues an abort for those that did. Submissions beyond `max_queue_size` waiting requests are refused with
QueueFull (backpressure) instead of piling up. After each step the loop publishes the scheduler's stats snapshot,
and hands each finished output to an optional `on_finished` callback (a metrics reporter's queue), and each traced
request that ended to an optional tracer's queue (tracing.RequestTracer), so observers read what the loop thread
made rather than reaching into the engine.

On a CPU the loop follows engine/cores.py: the thread that built the engine hands its OpenMP workers back before
the loop starts, so the stepping thread owns the process's only pool, and (with `cpu_serving_threads` idle, the
default) the responder and the watcher run in SCHED_IDLE, taking a core only when the compute leaves one.

Outputs leave through a third thread, the responder: the stepping thread only queues (sink, output) pairs, so
building and sending responses (in Triton an IPC per response) overlaps the next forward pass instead of
delaying it. One responder keeps each request's responses in order; a send that fails aborts the request. When it
falls behind, it merges the outputs of one request that queued up meanwhile into one response (fewer IPCs exactly
when they are the bottleneck; a streaming client then sees several tokens in one response, as with speculation).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import Request, RequestOutput
from trellm_backend.engine.stats import SchedulerStats
from trellm_backend.engine.cores import name_os_thread, release_thread_pool, yield_threads

log = logging.getLogger("trellm")


class OutputSink(Protocol):
    """Where a request's outputs go (in Triton: a response sender)."""

    def send(self, output: RequestOutput) -> None: ...
    def fail(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_size`; the caller should answer UNAVAILABLE and the client retry."""


class ShuttingDown(QueueFull):
    """Refused because the server is stopping (UNAVAILABLE, as a full queue is)."""


class DuplicateClientId(ValueError):
    """A client request id that is already in flight: refused, so that a stop request naming it is unambiguous."""


# The loop's inbox messages.
@dataclass(frozen=True)
class Add:
    request: Request
    sink: OutputSink
    compiled: bool = False     # sent when its grammar was compiled (it may have been aborted meanwhile)


@dataclass(frozen=True)
class CompileTimeout:
    """A guided request whose grammar was still compiling COMPILE_TIMEOUT_S after it came."""
    add: Add


# How long a guided request may wait for its grammar (the compile goes on for the cache; the request fails by name).
COMPILE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AbortClient:
    client_id: str


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# The responder's messages: an output to send, or an error that ends a request.
@dataclass(frozen=True)
class Send:
    sink: OutputSink
    output: RequestOutput


@dataclass(frozen=True)
class Fail:
    sink: OutputSink
    message: str


@dataclass(frozen=True)
class Sent:
    """Set `event` once everything queued before this has been delivered."""
    event: threading.Event


class EngineLoop:
    # How often the watcher asks every running request whether its client cancelled. In Triton each ask is an IPC
    # round trip through tritonserver; every 5 ms with 48 streams took a visible share of served tokens/s on 2 cores
    # (perf/RESULTS.md, section "...: decode attention, fused layer steps, fused prefill attention"). At most
    # MAX_CANCEL_ASKS_PER_S asks a second in all: with many streams a sweep spreads out (48: every 0.24 s) instead
    # of costing ~1,000 IPCs a second, more than the responses the tokens themselves need on the anchor workload
    # (perf/RESULTS.md, "Cancellation asks are budgeted": served throughput higher in each of three sittings).
    CANCEL_POLL_S = 0.05
    MAX_CANCEL_ASKS_PER_S = 200
    # With idle-class helpers (cores.py) a step's responses wait for a gap in the compute, so a lone stream would
    # get its tokens a few at a time (gaps of several inter-token latencies: perf/RESULTS.md, "A lone stream"), and a
    # first token made in a long prefill step could wait for the next gap. The stepping thread therefore queues
    # the step's urgent outputs first (all of them when at most LATENCY_STREAMS streams got one, else the first
    # tokens of their requests) and waits, at most DELIVERY_WAIT_S, until the responder has sent those: a pause
    # of a few round trips in the steps where latency is at stake. The rest merge when the responder is behind.
    LATENCY_STREAMS = 4
    DELIVERY_WAIT_S = 0.005

    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None,
                 tracer=None):
        """`on_finished` is called on the loop thread with every finished output: it must only queue it. `tracer`
        (tracing.RequestTracer) gets every request that carries a trace once it ends."""
        self.engine = engine
        self.max_queue_size = engine.config.max_queue_size
        self._on_finished = on_finished
        self._tracer = tracer
        self._traced: dict[str, Request] = {}   # traced requests in the engine (loop thread only)
        self._stats = engine.stats()
        self._inbox: queue.Queue[Add | CompileTimeout | Abort | AbortClient | AbortAll | Stop] = queue.Queue()
        self._sinks: dict[str, OutputSink] = {}
        # A client's request id -> its engine requests not over yet, and back. Filled when submitted (so a
        # duplicate id is refused at once), emptied by the loop thread, hence the lock.
        self._client_ids: dict[str, set[str]] = {}
        self._client_id_of: dict[str, str] = {}
        self._clients_lock = threading.Lock()
        # Guided requests whose grammar is compiling (not in the inbox yet): request id -> the Add to make of it.
        self._compiling: dict[str, Add] = {}
        self._stopping = False
        self._closed: str | None = None     # why new requests are refused (shut_down)
        self._outbox: queue.SimpleQueue[Send | Fail | Sent | None] = queue.SimpleQueue()
        # Whether the serving side yields the cores to the compute (cores.py); the Triton adapter follows it.
        self.idle_helpers = engine.runner.device.type == "cpu" and engine.config.cpu_serving_threads == "idle"
        release_thread_pool()   # the engine was built on this thread: its OpenMP pool would throttle the stepping one
        self._responder = threading.Thread(target=self._respond, name="trellm-responses", daemon=True)
        self._responder.start()
        self._thread = threading.Thread(target=self._run, name="trellm-engine", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="trellm-cancel", daemon=True)
        self._watcher.start()
        if self.idle_helpers:
            yield_threads([self._responder, self._watcher])

    def num_waiting(self) -> int:
        """Requests not yet running: submitted but not drained, plus the scheduler's waiting queue as of the last
        step's snapshot (other threads never read the engine itself)."""
        return self._inbox.qsize() + self._stats.num_waiting

    def stats(self) -> SchedulerStats:
        """The latest snapshot of the scheduler, with requests still in the inbox counted as waiting."""
        return replace(self._stats, num_waiting=self.num_waiting())

    def submit(self, requests: list[Request], sinks: list[OutputSink], client_id: str | None = None) -> None:
        """Queue the engine requests of one client request (its n samples), built and validated by
        `engine.make_request`, each with its sink. `client_id` (Triton's request id) lets a later
        `abort_client_id` find them. Raises QueueFull when `max_queue_size` requests already wait, and
        DuplicateClientId when requests under `client_id` are still in flight."""
        if self._closed is not None:
            raise ShuttingDown(self._closed)
        waiting = self.num_waiting()
        if waiting >= self.max_queue_size:
            raise QueueFull(f"the server is at capacity: {waiting} requests are waiting (max_queue_size="
                            f"{self.max_queue_size}); retry later")
        client_id = client_id or None
        if client_id is not None:
            with self._clients_lock:
                if client_id in self._client_ids:
                    raise DuplicateClientId(f"request id {client_id!r} is already in flight; request ids of "
                                            "running requests must be unique (a stop request names one)")
                self._client_ids[client_id] = {r.request_id for r in requests}
                self._client_id_of.update((r.request_id, client_id) for r in requests)
        for request, sink in zip(requests, sinks):
            future = request.grammar_future
            if future is None or future.done():
                self._inbox.put(Add(request, sink))
            else:   # a guided request joins the engine once its grammar is compiled; the others go on meanwhile
                add = Add(request, sink, compiled=True)
                with self._clients_lock:
                    self._compiling[request.request_id] = add
                timer = threading.Timer(COMPILE_TIMEOUT_S, lambda add=add: self._inbox.put(CompileTimeout(add)))
                timer.daemon = True
                timer.start()
                future.add_done_callback(lambda _, add=add, timer=timer: (timer.cancel(), self._inbox.put(add)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def abort_client_id(self, client_id: str) -> None:
        """Abort every request submitted under `client_id` (a TRT-LLM-style stop request)."""
        self._inbox.put(AbortClient(client_id))

    def shut_down(self, grace_s: float, reason: str = "the server is shutting down") -> None:
        """Refuse new requests from now on (ShuttingDown), and after `grace_s` seconds abort whatever is still in
        flight, so every request gets its final response (finish_reason abort) while the server still delivers it.
        Returns at once."""
        if self._closed is not None:
            return
        self._closed = f"{reason}; retry on another replica or after the restart"
        log.warning("%s: refusing new requests, ending those in flight within %.1f s", reason, grace_s)
        timer = threading.Timer(grace_s, lambda: self._inbox.put(AbortAll()))
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """Abort everything in flight and end the threads."""
        self._stopping = True
        self._inbox.put(Stop())
        self._thread.join(timeout=30)
        self.engine.close()
        self._outbox.put(None)
        self._responder.join(timeout=10)
        self._watcher.join(timeout=5)

    def _take_outbox(self) -> list[Send | Fail | Sent | None]:
        """Everything queued for the responder, waiting for at least one message. Consecutive outputs of one
        request become one (RequestOutput.then): a responder that fell behind the steps then sends one response per
        request instead of one per step, so serving costs less exactly when it is the bottleneck."""
        msgs = [self._outbox.get()]
        while True:
            try:
                msgs.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        merged: list[Send | Fail | Sent | None] = []
        open_send: dict[int, int] = {}      # id(sink) -> index in `merged` of its latest Send, while mergeable
        for msg in msgs:
            if isinstance(msg, Send):
                at = open_send.get(id(msg.sink))
                if at is not None:
                    merged[at] = Send(msg.sink, merged[at].output.then(msg.output))
                    continue
                open_send[id(msg.sink)] = len(merged)
            elif isinstance(msg, Fail):
                open_send.pop(id(msg.sink), None)
            merged.append(msg)
        return merged

    def _respond(self) -> None:
        name_os_thread()
        while True:
            for msg in self._take_outbox():
                if msg is None:
                    return
                if isinstance(msg, Sent):
                    msg.event.set()
                else:
                    self._deliver(msg)

    def _deliver(self, msg: Send | Fail) -> None:
        try:
            if isinstance(msg, Fail):
                msg.sink.fail(msg.message)
            else:
                msg.sink.send(msg.output)
        except Exception:  # a client that went away must not stop the others
            if isinstance(msg, Send) and not msg.output.finished:
                log.exception("sending output of %s failed", msg.output.request_id)
                self.abort(msg.output.request_id)
            else:
                log.debug("last response of a request not delivered", exc_info=True)

    def _watch_cancellations(self) -> None:
        name_os_thread()
        while not self._stopping:
            start = time.perf_counter()
            sinks = list(self._sinks.items())
            for rid, sink in sinks:
                try:
                    cancelled = sink.is_cancelled()
                except Exception:   # a sender that is already closed
                    cancelled = False
                if cancelled:
                    self.abort(rid)
            # Idle at least as long as a sweep took, so polling never takes more than half of a core.
            time.sleep(max(self.CANCEL_POLL_S, len(sinks) / self.MAX_CANCEL_ASKS_PER_S, time.perf_counter() - start))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(msg, CompileTimeout):
                rid = msg.add.request.request_id
                with self._clients_lock:
                    waiting = self._compiling.pop(rid, None) is not None
                if waiting:
                    self._forget(rid)
                    guide = msg.add.request.params.guide
                    self._failed(msg.add, f"compiling the {guide.type} guide took longer than "
                                          f"{COMPILE_TIMEOUT_S:g} s; send a smaller one")
                continue
            if isinstance(msg, Add):
                rid = msg.request.request_id
                if msg.compiled:
                    with self._clients_lock:
                        if self._compiling.pop(rid, None) is None:
                            continue    # it timed out or was aborted meanwhile: already answered
                    if self._closed is not None:
                        self._forget(rid)
                        self._failed(msg, self._closed)
                        continue
                try:
                    self.engine.add(msg.request)
                except Exception as e:   # ValueError: the request's fault, named; anything else: ours
                    if not isinstance(e, ValueError):
                        log.exception("adding %s failed", msg.request.request_id)
                    self._forget(msg.request.request_id)
                    self._failed(msg, str(e) if isinstance(e, ValueError) else f"engine error: {type(e).__name__}: {e}")
                    continue
                self._sinks[msg.request.request_id] = msg.sink
                if msg.request.trace is not None and self._tracer is not None:
                    self._traced[msg.request.request_id] = msg.request
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            elif isinstance(msg, AbortAll):
                for rid in list(self._sinks):
                    self._abort(rid)
            elif isinstance(msg, AbortClient):
                with self._clients_lock:
                    rids = list(self._client_ids.get(msg.client_id, ()))
                for rid in rids:
                    self._abort(rid)

    def _finished(self, out: RequestOutput) -> None:
        if self._on_finished is not None:
            self._on_finished(out)
        self._end_trace(out.request_id, out=out)

    def _failed(self, add: Add, message: str) -> None:
        """Answer a request that never ran (or stopped running) with an error, and end its trace so."""
        self._outbox.put(Fail(add.sink, message))
        self._end_trace(add.request.request_id, error=message, request=add.request)

    def _end_trace(self, request_id: str, out: RequestOutput | None = None, error: str | None = None,
                   request: Request | None = None) -> None:
        """Hand a traced request that ended to the tracer: one in the engine by its id, else `request` (one that
        never reached the engine) when it carries a trace."""
        if self._tracer is None:
            return
        request = self._traced.pop(request_id, None) or request
        if request is not None and request.trace is not None:
            self._tracer.ended(request, out, error)

    def _forget(self, request_id: str) -> OutputSink | None:
        with self._clients_lock:
            client_id = self._client_id_of.pop(request_id, None)
            if client_id is not None:
                ids = self._client_ids[client_id]
                ids.discard(request_id)
                if not ids:    # every engine request under the id is over: it may be used again
                    del self._client_ids[client_id]
        return self._sinks.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        with self._clients_lock:
            compiling = self._compiling.pop(request_id, None)
        if compiling is not None:     # not in the engine yet: it ends now, its compile goes on for the cache
            self._forget(request_id)
            self._failed(compiling, "aborted while its grammar compiled")
            return
        out = self.engine.abort(request_id)
        if out is not None:
            self._finished(out)
        sink = self._forget(request_id)
        if out is not None and sink is not None:
            self._outbox.put(Send(sink, out))

    def _iterate(self) -> None:
        """Take in commands, run one step, queue its outputs."""
        self._drain(block=not self.engine.has_unfinished())
        self._stats = self.engine.stats()
        if self._stopping or not self.engine.has_unfinished():
            return
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        sends = []
        for out in outputs:
            if not out.new_token_ids and not out.finished:
                continue    # its tokens wait for their text (half a character, a possible stop string)
            if out.finished:
                self._finished(out)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                self._forget(out.request_id)
            sends.append(Send(sink, out))
        urgent, rest = [], sends
        if self.idle_helpers:   # what a client waits on: every output of a few streams, else first tokens
            few = len(sends) <= self.LATENCY_STREAMS
            flags = [few or m.output.num_output_tokens == len(m.output.new_token_ids) for m in sends]
            urgent = [m for m, f in zip(sends, flags) if f]
            rest = [m for m, f in zip(sends, flags) if not f]
        sent = Sent(threading.Event()) if urgent else None
        for msg in urgent + ([sent] if sent else []) + rest:
            self._outbox.put(msg)
        if sent is not None:
            sent.event.wait(self.DELIVERY_WAIT_S)

    def _fail_all(self, message: str) -> None:
        """End every request in flight with an error, freeing its blocks as far as the engine still can."""
        for rid in list(self._sinks):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            self._end_trace(rid, error=message)
            self._outbox.put(Fail(self._forget(rid), message))

    def _run(self) -> None:
        name_os_thread()
        while not self._stopping:
            try:
                self._iterate()
            except Exception as e:  # nothing may end this thread: fail what is in flight and go on
                log.exception("engine loop iteration failed")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
        for rid in list(self._sinks):
            self._abort(rid)
