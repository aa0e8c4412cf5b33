"""Each sampling control changes what is drawn the way it should: on the sampler with logits whose answer is
known, and on the engine with the default model."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hf_models import random_prompts
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import Request, SamplingParams, parse_logit_bias
from trellm_backend.engine.sampler import SamplingRow, apply_bans, apply_logit_bias, apply_penalties, sample
from trellm_backend.engine.scheduler import sampling_row

V = 12


def req(prompt, output=(), **params) -> SamplingRow:
    """The row the scheduler plans for a request with this prompt and output so far."""
    r = Request("r", list(prompt), SamplingParams(**params), max_len=1000)
    r.token_ids += list(output)
    return sampling_row(r)


def draws(logits_row, n=400, **params) -> set[int]:
    """The set of tokens drawn in n rows of the same logits (unseeded, one batch)."""
    rows = [req([0], **params) for _ in range(n)]
    return {s.token_id for s in sample(torch.tensor([logits_row] * n), rows)}


LOGITS = [math.log(p) for p in (0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.004, 0.003, 0.002, 0.0005, 0.0005)]


def test_top_k_top_p_min_p_draw_only_from_the_sets_they_allow():
    assert draws(LOGITS, top_k=3) == {0, 1, 2}
    assert draws(LOGITS, top_p=0.7) == {0, 1, 2}          # 0.4 + 0.25 < 0.7: the third token completes the set
    assert draws(LOGITS, min_p=0.3) == {0, 1, 2}          # p >= 0.3 * 0.4 = 0.12
    assert draws(LOGITS, min_p=0.3, top_k=2) == {0, 1}
    assert len(draws(LOGITS, n=2000)) > 6                 # no control: the tail is reachable


def test_penalties_against_counted_repeats():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])
    r = req(prompt=[3], output=[0, 0, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, [r])[0]
    # token 0: twice in the output: 2/2 - 0.5*2 - 0.25; token 1: once: -2*2 - 0.5 - 0.25; token 3: prompt only
    # (repetition penalty only): 0.5/2; token 2: never seen, unchanged.
    assert got[:4].tolist() == pytest.approx([1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 1.0, 0.25])
    assert torch.equal(got[4:], logits[0, 4:])
    plain = req(prompt=[3], output=[0, 0, 1])
    assert torch.equal(apply_penalties(logits, [plain]), logits)


def test_penalties_apply_per_row():
    logits = torch.zeros(2, V)
    rows = [req([1], [5, 5, 5], frequency_penalty=1.0), req([1], [5, 5, 5])]
    got = apply_penalties(logits, rows)
    assert got[0, 5] == -3.0 and got[1, 5] == 0.0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0       # EOS is by far the most likely
    early = req([1], [4], min_tokens=2, stop_token_ids=[7], temperature=0.0)
    done = req([1], [4, 4], min_tokens=2, stop_token_ids=[7], temperature=0.0)
    got = apply_bans(logits, [early, done], eos_token_ids=[2, 3])
    assert got[0, [2, 3, 7]].tolist() == [float("-inf")] * 3 and got[1, 2] == 10.0
    assert [s.token_id for s in sample(logits, [early, done], eos_token_ids=[2, 3])] == [0, 2]


def test_bad_words_ban_the_last_token_after_their_prefix():
    logits = torch.zeros(3, V)
    logits[:, 6] = 5.0
    words = [[4, 6], [9]]
    rows = [req([1], [4], bad_words_ids=words), req([1], [5], bad_words_ids=words), req([4], bad_words_ids=words)]
    got = apply_bans(logits, rows)
    assert got[0, 6] == float("-inf") and got[1, 6] == 5.0 and got[2, 6] == float("-inf")
    assert (got[:, 9] == float("-inf")).all()


def test_bad_word_bans_equal_a_comparison_per_word():
    """The lookup table the sampler uses bans exactly what comparing the sequence's tail with every word bans."""
    import random
    rng = random.Random(0)
    for _ in range(200):
        words = [[rng.randrange(V) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 12))]
        tokens = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
        r = req(tokens[:1], tokens[1:], bad_words_ids=words)
        expected = {w[-1] for w in words if len(w) == 1 or tokens[-(len(w) - 1):] == w[:-1]}
        got = apply_bans(torch.zeros(1, V), [r])
        assert {i for i in range(V) if got[0, i] == float("-inf")} == expected, (words, tokens)


@pytest.mark.parametrize("params, message", [
    (dict(stop=["x"] * 65), "stop_words / stop has 65 entries; at most 64 are allowed"),
    (dict(bad_words=["x"] * 1025), "bad_words has 1025 entries; at most 1024 are allowed"),
    (dict(bad_words=["ok", "y" * 257]), "bad_words has an entry of 257 characters; at most 256 are allowed"),
    (dict(stop_token_ids=[1] * 257), "stop_token_ids has 257 entries; at most 256 are allowed"),
])
def test_word_lists_are_bounded_by_name(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params).validate()
    SamplingParams(stop=["x"] * 64, bad_words=["y" * 256] * 1024, stop_token_ids=[1] * 256).validate()


def test_logit_bias_is_added_to_its_own_row_and_steers_the_draw():
    logits = torch.zeros(2, V)
    got = apply_logit_bias(logits, [req([1], logit_bias={3: 5.0, 4: -100}), req([1])])
    assert got[0, 3] == 5 and got[0, 4] == -100 and got[0].sum() == -95 and torch.equal(got[1], logits[1])
    assert sample(torch.tensor([LOGITS]), [req([0], temperature=0.0, logit_bias={11: 100})])[0].token_id == 11
    assert draws(LOGITS, logit_bias={0: -100, 1: -100}).isdisjoint({0, 1})
    for bias, message in (({1: 100.5}, r"\[-100, 100\], got 100.5"), ({-1: 1}, "integers >= 0"),
                          (dict.fromkeys(range(1025), 1), "1025 entries; at most 1024")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=bias).validate()
    assert parse_logit_bias('{"0": 1, "4095": -2.5}') == {0: 1, 4095: -2.5}
    for key in ("05", "+5", " 5", "5.0", "1_0", "-0", "\u0665"):     # two spellings must never name one token
        with pytest.raises(ValueError, match="written as integers"):
            parse_logit_bias({key: 1})


def test_logprobs_are_of_the_processed_distribution():
    logits = torch.tensor([LOGITS, LOGITS])
    rows = [req([0], temperature=0.0, logprobs=3, top_k=2), req([0], temperature=0.0)]
    a, b = sample(logits, rows)
    expected = torch.log_softmax(torch.tensor(LOGITS), -1)
    assert a.token_id == 0 and a.rank == 1 and a.logprob == pytest.approx(expected[0].item(), abs=1e-5)
    assert [t for t, _ in a.top] == [0, 1, 2] and b.logprob is None and b.top is None
    hot = sample(torch.tensor([LOGITS]), [req([0], temperature=2.0, top_k=2, seed=1, logprobs=1)])[0]
    # temperature 2 and top-k 2: the token came from softmax(LOGITS[:2] / 2)
    pair = torch.log_softmax(torch.tensor(LOGITS[:2]) / 2, -1)
    assert hot.logprob == pytest.approx(pair[hot.token_id].item(), abs=1e-5) and len(hot.top) == 1


# -- the engine, with the default model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(default_model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path)
    return LLMEngine(EngineConfig(model_path=default_model_path, kv_cache_bytes=16 << 20), tokenizer=tok)


def run(engine, prompt, params, rid="x"):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_every_control_keeps_seeded_output_independent_of_batch_mates(engine):
    p = random_prompts(5, 4096, [9, 21, 4])
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=5,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, min_tokens=4,
                            bad_words=["the"], ignore_eos=True, logprobs=2)
    alone = [o.new_token_ids[0] for o in run(engine, p[0], seeded)]
    engine.add_request("m1", p[1], SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=2.0))
    engine.add_request("m2", p[2], SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=1.0))
    engine.add_request("m3", p[2], replace(seeded, seed=7, max_tokens=14))      # a seeded mate: its own generator
    assert [o.new_token_ids[0] for o in run(engine, p[0], seeded, "y")] == alone
    assert [o.new_token_ids[0] for o in run(engine, p[0], replace(seeded, seed=6), "z")] != alone, "seed ignored"


def test_logit_bias_on_the_model_moves_greedy_tokens_as_transformers_logits_say(engine, default_model_path):
    """-100 on the greedy token makes the first token the runner-up of transformers' logits; +100 on a token makes
    every token that one."""
    from transformers import AutoModelForCausalLM
    prompt = random_prompts(8, 4096, [12])[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], greedy)[0][0]
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    with torch.no_grad():
        runner_up = model(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1].item()
    assert engine.generate([prompt], replace(greedy, logit_bias={first: -100}))[0][0] == runner_up
    assert engine.generate([prompt], replace(greedy, logit_bias={17: 100}))[0] == [17] * 4
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 4096\), got \[4096\]"):
        engine.make_request("v", prompt, SamplingParams(logit_bias={4096: 1}))


def test_min_tokens_and_stop_token_ids(engine):
    prompt = random_prompts(6, 4096, [10])[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_id = free[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id]))[0] \
        == [stop_id]
    held = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id],
                                                    min_tokens=3))[0]
    assert stop_id not in held[:3] and len(held) >= 3


def test_stop_string_split_across_tokens_ends_the_request_and_never_leaks(engine):
    prompt = engine.tokenizer("The import statement").input_ids
    outs = run(engine, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    full = "".join(o.text for o in outs)
    tokens = [o.new_token_ids[0] for o in outs]
    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [engine.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    i = next(i for i in range(1, len(tokens) - 1) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]):len(pieces[i]) + 2]
    outs = run(engine, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    text = "".join(o.text for o in outs)
    assert text == full[:full.index(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and len(outs) == i + 1
    # Before the final step no delta held any part of the stop string.
    assert stop[:2] not in "".join(o.text for o in outs[:-1])[-2:]


def test_bad_words_are_never_generated(engine):
    prompt = engine.tokenizer("The import statement").input_ids
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = "".join(o.text for o in run(engine, prompt, SamplingParams(**params)))
    word = "self"
    assert word in text, text
    banned = "".join(o.text for o in run(engine, prompt, SamplingParams(**params, bad_words=[word])))
    assert word not in banned and banned != text


def test_bad_words_of_parallel_samples_are_tokenized_once(engine, monkeypatch):
    """n samples of one request share one tokenization of its bad words (it ran per sample, on the thread that
    admits every request); a request with other words gets its own."""
    import trellm_backend.engine.engine as engine_module
    from trellm_backend.engine.output_processor import bad_words_ids
    from trellm_backend.triton.llm import fan_out
    calls = []
    monkeypatch.setattr(engine_module, "bad_words_ids", lambda tok, words: calls.append(words) or
                        bad_words_ids(tok, words))
    words = [f"w{i}" for i in range(300)] + ["self"]
    samples = fan_out(SamplingParams(n=8, max_tokens=4, temperature=1.0, seed=3, bad_words=words))
    reqs = [engine.make_request(f"r#{i}", [1, 2, 3], p) for i, p in enumerate(samples)]
    assert len(calls) == 1
    assert all(r.params.bad_words_ids == reqs[0].params.bad_words_ids for r in reqs)
    assert [1 for ids in reqs[0].params.bad_words_ids if ids == engine.tokenizer("self", add_special_tokens=False).input_ids]
    engine.make_request("other", [1, 2, 3], SamplingParams(max_tokens=4, bad_words=["the", "words"]))
    assert len(calls) == 2 and calls[1] == ["the", "words"]
    engine.make_request("again", [1, 2, 3], SamplingParams(max_tokens=4, bad_words=words))   # still cached
    assert len(calls) == 2


def test_cumulative_logprob_is_the_sum(engine):
    outs = run(engine, [1, 50, 60], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0))
    lps = [o.logprobs[0] for o in outs]
    assert all(lp <= 0 for lp in lps) and outs[-1].cumulative_logprob == pytest.approx(sum(lps), abs=1e-4)
    assert all(o.top_logprobs[0][0] == 1 for o in outs)          # greedy: the sampled token ranks first
    t = outs[-1].times
    assert 0 < t.arrival_ns <= t.first_scheduled_ns <= t.first_token_ns <= t.last_token_ns


def test_stop_strings_need_a_tokenizer(default_model_path):
    bare = LLMEngine(EngineConfig(model_path=default_model_path, num_kv_blocks=4))
    with pytest.raises(ValueError, match="tokenizer"):
        bare.make_request("a", [1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"stop token ids.*\[0, 4096\)"):
        bare.make_request("b", [1, 2], SamplingParams(stop_token_ids=[5000]))
