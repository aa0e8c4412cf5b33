"""Decode steps padded to a batch-size bucket over persistent buffers (`enforce_eager=false`, engine/padded_decode.py:
the inputs a CUDA graph replays, run eagerly on a CPU) against the steps as scheduled: bit for bit the same tokens,
logprobs, text and finish reasons for every feature that reaches a decode step, while padding rows touch no
request's KV blocks.

Bit for bit with one CPU linear path: the timed choice (kernels/linear_choice.py) may run a padded batch's row count
on another implementation than the unpadded one's, which sums in another order; then greedy tokens still agree, as
they must on a GPU."""
from __future__ import annotations

import json

import pytest

from hf_models import make_lora, random_prompts
from test_engine import run
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.padded_decode import decode_buckets
from trellm_backend.engine.request import SamplingParams
from trellm_backend.engine.structured_output import Guide

ARRIVALS = [0, 0, 1, 3, 3, 6, 9]     # sequences join and leave: decode batches of many sizes, mixed steps between


def outputs(model_path, tokenizer, prompts, params_of, eager: bool, **kw) -> tuple[list[dict], LLMEngine]:
    eng = LLMEngine(EngineConfig(model_path, enforce_eager=eager, **kw), tokenizer)
    return run(eng, prompts, None, ARRIVALS[:len(prompts)], params_of=params_of), eng


def test_buckets_are_vllms_capture_sizes():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(3) == [1, 2, 3] and decode_buckets(1) == [1]


@pytest.fixture(scope="module")
def adapter(default_model_path, tmp_path_factory) -> str:
    return make_lora(default_model_path, "all-r16", str(tmp_path_factory.mktemp("lora") / "all-r16"))


FEATURES = {
    "greedy": (dict(), lambda i: SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)),
    "seeded sampling, penalties": (dict(), lambda i: SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.9, seed=i, repetition_penalty=1.2, ignore_eos=True, logprobs=1)),
    "prefix caching and preemption": (dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=64),
                                      lambda i: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
    "int8 KV cache": (dict(kv_cache_dtype="int8"), lambda i: SamplingParams(max_tokens=24, temperature=0.0,
                                                                           ignore_eos=True, logprobs=2)),
    "ngram speculation": (dict(speculative_method="ngram"), lambda i: SamplingParams(max_tokens=32, temperature=0.0,
                                                                                    ignore_eos=True)),
    "structured output": (dict(), lambda i: SamplingParams(
        max_tokens=24, temperature=0.0, guide=Guide("regex", r"(\+|-)?[0-9]{1,4}\.[0-9]{2} [a-z]{2,6}")
        if i % 2 else None)),
}


@pytest.mark.parametrize("feature", [*FEATURES, "lora"])
def test_padded_decode_steps_give_what_the_scheduled_steps_give(default_model_path, tokenizer, adapter, feature,
                                                                kernel_settings):
    kernel_settings(cpu_linear="cpp")
    if feature == "lora":
        kw = dict(lora_adapters=json.dumps({"a": adapter}))

        def params_of(i):
            return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, lora_name="a" if i % 2 else None)
    else:
        kw, params_of = FEATURES[feature]
    shared = random_prompts(7, 4096, [40])[0]
    prompts = random_prompts(3, 4096, [1, 9, 17, 33]) + [shared + [5, 6], shared + [7], shared]
    eager, eager_engine = outputs(default_model_path, tokenizer, prompts, params_of, True, **kw)
    padded, engine = outputs(default_model_path, tokenizer, prompts, params_of, False, **kw)
    if engine.runner.device.type == "cpu":
        assert padded == eager
    else:   # a GPU's GEMMs may take another kernel for the padded row count (gpu_check's parity step)
        assert [(p["tokens"], p["reason"]) for p in padded] == [(e["tokens"], e["reason"]) for e in eager]
    assert eager_engine.runner.padded is None
    assert engine.runner.padded.steps > 10, "the padded path must have run"
    if feature == "prefix caching and preemption":
        assert engine.num_preemptions > 0 and engine.stats().prefix_cache_hits > 0


def test_greedy_tokens_agree_whatever_linear_path_a_row_count_takes(default_model_path, tokenizer, kernel_settings):
    kernel_settings(cpu_linear="auto")
    prompts = random_prompts(4, 4096, [3, 8, 21, 40, 64, 2, 5])
    greedy = FEATURES["greedy"][1]
    eager, _ = outputs(default_model_path, tokenizer, prompts, greedy, True)
    padded, _ = outputs(default_model_path, tokenizer, prompts, greedy, False)
    assert [p["tokens"] for p in padded] == [e["tokens"] for e in eager]


def test_padding_rows_write_only_the_scratch_block(default_model_path):
    """Three sequences padded to a bucket of four: the KV blocks no request holds keep their contents, and the
    scratch block past the managed ones takes the padding row's K/V."""
    eng = LLMEngine(EngineConfig(default_model_path, enforce_eager=False, block_size=16, num_kv_blocks=32))
    for i, p in enumerate(random_prompts(1, 4096, [5, 6, 7])):
        eng.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()      # the prefills
    cache = eng.runner.kv_cache
    assert cache.shape[2] == eng.kv.num_blocks + 1
    held = {b for i in range(3) for b in eng.kv.block_ids(str(i))}
    free = [b for b in range(eng.kv.num_blocks) if b not in held]
    cache[:, :, free] = 7.0
    cache[:, :, -1] = 0.0
    eng.step()      # a decode step of three, padded to four
    assert eng.runner.padded.steps == 1
    assert (cache[:, :, free] == 7.0).all(), "a padding row wrote into a block no request holds"
    assert (cache[:, :, -1, 0] != 0).any(), "the padding row's K/V go to the scratch block"
