"""Speculative decoding: guesses change how many tokens a step yields, never which tokens.

Greedy and seeded requests must give the same tokens (and logprobs) with speculation on and off, alone and in
mixed batches, under preemption and with prefix caching; every stop rule must hold with several tokens per step;
unseeded sampling must keep the target's distribution even when every guess is bad.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_engine import check_parity, model_dir_for, random_prompts, run, VARIANTS
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.proposers import NgramProposer
from trellm_backend.engine.request import SamplingParams

REPETITIVE = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
              "The quick brown fox jumps over the lazy dog. The quick brown fox",
              "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time there was a cat. Once upon a time"]


def engine(path, tokenizer=None, method="ngram", **kw):
    kw.setdefault("speculative_disable_batch_size", 64)
    return LLMEngine(EngineConfig(path, speculative_method=method, **kw), tokenizer)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_tokens_equal_with_and_without_speculation(default_model_path, tokenizer, k):
    """A mixed batch: prompts arriving at different steps (prefill chunks beside verified decodes), one request
    with speculation turned off, a tight budget."""
    prompts = [tokenizer(t).input_ids for t in REPETITIVE] + random_prompts(3, 4096, [90, 5])
    arrivals = [0, 0, 1, 3, 4, 6]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative_decoding=False)
    kw = dict(max_num_batched_tokens=48, long_prefill_token_threshold=32)
    base = run(engine(default_model_path, method="none", **kw), prompts, greedy, arrivals)
    eng = engine(default_model_path, num_speculative_tokens=k, **kw)
    got = run(eng, prompts, greedy, arrivals, params_of=lambda i: off if i == 5 else greedy)
    assert [g["tokens"] for g in got] == [b["tokens"] for b in base]
    s = eng.stats()
    assert s.spec_num_drafts > 0 and 0 < s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    assert len(s.spec_accepted_per_pos) == k and sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens


def test_greedy_equal_under_preemption_and_prefix_caching(default_model_path, tokenizer):
    """A KV pool too small for the batch (requests are preempted and recomputed) and shared prompt prefixes
    (cache hits): rejected guesses' blocks must go back, and no cached block may hold an unverified guess."""
    shared = tokenizer(REPETITIVE[1] * 3).input_ids
    prompts = [shared + tokenizer(f" number {i}. The quick").input_ids for i in range(6)]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=16, num_kv_blocks=14, max_num_batched_tokens=64)
    base = run(engine(default_model_path, method="none", **kw), prompts, greedy, [0, 0, 0, 2, 2, 9])
    eng = engine(default_model_path, num_speculative_tokens=5, **kw)
    got = run(eng, prompts, greedy, [0, 0, 0, 2, 2, 9])
    assert [g["tokens"] for g in got] == [b["tokens"] for b in base]
    assert eng.num_preemptions > 0 and eng.stats().prefix_cache_hits > 0
    assert eng.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity_models_match_transformers_with_speculation(tmp_path_factory, name):
    root = str(tmp_path_factory.mktemp("hf"))
    eng = check_parity(model_dir_for(root, name), 320, max_num_batched_tokens=32, speculative_method="ngram",
                       num_speculative_tokens=3, prompt_lookup_min=1, speculative_disable_batch_size=64)
    assert eng.stats().spec_num_draft_tokens > 0


def test_seeded_sampling_and_logprobs_equal_with_and_without_speculation(default_model_path, tokenizer):
    prompts = [tokenizer(t).input_ids for t in REPETITIVE]

    def params(i):
        return SamplingParams(max_tokens=32, temperature=0.3, top_p=0.95, seed=100 + i, logprobs=2,
                              repetition_penalty=1.02, ignore_eos=True)
    base = run(engine(default_model_path, method="none"), prompts, None, params_of=params)
    eng = engine(default_model_path, num_speculative_tokens=4, prompt_lookup_min=1)
    got = run(eng, prompts, None, params_of=params)
    for b, g in zip(base, got):
        assert g["tokens"] == b["tokens"]
        assert [(r, [t for t, _ in top]) for r, top in g["top"]] == [(r, [t for t, _ in top]) for r, top in b["top"]]
        assert g["logprobs"] == pytest.approx(b["logprobs"], abs=1e-3)
    assert eng.stats().spec_num_accepted_tokens > 0


def test_stop_rules_hold_with_several_tokens_per_step(default_model_path, tokenizer):
    """Stop strings, stop ids, min_tokens and max_tokens end the request at the same token as without guesses:
    tokens a step accepted past the stop are dropped."""
    prompts = [tokenizer(t).input_ids for t in REPETITIVE]
    probe = run(engine(default_model_path, tokenizer, method="none"), prompts,
                SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_id = probe[0]["tokens"][9]          # a token the first answer makes mid-way
    stop_text = probe[1]["text"][12:16]      # text the second answer makes mid-way
    cases = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, stop=[stop_text], ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id], min_tokens=12, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    reasons = []
    for params in cases:
        base = run(engine(default_model_path, tokenizer, method="none"), prompts, params)
        reasons.append([b["reason"] for b in base])
        got = run(engine(default_model_path, tokenizer, num_speculative_tokens=6), prompts, params)
        assert [(g["tokens"], g["text"], g["reason"]) for g in got] == \
            [(b["tokens"], b["text"], b["reason"]) for b in base], params
        assert all(len(g["tokens"]) <= params.max_tokens for g in got)
    assert reasons[0][0] == reasons[1][1] == "stop" and reasons[3] == ["length"] * 4, reasons


class WrongGuesses:
    """A proposer whose guesses are bad on purpose: always the same token, at every position."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, seqs):
        return [[self.token] * s.num_tokens for s in seqs]

    def forget(self, request_id):
        pass


class WrongThenRight:
    """Guesses wrong for the first `wrong_calls` steps, then the true continuation (known from a run without
    guesses)."""

    def __init__(self, answer: list[int], wrong_calls: int):
        self.answer, self.wrong_calls, self.calls = answer, wrong_calls, 0

    def propose(self, seqs):
        self.calls += 1
        out = []
        for s in seqs:
            n, k = len(s.token_ids), s.num_tokens
            out.append([0] * k if self.calls <= self.wrong_calls else self.answer[n:n + k])
        return out

    def forget(self, request_id):
        pass


def test_a_request_whose_guesses_fail_stops_guessing_and_resumes_when_they_pay(default_model_path, tokenizer):
    """Failed guesses cost a CPU step nearly what extra sequences do: after a few failures a request guesses one
    token every few steps only, and full guesses come back once a probe is right."""
    from trellm_backend.engine import scheduler
    prompt = tokenizer(REPETITIVE[3]).input_ids
    greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    (answer,) = engine(default_model_path, method="none").generate([prompt], greedy)
    eng = engine(default_model_path, num_speculative_tokens=4)
    eng.runner.proposer = WrongThenRight(prompt + answer, wrong_calls=40)
    assert eng.generate([prompt], greedy) == [answer]
    s = eng.stats()
    # 40 failing steps: full guesses only until the acceptance decays under the threshold, then probes of one.
    failing = 4 * math.ceil(math.log(scheduler.MIN_ACCEPTANCE) / math.log(scheduler.ACCEPTANCE_DECAY))
    wrong = s.spec_num_draft_tokens - s.spec_num_accepted_tokens
    assert wrong <= failing + 40 // scheduler.PROBE_EVERY, (wrong, failing)
    assert s.spec_num_accepted_tokens >= 40, "guessing must resume in full once the guesses are right"


def test_sampling_keeps_the_target_distribution_with_bad_guesses(default_model_path, tokenizer):
    """Unseeded draws of the second and third tokens (both decided by verification: the first comes from the
    prompt's prefill) against the target's exact distribution, computed by transformers. The guess is a token the
    target gives some probability, so both acceptance and the resample after a rejection are exercised; an engine
    that kept unverified guesses, or resampled without removing the rejected token, fails the chi-square bound."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    prompt = tokenizer("The quick brown").input_ids
    top_k = 4

    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        p = torch.zeros_like(logits)
        v, i = logits.topk(top_k)
        p[i] = torch.softmax(v, -1)
        return p

    p1 = probs(prompt)
    exact: dict[tuple[int, int], float] = {}
    second = torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [t1])
        second += p1[t1] * p2
        for t2 in p2.nonzero().flatten().tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    # Guess the second most likely second token: accepted sometimes, rejected more often.
    guess = int(second.topk(2).indices[1])

    n = 3000
    eng = engine(default_model_path, num_speculative_tokens=2, max_num_seqs=64, max_num_batched_tokens=4096)
    eng.runner.proposer = WrongGuesses(guess)
    outs = eng.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k))
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        counts[(o[0], o[1])] = counts.get((o[0], o[1]), 0) + 1
    assert set(counts) <= set(exact), "a token outside the target's top-k was produced"
    # Chi-square over the cells expected at least 5 times, the rest pooled.
    big = [c for c, p in exact.items() if p * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    expected = [exact[c] * n for c in big] + [n - sum(exact[c] * n for c in big)]
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    # p < 0.001 bound: dof + 3.3 * sqrt(2 dof) approximates the 99.9th percentile for these sizes.
    assert chi2 < dof + 3.3 * math.sqrt(2 * dof) + 5, (chi2, dof)
    s = eng.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, "the bad guess is sometimes accepted, mostly not"


def test_ngram_proposer_guesses_from_the_latest_match_and_repeats_loops():
    from trellm_backend.engine.proposers import ProposalInput
    p = NgramProposer(1, 3)

    def seq(rid, tokens, k):
        return ProposalInput(rid, tokens, len(tokens) - 1, [], k)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    assert p.propose([seq("r", tokens, 3)]) == [[1, 2, 5]], "the latest earlier occurrence of [5, 6, 7] continues 1, 2, 5"
    tokens += [1, 2, 5, 6]
    assert p.propose([seq("r", tokens, 2)]) == [[7, 1]], "the index grew with the new tokens"
    loop = [3, 4, 3, 4, 3]
    assert p.propose([seq("l", loop, 5)]) == [[4, 3, 4, 3, 4]], "a match near the end is read as a repeating span"
    assert p.propose([seq("l", loop, 0)]) == [[]]
    p.forget("l")
    assert "l" not in p.index
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


def make_disagreeing_draft(model_dir: str, out_dir: str) -> str:
    """The target's own folder with a zeroed LM head: every logit is 0, so the draft always guesses token 0
    (<unk>), which the target never makes: every guess is rejected."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, out_dir)
    state = load_file(f"{out_dir}/model.safetensors")
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    save_file(state, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    return out_dir


def test_draft_model_that_is_the_target_has_every_guess_accepted(default_model_path, tokenizer):
    """With the target as its own draft every guess is right: the draft's K/V (in the target's blocks) must be in
    step through prefill chunks, the catch-up after a fully accepted step, and a tight budget."""
    prompts = [tokenizer(t).input_ids for t in REPETITIVE] + random_prompts(3, 4096, [90])
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=48, long_prefill_token_threshold=32, block_size=16)
    base = run(engine(default_model_path, method="none", **kw), prompts, greedy, [0, 0, 1, 3, 4])
    eng = engine(default_model_path, method="draft", draft_model_path=default_model_path,
                 num_speculative_tokens=4, **kw)
    got = run(eng, prompts, greedy, [0, 0, 1, 3, 4])
    assert [g["tokens"] for g in got] == [b["tokens"] for b in base]
    s = eng.stats()
    assert s.spec_num_draft_tokens > 50 and s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    # The pool is shared by both models' K/V: the same budget holds half the blocks for a same-size draft.
    assert eng.kv.num_blocks * 2 == engine(default_model_path, method="none", **kw).kv.num_blocks


def test_draft_model_that_always_disagrees_changes_nothing_but_speed(default_model_path, tokenizer, tmp_path):
    draft = make_disagreeing_draft(default_model_path, str(tmp_path / "draft"))
    prompts = [tokenizer(t).input_ids for t in REPETITIVE]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = run(engine(default_model_path, method="none"), prompts, greedy)
    eng = engine(default_model_path, method="draft", draft_model_path=draft, num_speculative_tokens=3)
    got = run(eng, prompts, greedy)
    assert [g["tokens"] for g in got] == [b["tokens"] for b in base]
    s = eng.stats()
    assert s.spec_num_draft_tokens > 0 and s.spec_num_accepted_tokens == 0


def test_draft_model_under_preemption_and_prefix_caching(default_model_path, tokenizer):
    shared = tokenizer(REPETITIVE[1] * 3).input_ids
    prompts = [shared + tokenizer(f" number {i}. The quick").input_ids for i in range(6)]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=16, num_kv_blocks=14, max_num_batched_tokens=64)
    base = run(engine(default_model_path, method="none", **kw), prompts, greedy, [0, 0, 0, 2, 2, 9])
    eng = engine(default_model_path, method="draft", draft_model_path=default_model_path, num_speculative_tokens=3,
                 **kw)
    got = run(eng, prompts, greedy, [0, 0, 0, 2, 2, 9])
    assert [g["tokens"] for g in got] == [b["tokens"] for b in base]
    s = eng.stats()
    assert eng.num_preemptions > 0 and s.prefix_cache_hits > 0
    # A guess can only be wrong where a cached block's draft K/V missed one position (module docstring of draft.py).
    assert s.spec_num_accepted_tokens >= 0.9 * s.spec_num_draft_tokens > 0


def test_draft_model_errors_name_the_setting(default_model_path, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model_path"):
        EngineConfig(default_model_path, speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_method='eagle' is not one of none, ngram, draft"):
        EngineConfig(default_model_path, speculative_method="eagle")
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 must be in \[1, 15\]"):
        EngineConfig(default_model_path, speculative_method="ngram", num_speculative_tokens=0)
    other = model_dir_for(str(tmp_path), "llama3-rope-bias")   # vocabulary of 320
    with pytest.raises(ValueError, match="vocab_size=320, but the target model's is 4096"):
        engine(default_model_path, method="draft", draft_model_path=other)


@pytest.mark.server
def test_served_streams_are_the_same_with_speculation_on_and_off(default_model_path, tokenizer, tmp_path):
    """Two entries of the default model added with the command (n-gram lookup; a draft model, the target itself),
    streamed through the ensemble: the text the engine makes without speculation, several tokens arriving in some
    responses, and the accepted-token counters on the metrics endpoint."""
    import re
    import subprocess
    import sys
    import urllib.request
    from conftest import free_ports
    from trellm_backend.tools.launch import TritonServer
    from trellm_client.client import LLMClient
    plain = run(engine(default_model_path, tokenizer, method="none"), [tokenizer(p).input_ids for p in REPETITIVE],
                SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    want = [g["text"] for g in plain]
    repo = tmp_path / "repository"
    repo.mkdir()
    models = {"lookup": ["--speculative-method=ngram", "--num-speculative-tokens=5"],
              "drafted": ["--speculative-method=draft", f"--draft-model-path={default_model_path}"]}
    for name, flags in models.items():
        r = subprocess.run([sys.executable, "-m", "trellm_backend.tools.add_model", name, default_model_path,
                            f"--repository={repo}", f"--kv-cache-bytes={32 << 20}", *flags],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    with TritonServer(str(repo), *free_ports(3), log_path=str(tmp_path / "server.log"),
                      model_control_mode="explicit", load_models=list(models)) as server:
        for name in models:
            with LLMClient(server.grpc_url, model=name) as c:
                chunks = [list(c.stream_chunks(p, stream=True, max_tokens=40, min_tokens=40,
                                               return_num_output_tokens=True)) for p in REPETITIVE]
            assert ["".join(ch.text for ch in chunk) for chunk in chunks] == want, name
            counts = [[ch.num_output_tokens for ch in chunk if ch.num_output_tokens] for chunk in chunks]
            assert max(b - a for n in counts for a, b in zip([0] + n, n)) > 1, "no response carried several tokens"
        page = urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=5).read().decode()
        accepted = {m: float(v) for m, v in re.findall(
            r'vllm:spec_decode_num_accepted_tokens_total\{model="(\w+)_llm"[^}]*\} (\S+)', page)}
        assert accepted["lookup"] > 0 and accepted["drafted"] > 0, accepted


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_abort_between_verified_steps_returns_every_block(default_model_path, tokenizer, method):
    eng = engine(default_model_path, method=method, draft_model_path=default_model_path, num_speculative_tokens=4,
                 block_size=16)
    prompts = [tokenizer(t).input_ids for t in REPETITIVE]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        eng.step()
    assert eng.stats().spec_num_drafts > 0 and eng.kv_blocks_used() > 0
    for i in range(len(prompts)):
        out = eng.abort(str(i))
        assert out.finished and out.finish_reason == "abort"
    assert eng.kv_blocks_used() == 0 and not eng.has_unfinished()
    assert eng.step() == []     # the next step tells the runner
    proposer = eng.runner.proposer
    assert not (proposer.index if method == "ngram" else proposer.computed), "the proposer must forget them"
    assert not eng.runner.token_ids, "the runner must drop their records"
