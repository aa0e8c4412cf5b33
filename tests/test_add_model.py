"""One command adds a model: entries generated from the default model's, loaded into a running server through
the repository API (explicit model control), each model answering with its own weights; unloading returns the
memory of its Python-backend processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import tritonclient.http as httpclient

from conftest import REPO
from repository_helpers import (MAX_TOKENS, PROMPTS, explicit_mode_server, greedy_texts, process_group_rss,
                                processes_mentioning, variant_model)
from trellm_backend.tools.add_model import TEMPLATE_ENTRIES, add_model, remove_model
from trellm_backend.tools.repository import read_config
from trellm_backend.tools.testbed import wait_until
from trellm_client.client import LLMClient, http_generate

pytestmark = pytest.mark.server

TEMPLATE = os.path.join(REPO, "model_repository")


def run_add_model(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trellm_backend.tools.add_model", *args], capture_output=True, text=True)


def test_entries_follow_the_template(default_model_path, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    r = run_add_model("chat", default_model_path, "--repository", str(repo), "--dtype", "float32",
                      "--kv-cache-bytes", "67108864", "--max-model-len", "512", "--max-num-seqs", "8")
    assert r.returncode == 0, r.stderr
    present = [e for e in TEMPLATE_ENTRIES if os.path.isfile(os.path.join(TEMPLATE, e, "config.pbtxt"))]
    expected = sorted("chat" if e == "ensemble" else f"chat_{e}" for e in present)
    assert sorted(os.listdir(repo)) == expected
    for entry in present:
        new = "chat" if entry == "ensemble" else f"chat_{entry}"
        t, c = read_config(os.path.join(TEMPLATE, entry, "config.pbtxt")), read_config(repo / new / "config.pbtxt")
        assert c.name == new
        assert c.input == t.input and c.output == t.output      # tensor lists come from the template
        assert sorted(os.listdir(repo / new / "1")) == sorted(f for f in os.listdir(os.path.join(TEMPLATE, entry, "1"))
                                                             if f != "__pycache__")
        if "model_path" in t.parameters:
            assert c.parameters["model_path"].string_value == default_model_path
    steps = [s.model_name for s in read_config(repo / "chat" / "config.pbtxt").ensemble_scheduling.step]
    assert steps == ["chat_preprocess", "chat_llm", "chat_postprocess"]
    llm = read_config(repo / "chat_llm" / "config.pbtxt").parameters
    assert {k: llm[k].string_value for k in ("dtype", "kv_cache_bytes", "max_model_len", "max_num_seqs")} == \
        {"dtype": "float32", "kv_cache_bytes": "67108864", "max_model_len": "512", "max_num_seqs": "8"}

    again = run_add_model("chat", default_model_path, "--repository", str(repo))
    assert again.returncode == 1 and "--force" in again.stderr
    typo = run_add_model("other", default_model_path, "--repository", str(repo), "--kv-cache-bytes", "lots")
    assert typo.returncode == 1 and "kv_cache_bytes='lots'" in typo.stderr
    r = run_add_model("chat", "--remove", "--repository", str(repo))
    assert r.returncode == 0, r.stderr
    assert os.listdir(repo) == []
    from hf_models import make_lora
    sql = make_lora(default_model_path, "attn-r8", str(tmp_path / "sql"))
    chat = make_lora(default_model_path, "mlp-r4-rslora", str(tmp_path / "chat-adapter"))
    # each adapter is read and checked as the model's load will: a missing folder fails the command, by file
    missing = run_add_model("tuned", default_model_path, "--repository", str(repo), "--lora", f"sql={sql}",
                            "--lora", f"x={tmp_path}/nowhere")
    assert missing.returncode == 1 and f"{tmp_path}/nowhere/adapter_config.json is missing" in missing.stderr, \
        missing.stderr
    assert os.listdir(repo) == []
    r = run_add_model("tuned", default_model_path, "--repository", str(repo), "--lora", f"sql={os.path.relpath(sql)}",
                      "--lora", f"chat={chat}")
    assert r.returncode == 0, r.stderr
    adapters = json.loads(read_config(repo / "tuned_llm" / "config.pbtxt").parameters["lora_adapters"].string_value)
    assert adapters == {"sql": sql, "chat": chat}


def test_model_path_is_relative_beside_the_repository_and_entry_names_are_rewritten(default_model_path, tmp_path):
    # A template with an entry that names another one through a parameter (as vllm_model names its llm).
    template = tmp_path / "template"
    subprocess.run(["cp", "-r", TEMPLATE, str(template)], check=True)
    vllm = template / "vllm_model"
    (vllm / "1").mkdir(parents=True, exist_ok=True)
    (vllm / "1" / "model.py").write_text("# placeholder\n")
    (vllm / "config.pbtxt").write_text('name: "vllm_model"\nbackend: "python"\n'
                                       'parameters: { key: "llm_model" value: { string_value: "llm" } }\n'
                                       'parameters: { key: "model_path" value: { string_value: "x" } }\n')
    repo, models = tmp_path / "repo", tmp_path / "hf_models"
    repo.mkdir()
    models.mkdir()
    os.symlink(default_model_path, models / "m")
    written = add_model("m", str(models / "m"), str(repo), template_dir=str(template))
    assert "m_vllm_model" in written
    cfg = read_config(repo / "m_vllm_model" / "config.pbtxt")
    assert cfg.parameters["llm_model"].string_value == "m_llm"
    assert cfg.parameters["model_path"].string_value == "../hf_models/m"
    assert sorted(remove_model("m", str(repo), template_dir=str(template))) == sorted(written)
    assert os.listdir(repo) == []
    with pytest.raises(ValueError, match="template"):
        remove_model("ensemble", TEMPLATE)


@pytest.fixture(scope="module")
def explicit_server(default_model_path, tmp_path_factory):
    """An explicit-mode server on a fresh repository holding one model, `base`, added with the command."""
    root = tmp_path_factory.mktemp("hot")
    server = explicit_mode_server(root, "base", default_model_path, str(32 << 20))
    yield server, root
    server.stop()


def answers(url: str, model: str) -> dict[str, str]:
    with LLMClient(url, model=model) as c:
        return {p: "".join(c.stream(p, max_tokens=MAX_TOKENS)) for p in PROMPTS}


def vllm_answers(http_url: str, model: str) -> dict[str, str]:
    """Greedy answers through the vLLM-shaped entry (HTTP generate, sampling parameters as JSON)."""
    sampling = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0})
    return {p: http_generate(http_url, p, model=model, sampling_parameters=sampling,
                             exclude_input_in_output=True)[0]["text_output"] for p in PROMPTS}


def door_answers(url: str, model: str) -> dict[str, str]:
    """Greedy completions through the OpenAI front door (the model is its ensemble entry's name)."""
    import urllib.request
    out = {}
    for p in PROMPTS:
        body = json.dumps({"model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out[p] = json.load(r)["choices"][0]["text"]
    return out


def test_hot_load_serves_own_weights_and_unload_returns_memory(explicit_server, default_model_path):
    server, root = explicit_server
    second = variant_model(default_model_path, str(root / "hf_second"))
    want_base, want_second = greedy_texts(default_model_path), greedy_texts(second)
    assert want_base != want_second, "the two models must differ for this test to tell them apart"
    client = httpclient.InferenceServerClient(server.http_url)
    assert answers(server.grpc_url, "base") == want_base

    rss_before = process_group_rss(server.proc.pid)
    add_model("second", second, server.model_repository, {"kv_cache_bytes": str(32 << 20)})
    client.load_model("second")                                   # loads its composing models too
    assert client.is_model_ready("second") and client.is_model_ready("second_llm")
    assert answers(server.grpc_url, "second") == want_second
    assert answers(server.grpc_url, "base") == want_base         # the first model is untouched
    client.load_model("second_vllm_model")                        # the vLLM-shaped entry drives second_llm
    assert vllm_answers(server.http_url, "second_vllm_model") == want_second

    # Update: new settings written over the loaded entries; loading again reloads what changed.
    add_model("second", second, server.model_repository, {"kv_cache_bytes": str(48 << 20)}, force=True)
    client.load_model("second")
    llm_params = client.get_model_config("second_llm")["parameters"]
    assert llm_params["kv_cache_bytes"]["string_value"] == str(48 << 20)
    assert answers(server.grpc_url, "second") == want_second
    rss_loaded = process_group_rss(server.proc.pid)

    client.unload_model("second_vllm_model")                      # not a dependency of the ensemble: on its own
    client.unload_model("second", unload_dependents=True)
    wait_until(lambda: not processes_mentioning(os.path.join(server.model_repository, "second_")), 60,
               "the unloaded model's Python-backend processes to end", interval=0.5)
    time.sleep(1)
    rss_after = process_group_rss(server.proc.pid)
    print(f"\nserver process-tree RSS: before load {rss_before / 2**20:.0f} MiB, after load "
          f"{rss_loaded / 2**20:.0f} MiB, after unload {rss_after / 2**20:.0f} MiB")
    grown = rss_loaded - rss_before
    assert grown > 100 << 20, "loading a model with three Python-backend processes must cost memory"
    assert rss_after - rss_before < 0.15 * grown, "unloading must give back the model's memory"
    assert not client.is_model_ready("second")
    assert answers(server.grpc_url, "base") == want_base
    client.close()


@pytest.mark.parametrize("family", ["mixtral-moe8", "phi3-longrope", "gemma3-text", "gemma2-softcap"])
def test_an_added_family_serves_transformers_greedy_text(explicit_server, default_model_path, family):
    """A Mixtral, a Phi-3, a Gemma 3 and a Gemma 2 folder (the default model's tokenizer, random weights) added with the command
    and loaded into a running server answer with transformers' greedy text through the ensemble, the vLLM-shaped
    entry and the OpenAI front door."""
    from hf_models import with_tokenizer
    from test_openai_api import start_front_door
    from trellm_backend.tools.launch import stop_front_door
    server, root = explicit_server
    folder = with_tokenizer(family, default_model_path, str(root / family))
    want = greedy_texts(folder)
    name = family.split("-")[0]
    add_model(name, folder, server.model_repository, {"kv_cache_bytes": str(16 << 20)})
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        client.load_model(name)
        client.load_model(f"{name}_vllm_model")
        assert answers(server.grpc_url, name) == want
        assert vllm_answers(server.http_url, f"{name}_vllm_model") == want
        door, url = start_front_door(server)
        try:
            assert door_answers(url, name) == want
        finally:
            stop_front_door(door)
    finally:
        client.unload_model(f"{name}_vllm_model")
        client.unload_model(name, unload_dependents=True)
        client.close()


def test_a_gguf_file_added_with_the_command_serves_transformers_greedy_text(explicit_server, default_model_path):
    """A llama.cpp file (the default model written as Q8_0) given to the command as FILE.gguf: config.json and the
    tokenizer are derived beside it, and the ensemble, the vLLM-shaped entry and the OpenAI front door answer with
    transformers' greedy text on the same file (its own GGUF loader), the weights held in the file's blocks."""
    from test_openai_api import start_front_door
    from trellm_backend.tools.launch import stop_front_door
    from trellm_backend.tools.write_gguf import write_gguf
    server, root = explicit_server
    folder = root / "gguf-tiny"
    folder.mkdir()
    write_gguf(default_model_path, str(folder / "tiny-q8_0.gguf"), "Q8_0")
    r = run_add_model("ggtiny", str(folder / "tiny-q8_0.gguf"), "--repository", server.model_repository,
                      "--kv-cache-bytes", str(16 << 20))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "tiny-q8_0.gguf",
                                          "tokenizer.json", "tokenizer_config.json"]
    want = greedy_texts(str(folder))
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        client.load_model("ggtiny")
        client.load_model("ggtiny_vllm_model")
        assert answers(server.grpc_url, "ggtiny") == want
        assert vllm_answers(server.http_url, "ggtiny_vllm_model") == want
        door, url = start_front_door(server)
        try:
            assert door_answers(url, "ggtiny") == want
        finally:
            stop_front_door(door)
        with open(server.log_path) as f:
            assert "INT8 with a scale per 32 inputs, C++" in f.read(), "the linears stay in the file's blocks"
    finally:
        client.unload_model("ggtiny_vllm_model")
        client.unload_model("ggtiny", unload_dependents=True)
        client.close()


def test_a_folder_the_engine_cannot_serve_is_refused_before_anything_is_written(default_model_path, tmp_path):
    """add_model wrote all five entries for a folder the llm then refused at load (a Gemma 3 or an unknown key); it
    now reads config.json as the load does, and exits 1 naming the file and what it refused."""
    import shutil
    repo = tmp_path / "repo"
    repo.mkdir()
    folder = tmp_path / "gemma3"
    shutil.copytree(default_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForConditionalGeneration"]}))
    r = run_add_model("gemma", str(folder), "--repository", str(repo))
    assert r.returncode == 1 and f"{folder}/config.json: architectures=['Gemma3ForConditionalGeneration'] is not " \
                                 "supported" in r.stderr, r.stderr
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    r = run_add_model("gemma", str(folder), "--repository", str(repo))
    assert r.returncode == 1 and "hidden_act='gelu_pytorch_tanh' is not supported" in r.stderr, r.stderr
    assert os.listdir(repo) == []
