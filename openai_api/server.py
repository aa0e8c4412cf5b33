"""The OpenAI-compatible front door: an aiohttp server that answers /v1/completions and /v1/chat/completions by
streaming the repository's `ensemble` over tritonserver's gRPC port, as any client would (client/client.py's
AsyncLLMClient). It holds no engine: it checks keys and limits, turns the body into ensemble inputs
(protocol.py), and the ensemble's responses into OpenAI's objects or server-sent events.

A client that goes away mid-answer cancels its handler (aiohttp's handler_cancellation); the stream's close then
sends the engine step a stop request, so the request's KV blocks are freed at once (which Triton 2.51's ensemble
scheduler never does on a plain cancel).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from collections import Counter

import numpy as np
from aiohttp import web

from trellm_backend import tracing
from trellm_openai import grpc_relay, protocol
from trellm_openai.keys import KeyStore, Limiter
from trellm_openai.protocol import APIError, Generation
from trellm_openai.relay import OneLineBadRequests, Relay, body_nests_deeper_than, read_at_most
from trellm_openai.tools import TOOL_CALL_PARSERS, CallStream, final_message
from trellm_client.client import AsyncLLMClient, ServerUnavailable, channel_args, ensemble_steps, infer_input

log = logging.getLogger("trellm.openai")
MAX_BODY_BYTES = 4 << 20           # a prompt of about a million tokens of English is still far below this
MAX_JSON_DEPTH = 64                # OpenAI bodies nest a handful of levels (messages -> content parts)
# The model list (repository index, configs, each engine step's adapters) is read again after MODELS_MAX_AGE_S for
# requests that find their model in it; a listing, and a request for an id it lacks, take one younger than
# FRESH_MODELS_S, so an adapter loaded or unloaded by a control request shows at once.
MODELS_MAX_AGE_S = 1.0
FRESH_MODELS_S = 0.1


class Metrics:
    """The front door's own counters, per key name, in Prometheus' text format (/metrics appends Triton's)."""

    def __init__(self):
        self.requests = Counter()        # (key, endpoint, status)
        self.tokens = Counter()          # (key, kind)
        self.rate_limited = Counter()    # key

    def text(self) -> str:
        lines = ["# HELP trellm_openai_requests_total Requests answered, by key, endpoint and HTTP status.",
                 "# TYPE trellm_openai_requests_total counter"]
        lines += [f'trellm_openai_requests_total{{key="{k}",endpoint="{e}",status="{s}"}} {v}'
                  for (k, e, s), v in sorted(self.requests.items())]
        lines += ["# HELP trellm_openai_tokens_total Tokens counted against each key (prompt, completion).",
                  "# TYPE trellm_openai_tokens_total counter"]
        lines += [f'trellm_openai_tokens_total{{key="{k}",kind="{kind}"}} {v}'
                  for (k, kind), v in sorted(self.tokens.items())]
        lines += ["# HELP trellm_openai_rate_limited_total Requests refused with 429, by key.",
                  "# TYPE trellm_openai_rate_limited_total counter"]
        lines += [f'trellm_openai_rate_limited_total{{key="{k}"}} {v}' for k, v in sorted(self.rate_limited.items())]
        return "\n".join(lines) + "\n"


class FrontDoor:
    def __init__(self, triton_url: str, keys_file: str | None = None, model_repository: str | None = None,
                 triton_metrics_url: str | None = None, tool_call_parser: str | None = None,
                 triton_http_url: str | None = None):
        import tritonclient.grpc.aio as aio
        self.triton_url = triton_url
        self.triton_metrics_url = triton_metrics_url
        self._http: object | None = None        # the aiohttp session that reads triton_metrics_url, made on first use
        self.triton = aio.InferenceServerClient(triton_url, channel_args=channel_args())
        self.clients: dict[str, AsyncLLMClient] = {}
        self.keys = KeyStore(keys_file)
        self.limiter = Limiter()
        self.metrics = Metrics()
        self.model_repository = model_repository
        self.tool_call_parser = tool_call_parser   # how `auto` tool choice reads the model's calls (tools.py)
        self._models: tuple[float, dict[str, tuple[str, str | None]]] = (0.0, {})
        self._models_lock = asyncio.Lock()     # one refresh at a time: requests arriving meanwhile wait for it
        self._tokenizers: dict[str, object] = {}
        # Triton's gRPC port is on loopback, or public with its repository API behind the launcher's admin key.
        from trellm_backend.tools.launch import ADMIN_KEY_ENV, GRPC_ADMIN_HEADER
        admin_key = os.environ.get(ADMIN_KEY_ENV)
        self.triton_admin_headers = {GRPC_ADMIN_HEADER: admin_key} if admin_key else None
        # The KServe v2 HTTP routes, relayed to tritonserver's (loopback) HTTP port; None: not served here.
        self.relay = Relay(triton_http_url, self.keys, MAX_JSON_DEPTH, limiter=self.limiter,
                           metrics=self.metrics) if triton_http_url else None
        # With OTEL_EXPORTER_OTLP_*ENDPOINT set: a span per OpenAI request (tracing.py), the parent of Triton's.
        self.tracer = tracing.make_tracer("trellm-openai")

    async def triton_metrics(self) -> str:
        """tritonserver's metrics text (the engine's vllm:* gauges among them), so that /metrics on this port holds
        what vLLM's API port does: an endpoint picker scrapes the port it routes to. A comment when unreachable."""
        if not self.triton_metrics_url:
            return ""
        import aiohttp
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            async with self._http.get(self.triton_metrics_url) as r:
                r.raise_for_status()
                return await r.text()
        except Exception as e:   # noqa: BLE001 - the front door's own counters are still worth answering
            return f"# tritonserver's metrics at {self.triton_metrics_url} are unavailable: {e!r}\n"

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self.relay is not None:
            await self.relay.close()
        if self.tracer is not None:
            tracing.shut_down(self.tracer)    # the spans still batched

    # -- models ------------------------------------------------------------------------------------------------
    async def models(self, max_age_s: float = MODELS_MAX_AGE_S) -> dict[str, tuple[str, str | None]]:
        """{model id: (ensemble, LoRA adapter or None)}: the READY ensembles of the repository, and each LoRA
        adapter their engine step serves (those it declares in `lora_adapters`, as control requests have changed
        them since), by its own name as vLLM lists them (`ENSEMBLE:NAME` where two ensembles serve one name).
        Read again when older than `max_age_s`."""
        at, models = self._models
        if time.monotonic() - at < max_age_s:
            return models
        async with self._models_lock:
            at, models = self._models
            if time.monotonic() - at < max_age_s:     # refreshed while this one waited
                return models
            return await self._refresh_models()

    async def lookup(self, model: str) -> tuple[str, str | None] | None:
        """The (ensemble, adapter) a request's model id names, or None. An id the list lacks reads the list again
        (if older than FRESH_MODELS_S), so an adapter a control request has just loaded is served at once instead
        of a 404 until the next refresh; unknown ids cost at most one read per FRESH_MODELS_S."""
        models = await self.models()
        if model not in models:
            models = await self.models(FRESH_MODELS_S)
        return models.get(model)

    async def _refresh_models(self) -> dict[str, tuple[str, str | None]]:
        index = await self.triton.get_model_repository_index(as_json=True, headers=self.triton_admin_headers)
        models, adapters = {}, []
        for m in index.get("models", []):
            if m.get("state") != "READY":
                continue
            config = await self.triton.get_model_config(m["name"], as_json=True)
            steps = ensemble_steps(config)
            if not steps:
                continue
            models[m["name"]] = (m["name"], None)
            for step in steps:
                step_config = (await self.triton.get_model_config(step, as_json=True))["config"]
                if any(i["name"] == "lora_control" for i in step_config.get("input", [])):
                    adapters += [(m["name"], name) for name in await self.step_adapters(step, step_config)]
        taken = Counter(name for _, name in adapters)
        for ensemble, name in adapters:
            models[name if taken[name] == 1 and name not in models else f"{ensemble}:{name}"] = (ensemble, name)
        self._models = (time.monotonic(), models)
        return models

    async def step_adapters(self, step: str, config: dict) -> list[str]:
        """The adapters engine step `step` serves now, as its answer to an empty LoRA control request; if it gives
        none within 10 s, those its `config` declares (`lora_adapters`), so one slow step never holds up the list."""
        from tritonclient.grpc import aio

        async def ask():
            yield {"model_name": step, "inputs": [infer_input(aio, "lora_control", np.array([[b"{}"]], dtype=object))]}
        try:
            answers = []
            async for result, error in self.triton.stream_infer(ask(), stream_timeout=10):
                if error is not None:
                    raise error
                answers.append(json.loads(result.as_numpy("text_output").reshape(-1)[0])["adapters"])
            return answers[0]
        except Exception as e:     # an error, a timeout, or no answer at all
            log.warning("%s did not list its LoRA adapters (%s): listing those it declares", step, e)
            table = config.get("parameters", {}).get("lora_adapters", {}).get("string_value", "")
            return list(json.loads(table)) if table else []

    def client(self, model: str) -> AsyncLLMClient:
        if model not in self.clients:
            self.clients[model] = AsyncLLMClient(self.triton_url, model)
        return self.clients[model]

    async def tokenizer(self, model: str):
        """The tokenizer of the model's engine step (for logprobs' token strings): its `model_path` parameter,
        relative to the repository folder the launcher gave."""
        if model not in self._tokenizers:
            from trellm_backend.triton.parameters import resolve_model_path
            from trellm_backend.triton.tokenization import load_tokenizer
            steps = ensemble_steps(await self.triton.get_model_config(model, as_json=True))
            path = None
            for step in steps:
                params = (await self.triton.get_model_config(step, as_json=True))["config"].get("parameters", {})
                if "model_path" in params:
                    path = resolve_model_path(params["model_path"]["string_value"],   # as Triton gives the model
                                              os.path.join(self.model_repository or ".", step))
            if path is None:
                raise APIError(400, f"logprobs are not available for {model}: its engine step names no model_path",
                               param="logprobs")
            self._tokenizers[model] = await asyncio.to_thread(load_tokenizer, path)
        return self._tokenizers[model]

    # -- requests ------------------------------------------------------------------------------------------------
    async def read_body(self, request: web.Request):
        raw = await read_at_most(request, MAX_BODY_BYTES)
        if raw is None:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise protocol.invalid("the request body is not UTF-8") from None
        if await body_nests_deeper_than(raw, MAX_JSON_DEPTH):    # before the parse, which recurses once per level
            raise protocol.invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise protocol.invalid(f"the request body is not valid JSON: {e}") from None

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        key = self.keys.authenticate(request.headers.get("Authorization"))
        if key is None:
            raise APIError(401, "missing or unknown API key: send Authorization: Bearer <key>",
                           type_="authentication_error", code="invalid_api_key")
        request["key"] = key.name
        g = protocol.parse(await self.read_body(request), chat, self.tool_call_parser)
        try:
            named = await self.lookup(g.model)
        except Exception as e:   # noqa: BLE001 -- tritonserver unreachable or stopping
            raise APIError(503, f"the inference server is not available: {e}", type_="server_error") from None
        if named is None:
            raise APIError(404, f"the model {g.model!r} does not exist or is not ready; GET /v1/models lists them",
                           param="model", code="model_not_found")
        ensemble, lora_name = named
        tokenizer = await self.tokenizer(ensemble) if g.top_logprobs is not None else None
        decision = self.limiter.admit(key)
        if not decision.allowed:
            self.metrics.rate_limited[key.name] += 1
            raise APIError(429, decision.reason, type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={**decision.headers, "Retry-After": str(decision.retry_after_s)})
        answer = Answer(g, tokenizer)
        headers = None
        if self.tracer is not None:   # this request's span (make_app's middleware) is the parent of Triton's
            headers = tracing.current_carrier(**{"gen_ai.request.model": g.model, "trellm.key": key.name,
                                                 "trellm.stream": g.stream})
        try:
            params = {**g.params, "lora_name": lora_name} if lora_name else g.params
            chunks = answer_chunks(self.client(ensemble), g, params, headers)
            async with contextlib.aclosing(chunks) as chunks:
                first = await self._first(chunks)
                if g.stream:
                    return await self._stream(request, g, answer, first, chunks, decision.headers)
                if first is not None:
                    answer.add(first)
                try:
                    async for chunk in chunks:
                        answer.add(chunk)
                except Exception as e:   # noqa: BLE001 -- the server failed the request after it began
                    raise server_error(e, first=False) from None
                return web.json_response(answer.final(), headers=decision.headers)
        finally:
            self.limiter.finish(key, answer.prompt_tokens + answer.completion_tokens)
            self.metrics.tokens[(key.name, "prompt")] += answer.prompt_tokens
            self.metrics.tokens[(key.name, "completion")] += answer.completion_tokens

    async def _first(self, chunks):
        """The first response, or the server's refusal as an APIError (before any byte of the answer is sent)."""
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as e:   # noqa: BLE001 -- tritonclient's InferenceServerException, in-band errors
            raise server_error(e, first=True) from None

    async def _stream(self, request, g: Generation, answer: "Answer", first, chunks, headers) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **headers})
        await response.prepare(request)

        async def send(obj) -> None:
            await response.write(f"data: {json.dumps(obj)}\n\n".encode("utf-8"))

        if first is not None:
            for obj in answer.add(first):
                await send(obj)
        try:
            async for chunk in chunks:
                for obj in answer.add(chunk):
                    await send(obj)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:   # noqa: BLE001 -- the headers are out: the error goes in the stream, as vLLM's does
            await send(server_error(e, first=False).body())
        if g.include_usage:
            await send(protocol.chunk_object(g, [], answer.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def answer_chunks(client: AsyncLLMClient, g: Generation, params: dict, headers: dict | None = None):
    """The ensemble's responses to `g`: one stream per prompt, each response's sequence_index made its choice's
    index (prompt p's sample j is choice p * n + j, OpenAI's order). With several prompts every stream's first
    response is awaited before any is yielded, so a prompt the server refuses fails the whole request before a byte
    of the answer is sent; then responses come as they arrive."""
    tools = g.tools and list(g.tools.tools)
    streams = [client.stream_chunks(p, g.messages, tools=tools, headers=headers, **params)
               for p in (g.prompts or [None])]
    if len(streams) == 1:       # the common case, without the merging below
        async with contextlib.aclosing(streams[0]) as stream:
            async for chunk in stream:
                yield chunk
        return

    async def next_of(p):
        try:
            chunk = await streams[p].__anext__()
        except StopAsyncIteration:
            return p, None
        return p, dataclasses.replace(chunk, sequence_index=p * g.n + chunk.sequence_index)

    async with contextlib.AsyncExitStack() as stack:
        for stream in streams:
            await stack.enter_async_context(contextlib.aclosing(stream))
        pending = {asyncio.ensure_future(next_of(p)) for p in range(len(streams))}
        try:
            # Every first response, or the first refusal (its mates are then cancelled at once).
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            results = _results(done)
            for p, chunk in sorted(results, key=lambda r: r[0]):
                if chunk is not None:
                    yield chunk
                    pending.add(asyncio.ensure_future(next_of(p)))
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for p, chunk in _results(done):
                    if chunk is not None:
                        pending.add(asyncio.ensure_future(next_of(p)))
                        yield chunk
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _results(done: set) -> list:
    """The finished tasks' results; the first failure raised once every failure has been read."""
    errors = [t.exception() for t in done if t.exception() is not None]
    if errors:
        raise errors[0]
    return [t.result() for t in done]


def server_error(e: Exception, first: bool) -> APIError:
    """The server's failure of a request as an APIError: before its first response a refusal (400 naming what the
    server named, 503 when it is unreachable, full or stopping), after it a 500 (the model's process failed)."""
    if isinstance(e, ServerUnavailable):
        return APIError(503, str(e), type_="server_error")
    message = e.message() if hasattr(e, "message") and callable(e.message) else str(e)
    if "at capacity" in message or "stopping" in message:
        return APIError(503, message, type_="server_error", code="server_overloaded")
    if first:
        return protocol.invalid(message)
    return APIError(500, f"the server failed the request while answering: {message}", type_="server_error")


class Answer:
    """What the ensemble's responses add up to, per choice (sequence_index), and the chunks each one makes."""

    def __init__(self, g: Generation, tokenizer=None):
        self.g, self.tokenizer = g, tokenizer
        count = g.n * len(g.prompts or [None])        # choices: n per prompt
        self.texts = [g.prompts[i // g.n] if g.echo else "" for i in range(count)]
        self.reasons: list[str | None] = [None] * count
        self.logprobs = [None if g.top_logprobs is None else protocol.logprobs_block(g, [], [], [], 0)
                         for _ in range(count)]
        self.started = [False] * count
        self.prompt_tokens_of = [0] * (count // g.n)   # per prompt
        self.output_tokens = [0] * count
        self.calls = [CallStream(g.tools) for _ in range(count)] if g.tools and g.tools.parses_calls else None

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_tokens_of)

    @property
    def completion_tokens(self) -> int:
        return sum(self.output_tokens)

    def usage(self) -> dict:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)

    def _logprobs(self, i: int, chunk) -> dict | None:
        if self.g.top_logprobs is None or not chunk.token_ids:
            return None
        decode = lambda t: self.tokenizer.decode([t])   # noqa: E731
        tokens = [decode(t) for t in chunk.token_ids]
        top = [[(decode(t), lp) for t, lp in alts] for _, alts in (chunk.top_logprobs or [])]
        top += [[] for _ in range(len(tokens) - len(top))]
        block = protocol.logprobs_block(self.g, tokens, list(chunk.output_log_probs or []), top,
                                        len(self.texts[i]) - len(chunk.text))
        kept = self.logprobs[i]
        for name, values in block.items():
            kept[name] = kept[name] + values
        return block

    def add(self, chunk) -> list[dict]:
        """Take one ensemble response; return the stream chunks it makes (none for an empty non-final one)."""
        i = chunk.sequence_index
        self.prompt_tokens_of[i // self.g.n] = max(self.prompt_tokens_of[i // self.g.n], chunk.num_input_tokens)
        self.output_tokens[i] = max(self.output_tokens[i], chunk.num_output_tokens)
        self.texts[i] += chunk.text
        reason = protocol.FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason)
        self.reasons[i] = reason or self.reasons[i]
        block = self._logprobs(i, chunk)
        if self.calls is not None:
            deltas, reason = self.calls[i].deltas(self.texts[i], reason)
            choices = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if reason:
                choices = choices or [{"index": i, "delta": {}, "logprobs": None, "finish_reason": None}]
                choices[-1]["finish_reason"] = reason
            return [protocol.chunk_object(self.g, [c]) for c in choices]
        if not chunk.text and reason is None and self.started[i]:
            return []
        text = chunk.text
        if not self.started[i] and self.g.echo:
            text = self.g.prompts[i // self.g.n] + text
        out = [protocol.chunk_object(self.g, [protocol.stream_choice(self.g, i, text, reason, block,
                                                                     not self.started[i])])]
        self.started[i] = True
        return out

    def final(self) -> dict:
        if not self.g.chat:
            return protocol.final_object(self.g, self.texts, self.reasons, self.logprobs, self.usage())
        messages, reasons = zip(*(final_message(self.g.tools, t, r) for t, r in zip(self.texts, self.reasons)))
        return protocol.final_object(self.g, list(messages), list(reasons), self.logprobs, self.usage())


# -- the aiohttp application ---------------------------------------------------------------------------------------
def make_app(door: FrontDoor) -> web.Application:
    @web.middleware
    async def traced(request: web.Request, handler):
        """An OpenAI request's span, a child of the client's `traceparent` when it sent one (tracing on only)."""
        if door.tracer is None or not request.path.startswith("/v1/"):
            return await handler(request)
        with tracing.server_span(door.tracer, request.method, request.path, request.headers) as span:
            response = await handler(request)
            tracing.end_http_span(span, response.status)
            return response

    @web.middleware
    async def errors(request: web.Request, handler):
        endpoint = request.path
        try:
            response = await handler(request)
        except APIError as e:
            response = web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status == 413:
                e = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
            else:
                e = APIError(e.status, e.reason, type_="invalid_request_error" if e.status < 500 else "server_error")
            response = web.json_response(e.body(), status=e.status)
        except (ConnectionResetError, asyncio.CancelledError):
            door.metrics.requests[(request.get("key", "-"), endpoint, "disconnected")] += 1
            raise
        except Exception:   # noqa: BLE001 -- never a traceback to the client, never a dead server
            log.exception("internal error on %s", endpoint)
            e = APIError(500, "internal error in the front door (see its log)", type_="server_error")
            response = web.json_response(e.body(), status=500)
        if endpoint.startswith("/v1/"):
            door.metrics.requests[(request.get("key", "-"), endpoint, str(response.status))] += 1
        return response

    async def completions(request):
        return await door.generate(request, chat=False)

    async def chat_completions(request):
        return await door.generate(request, chat=True)

    async def list_models(request):
        if door.keys.authenticate(request.headers.get("Authorization")) is None:
            raise APIError(401, "missing or unknown API key: send Authorization: Bearer <key>",
                           type_="authentication_error", code="invalid_api_key")
        try:
            models = await door.models(FRESH_MODELS_S)     # a listing shows loads and unloads at once
        except Exception as e:   # noqa: BLE001
            raise APIError(503, f"the inference server is not available: {e}", type_="server_error") from None
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "trellm", "root": lora or n,
             "parent": ensemble if lora else None} for n, (ensemble, lora) in models.items()]})

    async def health(request):
        try:
            ready = await door.triton.is_server_ready()
        except Exception:   # noqa: BLE001
            ready = False
        return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)

    async def metrics(request):
        return web.Response(text=door.metrics.text() + await door.triton_metrics(), content_type="text/plain")

    # each route reads its own bound
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[traced, errors])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if door.relay is not None:
        app.router.add_route("*", "/v2{tail:.*}", door.relay.handle)
    app.on_cleanup.append(lambda _: door.close())
    return app


async def serve(door: FrontDoor, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_app(door), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def main(argv=None) -> int:
    import argparse
    from trellm_backend.tools.repository import default_repository
    ap = argparse.ArgumentParser(prog="python -m trellm_openai", description="The OpenAI-compatible front door.")
    ap.add_argument("--triton-url", default="localhost:8001", help="tritonserver's gRPC address")
    ap.add_argument("--triton-http-url", default="localhost:8000",
                    help="tritonserver's HTTP address, whose KServe v2 routes this port relays ('' for none)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--keys-file", default=os.environ.get("TRELLM_API_KEYS_FILE"),
                    help="API keys and their limits (openai_api/keys.py); without one the front door is open")
    ap.add_argument("--grpc-port", type=int, default=0,
                    help="also serve Triton's KServe gRPC API on this port, relayed to --triton-url with keys and "
                         "limits, admin calls refused (openai_api/grpc_relay.py; default 0: not served)")
    ap.add_argument("--grpc-max-message-bytes", type=int, default=grpc_relay.MAX_MESSAGE_BYTES,
                    help="the largest gRPC request message the relay takes")
    ap.add_argument("--grpc-max-streams-per-connection", type=int, default=grpc_relay.MAX_STREAMS_PER_CONNECTION,
                    help="calls and streams at once on one gRPC connection")
    ap.add_argument("--triton-metrics-url", default="http://localhost:8002/metrics",
                    help="tritonserver's metrics, appended to this server's /metrics ('' for none)")
    ap.add_argument("--model-repository", default=default_repository(),
                    help="the repository tritonserver serves (where model_path parameters are relative to)")
    ap.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                    help="the format the served models write tool calls in, for tool_choice \"auto\" "
                         "(openai_api/tools.py); without one, auto is refused and required or named calls work")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[openai] %(message)s")
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
    if args.keys_file:
        KeyStore(args.keys_file)   # a malformed file stops the start, naming the line

    async def run():
        door = FrontDoor(args.triton_url, args.keys_file, args.model_repository, args.triton_metrics_url,
                         args.tool_call_parser, args.triton_http_url)
        runner = await serve(door, args.host, args.port)
        relay = grpc_server = None
        if args.grpc_port:
            relay = grpc_relay.GrpcRelay(args.triton_url, door.keys, door.limiter, door.metrics)
            grpc_server = await grpc_relay.serve(relay, args.host, args.grpc_port, args.grpc_max_message_bytes,
                                                 args.grpc_max_streams_per_connection)
        grpc_line = f", Triton's KServe gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else ""
        print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1{grpc_line} "
              f"({'keys from ' + args.keys_file if args.keys_file else 'open: no keys file'})", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)   # a clean stop exports its spans
        try:
            await stop.wait()
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
                await relay.close()
            await runner.cleanup()
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0
