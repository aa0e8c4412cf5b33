"""Closed-loop load over Triton's gRPC streaming API (or the OpenAI front door's SSE streams): `concurrency`
clients, each sending its next request as soon as the previous one finished, timing every streamed response
(asyncio, one channel or HTTP session, one stream per request)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from trellm_backend.tools.testbed import metric_samples
from trellm_client.client import build_inputs, infer_input, llm_inputs

# vLLM's gauge of KV-cache use (a fraction, 0..1; newer vLLM names it kv_cache_usage_perc), read from the server's
# metrics endpoint when it exports one.
KV_USAGE_GAUGES = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")


@dataclass
class RequestTiming:
    prompt_tokens: int
    output_tokens: int          # the server's num_output_tokens, else the number of text responses
    requested_tokens: int
    start: float                # seconds since the level began
    ttft: float                 # first response - send
    e2e: float                  # last response - send
    itl: float | None           # (last - first) / (output_tokens - 1), genai-perf's inter-token latency
    error: str | None = None
    responses: int = 0          # responses (chunks) with text: fewer than output_tokens when the server merged some
    max_gap: float | None = None   # the longest wait between two of them: how smooth the stream was


async def model_inputs(url: str, model: str) -> set[str]:
    import tritonclient.grpc.aio as grpc
    client = grpc.InferenceServerClient(url)
    try:
        meta = await client.get_model_metadata(model, as_json=True)
    finally:
        await client.close()
    return {i["name"] for i in meta["inputs"]}


def _timing(item, start_offset: float, start: float, arrivals: list[float], num_output: int | None,
            error: str | None) -> RequestTiming:
    """One request's timing from the arrival times of its responses that carried text (and the server's count of
    output tokens, when it sent one)."""
    if error is not None:
        return RequestTiming(len(item.prompt_ids), 0, item.output_tokens, start_offset, float("nan"), float("nan"),
                             None, error)
    n = num_output if num_output is not None else len(arrivals)
    itl = (arrivals[-1] - arrivals[0]) / (n - 1) if n > 1 else None
    gap = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=None)
    return RequestTiming(len(item.prompt_ids), n, item.output_tokens, start_offset, arrivals[0] - start,
                         arrivals[-1] - start, itl, None, len(arrivals), gap)


async def _one(client, grpc, model: str, item, send_min_tokens: bool, t0: float, send_ids: bool) -> RequestTiming:
    fields = dict(max_tokens=item.output_tokens, stream=True, return_num_output_tokens=True,
                  min_tokens=item.output_tokens if send_min_tokens else None, lora_name=item.lora_name)
    if send_ids:   # `llm` directly: the prompt's token ids, no tokenizing step
        inputs = llm_inputs(grpc, item.prompt_ids, **fields)
        inputs.append(infer_input(grpc, "input_lengths", np.array([[len(item.prompt_ids)]], dtype=np.int32)))
    else:
        inputs = build_inputs(grpc, item.prompt, fields)

    async def requests():
        yield {"model_name": model, "inputs": inputs,
               "parameters": {"triton_enable_empty_final_response": True}}

    start = time.perf_counter()
    arrivals, num_output, error = [], None, None
    # Read to the call's end, which comes right after the final response: a call cancelled (or left by a break)
    # then can keep the ensemble loaded at the server's stop (client/client.py's AsyncLLMClient.stream_chunks).
    async for result, err in client.stream_infer(requests()):
        now = time.perf_counter()
        if err is not None:
            error = str(err)
            break
        text = result.as_numpy("text_output")
        if text is not None:
            arrivals.append(now)
        count = result.as_numpy("num_output_tokens")
        if count is not None:
            num_output = int(np.asarray(count).reshape(-1)[-1])
    if not arrivals and error is None:
        error = "no response with text_output"
    return _timing(item, start - t0, start, arrivals, num_output, error)


def read_gauge(metrics_url: str, names: tuple[str, ...] = KV_USAGE_GAUGES) -> float | None:
    """The largest sample of the first of `names` on a Prometheus text endpoint; None when absent/unreachable."""
    try:
        samples = metric_samples(metrics_url, timeout=2)
    except OSError:
        return None
    for name in names:
        values = [s.value for s in samples if s.name == name]
        if values:
            return max(values)
    return None


async def _watch_gauge(metrics_url: str | None, peak: list, stop: asyncio.Event) -> None:
    while metrics_url and not stop.is_set():
        value = await asyncio.to_thread(read_gauge, metrics_url)
        if value is None:    # no such gauge on this server: stop asking
            return
        peak[0] = value if peak[0] is None else max(peak[0], value)
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _one_openai(session, base_url: str, model: str, item, send_min_tokens: bool, t0: float,
                      extra_body: dict | None = None) -> RequestTiming:
    """The same request through the OpenAI front door (/v1/completions, streamed, usage in the last chunk);
    `extra_body`: fields a server needs beside the standard ones (llama-server's ignore_eos)."""
    import json
    body = {"model": item.lora_name or model, "prompt": item.prompt, "max_tokens": item.output_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {})}
    if send_min_tokens:
        body["min_tokens"] = item.output_tokens
    start = time.perf_counter()
    arrivals, num_output, error = [], None, None
    async with session.post(base_url + "/v1/completions", json=body) as r:
        if r.status != 200:
            error = f"HTTP {r.status}: {await r.text()}"
        else:
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    num_output = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and (chunk["choices"][0]["text"]
                                           or chunk["choices"][0].get("finish_reason") is None):
                    # A token's chunk, even one whose text is held back or empty (a skipped special token), as
                    # the gRPC path counts every response with text_output; not a closing chunk without text.
                    arrivals.append(now)
    if not arrivals and error is None:
        error = "no chunk with text"
    return _timing(item, start - t0, start, arrivals, num_output, error)


async def run_level(url: str, model: str, items: list, concurrency: int, send_min_tokens: bool,
                    metrics_url: str | None = None, on_done=None,
                    send_ids: bool = False, extra_body: dict | None = None, keep_alive: bool = True
                    ) -> tuple[list[RequestTiming], float, float | None]:
    """Send `items` with `concurrency` in flight; returns the timings (in item order), the wall time and the peak
    of KV_USAGE_GAUGES seen meanwhile (None when the server does not export it). `send_ids`: prompts as token ids
    (the `llm` model) instead of text. A `url` starting with http:// is an OpenAI server's (`extra_body`: fields
    added to each request; without `keep_alive` each request opens its own connection, for a server that closes
    one after a stream, as llama-server does)."""
    import aiohttp
    import tritonclient.grpc.aio as grpc
    openai = url.startswith("http://")
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                   connector=aiohttp.TCPConnector(limit=0, force_close=not keep_alive)) if openai \
        else grpc.InferenceServerClient(url)
    queue = list(enumerate(items))[::-1]
    timings: list[RequestTiming | None] = [None] * len(items)
    peak, stop = [None], asyncio.Event()

    async def user():
        while queue:
            index, item = queue.pop()
            timings[index] = await (_one_openai(client, url, model, item, send_min_tokens, t0, extra_body) if openai
                                    else _one(client, grpc, model, item, send_min_tokens, t0, send_ids))
            if on_done:
                on_done()

    t0 = time.perf_counter()
    watcher = asyncio.create_task(_watch_gauge(metrics_url, peak, stop))
    try:
        await asyncio.gather(*(user() for _ in range(min(concurrency, len(items)))))
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        await watcher
        await client.close()
    return timings, wall, peak[0]
