"""Tensor parallelism (backend/distributed/, models/sharding.py): a model split across two processes gives
transformers' greedy tokens for every dense and mixture-of-experts family; each rank holds its share of the weights;
what does not split yet is refused by name. Split either way (tensor parallel, or a pipeline of two stages:
test_pipeline_parallel.py has the rest of its tests), a model gives the tokens of one process with quantized weights
and caches, prefix caching, speculation and LoRA adapters, and a worker that dies or stops fails the step within the
deadline, naming it, and leaves no process."""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import pytest

from hf_models import LORAS, hf_greedy, make_lora, make_variant, model_dir_for, random_prompts
from test_engine import ARRIVALS, GREEDY, LENGTHS, run, run_staggered
from test_lora import greedy as lora_greedy
from test_structured_output import REGEX, SCHEMA, check
from trellm_backend.distributed.group import GroupFailure
from trellm_backend.engine import runner
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams
from trellm_backend.engine.structured_output import Guide
from trellm_backend.models.config import ModelConfigError

SMALL = dict(max_num_batched_tokens=48, block_size=16, kv_cache_bytes=8 << 20)


def engine(folder: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=folder, **{**SMALL, **kwargs}))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Larger initial weights where the default ones give a greedy answer that a wrong split would not change (one
# token over and over): with them a bias added on both ranks, or a rank's K/V rows taken from another head, changes it.
SHARPER = {"llama3-rope-bias": {"initializer_range": 0.2}, "qwen2-bias-gqa4": {"initializer_range": 0.2}}


# Split two ways, each a different split: K/V heads fewer than ranks (shared), biases on o and down (added once),
# merged q/k/v and gate/up with longrope (Phi-3), q/k norms and head_dim 8, Gemma's norms, caps and windows, tied
# embeddings; experts (Mixtral's w1/w3/w2, Qwen's), Qwen2-MoE's shared expert and its dense layer.
TWO_RANKS = ["llama-gqa4-hd128", "llama3-rope-bias", "phi3-longrope", "qwen3-qknorm-hd8", "gemma2-softcap",
             "gemma3-text", "qwen2-bias-gqa4", "mistral-sliding", "mixtral-moe8", "qwen3-moe8-qknorm",
             "qwen2-moe-shared"]
# Two stages: tied embeddings (the last stage holds them for its LM head), Gemma's scaled embeddings and capped
# logits, Phi-3's longrope flags, a mixture of experts with a dense layer, sliding windows, biases.
TWO_STAGES = ["llama-gqa4-hd128", "gemma3-text", "phi3-longrope", "qwen2-moe-shared", "mistral-sliding",
              "llama3-rope-bias"]


@pytest.mark.parametrize("split, name", [("tensor_parallel_size", n) for n in TWO_RANKS]
                         + [("pipeline_parallel_size", n) for n in TWO_STAGES])
def test_a_split_model_gives_transformers_tokens(tmp_path, monkeypatch, split, name):
    monkeypatch.setattr(runner, "MIN_MICRO_BATCH_TOKENS", 1)   # a pipeline's steps of several chunks in micro-batches
    folder = make_variant(name, str(tmp_path / name), changes=SHARPER.get(name))
    prompts = random_prompts(0, 320, LENGTHS)
    eng = engine(folder, **{split: 2})
    try:
        got = run_staggered(eng, prompts, ARRIVALS, GREEDY)
    finally:
        eng.close()
    assert got == hf_greedy(folder, prompts, GREEDY.max_tokens)


def test_a_vocabulary_that_does_not_split_evenly(tmp_path):
    folder = make_variant("qwen2-bias-gqa4", str(tmp_path / "m"), vocab_size=321)   # 161 + 160 rows, tied
    prompts = random_prompts(1, 321, [5, 30])
    prompts[0][-1] = 320   # the last row, held by rank 1 past its padding
    eng = engine(folder, tensor_parallel_size=2)
    try:
        got = run_staggered(eng, prompts, [0, 0], GREEDY)
    finally:
        eng.close()
    assert got == hf_greedy(folder, prompts, GREEDY.max_tokens)


SPLITS = ["tensor_parallel_size", "pipeline_parallel_size"]


# float32: a tensor-parallel split changes only the order of float32 sums. In bfloat16 it also rounds each rank's
# partial sums to bfloat16 before adding them, which moved a near-tie of the sharp qwen2 variant (a pipeline changes
# no arithmetic: test_pipeline_parallel.py runs it in bfloat16). INT8 weights take each o and down row's scale over
# the whole row, and INT4's groups of 64 inputs fall within a rank's half, so both quantize as one process does. The
# quantized cases run the variant whose K/V head both ranks share.
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name, settings", [
    ("llama-gqa4-hd128", dict(dtype="float32", quantization="int8", kv_cache_dtype="int8")),
    ("qwen2-bias-gqa4", dict(enable_prefix_caching=True, speculative_method="ngram", num_speculative_tokens=3)),
    ("llama-gqa4-hd128", dict(quantization="int4", dtype="float32")),
])
def test_a_split_model_gives_one_process_tokens(tmp_path, name, settings, split):
    folder = make_variant(name, str(tmp_path / name), changes=SHARPER.get(name))
    # repeated prompts: the prefix cache and prompt lookup have something to find
    prompts = random_prompts(2, 320, LENGTHS)
    prompts += [p + p[:10] for p in prompts[3:5]]
    out = {}
    for n in (1, 2):
        eng = engine(folder, **{split: n}, **settings)
        try:
            out[n] = run_staggered(eng, prompts, ARRIVALS + [12, 12], GREEDY)
        finally:
            eng.close()
    assert out[2] == out[1]


def test_each_rank_holds_its_share_of_the_weights(tmp_path):
    folder = model_dir_for(str(tmp_path), "llama3-rope-bias")
    one = engine(folder)
    two = engine(folder, tensor_parallel_size=2)
    try:
        whole = one.runner.model.weight_bytes()
        ranks = [two.runner.model.weight_bytes()] + two.runner.workers.start_sizes
    finally:
        two.close()
    assert len(ranks) == 2
    assert all(b <= whole / 2 * 1.1 for b in ranks), (ranks, whole)


@pytest.mark.parametrize("name, settings, says", [
    ("three-experts-rows", {}, "must divide moe_intermediate_size \\(each expert's\\)=39"),
    ("qwen2-bias-gqa4", dict(tensor_parallel_size=3), "3 processes on this host, which lets this server use"),
    ("three-heads", {}, "must divide num_attention_heads=3"),
    ("qwen2-bias-gqa4", dict(speculative_method="draft", draft_model_path="x"), "draft models"),
])
def test_what_does_not_split_is_refused_by_name(tmp_path, name, settings, says):
    odd = {"three-heads": ("llama3-rope-bias", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)),
           "three-experts-rows": ("qwen3-moe8-qknorm", dict(moe_intermediate_size=39))}
    folder = make_variant(*odd[name][:1], str(tmp_path / name), changes=odd[name][1]) if name in odd else \
        model_dir_for(str(tmp_path), name)
    with pytest.raises((ValueError, ModelConfigError), match=says):
        engine(folder, **{"tensor_parallel_size": 2, **settings})


@pytest.mark.parametrize("split, kind", [("tensor_parallel_size", "tensor-parallel rank"),
                                         ("pipeline_parallel_size", "pipeline stage")])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_worker_fails_the_step_and_names_it(tmp_path, how, split, kind):
    folder = model_dir_for(str(tmp_path), "qwen2-bias-gqa4")
    eng = engine(folder, **{split: 2}, parallel_timeout_s=2.0)
    lost = []
    eng.on_worker_lost(lost.append)
    [pid] = eng.runner.workers.pids()
    try:
        eng.add_request("a", random_prompts(3, 320, [20])[0], replace(GREEDY, max_tokens=200))
        eng.step()
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(GroupFailure) as e:
            for _ in range(200):
                eng.step()
        assert time.monotonic() - start < 4.0
        assert f"{kind} 1 (pid {pid}) " + ("was killed by signal 9" if how == "kill" else "is stopped") in str(e.value)
        with pytest.raises(GroupFailure):   # and every later step
            eng.step()
        deadline = time.monotonic() + 2
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lost) == 1 and f"pid {pid}" in lost[0]
    finally:
        eng.close()
    assert not alive(pid)


def test_a_worker_that_dies_between_steps_is_seen(tmp_path):
    folder = model_dir_for(str(tmp_path), "qwen2-bias-gqa4")
    eng = engine(folder, tensor_parallel_size=2)
    lost = []
    eng.on_worker_lost(lost.append)
    [pid] = eng.runner.workers.pids()
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and "waiting for a step" in lost[0]
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(GroupFailure, match="killed by signal 9"):
            eng.step()
    finally:
        eng.close()


@pytest.mark.parametrize("split", SPLITS)
def test_lora_adapters_split_with_the_model(default_model_path, tmp_path, split):
    """Every adapter, mixed in one batch with the base, gives one process's tokens; an adapter replaced under its
    name while serving is read again by the workers."""
    adapters = {n: make_lora(default_model_path, n, str(tmp_path / n)) for n in LORAS}
    prompts = random_prompts(3, 4096, [5, 17, 40])
    names = [None, *LORAS]
    out = {}
    for n in (1, 2):
        eng = LLMEngine(EngineConfig(default_model_path, lora_adapters=json.dumps(adapters), max_num_batched_tokens=64,
                                     **{split: n}))
        try:
            out[n] = lora_greedy(eng, prompts, names, 12)
            eng.loras.apply({"attn-r8": adapters["all-r16"]}, [])
            out[n, "replaced"] = lora_greedy(eng, prompts, ["attn-r8"], 12)
        finally:
            eng.close()
    assert out[2] == out[1]
    assert out[2, "replaced"] == out[1][-len(prompts):], "attn-r8 now reads all-r16's folder"


@pytest.mark.parametrize("split", SPLITS)
def test_structured_output_on_a_split_model(default_model_path, tokenizer, split):
    """Guides mask rank 0's logits: a split model's guided answers, greedy and sampled, are one process's."""
    prompts = [tokenizer(p)["input_ids"] for p in ["Hello", "The answer is", "A list:"]]
    guides = [Guide("regex", REGEX), Guide("json_schema", json.dumps(SCHEMA))]
    out = {}
    for n in (1, 2):
        eng = LLMEngine(EngineConfig(default_model_path, **{split: n}), tokenizer)
        try:
            out[n] = run(eng, prompts * 2, None, params_of=lambda i: SamplingParams(
                max_tokens=200, temperature=i % 2, seed=i, guide=guides[i % 2]))
        finally:
            eng.close()
    assert [(o["tokens"], o["reason"]) for o in out[2]] == [(o["tokens"], o["reason"]) for o in out[1]]
    for i, o in enumerate(out[2]):
        check(guides[i % 2], o["text"])


def test_messages_carry_arrays_and_never_run_what_a_sender_wrote():
    """The sockets carry JSON and raw arrays (distributed/messages.py): a step's plan goes through whole, and a
    pickle, which unpickling would run, is refused as a frame that is not ours."""
    import pickle
    import numpy as np
    from trellm_backend.distributed.messages import BadMessage, decode, encode
    msg = {"ids": np.arange(5, dtype=np.int32), "rows": slice(2, 4), "key": ("a", "/x", 7), "none": None,
           "f": np.ones((2, 3), dtype=np.float32), "n": [1, 2.5, "s", True]}
    back = decode(encode(msg))
    assert back["key"] == ("a", "/x", 7) and back["rows"] == slice(2, 4) and back["n"] == [1, 2.5, "s", True]
    assert back["ids"].tolist() == list(range(5)) and back["f"].shape == (2, 3) and back["none"] is None

    class Runs:
        def __reduce__(self):
            return (os.system, ("touch /tmp/should-not-exist",))
    with pytest.raises(BadMessage):
        decode(pickle.dumps(Runs()))
    with pytest.raises(BadMessage):   # an object array would unpickle its items
        decode(encode({"a": np.zeros(2)}).replace(b"<f8", b"|O8"))
