"""Runs an LLMEngine in a background thread, so a server thread can submit and abort while it steps.

Other threads only put commands in a queue; the loop thread alone touches the engine, and drains the queue
before every step, so a submit or an abort takes effect within one step. A watcher thread asks each request's
sink whether its client cancelled (in Triton an IPC round trip per request, so it stays off the stepping thread)
and queues an abort for those that did. Submissions beyond `max_queue_size` waiting requests are refused with
QueueFull (backpressure) instead of piling up.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import Request, RequestOutput

log = logging.getLogger("trellm")


class OutputSink(Protocol):
    """Where a request's outputs go (in Triton: a response sender)."""

    def send(self, output: RequestOutput) -> None: ...
    def fail(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_size`; the caller should answer UNAVAILABLE and the client retry."""


class EngineLoop:
    CANCEL_POLL_S = 0.005

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.max_queue_size = engine.config.max_queue_size
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, OutputSink] = {}
        self._client_ids: dict[str, set[str]] = {}    # a client's request id -> engine request ids (loop thread)
        self._client_id_of: dict[str, str] = {}
        self.finished: queue.Queue | None = None      # set by a metrics reporter: every finished output goes there
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="trellm-engine", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="trellm-cancel", daemon=True)
        self._watcher.start()

    def num_waiting(self) -> int:
        """Requests not yet running: submitted but not drained, plus the scheduler's waiting queue."""
        return self._inbox.qsize() + len(self.engine.scheduler.waiting)

    def submit(self, request: Request, sink: OutputSink, client_id: str | None = None) -> None:
        """Queue a request built (and validated) by `engine.make_request`. `client_id` (Triton's request id) lets
        a later `abort_client_id` find it. Raises QueueFull when `max_queue_size` requests already wait."""
        waiting = self.num_waiting()
        if waiting >= self.max_queue_size:
            raise QueueFull(f"the server is at capacity: {waiting} requests are waiting (max_queue_size="
                            f"{self.max_queue_size}); retry later")
        self._inbox.put(("add", request, (sink, client_id or None)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def abort_client_id(self, client_id: str) -> None:
        """Abort every request submitted under `client_id` (a TRT-LLM-style stop request)."""
        self._inbox.put(("abort_client", client_id, None))

    def stop(self) -> None:
        """Abort everything in flight and end the threads."""
        self._stopping = True
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=30)
        self._watcher.join(timeout=5)

    def _watch_cancellations(self) -> None:
        while not self._stopping:
            start = time.perf_counter()
            for rid, sink in list(self._sinks.items()):
                try:
                    cancelled = sink.is_cancelled()
                except Exception:   # a sender that is already closed
                    cancelled = False
                if cancelled:
                    self.abort(rid)
            # Idle at least as long as a sweep took, so polling never takes more than half of a core.
            time.sleep(max(self.CANCEL_POLL_S, time.perf_counter() - start))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd, arg, sink = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if cmd == "add":
                sink, client_id = sink
                try:
                    self.engine.add(arg)
                except ValueError as e:
                    sink.fail(str(e))
                    continue
                self._sinks[arg.request_id] = sink
                if client_id is not None:
                    self._client_ids.setdefault(client_id, set()).add(arg.request_id)
                    self._client_id_of[arg.request_id] = client_id
            elif cmd == "abort":
                self._abort(arg)
            elif cmd == "abort_client":
                for rid in list(self._client_ids.get(arg, ())):
                    self._abort(rid)

    def _forget(self, request_id: str) -> OutputSink | None:
        client_id = self._client_id_of.pop(request_id, None)
        if client_id is not None:
            ids = self._client_ids[client_id]
            ids.discard(request_id)
            if not ids:
                del self._client_ids[client_id]
        return self._sinks.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None and self.finished is not None:
            self.finished.put(out)
        sink = self._forget(request_id)
        if out is not None and sink is not None:
            try:
                sink.send(out)
            except Exception:  # the client is gone: nothing to tell it
                log.debug("final response of aborted %s not delivered", request_id)

    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping:
                break
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step must not take the server down: fail the requests in it
                log.exception("engine step failed")
                for rid in list(self._sinks):
                    self.engine.abort(rid)
                    self._forget(rid).fail(f"engine error: {e}")
                continue
            for out in outputs:
                if out.finished and self.finished is not None:
                    self.finished.put(out)
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    self._forget(out.request_id)
                try:
                    sink.send(out)
                except Exception:  # a client that went away must not stop the others
                    log.exception("sending output of %s failed", out.request_id)
                    self._abort(out.request_id)
        for rid in list(self._sinks):
            self._abort(rid)
