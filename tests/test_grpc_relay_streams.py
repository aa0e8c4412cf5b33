"""How the front door's gRPC relay (openai_api/grpc_relay.py) ends an upstream stream whose client left, against an
in-process stand-in for tritonserver's ModelStreamInfer that records how each stream it served ended: a client that
cancels just after its final response must reach Triton as a half-close (tritonserver 2.51 keeps the state of a
stream cancelled just then for good, server#8078), one that leaves mid-request as a cancel (so the work stops), and a
flag-only final response the relay asked for on the client's behalf is not passed on."""
from __future__ import annotations

import asyncio

import grpc
from tritonclient.grpc import service_pb2

from trellm_openai import grpc_relay
from trellm_openai.keys import KeyStore, Limiter

STREAM = f"/{grpc_relay.SERVICE}/{grpc_relay.STREAM}"


def response(request: service_pb2.ModelInferRequest, final: bool, text: bytes | None) -> bytes:
    r = service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(
        id=request.id, model_name=request.model_name))
    r.infer_response.parameters["triton_final_response"].bool_param = final
    if text is not None:
        r.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        r.infer_response.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    return r.SerializeToString()


class FakeTriton:
    """ModelStreamInfer: request `answer` gets one data response that is final; `flag-only` a data response, then
    (only when the request asks for empty finals) a flag-only final; `hold` no response for a minute."""

    def __init__(self):
        self.ends: list[str] = []
        self.empty_finals_asked: list[bool] = []

    async def stream(self, request_iterator, context):
        try:
            async for raw in request_iterator:
                request = service_pb2.ModelInferRequest.FromString(raw)
                asked = request.parameters["triton_enable_empty_final_response"].bool_param
                self.empty_finals_asked.append(asked)
                if request.id == "hold":
                    await asyncio.sleep(60)
                elif request.id == "flag-only":
                    await context.write(response(request, False, b"hi"))
                    if asked:
                        await context.write(response(request, True, None))
                else:
                    await context.write(response(request, True, b"hi"))
            await asyncio.sleep(0.2)     # a cancel that ended the requests early shows in the context by now
            self.ends.append("cancelled" if context.cancelled() else "half-closed")
        except asyncio.CancelledError:
            self.ends.append("cancelled")
            raise


async def with_relay(body, **bounds):
    """Run `body(relay_channel, fake)` with the fake upstream and the relay (grpc_relay.serve's `bounds`) served on
    loopback ports."""
    from trellm_backend.tools.testbed import free_ports
    fake = FakeTriton()
    upstream = grpc.aio.server()
    upstream.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(grpc_relay.SERVICE, {
        grpc_relay.STREAM: grpc.stream_stream_rpc_method_handler(fake.stream)}),))
    upstream_port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    relay = grpc_relay.GrpcRelay(f"127.0.0.1:{upstream_port}", KeyStore(None), Limiter())
    port = free_ports(1)[0]
    server = await grpc_relay.serve(relay, "127.0.0.1", port, **bounds)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel, fake)
    finally:
        await server.stop(0)
        await relay.close()
        await upstream.stop(0)


async def wait_for(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)


def request(request_id: str) -> bytes:
    return service_pb2.ModelInferRequest(model_name="m", id=request_id).SerializeToString()


def test_a_client_that_cancels_after_its_final_response_half_closes_upstream():
    async def body(channel, fake):
        for _ in range(3):
            call = channel.stream_stream(STREAM)()
            await call.write(request("answer"))
            final = service_pb2.ModelStreamInferResponse.FromString(await call.read())
            assert final.infer_response.parameters["triton_final_response"].bool_param
            call.cancel()                     # as tritonclient's stop_stream(cancel_requests=True) does
        await wait_for(lambda: len(fake.ends) == 3)
        assert fake.ends == ["half-closed"] * 3
    asyncio.run(with_relay(body))


def test_a_client_that_leaves_mid_request_cancels_it_upstream():
    async def body(channel, fake):
        call = channel.stream_stream(STREAM)()
        await call.write(request("hold"))
        await wait_for(lambda: fake.empty_finals_asked)
        call.cancel()
        await wait_for(lambda: fake.ends)
        assert fake.ends == ["cancelled"]
    asyncio.run(with_relay(body))


def test_a_flag_only_final_reaches_the_relay_and_only_the_clients_that_asked():
    async def body(channel, fake):
        call = channel.stream_stream(STREAM)()
        await call.write(request("flag-only"))
        await call.done_writing()
        got = [service_pb2.ModelStreamInferResponse.FromString(r) async for r in call]
        assert [r.infer_response.parameters["triton_final_response"].bool_param for r in got] == [False]
        assert fake.empty_finals_asked == [True] and fake.ends == ["half-closed"]
        # a client that asks for empty finals itself gets them
        asked = service_pb2.ModelInferRequest(model_name="m", id="flag-only")
        asked.parameters["triton_enable_empty_final_response"].bool_param = True
        call = channel.stream_stream(STREAM)()
        await call.write(asked.SerializeToString())
        await call.done_writing()
        got = [service_pb2.ModelStreamInferResponse.FromString(r) async for r in call]
        assert [r.infer_response.parameters["triton_final_response"].bool_param for r in got] == [False, True]
    asyncio.run(with_relay(body))


def test_a_message_over_the_bound_is_refused_and_the_relay_goes_on():
    async def body(channel, fake):
        big = service_pb2.ModelInferRequest(model_name="m", id="answer", raw_input_contents=[b"x" * 8192])
        call = channel.stream_stream(STREAM)()
        await call.write(big.SerializeToString())
        try:
            await call.read()
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("an 8 KiB message passed a 4 KiB bound")
        assert fake.empty_finals_asked == []       # nothing of it went upstream
        call = channel.stream_stream(STREAM)()     # the next stream is served
        await call.write(request("answer"))
        assert service_pb2.ModelStreamInferResponse.FromString(await call.read()).infer_response.id == "answer"
        call.cancel()
    asyncio.run(with_relay(body, max_message_bytes=4096))


def test_a_message_that_is_no_request_gets_an_error_response_and_the_stream_goes_on():
    async def body(channel, fake):
        call = channel.stream_stream(STREAM)()
        await call.write(b"\xff\xff\xff not a protobuf")
        error = service_pb2.ModelStreamInferResponse.FromString(await call.read())
        assert "not a ModelInferRequest" in error.error_message
        await call.write(request("answer"))
        await call.done_writing()
        answer = service_pb2.ModelStreamInferResponse.FromString(await call.read())
        assert answer.infer_response.id == "answer" and await call.read() is grpc.aio.EOF
        await wait_for(lambda: fake.ends)
        assert fake.ends == ["half-closed"]
    asyncio.run(with_relay(body))
