"""Quantized weights and KV cache side by side, in one run (issue 17): for each setting, the memory the weights
take, the KV bytes per token and how many sequences one KV budget holds, then output tok/s and TTFT of the engine
alone on the anchor profile's requests and on the variable profile's (perf/workload.py).

    .venv/bin/python perf/bench_quantization.py [--model hf_models/anchor] [--kv-cache-bytes 2147483648]
        [--settings none/auto,int8/auto,int4/auto,none/int8,int8/int8] [--profiles anchor,variable]

A setting is `quantization/kv_cache_dtype`. "sequences in budget" is how many sequences of the profile's longest
request (prompt + output) the KV pool holds at once: blocks / blocks per sequence, as the scheduler counts them.
Settings run one after another in this order; on a shared machine compare ratios from one run.
"""
from __future__ import annotations

import argparse
import os

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402

from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from trellm_backend.engine.limits import kv_bytes_per_block  # noqa: E402
from trellm_backend.engine.request import SamplingParams  # noqa: E402

from workload import PromptMaker, make_items, profiles, run_at_once  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from `obj` through attributes, lists and dicts, each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = id(obj) if obj.is_mkldnn else obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(o, seen) for o in vars(obj).values())
    return 0


def run_items(engine: LLMEngine, items) -> tuple[float, float]:
    """(output tok/s, mean TTFT s) of `items` sent at once."""
    run = run_at_once(engine, [(it.prompt_ids, it.output_tokens) for it in items])
    return run.output_tokens / run.wall_s, sum(run.first_token_s) / len(run.first_token_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "anchor"))
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    ap.add_argument("--settings", default="none/auto,int8/auto,int4/auto,none/int8,int8/int8")
    ap.add_argument("--profiles", default="anchor,variable")
    ap.add_argument("--requests", type=int, default=48, help="requests of each profile, all sent at once")
    args = ap.parse_args()
    maker = PromptMaker(args.model)
    workloads = {name: make_items(maker, profiles()[name], args.requests, 0) for name in args.profiles.split(",")}
    print(f"{args.model}: kv_cache_bytes={args.kv_cache_bytes}; {args.requests} requests of each profile at once")
    print(f"{'setting':<12}{'weights MiB':>12}{'KV B/token':>11}" + "".join(
        f"{name + ' seqs':>15}{'tok/s':>8}{'TTFT s':>8}" for name in workloads))
    base = None
    for setting in args.settings.split(","):
        quantization, kv_dtype = setting.split("/")
        engine = LLMEngine(EngineConfig(model_path=args.model, quantization=quantization, kv_cache_dtype=kv_dtype,
                                        kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=256))
        r = engine.runner
        weights = tensor_bytes(r.model) / 2**20
        per_token = kv_bytes_per_block(engine.model_config, r.block_size, r.kv_dtype) / r.block_size
        g = torch.Generator().manual_seed(0)
        engine.generate([torch.randint(10, engine.model_config.vocab_size, (16,), generator=g).tolist()],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))      # warm-up
        row = f"{setting:<12}{weights:>12.1f}{per_token:>11.0f}"
        figures = []
        for items in workloads.values():
            longest = max(len(it.prompt_ids) + it.output_tokens for it in items)
            seqs = r.num_blocks // -(-longest // r.block_size)
            tok_s, ttft = run_items(engine, items)
            figures.append(tok_s)
            row += f"{seqs:>15}{tok_s:>8.1f}{ttft:>8.2f}"
        base = base or figures
        print(row + "   tok/s vs first: " + " ".join(f"{f / b:.2f}x" for f, b in zip(figures, base)), flush=True)
        del engine, r


if __name__ == "__main__":
    main()
