"""What the front door's KServe v2 relays cost against Triton's own ports, in one run on one server: the time to
first token at concurrency 1 (requests alternating between the two paths) and the output throughput of a burst of
`--streams` streams (the two paths in turn, twice, A B B A).

    .venv/bin/python perf/relay_overhead.py [--protocol http|grpc] [--model-dir hf_models/anchor] [--requests 40]
                                            [--streams 48]

HTTP: both paths send the same /v2/models/ensemble/generate_stream bodies and read the server-sent events as they
come. gRPC: both paths open one ModelStreamInfer per request with tritonclient.grpc.aio (the relay with an API key,
as a client of a deployment would). Requests are 64-token prompts of the anchor profile's kind, `--max-tokens`
each, ignore_eos. Prints each path's TTFT p50 and mean, their difference, each path's output tokens a second and
the ratio door / direct.
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


async def grpc_stream(client, prompt: str, max_tokens: int, headers: dict | None) -> tuple[float, int]:
    """One ModelStreamInfer of one request: seconds to the first response with text, and the output tokens."""
    import numpy as np
    from tritonclient.grpc import aio

    def tensor(name, value):
        arr = np.array([[value]], dtype=object if isinstance(value, bytes) else None)
        t = aio.InferInput(name, list(arr.shape), {np.dtype(object): "BYTES", np.dtype(bool): "BOOL"}.get(
            arr.dtype, "INT32"))
        t.set_data_from_numpy(arr.astype(np.int32) if arr.dtype.kind == "i" else arr)
        return t

    async def requests():
        yield {"model_name": "ensemble", "inputs": [
            tensor("text_input", prompt.encode()), tensor("max_tokens", max_tokens), tensor("ignore_eos", True),
            tensor("stream", True), tensor("return_num_output_tokens", True)]}
    start, first, tokens = time.perf_counter(), None, 0
    async for result, error in client.stream_infer(requests(), headers=headers):
        if error is not None:
            raise RuntimeError(str(error))
        tokens = max(tokens, int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
        if first is None and result.as_numpy("text_output").reshape(-1)[0]:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, tokens


async def run(paths: dict[str, str], prompts: list[str], args) -> dict:
    if args.protocol == "grpc":
        return await run_grpc(paths, prompts, args)
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


async def run_grpc(paths: dict[str, tuple[str, dict | None]], prompts: list[str], args) -> dict:
    """run() over gRPC: `paths` maps a name to (address, headers)."""
    from tritonclient.grpc import aio
    out = {name: {"ttft": [], "tok_s": []} for name in paths}
    clients = {name: (aio.InferenceServerClient(url), headers) for name, (url, headers) in paths.items()}
    try:
        for name, (client, headers) in clients.items():     # warm-up, not counted
            await grpc_stream(client, prompts[0], 4, headers)
        for i in range(args.requests):                        # concurrency 1, alternating
            for name in (list(clients) if i % 2 == 0 else list(reversed(clients))):
                client, headers = clients[name]
                out[name]["ttft"].append((await grpc_stream(client, prompts[i % len(prompts)], 8, headers))[0])
        for name in list(clients) + list(reversed(clients)):  # throughput at --streams, A B B A
            client, headers = clients[name]
            start = time.perf_counter()
            results = await asyncio.gather(*(grpc_stream(client, prompts[j % len(prompts)], args.max_tokens, headers)
                                             for j in range(args.streams)))
            out[name]["tok_s"].append(sum(n for _, n in results) / (time.perf_counter() - start))
    finally:
        for client, _ in clients.values():
            await client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=("http", "grpc"), default="http")
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
    *server_ports, port, grpc_port = free_ports(5)
    server = TritonServer(repo, *server_ports, log_path=os.path.join(args.out, "server.log"))
    server.start()
    keys = os.path.join(args.out, "keys.txt")
    with open(keys, "w") as f:
        f.write("sk-relay-overhead name=relay-overhead\n")
    door = start_front_door(server, port, keys if args.protocol == "grpc" else None, grpc_port=grpc_port)
    prompts = [item.prompt for item in make_items(PromptMaker(args.model_dir), Profile("relay", [1], [1], (64, 64),
                                                                                         (8, 8)), 16, 0)]
    try:
        if args.protocol == "grpc":
            paths = {"Triton gRPC (loopback)": (f"127.0.0.1:{server.grpc_port}", None),
                     "front door gRPC relay": (f"127.0.0.1:{grpc_port}", {"authorization": "Bearer sk-relay-overhead"})}
        else:
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
