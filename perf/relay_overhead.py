"""What the front door's KServe v2 relay costs against Triton's own HTTP port, in one run on one server: the time to
first token at concurrency 1 (requests alternating between the two paths) and the output throughput of a burst of
streams at `--concurrency` (the two paths in turn, twice, A B B A).

    .venv/bin/python perf/relay_overhead.py [--model-dir hf_models/anchor] [--requests 40] [--concurrency 16]

Both paths send the same /v2/models/ensemble/generate_stream bodies (64-token prompts of the anchor profile's
kind, `--max-tokens` each, ignore_eos) and read the server-sent events as they come. Prints each path's TTFT p50 and
mean, their difference, each path's output tokens a second and the ratio door / direct.
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


async def stream(session, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One generate_stream: seconds to the first event with text, and the output tokens it got (num_output_tokens:
    an event may carry several)."""
    body = {"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "return_num_output_tokens": True}
    start, first, tokens = time.perf_counter(), None, 0
    async with session.post(f"http://{url}/v2/models/ensemble/generate_stream", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                tokens = max(tokens, int(event.get("num_output_tokens") or 0))
                if first is None and event.get("text_output"):
                    first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, tokens


async def run(paths: dict[str, str], prompts: list[str], args) -> dict:
    import aiohttp
    out = {name: {"ttft": [], "tok_s": []} for name in paths}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name, url in paths.items():      # warm-up, not counted
            await stream(session, url, prompts[0], 4)
        for i in range(args.requests):       # concurrency 1, alternating
            for name, url in (paths.items() if i % 2 == 0 else reversed(paths.items())):
                out[name]["ttft"].append((await stream(session, url, prompts[i % len(prompts)], 8))[0])
        order = list(paths) + list(reversed(paths))
        for name in order:                   # throughput at --concurrency, A B B A
            start = time.perf_counter()
            results = await asyncio.gather(*(stream(session, paths[name], prompts[j % len(prompts)], args.max_tokens)
                                             for j in range(args.streams)))
            out[name]["tok_s"].append(sum(n for _, n in results) / (time.perf_counter() - start))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--requests", type=int, default=40, help="TTFT requests per path")
    ap.add_argument("--streams", type=int, default=48, help="streams of each throughput burst")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "relay-overhead"))
    args = ap.parse_args()
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    from trellm_backend.tools.testbed import free_ports, private_repository
    repo = private_repository(os.path.join(REPO, "model_repository"), os.path.join(args.out, "model_repository"),
                              {"llm": {"enable_prefix_caching": "false"}}, model_dir=args.model_dir)
    *server_ports, port = free_ports(4)
    server = TritonServer(repo, *server_ports, log_path=os.path.join(args.out, "server.log"),
                          extra_args=["--http-address=127.0.0.1"])
    server.start()
    door = start_front_door(server, port, None)
    prompts = [item.prompt for item in make_items(PromptMaker(args.model_dir), Profile("relay", [1], [1], (64, 64),
                                                                                         (8, 8)), 16, 0)]
    try:
        paths = {"Triton HTTP (loopback)": f"127.0.0.1:{server.http_port}", "front door relay": f"127.0.0.1:{port}"}
        out = asyncio.run(run(paths, prompts, args))
    finally:
        stop_front_door(door)
        server.stop()
    (direct, relayed) = out.values()
    for name, o in out.items():
        print(f"{name:24s} TTFT p50 {statistics.median(o['ttft']) * 1e3:7.2f} ms, mean "
              f"{statistics.mean(o['ttft']) * 1e3:7.2f} ms; {args.streams} streams: "
              f"{', '.join(f'{t:.1f}' for t in o['tok_s'])} out tok/s")
    d_ttft = (statistics.median(relayed["ttft"]) - statistics.median(direct["ttft"])) * 1e3
    ratio = statistics.mean(relayed["tok_s"]) / statistics.mean(direct["tok_s"])
    print(f"relay: TTFT p50 +{d_ttft:.2f} ms at concurrency 1; throughput {ratio:.3f}x of direct at {args.streams} "
          "streams")
    return 0


if __name__ == "__main__":
    sys.exit(main())
