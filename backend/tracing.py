"""Request traces over OTLP, with opentelemetry's SDK: the front door's span and the engine's span of a request.

Tracing is on when the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT`) is set,
as vLLM's `--otlp-traces-endpoint` and tritonserver's `--trace-config opentelemetry,url=...` point at a collector.
Off, nothing here is imported or run. A trace's parts are joined by W3C trace context: the door passes its span as
`traceparent` to tritonserver, whose own spans (ensemble, steps) pass the llm step's span to the engine
(pb_utils' `request.trace().get_context()`), and the engine's span is made when its request ends, from the
timestamps the engine kept, on a thread of its own, so the stepping thread only queues.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("trellm")


def traces_endpoint(environ=os.environ) -> str | None:
    """The OTLP/HTTP URL traces are posted to, or None when tracing is off (no endpoint set, OTEL_SDK_DISABLED,
    or OTEL_TRACES_EXPORTER=none)."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or environ.get("OTEL_TRACES_EXPORTER") == "none":
        return None
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def make_tracer(service_name: str, environ=os.environ):
    """An opentelemetry Tracer exporting over OTLP/HTTP in batches, or None when tracing is off. `service_name`
    names this process in the trace (the resource's service.name)."""
    endpoint = traces_endpoint(environ)
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing: %s spans go to %s", service_name, endpoint)
    tracer = provider.get_tracer("trellm")
    tracer.trellm_provider = provider     # for shut_down
    return tracer


def shut_down(tracer) -> None:
    """Export what is still batched (a stopping process would lose it)."""
    provider = getattr(tracer, "trellm_provider", None)
    if provider is not None:
        provider.shutdown()


def server_span(tracer, method: str, path: str, headers):
    """A SERVER span ("METHOD path") around one HTTP request (a context manager: the current span inside), the child
    of the client's span when its headers carry a W3C `traceparent`."""
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    parent = TraceContextTextMapPropagator().extract(dict(headers))
    return tracer.start_as_current_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                        attributes={"http.request.method": method, "url.path": path})


def end_http_span(span, status: int) -> None:
    """The response's status on its span; 5xx marks the span failed (a 4xx is the client's)."""
    from opentelemetry.trace import Status, StatusCode
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))


def current_carrier(**attributes) -> dict[str, str]:
    """The W3C headers of the current span, to pass on to tritonserver (gRPC metadata, HTTP headers), after
    setting `attributes` on it."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    trace.get_current_span().set_attributes(attributes)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


def triton_carrier(request) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) of the span a pb_utils request belongs to, {} when untraced:
    tritonserver's span of it (`request.trace().get_context()`, a JSON object), else the `traceparent` request
    parameter a BLS caller set (tritonserver 2.51 drops the trace of a BLS request made after the caller's
    `execute` returned, as vllm_model's are)."""
    trace = request.trace()
    context = trace.get_context() if trace is not None else None
    for text in (context, request.parameters()):
        try:
            value = json.loads(text) if text else None
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("traceparent"), str):
            return {k: value[k] for k in ("traceparent", "tracestate") if isinstance(value.get(k), str)}
    return {}


@dataclass(frozen=True)
class RequestTrace:
    """What an engine request carries when it is traced: its parent span (W3C headers) and the attributes only its
    entry point knows (the served model's name, n, the client's request id)."""
    carrier: dict[str, str]
    attributes: dict = field(default_factory=dict)


def span_events(times, end_ns: int, finish_reason: str | None) -> list[tuple[str, int]]:
    """The engine's events of one request in time order: queued, scheduled, each preemption, first_token, then
    finished (or aborted)."""
    events = [("queued", times.arrival_ns)]
    if times.first_scheduled_ns:
        events.append(("scheduled", times.first_scheduled_ns))
    events += [("preempted", t) for t in times.preempted_ns]
    if times.first_token_ns:
        events.append(("first_token", times.first_token_ns))
    events.sort(key=lambda e: e[1])
    events.append(("aborted" if finish_reason in (None, "abort") else "finished", end_ns))
    return events


def span_attributes(request, out, error: str | None) -> dict:
    """The engine span's attributes, with vLLM's names (gen_ai.*) where vLLM has one."""
    p, t = request.params, request.times
    attributes = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.request.max_tokens": p.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k,
        "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": request.num_output_tokens,
        "trellm.num_preemptions": len(t.preempted_ns),
        "trellm.num_cached_tokens": request.num_cached_tokens,
        **request.trace.attributes,
    }
    if p.lora_name:
        attributes["trellm.lora_name"] = p.lora_name
    if p.guide is not None:
        attributes["trellm.guide"] = p.guide.type
    if out is not None and out.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (out.finish_reason,)
    if error is not None:
        attributes["trellm.error"] = error
    if t.first_scheduled_ns:
        attributes["gen_ai.latency.time_in_queue"] = (t.first_scheduled_ns - t.arrival_ns) / 1e9
    if t.first_token_ns:
        attributes["gen_ai.latency.time_to_first_token"] = (t.first_token_ns - t.arrival_ns) / 1e9
        attributes["gen_ai.latency.time_in_model_prefill"] = (t.first_token_ns - t.first_scheduled_ns) / 1e9
        attributes["gen_ai.latency.time_in_model_decode"] = (t.last_token_ns - t.first_token_ns) / 1e9
        attributes["gen_ai.latency.e2e"] = (t.last_token_ns - t.arrival_ns) / 1e9
    return attributes


class RequestTracer:
    """Makes the engine's span of each traced request once it ends. `ended` only queues; a thread of its own
    builds the spans and the SDK's batch processor exports them."""

    def __init__(self, tracer):
        self.tracer = tracer
        self._ended: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trellm-traces", daemon=True)
        self._thread.start()

    def ended(self, request, out=None, error: str | None = None) -> None:
        """`request` (with its `trace`) is over: finished or aborted with its last output `out`, or failed with
        `error`. Safe on the stepping thread."""
        self._ended.put((request, out, error, time.time_ns()))

    def stop(self) -> None:
        self._ended.put(None)
        self._thread.join(timeout=5)
        shut_down(self.tracer)

    def _run(self) -> None:
        while (item := self._ended.get()) is not None:
            try:
                self._span(*item)
            except Exception:   # a trace must never take serving down
                log.exception("making a request's span failed")

    def _span(self, request, out, error: str | None, now_ns: int) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        parent = TraceContextTextMapPropagator().extract(request.trace.carrier)
        t = request.times
        end_ns = t.last_token_ns if out is not None and out.finish_reason not in (None, "abort") and \
            t.last_token_ns else now_ns
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER, start_time=t.arrival_ns,
                                      attributes=span_attributes(request, out, error))
        for name, at in span_events(t, end_ns, None if error else (out.finish_reason if out else None)):
            span.add_event(name, timestamp=at)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)
