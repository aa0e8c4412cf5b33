"""How many sequences one KV budget holds at once, per KV cache dtype (issue 17): the engine alone, a fixed
`kv_cache_bytes`, more requests than fit, every request prompt-len + gen-len tokens; the peak of sequences running
together is counted in the engine's steps (not computed), beside the pool's blocks and bytes per block.

    .venv/bin/python perf/bench_kv_capacity.py --model hf_models/anchor [--kv-cache-bytes 134217728]
        [--dtypes float32,bfloat16] [--kv-dtypes auto,int8,fp8_e4m3] [--requests 120]

INT8 and FP8 store one byte per value plus a float16 scale per token and KV head (kernels/kv_cache.py), so the
ratio to `auto` is 4 D / (D + 2) against float32 and 2 D / (D + 2) against bfloat16, rounded down to whole blocks
and whole sequences.
"""
from __future__ import annotations

import argparse
import os
import time

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402

from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from trellm_backend.engine.limits import kv_bytes_per_block  # noqa: E402
from trellm_backend.engine.request import SamplingParams  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_running(engine: LLMEngine, requests: int, prompt_len: int, gen_len: int) -> tuple[int, int, float]:
    """(most sequences running in one step, preemptions, seconds) for `requests` requests sent at once."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(str(i), torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak, engine.num_preemptions, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "anchor"))
    ap.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes (the llm parameter dtype)")
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--gen-len", type=int, default=64)
    args = ap.parse_args()
    print(f"{args.model}: kv_cache_bytes={args.kv_cache_bytes}, {args.requests} requests of {args.prompt_len} + "
          f"{args.gen_len} tokens sent at once")
    print(f"{'dtype':<10}{'kv':<10}{'bytes/block':>12}{'blocks':>8}{'tokens':>9}{'peak seqs':>11}{'vs auto':>9}"
          f"{'preempt':>9}{'seconds':>9}")
    for dtype in args.dtypes.split(","):
        base = None
        for kv in args.kv_dtypes.split(","):
            engine = LLMEngine(EngineConfig(model_path=args.model, dtype=dtype, kv_cache_dtype=kv,
                                            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.requests))
            r = engine.runner
            per_block = kv_bytes_per_block(engine.model_config, r.block_size, r.kv_dtype)
            peak, preempted, seconds = peak_running(engine, args.requests, args.prompt_len, args.gen_len)
            base = base or peak
            print(f"{dtype:<10}{kv:<10}{per_block:>12}{r.num_blocks:>8}{r.num_blocks * r.block_size:>9}{peak:>11}"
                  f"{peak / base:>8.2f}x{preempted:>9}{seconds:>9.1f}")
            del engine, r


if __name__ == "__main__":
    main()
