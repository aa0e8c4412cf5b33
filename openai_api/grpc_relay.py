"""Triton's KServe v2 gRPC service on the front door's public gRPC port, relayed to tritonserver's gRPC port on
loopback.

tritonserver's gRPC port serves repository control (in explicit mode a client can upload a model.py that the server
runs), shared memory, trace and log settings beside inference, and asks no key. So it listens on loopback, and this
relay is the public one: health, metadata, config, statistics, ModelInfer and ModelStreamInfer pass as bytes (a
stream's requests are read to count them against their key, and of its responses only each request's last is
decoded); the admin calls are refused with PERMISSION_DENIED. With a keys file every call but the server's health wants `authorization:
Bearer <key>` metadata, and each inference request counts against its key's limits (keys.py) as an OpenAI request
does: requests a minute, requests at once, and tokens a minute. For a key with a token limit the relay asks the model
for its token counts (the contracts' `return_num_input_tokens` and `return_num_output_tokens` flags, where the model
declares them) and takes them out of the responses again when the client had not asked for them.

Over a limit: a ModelInfer, or a stream's request while nothing else of that stream is in flight, ends with
RESOURCE_EXHAUSTED, a `retry-after` trailer and a google.rpc.RetryInfo detail; a stream's request while others of
the same stream are in flight gets an error response of its own, and the others go on.

A stream the client leaves (a cancel, a closed connection) is ended upstream by half-closing it once nothing is in
flight, never by a cancel: tritonserver 2.51 keeps a stream's state for good when its cancel arrives just after the
final response (server#8078). A request still in flight is cancelled as a direct client's would be.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from tritonclient.grpc import service_pb2

from trellm_openai.relay import COUNT_FLAGS, MODEL_FACTS_MAX_AGE_S

SERVICE = "inference.GRPCInferenceService"
# Calls relayed as they are; the first two need no key (a load balancer's health check has none).
HEALTH = ("ServerLive", "ServerReady")
READ_ONLY = ("ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelStatistics")
INFER = "ModelInfer"
STREAM = "ModelStreamInfer"
# Calls that change or expose the server: loopback only.
ADMIN = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
         "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus",
         "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings")
# Triton's own bound of a request (--grpc-max-input-size is 64 MiB by default in later releases, unbounded in 2.51).
MAX_MESSAGE_BYTES = 64 << 20
MAX_STREAMS_PER_CONNECTION = 256
# Metadata the relay does not pass on: the caller's key stays with the relay.
_NOT_FORWARDED = {"authorization"}
# How long a stream the client left may take to end upstream once half-closed, before it is cancelled after all.
CLOSE_GRACE_S = 10.0
# A request's end in a stream: Triton marks each response of a decoupled model; other models answer once.
_FINAL = "triton_final_response"
_EMPTY_FINAL = "triton_enable_empty_final_response"
# triton_final_response's map entry as Triton writes it (its value is a oneof, so `false` is written too): bytes of
# a response that marks it not final need no parse. Text that happens to hold the `true` form only costs a parse.
_NOT_FINAL = _FINAL.encode() + b"\x12\x02\x08\x00"
_FINAL_TRUE = _FINAL.encode() + b"\x12\x02\x08\x01"
_ASK_EMPTY_FINAL = service_pb2.ModelInferRequest(parameters={_EMPTY_FINAL: service_pb2.InferParameter(
    bool_param=True)}).SerializeToString()


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                   max_streams: int = MAX_STREAMS_PER_CONNECTION) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", -1),
            ("grpc.max_concurrent_streams", max_streams), ("grpc.so_reuseport", 0)]


def upstream_options() -> list[tuple[str, int]]:
    from trellm_client.client import channel_args
    return [*channel_args(), ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def retry_trailers(retry_after_s: int) -> tuple[tuple[str, object], ...]:
    """A `retry-after` trailer (seconds) and the google.rpc.Status detail gRPC clients read retry hints from."""
    detail = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_after_s))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED)
    status.details.add().Pack(detail)
    return (("retry-after", str(retry_after_s)), ("grpc-status-details-bin", status.SerializeToString()))


def response_tokens(response: service_pb2.ModelInferResponse) -> tuple[int, int, bool]:
    """(num_input_tokens, num_output_tokens, whether the output count is cumulative) of a response, 0 for a count
    it lacks. The two contracts count outputs differently: TRT-LLM's INT32 num_output_tokens is the tokens so far,
    vLLM's UINT32 one the tokens new in this response."""
    import numpy as np
    counts, cumulative = {}, True
    for i, out in enumerate(response.outputs):
        if out.name not in ("num_input_tokens", "num_output_tokens"):
            continue
        dtype = {"INT32": np.int32, "UINT32": np.uint32, "INT64": np.int64, "UINT64": np.uint64}.get(out.datatype)
        if dtype is None:
            continue
        if i < len(response.raw_output_contents):
            values = np.frombuffer(response.raw_output_contents[i], dtype)
        else:
            values = np.asarray([*out.contents.int_contents, *out.contents.uint_contents,
                                 *out.contents.int64_contents, *out.contents.uint64_contents])
        counts[out.name] = int(values.sum()) if values.size else 0
        if out.name == "num_output_tokens":
            cumulative = out.datatype != "UINT32"
    return counts.get("num_input_tokens", 0), counts.get("num_output_tokens", 0), cumulative


def without_counts(response: service_pb2.ModelInferResponse) -> None:
    """Remove the token-count outputs the relay asked for on the client's behalf."""
    for i in reversed(range(len(response.outputs))):
        if response.outputs[i].name in COUNT_FLAGS.values():
            del response.outputs[i]
            if i < len(response.raw_output_contents):
                del response.raw_output_contents[i]


def ask_for_counts(request: service_pb2.ModelInferRequest, declared: set[str], batched: bool) -> bool:
    """Set the count flags `declared` (the model's inputs) names to true in `request`, adding those it lacks (shape
    [1, 1] for a batching model, else [1]) and asking for their outputs where the request names its outputs; whether
    anything changed (then the counts are the relay's, not the client's)."""
    changed = False
    raw = len(request.raw_input_contents) > 0
    for flag, output in COUNT_FLAGS.items():
        if flag not in declared:
            continue
        index = next((i for i, t in enumerate(request.inputs) if t.name == flag), None)
        if index is None:
            tensor = request.inputs.add(name=flag, datatype="BOOL", shape=[1, 1] if batched else [1])
            if raw:
                request.raw_input_contents.append(b"\x01")
            else:
                tensor.contents.bool_contents.append(True)
            changed = True
        elif raw and index < len(request.raw_input_contents) and request.raw_input_contents[index] != b"\x01":
            request.raw_input_contents[index] = b"\x01"
            changed = True
        elif not raw and list(request.inputs[index].contents.bool_contents) != [True]:
            request.inputs[index].contents.bool_contents[:] = [True]
            changed = True
        if len(request.outputs) and all(o.name != output for o in request.outputs):
            request.outputs.add(name=output)
            changed = True
    return changed


@dataclass
class StreamState:
    """What one relayed stream has in flight, and the tokens its responses counted."""
    in_flight: int = 0
    empty_finals_asked: list[bool] = field(default_factory=list)   # per request in flight, in order: the client's own
    tokens: int = 0            # counted at each request's final response (and new outputs as they come, for vLLM's)
    counts_asked: dict[str, int] = field(default_factory=dict)   # request id -> requests in flight whose counts the
                                                                  # relay asked for (taken out of their responses)


class GrpcRelay:
    """The relay's handlers; `keys`/`limiter`: the front door's (keys.py), shared with its HTTP side."""

    def __init__(self, triton_grpc_url: str, keys, limiter, metrics=None):
        self.upstream_url = triton_grpc_url
        self.keys, self.limiter, self.metrics = keys, limiter, metrics
        self.channel: grpc.aio.Channel | None = None
        self._calls: dict[str, object] = {}            # method -> its multicallable on the channel
        self._inputs: dict[tuple[str, str], tuple[float, tuple[set[str], bool] | None]] = {}
        self._closing: set[asyncio.Task] = set()      # upstream streams ending after their client left

    def handler(self) -> grpc.GenericRpcHandler:
        unary = {name: grpc.unary_unary_rpc_method_handler(self._relay_unary(name)) for name in (*HEALTH, *READ_ONLY)}
        unary[INFER] = grpc.unary_unary_rpc_method_handler(self._infer)
        unary.update({name: grpc.unary_unary_rpc_method_handler(self._refuse(name)) for name in ADMIN})
        return grpc.method_handlers_generic_handler(SERVICE, {
            **unary, STREAM: grpc.stream_stream_rpc_method_handler(self._stream)})

    def _upstream(self, name: str, streaming: bool = False):
        """The multicallable of Triton's method `name`, bytes in and out."""
        if name not in self._calls:
            if self.channel is None:
                self.channel = grpc.aio.insecure_channel(self.upstream_url, options=upstream_options())
            method = self.channel.stream_stream if streaming else self.channel.unary_unary
            self._calls[name] = method(f"/{SERVICE}/{name}")
        return self._calls[name]

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        if self.channel is not None:
            await self.channel.close()

    async def _declared(self, model: str, version: str) -> tuple[set[str], bool] | None:
        """(the inputs `model` declares, whether it batches), read from Triton at most once per
        MODEL_FACTS_MAX_AGE_S; None when Triton cannot say (an unknown model: its request fails on its own)."""
        at, value = self._inputs.get((model, version), (-MODEL_FACTS_MAX_AGE_S, None))
        if time.monotonic() - at < MODEL_FACTS_MAX_AGE_S:
            return value
        try:
            raw = await self._upstream("ModelConfig")(service_pb2.ModelConfigRequest(
                name=model, version=version).SerializeToString(), timeout=10)
            config = service_pb2.ModelConfigResponse.FromString(raw).config
            value = ({t.name for t in config.input}, config.max_batch_size > 0)
        except grpc.aio.AioRpcError:
            value = None
        self._inputs[(model, version)] = (time.monotonic(), value)
        return value

    async def _with_counts(self, key, request: service_pb2.ModelInferRequest) -> bool:
        """For a key with a token limit, make `request` ask for its token counts; whether they are the relay's."""
        if key.tpm is None:
            return False
        declared = await self._declared(request.model_name, request.model_version)
        return declared is not None and ask_for_counts(request, *declared)

    # -- checks ------------------------------------------------------------------------------------------------
    async def _key(self, context: grpc.aio.ServicerContext):
        metadata = context.invocation_metadata() or ()
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        key = self.keys.authenticate(authorization if isinstance(authorization, str) else None)
        if key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or unknown API key: send metadata authorization: Bearer <key>")
        return key

    @staticmethod
    def _forwarded(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
        return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if k not in _NOT_FORWARDED)

    def _count(self, key, method: str, status: str) -> None:
        if self.metrics is not None:
            self.metrics.requests[(key.name if key else "-", f"grpc:{method}", status)] += 1

    def _refuse(self, name: str):
        async def refuse(request: bytes, context: grpc.aio.ServicerContext):
            self._count(None, name, "PERMISSION_DENIED")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{name} is not served on this port: repository control, shared memory, trace and "
                                "log settings are for the server's own host")
        return refuse

    @staticmethod
    async def _pass_error(e: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext):
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) and "connect" in (e.details() or ""):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the inference server is not available: {e.details()}")
        await context.abort(e.code(), e.details() or "")

    # -- unary calls ---------------------------------------------------------------------------------------------
    def _relay_unary(self, name: str):
        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if name not in HEALTH:
                await self._key(context)
            try:
                return await self._upstream(name)(
                    request, metadata=self._forwarded(context), timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                await self._pass_error(e, context)
        return relay

    def _over_limit(self, key, method: str, decision) -> str:
        """Count a request refused over its key's limit; the message that says so."""
        if self.metrics is not None:
            self.metrics.rate_limited[key.name] += 1
        self._count(key, method, "RESOURCE_EXHAUSTED")
        return f"{decision.reason}; retry after {decision.retry_after_s} s"

    async def _admit_or_abort(self, key, context: grpc.aio.ServicerContext, method: str):
        decision = self.limiter.admit(key)
        if not decision.allowed:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._over_limit(key, method, decision),
                                trailing_metadata=retry_trailers(decision.retry_after_s))

    async def _infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        key = await self._key(context)
        await self._admit_or_abort(key, context, INFER)
        tokens, relays_counts = 0, False
        try:
            if key.tpm is not None:
                parsed = service_pb2.ModelInferRequest.FromString(request)
                if await self._with_counts(key, parsed):
                    request, relays_counts = parsed.SerializeToString(), True
            raw = await self._upstream(INFER)(
                request, metadata=self._forwarded(context), timeout=context.time_remaining())
            if key.tpm is not None:
                response = service_pb2.ModelInferResponse.FromString(raw)
                n_in, n_out, _ = response_tokens(response)
                tokens = n_in + n_out
                if relays_counts:
                    without_counts(response)
                    raw = response.SerializeToString()
            self._count(key, INFER, "OK")
            return raw
        except grpc.aio.AioRpcError as e:
            self._count(key, INFER, e.code().name)
            await self._pass_error(e, context)
        finally:
            self.limiter.finish(key, tokens)

    # -- streams ------------------------------------------------------------------------------------------------
    async def _stream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Relay one ModelStreamInfer: the client's requests go up as they come (each admitted against its key),
        Triton's responses come down as they come; ends when both sides have.

        The upstream call is read and written by tasks of its own: grpc.aio cancels a call whose awaiting task is
        cancelled, and this handler's task is cancelled when the client leaves, which must not become a cancel
        upstream while nothing is in flight."""
        key = await self._key(context)
        call = self._upstream(STREAM, streaming=True)(metadata=self._forwarded(context),
                                                      timeout=context.time_remaining())
        state = StreamState()
        write_lock = asyncio.Lock()
        refused: list = []           # (message, decision) that ends the stream with RESOURCE_EXHAUSTED, if one does
        client_gone = asyncio.Event()

        async def write(raw: bytes) -> None:
            if client_gone.is_set():
                return
            try:
                async with write_lock:
                    await context.write(raw)
            except Exception:   # noqa: BLE001 - the client has left: the upstream is still read to its end
                client_gone.set()

        async def pump() -> None:
            """The client's requests, up."""
            try:
                async for raw in request_iterator:
                    try:
                        request = service_pb2.ModelInferRequest.FromString(raw)
                    except DecodeError:
                        await write(service_pb2.ModelStreamInferResponse(
                            error_message="the message is not a ModelInferRequest").SerializeToString())
                        continue
                    decision = self.limiter.admit(key)
                    if not decision.allowed:
                        message = self._over_limit(key, STREAM, decision)
                        if state.in_flight == 0:
                            refused.append((message, decision))
                            break
                        await write(service_pb2.ModelStreamInferResponse(
                            error_message=message, infer_response=service_pb2.ModelInferResponse(
                                model_name=request.model_name, model_version=request.model_version,
                                id=request.id)).SerializeToString())
                        continue
                    # Every request's end must reach the relay, also a decoupled model's flag-only final response,
                    # which Triton sends only when asked; the relay asks, and passes such a response on only to a
                    # client that asked itself.
                    asked = _EMPTY_FINAL in request.parameters and request.parameters[_EMPTY_FINAL].bool_param
                    if key.tpm is not None and await self._with_counts(key, request):
                        state.counts_asked[request.id] = state.counts_asked.get(request.id, 0) + 1
                        request.parameters[_EMPTY_FINAL].bool_param = True
                        raw = request.SerializeToString()
                    elif not asked:
                        raw += _ASK_EMPTY_FINAL      # a map entry appended to a message overrides the key's earlier one
                    state.in_flight += 1
                    state.empty_finals_asked.append(asked)
                    await call.write(raw)
            except Exception:   # noqa: BLE001 - the client left, or the upstream ended: the reader says which
                pass
            finally:
                with _quiet():
                    await call.done_writing()

        async def read() -> None:
            """Triton's responses, down, until the upstream stream ends."""
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    return
                if key.tpm is None and _NOT_FINAL in raw and _FINAL_TRUE not in raw:
                    await write(raw)      # a response before its request's last: passed on unread
                    continue
                response = service_pb2.ModelStreamInferResponse.FromString(raw)
                forward = True
                params = response.infer_response.parameters
                final = bool(response.error_message) or _FINAL not in params or params[_FINAL].bool_param
                if final and state.in_flight:
                    state.in_flight -= 1
                    asked = state.empty_finals_asked.pop(0) if state.empty_finals_asked else True
                    forward = asked or bool(response.error_message) or len(response.infer_response.outputs) > 0
                    self.limiter.finish(key, 0)
                    self._count(key, STREAM, "error" if response.error_message else "OK")
                if key.tpm is not None and not response.error_message:
                    n_in, n_out, cumulative = response_tokens(response.infer_response)
                    state.tokens += (n_out if not cumulative else 0) + ((n_in + cumulative * n_out) if final else 0)
                    request_id = response.infer_response.id
                    if state.counts_asked.get(request_id):
                        without_counts(response.infer_response)
                        raw = response.SerializeToString()
                        if final:
                            state.counts_asked[request_id] -= 1
                if forward:
                    await write(raw)

        pump_task, read_task = asyncio.ensure_future(pump()), asyncio.ensure_future(read())
        try:
            await asyncio.shield(read_task)
            if not pump_task.done():     # the upstream ended on its own: further requests have nowhere to go
                pump_task.cancel()
            await asyncio.gather(pump_task, return_exceptions=True)
            if refused:
                message, decision = refused[0]
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                                    trailing_metadata=retry_trailers(decision.retry_after_s))
        except grpc.aio.AioRpcError as e:
            pump_task.cancel()
            await self._pass_error(e, context)
        except asyncio.CancelledError:
            # The client left. With nothing in flight the upstream stream is half-closed and read to its end, off
            # this task; a request in flight is cancelled, as it is for a client of Triton's own port.
            client_gone.set()
            if state.in_flight:
                call.cancel()
            task = asyncio.ensure_future(_end_upstream(call, read_task, pump_task))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            raise
        finally:
            for _ in range(state.in_flight):
                self.limiter.finish(key, 0)
            state.in_flight = 0
            self.limiter.count_tokens(key, state.tokens)


def _quiet() -> contextlib.suppress:
    """Swallow the errors of a call that has already ended (a write or half-close after the end)."""
    return contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError)


async def _end_upstream(call, read_task: asyncio.Task, pump_task: asyncio.Task) -> None:
    """End the upstream stream of a client that left: half-closed and read to its end, cancelled only if it has not
    ended within CLOSE_GRACE_S."""
    with _quiet():
        await call.done_writing()
    done, _ = await asyncio.wait([read_task], timeout=CLOSE_GRACE_S)
    if not done:
        call.cancel()
    pump_task.cancel()
    await asyncio.gather(read_task, pump_task, return_exceptions=True)


async def serve(relay: GrpcRelay, host: str, port: int, max_message_bytes: int = MAX_MESSAGE_BYTES,
                max_streams: int = MAX_STREAMS_PER_CONNECTION) -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(max_message_bytes, max_streams))
    server.add_generic_rpc_handlers((relay.handler(),))
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"the gRPC relay cannot listen on {host}:{port}")
    await server.start()
    return server
