"""Prefix caching with the real model: requests sharing a long system prompt reuse its KV blocks, and greedy
outputs stay identical to transformers with caching on or off, with different chunk sizes, and under a pool small
enough to force preemptions."""
from __future__ import annotations

import pytest

from hf_models import hf_greedy, random_prompts
from test_engine import GREEDY, MAX_TOKENS, run_staggered
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams

SYSTEM = random_prompts(7, 4096, [50])[0]                      # shared by every prompt: 3 full blocks of 16
TAILS = random_prompts(8, 4096, [1, 5, 14, 20, 9, 30])
PROMPTS = [SYSTEM + t for t in TAILS] + [SYSTEM[:32], SYSTEM]  # also exactly 2 blocks, and the prefix alone
ARRIVALS = [0, 0, 1, 4, 12, 30, 31, 40]                         # the late ones find earlier blocks freed, not gone


@pytest.fixture(scope="module")
def expected(default_model_path):
    return hf_greedy(default_model_path, PROMPTS, MAX_TOKENS)


def run(model_path, **kwargs) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(EngineConfig(model_path=model_path, block_size=16, **kwargs))   # the blocks counted above
    return engine, run_staggered(engine, PROMPTS, ARRIVALS, GREEDY)   # run_staggered checks no block is held


@pytest.mark.parametrize("settings", [
    dict(enable_prefix_caching=False, max_num_batched_tokens=64),
    dict(enable_prefix_caching=True, max_num_batched_tokens=64),
    dict(enable_prefix_caching=True, max_num_batched_tokens=8),
    dict(enable_prefix_caching=True, max_num_batched_tokens=256, enable_chunked_prefill=False),
], ids=["off", "on", "on-chunk8", "on-unchunked"])
def test_greedy_outputs_identical_with_and_without_prefix_cache(default_model_path, expected, settings):
    engine, got = run(default_model_path, kv_cache_bytes=32 << 20, **settings)
    assert got == expected
    hits = engine.kv.num_hits
    if settings["enable_prefix_caching"]:
        assert hits >= 3 * (len(PROMPTS) - 2), f"the shared 3-block system prompt was reused only {hits} times"
    else:
        assert hits == 0


def test_prefix_cache_under_preemption(default_model_path, expected):
    # 12 blocks cannot hold eight sequences of up to 100 tokens: requests are preempted and recomputed, and a
    # recompute starts from whatever of its own (or a neighbour's) blocks is still cached.
    engine, got = run(default_model_path, num_kv_blocks=12, max_num_batched_tokens=64)
    assert engine.num_preemptions > 0
    assert got == expected


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_under_prefix_caching_chunking_and_preemption(default_model_path, kv_cache_dtype):
    """An INT8/FP8 cache stores each token's K/V quantized on their own (one scale per token and head), so a reused
    prefix block, a prefill cut into 8-token chunks and a preempted-and-recomputed request give the tokens of a
    plain run with the same cache dtype (that run's agreement with the float model: test_quantization.py)."""
    _, plain = run(default_model_path, kv_cache_bytes=32 << 20, enable_prefix_caching=False,
                   max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    engine, got = run(default_model_path, kv_cache_bytes=32 << 20, max_num_batched_tokens=8,
                      kv_cache_dtype=kv_cache_dtype)
    assert engine.kv.num_hits >= 3 * (len(PROMPTS) - 2) and got == plain
    engine, got = run(default_model_path, num_kv_blocks=12, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    assert engine.num_preemptions > 0 and got == plain


def test_reused_blocks_are_reported_per_request(default_model_path):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, block_size=16, kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = engine.make_request("a", PROMPTS[0], params)
    engine.add(first)
    while engine.has_unfinished():
        engine.step()
    second = engine.make_request("b", PROMPTS[1], params)
    salted = engine.make_request("c", PROMPTS[1], params)
    salted.cache_salt = "another tenant"
    engine.add(second)
    engine.add(salted)
    while engine.has_unfinished():
        engine.step()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48, "the three full blocks of the shared prompt must come from the cache"
    assert salted.num_cached_tokens == 0, "a different cache salt must not see another tenant's prefix"
