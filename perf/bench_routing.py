"""Routing in front of replicas (issue 31): two replicas of the model, each a tritonserver with its OpenAI front
door, behind SGLang's router (sglang-router, its own environment .venv-router), once with its `round_robin` policy
and once with `cache_aware`, on a multi-tenant workload whose tenants share long system prompts.

    .venv/bin/python perf/bench_routing.py [--model-dir hf_models/tiny-llama] [--tenants 16] [--requests 128]
        [--prefix-tokens 512] [--concurrency 8] [--kv-prefixes 10] [--router-python .venv-router/bin/python]

Each replica's KV cache holds about `--kv-prefixes` tenants' prompts, fewer than the tenants: a router that sends
every tenant to both replicas makes each evict what the next request needs, one that keeps a tenant on one replica
lets each hold its share. Prints, per policy: the prefix-cache hit rate over both replicas (hit tokens / queried
tokens, the engines' vllm: counters), TTFT p50/p99 at the client, requests per replica, and the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door  # noqa: E402
from trellm_backend.tools.testbed import free_ports, metric_samples, private_repository  # noqa: E402
from workload import PromptMaker  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("round_robin", "cache_aware")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total")


def counters(metrics_port: int) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for s in metric_samples(metrics_port):
        if s.name in out:
            out[s.name] += s.value
    return out


def start_router(python: str, policy: str, workers: list[str]) -> tuple[subprocess.Popen, str]:
    port, prometheus_port = free_ports(2)
    proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-port", str(prometheus_port), "--policy", policy, "--log-level", "warn",
                             "--worker-urls", *workers],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the router ({policy}) did not start (exit {proc.poll()})")
        time.sleep(0.5)


async def one(session, url: str, prompt: str, max_tokens: int) -> float:
    """TTFT (s) of one streamed completion through the router."""
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"no streamed chunk from {url}")
    return first


async def run(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[float]:
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def bounded(p):
            async with sem:
                return await one(session, url, p, max_tokens)
        return await asyncio.gather(*(bounded(p) for p in prompts))


def workload(maker: PromptMaker, seed: int, tenants: int, requests: int, prefix_tokens: int) -> list[str]:
    """`requests` prompts, each a tenant's system prompt (shared by its requests) and a question of its own, the
    tenants in a random order."""
    rng = random.Random(seed)
    systems = [maker.prompt(rng, prefix_tokens)[0] for _ in range(tenants)]
    return [systems[rng.randrange(tenants)] + "\n\nQuestion: " + maker.prompt(rng, 24)[0] for _ in range(requests)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-prefixes", type=float, default=10, help="each replica's KV cache, in tenants' prompts")
    ap.add_argument("--router-python", default=os.path.join(REPO, ".venv-router", "bin", "python"))
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "routing"))
    args = ap.parse_args()
    if not os.path.exists(args.router_python):
        ap.error(f"no router environment at {args.router_python}: scripts/setup.sh makes it")
    with open(os.path.join(args.model_dir, "config.json")) as f:
        mc = json.load(f)
    head_dim = mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]
    per_token = 2 * mc["num_hidden_layers"] * mc["num_key_value_heads"] * head_dim * 4       # float32 K and V
    kv_bytes = int(args.kv_prefixes * (args.prefix_tokens + 64) * per_token)
    maker = PromptMaker(args.model_dir)
    servers, doors, workers = [], [], []
    os.makedirs(args.out, exist_ok=True)
    try:
        for i in range(2):
            repo = private_repository(os.path.join(REPO, "model_repository"), os.path.join(args.out, f"repo{i}"),
                                      {"llm": {"kv_cache_bytes": str(kv_bytes),
                                               "max_model_len": str(args.prefix_tokens + 128)}},
                                      model_dir=args.model_dir)
            server = TritonServer(repo, *free_ports(3), log_path=os.path.join(args.out, f"server{i}.log")).start()
            servers.append(server)
            [port] = free_ports(1)
            doors.append(start_front_door(server, port, None))
            workers.append(f"http://127.0.0.1:{port}")
        print(f"2 replicas of {args.model_dir}, KV cache {kv_bytes / 2**20:.1f} MiB each (~{args.kv_prefixes:g} "
              f"tenants' prompts); {args.tenants} tenants, {args.requests} requests, {args.concurrency} at a time",
              flush=True)
        results = {}
        for n, policy in enumerate(POLICIES):
            prompts = workload(maker, n, args.tenants, args.requests, args.prefix_tokens)   # fresh per policy
            before = [counters(s.metrics_port) for s in servers]
            router, url = start_router(args.router_python, policy, workers)
            try:
                ttft = asyncio.run(run(url, prompts, args.concurrency, args.max_tokens))
            finally:
                router.terminate()
                router.wait(10)
            # A replica counts a request as it finishes, which can come just after its last response reaches the
            # client: read the counters until every request is in them (or 10 s have passed).
            deadline = time.monotonic() + 10
            while True:
                after = [counters(s.metrics_port) for s in servers]
                d = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
                if sum(x["vllm:request_success_total"] for x in d) >= len(prompts) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            queries = sum(x["vllm:prefix_cache_queries_total"] for x in d)
            hits = sum(x["vllm:prefix_cache_hits_total"] for x in d)
            load = [int(x["vllm:request_success_total"]) for x in d]
            q = statistics.quantiles(ttft, n=100)
            results[policy] = dict(hit_rate=hits / queries if queries else 0.0, ttft_p50_ms=1e3 * q[49],
                                   ttft_p99_ms=1e3 * q[98], requests_per_replica=load)
            r = results[policy]
            print(f"{policy:12s} hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:.0f} ms  p99 "
                  f"{r['ttft_p99_ms']:.0f} ms  requests per replica {load}", flush=True)
        rr, ca = results["round_robin"], results["cache_aware"]
        load = ca["requests_per_replica"]
        print(f"cache_aware / round_robin: hit rate {ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, TTFT p50 "
              f"{ca['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x, p99 {ca['ttft_p99_ms'] / rr['ttft_p99_ms']:.2f}x; "
              f"cache_aware's busier replica took {max(load) / max(min(load), 1):.2f}x the other's requests")
        with open(os.path.join(args.out, "routing.json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "kv_cache_bytes": kv_bytes, "results": results}, f, indent=1)
    finally:
        for door in doors:
            stop_front_door(door)
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
