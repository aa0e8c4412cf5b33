"""Detokenization without state: the text a run of tokens adds after the tokens before it.

The text of a run is decode(context + tokens) minus decode(context). It equals the run's share of the full decode
when the context is long enough for the tokenizer's space handling (WINDOW tokens) and both it and the run
begin and end between characters: a character spelled in several byte tokens decodes only whole (a byte-fallback
decoder turns a whole group of byte tokens into U+FFFD when one of them is cut off). The engine
(output_processor.py) cuts runs that way, so the engine, `llm`'s own text_output and the ensemble's `postprocess`
step all make text with this one function from the same tokens and agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

WINDOW = 6          # tokens of context, at least, decoded with each run
MAX_PARTIAL = 3     # a UTF-8 character has at most 4 bytes: at most 3 byte tokens wait for the one completing it
PARTIAL = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character


@dataclass(frozen=True)
class TokenRun:
    """Tokens whose text is wanted, after `context_ids` (the tokens just before them; [] = the sequence's start)."""
    context_ids: list[int]
    token_ids: list[int]
    cut_chars: int = 0          # characters cut off the end (a stop string and what followed it)


def run_texts(tokenizer, runs: list[TokenRun], skip_special_tokens: bool = True) -> list[str]:
    """The text of each run: one batched decode of the contexts, one of the contexts with their tokens."""
    if not runs:
        return []
    before = _decode_batch(tokenizer, [r.context_ids for r in runs], skip_special_tokens)
    after = _decode_batch(tokenizer, [r.context_ids + r.token_ids for r in runs], skip_special_tokens)
    texts = []
    for run, b, a in zip(runs, before, after):
        text = a[len(b):]
        texts.append(text[:len(text) - run.cut_chars] if run.cut_chars else text)
    return texts


def _decode_batch(tokenizer, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """transformers' decode of each sequence without its clean-up, which for a fast tokenizer is exactly its Rust
    tokenizer's decode: one call for the batch (a third of the per-sequence cost in Python)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(seqs, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def run_text(tokenizer, run: TokenRun, skip_special_tokens: bool = True) -> str:
    return run_texts(tokenizer, [run], skip_special_tokens)[0]


def prompt_context(tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last WINDOW tokens, or up to MAX_PARTIAL more so that they begin between characters."""
    start = max(0, len(prompt_ids) - WINDOW)
    for k in range(start, max(0, start - MAX_PARTIAL) - 1, -1):
        if not tokenizer.decode(prompt_ids[k:], skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False).startswith(PARTIAL):
            return list(prompt_ids[k:])
    return list(prompt_ids[start:])
