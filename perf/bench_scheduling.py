"""Scheduling benchmarks of the engine alone (no Triton), each an on/off comparison measured in one run:

1. prefix caching: requests that share a long system prompt, caching on vs off: output tokens/s and TTFT;
2. chunked prefill: a short request (and running streams) behind a 4k-token prompt, chunked prefill on vs off:
   the short request's TTFT and the longest pause of the running streams.

    python perf/bench_scheduling.py [--model hf_models/tiny-llama] [--repeats 2]

The model folder is copied with a longer `max_position_embeddings` for the 4k prompt (weights are linked, not
copied). Compare ratios from one run; absolute times on a shared CPU vary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def shared_prompt_run(model: str, caching: bool, args) -> dict:
    engine = LLMEngine(EngineConfig(model_path=model, enable_prefix_caching=caching))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    system = tokens(g, args.system_len, vocab)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    engine.generate([tokens(g, 8, vocab)], params)                       # warm-up, no shared prefix
    start = time.perf_counter()
    first: dict[str, float] = {}
    added: dict[str, float] = {}
    generated = 0
    for i in range(args.requests):                                       # one new request per step
        engine.add_request(str(i), system + tokens(g, args.tail_len, vocab), params)
        added[str(i)] = time.perf_counter() - start
        generated += _step(engine, first, start)
    while engine.has_unfinished():
        generated += _step(engine, first, start)
    wall = time.perf_counter() - start
    ttft = [first[str(i)] - added[str(i)] for i in range(args.requests)]
    return dict(output_tok_s=generated / wall, ttft_mean_ms=1e3 * statistics.mean(ttft),
                ttft_p50_ms=1e3 * statistics.median(ttft), hit_blocks=engine.kv.num_hits)


def _step(engine: LLMEngine, first: dict, start: float) -> int:
    n = 0
    for o in engine.step():
        n += len(o.new_token_ids)
        first.setdefault(o.request_id, time.perf_counter() - start)
    return n


def long_prompt_run(model: str, chunked: bool, args) -> dict:
    budget = 2048 if chunked else args.long_len + 64
    engine = LLMEngine(EngineConfig(model_path=model, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                                    enable_prefix_caching=False, max_model_len=args.long_len + 128))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    decode = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    engine.generate([tokens(g, args.long_len, vocab)], SamplingParams(max_tokens=1, temperature=0.0))  # warm-up
    for i in range(4):                                     # four streams already decoding
        engine.add_request(f"stream{i}", tokens(g, 32, vocab), decode)
    for _ in range(3):
        engine.step()
    arrival = time.perf_counter()                          # the short request arrives right behind the long one
    engine.add_request("long", tokens(g, args.long_len, vocab), SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("short", tokens(g, 16, vocab), SamplingParams(max_tokens=4, temperature=0.0))
    last = {f"stream{i}": arrival for i in range(4)}
    longest_pause, short_ttft, long_done = 0.0, None, False
    while short_ttft is None or not long_done:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in last:
                longest_pause = max(longest_pause, now - last[o.request_id])
                last[o.request_id] = now
            elif o.request_id == "short" and short_ttft is None:
                short_ttft = now - arrival
            elif o.request_id == "long":
                long_done = True
    return dict(short_ttft_ms=1e3 * short_ttft, longest_stream_pause_ms=1e3 * longest_pause)


def long_context_copy(model: str, max_positions: int) -> str:
    """A copy of the model folder allowing `max_positions` positions; large files are symlinked."""
    out = tempfile.mkdtemp(prefix="trellm-longctx-")
    for name in os.listdir(model):
        src = os.path.join(os.path.abspath(model), name)
        if name == "config.json":
            with open(src) as f:
                cfg = json.load(f)
            cfg["max_position_embeddings"] = max_positions
            with open(os.path.join(out, name), "w") as f:
                json.dump(cfg, f)
        else:
            os.symlink(src, os.path.join(out, name))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--tail-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    print(f"1) {args.requests} requests sharing a {args.system_len}-token system prompt (+{args.tail_len} own "
          f"tokens, {args.gen_len} generated), one arriving per step")
    for r in range(args.repeats):
        off, on = shared_prompt_run(args.model, False, args), shared_prompt_run(args.model, True, args)
        print(f"   run {r}: caching off {off['output_tok_s']:.0f} tok/s, TTFT mean {off['ttft_mean_ms']:.0f} ms | "
              f"on {on['output_tok_s']:.0f} tok/s, TTFT mean {on['ttft_mean_ms']:.0f} ms, {on['hit_blocks']} blocks "
              f"reused | throughput x{on['output_tok_s'] / off['output_tok_s']:.2f}, "
              f"TTFT x{off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f} shorter")

    model = long_context_copy(args.model, args.long_len + 128)
    try:
        print(f"2) a 16-token request arriving behind a {args.long_len}-token prompt, 4 streams decoding")
        for r in range(args.repeats):
            off, on = long_prompt_run(model, False, args), long_prompt_run(model, True, args)
            print(f"   run {r}: unchunked: short TTFT {off['short_ttft_ms']:.0f} ms, longest stream pause "
                  f"{off['longest_stream_pause_ms']:.0f} ms | chunked (budget 2048, 512 per prompt per step): "
                  f"{on['short_ttft_ms']:.0f} ms, {on['longest_stream_pause_ms']:.0f} ms | TTFT "
                  f"x{off['short_ttft_ms'] / on['short_ttft_ms']:.1f} shorter, pause "
                  f"x{off['longest_stream_pause_ms'] / on['longest_stream_pause_ms']:.1f} shorter")
    finally:
        shutil.rmtree(model)


if __name__ == "__main__":
    main()
