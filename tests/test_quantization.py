"""Weight-only INT8 and INT4 (`quantization: int8 / int4`), W8A8 (`w8a8`), GPTQ/AWQ checkpoints and the INT8/FP8 KV
cache (`kv_cache_dtype`): what quantization costs in quality on the default model, measured against the float model;
that the GPTQ and AWQ files the packer writes hold the bits where those formats put them and read back exactly; and that
quantized models serve through tritonserver. The kernels themselves are checked against their reference in
test_kernels.py."""
from __future__ import annotations

import argparse
import collections
import email
import json
import math
import os
import re

import pytest
import torch

from rounding import EPS32
from test_engine import run
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams
from trellm_backend.models.quant_formats import AWQ_ORDER, QuantFormat, awq_pack, awq_unpack, gptq_pack, gptq_unpack
from trellm_backend.tools.quantize_checkpoint import act_order, quantize_folder, quantize_linear
from trellm_kernels.int4 import quantize_int4
from trellm_kernels.linear import quantize_int8

PROMPTS = ["The Python language", "A function definition", "Exceptions are raised when", "The import statement",
           "Lists", "class", "for loops iterate over the items of any sequence", "with statement"]


def engine_texts(model_path: str, quantization: str, max_tokens: int, kv_cache_dtype: str = "auto",
                 **engine) -> dict[str, list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = LLMEngine(EngineConfig(model_path=model_path, kv_cache_bytes=64 << 20, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype, **engine))
    outputs = run(engine, [tok(p).input_ids for p in PROMPTS],
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {p: out["tokens"] for p, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def float_tokens(default_model_path):
    return engine_texts(default_model_path, "none", 32)


def agreement(base: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, int]:
    """Per prompt, how many greedy tokens agree before the first difference."""
    return {p: next((i for i, (a, b) in enumerate(zip(base[p], other[p])) if a != b), len(base[p])) for p in PROMPTS}


def test_int8_greedy_tokens_agree_with_the_float_model(default_model_path, float_tokens):
    """Measured 2026-11-25: all 8 prompts identical over 32 tokens. Bound: at least 7 of 8, and no prompt
    diverging before its 16th token."""
    agree = agreement(float_tokens, engine_texts(default_model_path, "int8", 32))
    assert sum(n == 32 for n in agree.values()) >= 7 and min(agree.values()) >= 16, agree


def test_w8a8_greedy_tokens_agree_with_the_float_model(default_model_path, float_tokens):
    """W8A8 rounds every call's activations to int8 per token as well as the weights. Measured 2026-12-05 (Intel
    Xeon with AMX, oneDNN's int8 GEMM): 6 of 8 prompts identical over 32 tokens, the others diverging at tokens
    13 and 17 (weight-only INT8: 8 of 8; the activations' rounding is what moves them, which is why W8A8 is a mode
    of its own and not a candidate of INT8's timed choice). Bound: at least 5 of 8 identical, 24 tokens on
    average."""
    agree = agreement(float_tokens, engine_texts(default_model_path, "w8a8", 32))
    assert sum(n == 32 for n in agree.values()) >= 5 and sum(agree.values()) / len(agree) >= 24, agree


def test_int4_greedy_tokens_agree_with_the_float_model(default_model_path, float_tokens):
    """INT4 g128 made at load. Measured 2026-11-25: 5 of 8 prompts identical over 32 tokens, the others diverging
    at tokens 5, 19 and 25 (26.1 agreed tokens on average); the same tokens when the CPU operator is replaced by
    fp32 dequantize-then-GEMM, so the divergences are the 4-bit weights', not the operator's bf16 activations.
    The default model is barely trained (perplexity ~1000): its top two logits are often close, which greedy
    decoding turns into early divergences. Bound: at least 4 of 8 identical, at least 20 tokens on average."""
    agree = agreement(float_tokens, engine_texts(default_model_path, "int4", 32))
    assert sum(n == 32 for n in agree.values()) >= 4 and sum(agree.values()) / len(agree) >= 20, agree


def test_a_gptq_act_order_checkpoint_agrees_with_the_float_model(default_model_path, float_tokens, tmp_path):
    """The packer's GPTQ file (asymmetric, act-order, g128), read by the engine. Measured 2026-11-25: 4 of 8 prompts
    identical to the float model over 32 tokens, 25.3 tokens on average (without act-order 5 of 8, 26.1; symmetric
    with act-order 3 of 8, 23.5: sym gives up one of the 16 levels). Bound: at least 3 of 8, 20 on average."""
    path = quantize_folder(default_model_path, str(tmp_path / "gptq"), QuantFormat("gptq", 128, desc_act=True,
                                                                                    zero_offset=1))
    agree = agreement(float_tokens, engine_texts(path, "none", 32))
    assert sum(n == 32 for n in agree.values()) >= 3 and sum(agree.values()) / len(agree) >= 20, agree


def held_text_ids(tokenizer) -> list[int]:
    """The first 1024 tokens of a text the default model never trained on (module docstrings; it was trained on
    pydoc_data's language reference)."""
    text = "\n".join(m.__doc__ for m in (argparse, collections, json, email))
    return tokenizer(text).input_ids[:1024]


def held_text_perplexity(model) -> float:
    ids = torch.tensor([held_text_ids(held_text_perplexity.tokenizer)])
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def quantized_perplexity(model_path: str, quantize) -> tuple[float, float]:
    """(float, quantized) held-text perplexity of transformers' model, the layers' linears replaced by
    quantize(weight).tensor(): the engine's own quantized weights, dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    held_text_perplexity.tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base = held_text_perplexity(model)
    quantized = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            module.weight.data = quantize(module.weight.data).tensor()
            quantized += 1
    assert quantized == 7 * model.config.num_hidden_layers
    return base, held_text_perplexity(model)


def test_int8_perplexity_is_within_one_percent_of_float(default_model_path):
    """Measured 2026-11-25: +0.03% (1039.4 -> 1039.8)."""
    base, quantized = quantized_perplexity(default_model_path, quantize_int8)
    assert quantized <= base * 1.01


def test_int4_g128_perplexity_is_within_five_percent_of_float(default_model_path):
    """Measured 2026-11-25: +0.12% (1039.4 -> 1040.7; g64 +0.10%, g32 +0.01%). Bound: the issue's +5%."""
    base, quantized = quantized_perplexity(default_model_path, lambda w: quantize_int4(w, 128))
    assert quantized <= base * 1.05


# ------------------------------------------------------------------------------------- INT8 / FP8 KV cache

def test_int8_kv_greedy_tokens_agree_with_the_float_kv(default_model_path, float_tokens):
    """kv_cache_dtype=int8 against the float32 cache, same weights. Measured 2026-11-25: 6 of 8 prompts identical
    over 32 tokens; "The Python language" diverges at token 5, where the float model's top two logits are 0.0055
    apart (a near tie any rounding flips), "Lists" at token 25 (27.75 agreed tokens on average); FP8 e4m3 the same
    two at the same tokens. Bound: at least 6 of 8 identical, at least 26 tokens on average."""
    for kv_dtype in ("int8", "fp8_e4m3"):
        agree = agreement(float_tokens, engine_texts(default_model_path, "none", 32, kv_dtype))
        assert sum(n == 32 for n in agree.values()) >= 6 and sum(agree.values()) / len(agree) >= 26, (kv_dtype, agree)


def engine_perplexity(model_path: str, kv_cache_dtype: str, chunk: int = 256, **engine) -> float:
    """Held-text perplexity through the engine's own forward pass and KV cache (so through the quantizing write
    and the attention that reads it back): the text as a prompt of 256-token chunks, each attending to the cached
    chunks before it, with the logits of every row."""
    from transformers import AutoTokenizer
    from trellm_backend.engine.limits import context_limit
    from trellm_backend.engine.forward_inputs import StepInputs
    from trellm_backend.engine.runner import ModelRunner
    from trellm_backend.models.config import load_model_config
    ids = held_text_ids(AutoTokenizer.from_pretrained(model_path))
    mc = load_model_config(model_path)
    cfg = EngineConfig(model_path=model_path, kv_cache_bytes=16 << 20, kv_cache_dtype=kv_cache_dtype, block_size=16,
                       **engine)
    runner = ModelRunner(cfg, mc, context_limit(cfg, mc))
    table = list(range(-(-len(ids) // 16)))
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            input_ids, meta, rows, _ = StepInputs(runner.device).build(
                part, [start], [len(part)], torch.tensor([table], dtype=torch.int32), 16,
                torch.arange(len(part), dtype=torch.int32))
            logits = runner.model.forward(input_ids, meta, runner.kv_cache, rows, runner.kv_scales)
            targets = torch.tensor(ids[start + 1:start + 1 + len(part)])
            nll -= torch.log_softmax(logits[:len(targets)], -1)[torch.arange(len(targets)), targets].sum().item()
    return math.exp(nll / (len(ids) - 1))


def test_int8_kv_perplexity_is_within_one_percent_of_float(default_model_path):
    """Measured 2026-11-25 (Zen 4): float32 KV 1039.45 (transformers: 1039.4), INT8 KV 1039.59 (+0.014%), FP8 e4m3
    KV 1038.27 (-0.11%). Bounds: the issue's +1% for INT8; FP8 within 2% either way. The float figure is checked
    against transformers on the same weights, not a constant: the default model is trained on the machine that
    builds it, and a CPU without AVX-512 (Zen 3) trains slightly different weights (1035.7 there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    held_text_perplexity.tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    reference = held_text_perplexity(AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32))
    base = engine_perplexity(default_model_path, "auto")
    assert abs(base / reference - 1) < 0.001, (base, reference)     # the engine's forward is transformers' model
    assert engine_perplexity(default_model_path, "int8") <= base * 1.01
    assert abs(engine_perplexity(default_model_path, "fp8_e4m3") / base - 1) <= 0.02


def test_bf16_perplexity_is_within_half_a_percent_of_float_and_int8_under_bf16_within_one(default_model_path):
    """The engine's own forward in bfloat16 (weights, activations and KV cache; on a CPU without AVX-512 its
    linears of 4+ tokens widened to fp32), and with INT8 weights under bf16 activations, against float32. The
    bounds are issue 30's: 0.5% for bf16, 1% for INT8. Measured 2026-11-27 (AVX2): 1035.68 float32, bf16 -0.023%,
    bf16 + INT8 -0.028%."""
    base = engine_perplexity(default_model_path, "auto")
    bf16 = engine_perplexity(default_model_path, "auto", dtype="bfloat16")
    int8 = engine_perplexity(default_model_path, "auto", dtype="bfloat16", quantization="int8")
    assert abs(bf16 / base - 1) <= 0.005, (base, bf16)
    assert abs(int8 / base - 1) <= 0.01, (base, int8)


def test_int8_perplexity_through_the_engine_is_within_one_percent_of_float(default_model_path):
    """The engine's own forward with INT8 weights: what the operator computes, which with AVX2 alone includes
    rounding each token's activations to int16 (the transformers test above sees only the weights' rounding).
    Bound: the issue's 1%. Measured 2026-11-27 (AVX2): float32 1035.68, INT8 +0.022% (the greedy test above: 8 of 8
    prompts as float32's)."""
    base = engine_perplexity(default_model_path, "auto")
    int8 = engine_perplexity(default_model_path, "auto", quantization="int8")
    assert abs(int8 / base - 1) <= 0.01, (base, int8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_perplexity_through_the_engine_is_within_one_percent_of_float(default_model_path, dtype):
    """W8A8 (int8 weights and per-token int8 activations) against the float32 model, in float32 and under bf16.
    Bound: INT8's 1%. Measured 2026-12-05 (Intel Xeon with AMX): -0.05% and -0.05%."""
    base = engine_perplexity(default_model_path, "auto")
    w8a8 = engine_perplexity(default_model_path, "auto", dtype=dtype, quantization="w8a8")
    assert abs(w8a8 / base - 1) <= 0.01, (base, w8a8)


def test_the_load_log_names_each_linear_layers_path(default_model_path, caplog):
    """One line at load says which implementation every linear layer runs (the same words as linear_path), so a
    host's paths show without a profile. The default model's gate_up (2 x 344 outputs) fills no whole 32-output
    block of the INT8 operator, so it is named apart from the others."""
    from trellm_kernels.linear import linear_path
    with caplog.at_level("INFO", logger="trellm"):
        engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20, quantization="int8"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear layers: ")]
    model = engine.runner.model
    layer = model.layers[0]
    assert f"qkv, o, down: {linear_path(layer.qkv)}; gate_up: {linear_path(layer.gate_up)}" in line, line
    assert line.endswith(f"; lm_head: {linear_path(model.lm_head)}") and "INT8" not in linear_path(model.lm_head)


@pytest.fixture(scope="module")
def small_model_path():
    """A larger model made here (`default_model --size small`: 4x the default model's layer width, 6 layers,
    head_dim 32, 150 training steps of 4 sequences, ~2 minutes to build on 2 cores). A folder built before
    2026-11-28 trained on 16 sequences a step: `rm -rf hf_models/small` to get the model the figures below describe."""
    from conftest import REPO
    from trellm_backend.tools.default_model import DEFAULT_TRAIN_STEPS, build
    return build(os.path.join(REPO, "hf_models", "small"), DEFAULT_TRAIN_STEPS["small"], size="small")


def test_quantization_quality_holds_on_a_larger_model(small_model_path):
    """The issue's bounds on the larger model. Measured 2026-11-28, held-text perplexity 1803.77 in float: INT8
    weights -0.001%, INT4 g128 +0.33%, INT8 KV -0.000%, FP8 KV -0.01%; greedy over 32 tokens, 8 of 8 prompts
    identical to float for each. W8A8, measured 2026-12-05 (Intel Xeon with AMX): -0.11% through the engine, 8 of
    8 identical. Bounds: +1% (INT8 weights, INT8 KV, W8A8), +5% (INT4), 2% either way (FP8); at least 6 of 8
    prompts identical."""
    base, int8 = quantized_perplexity(small_model_path, quantize_int8)
    _, int4 = quantized_perplexity(small_model_path, lambda w: quantize_int4(w, 128))
    assert int8 <= base * 1.01 and int4 <= base * 1.05, (base, int8, int4)
    kv_base = engine_perplexity(small_model_path, "auto")
    assert abs(kv_base / base - 1) < 1e-3, (kv_base, base)
    assert engine_perplexity(small_model_path, "int8") <= kv_base * 1.01
    assert engine_perplexity(small_model_path, "auto", quantization="w8a8") <= kv_base * 1.01
    assert abs(engine_perplexity(small_model_path, "fp8_e4m3") / kv_base - 1) <= 0.02
    float_texts = engine_texts(small_model_path, "none", 32)
    for quantization, kv_dtype in (("int8", "auto"), ("w8a8", "auto"), ("int4", "auto"), ("none", "int8"),
                                   ("none", "fp8_e4m3")):
        agree = agreement(float_texts, engine_texts(small_model_path, quantization, 32, kv_dtype))
        assert sum(n == 32 for n in agree.values()) >= 6, (quantization, kv_dtype, agree)


def test_kv_cache_dtype_sizes_the_pool_and_is_checked_at_load(default_model_path, tmp_path):
    """The same kv_cache_bytes holds (D * 4) / (D + 2) times fp32's blocks in INT8 (values plus a float16 scale per
    token and head: 3.76x at the default model's head_dim 32); an unknown value is a load error naming
    config.pbtxt, the field and the allowed values."""
    from trellm_backend.engine.limits import kv_bytes_per_block
    from trellm_backend.models.config import ModelConfigError, load_model_config
    from trellm_backend.triton.checks import serving_config
    mc = load_model_config(default_model_path)
    fp32, int8 = (kv_bytes_per_block(mc, 128, d) for d in (torch.float32, torch.int8))
    assert fp32 == 4 * 2 * 128 * 2 * 32 * 4 and int8 == 4 * 2 * 128 * 2 * (32 + 2)
    assert kv_bytes_per_block(mc, 128, torch.float8_e4m3fn) == int8
    assert kv_bytes_per_block(mc, 128, torch.int8, draft=mc) == 2 * int8      # a draft's K/V quantized alike
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=64 << 20, kv_cache_dtype="int8"))
    assert engine.runner.num_blocks == (64 << 20) // int8 and engine.runner.kv_cache.dtype == torch.int8
    assert engine.runner.kv_scales.shape == (4, 2, engine.runner.num_blocks, 128, 2)
    entry = tmp_path / "llm"
    params = {"model_path": default_model_path, "kv_cache_bytes": str(32 << 20)}
    assert serving_config({**params, "kv_cache_dtype": "int8"}, str(entry)).kv_cache_dtype == "int8"
    with pytest.raises(ModelConfigError, match="^" + re.escape(
            f"{entry / 'config.pbtxt'}: kv_cache_dtype='fp16' is not one of auto, int8, fp8_e4m3")):
        serving_config({**params, "kv_cache_dtype": "fp16"}, str(entry))
    # One 2048-token sequence needs 16 blocks: 4 MiB in fp32, 1.06 MiB in INT8.
    small = {**params, "kv_cache_bytes": str(2 << 20)}
    with pytest.raises(ModelConfigError, match="KV cache too small"):
        serving_config(small, str(entry))
    serving_config({**small, "kv_cache_dtype": "int8"}, str(entry))


# ------------------------------------------------------------------------------- GPTQ and AWQ checkpoint layouts

def word(t: torch.Tensor, i: int, j: int) -> int:
    return int(t[i, j]) & 0xFFFFFFFF      # the int32 as the 32 bits the formats describe


def test_gptq_and_awq_put_each_value_in_the_bits_the_formats_define():
    """Read element by element with the formats' definitions (quant_formats.py's docstring), not with the
    vectorized unpacking the engine uses."""
    g = torch.Generator().manual_seed(5)
    N, K, group = 16, 64, 32
    q = torch.randint(0, 16, (N, K), generator=g).to(torch.uint8)
    zeros = torch.randint(1, 16, (K // group, N), generator=g).to(torch.uint8)
    scales = torch.rand(K // group, N, generator=g)
    g_idx = torch.arange(K, dtype=torch.int32) // group
    t = gptq_pack(q, scales, zeros, g_idx, zero_offset=1)
    assert t["qweight"].shape == (K // 8, N) and t["qzeros"].shape == (K // group, N // 8)
    assert t["qweight"].dtype == t["qzeros"].dtype == torch.int32 and t["scales"].dtype == torch.float16
    for n in range(N):
        for k in range(K):
            assert (word(t["qweight"], k // 8, n) >> 4 * (k % 8)) & 15 == q[n, k]
        for gi in range(K // group):
            assert ((word(t["qzeros"], gi, n // 8) >> 4 * (n % 8)) & 15) + 1 == zeros[gi, n]   # stored zero - 1
    t = awq_pack(q, scales, zeros)
    assert t["qweight"].shape == (K, N // 8) and t["qzeros"].shape == (K // group, N // 8)
    for n in range(N):
        nibble = AWQ_ORDER.index(n % 8)      # column 8c + AWQ_ORDER[i] sits in nibble i
        for k in range(K):
            assert (word(t["qweight"], k, n // 8) >> 4 * nibble) & 15 == q[n, k]
        for gi in range(K // group):
            assert (word(t["qzeros"], gi, n // 8) >> 4 * nibble) & 15 == zeros[gi, n]


FORMATS = {
    "gptq-sym": QuantFormat("gptq", 128, sym=True, zero_offset=1),
    "gptq-asym-act-order": QuantFormat("gptq", 64, desc_act=True, zero_offset=1),
    "gptq-sym-act-order": QuantFormat("gptq", 32, desc_act=True, sym=True, zero_offset=1),
    "gptq_v2-asym": QuantFormat("gptq", 32),
    "awq-g128": QuantFormat("awq", 128),
    "awq-g32": QuantFormat("awq", 32),
}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("out_f, in_f", [(48, 256), (40, 344)])
def test_unpack_of_pack_is_the_quantize_dequantize_weight(name, out_f, in_f):
    """(40, 344): the default model's down_proj inputs, not a multiple of any group (GPTQ's last group is short;
    AWQ cannot hold it)."""
    fmt = FORMATS[name]
    if fmt.method == "awq" and in_f % fmt.group_size:
        with pytest.raises(ValueError, match="whole groups"):
            awq_pack(*quantize_linear(torch.randn(out_f, in_f), fmt)[:3])
        return
    g = torch.Generator().manual_seed(6)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(1, in_f, generator=g)   # inputs of unequal scale
    order = act_order([w]) if fmt.desc_act else None
    q, scales, zeros, g_idx = quantize_linear(w, fmt, order)
    gi = g_idx.long()
    dequantized = (q.float() - zeros.float()[gi].t()) * scales.float()[gi].t()   # the formats' W[n, k]
    step = scales.float()[gi].t()
    if not (fmt.zero_offset and not fmt.sym):     # a v1 GPTQ zero cannot be 0: the top step may clip
        # half a step, plus the 15 steps of the group's range each off by the fp16 rounding of the scale
        assert ((dequantized - w).abs() <= step * (0.5 + 15 * 2 ** -11) + EPS32 * (w.abs() + 16 * step)).all()
    if fmt.method == "gptq":
        packed = gptq_pack(q, scales, zeros, g_idx, fmt.zero_offset)
        weight = gptq_unpack(packed, fmt, "test")
        assert (weight.perm is not None) == fmt.desc_act
        if fmt.desc_act:
            assert not torch.equal(g_idx, torch.arange(in_f, dtype=torch.int32) // fmt.group_size)
            assert torch.equal(weight.perm, torch.argsort(gi, stable=True))
    else:
        weight = awq_unpack(awq_pack(q, scales, zeros), fmt, "test")
    weight.scales = weight.scales.float()          # as the engine holds it in fp32
    assert torch.equal(weight.tensor(), dequantized)


def test_the_engine_reads_each_linear_of_an_awq_and_a_gptq_checkpoint_into_its_place(tmp_path):
    """A model made here whose sizes AWQ can hold (Qwen2: q/k/v biases, GQA, tied embeddings): every stacked
    linear of the engine equals the packer's quantize-dequantize of the float weights, exactly."""
    from hf_models import model_dir_for
    from trellm_backend.models.config import load_model_config
    from trellm_backend.models.llama import LlamaModel
    from trellm_backend.models.weights import load_state_dict
    src = model_dir_for(str(tmp_path), "qwen2-bias-gqa4")
    float_state = load_state_dict(src, torch.float32)
    for fmt in (QuantFormat("awq", 64), QuantFormat("gptq", 32, desc_act=True, zero_offset=1)):
        dst = quantize_folder(src, str(tmp_path / fmt.method), fmt)
        mc = load_model_config(dst)
        assert mc.quant == fmt
        model = LlamaModel(mc, load_state_dict(dst, torch.float32), torch.device("cpu"), torch.float32, 64)
        for i, layer in enumerate(model.layers):
            for weight, module, names in ((layer.qkv, "self_attn", ("q_proj", "k_proj", "v_proj")),
                                          (layer.o, "self_attn", ("o_proj",)),
                                          (layer.gate_up, "mlp", ("gate_proj", "up_proj")),
                                          (layer.down, "mlp", ("down_proj",))):
                ws = [float_state[f"model.layers.{i}.{module}.{n}.weight"] for n in names]
                order = act_order(ws) if fmt.desc_act else None
                want = []
                for w in ws:
                    q, scales, zeros, g_idx = quantize_linear(w, fmt, order)
                    gi = g_idx.long()
                    want.append((q.float() - zeros.float()[gi].t()) * scales.float()[gi].t())
                assert weight.int4 is not None and (weight.int4.perm is not None) == fmt.desc_act
                assert torch.equal(weight.tensor(), torch.cat(want)), (fmt.method, i, names)
        assert layer.qkv_bias is not None   # the float tensors beside the packed ones are read too


@pytest.mark.server
def test_quantized_models_added_with_the_command_serve_what_the_engine_generates(default_model_path, tmp_path):
    """INT8 weights made at load, W8A8, a GPTQ act-order checkpoint (read as stored: its config.json says so) and an
    INT8 KV cache, each an entry written by `add_model` with its parameter, in one tritonserver: each streams, for every
    prompt, the tokens the engine makes with the same setting (themselves close to the float model's: above). INT4
    made at load takes the INT8 path through the server: the same parameter, checked by checks.py against the same
    list."""
    import subprocess
    import sys
    from conftest import free_ports
    from transformers import AutoTokenizer
    from trellm_backend.tools.launch import TritonServer
    from trellm_backend.tools.repository import read_config
    from trellm_client.client import LLMClient
    gptq = quantize_folder(default_model_path, str(tmp_path / "gptq"), QuantFormat("gptq", 128, desc_act=True,
                                                                                    zero_offset=1))
    repo = tmp_path / "repository"
    repo.mkdir()
    models = {"q8": (default_model_path, "int8", "auto", 32 << 20),
              "w8a8": (default_model_path, "w8a8", "auto", 32 << 20),
              "gptq": (gptq, "none", "auto", 32 << 20), "kv8": (default_model_path, "none", "int8", 8 << 20)}
    tok = AutoTokenizer.from_pretrained(default_model_path)
    want = {}
    for name, (path, quantization, kv_dtype, kv_bytes) in models.items():
        r = subprocess.run([sys.executable, "-m", "trellm_backend.tools.add_model", name, path, f"--repository={repo}",
                            f"--quantization={quantization}", f"--kv-cache-dtype={kv_dtype}",
                            f"--kv-cache-bytes={kv_bytes}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        parameters = read_config(repo / f"{name}_llm" / "config.pbtxt").parameters
        assert parameters["quantization"].string_value == quantization, name
        assert parameters["kv_cache_dtype"].string_value == kv_dtype, name
        want[name] = {p: tok.decode(ids, skip_special_tokens=True)
                      for p, ids in engine_texts(path, quantization, 12, kv_dtype).items()}
    log = tmp_path / "server.log"
    with TritonServer(str(repo), *free_ports(3), log_path=str(log), model_control_mode="explicit",
                      load_models=list(models)) as server:
        for name in models:
            with LLMClient(server.grpc_url, model=name) as c:
                got = {p: "".join(c.stream(p, max_tokens=12, min_tokens=12)) for p in PROMPTS}
            assert got == want[name], name
    # The INT8 pool, logged at load: 8 MiB in INT8 holds 7 sequences of 2048 tokens (fp32: 2).
    assert "int8 (float16 scale per token and head)" in log.read_text()


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits=8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "quantization_config.group_size=-1 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256}, "quantization_config.group_size=256 is not supported"),
    ({"quant_method": "fp8"}, "quantization_config.quant_method='fp8' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "quantization_config.version='gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "quantization_config.checkpoint_format='marlin' is not supported"),
])
def test_an_unsupported_quantization_config_is_a_load_error_naming_the_file_and_value(default_model_path, tmp_path,
                                                                                      qc, message):
    import shutil
    from trellm_backend.models.config import ModelConfigError
    from trellm_backend.triton.checks import serving_config
    folder = tmp_path / "model"
    shutil.copytree(default_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="^" + re.escape(f"{folder / 'config.json'}: {message}")):
        serving_config({"model_path": str(folder), "kv_cache_bytes": str(32 << 20)}, str(tmp_path / "entry"))


def test_a_prequantized_checkpoint_refuses_quantization_at_load(default_model_path, tmp_path):
    from trellm_backend.models.config import ModelConfigError
    from trellm_backend.triton.checks import serving_config
    path = quantize_folder(default_model_path, str(tmp_path / "gptq"), QuantFormat("gptq", 64, zero_offset=1))
    with pytest.raises(ModelConfigError, match="quantization='int4', but .*config.json is already a gptq checkpoint"):
        serving_config({"model_path": path, "kv_cache_bytes": str(32 << 20), "quantization": "int4"},
                       str(tmp_path / "entry"))
    with pytest.raises(ModelConfigError, match="already quantized"):
        engine_texts(path, "int8", 1)


def test_the_packer_command_writes_the_quantization_config_it_was_asked_for(default_model_path, tmp_path, capsys):
    from trellm_backend.models.config import load_model_config
    from trellm_backend.tools import quantize_checkpoint
    dst = tmp_path / "gptq"
    quantize_checkpoint.main([default_model_path, str(dst), "--method", "gptq", "--group-size", "64", "--desc-act",
                              "--asym", "--v2"])
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq_v2"}
    assert load_model_config(str(dst)).quant == QuantFormat("gptq", 64, desc_act=True, sym=False, zero_offset=0)
    assert (dst / "tokenizer.json").is_file()
    with pytest.raises(SystemExit):
        quantize_checkpoint.main([default_model_path, str(tmp_path / "awq"), "--method", "awq", "--desc-act"])
    assert "GPTQ options" in capsys.readouterr().err
