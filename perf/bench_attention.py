"""CPU paged attention, option by option, on the anchor model's shapes (8 heads, 4 KV heads, head_dim 64; blocks of
16 unless --block-size): milliseconds per layer for a decode step of many sequences and for a prefill chunk over a
cached prefix.

    .venv/bin/python perf/bench_attention.py [--seqs 48] [--ctx 263] [--chunk 256] [--prefix 256] [--repeats 20]
        [--kv-dtypes auto,int8,fp8_e4m3]

Options: `reference` (the PyTorch oracle), `dispatch` (what the engine runs on a CPU: the C++ operator for decodes
and short chunks, torch's fused attention over each long chunk's gathered blocks), `cpp`
(kernels/cpu/paged_attention.cpp for every chunk), `sdpa` (a loop of torch's scaled_dot_product_attention over
each sequence's index_select-ed blocks), `flex` (torch.compile'd flex_attention over the same gathered views).
Each is checked against the reference before it is timed. Ratios within one run are what to compare.
--kv-dtypes adds rows for an INT8 / FP8 e4m3 cache (kv_cache_dtype; the same random K/V quantized with their
per-token-and-head scales), timed with the options that read one: reference, dispatch, cpp.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from trellm_backend.tools.launch import openmp_wait_defaults

os.environ.update(openmp_wait_defaults(os.environ))   # the OpenMP wait policy the server runs with, before torch loads
import torch  # noqa: E402
import torch.nn.functional as F

from trellm_kernels import cpu_ops
from trellm_kernels.attention import paged_attention, paged_attention_reference
from trellm_kernels.kv_cache import KV_CACHE_DTYPES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from kernel_cases import paged_case, quantized  # noqa: E402


def cpp(q, k, v, cu, seq_lens, bt, scale, mq, mk, k_scale=None, v_scale=None):
    """The C++ operator alone, for every chunk length."""
    out = torch.empty_like(q)
    if k_scale is not None:
        cpu_ops.load().paged_attention_quantized(out, q, k.view(torch.int8), v.view(torch.int8), k_scale, v_scale,
                                                 cu, seq_lens, bt, scale, 1 << 30, k.dtype == torch.int8, 0, 0.0)
    else:
        cpu_ops.load().paged_attention(out, q, k, v, cu, seq_lens, bt, scale, 1 << 30, 0, 0.0)
    return out


def _gathered(k, v, bt, b, n):
    """Sequence b's first n keys/values as [KVH, n, D] (a copy: index_select of its blocks)."""
    blocks = bt[b, :(n + k.shape[1] - 1) // k.shape[1]].long()
    kb = k.index_select(0, blocks).flatten(0, 1)[:n].transpose(0, 1)
    vb = v.index_select(0, blocks).flatten(0, 1)[:n].transpose(0, 1)
    return kb, vb


def sdpa(q, k, v, cu, seq_lens, bt, scale, mq, mk):
    out = torch.empty_like(q)
    G = q.shape[1] // k.shape[2]
    for b in range(seq_lens.shape[0]):
        s, e, n = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        kb, vb = _gathered(k, v, bt, b, n)
        qb = q[s:e].transpose(0, 1)                                       # [H, q_len, D]
        q_pos = torch.arange(n - (e - s), n)[:, None]
        mask = torch.arange(n)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qb, kb.repeat_interleave(G, 0), vb.repeat_interleave(G, 0),
                                           attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


_flex = None


def flex(q, k, v, cu, seq_lens, bt, scale, mq, mk):
    global _flex
    from torch.nn.attention.flex_attention import flex_attention
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=True)
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        s, e, n = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        kb, vb = _gathered(k, v, bt, b, n)
        offset = n - (e - s)

        def causal(bi, h, qi, ki):
            return ki <= qi + offset
        o = _flex(q[s:e].transpose(0, 1)[None], kb[None], vb[None], score_mod=lambda sc, bi, h, qi, ki:
                  torch.where(causal(bi, h, qi, ki), sc, -float("inf")), scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


OPTIONS = {"reference": paged_attention_reference, "dispatch": paged_attention, "cpp": cpp, "sdpa": sdpa, "flex": flex}
QUANTIZED_OPTIONS = ("reference", "dispatch", "cpp")    # the options that read an INT8/FP8 cache


def time_option(fn, args, repeats, kwargs=None):
    """The fastest of `repeats` calls: on a shared machine the minimum is the least disturbed figure."""
    kwargs = kwargs or {}
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=48, help="decoding sequences in the decode case")
    ap.add_argument("--ctx", type=int, default=263, help="context length of each decoding sequence")
    ap.add_argument("--chunk", type=int, default=256, help="new tokens of the prefill case")
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before the prefill chunk")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, help="torch's threads (default: its own choice)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--options", default="reference,dispatch,cpp,sdpa,flex")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kv-dtypes", default="auto", help="KV cache dtypes, comma-separated: auto (the dtype's own), "
                    "int8, fp8_e4m3")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        sys.exit(cpu_ops.error())
    H, KVH, D, bs = 8, 4, 64, args.block_size
    cases = {f"decode {args.seqs} x {args.ctx}": [(args.ctx - 1, 1)] * args.seqs,
             f"prefill {args.chunk} after {args.prefix}": [(args.prefix, args.chunk)]}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per layer (H={H}, KVH={KVH}, D={D}, "
          f"block {bs})")
    names = args.options.split(",")
    print(f"{'case':<28}{'dtype':<10}{'kv':<10}" + "".join(f"{n:>12}" for n in names) + f"{'ref/cpp':>10}")
    for case, shapes in cases.items():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            batch = paged_case([n for _, n in shapes], [c for c, _ in shapes], H, KVH, D, bs, dtype)
            for kv_name in args.kv_dtypes.split(","):
                call, kw = (batch, {}) if kv_name == "auto" else quantized(batch, KV_CACHE_DTYPES[kv_name])
                ref = paged_attention_reference(*call, **kw).float()
                times = {}
                for n in names:
                    if kw and n not in QUANTIZED_OPTIONS:
                        times[n] = float("nan")
                        continue
                    out = OPTIONS[n](*call, **kw).float()
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    if not torch.allclose(out, ref, atol=tol, rtol=tol):
                        sys.exit(f"{n} disagrees with the reference on {case} {dtype_name} {kv_name}: "
                                 f"max error {(out - ref).abs().max().item():.3g}")
                    times[n] = time_option(OPTIONS[n], call, args.repeats, kw)
                ratio = times["reference"] / times["cpp"] if "reference" in times and "cpp" in times else float("nan")
                print(f"{case:<28}{dtype_name:<10}{kv_name:<10}" + "".join(f"{times[n]:>12.3f}" for n in names)
                      + f"{ratio:>9.1f}x")


if __name__ == "__main__":
    main()
