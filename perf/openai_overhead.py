"""What the OpenAI front door adds to the time to first token at concurrency 1: the same requests sent one at a time,
alternating between the ensemble over gRPC and the front door, on one server, so both see the same machine.

    .venv/bin/python perf/openai_overhead.py [--model-dir hf_models/anchor] [--requests 40]

Prints the p50 and mean TTFT of each path and their difference. Throughput at 48 streams comes from
perf/benchmark.py --model ensemble,openai:ensemble (docs/openai.md).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

import grpc_load  # noqa: E402
from benchmark import DEFAULT_MODEL_DIR, REPO  # noqa: E402
from workload import Profile, PromptMaker, make_items  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--requests", type=int, default=40, help="requests per path")
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "openai-overhead"))
    args = ap.parse_args()
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    from trellm_backend.tools.testbed import free_ports, private_repository
    repo = private_repository(os.path.join(REPO, "model_repository"), os.path.join(args.out, "model_repository"),
                              {"llm": {"enable_prefix_caching": "false"}}, model_dir=args.model_dir)
    *server_ports, port = free_ports(4)
    server = TritonServer(repo, *server_ports, log_path=os.path.join(args.out, "server.log"))
    server.start()
    door = start_front_door(server, port, None)
    items = make_items(PromptMaker(args.model_dir), Profile("ttft", [1], [1], (64, 64), (8, 8)), args.requests + 2,
                       0)
    ttft: dict[str, list[float]] = {"gRPC ensemble": [], "OpenAI front door": []}

    async def measure():
        """One connection per path for all requests (as an SDK keeps its connection), alternating paths."""
        import aiohttp
        import tritonclient.grpc.aio as grpc
        client = grpc.InferenceServerClient(server.grpc_url)
        async with aiohttp.ClientSession() as session:
            try:
                for i, item in enumerate(items):
                    grpc_side = await grpc_load._one(client, grpc, "ensemble", item, True, 0.0, False)
                    door_side = await grpc_load._one_openai(session, f"http://localhost:{port}", "ensemble", item,
                                                            True, 0.0)
                    for name, t in (("gRPC ensemble", grpc_side), ("OpenAI front door", door_side)):
                        assert t.error is None, t.error
                        if i >= 2:       # the first two warm both paths
                            ttft[name].append(t.ttft * 1e3)
            finally:
                await client.close()
    try:
        asyncio.run(measure())
    finally:
        stop_front_door(door)
        server.stop()
    for name, values in ttft.items():
        print(f"{name:18s} TTFT p50 {statistics.median(values):6.1f} ms  mean {statistics.mean(values):6.1f} ms  "
              f"({len(values)} requests of 64 prompt tokens, concurrency 1)")
    a, b = (statistics.median(v) for v in ttft.values())
    print(f"added by the front door: {b - a:+.1f} ms at p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
