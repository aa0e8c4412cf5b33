"""Offline engine throughput, without Triton: how many tokens per second the engine generates for a batch of
requests, and what share of each step the scheduler and batch preparation take next to the model.

    python perf/bench_engine.py [--model hf_models/tiny-llama] [--requests 64] [--prompt-len 128] [--gen-len 64]

Prints one line per run; use ratios from one run when comparing settings on a shared machine.
--profile-step instead waits until every request is decoding, then prints how long a decode step takes, the share
of paged attention in it, and a torch.profiler table of one step: where a step's time goes.
--anchor instead runs the benchmark's anchor requests (perf/workload.py, 48 at t=0, exact output lengths) and
splits the time between prefill steps and decode steps; with --by-op also between the forward's operations
(linear layers, paged attention, norms, ...), timed around each call, the C++ operators included (torch.profiler
does not see those).
"""
from __future__ import annotations

import argparse
import os
import time

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402

import trellm_backend.models.llama as llama
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="KV pool size (default: the engine's)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    ap.add_argument("--quantization", default=None, help="the llm parameter: none, int8, w8a8, int4, int4-g64 or int4-g32 (default: the engine's)")
    ap.add_argument("--dtype", default=None, help="the llm parameter: auto, float32, float16 or bfloat16 (default: "
                    "the engine's, float32 on a CPU)")
    ap.add_argument("--kv-cache-dtype", default=None, help="the llm parameter: auto, int8 or fp8_e4m3 (default: the "
                    "engine's, auto)")
    ap.add_argument("--enforce-eager", default=None, choices=("true", "false"), help="the llm parameter: false pads "
                    "decode steps to a batch-size bucket over persistent inputs (default: the engine's, true)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None, help="the llm parameter: processes that split "
                    "the model (default: the engine's, 1)")
    ap.add_argument("--pipeline-parallel-size", type=int, default=None, help="the llm parameter: stages that split "
                    "the model's layers (default: the engine's, 1)")
    ap.add_argument("--profile-step", action="store_true", help="profile one decode step of the whole batch")
    ap.add_argument("--anchor", action="store_true", help="the anchor profile's requests, time by step kind")
    ap.add_argument("--by-op", action="store_true", help="with --anchor: seconds per forward operation and step kind; "
                    "else: milliseconds of a decode step of --requests sequences per forward operation, the rest of "
                    "the runner's work, and the engine's outside it (scheduling, applying the tokens)")
    args = ap.parse_args()

    extra = {k: v for k, v in (("kv_cache_bytes", args.kv_cache_bytes), ("block_size", args.block_size),
                               ("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype),
                               ("dtype", args.dtype), ("tensor_parallel_size", args.tensor_parallel_size),
                               ("pipeline_parallel_size", args.pipeline_parallel_size),
                               ("enforce_eager", None if args.enforce_eager is None else args.enforce_eager == "true"))
             if v is not None}
    engine = LLMEngine(EngineConfig(model_path=args.model, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, **extra))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    engine.generate([torch.randint(10, vocab, (16,), generator=g).tolist()], params)   # warm-up
    if args.anchor:
        return split_anchor_steps(engine, args.model, args.by_op)

    for i in range(args.requests):
        engine.add_request(str(i), torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist(), params)
    if args.profile_step:
        return profile_decode_step(engine, args.requests)
    if args.by_op:
        return decode_step_by_op(engine, args.requests)
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


FORWARD_OPS = ("linear", "paged_attention", "rotary_and_write_kv", "fused_add_rms_norm", "rms_norm",
               "silu_and_mul")


def decode_step_by_op(engine: LLMEngine, num_requests: int, timed_steps: int = 200):
    """Once every request decodes, time `timed_steps` steps: each of FORWARD_OPS as the model module calls it, the
    rest of the runner's execute, and what the engine does outside it."""
    from collections import defaultdict
    while sum(1 for o in engine.step() if o.new_token_ids) < num_requests:
        if not engine.has_unfinished():
            raise SystemExit("the requests finished before all of them decoded together: raise --gen-len")
    seconds: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            r = fn(*a, **kw)
            seconds[name] += time.perf_counter() - t
            return r
        return call

    originals = {name: getattr(llama, name) for name in FORWARD_OPS}
    execute = engine.runner.execute
    try:
        for name, fn in originals.items():
            setattr(llama, name, timed(name, fn))
        engine.runner.execute = timed("execute", execute)
        start = time.perf_counter()
        for _ in range(timed_steps):
            engine.step()
        step = (time.perf_counter() - start) / timed_steps
    finally:
        engine.runner.execute = execute
        for name, fn in originals.items():
            setattr(llama, name, fn)
    if len(engine.scheduler.running) < num_requests:
        raise SystemExit("requests finished while the steps were timed: raise --gen-len")
    ms = {name: sec / timed_steps * 1e3 for name, sec in seconds.items()}
    ops = {name: ms.get(name, 0.0) for name in FORWARD_OPS}
    print(f"decode step, {num_requests} sequences: {step * 1e3:.3f} ms; "
          + ", ".join(f"{op} {t:.3f}" for op, t in ops.items())
          + f", the rest of the runner {ms['execute'] - sum(ops.values()):.3f}, outside the runner "
          f"{step * 1e3 - ms['execute']:.3f} ms")


def split_anchor_steps(engine: LLMEngine, model_dir: str, by_op: bool = False):
    """Run the anchor profile's requests and report prefill and decode steps apart (and, `by_op`, the forward's
    operations: each of FORWARD_OPS, as the model module calls it, timed around the call)."""
    from collections import defaultdict
    from workload import PromptMaker, make_items, profiles, run_at_once
    items = make_items(PromptMaker(model_dir), profiles()["anchor"], 48, 0)
    execute = engine.runner.execute
    kinds = {"prefill": [0, 0.0, 0], "decode": [0, 0.0, 0]}   # steps, seconds, sequences
    op_seconds: dict[tuple[str, str], float] = defaultdict(float)
    kind = ["decode"]

    def timed(plan, *rest):
        kind[0] = "prefill" if sum(c.num_new_tokens for c in plan.chunks) > len(plan.chunks) else "decode"
        t = time.perf_counter()
        r = execute(plan, *rest)
        k = kinds[kind[0]]
        k[0], k[1], k[2] = k[0] + 1, k[1] + time.perf_counter() - t, k[2] + len(plan.chunks)
        return r

    def timed_op(name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            r = fn(*a, **kw)
            op_seconds[(kind[0], name)] += time.perf_counter() - t
            return r
        return call

    if by_op:
        for name in FORWARD_OPS:
            setattr(llama, name, timed_op(name, getattr(llama, name)))

    engine.runner.execute = timed
    run = run_at_once(engine, [(it.prompt_ids, it.output_tokens) for it in items])
    generated, wall, ttft = run.output_tokens, run.wall_s, sorted(run.first_token_s)
    r = engine.runner
    print(f"anchor: {len(items)} requests, {generated} output tokens in {wall:.1f} s = {generated / wall:.1f} tok/s, "
          f"TTFT mean {sum(ttft) / len(ttft):.2f} s p50 {ttft[len(ttft) // 2]:.2f} s; KV pool {r.num_blocks} blocks "
          f"of {r.block_size} tokens, {str(r.kv_dtype).removeprefix('torch.')}")
    for name, (steps, seconds, seqs) in kinds.items():
        print(f"  {name}: {steps} steps, {seconds:.1f} s, {seconds / max(steps, 1) * 1e3:.0f} ms a step, "
              f"{seqs / max(steps, 1):.1f} sequences a step")
        if by_op:
            ops = {op: op_seconds[(name, op)] for op in FORWARD_OPS}
            rest = seconds - sum(ops.values())
            print("    " + ", ".join(f"{op} {sec:.2f}" for op, sec in ops.items()) + f", the rest {rest:.2f} s")


def profile_decode_step(engine: LLMEngine, num_requests: int, timed_steps: int = 5):
    """Step until every request decodes, time a few decode steps and their attention, then profile one."""
    while True:
        all_sampled = sum(len(o.new_token_ids) for o in engine.step()) == num_requests
        if not engine.has_unfinished():
            raise SystemExit("the requests finished before all of them decoded together: raise --gen-len")
        if all_sampled:
            break
    attention_time = 0.0
    attention = llama.paged_attention

    def timed_attention(*a, **k):
        nonlocal attention_time
        t = time.perf_counter()
        r = attention(*a, **k)
        attention_time += time.perf_counter() - t
        return r

    context = engine.scheduler.running[0].num_tokens
    llama.paged_attention = timed_attention
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    step, attention_time = (time.perf_counter() - start) / timed_steps, attention_time / timed_steps
    llama.paged_attention = attention
    if len(engine.scheduler.running) < num_requests:
        raise SystemExit("requests finished while the steps were timed: raise --gen-len")
    print(f"decode step, {num_requests} sequences of ~{context} tokens: {step * 1e3:.0f} ms, "
          f"attention {attention_time * 1e3:.0f} ms ({attention_time / step:.0%})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
