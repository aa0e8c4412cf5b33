"""What request tracing costs, in one run on one server: OpenAI streams through the front door with every request
traced (a door tracing to an OTLP receiver on loopback, tritonserver's trace level TIMESTAMPS, the engine's spans)
against the same streams with tracing off (a door without tracing, tritonserver's level OFF, so the engine traces
nothing either). The time to first token at concurrency 1 (the two modes alternating) and the output throughput of
a burst of `--streams` streams (off, on, on, off, `--rounds` times, after a burst of each not counted).

    .venv/bin/python perf/trace_overhead.py [--model-dir hf_models/anchor] [--requests 40] [--streams 48]

Prompts are the anchor profile's kind (64 tokens), `--max-tokens` each, ignore_eos. Prints each mode's TTFT p50
and mean, the throughput ratio on / off, and the engine spans the receiver got (one per traced request).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import DEFAULT_MODEL_DIR, REPO  # noqa: E402
from workload import Profile, PromptMaker, make_items  # noqa: E402


async def stream(session, door: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streamed /v1/completions: seconds to the first text, and the output tokens (its usage chunk)."""
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with session.post(f"{door}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("text") for c in chunk.get("choices", ())):
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, tokens


async def run(doors: dict[str, str], set_mode, prompts: list[str], args) -> dict:
    import aiohttp
    out = {mode: {"ttft": [], "tok_s": []} for mode in doors}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for mode, door in doors.items():       # warm-up, not counted: one burst each
            set_mode(mode)
            await asyncio.gather(*(stream(session, door, prompts[j % len(prompts)], args.max_tokens)
                                   for j in range(args.streams)))
        for i in range(args.requests):         # concurrency 1, alternating
            for mode, door in (doors.items() if i % 2 == 0 else reversed(doors.items())):
                set_mode(mode)
                out[mode]["ttft"].append((await stream(session, door, prompts[i % len(prompts)], 8))[0])
        for mode in (list(doors) + list(reversed(doors))) * args.rounds:    # throughput: off on on off, ...
            set_mode(mode)
            start = time.perf_counter()
            results = await asyncio.gather(*(stream(session, doors[mode], prompts[j % len(prompts)], args.max_tokens)
                                             for j in range(args.streams)))
            out[mode]["tok_s"].append(sum(n for _, n in results) / (time.perf_counter() - start))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--requests", type=int, default=40, help="TTFT requests per mode")
    ap.add_argument("--streams", type=int, default=48, help="streams of each throughput burst")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="throughput bursts: off on on off, this many times")
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "trace-overhead"))
    args = ap.parse_args()
    import tritonclient.http as httpclient
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    from trellm_backend.tools.otlp_receiver import OtlpReceiver
    from trellm_backend.tools.testbed import free_ports, private_repository
    repo = private_repository(os.path.join(REPO, "model_repository"), os.path.join(args.out, "model_repository"),
                              {"llm": {"enable_prefix_caching": "false"}}, model_dir=args.model_dir)
    prompts = [item.prompt for item in make_items(PromptMaker(args.model_dir), Profile("trace", [1], [1], (64, 64),
                                                                                         (8, 8)), 16, 0)]
    with OtlpReceiver(decode_json=False) as receiver:    # a collector would parse elsewhere, not on these cores
        *server_ports, off_port, on_port = free_ports(5)
        server = TritonServer(repo, *server_ports, log_path=os.path.join(args.out, "server.log"),
                              otlp_traces_endpoint=receiver.endpoint + "/v1/traces")
        server.start()
        doors = {"off": start_front_door(server, off_port, None, traced=False),
                 "on": start_front_door(server, on_port, None)}
        admin = httpclient.InferenceServerClient(server.http_url)

        def set_mode(mode: str) -> None:
            admin.update_trace_settings(settings={"trace_level": ["TIMESTAMPS" if mode == "on" else "OFF"]})

        try:
            out = asyncio.run(run({"off": f"http://127.0.0.1:{off_port}", "on": f"http://127.0.0.1:{on_port}"},
                                  set_mode, prompts, args))
            time.sleep(2)     # the last spans' export
        finally:
            for door in doors.values():
                stop_front_door(door)
            server.stop()
        engine_spans = sum(s.name == "llm_request" for s in receiver.spans)
        door_spans = sum(s.service == "trellm-openai" for s in receiver.spans)
    for mode, o in out.items():
        print(f"tracing {mode:3s}  TTFT p50 {statistics.median(o['ttft']) * 1e3:7.2f} ms, mean "
              f"{statistics.mean(o['ttft']) * 1e3:7.2f} ms; {args.streams} streams: "
              f"{', '.join(f'{t:.1f}' for t in o['tok_s'])} out tok/s")
    d_ttft = (statistics.median(out["on"]["ttft"]) - statistics.median(out["off"]["ttft"])) * 1e3
    ratio = statistics.mean(out["on"]["tok_s"]) / statistics.mean(out["off"]["tok_s"])
    traced = args.requests + (1 + 2 * args.rounds) * args.streams
    print(f"tracing on: TTFT p50 {d_ttft:+.2f} ms at concurrency 1; throughput {ratio:.3f}x of off at "
          f"{args.streams} streams; spans received: {engine_spans} engine, {door_spans} door, "
          f"{receiver.json_posts} posts from tritonserver ({traced} requests traced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
