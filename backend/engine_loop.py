"""Runs an LLMEngine in a background thread, so a server thread can submit and abort while it steps.

Other threads only put commands in a queue; the loop thread alone touches the engine, and drains the queue
before every step, so a submit or an abort takes effect within one step.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from trellm_backend.engine import LLMEngine
from trellm_backend.request import Request, RequestOutput

log = logging.getLogger("trellm")


class OutputSink(Protocol):
    """Where a request's outputs go (in Triton: a response sender)."""

    def send(self, output: RequestOutput) -> None: ...
    def fail(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, OutputSink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="trellm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sink: OutputSink) -> None:
        """Queue a request built (and validated) by `engine.make_request`."""
        self._inbox.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stop(self) -> None:
        """Abort everything in flight and end the thread."""
        self._stopping = True
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=30)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd, arg, sink = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if cmd == "add":
                try:
                    self.engine.add(arg)
                    self._sinks[arg.request_id] = sink
                except ValueError as e:
                    sink.fail(str(e))
            elif cmd == "abort":
                self._abort(arg)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if out is not None and sink is not None:
            sink.send(out)

    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping:
                break
            for rid in [rid for rid, s in self._sinks.items() if s.is_cancelled()]:
                self._abort(rid)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step must not take the server down: fail the requests in it
                log.exception("engine step failed")
                for rid in list(self._sinks):
                    self.engine.abort(rid)
                    self._sinks.pop(rid).fail(f"engine error: {e}")
                continue
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                try:
                    sink.send(out)
                except Exception:  # a client that went away must not stop the others
                    log.exception("sending output of %s failed", out.request_id)
                    self._abort(out.request_id)
        for rid in list(self._sinks):
            self._abort(rid)
