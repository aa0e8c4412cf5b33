"""The C++ CPU operators (kernels/cpu/, built by kernels/cpu_ops.py) against the PyTorch references, and the CPU
dispatch that chooses them. Unlike the Triton kernels' tests (test_kernels.py), these need no interpreter: they run
in any session on a host with g++ and ninja (CI has both: a missing build is a failure, not a skip)."""
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from trellm_kernels import (activation, attention, cpu_ops, dispatch, kv_cache, linear, linear_choice, lora, rmsnorm,
                            rotary)
from kernel_cases import paged_case, quantized, randn
from rounding import (EPS32, assert_within_rounding, exact_linear, exact_lora_add, exact_rms_norm, exact_rotary,
                      exact_silu_and_mul)
from test_kernels import (BF16, F16, F32, KV_QUANT, QUANTIZED_WRITE_CASES, attention_close, attention_options_close,
                          check_quantized_write)

pytestmark = pytest.mark.kernels


def isa_params(*isas):
    """The builds of cpu_ops.ISA_FLAGS as test parameters: each this host executes, and a skip that names the
    instruction set for each it does not, so every host runs the same test ids."""
    runnable = cpu_ops.runnable_isas()
    return [pytest.param(isa, id=isa, marks=() if isa in runnable else pytest.mark.skip(
        reason=f"this CPU ({cpu_ops.cpu_model()}) cannot execute the {isa} build: it lacks "
               f"{' '.join(cpu_ops.ISA_CPU_FLAGS[isa]) or 'x86-64'}")) for isa in isas]


@pytest.fixture(params=isa_params(*cpu_ops.ISA_FLAGS))
def ops(request, monkeypatch):
    """The operators built for one instruction set (each the host executes: conftest.py's header lists them),
    installed as the process's operators, so the dispatch functions (linear, attention, ...) run that build too.
    A build that fails is the test's failure, not a skip: CI has g++ and ninja."""
    module = cpu_ops.load_isa(request.param)
    monkeypatch.setattr(cpu_ops, "_module", module)
    return module


def half(dtype) -> int:
    """Roundings to a 16-bit dtype (tests/rounding.py) of a path that rounds an intermediate and its output."""
    return 1 if dtype == F32 else 2

CPU_OP_CASES = [  # q_lens, ctx_lens: decodes, chunks over a cached prefix, a fresh prompt, mixed in one batch
    ([1, 1, 1, 1, 1], [0, 14, 15, 200, 33]),
    ([9, 1, 40, 1, 3], [20, 63, 0, 5, 130]),
    ([1] * 12 + [17], [int(x) for x in torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))]),
    ([5, 5, 2, 16, 5, 1], [127, 128, 40, 250, 3, 60]),   # speculative verification: guesses + 1 rows per sequence
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bs", [16, 32, 128])
@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("case", range(len(CPU_OP_CASES)))
def test_cpu_attention_operator_matches_reference(ops, case, group, d, bs, dtype):
    """The C++ operator (every row, whatever the chunk length) against the reference on random paged layouts."""
    q_lens, ctx_lens = CPU_OP_CASES[case]
    kvh = 2
    args = paged_case(q_lens, ctx_lens, kvh * group, kvh, d, bs, dtype, seed=case)
    out = torch.empty_like(args[0])
    ops.paged_attention(out, *args[:7], 1 << 30, 0, 0.0)
    attention_close(out, args)


@pytest.mark.parametrize("d", [64, 128, 8])
@pytest.mark.parametrize("case", range(len(CPU_OP_CASES)))
def test_cpu_attention_operator_reads_a_float16_cache(ops, case, d):
    """A float16 model's cache: with AVX2 its values are widened 8 at a time as they are summed (head sizes 64 and
    128), others through the per-block float copy; the reference's answer either way."""
    args = paged_case(*CPU_OP_CASES[case], 8, 2, d, 16, F16, seed=case)
    out = torch.empty_like(args[0])
    ops.paged_attention(out, *args[:7], 1 << 30, 0, 0.0)
    attention_close(out, args)


@pytest.mark.parametrize("cache_dtype", KV_QUANT)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("case", range(len(CPU_OP_CASES)))
def test_cpu_quantized_attention_operator_matches_reference(ops, case, group, d, bs, dtype, cache_dtype):
    """The operator over an INT8 / FP8 cache (values read as bytes, scales folded into scores and weights)."""
    kvh = 2
    args, scales = quantized(paged_case(*CPU_OP_CASES[case], kvh * group, kvh, d, bs, dtype, seed=case), cache_dtype)
    out = torch.empty_like(args[0])
    ops.paged_attention_quantized(out, args[0], args[1].view(torch.int8), args[2].view(torch.int8),
                                  scales["k_scale"], scales["v_scale"], *args[3:7], 1 << 30, cache_dtype == torch.int8,
                                  0, 0.0)
    attention_close(out, args, **scales)


@pytest.mark.parametrize("cache_dtype", [None, *KV_QUANT])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (16, 0.0), (33, 0.0), (0, 30.0), (12, 2.0)])
@pytest.mark.parametrize("case", range(len(CPU_OP_CASES)))
def test_cpu_attention_operator_window_and_softcap(ops, case, window, softcap, cache_dtype):
    """The operator's sliding window (blocks before a row's window never read) and score cap, over float and
    quantized caches, against the reference."""
    args = paged_case(*CPU_OP_CASES[case], 8, 2, 64, 16, F32, seed=case)
    scales = {}
    if cache_dtype is not None:
        args, scales = quantized(args, cache_dtype)
    out = torch.empty_like(args[0])
    if cache_dtype is None:
        ops.paged_attention(out, *args[:7], 1 << 30, window, softcap)
    else:
        ops.paged_attention_quantized(out, args[0], args[1].view(torch.int8), args[2].view(torch.int8),
                                      scales["k_scale"], scales["v_scale"], *args[3:7], 1 << 30,
                                      cache_dtype == torch.int8, window, softcap)
    attention_options_close(out, args, window, softcap, **scales)


@pytest.mark.parametrize("cache_dtype", [None, *KV_QUANT])
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (20, 0.0), (0, 50.0), (9, 3.0)])
def test_cpu_dispatch_window_and_softcap(ops, kernel_settings, window, softcap, cache_dtype):
    """On a CPU, long chunks with a window run in torch's fused attention over their window's blocks, and with a
    soft cap in the reference's GEMMs; together with the operator's rows, the reference's answer."""
    kernel_settings(force_triton=False)
    args = paged_case([1, 40, 1, 25], [30, 7, 90, 0], 8, 4, 64, 16, F32)
    scales = {}
    if cache_dtype is not None:
        args, scales = quantized(args, cache_dtype)
    out = attention.paged_attention(*args, **scales, window=window, softcap=softcap)
    attention_options_close(out, args, window, softcap, **scales)


@pytest.mark.parametrize("cache_dtype", KV_QUANT)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("d", [8, 64])
def test_cpu_gather_dequantize_operator_matches_the_reference(ops, cache_dtype, dtype, d):
    """The long-chunk path's gather: the blocks in the order given, each value times its scale, as torch does it."""
    g = torch.Generator().manual_seed(14)
    cache, scales = kv_cache.quantize_kv(randn(g, 9, 16, 3, d) * 3, cache_dtype)
    blocks = torch.tensor([7, 2, 2, 0, 8])
    out = torch.empty(5, 16, 3, d, dtype=dtype)
    ops.gather_dequantize(out, cache.view(torch.int8), scales, blocks, cache_dtype == torch.int8)
    assert torch.equal(out, kv_cache.dequantize_kv(cache[blocks], scales[blocks], dtype))


@pytest.mark.parametrize("cache_dtype", KV_QUANT)
def test_cpu_dispatch_over_a_quantized_cache(ops, monkeypatch, cache_dtype, kernel_settings):
    """A quantized cache on a CPU: decodes and short chunks in the operator, long chunks through torch's fused
    attention over their dequantized blocks; together the reference's answer, and the operator saw the short rows
    only. Without the operators the reference runs."""
    args, scales = quantized(paged_case([1, 40, 1, 5], [30, 7, 90, 0], 8, 4, 64, 16, F32), cache_dtype)
    seen = []
    real = ops

    class Spy:
        def paged_attention_quantized(self, *a):
            seen.append(a[-4])
            return real.paged_attention_quantized(*a)

        def __getattr__(self, name):
            seen.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_ops, "_module", Spy())
    kernel_settings(force_triton=False)
    attention_close(attention.paged_attention(*args, **scales), args, **scales)
    # the long chunk's keys and values dequantized by the operator as they are gathered
    assert seen == [attention.CPU_OP_MAX_Q_LEN, "gather_dequantize", "gather_dequantize"]
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpu_ops, "_error", "off")
    attention_close(attention.paged_attention(*args, **scales), args, **scales)


def test_cpu_dispatch_splits_long_chunks(ops, monkeypatch, kernel_settings):
    """On a CPU the dispatch sends decodes and short chunks to the operator and long chunks to the reference's
    GEMMs; together they equal the reference, and the operator saw only the short rows."""
    args = paged_case([1, 40, 1, 5], [30, 7, 90, 0], 8, 4, 64, 16, F32)
    seen = []
    real = ops

    class Spy:
        def paged_attention(self, out, q, k, v, cu, lens, tables, scale, max_q_len, window, softcap):
            seen.append(max_q_len)
            return real.paged_attention(out, q, k, v, cu, lens, tables, scale, max_q_len, window, softcap)

    monkeypatch.setattr(cpu_ops, "_module", Spy())
    kernel_settings(force_triton=False)
    attention_close(attention.paged_attention(*args), args)
    assert seen == [attention.CPU_OP_MAX_Q_LEN]


def test_cpu_operators_split_their_work_over_torchs_openmp_threads(ops):
    """ATen's at::parallel_for splits work only where the calling file is compiled with OpenMP: built without it,
    every C++ operator ran on one core of the machine's two. And the process keeps one OpenMP runtime, torch's."""
    with open(ops.__file__, "rb") as f:
        assert b"GOMP_parallel" in f.read(), "built without OpenMP: at::parallel_for runs on one thread"
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def test_cpu_ops_build_with_the_pinned_ninja_whatever_is_first_on_path(tmp_path):
    """Two ninja versions rebuilt the operators after each other (their logs hash commands differently): the
    server's stubs ran the venv's and `.venv/bin/python` the system's. A ninja first on PATH that fails must not be
    the one run."""
    assert cpu_ops.load() is not None, cpu_ops.error()     # built (or found built) in this process
    fake = tmp_path / "ninja"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\nexit 1\n")
    fake.chmod(0o755)
    code = "from trellm_kernels import cpu_ops; assert cpu_ops.load() is not None, cpu_ops.error()"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "calls").exists()


def test_cpu_ops_can_be_turned_off(monkeypatch, kernel_settings):
    """TRELLM_CPU_OPS=0 (or a failed build) leaves the PyTorch path, and says why."""
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpu_ops, "_error", None)
    kernel_settings(cpu_ops=False)
    kernel_settings(force_triton=False)
    assert cpu_ops.load() is None and "TRELLM_CPU_OPS=0" in cpu_ops.error()
    args = paged_case([1, 3], [10, 20], 4, 2, 8, 16, F32)
    attention_close(attention.paged_attention(*args), args)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 100), (300, 512)])
def test_cpu_rms_norm_operators_match_reference(ops, rows, cols, dtype):
    """RMSNorm and the fused residual add (whose residual is x + residual rounded in the dtype, exactly), into new
    tensors and in place."""
    g = torch.Generator().manual_seed(rows)
    x, res = randn(g, rows, cols, dtype=dtype) * 3, randn(g, rows, cols, dtype=dtype)
    w = (1 + 0.1 * randn(g, cols)).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    assert_within_rounding(out, exact_rms_norm(x, w, 1e-6), roundings=half(dtype))
    ref_res = rmsnorm.fused_add_rms_norm_reference(x, res, w, 1e-6)[1]
    normed, new_res = torch.empty_like(x), torch.empty_like(res)
    ops.fused_add_rms_norm(normed, new_res, x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    exact = exact_rms_norm(ref_res, w, 1e-6)
    assert_within_rounding(normed, exact, roundings=half(dtype))
    ops.fused_add_rms_norm(x, res, x, res, w, 1e-6)      # out and res_out may be the inputs
    assert torch.equal(res, ref_res)
    assert_within_rounding(x, exact, roundings=half(dtype))


def test_the_operators_round_to_bf16_as_torch_does_at_ties_overflow_and_nan(ops):
    """The residual add rounds each float sum to bf16 with the operators' own branch-free rounding: ties to even
    (1 + 2^-8 down to 1, 1 + 3 * 2^-8 up), a sum past bf16's largest value to inf, a subnormal kept, NaN (inf - inf)
    to a NaN. Compared bit for bit with torch's sum in bf16, but for NaN's bits (torch's own scalar and vector
    conversions differ there)."""
    x = torch.tensor([[1.0, 1.0, 3e38, float("inf"), float("nan"), -1.0, 0.5, 1e-40]], dtype=torch.bfloat16)
    res = torch.tensor([[2 ** -8, 3 * 2 ** -8, 3e38, -float("inf"), 0.0, -2 ** -8, 2 ** -10, 0.0]],
                       dtype=torch.bfloat16)
    normed, new_res = torch.empty_like(x), torch.empty_like(res)
    ops.fused_add_rms_norm(normed, new_res, x, res, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    want = (x.float() + res.float()).to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(new_res.isnan(), nan) and nan.sum() == 2, (new_res, want)
    assert torch.equal(new_res[~nan].view(torch.int16), want[~nan].view(torch.int16)), (new_res, want)


@pytest.mark.parametrize("h,kvh,d,rot,dtype", [(8, 4, 64, 64, F32), (7, 1, 8, 8, F32), (4, 4, 64, 32, F32),
                                               (8, 2, 16, 16, F16), (2, 1, 128, 128, BF16)])
def test_cpu_rotary_operator_matches_reference(ops, h, kvh, d, rot, dtype):
    g = torch.Generator().manual_seed(9)
    T, max_pos = 70, 4096
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (T,), generator=g, dtype=torch.int32)
    q, k = randn(g, T, h, d, dtype=dtype), randn(g, T, kvh, d, dtype=dtype)
    q_in, k_in = q.clone(), k.clone()
    ops.rotary(q_in, k_in, positions, cos_sin)
    assert_within_rounding(q_in, exact_rotary(q, positions, cos_sin), roundings=half(dtype))
    assert_within_rounding(k_in, exact_rotary(k, positions, cos_sin), roundings=half(dtype))
    assert torch.equal(q_in[..., rot:], q[..., rot:])      # columns past the rotated width pass through


@pytest.mark.parametrize("shape,dtype", [((7, 96), F32), ((3, 2200), F16), ((300, 2816), BF16), ((2, 34), F32)])
def test_cpu_silu_and_mul_operator_matches_reference(ops, shape, dtype):
    g = torch.Generator().manual_seed(10)
    x = randn(g, *shape, dtype=dtype) * 6
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0]).to(dtype)   # exp's clamps: no inf or nan at the ends
    out = x.new_empty(shape[0], shape[1] // 2)
    ops.silu_and_mul(out, x)
    exact = exact_silu_and_mul(x)
    # exp's argument is clamped to [-87, 88] (vec_math.h), so silu(g) for g below -87 reads as g * e^-87 at most:
    # within that of the exact value, finite; every other output within the rule
    ends, up = out[0, [0, 3]].double(), x[0, shape[1] // 2:][[0, 3]].double()
    clamp = (x[0, [0, 3]].double() * up).abs() * math.exp(-87)
    assert ((ends - exact.value[0, [0, 3]]).abs() <= clamp).all() and ends.isfinite().all()
    out[0, [0, 3]] = exact.value[0, [0, 3]].to(dtype)
    assert_within_rounding(out, exact, roundings=half(dtype))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cpu_write_kv_operator_from_a_qkv_view(ops, dtype):
    """k and v as strided views into a merged qkv (as the model passes them); -1 slots are skipped."""
    g = torch.Generator().manual_seed(11)
    T, kvh, d, bs, blocks = 40, 2, 16, 16, 6
    qkv = randn(g, T, (4 + 2 * kvh) * d, dtype=dtype)
    k = qkv[:, 4 * d:(4 + kvh) * d].view(T, kvh, d)
    v = qkv[:, (4 + kvh) * d:].view(T, kvh, d)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(torch.int32)
    slots[::7] = -1
    caches = [randn(g, blocks, bs, kvh, d, dtype=dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    kv_cache.write_kv_reference(k, v, caches[0], caches[1], slots)
    ops.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_cpu_dispatch_uses_the_layer_operators(ops, monkeypatch, kernel_settings):
    """On a CPU with the operators built, each dispatch function takes its operator (and gives the reference's
    answer); with TRELLM_CPU_OPS=0 the same calls run the references."""
    kernel_settings(force_triton=False)
    real, called = ops, []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_ops, "_module", Spy())
    g = torch.Generator().manual_seed(12)
    x, res, w = randn(g, 5, 64), randn(g, 5, 64), randn(g, 64)
    assert_within_rounding(rmsnorm.rms_norm(x, w, 1e-5), exact_rms_norm(x, w, 1e-5))
    normed, new_res = rmsnorm.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(new_res, x + res)
    assert_within_rounding(normed, exact_rms_norm(x + res, w, 1e-5))
    gu = randn(g, 5, 128)
    assert_within_rounding(activation.silu_and_mul(gu), exact_silu_and_mul(gu))
    cos_sin = torch.randn(32, 16, generator=g)
    q, k, pos = randn(g, 5, 4, 16), randn(g, 5, 2, 16), torch.arange(5, dtype=torch.int32)
    got_q, got_k = rotary.apply_rotary(q.clone(), k.clone(), pos, cos_sin)
    assert_within_rounding(got_q, exact_rotary(q, pos, cos_sin))
    assert_within_rounding(got_k, exact_rotary(k, pos, cos_sin))
    cache = [torch.zeros(2, 16, 2, 16) for _ in range(2)]
    kv_cache.write_kv(k, k, cache[0], cache[1], torch.arange(5, dtype=torch.int32))
    assert torch.equal(cache[0].view(-1, 2, 16)[:5], k)
    assert called == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary", "write_kv"]


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch's cpp_extension waits forever on its lock file; one older than any build is a killed build's."""
    import os
    import time
    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_ops.remove_stale_lock(str(tmp_path))
    assert lock.exists(), "a build in progress keeps its lock"
    old = time.time() - cpu_ops.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_ops.remove_stale_lock(str(tmp_path))
    assert not lock.exists()




@pytest.mark.parametrize("cache_dtype", KV_QUANT)
@pytest.mark.parametrize("kvh,d,bs,dtype", [c for c in QUANTIZED_WRITE_CASES if c[3] in (F32, BF16)])
def test_cpu_quantized_write_kv_operator_matches_the_reference_bit_for_bit(ops, cache_dtype, kvh, d, bs, dtype):
    check_quantized_write(lambda k, v, kc, vc, slots, ks, vs: ops.write_kv_quantized(
        k, v, kc.view(torch.int8), vc.view(torch.int8), ks, vs, slots.to(torch.int32), cache_dtype == torch.int8),
        cache_dtype, kvh, d, bs, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 96, 80), (7, 96, 80), (33, 256, 1408), (33, 64, 8),
                                                 (113, 64, 200)])   # tiles of 48 and a chunk of 96; k in 64s + 8
def test_cpu_int8_linear_packs_for_the_driver_and_rows_do_not_depend_on_their_batch(ops, tokens, out_f, in_f, dtype):
    """INT8 weights on a CPU are packed in the C++ driver's blocks (bf16 models too: the operator widens their
    activations), and a token's result does not depend on what shares the call. (The values against the
    dequantizing reference: test_kernels.py.)"""
    g = torch.Generator().manual_seed(1)
    q = linear.prepare_weight(randn(g, out_f, in_f, dtype=dtype), "int8")
    assert q.qweight.dim() == 3, "CPU weights are packed for the C++ operator"
    assert q.qweight.shape[2] == linear.CPU_BLOCK == ops.linear_block, "the packing is the driver's"
    x = randn(g, tokens, in_f, dtype=dtype)
    together = linear.linear(x, q)
    for i in range(tokens):
        assert torch.equal(linear.linear(x[i:i + 1], q), together[i:i + 1])


@pytest.mark.parametrize("ops", isa_params("avx2"), indirect=True)
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 64, 80), (2, 96, 81), (3, 64, 8), (7, 96, 81), (48, 64, 700),
                                                 (113, 32, 513), (600, 64, 200)])
def test_cpu_int8_linear_with_avx2_alone_is_its_int16_reference_bit_for_bit(ops, tokens, out_f, in_f):
    """With AVX2 alone the INT8 operator rounds each token's activations to int16 and sums exactly in integers: the
    PyTorch reference of that arithmetic gives the same bits (odd K, several k chunks, tiles of 1-48 tokens, a
    chunk of 96, a row of zeros, at every token count), and its error against fp32 is within the activations'
    rounding: each value within half a step of its int16 grid point, and the sums of those within the rounding
    rule. (The AVX-512 and portable builds multiply in fp32: test_kernels.py compares them with the exact product.)"""
    assert ops.avx2 and linear.linear_path(linear.prepare_weight(torch.zeros(64, 8), "int8")).startswith(
        "INT8 C++ (AVX2")
    g = torch.Generator().manual_seed(5)
    q = linear.prepare_weight(randn(g, out_f, in_f, dtype=F32), "int8")
    x = randn(g, tokens, in_f, dtype=F32) * torch.rand(tokens, 1, generator=g) * 4
    x[tokens // 2] = 0
    got = linear.linear(x, q)
    assert torch.equal(got, linear.int8_linear_int16_reference(x, q))
    xq, x_scale = linear.int16_activations(x)
    grid = xq.double() * x_scale.double()
    # half a step, and the rounding of x * (32767 / max|x|) in float32 before it is rounded to an integer
    amax = x.abs().amax(dim=1, keepdim=True).double()
    assert ((grid - x.double()).abs() <= x_scale.double() / 2 + 2 * EPS32 * amax).all()
    assert_within_rounding(got, exact_linear(grid, q.int8_rows().double() * q.scales.double()[:, None]))


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_int8_activations_of_the_operator_are_torchs_bit_for_bit(ops, dtype):
    """W8A8's per-token rounding of activations to int8 in one C++ pass gives the bits of the PyTorch steps it
    replaces (linear.per_token_rounding), for rows of zeros, a huge and a tiny row, and odd widths; every value
    lies within half a step of its grid point."""
    g = torch.Generator().manual_seed(8)
    for tokens, k in ((1, 16), (7, 81), (40, 512)):
        x = (randn(g, tokens, k) * torch.rand(tokens, 1, generator=g) * 8).to(dtype)
        x[tokens // 2] = 0
        x[-1] *= 1e4 if dtype != F16 else 100
        xq, x_scale = linear.int8_activations(x)
        want, want_scale = linear.per_token_rounding(x, 127)
        assert xq.dtype == torch.int8 and torch.equal(xq.float(), want) and torch.equal(x_scale, want_scale)
        amax = x.float().abs().amax(dim=1, keepdim=True)
        assert ((xq.float() * x_scale - x.float()).abs() <= x_scale / 2 + 2 * EPS32 * amax).all()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "rows"])
def test_w8a8_is_exact_integer_sums_scaled_on_every_path(ops, monkeypatch, dtype, onednn):
    """quantization=w8a8: where the CPU has int8 dot products oneDNN's quantized GEMM runs on the weight prepacked at
    load (one copy, read back exactly); elsewhere a float GEMM of the rounded integers. Either gives the exact integer
    sums times the weight's and the token's scales (w8a8_reference, which sums in int64), the bias added before the
    one rounding to the dtype, at every token count; the load log names the path."""
    if onednn and not linear.onednn_runs_w8a8():
        pytest.skip(f"this CPU ({cpu_ops.cpu_model()}) has no int8 dot products ({', '.join(linear.INT8_DOT_FLAGS)}):"
                    " oneDNN's int8 GEMM could saturate, so W8A8 takes the float GEMM of the rounded integers")
    monkeypatch.setattr(linear, "onednn_runs_w8a8", lambda: onednn)
    g = torch.Generator().manual_seed(9)
    w, b = randn(g, 96, 200, dtype=dtype), randn(g, 96, dtype=dtype)
    q = linear.prepare_weight(w, "w8a8")
    assert q.w8a8 and ((q.prepared is not None) == onednn) and ((q.qweight is not None) != onednn)
    assert torch.equal(q.int8_rows(), linear.quantize_int8(w, packed=False).qweight)
    assert linear.linear_path(q).startswith("W8A8 oneDNN" if onednn else "W8A8 as torch linear")
    for tokens in (1, 3, 16, 65, 300):
        x = randn(g, tokens, 200, dtype=dtype)
        want = linear.w8a8_reference(x, q)
        # oneDNN's int32 sums are exact; the float GEMM's are too at these sizes (below 2^24)
        assert torch.equal(linear.linear(x, q), want.to(dtype))
        assert torch.equal(linear.linear(x, q, b), (want + b).to(dtype))


@pytest.mark.parametrize("mode", ["cpp", "onednn", "torch"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("out_f", [300, 320])
def test_linear_prepared_weight(ops, monkeypatch, mode, dtype, out_f, kernel_settings):
    """A weight prepared once (for fp32 on a CPU: the C++ operator's blocks on an AVX-512 build when the outputs
    fill them, else oneDNN's layout; for bf16 on an AVX2 build, where torch's half GEMM goes row by row, the half
    operator's blocks when the outputs fill them) serves every token count, with and without a bias, and agrees with
    torch's linear."""
    kernel_settings(cpu_linear=mode)
    g = torch.Generator().manual_seed(0)
    w, b = randn(g, out_f, 96, dtype=dtype), randn(g, out_f, dtype=dtype)
    prepared = linear.prepare_weight(w)
    amx = linear_choice.amx_holds(dtype, (out_f, 96))
    packed = mode == "cpp" and out_f % linear.CPU_BLOCK == 0 and (
        ops.avx512 if dtype == F32 else ops.avx2 and linear.half_gemm_is_row_by_row(dtype) or amx)
    assert (prepared.packed is not None) == packed
    assert (prepared.prepared is not None) == (mode != "torch" and dtype == F32 and not packed)
    held = [t for t in (prepared.dense, prepared.prepared, prepared.packed) if t is not None]
    assert len(held) == 1, "one copy of the weight"
    assert torch.equal(prepared.tensor(), w)
    for tokens in (1, 7, 13, 26, 64, 513):
        x = randn(g, tokens, 96, dtype=dtype)
        assert_within_rounding(linear.linear(x, prepared, b), exact_linear(x, w, b), roundings=half(dtype))
        assert_within_rounding(linear.linear(x, prepared), exact_linear(x, w), roundings=half(dtype))
    if packed:   # a token's result does not depend on what shares the call (each sum runs over k in order)
        x = randn(g, 40, 96, dtype=dtype)
        together = linear.linear(x, prepared, b)
        # AMX tiles from AMX_FROM_TOKENS sum in their own order: there the shares are calls that take the tiles too
        for i, n in ((0, 1), (11, 1), (12, 1), (39, 1)) if not amx else ((0, 16), (20, 20), (3, 33)):
            assert torch.equal(linear.linear(x[i:i + n], prepared, b), together[i:i + n])


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("out_f", [64, 40])     # whole 32-output blocks of the C++ operators, and not
def test_the_logged_linear_path_is_the_one_linear_runs(ops, monkeypatch, quantization, dtype, out_f, kernel_settings):
    """The load log's line per linear layer (linear_path) names the implementation `linear` calls for a decode
    step's token, on whatever this host supports: each candidate is spied on and exactly the named one runs; where
    the line names a token count from which the call changes path, that many tokens run torch's linear in fp32.
    (The written-down rule, TRELLM_CPU_LINEAR=cpp; the timed choice's line has its own test.)"""
    kernel_settings(cpu_linear="cpp")
    real, called = ops, []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(real, name)

    def spy(owner, name, label):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: called.append(label(a)) or original(*a, **k))
    monkeypatch.setattr(cpu_ops, "_module", Spy())
    spy(torch.ops.mkldnn, "_linear_pointwise", lambda a: "oneDNN")
    spy(torch, "_weight_int4pack_mm_for_cpu", lambda a: "_weight_int4pack_mm")
    spy(torch.nn.functional, "linear", lambda a: f"torch linear on {a[0].dtype}")
    ops = ("fp32_linear", "half_linear", "bf16_linear", "bf16_amx_linear", "int8_linear", "group_linear", "oneDNN",
           "_weight_int4pack_mm", "torch linear on")
    g = torch.Generator().manual_seed(3)
    w = linear.prepare_weight(randn(g, out_f, 256, dtype=dtype), quantization)
    path = linear.linear_path(w)

    def runs(tokens):
        called.clear()
        linear.linear(randn(g, tokens, 256, dtype=dtype), w)
        return [c for c in called if c.startswith(ops)]
    torch_linear = f"torch linear on {dtype}"
    named = {"fp32 C++": "fp32_linear", "(AVX512-BF16": "bf16_linear", "float16 C++": "half_linear",
             "INT8 C++": "int8_linear", "group operator": "group_linear", "oneDNN": "oneDNN",
             "_weight_int4pack_mm": "_weight_int4pack_mm",
             "dequantized": torch_linear, "torch linear": torch_linear}
    head = path.split(",")[0]
    assert runs(1) == [op for words, op in named.items() if words in head][:1], (path, called)
    switch = re.search(r"from (\d+) tokens", path)
    if switch:
        assert runs(int(switch.group(1))) == ["bf16_amx_linear" if "AMX from" in path else f"torch linear on {F32}"], \
            (path, called)


def fake_timer(table):
    """A timer that answers from table[call][i] (microseconds at linear_choice.COUNTS[i]) without running anything,
    and records what it was asked."""
    asked = []

    def timer(call, tokens, fn, quick):
        asked.append((call, tokens, quick))
        return table[call][linear_choice.COUNTS.index(tokens)] * 1e-6
    return timer, asked


@pytest.fixture
def untimed_layouts(monkeypatch):
    """The choice's three layouts on any host, with nothing held or run (a fake timer answers instead), and their
    calls as on a host without AMX (a test that wants cpp-amx offers it)."""
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "layouts_for", lambda dtype, n: ["cpp", "onednn", "torch"])
    monkeypatch.setattr(linear_choice, "amx_holds", lambda dtype, shape: False)
    monkeypatch.setattr(linear, "hold", lambda w, layout, typical_tokens=64: linear.Weight(w))
    monkeypatch.setattr(linear_choice, "LoadWatch", QuietHost)


class QuietHost:
    """linear_choice.LoadWatch on a host where nothing else runs (fake timers take no time to watch)."""
    foreign_cores = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_the_linear_choice_follows_the_timings_and_is_cached_by_host_and_shape(ops, tmp_path, monkeypatch,
                                                                              untimed_layouts):
    """A fake timing table proves the choice: the layout least slow against the best call at each count (today's
    layout kept within the tie margin), then that layout's fastest call per count range; a call far behind at one
    count is timed once (quick) at the next, never skipped, as it may still win at more tokens. The choice is written to the cache and read back without timing, under a key naming the
    CPU, torch and the shape; a cache entry naming a call this host lacks, or a corrupt file, is timed again."""
    cache = str(tmp_path / "linear-choice.json")
    w = torch.zeros(64, 32, dtype=BF16)
    table = {"cpp": [10, 20, 40, 100, 400], "cpp-unpacked": [50, 60, 70, 92, 200],
             "onednn": [12, 22, 42, 95, 300], "torch": [100, 1000, 9000, 90000, 1e6], "torch-fp32": [90, 95, 99, 120, 210]}
    timer, asked = fake_timer(table)
    choice = linear_choice.choose(w, "torch", timer=timer, path=cache)
    # scores: cpp 1 + 1 + 1 + 1 + 1 = 5.0 (its unpacked call wins from 129); onednn 1.2 + 1.1 + 1.05 + 1.06 + 1.5;
    # torch, today's layout here, 9 + 4.75 + 2.5 + 1.33 + 1.05: too slow to keep
    assert choice.layout == "cpp" and choice.calls == ("cpp", "cpp", "cpp", "cpp-unpacked", "cpp-unpacked")
    assert ("torch", 4, True) in asked and ("cpp-unpacked", 4, True) in asked and ("cpp", 4, False) in asked
    assert ("cpp-unpacked", 256, False) in asked       # back within reach at 64 tokens
    assert linear_choice.describe(choice.layout, choice.calls) == "cpp layout: cpp to 32 tokens, cpp-unpacked from 33"
    near = {**table, "onednn": [10.2, 20.2, 40.5, 92, 205]}     # within the tie margin of cpp's 5.0
    assert linear_choice.decide(near, ["cpp", "onednn", "torch"], BF16, "onednn").layout == "onednn"
    assert linear_choice.decide(near, ["cpp", "onednn", "torch"], BF16, "cpp").layout == "cpp"
    # today's call at a count is kept within the margin (cpp at 64 tokens: 100 against 92), not beyond (400 at 256)
    today = ("cpp",) * 5
    assert linear_choice.decide(table, ["cpp", "onednn", "torch"], BF16, "cpp", today).calls == \
        ("cpp", "cpp", "cpp", "cpp", "cpp-unpacked")

    stored = json.load(open(cache))
    key = linear_choice.cache_key(BF16, (64, 32), ["cpp", "onednn", "torch"])
    assert list(stored) == [key] and cpu_ops.cpu_model() in key and torch.__version__ in key and "64x32" in key
    monkeypatch.setattr(linear_choice, "_memo", {})
    untimed, asked = fake_timer({})
    assert linear_choice.choose(w, "torch", timer=untimed, path=cache).calls == choice.calls and asked == []
    # another host's or shape's entry is not this one's
    assert linear_choice.choose(torch.zeros(96, 32, dtype=BF16), "torch", timer=timer, path=cache).layout == "cpp"
    # an entry this host cannot run, and a corrupt file, are timed again
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "layouts_for", lambda dtype, n: ["onednn", "torch"])
    timer, asked = fake_timer(table)
    assert linear_choice.choose(w, "torch", timer=timer, path=cache).layout == "onednn" and asked
    open(cache, "w").write("{not json")
    monkeypatch.setattr(linear_choice, "_memo", {})
    timer, asked = fake_timer(table)
    assert linear_choice.choose(w, "torch", timer=timer, path=cache).layout == "onednn" and asked


def test_amx_tiles_let_one_layout_win_at_every_count(ops, tmp_path, untimed_layouts, monkeypatch):
    """Where AMX tiles take the k-pair weight, its layout is timed with three calls: the pair products win at few
    tokens and the tiles at many, so the k-pair layout is held for every count, where without the tiles oneDNN's
    would be (its many-token calls) and the one-token calls would run slower."""
    w = torch.zeros(64, 32, dtype=BF16)
    table = {"cpp": [10, 20, 60, 240, 960], "cpp-amx": [15, 22, 30, 60, 200], "cpp-unpacked": [50, 60, 70, 92, 260],
             "onednn": [16, 24, 31, 62, 205], "torch": [100, 1000, 9000, 90000, 1e6],
             "torch-fp32": [90, 95, 99, 120, 210]}
    timer, _ = fake_timer(table)
    without = linear_choice.choose(w, "torch", timer=timer, path=str(tmp_path / "a.json"))
    assert without.layout == "onednn"
    monkeypatch.setattr(linear_choice, "amx_holds", lambda dtype, shape: dtype == BF16 and shape[1] % 32 == 0)
    monkeypatch.setattr(linear_choice, "_memo", {})
    choice = linear_choice.choose(w, "torch", timer=timer, path=str(tmp_path / "b.json"))
    assert (choice.layout, choice.calls) == ("cpp", ("cpp", "cpp", "cpp-amx", "cpp-amx", "cpp-amx"))
    assert linear_choice.describe(choice.layout, choice.calls) == "cpp layout: cpp to 8 tokens, cpp-amx from 9"


def test_a_burst_of_other_work_while_timing_does_not_move_the_choice(ops, tmp_path, monkeypatch, untimed_layouts):
    """Other work on the host (another model loading) slows every run for a while: here the first five timings
    asked take 10x. The calls are timed in interleaved rounds and each keeps its fastest, so the choice is the quiet
    table's; timed one call after another, the burst would fall on cpp's first counts and hand the weight to oneDNN."""
    w = torch.zeros(64, 32, dtype=BF16)
    table = {"cpp": [10, 20, 40, 90, 300], "cpp-unpacked": [50, 60, 70, 92, 200],
             "onednn": [12, 22, 42, 95, 300], "torch": [100, 1000, 9000, 90000, 1e6], "torch-fp32": [90, 95, 99, 120, 210]}
    quiet_timer, _ = fake_timer(table)
    quiet = linear_choice.choose(w, "torch", timer=quiet_timer, path=str(tmp_path / "quiet.json"))
    monkeypatch.setattr(linear_choice, "_memo", {})
    timer, asked = fake_timer(table)

    def busy(call, tokens, fn, quick):
        return timer(call, tokens, fn, quick) * (10 if len(asked) < 5 else 1)
    noisy = linear_choice.choose(w, "torch", timer=busy, path=str(tmp_path / "noisy.json"))
    assert quiet.layout == "cpp" and (noisy.layout, noisy.calls) == (quiet.layout, quiet.calls)
    assert noisy.us == quiet.us


def test_timings_out_of_order_are_not_cached_and_a_cached_entry_out_of_order_is_timed_again(ops, tmp_path,
                                                                                              monkeypatch,
                                                                                              untimed_layouts):
    """More tokens never cost less: a table where a call took longer at 1 token than at 4 (what a test run under
    load wrote into a user's cache: torch 309 us at 1 token, 11.6 at 4) is timed again; still out of order once the
    process's wait for quiet is spent, the weight takes the written-down rule and nothing is written. A cached entry
    out of order is not read."""
    cache = str(tmp_path / "linear-choice.json")
    w = torch.zeros(64, 32, dtype=BF16)
    table = {"cpp": [10, 20, 40, 100, 400], "cpp-unpacked": [50, 60, 70, 92, 200], "onednn": [12, 22, 42, 95, 300],
             "torch": [309, 11.6, 320, 315, 1e4], "torch-fp32": [90, 95, 99, 120, 210]}
    assert linear_choice.out_of_order(table) == ["torch 309 us at 1 tokens, 11.6 us at more"]
    monkeypatch.setattr(linear_choice, "_quiet_wait_left", [0.0])
    timer, asked = fake_timer(table)
    choice = linear_choice.choose(w, "onednn", ("onednn",) * 5, timer=timer, path=cache)
    assert (choice.layout, choice.calls) == ("onednn", ("onednn",) * 5) and asked
    assert not os.path.exists(cache)
    # with time left to wait, a second timing in order is taken and cached
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "_quiet_wait_left", [5.0])
    monkeypatch.setattr(linear_choice.time, "sleep", lambda s: None)
    calm = {**table, "torch": [100, 1000, 9000, 90000, 1e6]}
    tables = [table, calm]           # what each timing of the shape measures: disordered, then in order
    real_measure = linear_choice.measure
    monkeypatch.setattr(linear_choice, "measure", lambda w, layouts, timer: (tables.pop(0), w.shape[0]))
    choice = linear_choice.choose(w, "onednn", ("onednn",) * 5, timer=timer, path=cache)
    assert choice.layout == "cpp" and tables == []
    assert list(json.load(open(cache)).values())[0]["us"]["torch"][0] == 100
    monkeypatch.setattr(linear_choice, "measure", real_measure)
    # an entry out of order in the file is timed again
    stored = json.load(open(cache))
    key = next(iter(stored))
    stored[key]["us"]["cpp"] = [500, 20, 40, 100, 400]
    json.dump(stored, open(cache, "w"))
    monkeypatch.setattr(linear_choice, "_memo", {})
    timer, asked = fake_timer(calm)
    linear_choice.choose(w, "onednn", ("onednn",) * 5, timer=timer, path=cache)
    assert asked and json.load(open(cache))[key]["us"]["cpp"][0] == 10


def test_a_choice_timed_beside_a_busy_loop_is_not_cached(tmp_path, monkeypatch):
    """Real timings, watched: beside a process spinning on a core the weight takes the written-down rule and the
    cache stays empty; once it has stopped, the shape is timed again and cached."""
    cache = str(tmp_path / "linear-choice.json")
    w = torch.randn(128, 64)
    static = linear.static_layout(w, "auto")
    calls = linear.static_calls(static, w.dtype, tuple(w.shape))
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "_quiet_wait_left", [0.5])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        choice = linear_choice.choose(w, static, calls, path=cache)
    finally:
        spinner.kill()
        spinner.wait()
    assert (choice.layout, choice.calls) == (static, calls) and not os.path.exists(cache)
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "_quiet_wait_left", [10.0])
    linear_choice.choose(w, static, calls, path=cache)
    assert len(json.load(open(cache))) == 1


def test_the_suite_times_into_its_own_cache_folder():
    """The suite's timings, taken beside its servers and tests, never reach the user's cache."""
    user = os.path.join(os.path.expanduser("~"), ".cache", "trellm")
    assert not os.path.abspath(linear_choice.cache_file()).startswith(user + os.sep)


def test_the_choice_times_each_call_on_weights_read_from_memory(ops, monkeypatch):
    """A decode step reads every weight from memory, so the timing does too: each run of a call takes the next of
    several copies of its layout, together twice the last-level cache (bounded), so no run finds its weight where the
    previous run left it; each copy holds the weight. Without a cache size known, one copy."""
    w = torch.randn(64, 48)
    part_bytes = w.numel() * w.element_size()
    monkeypatch.setattr(linear_choice, "last_level_cache_bytes", lambda: 3 * part_bytes)
    assert linear_choice.copies_to_stream(part_bytes) == 6
    seen: dict[str, list] = {}
    real = dict(linear.CALLS)
    for name, fn in real.items():
        monkeypatch.setitem(linear.CALLS, name, lambda x, weight, b, name=name, fn=fn:
                            seen.setdefault(name, []).append(weight) or fn(x, weight, b))

    def timer(call, tokens, fn, quick):
        for _ in range(1 if quick else 4):
            fn()
        return 1e-6
    layouts = linear_choice.layouts_for(w.dtype, tuple(w.shape))
    linear_choice.measure(w, layouts, timer)
    for name, weights in seen.items():
        ids = [id(x) for x in weights]
        assert len(set(ids)) == 6, name
        assert all(len(set(ids[i:i + 6])) == len(ids[i:i + 6]) for i in range(len(ids))), name   # a full cycle
        assert all(torch.equal(x.tensor(), w) for x in weights[:6]), name
    monkeypatch.setattr(linear_choice, "last_level_cache_bytes", lambda: 0)
    assert linear_choice.copies_to_stream(part_bytes) == 1
    monkeypatch.setattr(linear_choice, "last_level_cache_bytes", lambda: 1 << 40)
    assert linear_choice.copies_to_stream(16 << 20) == linear_choice.STREAM_MAX_BYTES // (16 << 20)
    assert linear_choice.copies_to_stream(1024) == linear_choice.MAX_COPIES


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("in_f", [72, 96])   # 96: a multiple of 32, which AMX tiles take where the host has them
def test_every_call_the_choice_can_pick_gives_the_linear(ops, dtype, in_f):
    """Each layout this host can hold, through each of its calls, at the token counts of every range: torch's
    linear within the rounding of the dtype, with and without a bias (the real run behind the fake table)."""
    g = torch.Generator().manual_seed(5)
    w, b = randn(g, 64, in_f, dtype=dtype), randn(g, 64, dtype=dtype)
    for layout in linear_choice.layouts_for(dtype, (64, in_f)):
        held = linear.hold(w, layout)
        assert len([t for t in (held.dense, held.prepared, held.packed) if t is not None]) == 1
        for call in linear_choice.calls_of(layout, dtype, (64, in_f)):
            for tokens in (1, 5, 20, 100, 300):
                x = randn(g, tokens, in_f, dtype=dtype)
                for bias in (b, None):
                    got = linear.CALLS[call](x, held, bias)
                    assert got.dtype == dtype, (layout, call)
                    assert_within_rounding(got, exact_linear(x, w, bias), roundings=half(dtype))


def test_auto_holds_the_timed_layout_and_runs_its_calls(ops, tmp_path, monkeypatch, kernel_settings):
    """TRELLM_CPU_LINEAR=auto (the default): prepare_weight holds only the chosen layout, `linear` runs the chosen
    call for each token count, and the load log's line says so; a forced mode still takes the written-down rule."""
    monkeypatch.setenv("TRELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_choice, "_memo", {})
    kernel_settings(cpu_linear="auto")
    g = torch.Generator().manual_seed(6)
    w = randn(g, 64, 40, dtype=BF16)
    table = {c: [100.0] * 5 for c in ("cpp", "cpp-unpacked", "onednn", "torch", "torch-fp32")}
    table["torch"] = [1, 100, 200, 400, 800]
    table["torch-fp32"] = [2, 2, 3, 4, 5]
    timer, _ = fake_timer(table)
    monkeypatch.setattr(linear_choice, "time_call", timer)
    monkeypatch.setattr(linear_choice, "LoadWatch", QuietHost)
    prepared = linear.prepare_weight(w)
    assert prepared.dense is not None and prepared.packed is None and prepared.prepared is None
    assert prepared.calls == ("torch", "torch-fp32", "torch-fp32", "torch-fp32", "torch-fp32")
    assert linear.linear_path(prepared) == "bfloat16 timed, torch layout: torch to 2 tokens, torch-fp32 from 3"
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: seen.append(x.dtype) or real(x, *a))
    for tokens, want in ((2, BF16), (3, F32)):
        seen.clear()
        x = randn(g, tokens, 40, dtype=BF16)
        assert_within_rounding(linear.linear(x, prepared), exact_linear(x, w), roundings=2)
        assert seen == [want]
    kernel_settings(cpu_linear="torch")
    assert linear.prepare_weight(w).calls is None


@pytest.mark.parametrize("ops", isa_params("avx2"), indirect=True)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 64, 80), (3, 96, 81), (7, 96, 81), (48, 64, 130), (113, 32, 200),
                                                 (300, 64, 40)])    # the last unpacked for torch's GEMM
def test_cpu_half_linear_with_avx2_alone_multiplies_in_fp32_and_rows_do_not_depend_on_their_batch(ops, dtype, tokens,
                                                                                                  out_f, in_f,
                                                                                                  kernel_settings,
                                                                                                  monkeypatch):
    """With AVX2 alone (no bf16/fp16 dot products, torch's half GEMM row by row) a bf16/fp16 weight whose outputs
    fill the 32-output blocks is packed for the half operator, which multiplies in fp32 and rounds once: the answer
    is torch's fp32 linear on the widened weight, rounded to the dtype (within one step of it, as the sums' order
    differs), for tiles of 1 to 48 tokens, odd K and a bias, and a token's result does not depend on its batch
    (below the token count from which calls take torch's GEMM on the unpacked weight instead). On a host whose torch
    has bf16/fp16 dot products (AVX512-BF16, AMX) the AVX2 build is still tested, under the rule's condition."""
    assert ops.avx2, "the half operator is the AVX2 build's (AVX-512 builds keep torch's bf16/fp16 GEMM)"
    monkeypatch.setattr(linear, "half_gemm_is_row_by_row", lambda dtype: True)
    kernel_settings(cpu_linear="cpp")
    g = torch.Generator().manual_seed(7)
    w, b = randn(g, out_f, in_f, dtype=dtype), randn(g, out_f, dtype=dtype)
    prepared = linear.prepare_weight(w)
    assert prepared.packed is not None and prepared.packed.dtype == dtype and prepared.dense is None
    assert linear.linear_path(prepared).startswith(f"{linear.dtype_name(dtype)} C++ (AVX2)")
    x = randn(g, tokens, in_f, dtype=dtype)
    together = linear.linear(x, prepared, b)
    assert together.dtype == dtype
    assert_within_rounding(together, exact_linear(x, w, b))     # rounded once, to the dtype
    for i in range(tokens if tokens < linear.HALF_UNPACKED_FROM_TOKENS else 0):   # one operator for all of them
        assert torch.equal(linear.linear(x[i:i + 1], prepared, b), together[i:i + 1])


def assert_bf16_call_rounds_once_per_token(call, held, w, b, x):
    """call(x, held, bias) in bf16: the exact linear rounded once, with and without a bias, and a token's row the
    same whatever shares its call."""
    for bias in (b, None):
        together = call(x, held, bias)
        assert together.dtype == BF16
        assert_within_rounding(together, exact_linear(x, w, bias))
    tokens = x.shape[0]
    for i in sorted({0, tokens // 2, tokens - 1}):
        assert torch.equal(call(x[i:i + 1], held, b), call(x, held, b)[i:i + 1])


BF16_DOT = "avx512_bf16" in cpu_ops._cpu_flags().split()


@pytest.mark.skipif(not BF16_DOT, reason=f"this CPU ({cpu_ops.cpu_model()}) has no bf16 dot products (avx512_bf16)")
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 64, 80), (5, 96, 2), (12, 32, 130), (26, 64, 82), (97, 32, 200),
                                                 (300, 64, 40)])
def test_cpu_bf16_linear_on_bf16_dot_products(tokens, out_f, in_f, monkeypatch):
    """Where the CPU has AVX512-BF16, the timed choice can hold a bf16 weight in k-pairs for the bf16 operator. Its
    answer is the products of the bf16 values summed in fp32 and rounded once (within one bf16 step of the exact
    linear), with and without a bias, for tiles of 1 to 12 tokens and calls longer than the driver's chunk of 96;
    a token's result does not depend on what shares its call; the held weight is the weight, and the load log names
    the operator."""
    ops = cpu_ops.load_isa("avx512")
    monkeypatch.setattr(cpu_ops, "_module", ops)
    assert ops.avx512_bf16, "an AVX-512 build on a CPU with avx512_bf16 has the bf16 operator"
    assert linear_choice.cpp_holds(BF16, (out_f, in_f)) and not linear_choice.cpp_holds(BF16, (out_f, in_f + 1))
    g = torch.Generator().manual_seed(8)
    w, b = randn(g, out_f, in_f, dtype=BF16), randn(g, out_f, dtype=BF16)
    held = linear.hold(w, "cpp")
    assert held.packed.shape == (out_f // linear.CPU_BLOCK, in_f // 2, linear.CPU_BLOCK, 2) and held.dense is None
    assert torch.equal(held.tensor(), w)
    assert linear.linear_path(held) == "bfloat16 C++ (AVX512-BF16)"
    assert_bf16_call_rounds_once_per_token(linear.CALLS["cpp"], held, w, b, randn(g, tokens, in_f, dtype=BF16))


AMX_BF16 = "amx_bf16" in cpu_ops._cpu_flags().split()


@pytest.mark.skipif(not AMX_BF16, reason=f"this CPU ({cpu_ops.cpu_model()}) has no AMX-BF16 tiles (amx_bf16)")
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 32, 32), (15, 64, 64), (16, 96, 96), (17, 32, 1408),
                                                 (32, 64, 32), (45, 64, 160), (100, 32, 512), (300, 96, 64)])
def test_cpu_bf16_linear_on_amx_tiles(tokens, out_f, in_f, monkeypatch):
    """Where the CPU has AMX-BF16, the k-pair weight also runs on AMX tiles ("cpp-amx"), read in place: the products
    of the bf16 values summed in fp32 and rounded once, with and without a bias, for one row group of 16 tokens or
    two, a short last chunk, and several chunks; a token's result does not depend on what shares its call. A weight
    whose `in` is not a multiple of 32 is not offered the call, and the written-down rule takes it from
    AMX_FROM_TOKENS."""
    ops = cpu_ops.load_isa("avx512")
    monkeypatch.setattr(cpu_ops, "_module", ops)
    if not ops.bf16_amx_ready():   # Linux before 5.16 has no arch_prctl for it: the choice then never offers cpp-amx
        pytest.skip("this kernel refused the process AMX's tile state (ARCH_REQ_XCOMP_PERM)")
    assert "cpp-amx" in linear_choice.calls_of("cpp", BF16, (out_f, in_f))
    assert "cpp-amx" not in linear_choice.calls_of("cpp", BF16, (out_f, in_f + 2))
    assert "cpp-amx" not in linear_choice.calls_of("cpp", F32, (out_f, in_f))
    assert linear.static_calls("cpp", BF16, (out_f, in_f)) == tuple(
        "cpp-amx" if n >= linear.AMX_FROM_TOKENS else "cpp" for n in linear_choice.COUNTS)
    g = torch.Generator().manual_seed(9)
    w, b = randn(g, out_f, in_f, dtype=BF16), randn(g, out_f, dtype=BF16)
    held = linear.hold(w, "cpp")
    assert_bf16_call_rounds_once_per_token(linear.CALLS["cpp-amx"], held, w, b, randn(g, tokens, in_f, dtype=BF16))


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("row_by_row, widen_rows", [(True, 48), (True, 10), (False, 48)])
def test_half_linear_runs_in_fp32_from_four_tokens_where_torchs_half_gemm_is_slow(monkeypatch, dtype, row_by_row,
                                                                                  widen_rows, kernel_settings):
    """On a CPU where torch's bf16/fp16 GEMM goes row by row (AVX2), a call of 4+ tokens widens to fp32 (what
    linear_path logs), a slice of `widen_rows` output rows at a time; elsewhere every call stays in the half type.
    Either way the answer is torch's. (The written-down rule; the timed choice times both calls.)"""
    kernel_settings(cpu_linear="cpp")
    monkeypatch.setattr(linear, "half_gemm_is_row_by_row", lambda _: row_by_row)
    monkeypatch.setattr(linear, "WIDEN_ELEMENTS", widen_rows * 96)
    seen = []
    original = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *a: seen.append((x.dtype, w.shape[0])) or
                        original(x, w, *a))
    g = torch.Generator().manual_seed(5)
    w, b = randn(g, 48, 96, dtype=dtype), randn(g, 48, dtype=dtype)
    prepared = linear.prepare_weight(w)
    assert ("in float32 from 4 tokens" in linear.linear_path(prepared)) == row_by_row
    for tokens in (1, 3, 4, 48):
        x = randn(g, tokens, 96, dtype=dtype)
        seen.clear()
        got = linear.linear(x, prepared, b)
        if row_by_row and tokens >= linear.HALF_AS_FP32_FROM_TOKENS:
            assert seen == [(F32, min(widen_rows, 48 - r)) for r in range(0, 48, widen_rows)]
        else:
            assert seen == [(dtype, 48)]
        assert got.dtype == dtype
        assert_within_rounding(got, exact_linear(x, w, b), roundings=2)


def test_kernel_settings_are_checked_where_they_are_read():
    with pytest.raises(ValueError, match="TRELLM_CPU_LINEAR='mkl'"):
        dispatch.KernelSettings.from_env({"TRELLM_CPU_LINEAR": "mkl"})
    with pytest.raises(ValueError, match="TRELLM_ATTN_SPLITS='0'"):
        dispatch.KernelSettings.from_env({"TRELLM_ATTN_SPLITS": "0"})
    s = dispatch.KernelSettings.from_env({"TRELLM_FORCE_TRITON": "1", "TRELLM_CPU_OPS": "0", "TRELLM_ATTN_SPLITS": "3"})
    assert s.force_triton and not s.cpu_ops and s.attn_splits == 3 and s.cpu_linear == "auto"


@pytest.mark.parametrize("tokens", [1, 3, 6, 16, 41])
@pytest.mark.parametrize("k, ranks, widths", [(512, [16, 16, 16], [512, 256, 256]), (37, [4, 4], [33, 70]),
                                              (1408, [8], [512])])
def test_cpu_lora_add_operator_matches_reference(ops, tokens, k, ranks, widths):
    """One adapter's term at a fused site, B block-diagonal over the site's modules (models/lora.py's layout): the
    operator on row views (an adapter's rows are a slice of the step's batch) against the two matmuls."""
    g = torch.Generator().manual_seed(tokens + k)
    R, N = sum(ranks), sum(widths)
    at = randn(g, k, R, dtype=F32)
    bt = torch.zeros(R, N)
    spans, r0, c0 = [], 0, 0
    for r, w in zip(ranks, widths):
        bt[r0:r0 + r, c0:c0 + w] = randn(g, r, w, dtype=F32)
        spans += [(c0, w)] * r
        r0, c0 = r0 + r, c0 + w
    spans = torch.tensor(spans, dtype=torch.int64)
    x = randn(g, tokens + 2, k, dtype=F32)[1:-1]          # a slice of a larger batch
    out = randn(g, tokens + 2, N, dtype=F32)
    exact = exact_lora_add(out[1:-1], x, at, bt, 0.75)
    got = out.clone()
    ops.lora_add(got[1:-1], x, at, bt, spans, 0.75)
    assert_within_rounding(got[1:-1], exact)
    assert torch.equal(got[0], out[0]) and torch.equal(got[-1], out[-1]), "rows outside the view are left alone"
    via_dispatch = out.clone()
    lora.lora_add(via_dispatch[1:-1], x, at, bt, spans, 0.75)
    assert_within_rounding(via_dispatch[1:-1], exact)
    with pytest.raises(RuntimeError, match="leaves the"):
        ops.lora_add(got, randn(g, tokens + 2, k, dtype=F32), at, bt, spans + N, 0.75)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group,mins", [(32, False), (32, True), (16, False), (64, True), (128, True)])
@pytest.mark.parametrize("tokens, out_f, in_f", [(1, 64, 256), (5, 96, 512), (6, 32, 128), (13, 64, 1024),
                                                 (100, 32, 256)])   # tiles of 6 (4 portable) and a chunk of 96
def test_cpu_group_linear_matches_a_float64_reference(ops, bits, group, mins, tokens, out_f, in_f):
    """GGUF's blocks (groups of 16 and 32) and INT4's (64 and 128, with minimums) as group-quantized weights
    (kernels/group_quant.py: int8, or 4-bit two to a byte) through each build's operator: within fp32 summation error
    of the float64 product, and a token's result independent of the call's other tokens."""
    from trellm_kernels.group_quant import GroupWeight, pack
    g = torch.Generator().manual_seed(2)
    q = (torch.randint(-32, 32, (out_f, in_f), generator=g, dtype=torch.int8) if bits == 8 else
         torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8))
    scales = torch.rand(in_f // group, out_f, generator=g) * 0.05
    m = torch.rand(in_f // group, out_f, generator=g) * 0.3 if mins else None
    w = pack(GroupWeight(q, scales, m, group))
    assert w.packed, "CPU weights whose outputs fill the blocks are packed for the operator"
    assert w.q.numel() == q.numel() * bits // 8 and torch.equal(w.rows()[0], q), "held at its own size, exactly"
    x = randn(g, tokens, in_f, dtype=F32)
    y = linear.group_linear(x, w)
    exact = x.double() @ GroupWeight(q, scales, m, group).tensor(torch.float64).t()
    magnitude = GroupWeight(q.abs(), scales, None if m is None else -m, group).tensor(torch.float64)
    bound = in_f * 2 ** -23 * (x.double().abs() @ magnitude.t()) * 4   # |q| s + m: the min term sums apart
    assert (y.double() - exact).abs().le(bound).all()
    for i in (0, tokens - 1):
        assert torch.equal(linear.group_linear(x[i:i + 1], w), y[i:i + 1])
