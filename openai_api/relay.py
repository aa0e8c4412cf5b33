"""The KServe v2 HTTP routes on the front door's port, relayed to tritonserver's HTTP port on loopback.

tritonserver 2.51 parses a JSON body recursively: one of 50,000 nested arrays to /v2/models/ensemble/generate
crashed the whole server, and every stream with it. So Triton's HTTP port listens on loopback, and this relay is
the public one: it checks a body's size and nesting (a byte scan, no parse) and only then passes the call on, as
it is, streams included. The routes are those clients of Triton's HTTP use (tritonclient's HTTP client,
perf_analyzer, genai-perf, curl): health, server and model metadata, config, ready, stats, infer, generate and
generate_stream. Repository control, shared memory, tracing and logging stay on loopback. An error of the relay's
own has Triton's shape, {"error": "..."}. A model's infer, generate and generate_stream count against the caller's
key as an OpenAI request does (keys.py): requests a minute and at once, refused with 429 and Retry-After; for a key
with a token limit, generate bodies ask for the model's token counts, which are counted and taken out of the answer
again when the client had not asked for them (an infer body is not rewritten: it counts requests only).
One more refusal reads a field: `stream: true` sent to `/generate`
(genai-perf's `--endpoint-type generate --streaming` does that): 2.51 answers it at once with an error while the
model's generation runs on unread, so a client repeating it fills the engine with work nobody reads.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout, web
from aiohttp.http_exceptions import HttpProcessingError

# Triton's own default bound of an HTTP request (--http-max-input-size).
MAX_V2_BODY_BYTES = 64 << 20
OFF_LOOP_BYTES = 1 << 20
# Brackets that open and close a nesting level.
_OPEN, _CLOSE = np.zeros(256, np.int8), np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1
# Paths relayed, after /v2: the server's metadata and health, and a model's metadata and its calls.
_ROUTES = re.compile(r"(/health/(live|ready))?|/models/[^/]+(/versions/[^/]+)?"
                     r"(/(config|ready|stats|infer|generate|generate_stream))?")
_HEALTH = re.compile(r"/health/(live|ready)")
_GENERATE = re.compile(r"/models/[^/]+(/versions/[^/]+)?/generate")
_COUNTED = re.compile(r"/models/([^/]+)(/versions/[^/]+)?/(infer|generate|generate_stream)")
# The contracts' flags that make a model return its token counts, and the outputs they add (both relays ask for them
# for a key with a token limit), and how long what a model declares is trusted before it is read again.
COUNT_FLAGS = {"return_num_input_tokens": "num_input_tokens", "return_num_output_tokens": "num_output_tokens"}
MODEL_FACTS_MAX_AGE_S = 60.0
# `"stream": true` (or [true]) as a key of the body: inside a JSON string a quote is escaped, so text cannot match.
_STREAM_ON = re.compile(rb'"stream"\s*:\s*(true|\[\s*true\s*\])')
log = logging.getLogger("trellm.openai")
# Hop-by-hop headers (RFC 9110) and what the relay sets itself.
_NOT_FORWARDED = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "expect",
                  "transfer-encoding", "upgrade", "host", "content-length"}


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether a JSON text nests objects and arrays more than `limit` deep, read from its bytes without parsing it
    (no recursion; a 4 MiB body in tens of milliseconds, one with few brackets at once): a quote not escaped by an
    odd run of backslashes opens or closes a string, and brackets outside strings are counted."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    b = np.frombuffer(raw, np.uint8)
    quote = b == ord('"')
    if b"\\" in raw:
        n = b.size
        index = np.arange(n, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(b == ord("\\"), np.int32(-1), index))   # last non-backslash <= i
        run_before = np.zeros(n, np.int32)                                                 # backslashes just before i
        run_before[1:] = index[:-1] - last_other[:-1]
        quote &= run_before % 2 == 0
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0                                 # after an even number of quotes
    step = (_OPEN[b] - _CLOSE[b]) * outside
    return bool(np.cumsum(step, dtype=np.int32).max() > limit)


async def read_at_most(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None once it is longer than `limit` bytes: refused from its Content-Length before
    anything is read, else as the bytes come, so no route buffers more than its own bound."""
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def body_nests_deeper_than(raw: bytes, limit: int) -> bool:
    """nests_deeper_than off the event loop for a large body (numpy releases the GIL), so one client's megabytes of
    brackets do not stall every other request of the door."""
    if len(raw) < OFF_LOOP_BYTES:
        return nests_deeper_than(raw, limit)
    return await asyncio.to_thread(nests_deeper_than, raw, limit)


class OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (an HTTP/2 prior-knowledge preface from a router probing the port, a
    scanner's bytes) with a traceback; it is answered 400 and says so in one line instead. So is a client that went
    away while its answer was being written (the stream it left is ended upstream as for any disconnect)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = f"{type(exc).__name__}: {exc.message}"
        elif isinstance(exc, ConnectionResetError):
            why = f"the client went away mid-answer ({type(exc).__name__}: {exc})"
        else:
            return True
        record.msg = f"{record.getMessage()}: {why}"
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def triton_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def ask_for_counts(raw: bytes) -> tuple[bytes, bool]:
    """A generate body asking for the model's token counts, and whether that changed it (then the counts are the
    relay's, and leave the answer)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, False      # Triton answers the malformed body itself
    if not isinstance(body, dict) or all(body.get(flag) is True for flag in COUNT_FLAGS):
        return raw, False
    body.update({flag: True for flag in COUNT_FLAGS})
    return json.dumps(body).encode(), True


class TokenCounts:
    """The token counts in a generate answer's JSON objects (one, or one per server-sent event): prompt tokens, and
    output tokens summed where each response counts its new ones (vLLM's UINT32 count), else the last count seen
    (TRT-LLM's tokens so far); `strip` takes the counts out of each object."""

    def __init__(self, cumulative: bool, strip: bool):
        self.cumulative, self.strip = cumulative, strip
        self.prompt = self.output = 0
        self._pending = b""

    def total(self) -> int:
        return self.prompt + self.output

    def _take(self, obj: dict) -> dict:
        def number(v):
            v = v[-1] if isinstance(v, list) and v else v
            return int(v) if isinstance(v, (int, float)) else 0
        if "num_input_tokens" in obj:
            self.prompt = max(self.prompt, number(obj["num_input_tokens"]))
        if "num_output_tokens" in obj:
            n = number(obj["num_output_tokens"])
            self.output = max(self.output, n) if self.cumulative else self.output + n
        if self.strip:
            for output in COUNT_FLAGS.values():
                obj.pop(output, None)
        return obj

    def body(self, raw: bytes) -> bytes:
        """A whole JSON answer (generate)."""
        try:
            obj = json.loads(raw)
        except ValueError:
            return raw
        return json.dumps(self._take(obj)).encode() if isinstance(obj, dict) else raw

    def events(self, chunk: bytes, end: bool = False) -> bytes:
        """The complete server-sent events so far (generate_stream), their counts read; the rest waits."""
        data = self._pending + chunk
        last = data.rfind(b"\n\n")
        cut = len(data) if end else last + 2 if last >= 0 else 0
        done, self._pending = data[:cut], data[cut:]
        out = []
        for line in done.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    obj = json.loads(line[5:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    line = b"data: " + json.dumps(self._take(obj)).encode()
            out.append(line)
        return b"\n".join(out)


class Relay:
    """The v2 routes of the front door's aiohttp application; `keys`: the door's API keys (openai_api/keys.py), asked
    for every route but health when a keys file is set."""

    def __init__(self, triton_http_url: str, keys, max_depth: int, max_body_bytes: int = MAX_V2_BODY_BYTES,
                 limiter=None, metrics=None):
        self.upstream = "http://" + triton_http_url.removeprefix("http://")
        self.keys, self.max_depth, self.max_body_bytes = keys, max_depth, max_body_bytes
        self.limiter, self.metrics = limiter, metrics      # keys.Limiter: None counts nothing
        self._session: ClientSession | None = None
        self._cumulative: dict[str, tuple[float, bool]] = {}   # model -> (read at, its output count is cumulative)

    def session(self) -> ClientSession:
        if self._session is None:
            # No decompression and no total timeout: bytes pass as they are, and a stream lasts as long as it lasts.
            self._session = ClientSession(auto_decompress=False, timeout=ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def refusal(self, request: web.Request, raw: bytes) -> web.Response | None:
        """The answer to a call that must not reach Triton, or None."""
        tail = request.path[len("/v2"):]
        if not _ROUTES.fullmatch(tail):
            return triton_error(404, f"{request.path} is not served on this port")
        if request.method not in ("GET", "POST", "HEAD"):
            return triton_error(405, f"{request.method} is not allowed on {request.path}")
        if not _HEALTH.fullmatch(tail) and self.keys.authenticate(request.headers.get("Authorization")) is None:
            return triton_error(401, "missing or unknown API key: send Authorization: Bearer <key>")
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            return triton_error(415, "compressed request bodies are not relayed; send the body uncompressed")
        header_length = request.headers.get("Inference-Header-Content-Length")
        try:
            json_part = raw[:int(header_length)] if header_length else raw
        except ValueError:
            return triton_error(400, f"Inference-Header-Content-Length {header_length!r} is not a number")
        if await body_nests_deeper_than(json_part, self.max_depth):
            return triton_error(400, f"the request body nests deeper than {self.max_depth} levels")
        if _GENERATE.fullmatch(tail) and len(json_part) <= OFF_LOOP_BYTES and _STREAM_ON.search(json_part):
            return triton_error(400, "stream=true needs the generate_stream route: /generate answers with one "
                                     f"response; POST it to {request.path}_stream")
        return None

    async def counts_cumulative(self, model: str) -> bool:
        """Whether `model`'s num_output_tokens is the tokens so far (TRT-LLM's INT32) rather than each response's new
        ones (vLLM's UINT32), from its metadata, read again after a minute."""
        at, cumulative = self._cumulative.get(model, (-MODEL_FACTS_MAX_AGE_S, True))
        if time.monotonic() - at < MODEL_FACTS_MAX_AGE_S:
            return cumulative
        try:
            async with self.session().get(f"{self.upstream}/v2/models/{model}") as r:
                outputs = (await r.json()).get("outputs", []) if r.status == 200 else []
            cumulative = all(o.get("datatype") != "UINT32" for o in outputs if o.get("name") == "num_output_tokens")
        except (ClientError, OSError, ValueError):
            pass
        self._cumulative[model] = (time.monotonic(), cumulative)
        return cumulative

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await read_at_most(request, self.max_body_bytes)
        if raw is None:
            return triton_error(413, f"the request body is larger than {self.max_body_bytes} bytes")
        refused = await self.refusal(request, raw)
        if refused is not None:
            return refused
        counted = _COUNTED.fullmatch(request.path[len("/v2"):]) if request.method == "POST" else None
        if self.limiter is None or counted is None:
            return await self.relay(request, raw)
        key = self.keys.authenticate(request.headers.get("Authorization"))
        decision = self.limiter.admit(key)
        if not decision.allowed:
            if self.metrics is not None:
                self.metrics.rate_limited[key.name] += 1
            return triton_error(429, decision.reason, headers={**(decision.headers or {}),
                                                               "Retry-After": str(decision.retry_after_s)})
        counts = None
        if key.tpm is not None and counted.group(3) != "infer":
            raw, strip = ask_for_counts(raw)
            counts = TokenCounts(await self.counts_cumulative(counted.group(1)), strip)
        try:
            return await self.relay(request, raw, counts)
        finally:
            self.limiter.finish(key, counts.total() if counts else 0)

    async def relay(self, request: web.Request, raw: bytes, counts: TokenCounts | None = None) -> web.StreamResponse:
        """Pass the call on as it is (`counts`: read the token counts of a generate answer, and take out those the
        relay asked for)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        try:
            # The client's own Accept-Encoding or none: aiohttp's default one made Triton gzip answers that
            # perf_analyzer (libcurl, no decoding) then could not read.
            upstream = await self.session().request(request.method, self.upstream + request.path_qs, data=raw,
                                                    headers=headers, skip_auto_headers=("Accept-Encoding",))
        except (ClientError, OSError) as e:
            return triton_error(503, f"the inference server is not available: {e}")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED})
            streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            if counts is not None and upstream.status == 200 and not streamed:
                body = counts.body(await upstream.read())
                response.content_length = len(body)
                await response.prepare(request)
                await response.write(body)
                await response.write_eof()
                return response
            if upstream.headers.get("Content-Length") is not None:
                response.content_length = int(upstream.headers["Content-Length"])
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():    # each server-sent event as soon as Triton sends it
                    await response.write(counts.events(chunk) if counts is not None and streamed else chunk)
                rest = counts.events(b"", end=True) if counts is not None and streamed else b""
                if rest:
                    await response.write(rest)
            except ClientError as e:
                # tritonserver went away mid-answer (a crash, a restart): one log line, and the client learns it as
                # it would from Triton, an error event in a stream, a cut connection otherwise
                log.warning("relay: tritonserver ended %s mid-answer: %s: %s", request.path, type(e).__name__, e)
                if response.content_type == "text/event-stream":
                    await response.write(f"data: {json.dumps({'error': 'the inference server went away mid-answer'})}"
                                         "\n\n".encode())
                elif request.transport is not None:
                    request.transport.close()
                    return response
            await response.write_eof()
        return response
