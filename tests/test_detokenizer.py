"""Streamed text: runs of tokens detokenized without state concatenate to exactly the full decode, and the engine's
text (output_processor.py) is what a stateless step (postprocess) remakes from each output's tokens; with a
byte-fallback tokenizer, runs of byte tokens (valid UTF-8 or not) stream as the whole answer on every entry point."""
import json
import os
import subprocess
import sys
from functools import partial

import pytest
from conftest import REPO

from trellm_backend.engine.detokenizer import TokenRun, prompt_context, run_text
from trellm_backend.engine.output_processor import OutputProcessor
from trellm_backend.engine.request import RequestOutput, SamplingParams

TEXTS = [
    "  leading spaces and a tab\tthen words",
    "数据结构和算法：列表、字典与集合",              # CJK: several byte-level tokens per character
    "emoji 🐍🚀 and a family 👨‍👩‍👧 in a row",
    "combining marks: e\u0301 n\u0303 a\u0308",
    "def f(x):\n    return x ** 2  # squares",
]


def after_prompt(tok, prompt, ids, skip=True):
    """The text as it reads after the prompt (SentencePiece's word-start "▁" is a space there)."""
    return tok.decode(prompt + ids, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)):]


def engine_steps(tok, prompt, ids, step=1, **params) -> list[RequestOutput]:
    """The engine's outputs for `ids` arriving `step` tokens per engine step (as speculation gives), made as
    Scheduler._advance makes them: each step's released tokens with their text, after the context of the step's
    first release; the step of the last token, or of a stop, finishes the request."""
    proc = OutputProcessor(tok, prompt, SamplingParams(**params))
    outs, unsent = [], []
    for i in range(0, len(ids), step):
        context, released, text, cut, finished, reason = None, 0, "", 0, False, None
        for j, t in enumerate(ids[i:i + step]):
            unsent.append(t)
            finished = i + j == len(ids) - 1
            r = proc.add(t, finished=finished)
            if r.num_tokens and context is None:
                context = r.context_ids
            released, text, cut = released + r.num_tokens, text + r.text, r.cut_chars
            if r.stopped or finished:
                finished, reason = True, "stop" if r.stopped else "length"
                break
        outs.append(RequestOutput("r", unsent[:released], finished, reason, text=text, context_ids=context or [],
                                  cut_chars=cut))
        del unsent[:released]
        if finished:
            break
    return outs


def engine_outputs(tok, prompt, ids, step=1, **params):
    """Drive an OutputProcessor over `ids` (engine_steps); check that every output's text is what the stateless
    remake of its tokens gives, as the ensemble's postprocess makes it, also when a responder merges consecutive
    outputs into one response; return the texts and whether a stop ended it."""
    outs = engine_steps(tok, prompt, ids, step, **params)
    texts, merged = [], []
    for o in outs:
        if o.new_token_ids:
            run = TokenRun(o.context_ids, o.new_token_ids, o.cut_chars)
            assert run_text(tok, run, params.get("skip_special_tokens", True)) == o.text, (run, o.text)
            texts.append(o.text)
            merged.append(run)
    for a, b in zip(merged, merged[1:]):    # two outputs sent as one response: the same text
        both = TokenRun(a.context_ids, a.token_ids + b.token_ids, b.cut_chars)
        assert run_text(tok, both) == run_text(tok, a) + run_text(tok, b)
    return texts, outs[-1].finish_reason == "stop"


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
    """Lone continuation bytes can never make a character: each goes out at once, as one U+FFFD."""
    tok = sp_tokenizer
    byte = tok.convert_tokens_to_ids("<0x80>")
    proc = OutputProcessor(tok, tok("a").input_ids, SamplingParams())
    assert [proc.add(byte, finished=False).text for _ in range(10)] == ["\ufffd"] * 10


# -- runs of byte tokens: a byte-fallback decoder renders a whole run at once (valid UTF-8: its text; else one
# U+FFFD per byte, ASCII bytes too), so the stream must hold a run until its rendering is settled --------------
def entry_point_texts(tok, prompt, outs, skip=True) -> dict[str, list[str]]:
    """What each way of serving the engine's outputs sends: llm's text_output at stream_interval 1 to 3 (what
    vllm_model and the OpenAI front door relay), the ensemble's postprocess remake of each llm response, and the
    answers not streamed, without and with the prompt echoed."""
    from trellm_backend.engine.detokenizer import run_texts
    from trellm_backend.triton.llm import ResponsePlan
    text_of = partial(run_text, tok, skip_special_tokens=skip)
    streams = {}
    for name, plan in [("llm", ResponsePlan(True, 1, text_of)), ("llm interval 2", ResponsePlan(True, 2, text_of)),
                       ("llm interval 3", ResponsePlan(True, 3, text_of)), ("whole", ResponsePlan(False, 1, text_of)),
                       ("echoed", ResponsePlan(False, 1, text_of, echo_prompt_ids=prompt))]:
        payloads = [p for p in map(plan.on_output, outs) if p is not None]
        streams[name] = [p.text for p in payloads]
        if name == "llm":
            streams["ensemble"] = run_texts(tok, [p.run for p in payloads], skip)
    return streams


def check_streams(tok, prompt, ids, step, skip=True, **params):
    """Every entry point's stream concatenates to the whole answer, which is transformers' text of the tokens the
    engine released (after the prompt; with it, when echoed), up to a stop string; returns the whole answer."""
    outs = engine_steps(tok, prompt, ids, step, skip_special_tokens=skip, **params)
    streams = entry_point_texts(tok, prompt, outs, skip)
    released = [t for o in outs for t in o.new_token_ids]
    [whole], [echoed] = streams.pop("whole"), streams.pop("echoed")
    for name, texts in streams.items():
        assert "".join(texts) == whole, (name, step, texts, whole)
    reference = after_prompt(tok, prompt, released, skip)
    if outs[-1].cut_chars:
        reference = reference[:len(reference) - outs[-1].cut_chars]
    assert whole == reference, (released, whole, reference)
    full = tok.decode(prompt + released, skip_special_tokens=skip)
    assert echoed == full[:len(full) - outs[-1].cut_chars], (echoed, full)
    return whole, outs


def byte_ids(tok, *values):
    return tok.convert_tokens_to_ids([f"<0x{v:02X}>" for v in values])


def word_ids(tok, text):
    """Tokens of `text` as they read mid-sentence (the tokenizer marks a word start itself: one space less)."""
    return tok(text[1:] if text.startswith(" ") else text, add_special_tokens=False).input_ids


BYTE_RUNS = {  # name: (text before, byte values, text after); None: the run ends the sequence
    "ASCII inside an invalid run": (" a", [0x41, 0xE2, 0x41], " b"),
    "a 4-byte lead cut by ASCII": (" a", [0xF0, 0x9F, 0x41], " b"),
    "a valid character": (" a", [0xE2, 0x82, 0xAC], " b"),
    "valid ASCII bytes": (" a", [0x41, 0x42], " b"),
    "a character, then a stray byte": (" a", [0xE4, 0xB8, 0xAD, 0x80], " b"),
    "an invalid run at the end": (" a", [0x41, 0xE2, 0x41], None),
    "an incomplete run at the end": (" a", [0x41, 0x42, 0xF0, 0x9F], None),
    "a valid run at the end": (" a", [0xF0, 0x9F, 0x8E, 0x89], None),
    "a long invalid run whose tail is ASCII": (" a", [0xE2] + [0x41] * 12, " b"),
    "stray bytes among ASCII": (" a", [0x80, 0x41, 0x80, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x80, 0x41], " b"),
    "a run first": ("", [0x41, 0xE2, 0x41], " b"),
}


@pytest.mark.parametrize("case", BYTE_RUNS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_byte_runs_stream_as_the_whole_answer_on_every_entry_point(sp_tokenizer, case, step):
    tok = sp_tokenizer
    before, values, after = BYTE_RUNS[case]
    ids = (word_ids(tok, before) if before else []) + byte_ids(tok, *values) + (word_ids(tok, after) if after else [])
    for prompt in (tok("Question:").input_ids, tok("Question: 问题").input_ids):   # the second ends in a run
        check_streams(tok, prompt, ids, step)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_special_token_inside_a_byte_run(sp_tokenizer, skip, step):
    """A special token the decode skips leaves the bytes around it one run; shown, it ends the run."""
    tok = sp_tokenizer
    ids = word_ids(tok, " a") + byte_ids(tok, 0x41, 0xE2) + [tok.eos_token_id] + byte_ids(tok, 0x82, 0xAC, 0x41) + \
        word_ids(tok, " b")
    whole, _ = check_streams(tok, tok("Question:").input_ids, ids, step, skip=skip, ignore_eos=True)
    assert whole == (" aA€A b" if skip else " a\ufffd\ufffd</s>\ufffd\ufffd\ufffd b")


@pytest.mark.parametrize("values, stop, whole", [
    ([0x41, 0xE2, 0x41], "A", " a"),                            # ASCII bytes: the run, had it ended there
    ([0x41, 0xE2, 0x41], "\ufffd b", " a\ufffd\ufffd"),          # across the end of an invalid run
    ([0x41, 0xE2, 0x82, 0xAC], "€", " aA"),                       # inside a valid run
    ([0x41, 0xE2, 0x82, 0xAC], "A€", " a"),
    ([0xE2, 0x41, 0x80, 0x41], "\ufffdx", None)])                 # held back as a possible stop, then out whole
@pytest.mark.parametrize("step", [1, 2, 3])
def test_stop_strings_in_byte_runs(sp_tokenizer, values, stop, whole, step):
    """A stop string is matched on the text as it reads if the answer ended at each token (a run a stop ends
    renders as it ends there), as transformers decodes the tokens up to it."""
    tok = sp_tokenizer
    ids = word_ids(tok, " a") + byte_ids(tok, *values) + word_ids(tok, " b c")
    got, outs = check_streams(tok, tok("Question:").input_ids, ids, step, stop=[stop])
    assert (outs[-1].finish_reason == "stop") == (whole is not None)
    assert got == (whole or after_prompt(tok, tok("Question:").input_ids, ids))


def first_stop(tok, prompt, ids, stops, skip=True):
    """The answer as transformers reads it when it ends at the first token whose text holds a stop string (cut
    before it): the text and the number of tokens."""
    for n in range(1, len(ids) + 1):
        text = after_prompt(tok, prompt, ids[:n], skip)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], n
    return after_prompt(tok, prompt, ids, skip), len(ids)


@pytest.mark.parametrize("seed", range(6))
def test_random_byte_runs_stream_as_the_whole_answer(sp_tokenizer, seed):
    """Seeded token sequences heavy in byte tokens (ASCII, lead and continuation bytes, bytes no character has, a
    surrogate's), words and special tokens (skipped or shown), after prompts that end outside a run, in a valid
    one, in an open one or in an invalid one (or no prompt), with and without stop strings: every entry point,
    steps 1 to 3."""
    import random
    tok = sp_tokenizer
    rng = random.Random(seed)
    values = [0x41, 0x42, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x8E, 0x89, 0x80, 0xBF,
              0xC0, 0xFF, 0xED, 0xA0]
    words = [word_ids(tok, w) for w in (" the", " a", "x", " list")]
    prompts = [tok("Question:").input_ids, tok("Question: 问题").input_ids, tok("Q").input_ids + byte_ids(tok, 0xE2),
               tok("Q").input_ids + byte_ids(tok, 0xE2, 0x41, 0x41, 0x41, 0x80, 0x41, 0x41, 0x41, 0x41, 0x41), []]
    for _ in range(12):
        ids = []
        while len(ids) < 30:
            kind = rng.random()
            ids += words[rng.randrange(len(words))] if kind < 0.25 else [tok.eos_token_id] if kind < 0.28 else \
                byte_ids(tok, *(rng.choice(values) for _ in range(rng.randint(1, 8))))
        prompt, skip = rng.choice(prompts), rng.random() < 0.8
        text = after_prompt(tok, prompt, ids, skip)
        at = rng.randrange(len(text))
        stops = [text[at:at + rng.randint(1, 4)]]
        for step in (1, 2, 3):
            check_streams(tok, prompt, ids, step, skip=skip, ignore_eos=True)
            whole, outs = check_streams(tok, prompt, ids, step, skip=skip, ignore_eos=True, stop=stops)
            assert (whole, sum(len(o.new_token_ids) for o in outs)) == first_stop(tok, prompt, ids, stops, skip)


def test_prompt_context_begins_outside_a_byte_run(sp_tokenizer):
    """The prompt's last WINDOW tokens, taken further back to the start of a run of byte tokens they would begin
    inside (the decode of a run's tail alone differs), or to a byte no character begins with where the run before
    it is already invalid (then every byte of the run is one U+FFFD, however it is cut)."""
    from trellm_backend.engine.detokenizer import WINDOW
    tok = sp_tokenizer
    head = tok("Question:").input_ids
    run = byte_ids(tok, *"数据结构".encode())
    assert prompt_context(tok, head + run) == run
    stray = byte_ids(tok, 0xE2, 0x41, 0x80, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41)
    assert prompt_context(tok, head + stray) == stray[2:] and len(stray[2:]) >= WINDOW
    ascii_tail = byte_ids(tok, 0xE2, *[0x41] * 10)
    assert prompt_context(tok, head + ascii_tail) == ascii_tail
    words = word_ids(tok, " the list of words in a row")
    assert prompt_context(tok, head + run + words) == (head + run + words)[-WINDOW:]


def test_a_run_that_turned_invalid_streams_at_once(sp_tokenizer):
    """Held while its bytes could still make characters; once they cannot, each byte is one U+FFFD whatever
    follows, so the run goes out byte by byte (a model stuck on byte tokens still streams)."""
    tok = sp_tokenizer
    proc = OutputProcessor(tok, tok("Question:").input_ids, SamplingParams())
    assert [proc.add(t, finished=False).num_tokens for t in byte_ids(tok, 0x41, 0xE2, 0x82)] == [0, 0, 0]
    assert proc.add(byte_ids(tok, 0x41)[0], finished=False).text == "\ufffd" * 4
    assert [proc.add(t, finished=False).text for t in byte_ids(tok, *[0x41] * 20)] == ["\ufffd"] * 20


@pytest.mark.parametrize("family", ["gemma2-softcap", "phi3-longrope"])
def test_random_weight_models_stream_their_byte_runs_as_the_whole_answer(sp_tokenizer, tmp_path, family):
    """A random-weight Gemma 2 and Phi-3 over the byte-fallback vocabulary say runs of byte tokens, valid or
    not: the engine's streamed text (every entry point) is the whole answer and transformers' text of the tokens."""
    from hf_models import with_tokenizer
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    from trellm_backend.triton.tokenization import load_tokenizer
    sp_tokenizer.save_pretrained(tmp_path / "tokenizer")
    folder = with_tokenizer(family, str(tmp_path / "tokenizer"), str(tmp_path / family))
    tok = load_tokenizer(folder)
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=8 << 20), tokenizer=tok)
    prompts = [tok(p).input_ids for p in ("Question:", "The list", "数据 and more", "x = 1")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    byte_tokens = 0
    for i, p in enumerate(prompts):
        streams = entry_point_texts(tok, p, outs[str(i)])
        tokens = [t for o in outs[str(i)] for t in o.new_token_ids]
        assert len(tokens) == 24
        [whole], [echoed] = streams.pop("whole"), streams.pop("echoed")
        for name, texts in streams.items():
            assert "".join(texts) == whole, (family, i, name, texts, whole)
        assert whole == after_prompt(tok, p, tokens) and echoed == tok.decode(p + tokens, skip_special_tokens=True)
        byte_tokens += sum(tok.convert_ids_to_tokens(t).startswith("<0x") for t in tokens)
    assert byte_tokens >= 8, "the outputs should hold runs of byte tokens"


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
