"""An OTLP/HTTP trace receiver on loopback for the tracing tests and perf/trace_overhead.py: it decodes what
exporters post to /v1/traces (protobuf from opentelemetry's SDK, JSON from tritonserver's otel-cpp) into plain
Span records."""
from __future__ import annotations

import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return None if kind is None else getattr(v, kind)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str          # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, int]] = field(default_factory=list)   # (name, time_ns) in the order sent
    status_code: int = 0    # 0 unset, 1 ok, 2 error


class OtlpReceiver:
    def __init__(self, decode_json: bool = True):
        """`decode_json` false: tritonserver's (JSON) posts are acknowledged unread, so that a benchmark sharing
        the host with the server does not pay for a collector's parsing (perf/trace_overhead.py)."""
        self.spans: list[Span] = []
        self.json_posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.headers.get("Content-Type", "").startswith("application/json"):
                    receiver.json_posts += 1
                    if decode_json:
                        receiver._take_json(json.loads(body))      # tritonserver's exporter sends OTLP/JSON
                else:
                    receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The base endpoint (OTEL_EXPORTER_OTLP_ENDPOINT's form); traces go to its /v1/traces."""
        return f"http://127.0.0.1:{self.port}"

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Span(
                        str(resource.get("service.name", "")), s.name, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        [(e.name, e.time_unix_nano) for e in s.events], s.status.code))
        with self._lock:
            self.spans.extend(spans)

    def _take_json(self, request: dict) -> None:
        """OTLP/JSON: ids in hex, integers as strings, values as {"stringValue": ...}."""
        def attributes(items):
            return {a["key"]: next(iter(a.get("value", {}).values()), None) for a in items or ()}
        spans = []
        for rs in request.get("resourceSpans", ()):
            service = attributes(rs.get("resource", {}).get("attributes")).get("service.name", "")
            for ss in rs.get("scopeSpans", ()):
                for s in ss.get("spans", ()):
                    spans.append(Span(
                        str(service), s["name"], s["traceId"].lower(), s["spanId"].lower(),
                        s.get("parentSpanId", "").lower(), int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]),
                        attributes(s.get("attributes")),
                        [(e["name"], int(e["timeUnixNano"])) for e in s.get("events", ())],
                        {"STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}.get(s.get("status", {}).get("code"), 0)))
        with self._lock:
            self.spans.extend(spans)

    def wait_for(self, predicate, timeout: float = 30.0) -> list[Span]:
        """The spans received so far, once `predicate(spans)` holds (AssertionError naming them if it never does)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans received in {timeout:g} s: "
                                     f"{[(s.service, s.name, s.trace_id[:8]) for s in spans]}")
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
