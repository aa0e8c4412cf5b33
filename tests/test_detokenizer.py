"""Streamed text: deltas of the incremental detokenizer concatenate to exactly the full decode."""
import pytest
from transformers import AutoTokenizer

from trellm_backend.detokenizer import IncrementalDetokenizer

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
