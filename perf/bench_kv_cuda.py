"""The INT8 / FP8 KV cache's Triton kernels on a real GPU (issue 17): the quantizing write against the reference
(bytes and scales), attention over quantized caches against the dequantize-then-attend reference on mixed batches,
then microseconds per decode call for a Llama-3-8B-shaped layer (32 heads, 8 KV heads, head 128, blocks of 16)
with the model-dtype cache, INT8 and FP8 (`triton.testing.do_bench`).

    python perf/bench_kv_cuda.py [--seqs 64] [--ctx 2048] [--dtype float16]

Needs CUDA; the tests check the same kernels in Triton's interpreter (tests/test_kernels.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from trellm_kernels import attention, kv_cache, triton_attention, triton_kv_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from kernel_cases import paged_case, quantized  # noqa: E402


def paged(q_lens, ctx_lens, H, KVH, D, bs, dtype, device):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                 for t in paged_case(q_lens, ctx_lens, H, KVH, D, bs, dtype))


def check(device):
    worst = 0.0
    for cache_dtype in (torch.int8, torch.float8_e4m3fn):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            # the write: bit for bit
            g = torch.Generator(device="cpu").manual_seed(1)
            T, KVH, D, NB, BS = 300, 8, 128, 40, 16
            k = (torch.randn(T, KVH, D, generator=g) * 3).to(dtype).to(device)
            v = torch.randn(T, KVH, D, generator=g).to(dtype).to(device)
            slots = torch.randperm(NB * BS, generator=g)[:T].to(device)
            slots[::9] = -1
            caches = [torch.zeros(NB, BS, KVH, D, dtype=cache_dtype, device=device) for _ in range(4)]
            scales = [torch.zeros(NB, BS, KVH, dtype=torch.float16, device=device) for _ in range(4)]
            kv_cache.write_kv_reference(k, v, caches[0], caches[1], slots, scales[0], scales[1])
            triton_kv_cache.write_kv_triton(k, v, caches[2], caches[3], slots, scales[2], scales[3])
            same = all(torch.equal(caches[i].view(torch.int8), caches[i + 2].view(torch.int8)) and
                       torch.equal(scales[i], scales[i + 2]) for i in (0, 1))
            assert same, f"write {cache_dtype} {dtype}: kernel and reference differ"
            # attention: decodes, chunks over cached prefixes, GQA 4, head 128 and 64
            for H, KVH, D, bs in ((32, 8, 128, 16), (8, 2, 64, 32)):
                for q_lens, ctx in (([1, 7, 33, 1, 200], [500, 16, 0, 1023, 77]), ([1] * 9, [5, 900, 33] * 3)):
                    args, sc = quantized(paged(q_lens, ctx, H, KVH, D, bs, dtype, device), cache_dtype)
                    ref = attention.paged_attention_reference(*args, **sc).float()
                    for splits in ((1, 4) if max(q_lens) == 1 else (1,)):
                        out = triton_attention.paged_attention_triton(*args, num_splits=splits, **sc).float()
                        err = (out - ref).abs().max().item()
                        worst = max(worst, err)
                        tol = 1e-3 if dtype == torch.float32 else 3e-2
                        assert err < tol, f"attention {cache_dtype} {dtype} {q_lens}: max error {err}"
    print(f"correct on {torch.cuda.get_device_name()}: writes bit for bit, attention max abs error {worst:.2e}")


def bench(args, device):
    dtype = getattr(torch, args.dtype)
    base = paged([1] * args.seqs, [args.ctx - 1] * args.seqs, 32, 8, 128, 16, dtype, device)
    print(f"decode attention, {args.seqs} sequences of {args.ctx} tokens, H=32 KVH=8 D=128, blocks of 16, "
          f"{args.dtype} queries; microseconds per call")
    first = None
    for name, cache_dtype in (("model dtype", None), ("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        call, kw = (base, {}) if cache_dtype is None else quantized(base, cache_dtype)
        for splits in (1, None):
            us = triton.testing.do_bench(lambda: triton_attention.paged_attention_triton(
                *call, num_splits=splits, **kw)) * 1e3
            first = first or us
            kv_bytes = call[1].numel() * call[1].element_size() * 2
            print(f"  {name:<12} {'single launch' if splits == 1 else 'default path':<14} {us:9.1f} us  "
                  f"{first / us:5.2f}x  (pool {kv_bytes / 2**20:.0f} MiB)")
    T, KVH, D = args.seqs * 8, 8, 128
    k = torch.randn(T, KVH, D, device=device, dtype=dtype)
    slots = torch.randperm(base[1].shape[0] * 16, device=device)[:T]
    for name, cache_dtype in (("model dtype", dtype), ("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        kc = torch.zeros_like(base[1], dtype=cache_dtype)
        scale = torch.zeros(kc.shape[:3], dtype=torch.float16, device=device) if cache_dtype != dtype else None
        us = triton.testing.do_bench(lambda: triton_kv_cache.write_kv_triton(k, k, kc, kc, slots, scale, scale)) * 1e3
        print(f"  write of {T} tokens, {name:<12} {us:8.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    device = torch.device("cuda")
    check(device)
    bench(args, device)


if __name__ == "__main__":
    main()
