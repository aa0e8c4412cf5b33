"""Triton-lang kernels against their PyTorch references, run on CPU through Triton's interpreter.

These tests need TRITON_INTERPRET=1 from the start of the process (conftest.py says why): a CPU host's session has
it; on a GPU host they are skipped in the session and run in a process of their own (test_engine.py).
Shapes are small because the interpreter runs every program in Python.

dtypes: the interpreter runs fp32 and fp16 kernels faithfully. bf16 is only partly supported, and tested with that
in mind: loads, stores and bf16 -> fp32 casts are exact, but (1) arithmetic on bf16 tiles, tl.dot included, runs on
their raw 16-bit integer storage, so every kernel converts bf16 to fp32 before arithmetic and the attention kernel
feeds tl.dot fp32 copies of bf16 tiles when interpreted (on a GPU the bf16 tensor-core dot runs, which these tests
cannot reach); (2) fp32 -> bf16 casts truncate instead of rounding to nearest-even as GPUs (and PyTorch) do, so
bf16 results are compared with a tolerance even where fp32/fp16 results must match bit for bit.

On a GPU (perf/gpu_check.sh) the same tests run compiled: TRELLM_KERNEL_TEST_DEVICE=cuda sends each Triton entry
point's arguments to the GPU and its results back (`on_device`), so the inputs and the PyTorch references stay the
CPU tensors written here. The interpreter's caveats above then do not apply; the tolerances still do.
"""
import os
import subprocess
import sys

import pytest
import torch

from trellm_kernels import activation, attention, dispatch, kv_cache, linear, rmsnorm, rotary
from trellm_kernels import triton_activation, triton_attention, triton_kv_cache, triton_rmsnorm, triton_rotary

from trellm_kernels import triton_linear
from trellm_kernels import lora, triton_lora
from trellm_kernels import moe, triton_moe

from kernel_cases import moe_case, paged_case, quantized, randn
from rounding import (EPS32, Exact, assert_within_rounding, exact_attention, exact_gelu_tanh_and_mul, exact_linear,
                      exact_lora_add, exact_moe, exact_rms_norm, exact_rotary, exact_silu_and_mul)

INTERPRETED = dispatch.settings().triton_interpret
# Where the Triton kernels run: unset, on the tests' own CPU tensors (interpreted); "cuda", compiled on the GPU.
KERNEL_DEVICE = os.environ.get("TRELLM_KERNEL_TEST_DEVICE")
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not INTERPRETED and KERNEL_DEVICE != "cuda",
                                 reason="needs TRITON_INTERPRET=1 from process start, or TRELLM_KERNEL_TEST_DEVICE=cuda")]

ENTRY_POINTS = [(triton_attention, "paged_attention_triton"), (triton_kv_cache, "write_kv_triton"),
                (triton_kv_cache, "rotary_write_kv_triton"),
                (triton_rmsnorm, "rms_norm_triton"), (triton_rmsnorm, "fused_add_rms_norm_triton"),
                (triton_rotary, "rotary_triton"), (triton_activation, "silu_and_mul_triton"),
                (triton_activation, "gelu_tanh_and_mul_triton"),
                (triton_linear, "int8_linear_triton"), (triton_linear, "int4_linear_triton"),
                (triton_linear, "group_linear_triton"),
                (triton_lora, "lora_shrink_triton"), (triton_lora, "lora_expand_triton"),
                (triton_moe, "fused_moe_triton")]


def on_device(fn, device: str):
    """`fn` run on `device` for callers that hold CPU tensors. Each CPU storage the arguments view is copied there
    once, and each argument becomes the same view (offset, shape, strides) of the copy, so strided views and views
    sharing one buffer reach the kernel as they are. After the call every storage is copied back (in-place writes
    land in the caller's tensors), and a result that views a copied storage comes back as that view of the
    original; any other result is copied to the CPU."""
    def call(*args, **kwargs):
        copies = {}                      # CPU storage address -> (CPU bytes, device bytes)

        def send(t):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return t
            storage = t.untyped_storage()
            if storage.data_ptr() not in copies:
                host = torch.empty(0, dtype=torch.uint8).set_(storage)
                copies[storage.data_ptr()] = (host, host.to(device, copy=True))
            return torch.empty(0, dtype=t.dtype, device=device).set_(
                copies[storage.data_ptr()][1].untyped_storage(), t.storage_offset(), t.shape, t.stride())

        def receive(t):
            if not isinstance(t, torch.Tensor):
                return t
            for host, dev in copies.values():
                if t.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr():
                    return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())
            return t.cpu()

        result = fn(*[send(a) for a in args], **{k: send(v) for k, v in kwargs.items()})
        for host, dev in copies.values():
            host.copy_(dev.cpu())
        return tuple(receive(r) for r in result) if isinstance(result, tuple) else receive(result)
    return call


@pytest.fixture(autouse=True)
def _kernels_on_the_test_device(monkeypatch):
    if KERNEL_DEVICE:
        for module, name in ENTRY_POINTS:
            monkeypatch.setattr(module, name, on_device(getattr(module, name), KERNEL_DEVICE))

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def attention_close(out, args, **scales):
    """Paged attention's output against the float64 reference (tests/rounding.py). In fp16/bf16 the softmax
    weights are rounded to the dtype for the second product (a GPU's tensor-core dot) and the output once more."""
    assert out.dtype == args[0].dtype
    assert_within_rounding(out, exact_attention(*args, **scales), roundings=1 if out.dtype == F32 else 2)


# ----------------------------------------------------------------------------------------------- paged attention

def check_attention(args, num_splits):
    attention_close(triton_attention.paged_attention_triton(*args, num_splits=num_splits), args)


MIXED = [  # q_lens, ctx_lens, H, KVH, D, block_size, dtype
    ([1, 5, 17, 1, 16], [0, 16, 15, 32, 17], 4, 4, 64, 16, F32),    # GQA 1: decodes, chunks continuing a prefix
    ([33, 1, 2, 1], [0, 31, 15, 0], 8, 2, 16, 32, F32),              # GQA 4
    ([15, 1, 3], [17, 32, 30], 7, 1, 8, 16, F32),                    # GQA 7 (group padded to 8), head 8
    ([1, 16, 1], [40, 16, 0], 16, 2, 16, 32, F32),                   # GQA 8
    ([3, 1], [14, 20], 4, 1, 128, 16, F32),                          # head 128, small T
    ([1, 5, 17, 1], [0, 16, 15, 32], 8, 2, 64, 16, F16),
    ([1, 5, 17, 1], [0, 16, 15, 32], 8, 2, 64, 32, BF16),
    ([15, 1, 3], [17, 32, 30], 7, 1, 8, 32, F16),
    ([2, 1, 16], [31, 0, 16], 8, 1, 16, 16, BF16),
    ([40], [0], 2, 2, 16, 16, F32),                                  # plain prefill spanning several tiles
    ([2, 0, 1, 0], [30, 5, 16, 0], 8, 2, 16, 16, F32),               # sequences with no new rows
    ([5, 5, 1, 3, 5], [30, 16, 9, 63, 0], 8, 2, 64, 16, F32),        # speculative verification: guesses + 1 rows
]


def test_reference_grouping_equals_one_padded_batch():
    """The CPU reference runs decodes in length-sorted groups and each prefill alone; that must equal attention
    over the whole batch padded at once."""
    q_lens = [1] * 20 + [9, 0, 17, 1]
    ctx_lens = [3, 70, 15, 1, 44, 16, 0, 90, 31, 5, 8, 64, 2, 17, 33, 50, 12, 7, 29, 81] + [20, 4, 0, 6]
    args = paged_case(q_lens, ctx_lens, 8, 2, 16, 16, F32)
    attention_close(attention.paged_attention_reference(*args), args)
    attention_close(attention._padded_attention(*args), args)


@pytest.mark.parametrize("q_lens,ctx_lens,h,kvh,d,bs,dtype", MIXED)
def test_attention_mixed_batch_single_launch(q_lens, ctx_lens, h, kvh, d, bs, dtype):
    check_attention(paged_case(q_lens, ctx_lens, h, kvh, d, bs, dtype), num_splits=1)


@pytest.mark.parametrize("seed", range(8))
def test_attention_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda xs: xs[torch.randint(len(xs), (1,), generator=g).item()]  # noqa: E731
    batch = torch.randint(1, 5, (1,), generator=g).item()
    q_lens = [pick([1, 1, 2, 16, 17, int(torch.randint(1, 40, (1,), generator=g))]) for _ in range(batch)]
    ctx_lens = [pick([0, 15, 16, 17, 32, 33, int(torch.randint(0, 70, (1,), generator=g))]) for _ in range(batch)]
    group, kvh = pick([1, 4, 7, 8]), pick([1, 2])
    args = paged_case(q_lens, ctx_lens, group * kvh, kvh, pick([8, 16, 64]), pick([16, 32]), F32, seed)
    check_attention(args, num_splits=1)


SPLIT = [  # ctx_lens (each sequence decodes one token), H, KVH, D, block_size, dtype, num_splits
    ([99, 0, 14, 15, 16, 31, 32], 4, 4, 64, 16, F32, 4),   # length-1 sequence leaves three segments empty
    ([70, 33, 5], 8, 2, 16, 32, F32, 3),
    ([64, 1, 47], 7, 1, 8, 16, F32, 2),
    ([80, 16], 16, 2, 16, 32, F32, 5),
    ([50, 3], 4, 1, 128, 16, F32, 2),
    ([99, 16, 0], 8, 2, 64, 16, F16, 3),
    ([99, 16, 0], 8, 2, 64, 32, BF16, 3),
    ([45, 32], 7, 1, 8, 32, BF16, 2),
]


@pytest.mark.parametrize("ctx_lens,h,kvh,d,bs,dtype,splits", SPLIT)
def test_attention_split_decode(ctx_lens, h, kvh, d, bs, dtype, splits):
    args = paged_case([1] * len(ctx_lens), ctx_lens, h, kvh, d, bs, dtype, seed=7)
    check_attention(args, num_splits=splits)
    check_attention(args, num_splits=1)          # the single-launch path on the same decode batch


def attention_options_close(out, args, window, softcap, **scales):
    assert out.dtype == args[0].dtype
    assert_within_rounding(out, exact_attention(*args, **scales, window=window, softcap=softcap),
                           roundings=1 if out.dtype == F32 else 2)


# q_lens, ctx_lens, H, KVH, D, block_size, window, softcap: windows shorter and longer than a tile, a block and the
# context, landing inside blocks and on their edges; Gemma 2's caps
WINDOWED = [
    ([1, 5, 17, 1, 40], [0, 16, 15, 70, 9], 4, 2, 16, 16, 7, 0.0),
    ([1, 33, 2, 1], [90, 0, 31, 64], 8, 2, 16, 16, 16, 0.0),
    ([3, 1, 20], [45, 100, 0], 7, 1, 8, 32, 33, 0.0),
    ([1, 5, 17, 1], [0, 16, 15, 32], 4, 2, 64, 16, 0, 50.0),
    ([1, 40, 2], [70, 9, 31], 8, 2, 16, 16, 12, 2.0),
    ([2, 1], [3, 4], 4, 4, 16, 16, 1, 0.0),                    # window 1: each row sees only itself
]


@pytest.mark.parametrize("q_lens,ctx_lens,h,kvh,d,bs,window,softcap", WINDOWED)
def test_attention_sliding_window_and_softcap(q_lens, ctx_lens, h, kvh, d, bs, window, softcap):
    """Each row sees its last `window` keys, scores capped by tanh: the single launch on a mixed batch, and the
    split path on the batch's decodes, whose segments cover only the window."""
    args = paged_case(q_lens, ctx_lens, h, kvh, d, bs, F32, seed=window)
    options = dict(window=window, softcap=softcap)
    attention_options_close(triton_attention.paged_attention_triton(*args, num_splits=1, **options), args, **options)
    decodes = paged_case([1] * len(ctx_lens), ctx_lens, h, kvh, d, bs, F32, seed=window)
    attention_options_close(triton_attention.paged_attention_triton(*decodes, num_splits=3, **options), decodes,
                            **options)
    if softcap == 0.0:   # keys the window hides change nothing: garbage there leaves the answer as it was
        k_cache, v_cache = args[1].clone(), args[2].clone()
        for b, (table, n) in enumerate(zip(args[5], args[4].tolist())):
            first = (n - q_lens[b] - window + 1) // bs      # blocks wholly before every row's window
            for block in table[:max(0, first)].tolist():
                k_cache[block], v_cache[block] = float("nan"), float("nan")
        hidden = (args[0], k_cache, v_cache, *args[3:])
        out = triton_attention.paged_attention_triton(*hidden, num_splits=1, **options)
        attention_options_close(out, args, **options)


def test_reference_window_and_softcap_from_first_principles():
    """The reference (every other path's oracle) against attention written out for one sequence: a window W
    means keys p - W < j <= p, and the cap is applied to the scaled scores before the softmax."""
    q_len, ctx, h, d, bs, window, cap = 5, 19, 2, 8, 4, 6, 0.7
    args = paged_case([q_len], [ctx], h, h, d, bs, torch.float64)
    q, k_cache, v_cache, _, seq_lens, tables, scale = args[:7]
    n = ctx + q_len
    k = k_cache[tables[0, :-(-n // bs)].long()].reshape(-1, h, d)[:n]
    v = v_cache[tables[0, :-(-n // bs)].long()].reshape(-1, h, d)[:n]
    expected, magnitude = torch.empty_like(q), torch.empty_like(q)
    for i in range(q_len):
        p = ctx + i
        for head in range(h):
            s = torch.tanh((k[:p + 1, head] @ q[i, head]) * scale / cap) * cap
            s[:max(0, p - window + 1)] = float("-inf")
            weights = torch.softmax(s, 0)
            expected[i, head], magnitude[i, head] = weights @ v[:p + 1, head], weights @ v[:p + 1, head].abs()
    got = attention.paged_attention_reference(*args, window=window, softcap=cap)
    assert_within_rounding(got, Exact(expected, magnitude, d + n + 8 * cap + 16), narrow=F32)
    decode = paged_case([1] * 3, [0, 7, 30], h, h, d, bs, torch.float64)
    attention_options_close(attention._padded_attention(*decode, window=window, softcap=cap), decode, window, cap)


def test_attention_path_choice(monkeypatch, kernel_settings):
    kernel_settings(attn_splits=None)
    choose = triton_attention.choose_num_splits
    cpu = torch.device("cpu")
    assert choose(1, 1, 1, 600, cpu) == 2                  # one long decode: split
    assert choose(1, 1, 4, 600, cpu) == 1                  # any prefill row: single launch
    assert choose(2, 2, 1, 100, cpu) == 1                  # short context
    assert choose(512, 8, 1, 4096, cpu) == 1               # batch already fills the GPU
    kernel_settings(attn_splits=3)
    assert choose(512, 8, 1, 4096, cpu) == 3 and choose(1, 1, 4, 600, cpu) == 1
    kernel_settings(attn_splits=1)
    assert choose(1, 1, 1, 600, cpu) == 1
    kernel_settings(attn_splits=None)
    # The default (heuristic) call on a long decode takes the split path and still matches the reference.
    args = paged_case([1], [599], 2, 1, 16, 32, F32, seed=3)
    calls = []
    original = triton_attention._merge_splits_kernel

    class Spy:  # records launches of the merge kernel, which only the split path uses
        def __getitem__(self, grid):
            calls.append(grid)
            return original[grid]

    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", Spy())
    attention_close(triton_attention.paged_attention_triton(*args), args)
    assert len(calls) == 1
    with pytest.raises(ValueError):
        triton_attention.paged_attention_triton(*paged_case([2], [5], 2, 1, 16, 16, F32), num_splits=2)


# ----------------------------------------------------------------------------------------------------- KV write

@pytest.mark.parametrize("kvh,d,bs,dtype,cache_dtype", [(2, 64, 16, F32, F32), (1, 8, 32, F16, F16),
                                                         (4, 16, 16, BF16, BF16), (3, 16, 32, F32, F16)])
def test_write_kv_skips_padding(kvh, d, bs, dtype, cache_dtype):
    g = torch.Generator().manual_seed(11)
    T, num_blocks = 9, 4
    qkv = randn(g, T, (2 + 2 * kvh) * d, dtype=dtype)       # k, v as strided views, like the engine's split
    k = qkv[:, 2 * d:(2 + kvh) * d].view(T, kvh, d)
    v = qkv[:, (2 + kvh) * d:].view(T, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[[1, 4, 8]] = -1
    k_cache, v_cache = randn(g, num_blocks, bs, kvh, d, dtype=cache_dtype), randn(g, num_blocks, bs, kvh, d,
                                                                                   dtype=cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_cache.write_kv_reference(k, v, k_ref, v_ref, slots)
    before = k_cache.clone()
    triton_kv_cache.write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert untouched.sum() == num_blocks * bs - 6
    assert torch.equal(k_cache.view(-1, kvh, d)[untouched], before.view(-1, kvh, d)[untouched])
    assert not torch.equal(k_cache, before)


# ------------------------------------------------------------------------------- INT8 / FP8 KV cache (issue 17)

KV_QUANT = [torch.int8, torch.float8_e4m3fn]


def dequantized(args, scales):
    dtype = args[0].dtype
    return (args[0], kv_cache.dequantize_kv(args[1], scales["k_scale"], dtype),
            kv_cache.dequantize_kv(args[2], scales["v_scale"], dtype), *args[3:])


QUANTIZED_WRITE_CASES = [(2, 64, 16, F32), (1, 8, 32, F16), (4, 16, 16, BF16), (3, 64, 32, BF16)]


@pytest.mark.parametrize("cache_dtype", KV_QUANT)
@pytest.mark.parametrize("kvh,d,bs,dtype", QUANTIZED_WRITE_CASES)
def test_quantized_write_kv_kernel_matches_the_reference_bit_for_bit(cache_dtype, kvh, d, bs, dtype):
    check_quantized_write(triton_kv_cache.write_kv_triton, cache_dtype, kvh, d, bs, dtype)


def check_quantized_write(write, cache_dtype, kvh, d, bs, dtype):
    """`write` (a quantized K/V writer: write(k, v, k_cache, v_cache, slots, k_scale, v_scale)) stores the
    reference's bytes and float16 scales; -1 slots stay untouched; each value reads back within the format's
    rounding of its token-and-head scale."""
    g = torch.Generator().manual_seed(13)
    T, num_blocks = 19, 4
    qkv = randn(g, T, (2 + 2 * kvh) * d, dtype=dtype) * 4
    k = qkv[:, 2 * d:(2 + kvh) * d].view(T, kvh, d)
    v = qkv[:, (2 + kvh) * d:].view(T, kvh, d)
    k[2] = 0                                   # an all-zero row: the scale's floor keeps it finite
    k[3, 0, 0] = 300                           # an outlier only widens its own token's scale
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[[1, 4, 8]] = -1
    fresh = lambda: ([torch.randint(-100, 100, (num_blocks, bs, kvh, d), generator=g, dtype=torch.int8)  # noqa: E731
                      .view(cache_dtype) for _ in range(2)],
                     [torch.rand(num_blocks, bs, kvh, generator=g).half() for _ in range(2)])
    (kc, vc), (ks, vs) = fresh()
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    kv_cache.write_kv_reference(k, v, *ref[:2], slots, *ref[2:])
    got = [t.clone() for t in (kc, vc, ks, vs)]
    write(k, v, *got[:2], slots, *got[2:])
    for a, e in zip(got, ref):
        assert torch.equal(a.view(torch.int8) if a.dtype == cache_dtype else a,
                           e.view(torch.int8) if e.dtype == cache_dtype else e)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    raw = lambda c: c.view(torch.int8).view(-1, kvh, d)   # noqa: E731
    assert torch.equal(raw(ref[0])[untouched], raw(kc)[untouched])
    valid = slots[slots >= 0]
    for x, c, sc in ((k, ref[0], ref[2]), (v, ref[1], ref[3])):
        x = x[slots >= 0].float()
        s = sc.view(-1, kvh)[valid].float()[..., None]
        err = (kv_cache.dequantize_kv(c.view(-1, kvh, d)[valid], sc.view(-1, kvh)[valid]) - x).abs()
        bound = s * 0.5 if cache_dtype == torch.int8 else x.abs() / 16 + s * 2 ** -10
        assert (err <= bound + EPS32 * (x.abs() + s)).all()    # plus float32's rounding of the dequantized value
    assert torch.equal(ref[0].view(-1, kvh, d)[slots[2]].float(), torch.zeros(kvh, d))


def test_fp8_encoding_in_the_kernel_is_torchs_cast_bit_for_bit():
    """The Triton kernels encode FP8 e4m3 with integer arithmetic (the interpreter's own cast misrounds some values):
    every representable value, every midpoint between two (ties to even) and a dense sweep, -0.0 included."""
    import triton
    import triton.language as tl
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.linspace(-448, 448, 20001),
                   torch.linspace(-0.03, 0.03, 20001), torch.tensor([-0.0])])

    @triton.jit
    def encode(x_ptr, y_ptr, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(y_ptr + i, triton_kv_cache._encode_fp8_e4m3(tl.load(x_ptr + i, mask=i < n)).to(tl.uint8),
                 mask=i < n)

    y = torch.empty(x.shape[0], dtype=torch.uint8)
    encode_on = on_device(lambda x, y: encode[(triton.cdiv(x.shape[0], 8192),)](x, y, x.shape[0], B=8192),
                          KERNEL_DEVICE or "cpu")
    encode_on(x, y)
    assert torch.equal(y, x.to(torch.float8_e4m3fn).view(torch.uint8))


QUANT_ATTENTION = [  # q_lens, ctx_lens, H, KVH, D, block_size, dtype: decodes and chunks over a cached prefix
    ([1, 5, 17, 1, 16], [0, 16, 15, 32, 17], 4, 4, 64, 16, F32),    # GQA 1
    ([15, 1, 3], [17, 32, 30], 7, 1, 8, 32, F32),                    # GQA 7, head 8
    ([1, 16, 1], [40, 16, 0], 16, 2, 64, 32, F32),                   # GQA 8
    ([1, 5, 17, 1], [0, 16, 15, 32], 8, 2, 64, 32, BF16),
    ([2, 1, 16], [31, 0, 16], 8, 1, 8, 16, F16),
    ([1, 1, 1], [99, 16, 0], 8, 2, 64, 16, F16),                     # decode-only: the split path too
]


@pytest.mark.parametrize("cache_dtype", KV_QUANT)
@pytest.mark.parametrize("q_lens,ctx_lens,h,kvh,d,bs,dtype", QUANT_ATTENTION)
def test_quantized_attention_kernel_matches_the_reference(cache_dtype, q_lens, ctx_lens, h, kvh, d, bs, dtype):
    float_args = paged_case(q_lens, ctx_lens, h, kvh, d, bs, dtype)
    args, scales = quantized(float_args, cache_dtype)
    ref = attention.paged_attention_reference(*args, **scales)
    # the oracle: dequantize (to the dtype), attend
    assert torch.equal(ref, attention.paged_attention_reference(*dequantized(args, scales)))
    for splits in ([1, 3] if max(q_lens) == 1 else [1]):
        attention_close(triton_attention.paged_attention_triton(*args, num_splits=splits, **scales), args, **scales)
    # What quantization costs here (unit-variance K/V): INT8 ~0.02, FP8 ~0.09 at most on these cases.
    drift = (ref.float() - attention.paged_attention_reference(*float_args).float()).abs().max().item()
    assert drift < (0.05 if cache_dtype == torch.int8 else 0.2), drift


# ------------------------------------------------------------------------------------------------------ RMSNorm

@pytest.mark.parametrize("shape,dtype,w_dtype", [((5, 64), F32, F32), ((4, 100), F16, F16), ((3, 48), BF16, BF16),
                                                 ((3, 4, 16), F32, F32), ((2, 3, 8), BF16, BF16),
                                                 ((4, 32), BF16, F32)])
def test_rms_norm(shape, dtype, w_dtype):
    g = torch.Generator().manual_seed(5)
    x = randn(g, *shape, dtype=dtype) * 3
    w = (1 + 0.1 * randn(g, shape[-1])).to(w_dtype)
    # in fp16/bf16 the normalised value is rounded to the dtype before the weight multiply (Hugging Face's order),
    # and the product once more
    assert_within_rounding(triton_rmsnorm.rms_norm_triton(x, w, 1e-6), exact_rms_norm(x, w, 1e-6), dtype,
                           roundings=1 if dtype == F32 else 2)


def test_rms_norm_per_head_on_strided_view():
    """Qwen3-style q_norm: [T, H, D] view into a wider qkv tensor (not contiguous)."""
    g = torch.Generator().manual_seed(6)
    qkv = randn(g, 5, 3 * 4 * 16, dtype=F16)
    q = qkv[:, :64].reshape(5, 4, 16)
    w = randn(g, 16, dtype=F16)
    assert_within_rounding(triton_rmsnorm.rms_norm_triton(q, w, 1e-5), exact_rms_norm(q, w, 1e-5), roundings=2)


def test_rms_norm_rounds_before_weight_fp16():
    """Hugging Face order: the normalised value is rounded to fp16, then multiplied by the weight. In fp16 the
    product of two fp16 values is exact in fp32, so the kernel must match the reference bit for bit except where
    the fp32 variance itself differs in its last bit (rare); multiplying in fp32 and rounding once would change
    about a quarter of the elements."""
    g = torch.Generator().manual_seed(4)
    x, w = randn(g, 32, 256, dtype=F16) * 3, randn(g, 256, dtype=F16)
    mismatched = (triton_rmsnorm.rms_norm_triton(x, w, 1e-6) != rmsnorm.rms_norm_reference(x, w, 1e-6))
    assert mismatched.float().mean() < 0.005


@pytest.mark.parametrize("shape,dtype", [((6, 64), F32), ((5, 96), F16), ((2, 3, 64), BF16)])
def test_fused_add_rms_norm(shape, dtype):
    g = torch.Generator().manual_seed(8)
    x, res = randn(g, *shape, dtype=dtype), randn(g, *shape, dtype=dtype) * 4
    w = (1 + 0.1 * randn(g, shape[-1])).to(dtype)
    normed, new_res = triton_rmsnorm.fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_normed, ref_res = rmsnorm.fused_add_rms_norm_reference(x, res, w, 1e-6)
    # x + residual rounded in the input dtype, exactly (but that the interpreter truncates fp32 -> bf16: see top)
    if dtype == BF16:
        assert_within_rounding(new_res, Exact(x.double() + res.double(), (x.double() + res.double()).abs(), 0))
    else:
        assert torch.equal(new_res, ref_res)
    assert_within_rounding(normed, exact_rms_norm(new_res, w, 1e-6), roundings=1 if dtype == F32 else 2)


# ------------------------------------------------------------------------------------------------------- rotary

@pytest.mark.parametrize("h,kvh,d,rot,dtype", [(4, 2, 64, 64, F32), (7, 1, 8, 8, F32), (4, 4, 64, 32, F32),
                                               (8, 2, 16, 16, F16), (2, 1, 128, 128, BF16), (4, 2, 64, 32, F16)])
def test_rotary(h, kvh, d, rot, dtype):
    g = torch.Generator().manual_seed(9)
    T, max_pos = 6, 64
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    q, k = randn(g, T, h, d, dtype=dtype), randn(g, T, kvh, d, dtype=dtype)
    ref_q, ref_k = rotary.rotary_reference(q, k, positions, cos_sin)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = triton_rotary.rotary_triton(q_in, k_in, positions, cos_sin)
    assert out_q.data_ptr() == q_in.data_ptr() and out_k.data_ptr() == k_in.data_ptr()   # in place
    # the cos/sin factors rounded to the dtype, then the sum (see the reference)
    assert_within_rounding(out_q, exact_rotary(q, positions, cos_sin), roundings=1 if dtype == F32 else 2)
    assert_within_rounding(out_k, exact_rotary(k, positions, cos_sin), roundings=1 if dtype == F32 else 2)
    assert torch.equal(out_q[..., rot:], q[..., rot:])     # columns past the rotated width pass through


@pytest.mark.parametrize("h,kvh,d,rot,dtype,cache_dtype", [
    (4, 2, 64, 64, F32, F32), (7, 1, 8, 8, F32, F32), (4, 4, 64, 32, BF16, BF16), (8, 2, 16, 16, F16, F16),
    (4, 2, 64, 64, BF16, torch.int8), (4, 2, 32, 16, F32, torch.float8_e4m3fn)])
def test_rotary_and_kv_write_in_one_kernel_give_the_two_kernels_bits(h, kvh, d, rot, dtype, cache_dtype):
    """rotary_write_kv_triton rotates q and fills the cache (and an INT8/FP8 cache's scales) with exactly the bits of
    rotary_triton then write_kv_triton, reading k and v as strided views of one qkv row as the model passes them;
    padding slots (-1) stay untouched."""
    g = torch.Generator().manual_seed(21)
    T, max_pos, bs, num_blocks = 9, 64, 4, 4
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    qkv = randn(g, T, (h + 2 * kvh) * d, dtype=dtype) * 3
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(T, h, d), k.view(T, kvh, d), v.view(T, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[[1, 4]] = -1
    quantized = cache_dtype in (torch.int8, torch.float8_e4m3fn)
    if quantized:
        caches = [torch.randint(-100, 100, (num_blocks, bs, kvh, d), generator=g, dtype=torch.int8).view(cache_dtype)
                  for _ in range(2)] + [torch.rand(num_blocks, bs, kvh, generator=g).half() for _ in range(2)]
    else:
        caches = [randn(g, num_blocks, bs, kvh, d, dtype=cache_dtype) for _ in range(2)] + [None, None]
    two = [c if c is None else c.clone() for c in caches]
    q_two, k_two = triton_rotary.rotary_triton(q.contiguous(), k.contiguous(), positions, cos_sin)
    triton_kv_cache.write_kv_triton(k_two, v, two[0], two[1], slots, two[2], two[3])
    one = [c if c is None else c.clone() for c in caches]
    q_one = triton_kv_cache.rotary_write_kv_triton(q.contiguous(), k, v, positions, cos_sin, one[0], one[1], slots,
                                                   one[2], one[3])
    assert torch.equal(q_one, q_two)
    for got, want, before in zip(one, two, caches):
        if got is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert not torch.equal(got.view(torch.uint8), before.view(torch.uint8))


# -------------------------------------------------------------------------------------------------- SiLU and mul

ACTIVATIONS = {"silu": ("silu_and_mul_triton", exact_silu_and_mul),
               "gelu_tanh": ("gelu_tanh_and_mul_triton", exact_gelu_tanh_and_mul)}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("shape,dtype", [((7, 96), F32), ((2, 3, 2200), F16), ((5, 34), BF16)])
def test_act_and_mul(act, shape, dtype):
    kernel, exact = ACTIVATIONS[act]
    g = torch.Generator().manual_seed(10)
    x = randn(g, *shape, dtype=dtype) * 3
    # in fp16/bf16 act(gate) is rounded to the dtype before the product (the reference's order), then the product
    assert_within_rounding(getattr(triton_activation, kernel)(x), exact(x), roundings=1 if dtype == F32 else 2)


# ------------------------------------------------------------------------------------------------------- LoRA

@pytest.mark.parametrize("tokens,k,r,n,dtype", [(7, 48, 8, 40, F32), (5, 200, 16, 130, F16), (3, 32, 4, 24, BF16)])
def test_lora_shrink_and_expand_follow_each_tokens_adapter(tokens, k, r, n, dtype):
    """Three adapters and tokens of none (-1), interleaved: each token goes through its own slot's matrices, into
    the columns [col0, col0 + n) of a wider output at rank offset r0 of the shrunk rows."""
    g = torch.Generator().manual_seed(13)
    x = randn(g, tokens, k, dtype=dtype)
    a = randn(g, 3, 2 * r, k, dtype=dtype) * 0.2
    b = randn(g, 3, n, r, dtype=dtype) * 0.2
    slots = torch.tensor([(i % 4) - 1 for i in range(tokens)], dtype=torch.int32)
    scales = torch.tensor([0.5, 2.0, 1.25])
    t = triton_lora.lora_shrink_triton(x, a, slots)
    t_ref = lora.lora_shrink_reference(x, a, slots)
    out = randn(g, tokens, n + 20, dtype=dtype)
    ref, before = out.clone(), out.clone()
    triton_lora.lora_expand_triton(out, t_ref, b, slots, scales, 10, r)
    lora.lora_expand_reference(ref, t_ref, b, slots, scales, 10, r)
    untouched = slots == -1
    assert torch.equal(out[untouched], ref[untouched]) and torch.equal(t[untouched], t_ref[untouched])
    assert not t[untouched].any()
    for slot in range(3):
        rows = slots == slot
        # shrink: fp32 sums of the dtype's exact products
        assert_within_rounding(t[rows], exact_linear(x[rows], a[slot]), F32)
        assert_within_rounding(t_ref[rows], exact_linear(x[rows], a[slot]), F32)
        # expand: out + scale * t @ b^T, t rounded to the dtype for the product on a GPU, the sum once more
        expected = exact_lora_add(before[rows, 10:10 + n], t_ref[rows, r:2 * r], torch.eye(r, dtype=F32),
                                  b[slot].T.float(), scales[slot].item())
        for got in (out, ref):
            assert_within_rounding(got[rows, 10:10 + n], expected, roundings=1 if dtype == F32 else 2)


# ---------------------------------------------------------------------------------------------------- dispatch

def test_dispatch_routes_to_triton_when_forced(monkeypatch, kernel_settings):
    """With TRELLM_FORCE_TRITON=1 every dispatch function calls its Triton kernel (spied on) on CPU tensors and
    returns the reference's numbers; with it off, none does."""
    calls = []

    def spy(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or fn(*a, **kw))

    spy(triton_attention, "paged_attention_triton")
    spy(triton_kv_cache, "write_kv_triton")
    spy(triton_kv_cache, "rotary_write_kv_triton")
    spy(triton_rmsnorm, "rms_norm_triton")
    spy(triton_rmsnorm, "fused_add_rms_norm_triton")
    spy(triton_rotary, "rotary_triton")
    spy(triton_activation, "silu_and_mul_triton")
    g = torch.Generator().manual_seed(12)
    args = paged_case([3, 1], [13, 20], 4, 2, 16, 16, F32)
    x, res, w = randn(g, 3, 32), randn(g, 3, 32), randn(g, 32)
    q, k = randn(g, 3, 4, 16), randn(g, 3, 2, 16)
    pos = torch.tensor([0, 5, 9])
    cos_sin = randn(g, 10, 16)
    slots = torch.tensor([3, -1, 40])

    def run_all():
        caches = (args[1].clone(), args[2].clone())
        kv_cache.write_kv(k, k * 2, *caches, slots)
        fused = (args[1].clone(), args[2].clone())
        fused_q = kv_cache.rotary_and_write_kv(q.clone(), k.clone(), k * 2, pos, cos_sin, *fused, slots)
        return (attention.paged_attention(*args), *caches, rmsnorm.rms_norm(x, w, 1e-6),
                *rmsnorm.fused_add_rms_norm(x, res, w, 1e-6), *rotary.apply_rotary(q.clone(), k.clone(), pos, cos_sin),
                activation.silu_and_mul(x), fused_q, *fused)

    kernel_settings(force_triton=False)
    expected = run_all()
    assert calls == []
    kernel_settings(force_triton=True)
    got = run_all()
    assert sorted(calls) == sorted(["write_kv_triton", "paged_attention_triton", "rms_norm_triton",
                                    "fused_add_rms_norm_triton", "rotary_triton", "silu_and_mul_triton",
                                    "rotary_write_kv_triton"])
    for outputs in (expected, got):
        attn, _, _, normed, fused, residual, rotated_q, rotated_k, silu, fused_q, fused_k_cache, _ = outputs
        assert_within_rounding(fused_q, exact_rotary(q, pos, cos_sin))
        valid = slots >= 0
        assert_within_rounding(fused_k_cache.view(-1, 2, 16)[slots[valid]],
                               exact_rotary(k[valid], pos[valid], cos_sin))
        attention_close(attn, args)
        assert_within_rounding(normed, exact_rms_norm(x, w, 1e-6))
        assert torch.equal(residual, x + res)
        assert_within_rounding(fused, exact_rms_norm(x + res, w, 1e-6))
        assert_within_rounding(rotated_q, exact_rotary(q, pos, cos_sin))
        assert_within_rounding(rotated_k, exact_rotary(k, pos, cos_sin))
        assert_within_rounding(silu, exact_silu_and_mul(x))
    for a, e in zip(got[1:3], expected[1:3]):
        assert torch.equal(a, e)


# ------------------------------------------------------------------------------------------ GPU compile check

COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trellm_kernels import triton_activation, triton_attention, triton_kv_cache, triton_moe, triton_rmsnorm, triton_rotary

def build(fn, consts, ptrs, floats=()):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, ptrs["*"]) if n.endswith("_ptr") else
           "fp32" if n in floats else "i32" for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

idx = {"cu_q_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
for dt, prec in (("*fp16", "tf32"), ("*fp32", "ieee")):
    build(triton_attention._paged_attn_kernel, dict(GROUP=7, GROUP_P=8, BLOCK_Q=8, HEAD_DIM=8, D_P=16, TILE=32,
          PREC=prec, UPCAST=False, QUANT=0), {"*": dt, **idx}, ("qk_scale",))
    build(triton_attention._split_decode_kernel, dict(NUM_SPLITS=4, GROUP=4, BLOCK_M=16, HEAD_DIM=128, D_P=128,
          TILE=32, PREC=prec, UPCAST=False, QUANT=0), {"*": dt, **idx}, ("qk_scale",))
build(triton_attention._merge_splits_kernel, dict(NUM_SPLITS=3, SPLITS_P=4, HEAD_DIM=64, D_P=64),
      {"*": "*fp32", "out_ptr": "*bf16"})
build(triton_kv_cache._write_kv_kernel, dict(BLOCK_H=4, BLOCK_D=64), {"*": "*bf16", "slot_ptr": "*i64"})
for raw, quant in (("*i8", 1), ("*u8", 2), ("*u8", 3)):   # INT8 / FP8 KV caches (FP8 as bytes; 3: sm_89+ cvt)
    kv = {"kc_ptr": raw, "vc_ptr": raw, "ks_ptr": "*fp16", "vs_ptr": "*fp16"}
    build(triton_attention._paged_attn_kernel, dict(GROUP=4, GROUP_P=4, BLOCK_Q=4, HEAD_DIM=64, D_P=64, TILE=32,
          PREC="tf32", UPCAST=False, QUANT=quant), {"*": "*bf16", **idx, **kv}, ("qk_scale",))
    build(triton_attention._split_decode_kernel, dict(NUM_SPLITS=4, GROUP=4, BLOCK_M=16, HEAD_DIM=128, D_P=128,
          TILE=32, PREC="tf32", UPCAST=False, QUANT=quant), {"*": "*fp16", **idx, **kv}, ("qk_scale",))
    build(triton_kv_cache._write_kv_quant_kernel, dict(QUANT=min(quant, 2), BLOCK_H=4, BLOCK_D=64),
          {"*": "*bf16", "slot_ptr": "*i64", **kv})
for quant, kv in ((0, {}), (1, {"kc_ptr": "*i8", "vc_ptr": "*i8", "ks_ptr": "*fp16", "vs_ptr": "*fp16"}),
                  (2, {"kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp16", "vs_ptr": "*fp16"})):
    build(triton_kv_cache._rotary_write_kv_kernel, dict(QUANT=quant, BLOCK_HQ=8, BLOCK_R=32, BLOCK_H=4, BLOCK_D=64),
          {"*": "*bf16", "pos_ptr": "*i32", "cs_ptr": "*fp32", "slot_ptr": "*i32", **kv})
build(triton_rmsnorm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_N=1024), {"*": "*bf16"}, ("eps",))
build(triton_rotary._rotary_kernel, dict(BLOCK_HQ=8, BLOCK_HK=2, BLOCK_R=32),
      {"*": "*fp16", "pos_ptr": "*i64", "cs_ptr": "*fp32"})
for act in (0, 1):
    build(triton_activation._act_and_mul_kernel, dict(ACT=act, BLOCK=1024), {"*": "*bf16"})
for dt, prec in (("*bf16", "tf32"), ("*fp32", "ieee")):
    for by_token, weighted in ((True, False), (False, True)):
        build(triton_moe._moe_gemm_kernel, dict(TOP_K=2, A_BY_TOKEN=by_token, MUL_WEIGHT=weighted, BLOCK_M=64,
              BLOCK_N=64, BLOCK_K=32, PREC=prec, UPCAST=False),
              {"*": dt, "pairs_ptr": "*i32", "block_experts_ptr": "*i32", "weights_ptr": "*fp32",
               "out_ptr": "*fp32" if weighted else dt})
print("compiled")
"""


def test_kernels_compile_for_gpu():
    """The interpreter accepts code the compiler rejects; compile every kernel for sm_90 (to a cubin, with the
    ptxas bundled in the triton wheel) in a fresh interpreter-free process. No GPU is needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"   # silences a Triton 3.9 warning; fusion is the default anyway
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_dispatch_over_a_quantized_cache_routes_to_triton_when_forced(monkeypatch, kernel_settings):
    calls = []
    for module, name in ((triton_attention, "paged_attention_triton"), (triton_kv_cache, "write_kv_triton")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    args, scales = quantized(paged_case([3, 1], [13, 20], 4, 2, 16, 16, F32), torch.int8)
    k = randn(torch.Generator().manual_seed(3), 3, 2, 16)
    slots = torch.tensor([3, -1, 40])

    def run():
        caches = [args[1].clone(), args[2].clone(), scales["k_scale"].clone(), scales["v_scale"].clone()]
        kv_cache.write_kv(k, k * 2, caches[0], caches[1], slots, caches[2], caches[3])
        return (attention.paged_attention(args[0], caches[0], caches[1], *args[3:], k_scale=caches[2],
                                          v_scale=caches[3]), *caches)

    kernel_settings(force_triton=False)
    expected = run()
    assert calls == []
    kernel_settings(force_triton=True)
    got = run()
    assert sorted(calls) == ["paged_attention_triton", "write_kv_triton"]
    for a, e in zip(got[1:], expected[1:]):
        assert torch.equal(a, e)
    for outputs in (expected, got):     # attention over the caches as written
        attention_close(outputs[0], (args[0], outputs[1], outputs[2], *args[3:]), k_scale=outputs[3],
                        v_scale=outputs[4])
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        kv_cache.write_kv(k, k, args[1], args[2], slots)


# ------------------------------------------------------------------------------------------------ linear layers

@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 96, 80), (7, 96, 80), (33, 256, 1408), (5, 100, 130),
                                                 (33, 64, 8), (113, 64, 200)])
def test_int8_linear_kernel_and_cpu_path_match_the_dequantizing_reference(dtype, tokens, out_f, in_f):
    g = torch.Generator().manual_seed(1)
    w, b = randn(g, out_f, in_f, dtype=dtype), randn(g, out_f, dtype=dtype)
    q = linear.prepare_weight(w, "int8")
    assert q.qweight.dtype == torch.int8 and q.dense is None and q.prepared is None and q.packed is None  # int8 only
    # Per-row INT8 keeps each weight within half a step of its row's scale (plus, in fp16/bf16, the rounding of
    # the dequantized value to the dtype).
    rounding = 0 if dtype == F32 else w.float().abs().max().item() * 2 ** -7
    assert (q.tensor().float() - w.float()).abs().max() <= q.scales.float().max() / 2 + rounding + EPS32 * w.float().abs().max()
    x = randn(g, tokens, in_f, dtype=dtype)

    w64 = q.int8_rows().double() * q.scales.double()[:, None]
    # The C++ operator built for AVX2 alone rounds each token's activations to int16 first (test_cpu_ops.py checks
    # that arithmetic bit for bit); its sums are then of those values.
    int16_tile = linear.linear_path(q).startswith("INT8 C++ (AVX2")
    xq, x_scale = linear.int16_activations(x)
    x_cpu = xq.double() * x_scale.double() if int16_tile else x
    for bias in (None, b):
        # fp16/bf16: the kernel keeps q and the scale exact and rounds its output; the dequantizing path rounds
        # each weight to the dtype first
        half = 1 if dtype == F32 else 2
        assert_within_rounding(triton_linear.int8_linear_triton(x, q.int8_rows(), q.scales, bias),
                               exact_linear(x, w64, bias), roundings=half)
        assert_within_rounding(linear.linear(x, q, bias), exact_linear(x_cpu, w64, bias),
                               roundings=half)


# -------------------------------------------------------------------------------------------- mixture of experts

MOE_CASES = [  # tokens, experts, top_k, hidden, expert intermediate, dtype
    (1, 4, 1, 32, 16, F32), (7, 8, 2, 48, 40, F32), (65, 16, 4, 32, 24, F16), (513, 64, 8, 16, 8, F32),
    (33, 64, 6, 24, 20, BF16), (200, 8, 2, 64, 48, BF16), (2, 4, 4, 16, 72, F32),
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, dtype", MOE_CASES)
def test_fused_moe_kernel_matches_the_reference(tokens, experts, top_k, hidden, inter, dtype):
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    # fp16/bf16: gate/up's output, silu, the activation and the output are each rounded to the dtype
    assert_within_rounding(triton_moe.fused_moe_triton(x, w13, w2, weights, ids), exact_moe(x, w13, w2, weights, ids),
                           roundings=1 if dtype == F32 else 4)


@pytest.mark.parametrize("seed", range(6))
def test_align_by_expert_gives_every_pair_once_in_blocks_of_one_expert(seed):
    g = torch.Generator().manual_seed(seed)
    tokens, experts, top_k, block_m = [(1, 4, 1, 16), (9, 8, 2, 16), (100, 64, 8, 64), (37, 5, 5, 16),
                                       (300, 16, 2, 64), (3, 64, 1, 16)][seed]
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pairs, block_experts = triton_moe.align_by_expert(ids, experts, block_m)
    n = tokens * top_k
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n)) and (pairs[pairs >= n] == n).all()
    by_block = pairs.view(-1, block_m)
    for b, e in enumerate(block_experts.tolist()):
        members = by_block[b][by_block[b] < n].long()
        if e < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (ids.reshape(-1)[members] == e).all()


def test_quantization_is_checked():
    with pytest.raises(ValueError,
                       match="quantization='int2' is not one of none, int8, w8a8, int4, int4-g64, int4-g32"):
        linear.prepare_weight(torch.zeros(2, 2), "int2")


# Odd shapes (inputs not a multiple of the group, odd inputs, outputs not a multiple of 16 or of the block) and ones
# torch's CPU int4 operator takes (N % 16 == 0, whole groups).
INT4_SHAPES = [(1, 96, 80), (7, 100, 130), (5, 64, 344), (33, 48, 256), (2, 256, 512)]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens, out_f, in_f", INT4_SHAPES)
def test_int4_linear_kernel_and_cpu_path_match_the_dequantizing_reference(dtype, group, tokens, out_f, in_f):
    from trellm_kernels import int4
    g = torch.Generator().manual_seed(2)
    w, b = randn(g, out_f, in_f, dtype=dtype), randn(g, out_f, dtype=dtype)
    q = int4.quantize_int4(w, group)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (out_f, (in_f + 1) // 2)
    assert q.scales.shape == q.zeros.shape == (-(-in_f // group), out_f)
    # Round to nearest over [min(w, 0), max(w, 0)]: every weight within half its group's step (plus, in fp16/bf16,
    # the rounding of the scale and of the dequantized value to the dtype).
    step = q.scales.float().repeat_interleave(group, 0)[:in_f].t()
    slack = 0 if dtype == F32 else 2 ** -7 * (w.float().abs().max().item() + 8 * step.max().item())
    assert ((q.tensor().float() - w.float()).abs() <= step / 2 + slack + EPS32 * (w.float().abs() + step)).all()
    x = randn(g, tokens, in_f, dtype=dtype)
    prepared = linear.prepare_int4(q)
    on_group_op, on_torch_op = prepared.int4.groups is not None, prepared.int4.cpu_scales_zeros is not None
    on_cpu_op = on_group_op or on_torch_op
    # whole blocks of 32 outputs: the group operator; else whole 16s: torch's; a short last group padded for both
    assert (on_group_op, on_torch_op) == (out_f % 32 == 0, out_f % 32 != 0 and out_f % 16 == 0)
    assert torch.equal(prepared.int4.q(), q.q()), "the CPU layout holds exactly the quantized values"
    for bias in (None, b):
        # the kernel rounds its dequantized tile to the dtype, and its output
        assert_within_rounding(triton_linear.int4_linear_triton(x, q.packed, q.scales, q.zeros, group, bias),
                               exact_linear(x, q.tensor(torch.float64), bias), roundings=1 if dtype == F32 else 2)
        check_int4_cpu_path(linear.linear(x, prepared, bias), x, prepared, bias)
    if on_cpu_op:
        together = linear.linear(x, prepared)
        for i in range(tokens):      # a token's result does not depend on what shares the call
            assert torch.equal(linear.linear(x[i:i + 1], prepared), together[i:i + 1])


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("group,mins,bits", [(32, False, 8), (32, True, 8), (16, True, 8), (32, True, 4)])
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 64, 64), (5, 100, 96), (33, 64, 128)])
def test_group_linear_kernel_matches_the_dequantizing_reference(dtype, group, mins, bits, tokens, out_f, in_f):
    """GGUF's blocks (kernels/group_quant.py) through the Triton kernel: each group's tile dequantized in fp32 and
    rounded to the dtype, as the reference rounds its dequantized weight."""
    from trellm_kernels.group_quant import GroupWeight
    g = torch.Generator().manual_seed(3)
    q = (torch.randint(-32, 32, (out_f, in_f), generator=g, dtype=torch.int8) if bits == 8 else
         torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8))
    scales = torch.rand(in_f // group, out_f, generator=g) * 0.05
    m = torch.rand(in_f // group, out_f, generator=g) * 0.3 if mins else None
    w = GroupWeight(q, scales, m, group)
    x = randn(g, tokens, in_f, dtype=dtype)
    assert_within_rounding(triton_linear.group_linear_triton(x, q, scales, m, group),
                           exact_linear(x, w.tensor(dtype).double(), None), roundings=1 if dtype == F32 else 2)


def check_int4_cpu_path(actual, x, weight, bias=None):
    """linear() on a CPU for an INT4 weight against the exact product. The group operator computes
    sum_g (s * sum q x - z s * sum x) in fp32 (the two parts' magnitudes; bf16/fp16 activations widened exactly,
    the output rounded once). torch's int4pack operator computes sum x * ((q - 8) * scale + zero') with
    zero' = (8 - zeros) * scale, all in bf16 (the activations, zero', the dequantized weight and the output: four
    roundings, of terms whose magnitudes are those of the two parts); the dequantizing path rounds the weight to the
    scales' dtype, then linear's output."""
    w64 = weight.int4.tensor(torch.float64)
    if weight.int4.groups is None and weight.int4.cpu_scales_zeros is None:
        assert_within_rounding(actual, exact_linear(x, w64, bias), roundings=1 if x.dtype == F32 else 2)
        return
    scales = weight.int4.scales.double().repeat_interleave(weight.int4.group, 0)[:x.shape[-1]].t()
    zeros = weight.int4.zeros.double().repeat_interleave(weight.int4.group, 0)[:x.shape[-1]].t()
    stored = weight.int4.stored_tensor(torch.float64)
    if weight.int4.groups is not None:
        parts = (stored + zeros * scales).abs() + (zeros * scales).abs()
    else:
        parts = (stored + (zeros - 8) * scales).abs() + ((8 - zeros) * scales).abs()
    if weight.int4.perm is not None:
        parts = torch.empty_like(parts).index_copy_(1, weight.int4.perm, parts)
    exact = exact_linear(x, w64, bias, w_abs=parts)
    if weight.int4.groups is not None:
        assert_within_rounding(actual, exact, roundings=1)
    else:
        assert_within_rounding(actual, exact, BF16, roundings=4)


def test_int4_act_order_permutes_the_inputs_before_the_kernel():
    """A GPTQ act-order weight is held with its inputs sorted by group; the layer must gather x in that order."""
    from dataclasses import replace
    from trellm_kernels import int4
    g = torch.Generator().manual_seed(3)
    w, x = randn(g, 64, 256), randn(g, 3, 256)
    perm = torch.randperm(256, generator=g)
    stored = int4.quantize_int4(w[:, perm], 64)          # groups of the permuted inputs
    q = replace(stored, perm=perm)
    dense = q.tensor()
    assert torch.equal(dense[:, perm], stored.tensor())
    assert (dense - w).abs().max() <= stored.scales.max() / 2 + EPS32 * (w.abs().max() + stored.scales.max())
    for weight in (linear.Weight(None, int4=q), linear.prepare_int4(q)):   # dequantize path, CPU operator
        check_int4_cpu_path(linear.linear(x, weight), x, weight)
