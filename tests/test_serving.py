"""The llm step's request contract: one table of inputs, the same in code, config.pbtxt files and the client."""
import os

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from trellm_backend.request import RequestOutput
from trellm_backend.serving import SCALAR_INPUTS, ResponsePlan, parse_llm_inputs
from trellm_client.client import INPUT_TYPES

REPO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_repository")


def load_config(model: str) -> model_config_pb2.ModelConfig:
    with open(os.path.join(REPO, model, "config.pbtxt")) as f:
        return text_format.Parse(f.read(), model_config_pb2.ModelConfig())


def test_tensor_lists_agree_everywhere():
    llm, ens = load_config("llm"), load_config("ensemble")
    assert [i.name for i in llm.input] == ["input_ids", "input_lengths", *SCALAR_INPUTS]
    assert [i.name for i in ens.input] == ["text_input", *SCALAR_INPUTS]
    assert all(i.optional for i in list(llm.input)[1:]) and all(i.optional for i in ens.input)
    # The ensemble's inputs keep the llm's types, and the ensemble forwards each of them to the llm step.
    llm_types = {i.name: i.data_type for i in llm.input}
    assert all(llm_types[i.name] == i.data_type for i in list(ens.input)[1:])
    llm_step = next(s for s in ens.ensemble_scheduling.step if s.model_name == "llm")
    assert set(SCALAR_INPUTS) <= set(llm_step.input_map)
    assert set(INPUT_TYPES) == set(SCALAR_INPUTS)
    # Every output of the llm feeds postprocess under the same name.
    post = load_config("postprocess")
    assert [o.name for o in llm.output] == [i.name for i in post.input]
    assert llm.model_transaction_policy.decoupled


def arr(v, dtype):
    return np.array([[v]], dtype=dtype)


def test_parse_defaults_to_greedy_and_reads_fields():
    spec = parse_llm_inputs({"input_ids": np.array([[5, 6, 7]], dtype=np.int32)})
    assert spec.prompt_ids == [5, 6, 7] and spec.params.temperature == 0.0 and not spec.stream and spec.echo_prompt
    spec = parse_llm_inputs({"input_ids": np.array([[5, 6, 0]], dtype=np.int32),
                             "input_lengths": arr(2, np.int32), "temperature": arr(0.5, np.float32),
                             "random_seed": arr(9, np.uint64), "stream": arr(True, np.bool_),
                             "exclude_input_in_output": arr(True, np.bool_), "max_tokens": arr(7, np.int32)})
    assert spec.prompt_ids == [5, 6] and spec.params.temperature == 0.5 and spec.params.seed == 9
    assert spec.stream and not spec.echo_prompt and spec.params.max_tokens == 7


@pytest.mark.parametrize("extra, message", [
    ({"max_tokens": arr(0, np.int32)}, "max_tokens"),
    ({"temperature": arr(float("nan"), np.float32)}, "temperature"),
    ({"top_k": arr(-5, np.int32)}, "top_k"),
    ({"stream": arr(1, np.int32)}, "stream"),
    ({"max_tokens": np.array([[1, 2]], dtype=np.int32)}, "max_tokens"),
])
def test_parse_names_the_bad_field(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_llm_inputs({"input_ids": np.array([[5]], dtype=np.int32), **extra})


def test_parse_refuses_batches_and_non_integer_ids():
    with pytest.raises(ValueError, match="one prompt per request"):
        parse_llm_inputs({"input_ids": np.zeros((2, 3), dtype=np.int32)})
    with pytest.raises(ValueError, match="input_ids"):
        parse_llm_inputs({"input_ids": np.zeros((1, 3), dtype=np.float32)})


def out(tokens, finished=False):
    return RequestOutput("r", tokens, finished, "length" if finished else None, 3, 0)


def test_stream_plan_sends_deltas_with_context_first():
    plan = ResponsePlan([1, 2, 3], stream=True, echo_prompt=True)   # echo never applies to streams
    first = plan.on_output(out([10]))
    assert first.token_ids == [1, 2, 3, 10] and first.num_context_tokens == 3
    assert plan.on_output(out([11])).token_ids == [11]
    last = plan.on_output(out([12], finished=True))
    assert last.token_ids == [12] and last.finished


def test_non_stream_plan_sends_once_with_prompt_when_echoed():
    plan = ResponsePlan([1, 2, 3], stream=False, echo_prompt=True)
    assert plan.on_output(out([10])) is None
    p = plan.on_output(out([11], finished=True))
    assert p.token_ids == [1, 2, 3, 10, 11] and p.num_context_tokens == 0 and p.finished
    plan = ResponsePlan([1, 2, 3], stream=False, echo_prompt=False)
    plan.on_output(out([10]))
    p = plan.on_output(out([11], finished=True))
    assert p.token_ids[p.num_context_tokens:] == [10, 11]
