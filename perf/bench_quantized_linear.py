"""Per-layer time of the CPU paths a quantized (or bf16) linear can take, by token count: what chose kernels/linear.py's
INT4 path (and re-checks INT8's and bf16's). Not a test: a measurement for perf/RESULTS.md.

Each path cycles through 16 distinct weights so that every call reads its weight from memory, as a decode step
does (one weight would stay in the cache and flatter the small formats less than the large).

    python perf/bench_quantized_linear.py [--out 2816 --in 512 --tokens 1,4,16,48,128,512 --group 128]
    python perf/bench_quantized_linear.py --layouts bfloat16   # each call of each layout the timed choice can hold
    python perf/bench_quantized_linear.py --w8a8   # W8A8's oneDNN GEMM fed int8 or u8 activations, beside fp32
"""
from __future__ import annotations

import argparse
import os
import time

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402

from trellm_kernels import cpu_ops, dispatch, linear, linear_choice
from trellm_kernels.int4 import Int4Weight, quantize_int4, to_cpu_int4pack


def per_call_us(fn, calls: int) -> float:
    for i in range(3):
        fn(i)
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=int, default=2816, help="output features (the anchor's gate_up)")
    ap.add_argument("--in", dest="in_f", type=int, default=512, help="input features")
    ap.add_argument("--tokens", default="1,4,16,48,128,512")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--weights", type=int, default=16, help="distinct weights cycled")
    ap.add_argument("--w8a8", action="store_true", help="instead: W8A8's oneDNN GEMM with signed int8 activations "
                    "against unsigned ones (zero point 128, what w8a8_linear sends), and the fp32 path, alternated")
    ap.add_argument("--layouts", metavar="DTYPE", help="instead: every layout of this dtype the timed choice can "
                    "hold here (linear_choice.layouts_for), each through its own call, in alternated rounds")
    args = ap.parse_args()
    cpu_ops.load()
    torch.manual_seed(0)
    if args.layouts:
        return by_layout(args, getattr(torch, args.layouts))
    if args.w8a8:
        return w8a8_activations(args)
    dense = [torch.randn(args.out, args.in_f) for _ in range(args.weights)]
    fp32 = [linear.prepare_weight(w) for w in dense]          # the engine's fp32 path (TRELLM_CPU_LINEAR)
    int8 = [linear.prepare_weight(w, "int8") for w in dense]
    bf16 = [linear.prepare_weight(w.bfloat16()) for w in dense]   # a bf16 model's path (linear_path names it)
    canonical: list[Int4Weight] = [quantize_int4(w, args.group) for w in dense]
    int4pack = [linear.Weight(None, int4=to_cpu_int4pack(w)) for w in canonical]
    nibbles = [linear.Weight(None, int4=w) for w in canonical]       # the dequantize-then-GEMM path
    n = args.weights
    print(f"{args.out} x {args.in_f}, group {args.group}, {torch.get_num_threads()} threads, us per call")
    print(f"bf16: {linear.linear_path(bf16[0])}")
    print(f"| tokens | fp32 ({dispatch.settings().cpu_linear}) | INT8 C++ operator "
          "| INT4 torch int4pack (bf16 activations) | INT4 dequantize + fp32 GEMM | bf16 (bf16 activations) |")
    print("|---|---|---|---|---|---|")
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, args.in_f)
        xb = x.bfloat16()
        calls = max(5, 2000 // m)
        row = [per_call_us(lambda i: linear.linear(x, fp32[i % n]), calls),
               per_call_us(lambda i: linear.linear(x, int8[i % n]), calls),
               per_call_us(lambda i: linear.linear(x, int4pack[i % n]), calls),
               per_call_us(lambda i: linear.linear(x, nibbles[i % n]), max(3, calls // 8)),
               per_call_us(lambda i: linear.linear(xb, bf16[i % n]), calls)]
        print(f"| {m} | " + " | ".join(f"{v:.0f}" for v in row) + " |", flush=True)


def w8a8_activations(args, rounds: int = 3) -> None:
    """us per call of oneDNN's quantized GEMM on the same prepacked weights fed s8 activations (zero point 0) and u8
    ones (zero point 128), and of the fp32 path, the fastest of `rounds` alternated rounds."""
    if not linear.onednn_runs_w8a8():
        print("oneDNN's quantized GEMM does not run W8A8 on this host (no VNNI or AMX-INT8)")
        return
    dense = [torch.randn(args.out, args.in_f) for _ in range(args.weights)]
    q = [linear.prepare_weight(w, "w8a8") for w in dense]
    fp32 = [linear.prepare_weight(w) for w in dense]
    one, zero, u8_zero, n = torch.tensor(1.0), torch.tensor(0), torch.tensor(128), args.weights

    def gemm(xq, zp, w):
        return torch.ops.onednn.qlinear_pointwise.tensor(xq, one, zp, w.prepared, w.scales.float(), zero, None, 1.0,
                                                         0, torch.float32, "none", [None], "")
    print(f"{args.out} x {args.in_f} W8A8, {torch.get_num_threads()} threads, {n} weights cycled, us per call "
          f"(fastest of {rounds} alternated rounds; activations already rounded)")
    print("| tokens | s8 activations | u8 activations | fp32 path |")
    print("|---|---|---|---|")
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, args.in_f)
        xq, _ = linear.int8_activations(x)
        xu = xq.view(torch.uint8).bitwise_xor(128)
        assert torch.equal(gemm(xq, zero, q[0]), gemm(xu, u8_zero, q[0]))     # the same exact sums
        forms = {"s8": lambda i: gemm(xq, zero, q[i % n]), "u8": lambda i: gemm(xu, u8_zero, q[i % n]),
                 "fp32": lambda i: linear.linear(x, fp32[i % n])}
        best = {name: float("inf") for name in forms}
        calls = max(5, 2000 // m)
        for _ in range(rounds):
            for name, fn in forms.items():
                best[name] = min(best[name], per_call_us(fn, calls))
        print(f"| {m} | " + " | ".join(f"{best[name]:.0f}" for name in forms) + " |", flush=True)


def by_layout(args, dtype: torch.dtype, rounds: int = 3) -> None:
    """us per call of each call of each layout (cpp, cpp-amx, cpp-unpacked, onednn, torch, ...), the fastest of
    `rounds` rounds that alternate them, each call on the next of the cycled weights."""
    shape = (args.out, args.in_f)
    layouts = linear_choice.layouts_for(dtype, shape)
    held = {layout: [linear.hold(torch.randn(*shape).to(dtype), layout) for _ in range(args.weights)]
            for layout in layouts}
    calls = [(call, layout) for layout in layouts for call in linear_choice.calls_of(layout, dtype, shape)]
    n = args.weights
    cpp = f"; cpp: {linear.linear_path(held['cpp'][0])}" if "cpp" in held else ""
    print(f"{args.out} x {args.in_f} {args.layouts}, {torch.get_num_threads()} threads, {n} weights cycled, "
          f"us per call (fastest of {rounds} alternated rounds){cpp}")
    print("| tokens | " + " | ".join(call for call, _ in calls) + " |")
    print("|---|" + "---|" * len(calls))
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, args.in_f).to(dtype)
        runs = max(5, 2000 // m)
        best = {call: float("inf") for call, _ in calls}
        for _ in range(rounds):
            for call, layout in calls:
                fn = linear.CALLS[call]
                best[call] = min(best[call], per_call_us(lambda i: fn(x, held[layout][i % n], None), runs))
        print(f"| {m} | " + " | ".join(f"{best[call]:.0f}" for call, _ in calls) + " |", flush=True)


if __name__ == "__main__":
    main()
