"""Request traces: the engine's span of each request (events, attributes, parent) from the engine loop, and one
connected trace per request through a real tritonserver and the front door, received by an OTLP receiver on
loopback."""
from __future__ import annotations

import json
import os
import threading
import urllib.request

import pytest

from test_engine_loop import Sink
from trellm_backend.tools.otlp_receiver import OtlpReceiver
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.loop import EngineLoop
from trellm_backend.engine.request import SamplingParams
from trellm_backend.tools.testbed import free_ports, wait_until
from trellm_backend.tracing import RequestTrace, RequestTracer, span_events, traces_endpoint

PARENT_TRACE, PARENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
ENGINE_EVENTS = ("queued", "scheduled", "first_token")


def test_the_endpoint_comes_from_the_standard_settings():
    assert traces_endpoint({}) is None
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}) == "http://t:1/x"
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x", "OTEL_SDK_DISABLED": "true"}) is None
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x", "OTEL_TRACES_EXPORTER": "none"}) \
        is None


@pytest.fixture
def traced_loop(default_model_path):
    """An engine loop whose tracer exports to memory, with a KV cache too small for three long requests at once
    (14 blocks of 16 tokens), so some are preempted."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"))
    engine = LLMEngine(EngineConfig(model_path=default_model_path, num_kv_blocks=14, block_size=16,
                                    max_num_batched_tokens=64, enable_prefix_caching=False))
    loop = EngineLoop(engine, tracer=tracer)
    yield loop, exporter
    loop.stop()
    tracer.stop()


def test_each_traced_request_gets_one_engine_span_with_its_events_in_order(traced_loop):
    loop, exporter = traced_loop
    carrier = {"traceparent": TRACEPARENT}
    params = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    reqs = [loop.engine.make_request(f"r{i}", [1 + i, 50, 60, 70, 80, 90, 100, 110] * 2, params) for i in range(3)]
    for r in reqs:
        r.trace = RequestTrace(carrier, {"gen_ai.response.model": "llm"})
    untraced = loop.engine.make_request("plain", [1, 2, 3], SamplingParams(max_tokens=4))
    sinks = [Sink() for _ in range(4)]
    loop.submit(reqs + [untraced], sinks)
    assert all(s.done.wait(120) for s in sinks)
    wait_until(lambda: len(exporter.get_finished_spans()) == 3, timeout=10, what="three engine spans")
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"r0", "r1", "r2"}, "the untraced request made a span, or a traced one made none"
    assert sum(s.attributes["trellm.num_preemptions"] for s in spans.values()) > 0, "no preemption: the test is moot"
    for rid, span in spans.items():
        assert span.name == "llm_request"
        assert format(span.context.trace_id, "032x") == PARENT_TRACE
        assert format(span.parent.span_id, "016x") == PARENT_SPAN
        names = [e.name for e in span.events]
        times = [e.timestamp for e in span.events]
        assert names[0] == "queued" and names[-1] == "finished"
        assert [n for n in names if n in ENGINE_EVENTS] == list(ENGINE_EVENTS)
        assert names.count("preempted") == span.attributes["trellm.num_preemptions"]
        assert times == sorted(times) and span.start_time == times[0] and span.end_time == times[-1]
        a = span.attributes
        assert a["gen_ai.usage.prompt_tokens"] == 16 and a["gen_ai.usage.completion_tokens"] == 90
        assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.response.model"] == "llm"
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
            <= a["gen_ai.latency.e2e"]


def test_an_aborted_request_and_a_failed_one_end_their_spans_so(traced_loop, monkeypatch):
    loop, exporter = traced_loop
    carrier = {"traceparent": TRACEPARENT}
    long = loop.engine.make_request("long", [1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True))
    long.trace = RequestTrace(carrier)
    sink = Sink()
    loop.submit([long], [sink])
    wait_until(lambda: loop.engine.kv_blocks_used() > 0, what="the long request running")
    loop.abort("long")
    assert sink.done.wait(30)

    def refuse(request):
        raise ValueError("refused by the test")
    monkeypatch.setattr(loop.engine, "add", refuse)
    bad = loop.engine.make_request("bad", [1, 2, 3], SamplingParams(max_tokens=4))
    bad.trace = RequestTrace(carrier)
    bad_sink = Sink()
    loop.submit([bad], [bad_sink])
    assert bad_sink.done.wait(30) and bad_sink.errors == ["refused by the test"]
    wait_until(lambda: len(exporter.get_finished_spans()) == 2, timeout=10, what="two engine spans")
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert [e.name for e in spans["long"].events][-1] == "aborted"
    assert spans["long"].attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert spans["bad"].status.status_code.name == "ERROR"
    assert spans["bad"].attributes["trellm.error"] == "refused by the test"
    assert [e.name for e in spans["bad"].events] == ["queued", "aborted"]


def test_span_events_put_preemptions_between_scheduling_and_the_first_token_by_time():
    from trellm_backend.engine.request import RequestTimes
    t = RequestTimes(arrival_ns=10, first_scheduled_ns=20, first_token_ns=50, last_token_ns=90,
                     preempted_ns=[30, 60])
    assert span_events(t, 90, "stop") == [("queued", 10), ("scheduled", 20), ("preempted", 30),
                                         ("first_token", 50), ("preempted", 60), ("finished", 90)]


# Through a real tritonserver and its front door.

@pytest.fixture(scope="module")
def traced_server(default_model_path, tmp_path_factory):
    """A tritonserver and its front door tracing to an OTLP receiver on loopback (exported every 0.2 s)."""
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    from trellm_backend.tools.testbed import private_repository
    root = tmp_path_factory.mktemp("traced")
    repo = private_repository(os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_repository"),
                              str(root / "repo"))
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    try:
        with OtlpReceiver() as receiver:
            server = TritonServer(repo, *free_ports(3), log_path=str(root / "server.log"),
                                  otlp_traces_endpoint=receiver.endpoint + "/v1/traces").start()
            door_port = free_ports(1)[0]
            door = start_front_door(server, door_port, None)
            try:
                yield server, f"http://127.0.0.1:{door_port}", receiver
            finally:
                stop_front_door(door)
                server.stop()
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]


def trace_of(receiver: OtlpReceiver, trace_id: str, services: set[str]):
    """The spans of one trace once every service in `services` has sent its part, and the engine's span."""
    spans = receiver.wait_for(lambda spans: services <= {s.service for s in spans if s.trace_id == trace_id}
                              and any(s.name == "llm_request" and s.trace_id == trace_id for s in spans))
    return [s for s in spans if s.trace_id == trace_id]


def assert_connected(spans, root_parent: str) -> None:
    """Every span's parent is in the trace, but the one root's, which is the client's span."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    assert [r.parent_id for r in roots] == [root_parent], \
        f"not one connected trace: roots {[(r.service, r.name, r.parent_id) for r in roots]}"


def assert_engine_span_under_llm(spans, step: str = "llm") -> None:
    """The engine's span hangs under tritonserver's span of `step`, with its events in order."""
    by_id = {s.span_id: s for s in spans}
    (engine,) = [s for s in spans if s.name == "llm_request"]
    assert engine.service == "trellm-engine"
    parent = by_id[engine.parent_id]
    assert parent.service == "tritonserver" and parent.name == step, (parent.service, parent.name)
    names = [n for n, _ in engine.events]
    assert names[0] == "queued" and names[-1] == "finished"
    assert [n for n in names if n in ENGINE_EVENTS] == list(ENGINE_EVENTS)
    assert [t for _, t in engine.events] == sorted(t for _, t in engine.events)


def stream_with_traceparent(server, model: str, inputs: list, traceparent: str) -> None:
    """One gRPC stream request to `model` with a W3C traceparent in its metadata, read to its final response."""
    import tritonclient.grpc as grpcclient
    done = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: done.set() if result is None or
                        result.get_response().parameters["triton_final_response"].bool_param else None,
                        headers={"traceparent": traceparent})
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    assert done.wait(60)
    client.stop_stream()


def post_with_traceparent(url: str, body: dict, traceparent: str) -> bytes:
    """One JSON POST with a W3C traceparent header; the whole answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "traceparent": traceparent})
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.read()


def test_a_grpc_ensemble_request_is_one_trace_under_the_clients_span(traced_server):
    import tritonclient.grpc as grpcclient
    from trellm_client.client import build_inputs
    server, _, receiver = traced_server
    trace_id, parent = "1" * 32, "2" * 16
    stream_with_traceparent(server, "ensemble", build_inputs(grpcclient, "Hello there", {"max_tokens": 4}),
                            f"00-{trace_id}-{parent}-01")
    spans = trace_of(receiver, trace_id, {"tritonserver", "trellm-engine"})
    assert_connected(spans, parent)
    assert {"ensemble", "preprocess", "llm", "postprocess"} <= {s.name for s in spans}
    assert_engine_span_under_llm(spans)


def test_a_streamed_openai_request_is_one_trace_from_the_door_to_the_engine(traced_server):
    _, door, receiver = traced_server
    trace_id, parent = "3" * 32, "4" * 16
    body = {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    answer = post_with_traceparent(door + "/v1/chat/completions", body, f"00-{trace_id}-{parent}-01")
    assert answer.endswith(b"data: [DONE]\n\n")
    spans = trace_of(receiver, trace_id, {"trellm-openai", "tritonserver", "trellm-engine"})
    assert_connected(spans, parent)
    (door_span,) = [s for s in spans if s.service == "trellm-openai"]
    assert door_span.parent_id == parent and door_span.name == "POST /v1/chat/completions"
    assert door_span.attributes["http.response.status_code"] == 200
    assert door_span.attributes["gen_ai.request.model"] == "ensemble"
    assert_engine_span_under_llm(spans)


def test_a_relayed_http_generate_stream_honours_the_clients_traceparent(traced_server):
    _, door, receiver = traced_server
    trace_id, parent = "5" * 32, "6" * 16
    answer = post_with_traceparent(door + "/v2/models/ensemble/generate_stream",
                                   {"text_input": "Hello", "max_tokens": 4}, f"00-{trace_id}-{parent}-01")
    assert b"text_output" in answer
    spans = trace_of(receiver, trace_id, {"tritonserver", "trellm-engine"})
    assert_connected(spans, parent)
    assert_engine_span_under_llm(spans)


def test_a_vllm_model_request_is_one_trace_through_its_bls_call_to_llm(traced_server):
    import tritonclient.grpc as grpcclient
    from trellm_client.client import vllm_inputs
    server, _, receiver = traced_server
    trace_id, parent = "7" * 32, "8" * 16
    stream_with_traceparent(server, "vllm_model", vllm_inputs(grpcclient, "Hello there", {"max_tokens": 4}),
                            f"00-{trace_id}-{parent}-01")
    spans = trace_of(receiver, trace_id, {"tritonserver", "trellm-engine"})
    assert_connected(spans, parent)
    # tritonserver 2.51 does not trace a BLS request made after execute returned: vllm_model passes its span on
    assert_engine_span_under_llm(spans, "vllm_model")


def test_the_engine_follows_tritonservers_sampling(traced_server):
    """With tritonserver's tracing switched off at run time (its trace API), a request leaves no span anywhere:
    the engine traces exactly the requests tritonserver traces."""
    import tritonclient.http as httpclient
    server, _, receiver = traced_server
    admin = httpclient.InferenceServerClient(server.http_url)
    admin.update_trace_settings(settings={"trace_level": ["OFF"]})
    try:
        from trellm_client.client import LLMClient
        with LLMClient(server.grpc_url) as client:
            client.generate("Hello there", max_tokens=3, ignore_eos=True)     # untraced: 3 tokens
            admin.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
            client.generate("Hello again", max_tokens=5, ignore_eos=True)     # traced: 5 tokens
        # once the traced one's engine span is in, the untraced one (answered before it) would be too
        spans = receiver.wait_for(lambda spans: any(
            s.name == "llm_request" and s.attributes["gen_ai.usage.completion_tokens"] == 5 for s in spans))
        assert not [s for s in spans if s.name == "llm_request" and s.attributes["gen_ai.usage.completion_tokens"] == 3]
    finally:
        admin.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
