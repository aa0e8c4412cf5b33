"""Streamed text: deltas of the incremental detokenizer concatenate to exactly the full decode."""
import pytest
from transformers import AutoTokenizer

from trellm_backend.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "  leading spaces and a tab\tthen words",
    "数据结构和算法：列表、字典与集合",              # CJK: several byte-level tokens per character
    "emoji 🐍🚀 and a family 👨‍👩‍👧 in a row",
    "combining marks: e\u0301 n\u0303 a\u0308",
    "def f(x):\n    return x ** 2  # squares",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_deltas_concatenate_to_full_decode(tokenizer, text, step):
    prompt = tokenizer("Question:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas), deltas


def test_incomplete_character_is_held_back_then_flushed(tokenizer):
    ids = tokenizer("🐍", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the test needs a character split over several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""           # half a character is not emitted
    assert detok.add(ids[1:]) + detok.flush() == "🐍"


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
    prompt = tok("Question:").input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    if any(ord(c) > 127 for c in text):
        assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids), "no byte fallback exercised"
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    # The text as it reads after the prompt (SentencePiece's word-start "▁" is a space there).
    expected = tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "\ufffd" not in expected


def test_stop_strings_on_byte_fallback_text(sp_tokenizer):
    """A stop string inside a run of byte tokens (a CJK word) stops there, and nothing of it is emitted."""
    from trellm_backend.engine.output_processor import OutputProcessor
    from trellm_backend.engine.request import SamplingParams
    tok = sp_tokenizer
    prompt = tok("Question:").input_ids
    ids = tok("lists 数据结构 and more", add_special_tokens=False).input_ids
    proc = OutputProcessor(tok, prompt, SamplingParams(stop=["结构 a"]))
    emitted, stopped_at = [], None
    for i, t in enumerate(ids):
        text, stopped = proc.add([t], finished=i == len(ids) - 1)
        emitted.append(text)
        if stopped:
            stopped_at = i
            break
    assert "".join(emitted) == " lists 数据" and stopped_at is not None
    assert all("\ufffd" not in e and "结" not in e for e in emitted)
