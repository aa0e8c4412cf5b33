"""Streamed text: runs of tokens detokenized without state concatenate to exactly the full decode, and the engine's
text (output_processor.py) is what a stateless step (postprocess) remakes from each output's tokens."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from trellm_backend.engine.detokenizer import TokenRun, prompt_context, run_text
from trellm_backend.engine.output_processor import OutputProcessor
from trellm_backend.engine.request import SamplingParams

TEXTS = [
    "  leading spaces and a tab\tthen words",
    "数据结构和算法：列表、字典与集合",              # CJK: several byte-level tokens per character
    "emoji 🐍🚀 and a family 👨‍👩‍👧 in a row",
    "combining marks: e\u0301 n\u0303 a\u0308",
    "def f(x):\n    return x ** 2  # squares",
]


def after_prompt(tok, prompt, ids):
    """The text as it reads after the prompt (SentencePiece's word-start "▁" is a space there)."""
    return tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]


def engine_outputs(tok, prompt, ids, step=1, **params):
    """Drive an OutputProcessor over `ids` (`step` tokens per engine step, as speculation gives); check that every
    output's text is what the stateless remake of its tokens gives, as the ensemble's postprocess makes it, also
    when a responder merges consecutive outputs into one response; return the texts and whether a stop ended it."""
    proc = OutputProcessor(tok, prompt, SamplingParams(**params))
    texts, merged, pending = [], [], []
    for i in range(0, len(ids), step):
        context, released, text, cut, stopped = None, [], "", 0, False
        for j, t in enumerate(ids[i:i + step]):
            pending.append(t)
            r = proc.add(t, finished=i + j == len(ids) - 1)
            if r.num_tokens:
                context = r.context_ids if context is None else context
                released += pending[:r.num_tokens]
                del pending[:r.num_tokens]
                text, cut, stopped = text + r.text, r.cut_chars, r.stopped
            if r.stopped:
                break
        if released:
            assert run_text(tok, TokenRun(context, released, cut)) == text, (context, released, text)
            texts.append(text)
            merged.append((context, released, cut))
        if stopped:
            break
    for a, b in zip(merged, merged[1:]):    # two outputs sent as one response: the same text
        both = TokenRun(a[0], a[1] + b[1], b[2])
        assert run_text(tok, both) == run_text(tok, TokenRun(*a)) + run_text(tok, TokenRun(*b))
    return texts, stopped


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_engine_text_is_the_full_decode_and_what_the_tokens_remake(tokenizer, text, step):
    prompt = tokenizer("Question:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    texts, _ = engine_outputs(tokenizer, prompt, ids, step)
    assert "".join(texts) == after_prompt(tokenizer, prompt, ids)
    assert all(texts[:-1]) and all("\ufffd" not in t for t in texts), texts


def test_incomplete_character_waits_with_its_tokens(tokenizer):
    ids = tokenizer("🐍", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the test needs a character split over several tokens"
    proc = OutputProcessor(tokenizer, tokenizer("a").input_ids, SamplingParams())
    assert proc.add(ids[0], finished=False).num_tokens == 0     # half a character: its token waits
    rest = [proc.add(t, finished=False) for t in ids[1:]]
    assert sum(r.num_tokens for r in rest) == len(ids) and "".join(r.text for r in rest).strip() == "🐍"


def test_prompt_context_begins_between_characters(tokenizer):
    prompt = tokenizer("问题：数据结构", add_special_tokens=False).input_ids
    context = prompt_context(tokenizer, prompt)
    assert prompt[-len(context):] == context and not tokenizer.decode(context).startswith("\ufffd")
    ids = tokenizer("和算法", add_special_tokens=False).input_ids
    texts, _ = engine_outputs(tokenizer, prompt, ids)
    assert "".join(texts) == after_prompt(tokenizer, prompt, ids)


def test_stop_string_is_cut_and_the_cut_is_remade(tokenizer):
    prompt = tokenizer("Question:").input_ids
    ids = tokenizer(" lists are mutable and tuples are not", add_special_tokens=False).input_ids
    texts, stopped = engine_outputs(tokenizer, prompt, ids, stop=["tuples"])
    assert stopped and "".join(texts) == " lists are mutable and "


# -- a SentencePiece-style tokenizer with byte fallback (Llama 2 / Mistral layout), built here ---------------
def build_byte_fallback_tokenizer():
    """BPE over "▁"-joined words, trained on ASCII text, plus the 256 <0xNN> byte tokens: anything else (CJK,
    emoji, accents) is spelled in UTF-8 bytes, one token per byte, and the decoder fuses them back."""
    import json
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = [t for t in pydoc_data.topics.topics.values()][:60]
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = norm
    trainer_tok.train_from_iterator(
        [line.encode("ascii", "ignore").decode() for t in text for line in t.splitlines()],
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_tokenizer():
    return build_byte_fallback_tokenizer()


@pytest.mark.parametrize("text", TEXTS + ["  two leading spaces", "中文 and 日本語 mixed, 🎉!"])
@pytest.mark.parametrize("step", [1, 2])
def test_byte_fallback_stream_equals_full_decode(sp_tokenizer, text, step):
    tok = sp_tokenizer
    prompt = tok("Question: 问题").input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    if any(ord(c) > 127 for c in text):
        assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids), "no byte fallback exercised"
    expected = after_prompt(tok, prompt, ids)
    texts, _ = engine_outputs(tok, prompt, ids, step)
    assert "".join(texts) == expected and "\ufffd" not in expected
    assert all(texts[:-1]) and all("\ufffd" not in t for t in texts), texts


def test_stop_strings_on_byte_fallback_text(sp_tokenizer):
    """A stop string inside a run of byte tokens (a CJK word) stops there, and nothing of it is emitted."""
    tok = sp_tokenizer
    prompt = tok("Question:").input_ids
    ids = tok("lists 数据结构 and more", add_special_tokens=False).input_ids
    texts, stopped = engine_outputs(tok, prompt, ids, stop=["结构 a"])
    assert stopped and "".join(texts) == " lists 数据"
    assert all("\ufffd" not in e and "结" not in e for e in texts)


def test_invalid_bytes_do_not_hold_tokens_forever(sp_tokenizer):
    """Lone continuation bytes are not the start of a character: at most MAX_PARTIAL wait, the rest go out."""
    tok = sp_tokenizer
    byte = tok.convert_tokens_to_ids("<0x80>")
    proc = OutputProcessor(tok, tok("a").input_ids, SamplingParams())
    assert sum(proc.add(byte, finished=False).num_tokens for _ in range(10)) >= 7


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_servers_load_the_tokenizer_autotokenizer_loads(sp_tokenizer, default_model_path, tmp_path, model_type):
    """load_tokenizer (every Triton model's) skips AutoTokenizer's imports where it would pick the generic class;
    the tokenizer must be the same either way: its class, ids, text and chat prompt, on a byte-fallback tokenizer
    saved as each model type (Qwen2's AutoTokenizer overrides the folder's class) and on the default model."""
    import json
    from transformers import AutoTokenizer
    from trellm_backend.triton.tokenization import load_tokenizer
    folder = tmp_path / model_type
    sp_tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    chat = [{"role": "user", "content": "数据 and 🎉"}]
    for path in (str(folder), default_model_path):
        ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(theirs)
        for text in TEXTS:
            ids = theirs(text).input_ids
            assert ours(text).input_ids == ids and ours.decode(ids) == theirs.decode(ids)
        assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
        if theirs.chat_template:
            assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("model", ["preprocess", "postprocess", "vllm_model"])
def test_the_models_that_only_tokenize_load_without_torch(default_model_path, model, tmp_path):
    """What makes the server start 6 s sooner on two cores, with 570 MiB less resident: of the repository's Python
    models only `llm` needs torch. The model file is imported as the Python backend imports it (its utilities
    module stood in for), then the calls its `initialize` makes on the model folder, and on a GPTQ folder, whose
    group size is checked against the INT4 kernels'."""
    for name in os.listdir(default_model_path):
        os.symlink(os.path.join(default_model_path, name), tmp_path / name)
    config = json.load(open(tmp_path / "config.json"))
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    os.unlink(tmp_path / "config.json")
    json.dump(config, open(tmp_path / "config.json", "w"))
    path = os.path.join(REPO, "model_repository", model, "1", "model.py")
    probe = f"""
import importlib.util, sys, types
utils = sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
spec = importlib.util.spec_from_file_location("model", {path!r})
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from trellm_backend.triton.tokenization import load_tokenizer, prompt_char_limit, require_tokenizer_files
for folder in ({default_model_path!r}, {str(tmp_path)!r}):
    require_tokenizer_files(folder); load_tokenizer(folder); prompt_char_limit(folder)
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]
