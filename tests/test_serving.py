"""The llm step's contract without Triton: tensors -> requests, engine outputs -> responses of both contracts."""
import dataclasses
import json

import numpy as np
import pytest

from trellm_backend.engine.request import RequestOutput, SamplingParams
from trellm_backend.triton.llm import (LLM_OUTPUTS, OutputSwitches, PerfMetrics, ResponsePlan, fan_out,
                                      parse_llm_inputs, response_tensors)
from trellm_backend.triton.vllm import vllm_outputs


def arr(v, dtype):
    return np.array([[v]], dtype=dtype)


def test_parse_defaults_to_greedy_and_reads_fields():
    spec = parse_llm_inputs({"input_ids": np.array([[5, 6, 7]], dtype=np.int32)})
    assert spec.prompt_ids == [5, 6, 7] and spec.params.temperature == 0.0 and not spec.stream and spec.echo_prompt
    spec = parse_llm_inputs({"input_ids": np.array([[5, 6, 0]], dtype=np.int32),
                             "input_lengths": arr(2, np.int32), "temperature": arr(0.5, np.float32),
                             "random_seed": arr(9, np.uint64), "stream": arr(True, np.bool_),
                             "exclude_input_in_output": arr(True, np.bool_), "max_tokens": arr(7, np.int32),
                             "end_id": arr(3, np.int32), "return_log_probs": arr(True, np.bool_)})
    assert spec.prompt_ids == [5, 6] and spec.params.temperature == 0.5 and spec.params.seed == 9
    assert spec.stream and not spec.echo_prompt and spec.params.max_tokens == 7
    assert spec.params.stop_token_ids == [3] and spec.params.logprobs == 0


def test_parse_refuses_batches_and_non_integer_ids():
    with pytest.raises(ValueError, match="one prompt per request"):
        parse_llm_inputs({"input_ids": np.zeros((2, 3), dtype=np.int32)})
    with pytest.raises(ValueError, match="input_ids"):
        parse_llm_inputs({"input_ids": np.zeros((1, 3), dtype=np.float32)})


def test_fan_out_gives_each_sample_its_own_seed():
    assert fan_out(SamplingParams(n=1, seed=4)) == [SamplingParams(n=1, seed=4)]
    samples = fan_out(SamplingParams(n=3, seed=10, temperature=0.7))
    assert [s.seed for s in samples] == [10, 11, 12] and all(s.n == 1 and s.temperature == 0.7 for s in samples)
    assert [s.seed for s in fan_out(SamplingParams(n=2))] == [None, None]


# A fake detokenizer: each token id spells one piece; a run's text is its pieces, less the cut characters.
PIECES = {1: "Lists", 2: " are", 9: "", 10: "a", 11: "b", 12: "c", 13: "d", 14: "e", 15: "f", 16: "g"}


def spell(run):
    text = "".join(PIECES[t] for t in run.token_ids)
    return text[:len(text) - run.cut_chars]


def out(tokens, finished=False, logprobs=None, context=(5, 6), cut=0):
    text = "".join(PIECES[t] for t in tokens)
    return RequestOutput("r", tokens, finished, "length" if finished else None, 3, 0, text=text[:len(text) - cut],
                         logprobs=logprobs, top_logprobs=[(1, [(t, -0.5)]) for t in tokens] if logprobs else None,
                         context_ids=list(context), cut_chars=cut)


def test_stream_plan_holds_steps_without_text_and_sends_no_empty_chunk():
    plan = ResponsePlan(stream=True, text_of=spell, echo_prompt_ids=[1])    # echo never applies to streams
    assert plan.on_output(out([9], logprobs=[-1.0], context=[7])) is None         # a token without text: held
    first = plan.on_output(out([10], logprobs=[-2.0], context=[7, 9]))
    assert first.text == "a" and first.run.token_ids == [9, 10] and first.logprobs == [-1.0, -2.0]
    assert first.run.context_ids == [7], "a merged response's text is made after its first output's context"
    assert len(first.top_logprobs) == 2
    last = plan.on_output(out([], finished=True))                                   # the final response may be empty
    assert last.text == "" and last.finished and last.finish_reason == "length" and last.run.context_ids == []


def test_stream_interval_sends_the_first_text_at_once_then_every_n_tokens_and_the_end():
    plan = ResponsePlan(stream=True, stream_interval=3, text_of=spell)
    assert plan.on_output(out([9])) is None                              # no text yet
    assert plan.on_output(out([10])).run.token_ids == [9, 10]                # the first text: at once (TTFT)
    assert plan.on_output(out([11])) is None
    assert plan.on_output(out([12])) is None
    p = plan.on_output(out([13, 14]))                                    # 4 >= 3 tokens gathered
    assert p.text == "bcde" and p.run.token_ids == [11, 12, 13, 14] and not p.finished
    assert plan.on_output(out([15])) is None
    last = plan.on_output(out([16], finished=True, cut=1))               # the end never waits; a stop's cut stays
    assert last.text == "f" and last.run.token_ids == [15, 16] and last.finished and last.run.cut_chars == 1
    every = ResponsePlan(stream=True, text_of=spell)
    assert [every.on_output(out([t])).text for t in (10, 11, 12)] == ["a", "b", "c"]


def test_non_stream_plan_sends_once_with_prompt_tokens_first_when_echoed():
    plan = ResponsePlan(stream=False, text_of=spell, echo_prompt_ids=[1])
    assert plan.on_output(out([2])) is None
    p = plan.on_output(out([10], finished=True))
    assert p.text == "Lists area" and p.run.token_ids == [1, 2, 10] and p.run.context_ids == [] and p.finished
    assert ResponsePlan(stream=False).on_output(out([10], finished=True)).text is None


def test_outputs_of_both_contracts():
    llm = {"text_output": np.array([["añb".encode()]], dtype=np.object_),
           "finish_reason": np.array([[b"stop"]], dtype=np.object_),
           "output_log_probs": np.array([[-0.25, -1.5]], dtype=np.float32),
           "cum_log_probs": np.array([[-1.75]], dtype=np.float32),
           "num_input_tokens": arr(4, np.int32), "num_output_tokens": arr(9, np.int32),
           "sequence_index": arr(1, np.int32),
           "token_ids": np.array([[7, 8]], dtype=np.int32),
           "top_logprobs": np.array([[json.dumps([[1, [[7, -0.25]]], [2, [[9, -1.0]]]]).encode()]],
                                    dtype=np.object_)}
    assert set(vllm_outputs(llm, {})) == {"text_output"}
    v = vllm_outputs(llm, {k: True for k in ("return_finish_reason", "return_cumulative_logprob",
                                             "return_logprobs", "return_num_input_tokens",
                                             "return_num_output_tokens")}, prefix="P:")
    assert v["text_output"][0].decode() == "P:añb" and v["finish_reason"][0] == b"stop"
    assert v["num_output_tokens"].tolist() == [2] and v["num_input_tokens"].dtype == np.uint32
    assert json.loads(v["logprobs"][0]) == [{"7": {"logprob": -0.25, "rank": 1}},
                                            {"9": {"logprob": -1.0, "rank": 1}, "8": {"logprob": -1.5, "rank": 2}}]


def test_kv_block_counts():
    plan = ResponsePlan(stream=False)
    p = plan.on_output(RequestOutput("r", [1], True, "length", 40, 10, num_cached_tokens=32))
    m = PerfMetrics.of(p, 16)     # 50 tokens in 4 blocks, the first 2 from the prefix cache
    assert (m.kv_cache_alloc_new_blocks, m.kv_cache_reused_blocks, m.kv_cache_alloc_total_blocks) == (2, 2, 4)
    assert {k: v.item() for k, v in m.tensors().items()} == dataclasses.asdict(m)
    assert m.tensors()["arrival_time_ns"].dtype == np.int64 and m.tensors()["kv_cache_reused_blocks"].dtype == np.int32


def test_response_carries_what_the_request_switched_on():
    """Five outputs always; logprobs, counts and perf fields only on request, each never empty; text_output or
    what makes it (for the ensemble's postprocess) as the caller asked."""
    plan = ResponsePlan(stream=True, text_of=spell)
    p = plan.on_output(RequestOutput("r", [10, 11], True, "stop", 4, 2, text="ab", logprobs=[-0.5, -1.0],
                                     context_ids=[3, 1], cut_chars=1))
    plain = response_tensors(p, 0, 16)
    assert set(plain) == {"text_output", "finish_reason", "token_ids", "batch_index", "sequence_index"}
    assert plain["text_output"].item() == b"a"
    full = response_tensors(p, 1, 16, OutputSwitches(True, True, True, True, True, True))
    assert set(full) == set(LLM_OUTPUTS)
    assert full["context_ids"].tolist() == [[3, 1]] and full["cut_chars"].item() == 1
    ensemble = response_tensors(dataclasses.replace(p, text=None), 0, 16, OutputSwitches(text=False, token_run=True))
    assert set(ensemble) == {"finish_reason", "token_ids", "context_ids", "cut_chars", "batch_index",
                             "sequence_index"}
    assert full["output_log_probs"].shape == (1, 1, 2) and full["cum_log_probs"].shape == (1, 1)
    assert full["num_input_tokens"].item() == 4 and full["num_output_tokens"].item() == 2
    assert full["sequence_index"].item() == 1 and full["kv_cache_alloc_total_blocks"].item() == 1


def test_return_switches_are_parsed():
    ids = np.array([[1, 2, 3]], dtype=np.int32)
    assert parse_llm_inputs({"input_ids": ids}).outputs == OutputSwitches()
    asked = parse_llm_inputs({"input_ids": ids}, {"token_ids", "context_ids", "cut_chars"}).outputs
    assert asked == OutputSwitches(text=False, token_run=True)
    spec = parse_llm_inputs({"input_ids": ids, "return_log_probs": np.array([[True]]),
                             "return_num_output_tokens": np.array([[True]]),
                             "return_perf_metrics": np.array([[True]])})
    assert spec.outputs == OutputSwitches(log_probs=True, num_output_tokens=True, perf_metrics=True)


@pytest.mark.parametrize("lengths,message", [(-1, r"input_lengths=-1 is out of range: it must be in \[1, 3\]"),
                                             (0, "input_lengths=0"), (4, r"input_lengths=4 .*\[1, 3\]"),
                                             ([1, 2], "must be one integer")])
def test_input_lengths_is_checked_against_input_ids(lengths, message):
    ids = np.array([[5, 6, 7]], dtype=np.int32)
    with pytest.raises(ValueError, match=message):
        parse_llm_inputs({"input_ids": ids, "input_lengths": np.array([lengths], dtype=np.int32).reshape(1, -1)})
    assert parse_llm_inputs({"input_ids": ids, "input_lengths": np.array([[2]], dtype=np.int32)}).prompt_ids == [5, 6]
