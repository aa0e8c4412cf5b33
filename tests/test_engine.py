"""The engine against Hugging Face transformers on the same weights: greedy tokens must be identical, with
requests arriving at different steps (so batches mix prefill chunks and decodes, and sequences join and leave),
for the default model and for other Llama-family configurations. Also the KV block bookkeeping."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hf_models import VARIANTS, hf_greedy, model_dir_for, random_prompts
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams

LENGTHS = [1, 7, 16, 17, 45, 90]       # one token, around a block boundary, several blocks
ARRIVALS = [0, 0, 2, 3, 5, 9]          # engine step at which each request is added
MAX_TOKENS = 20


def run(eng: LLMEngine, prompts, params, arrivals=None, params_of=None, after_step=None) -> list[dict]:
    """Add prompt i at step arrivals[i] (all at once by default) with `params` (or params_of(i)); step until all
    finish, calling after_step() after each step if given; check that no KV block is still held. Returns each
    prompt's outputs merged: tokens, text, logprobs, top logprobs and finish reason."""
    arrivals = arrivals or [0] * len(prompts)
    outs = {i: [] for i in range(len(prompts))}
    order = sorted(range(len(prompts)), key=arrivals.__getitem__)
    step = 0
    while order or eng.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            eng.add_request(str(i), prompts[i], params_of(i) if params_of else params)
        for o in eng.step():
            outs[int(o.request_id)].append(o)
        if after_step is not None:
            after_step()
        step += 1
        assert step < 10_000
    assert eng.kv_blocks_used() == 0, "blocks still held after every request finished"
    return [dict(tokens=[t for x in o for t in x.new_token_ids], text="".join(x.text for x in o),
                 logprobs=[v for x in o for v in (x.logprobs or [])],
                 top=[v for x in o for v in (x.top_logprobs or [])], reason=o[-1].finish_reason)
            for o in (outs[i] for i in range(len(prompts)))]


def run_staggered(engine: LLMEngine, prompts, arrivals, params) -> list[list[int]]:
    """Each prompt's tokens, prompt i added at step arrivals[i]."""
    return [r["tokens"] for r in run(engine, prompts, params, arrivals)]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {name: model_dir_for(root, name) for name in VARIANTS}


def check_parity(model_dir, vocab, max_tokens=MAX_TOKENS, **engine_kwargs):
    prompts = random_prompts(0, vocab, LENGTHS)
    expected = hf_greedy(model_dir, prompts, max_tokens)
    engine = LLMEngine(EngineConfig(model_path=model_dir, **engine_kwargs))
    got = run_staggered(engine, prompts, ARRIVALS, replace(GREEDY, max_tokens=max_tokens))
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"prompt {i} (length {LENGTHS[i]}): engine {g} != transformers {e}"
    return engine


def test_default_model_matches_transformers(default_model_path):
    # A 32-token budget: long prompts are prefilled in chunks while earlier requests decode.
    check_parity(default_model_path, 4096, max_num_batched_tokens=32, kv_cache_bytes=32 << 20)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_transformers(variant_dirs, name):
    check_parity(variant_dirs[name], 320, max_num_batched_tokens=48, block_size=16, kv_cache_bytes=8 << 20)


def test_block_size_32_and_no_chunking(default_model_path):
    check_parity(default_model_path, 4096, block_size=32, max_num_batched_tokens=256, enable_chunked_prefill=False,
                 kv_cache_bytes=32 << 20)


def test_preemption_keeps_outputs_identical(default_model_path):
    # 14 blocks of 16 tokens cannot hold all six sequences (up to 110 tokens each): some are preempted and
    # recomputed, and their tokens must not change.
    engine = check_parity(default_model_path, 4096, num_kv_blocks=14, block_size=16, max_num_batched_tokens=64)
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("prefix_caching, speculation", [(False, "none"), (True, "ngram")])
def test_sliding_window_returns_blocks_that_left_it(variant_dirs, prefix_caching, speculation):
    """Every layer of mistral-sliding attends within 24 keys: blocks that left a request's window go back to the
    pool as it decodes, so a 90-token prompt decoding 40 holds 3 blocks of 16, not 9. After every step the free
    blocks are overwritten with large values and handed to other requests (a pool of 16 blocks for six sequences):
    a block freed too early, or a kernel that still read a dropped one, would change a token. With prefix caching
    and n-gram guesses (the random model repeats itself, so some are accepted) the tokens stay the same."""
    folder = variant_dirs["mistral-sliding"]
    engine = check_parity(folder, 320, 40, block_size=16, num_kv_blocks=16, max_num_batched_tokens=48,
                          enable_prefix_caching=prefix_caching, speculative_method=speculation,
                          speculative_disable_batch_size=8)
    if speculation != "none":
        assert engine.stats().spec_num_accepted_tokens > 0
    assert engine.kv_blocks_used() == 0 and engine.kv.window == 24
    prompts = random_prompts(0, 320, LENGTHS)
    held = []

    def poison_free_blocks_and_count():
        free = list(engine.kv.free_ids)
        if not prefix_caching:       # cached free blocks must keep what a later hit reads
            engine.runner.kv_cache[:, :, free] = 1e4
        held.append(engine.kv_blocks_used())

    got = run(engine, prompts[-1:], replace(GREEDY, max_tokens=40), after_step=poison_free_blocks_and_count)
    assert got[0]["tokens"] == hf_greedy(folder, prompts[-1:], 40)[0]
    assert max(held[-30:]) <= 3, held
    if not prefix_caching:
        got = run(engine, prompts, replace(GREEDY, max_tokens=40), after_step=poison_free_blocks_and_count)
        assert [r["tokens"] for r in got] == hf_greedy(folder, prompts, 40)


def test_abort_frees_blocks_at_once(default_model_path):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, block_size=16, kv_cache_bytes=16 << 20))
    for i, p in enumerate(random_prompts(1, 4096, [40, 33, 5])):
        engine.add_request(str(i), p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_blocks_used() > 0
    out = engine.abort("0")
    assert out.finished and out.finish_reason == "abort"
    engine.abort("2")
    assert engine.abort("unknown") is None
    assert engine.kv_blocks_used() == 3   # request 1: 33 prompt tokens + 3 generated = 36 tokens in 3 blocks
    engine.abort("1")
    assert engine.kv_blocks_used() == 0 and not engine.has_unfinished()


def test_stops_on_every_eos_id_and_max_tokens(default_model_path):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20))
    assert sorted(engine.eos_token_ids) == [2, 7]     # </s> and <|end|> from generation_config.json
    prompt = random_prompts(2, 4096, [10])[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(free_run) == 8
    # Declare the third generated token a stop token: generation ends right there.
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[free_run[2]])
    assert engine.generate([prompt], stop)[0] == free_run[:free_run.index(free_run[2]) + 1]


def test_bad_requests_are_refused_with_the_numbers(default_model_path):
    engine = LLMEngine(EngineConfig(model_path=default_model_path, max_model_len=64, num_kv_blocks=3, block_size=16))
    with pytest.raises(ValueError, match="empty"):
        engine.make_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="64"):
        engine.make_request("b", [5] * 64, SamplingParams())
    with pytest.raises(ValueError, match="holds 48"):
        engine.make_request("c", [5] * 50, SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        engine.make_request("d", [5, 4096], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.make_request("e", [5], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        engine.make_request("f", [5], SamplingParams(top_p=0.0))


@pytest.mark.kernels
@pytest.mark.parametrize("name, splits", [("default", None), ("qwen3-qknorm-hd8", "3"), ("qwen2-bias-gqa4", None),
                                          ("qwen2-moe-shared", None), ("gemma2-softcap", None)])
def test_triton_kernels_match_transformers(monkeypatch, default_model_path, variant_dirs, name, splits, kernel_settings):
    """The same parity with every hot-path op running as a Triton-lang kernel (interpreted on CPU); for Qwen3
    the decode steps take the split-sequence attention path, Qwen2-MoE's experts the fused MoE kernel, and Gemma 2
    its window and score cap in the attention kernel. 8 tokens
    each: every request still decodes beside others' prefill chunks, at a third of the interpreter's time for 20."""
    kernel_settings(force_triton=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"   # interpreted on CPU (conftest), compiled on GPU
    if splits:
        kernel_settings(attn_splits=int(splits))
    import trellm_kernels.triton_attention as ta
    import trellm_kernels.triton_moe as tm
    calls, moe_calls = [], []
    monkeypatch.setattr(ta, "paged_attention_triton", _counting(ta.paged_attention_triton, calls))
    monkeypatch.setattr(tm, "fused_moe_triton", _counting(tm.fused_moe_triton, moe_calls))
    if name == "default":
        check_parity(default_model_path, 4096, 8, device=device, max_num_batched_tokens=32, kv_cache_bytes=32 << 20)
    else:
        check_parity(variant_dirs[name], 320, 8, device=device, max_num_batched_tokens=48, kv_cache_bytes=8 << 20)
    assert calls, "the Triton attention kernel was never called"
    assert bool(moe_calls) == ("moe" in name), "the fused MoE kernel runs exactly in the MoE models"


def _counting(fn, calls):
    def wrapper(*a, **k):
        calls.append(1)
        return fn(*a, **k)
    return wrapper


@pytest.mark.kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CPU host's session runs test_kernels.py interpreted")
def test_kernel_interpreter_tests_in_their_own_process():
    """On a GPU host this session compiles the kernels, so the interpreter tests get a process of their own."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_kernels.py")],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:]


def test_gemma_logprobs_follow_the_capped_logits(variant_dirs):
    """Gemma 3's final_logit_softcapping is monotonic, so greedy tokens cannot show it; the logprobs do. Each
    sampled token's logprob is transformers' log-softmax of the capped logits within float32 rounding, and the answer's
    logprobs together are far closer to those than to the uncapped ones' (a token whose logits sit far below the cap
    barely moves, so the margin is taken over the answer, not per token)."""
    import json
    from transformers import AutoModelForCausalLM
    folder = variant_dirs["gemma3-text"]
    cap = json.load(open(os.path.join(folder, "config.json")))["final_logit_softcapping"]
    prompt = random_prompts(3, 320, [12])[0]
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=8 << 20))
    [out] = run(engine, [prompt], replace(GREEDY, max_tokens=6, logprobs=0))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["tokens"]])).logits[0, len(prompt) - 1:-1].double()
    uncapped = torch.atanh(logits / cap) * cap     # what the model computed before transformers capped it
    errors = []
    for i, (token, logprob) in enumerate(zip(out["tokens"], out["logprobs"])):
        want = torch.log_softmax(logits[i], -1)[token].item()
        other = torch.log_softmax(uncapped[i], -1)[token].item()
        assert abs(logprob - want) < 1e-5, (i, logprob, want)
        errors.append((abs(logprob - want), abs(logprob - other)))
    assert sum(e for e, _ in errors) * 100 < sum(o for _, o in errors), errors
