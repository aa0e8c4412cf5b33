"""Runs of byte tokens on a real tritonserver: a random-weight Gemma 2 and Phi-3 over a byte-fallback vocabulary
(tests/test_detokenizer.py builds it) say runs of byte tokens, valid UTF-8 or not, and every entry point streams
exactly its whole answer, which is transformers' text of the tokens."""
from __future__ import annotations

import json
import urllib.request

import pytest
import tritonclient.http as httpclient

from repository_helpers import explicit_mode_server
from test_detokenizer import after_prompt, build_byte_fallback_tokenizer
from trellm_backend.tools.add_model import add_model
from trellm_client.client import LLMClient, OpenAIHTTPClient, http_generate

pytestmark = pytest.mark.server

FAMILIES = {"gemma": "gemma2-softcap", "phi": "phi3-longrope"}
PROMPTS = ["Question:", "The list", "数据 and more", "x = 1"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An explicit-mode server with both models, each added with the command; their folders by name."""
    from hf_models import with_tokenizer
    root = tmp_path_factory.mktemp("byte-runs")
    build_byte_fallback_tokenizer().save_pretrained(root / "tokenizer")
    folders = {name: with_tokenizer(family, str(root / "tokenizer"), str(root / family))
               for name, family in FAMILIES.items()}
    server = explicit_mode_server(root, "gemma", folders["gemma"], str(16 << 20))
    add_model("phi", folders["phi"], server.model_repository, {"kv_cache_bytes": str(16 << 20)})
    client = httpclient.InferenceServerClient(server.http_url)
    for model in ("phi", "gemma_vllm_model", "phi_vllm_model"):
        client.load_model(model)
    client.close()
    yield server, folders
    server.stop()


def door_text(url: str, model: str, prompt: str) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_entry_point_streams_the_whole_answer(served, name):
    from test_openai_api import start_front_door
    from trellm_backend.tools.launch import stop_front_door
    from trellm_backend.triton.tokenization import load_tokenizer
    server, folders = served
    tok = load_tokenizer(folders[name])
    params = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sampling = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    door, url = start_front_door(server)
    byte_tokens = 0
    try:
        for prompt in PROMPTS:
            with LLMClient(server.grpc_url, model=name) as c:
                chunks = list(c.stream_chunks(prompt, stream=True, **params))
                whole = c.generate(prompt, exclude_input_in_output=True, **params)
                echoed = c.generate(prompt, **params)
            tokens = [t for ch in chunks for t in ch.token_ids or []]
            assert len(tokens) == MAX_TOKENS
            ids = tok(prompt).input_ids
            assert whole == after_prompt(tok, ids, tokens) and echoed == tok.decode(ids + tokens,
                                                                                    skip_special_tokens=True)
            streams = {
                "ensemble": [ch.text for ch in chunks],
                "vllm_model": [e["text_output"] for e in http_generate(
                    server.http_url, prompt, model=f"{name}_vllm_model", stream=True, sampling_parameters=sampling,
                    exclude_input_in_output=True)],
                "vllm_model whole": [http_generate(server.http_url, prompt, model=f"{name}_vllm_model",
                                                   sampling_parameters=sampling,
                                                   exclude_input_in_output=True)[0]["text_output"]],
                "openai": list(OpenAIHTTPClient(url, model=name).stream(prompt, ignore_eos=True,
                                                                          max_tokens=MAX_TOKENS)),
                "openai whole": [door_text(url, name, prompt)],
            }
            for entry, texts in streams.items():
                assert "".join(texts) == whole, (name, prompt, entry, texts, whole)
            byte_tokens += sum(tok.convert_ids_to_tokens(t).startswith("<0x") for t in tokens)
    finally:
        stop_front_door(door)
    assert byte_tokens >= 8, "the answers should hold runs of byte tokens"
