"""A decode step's forward with the layers in one C++ call (models/decode_stack.py) and operator by operator from
Python, alternated in one process on the same weights and KV cache, at a few batch sizes.

    python perf/bench_decode_stack.py --model hf_models/anchor [--dtype float32] [--quantization int8]
        [--batches 1,4,16] [--context 256] [--rounds 12]

Prints, per batch size, each path's median and best milliseconds a step and the ratio of the medians. Rounds
alternate the two paths, so a busy moment of the host falls on both; the CPU time other processes took meanwhile
is printed beside them. Then a few stack steps timed by part (the linears by site, attention, norms and
activations, and the forward outside the layers: embedding, final norm, LM head).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402

from trellm_backend.engine.forward_inputs import StepInputs, allocate_kv_cache  # noqa: E402
from trellm_backend.models.config import load_model_config  # noqa: E402
from trellm_backend.models.llama import LlamaModel  # noqa: E402
from trellm_backend.models.weights import load_state_dict  # noqa: E402
from trellm_kernels.kv_cache import QMAX  # noqa: E402
from trellm_kernels.linear_choice import LoadWatch  # noqa: E402


def step_ms(model, ids, meta, cache, scales, rows, steps: int) -> float:
    for _ in range(3):
        model.forward(ids, meta, cache, rows, scales)
    t = time.perf_counter()
    for _ in range(steps):
        model.forward(ids, meta, cache, rows, scales)
    return (time.perf_counter() - t) / steps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3"))
    ap.add_argument("--batches", default="1,4,16", help="comma-separated sequences per decode step")
    ap.add_argument("--context", type=int, default=256, help="tokens each sequence has in the cache")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30, help="steps timed per path and round")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_dtype = {"auto": dtype, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_cache_dtype]
    model = LlamaModel(load_model_config(args.model), load_state_dict(args.model, dtype), torch.device("cpu"), dtype,
                       args.context + args.block_size, args.quantization)
    stack = model.decode_stack
    print(f"{args.model} {args.dtype} quantization={args.quantization} kv={kv_dtype}; threads "
          f"{torch.get_num_threads()}; linear layers: {model.linear_paths()}")
    if stack is None:
        raise SystemExit("the decode stack does not take this model here (see models/decode_stack.py)")
    BLOCK = args.block_size
    blocks = -(-(args.context + 1) // BLOCK)
    for batch in (int(b) for b in args.batches.split(",")):
        cache, scales = allocate_kv_cache(model.cfg, batch * blocks, BLOCK, kv_dtype, torch.device("cpu"))
        if kv_dtype in QMAX:
            scales.fill_(0.01)
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        ids, meta, rows, _ = StepInputs(torch.device("cpu")).build(
            [1] * batch, [args.context] * batch, [1] * batch, tables, BLOCK, torch.arange(batch, dtype=torch.int32))
        times = {"python": [], "stack": []}
        with torch.inference_mode(), LoadWatch() as load:
            for _ in range(args.rounds):
                for path in times:
                    model.decode_stack = stack if path == "stack" else None
                    times[path].append(step_ms(model, ids, meta, cache, scales, rows, args.steps))
        med = {p: statistics.median(t) for p, t in times.items()}
        print(f"batch {batch}: python {med['python']:.3f} ms (best {min(times['python']):.3f}), stack "
              f"{med['stack']:.3f} ms (best {min(times['stack']):.3f}); python/stack "
              f"{med['python'] / med['stack']:.2f}x; other processes {load.foreign_cores:.2f} cores")
        model.decode_stack = stack
        stack.set_timed(True)
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(args.steps):
                model.forward(ids, meta, cache, rows, scales)
        step = (time.perf_counter() - t) / args.steps
        stack.set_timed(False)
        parts = stack.seconds()
        print(f"  a timed stack step {step * 1e3:.3f} ms: " + ", ".join(
            f"{name} {s / args.steps * 1e3:.3f}" for name, s in sorted(parts.items(), key=lambda p: -p[1]))
            + f", outside the layers {(step - sum(parts.values()) / args.steps) * 1e3:.3f}")


if __name__ == "__main__":
    main()
