"""Offline engine throughput, without Triton: how many tokens per second the engine generates for a batch of
requests, and what share of each step the scheduler and batch preparation take next to the model.

    python perf/bench_engine.py [--model hf_models/tiny-llama] [--requests 64] [--prompt-len 128] [--gen-len 64]

Prints one line per run; use ratios from one run when comparing settings on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from trellm_backend.config import EngineConfig
from trellm_backend.engine import LLMEngine
from trellm_backend.request import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model_path=args.model, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    engine.generate([torch.randint(10, vocab, (16,), generator=g).tolist()], params)   # warm-up

    for i in range(args.requests):
        engine.add_request(str(i), torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist(), params)
    model_time = 0.0
    execute = engine.runner.model.forward

    def timed_forward(*a, **k):
        nonlocal model_time
        t = time.perf_counter()
        r = execute(*a, **k)
        model_time += time.perf_counter() - t
        return r

    engine.runner.model.forward = timed_forward
    steps, generated = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - start
    print(f"requests={args.requests} prompt={args.prompt_len} gen={args.gen_len} steps={steps} "
          f"wall={wall:.2f}s output_tok/s={generated / wall:.1f} "
          f"total_tok/s={(generated + args.requests * args.prompt_len) / wall:.1f} "
          f"model_share={model_time / wall:.1%} overhead_per_step_ms={(wall - model_time) / steps * 1e3:.2f}")


if __name__ == "__main__":
    main()
