"""One benchmark command: the seeds' three load profiles against a Triton server (gRPC streaming to the `ensemble`),
optionally with Hugging Face transformers baselines on the same model and requests.

    .venv/bin/python perf/benchmark.py --url localhost:8001 [--profiles low,high,variable] [--baselines]
    .venv/bin/python perf/benchmark.py --start-server --model-dir hf_models/llama-40m --baselines   # own server
    .venv/bin/python perf/benchmark.py --start-server --smoke                                        # CI-sized

Profiles: low (1, 2, 4 concurrent users), high (64, 128), variable (seeded prompts of 16-2048 tokens and outputs
of 16-512 tokens, all in flight at once). Prints a table of TTFT, inter-token latency and end-to-end latency
(p50/p95/p99), output tokens/s, requests/s and peak KV use; writes benchmark.json and two PNG plots to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import socket
import sys
import time

# The launcher runs the server's torch with sleeping idle OpenMP workers; the baselines in this process get the
# same setting (it must be set before torch loads), and spinning workers would also steal the server's cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpc_load  # noqa: E402
import report  # noqa: E402
from workload import PromptMaker, make_items, profiles  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(REPO, "hf_models", "tiny-llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repository_for(src: str, model_dir: str, dest: str, llm_params: dict[str, str]) -> str:
    """A copy of the model repository `src` whose models read `model_dir`, with `llm_params` set in the llm
    model's parameters (config.pbtxt edited through protobuf, as add_model does)."""
    from trellm_backend.tools.repository import read_config, set_parameters, write_config
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in os.listdir(dest):
        path = os.path.join(dest, name, "config.pbtxt")
        if not os.path.isfile(path):
            continue
        cfg = read_config(path)
        set_parameters(cfg, {"model_path": os.path.abspath(model_dir)}, only_existing=True)
        if name == "llm":
            set_parameters(cfg, llm_params)
        write_config(path, cfg)
    return dest


async def measure(args, plan, send_min_tokens: bool) -> list[dict]:
    levels = []
    total = sum(len(items) for _, _, items in plan)
    with tqdm(total=total, unit="req", desc="benchmark", file=sys.stderr, disable=args.no_progress) as bar:
        # One short request first: the first request of a fresh server pays one-off costs.
        warmup = dataclasses.replace(plan[0][2][0], output_tokens=4)
        await grpc_load.run_level(args.url, args.model, [warmup], 1, send_min_tokens)
        for name, concurrency, items in plan:
            bar.set_postfix_str(f"{name} c={concurrency}")
            timings, wall, kv_peak = await grpc_load.run_level(args.url, args.model, items, concurrency,
                                                                send_min_tokens, args.metrics_url, bar.update)
            levels.append(report.summarize(name, concurrency, timings, wall, kv_peak))
    return levels


def run_baselines(args, levels: list[dict], plan) -> list[dict]:
    import hf_baselines
    name = args.baseline_profile
    index = next(i for i, (n, _, _) in enumerate(plan) if n == name)
    level, items = levels[index], plan[index][2]
    # The server's own output counts, so both sides make the same tokens even where it stopped early.
    requests = [(item.prompt_ids, t["output_tokens"]) for item, t in zip(items, level["timings"])
                if t["error"] is None and t["output_tokens"] > 0]
    results = hf_baselines.run_all(args.model_dir, requests, args.static_batch_size)
    return [{"name": r.name, "profile": name, "wall_s": r.wall_s, "output_tokens": r.output_tokens,
             "output_tok_s": r.output_tok_s, "server_ratio": level["output_tok_s"] / r.output_tok_s}
            for r in results]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address (ignored with --start-server)")
    ap.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default: same host, port 8002)")
    ap.add_argument("--model", default="ensemble", help="the entry point to load (TRT-LLM-shaped tensors)")
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                    help="the served model's Hugging Face folder: tokenizer for prompts, weights for baselines")
    ap.add_argument("--profiles", default="low,high,variable")
    ap.add_argument("--smoke", action="store_true", help="a few short requests per profile (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variable-requests", type=int, default=48)
    ap.add_argument("--variable-concurrency", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out"))
    ap.add_argument("--start-server", action="store_true",
                    help="start tritonserver on free ports for --model-dir (a repository copy under --out)")
    ap.add_argument("--model-repository", default=os.path.join(REPO, "model_repository"),
                    help="with --start-server: the repository to copy and serve")
    ap.add_argument("--llm-param", action="append", default=[], metavar="KEY=VALUE",
                    help="with --start-server: an llm engine setting, e.g. kv_cache_bytes=1073741824")
    ap.add_argument("--baselines", action="store_true", help="also run transformers on the same requests")
    ap.add_argument("--baseline-profile", default="variable")
    ap.add_argument("--static-batch-size", type=int, default=8)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    unknown = set(args.profiles.split(",")) - {"low", "high", "variable"}
    if unknown:
        ap.error(f"--profiles: unknown {sorted(unknown)}; choose from low, high, variable")
    if args.baselines and args.baseline_profile not in args.profiles.split(","):
        ap.error(f"--baseline-profile {args.baseline_profile} is not among --profiles")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    server = None
    if args.start_server:
        from trellm_backend.tools.launch import TritonServer
        llm_params = dict(p.split("=", 1) for p in args.llm_param)
        repo = repository_for(args.model_repository, args.model_dir, os.path.join(args.out, "model_repository"),
                              llm_params)
        ports = [free_port() for _ in range(3)]
        server = TritonServer(repo, *ports, log_path=os.path.join(args.out, "server.log"))
        print(f"starting tritonserver on {repo} (log: {server.log_path})", file=sys.stderr)
        server.start()
        args.url, args.metrics_url = server.grpc_url, f"http://localhost:{ports[2]}/metrics"
    if args.metrics_url is None:
        args.metrics_url = f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    try:
        maker = PromptMaker(args.model_dir)
        chosen = profiles(args.smoke, args.variable_requests, args.variable_concurrency)
        plan = [(name, c, make_items(maker, chosen[name], n, args.seed))
                for name in args.profiles.split(",")
                for c, n in zip(chosen[name].concurrency, chosen[name].requests_per_level)]
        send_min_tokens = "min_tokens" in asyncio.run(grpc_load.model_inputs(args.url, args.model))
        started = time.time()
        levels = asyncio.run(measure(args, plan, send_min_tokens))
    finally:
        if server is not None:
            server.stop()   # before the baselines, which want the cores to themselves
    baselines = run_baselines(args, levels, plan) if args.baselines else []

    doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "argv": sys.argv[1:],
           "model_dir": os.path.abspath(args.model_dir), "entry_point": args.model, "seed": args.seed,
           "min_tokens_sent": send_min_tokens, "kv_gauges": grpc_load.KV_USAGE_GAUGES, "cpu_count": os.cpu_count(),
           "levels": levels, "baselines": baselines}
    json_path = os.path.join(args.out, "benchmark.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    pngs = report.plot(levels, os.path.join(args.out, ""))
    print(report.table(levels, baselines))
    if not send_min_tokens:
        print(f"\nnote: {args.model} has no min_tokens input: answers may end before max_tokens at EOS; "
              "output tokens are the server's counts")
    print(f"\nwrote {json_path}, {', '.join(pngs)}")
    return 1 if any(lv["errors"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
