"""One table of request fields (backend/triton/fields.py FIELDS) against everything that lists them: the config.pbtxt input
lists, the client's types, the field table of docs/requests.md; and the parsing rules of both contracts."""
import json
import os

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2

from trellm_backend.tools.repository import read_config
from trellm_backend.triton import fields
from trellm_backend.triton.llm import LLM_OUTPUTS
from trellm_backend.triton.vllm import VLLM_OUTPUTS, parse_vllm_request
from trellm_client.client import INPUT_TYPES, JSON_INPUTS, LIST_INPUTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.join(ROOT, "model_repository")
TYPE_NAMES = {v: k for k, v in model_config_pb2.DataType.items()}


def load_config(model: str) -> model_config_pb2.ModelConfig:
    return read_config(os.path.join(REPO, model, "config.pbtxt"))


def declared(config) -> dict[str, tuple[str, list[int], bool]]:
    return {i.name: (TYPE_NAMES[i.data_type], list(i.dims), i.optional) for i in config.input}


def expected_field_inputs(table) -> dict[str, tuple[str, list[int], bool]]:
    return {t: (fields.TRITON_TYPES[f.kind], [int(f.dims)], True) for f in table for t in f.tensor_names}


class FakeAutoCompleteConfig:
    """Triton's auto_complete_model_config, as the Python backend hands it to auto_complete_config."""

    def __init__(self, config):
        self.inputs = [{"name": i.name} for i in config.input]
        self.added = []

    def as_dict(self):
        return {"input": self.inputs + self.added}

    def add_input(self, spec):
        self.added.append(spec)


def test_llm_inputs_are_the_field_table():
    """config.pbtxt declares the prompt and `stop`; auto_complete_config adds every field's tensors."""
    config = load_config("llm")
    fake = FakeAutoCompleteConfig(config)
    fields.auto_complete_llm_inputs(fields.auto_complete_llm_inputs(fake))    # a second call adds nothing
    for spec in fake.added:
        config.input.add(name=spec["name"], data_type=model_config_pb2.DataType.Value(spec["data_type"]),
                         dims=spec["dims"], optional=spec["optional"])
    llm = declared(config)
    llm.pop("stop")   # the TRT-LLM-style stop request, not a request field
    llm.pop("lora_control")   # the LoRA control request, neither
    assert list(llm) == fields.llm_tensor_names()
    assert {k: v for k, v in llm.items() if k not in fields.LLM_PROMPT_INPUTS} == expected_field_inputs(fields.FIELDS)


def test_ensemble_inputs_are_the_field_table_and_reach_llm():
    ens = load_config("ensemble")
    inputs = declared(ens)
    assert list(inputs) == fields.ensemble_tensor_names()
    assert all(optional for _, _, optional in inputs.values())   # text_input too: preprocess names it missing
    ensemble_fields = [f for f in fields.FIELDS if f.in_ensemble]
    assert {k: v for k, v in inputs.items() if k not in fields.ENSEMBLE_PROMPT_INPUTS} == \
        expected_field_inputs(ensemble_fields)
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    assert set(steps["llm"].input_map) == {"input_ids", "input_lengths",
                                           *(t for f in ensemble_fields for t in f.tensor_names)}
    assert all(k == v for k, v in steps["llm"].input_map.items() if k not in fields.LLM_PROMPT_INPUTS)
    pre = declared(load_config("preprocess"))
    assert set(steps["preprocess"].input_map) == set(pre) >= set(fields.ENSEMBLE_PROMPT_INPUTS)
    # preprocess -> llm -> postprocess: text_output is postprocess's, made from llm's token runs; every other
    # ensemble output is llm's own, of the same type and shape, mapped by name.
    assert list(steps) == ["preprocess", "llm", "postprocess"]
    llm_out = {o.name: (o.data_type, list(o.dims)) for o in load_config("llm").output}
    assert list(llm_out) == LLM_OUTPUTS
    post = load_config("postprocess")
    post_in = {i.name: (i.data_type, list(i.dims)) for i in post.input}
    post_out = {o.name: (o.data_type, list(o.dims)) for o in post.output}
    assert set(post_in) == {"token_ids", "context_ids", "cut_chars"} and list(post_out) == ["text_output"]
    assert all(llm_out[name] == shape for name, shape in post_in.items())
    assert post_out["text_output"] == llm_out["text_output"]
    assert {steps["llm"].output_map[k] for k in post_in} == set(steps["postprocess"].input_map.values())
    assert all(steps["llm"].output_map[k] == steps["postprocess"].input_map[k] for k in post_in)
    assert dict(steps["postprocess"].output_map) == {"text_output": "text_output"}
    from_llm = {k: v for k, v in steps["llm"].output_map.items() if not v.startswith("_")}
    assert "text_output" not in steps["llm"].output_map, "llm makes no text in the ensemble: postprocess does"
    assert from_llm == {o.name: o.name for o in ens.output if o.name != "text_output"}
    assert all(llm_out[o.name] == (o.data_type, list(o.dims)) for o in ens.output)


def test_vllm_model_inputs_and_outputs_follow_the_vllm_contract():
    cfg = load_config("vllm_model")
    inputs = declared(cfg)
    assert inputs.pop("text_input") == ("TYPE_STRING", [1], False)
    assert inputs == {n: ({"bool": "TYPE_BOOL", "str": "TYPE_STRING"}[k], [1], True)
                      for n, k in fields.VLLM_INPUTS.items()}
    assert cfg.max_batch_size == 0 and cfg.model_transaction_policy.decoupled
    outputs = {o.name: TYPE_NAMES[o.data_type] for o in cfg.output}
    assert outputs == {"text_output": "TYPE_STRING", "finish_reason": "TYPE_STRING",
                       "cumulative_logprob": "TYPE_FP32", "logprobs": "TYPE_STRING",
                       "num_input_tokens": "TYPE_UINT32", "num_output_tokens": "TYPE_UINT32"}
    assert list(outputs) == VLLM_OUTPUTS      # what serving.vllm_outputs may produce
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["llm_model"] == "llm"


def test_client_types_match_the_ensemble():
    ens = {t: f for f in fields.FIELDS if f.in_ensemble for t in f.tensor_names}
    assert set(INPUT_TYPES) == set(ens)
    numpy_of = {"int": np.int32, "uint": np.uint64, "float": np.float32, "bool": np.bool_, "str": np.object_,
                "str_list": np.object_, "int_list": np.int32, "json": np.object_}
    assert all(INPUT_TYPES[t] is numpy_of[f.kind] for t, f in ens.items())
    assert LIST_INPUTS == {t for t, f in ens.items() if f.kind == "str_list"}
    assert JSON_INPUTS - {"tools"} == {t for t, f in ens.items() if f.kind == "json"}   # tools: a prompt input


def test_the_docs_document_every_field():
    with open(os.path.join(ROOT, "docs", "requests.md")) as f:
        readme = f.read()
    assert fields.fields_markdown() in readme, "regenerate docs/requests.md's field table: fields.fields_markdown()"
    for name in fields.VLLM_INPUTS:
        assert f"`{name}`" in readme


# -- parsing -------------------------------------------------------------------------------------------------
def t(v, dtype):
    return np.array([[v]], dtype=dtype)


def test_tensor_aliases_and_defaults():
    values = fields.values_from_tensors({"min_length": t(5, np.int32), "random_seed": t(7, np.uint64)})
    params = fields.sampling_params(values)
    assert params.min_tokens == 5 and params.seed == 7 and params.temperature == 0.0   # greedy by default
    both = {"min_tokens": t(5, np.int32), "min_length": t(6, np.int32)}
    with pytest.raises(ValueError, match="aliases"):
        fields.values_from_tensors(both)
    words = fields.values_from_tensors({"stop_words": np.array([[b"\n\n", "日本".encode()]], dtype=np.object_)})
    assert words == {"stop": ["\n\n", "日本"]}


@pytest.mark.parametrize("tensors, message", [
    ({"max_tokens": t(0, np.int32)}, r"max_tokens must be in \[1, 1048576\], got 0"),
    ({"min_length": t(-1, np.int32)}, r"min_length must be in \[0, 1048576\]"),
    ({"temperature": t(float("nan"), np.float32)}, "temperature must be a finite number"),
    ({"top_p": t(0.0, np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"min_p": t(1.5, np.float32)}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": t(0.0, np.float32)}, r"repetition_penalty must be in \(0, 100\]"),
    ({"presence_penalty": t(3.0, np.float32)}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": t(-2.5, np.float32)}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"num_return_sequences": t(17, np.int32)}, r"num_return_sequences must be in \[1, 16\]"),
    ({"beam_width": t(2, np.int32)}, r"beam_width must be in \[1, 1\]"),
    ({"top_k": t(-2, np.int32)}, "top_k must be in"),
    ({"end_id": t(-1, np.int32)}, "end_id must be in"),
    ({"stream": t(1, np.int32)}, "stream has dtype int32; expected BOOL"),
    ({"max_tokens": np.array([[1, 2]], dtype=np.int32)}, "max_tokens must hold exactly one value"),
    ({"stop_words": np.array([[1]], dtype=np.int32)}, "stop_words must be a STRING tensor"),
])
def test_tensor_errors_name_the_field_and_range(tensors, message):
    with pytest.raises(ValueError, match=message):
        fields.sampling_params(fields.values_from_tensors(tensors))


def test_sampling_parameters_json_coerces_strings_like_genai_perf_sends():
    values = fields.values_from_sampling_json(json.dumps(
        {"max_tokens": "256", "min_tokens": "256", "ignore_eos": "false", "temperature": "0.5", "top_k": 3.0,
         "stop": "END", "stop_token_ids": ["5", 6], "n": 2, "seed": None}))
    assert values == {"max_tokens": 256, "min_tokens": 256, "ignore_eos": False, "temperature": 0.5, "top_k": 3,
                      "stop": ["END"], "stop_token_ids": [5, 6], "n": 2}
    assert fields.values_from_sampling_json('{"ignore_eos": "true"}') == {"ignore_eos": True}


@pytest.mark.parametrize("sp, message", [
    ('{"max_tokens": "lots"}', "sampling_parameters.max_tokens must be an integer"),
    ('{"max_tokens": 2.5}', "sampling_parameters.max_tokens must be an integer"),
    ('{"ignore_eos": "maybe"}', "sampling_parameters.ignore_eos must be true or false"),
    ('{"top_p": "2"}', r"sampling_parameters.top_p must be in \(0, 1\]"),
    ('{"logprobs": 21}', r"sampling_parameters.logprobs must be in \[0, 20\]"),
    ('{"stop": [1]}', "sampling_parameters.stop must be a string or a list of strings"),
    ('{"max_token": 5, "tempreature": 1}', "unknown field.*max_token, tempreature"),
    ('[1, 2]', "must be a JSON object"),
    ('{"max_tokens": ', "not valid JSON"),
    ('{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_sampling_parameters_errors(sp, message):
    with pytest.raises(ValueError, match=message):
        fields.values_from_sampling_json(sp)


def test_vllm_request_defaults_and_what_goes_to_llm():
    spec = parse_vllm_request({"text_input": "hi", "sampling_parameters": '{"max_tokens": "4"}'},
                              {"stream": True, "return_cumulative_logprob": True})
    assert spec.values["temperature"] == 1.0       # vLLM's default, unlike the ensemble's greedy default
    assert spec.values["return_log_probs"] and spec.stream and not spec.echo_prompt
    tensors = fields.tensors_from_values(spec.values)
    assert tensors["max_tokens"].dtype == np.int32 and tensors["max_tokens"].shape == (1, 1)
    back = fields.sampling_params(fields.values_from_tensors(tensors))    # what llm will parse
    assert back.max_tokens == 4 and back.temperature == 1.0 and back.logprobs == 0
    with pytest.raises(ValueError, match="text_input is missing"):
        parse_vllm_request({"sampling_parameters": "{}"}, {})


def test_unknown_request_parameters_are_reported():
    assert fields.request_parameters_error('{"triton_enable_empty_final_response": true}') is None
    assert "max_tokns" in fields.request_parameters_error('{"max_tokns": 5}')
