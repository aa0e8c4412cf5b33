"""Broken model folders fail to load with a message naming the file and the value at fault, as Triton's load API
reports it, while the healthy model on the same server keeps answering. Every case is checked against the llm entry's
own checks (what its initialize runs); three of them, one per kind of source (the weights, the folder's files, the
machine), go through a real server's load API too: the way an error reaches the operator is the same for all."""
from __future__ import annotations

import concurrent.futures
import os
import shutil

import pytest
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from repository_helpers import edit_json, explicit_mode_server
from trellm_backend.models.config import ModelConfigError, load_model_config
from trellm_backend.tools.add_model import add_model
from trellm_backend.tools.repository import read_config
from trellm_backend.triton.checks import serving_config
from trellm_backend.triton.parameters import model_parameters
from trellm_client.client import LLMClient

KV = str(32 << 20)


def broken_copy(default_model_path: str, dest: str) -> str:
    shutil.copytree(default_model_path, dest)
    return dest


def missing_weights(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    return {}, [f"{folder}: no *.safetensors weights found"]


def truncated_weights(folder):
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return {}, [f"{path}: truncated or corrupt", f"the file has {os.path.getsize(path)}"]


def unsupported_architecture(folder):
    edit_json(os.path.join(folder, "config.json"), architectures=["GPT2LMHeadModel"])
    return {}, [f"{folder}/config.json: architectures=['GPT2LMHeadModel'] is not supported"]


def tokenizer_larger_than_vocabulary(folder):
    edit_json(os.path.join(folder, "config.json"), vocab_size=1000)
    return {}, [f"{folder}/config.json: vocab_size=1000 but the folder's tokenizer has 4096 tokens"]


def missing_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))
    return {}, [f"{folder}: no tokenizer files"]


def kv_budget_below_one_sequence(folder):
    # tiny-llama: 4 layers x K and V x 2 KV heads x head size 32 x 4 bytes = 2048 bytes per token; 2048 tokens.
    return {"kv_cache_bytes": "1000000"}, [
        "config.pbtxt: KV cache too small: kv_cache_bytes=1000000 gives 1000000 bytes",
        "max_model_len=2048 tokens needs 4194304 bytes"]


def negative_block_size(folder):
    return {"block_size": "-16"}, ["config.pbtxt: block_size=-16 must be a positive number of tokens, or 0 for the "
                                   "device's default (128 on CPU, 16 on CUDA)"]


def larger_than_memory(folder):
    return {"kv_cache_bytes": str(1 << 45)}, [
        "config.pbtxt: the model does not fit in memory", f"KV cache {1 << 45} bytes", "MemAvailable in /proc/meminfo"]


def unsupported_quantization(folder):
    return {"quantization": "int3"}, ["config.pbtxt: quantization='int3' is not one of none, int8, w8a8, int4, "
                                      "int4-g64, int4-g32"]


CASES = [missing_weights, truncated_weights, unsupported_architecture, tokenizer_larger_than_vocabulary,
         missing_tokenizer, kv_budget_below_one_sequence, negative_block_size, larger_than_memory,
         unsupported_quantization]
THROUGH_TRITON = [missing_weights, tokenizer_larger_than_vocabulary, larger_than_memory]
REFUSED_BY_ADD_MODEL = [unsupported_architecture]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_every_broken_folder_fails_the_llm_entrys_checks_by_name(default_model_path, tmp_path, case):
    folder = broken_copy(default_model_path, str(tmp_path / "hf"))
    engine, expected = case(folder)
    (tmp_path / "repo").mkdir()
    if case in REFUSED_BY_ADD_MODEL:   # config.json is read before any entry is written
        with pytest.raises(ModelConfigError) as e:
            add_model(case.__name__, folder, str(tmp_path / "repo"), {"kv_cache_bytes": KV, **engine})
        assert all(text in str(e.value) for text in expected) and os.listdir(tmp_path / "repo") == []
        return
    add_model(case.__name__, folder, str(tmp_path / "repo"), {"kv_cache_bytes": KV, **engine})
    entry = tmp_path / "repo" / f"{case.__name__}_llm"
    # As Triton hands it to initialize: the config as JSON, read by the entry's own model_parameters.
    config = json_format.MessageToDict(read_config(str(entry / "config.pbtxt")), preserving_proto_field_name=True)
    with pytest.raises(ModelConfigError) as e:
        serving_config(model_parameters(config), str(entry))
    for text in expected:
        assert text in str(e.value)


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    """An explicit-mode server whose only loaded model is `good`."""
    root = tmp_path_factory.mktemp("load_errors")
    s = explicit_mode_server(root, "good", default_model_path, KV)
    yield s, root
    s.stop()


def good_still_answers(server) -> None:
    with LLMClient(server.grpc_url, model="good") as c:
        assert c.generate("The Python language", max_tokens=4, exclude_input_in_output=True)


@pytest.fixture(scope="module")
def load_results(server, default_model_path):
    """Every case's folder added and its engine entry loaded, all at once (Triton loads them in parallel; each
    starts one Python-backend process, not the three of a whole ensemble): case name -> (expected, error text)."""
    s, root = server
    jobs = {}
    for case in THROUGH_TRITON:
        name = case.__name__
        folder = broken_copy(default_model_path, str(root / f"hf_{name}"))
        engine, expected = case(folder)
        add_model(name, folder, s.model_repository, {"kv_cache_bytes": KV, **engine})
        jobs[name] = expected

    def load(name):
        with httpclient.InferenceServerClient(s.http_url, network_timeout=300) as client:
            try:
                client.load_model(f"{name}_llm")
            except InferenceServerException as e:
                return str(e)
        return None

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        errors = dict(zip(jobs, pool.map(load, jobs)))
    return {name: (jobs[name], errors[name]) for name in jobs}


@pytest.mark.server
@pytest.mark.parametrize("case", THROUGH_TRITON, ids=lambda c: c.__name__)
def test_broken_folder_fails_with_named_message(server, load_results, case):
    s, _ = server
    expected, error = load_results[case.__name__]
    assert error is not None, "the broken model loaded"
    for text in expected:
        assert text in error
    with httpclient.InferenceServerClient(s.http_url) as client:
        assert not client.is_model_ready(f"{case.__name__}_llm")
        assert client.is_server_live() and client.is_model_ready("good")
    good_still_answers(s)


@pytest.mark.server
def test_ensemble_load_reports_the_engine_error_everywhere(server, default_model_path):
    """What an operator sees: the load API's answer, the repository index and the server log all carry it."""
    s, root = server
    folder = broken_copy(default_model_path, str(root / "hf_ensemble_case"))
    add_model("tight", folder, s.model_repository, {"kv_cache_bytes": "1000000"})
    expected = (f"{s.model_repository}/tight_llm/config.pbtxt: KV cache too small: kv_cache_bytes=1000000 gives "
                "1000000 bytes (3 blocks), but one sequence of max_model_len=2048 tokens needs 4194304 bytes "
                "(16 blocks of 128 tokens x 262144 bytes)")   # the CPU's default block size
    client = httpclient.InferenceServerClient(s.http_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("tight")
    assert expected in str(err.value)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert expected in index["tight_llm"]["reason"]
    assert index["good"]["state"] == "READY"
    with open(root / "server.log", errors="replace") as f:
        assert expected in f.read()
    good_still_answers(s)
    client.close()


@pytest.mark.parametrize("variant, changes, message", [
    ("gemma3-text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not supported"),
    ("gemma2-softcap", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping=-1.0 must be a positive number"),
    ("mistral-sliding", dict(sliding_window=0), "sliding_window=0 must be an integer >= 1"),
    ("qwen2-sliding", dict(layer_types=["sliding_attention"]), "layer_types=['sliding_attention'] must name"),
    ("gemma3-text", dict(hidden_activation="gelu"), "hidden_activation='gelu' is not supported (only "
                                                    "'gelu_pytorch_tanh')"),
    ("gemma3-text", dict(layer_types=["full_attention"]), "layer_types=['full_attention'] must name"),
    ("phi3-longrope", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0],
                                                long_factor=[1.0] * 6, original_max_position_embeddings=24)),
     "rope_scaling.short_factor must list 6 positive numbers"),
])
def test_a_family_key_outside_what_is_served_is_refused_by_name(tmp_path, variant, changes, message):
    from hf_models import model_dir_for
    folder = model_dir_for(str(tmp_path), variant)
    edit_json(os.path.join(folder, "config.json"), **changes)
    with pytest.raises(ModelConfigError) as e:
        load_model_config(folder)
    assert f"{folder}/config.json: " in str(e.value) and message in str(e.value), str(e.value)
