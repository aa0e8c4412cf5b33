"""Detokenization without state: the text a run of tokens adds after the tokens before it.

The text of a run is decode(context + tokens) minus decode(context). It equals the run's share of the full decode
when the context is long enough for the tokenizer's space handling (WINDOW tokens) and both it and the run
begin and end between characters: a character spelled in several byte tokens decodes only whole (a byte-level
decoder shows U+FFFD for the bytes of a character cut off). A byte-fallback decoder (SentencePiece-style <0xNN>
tokens) goes further: it renders a whole run of consecutive byte tokens at once, as its text when the run is valid
UTF-8 and as one U+FFFD per byte (ASCII bytes too) when it is not, so a run's text is settled only when the run
ends, or once its bytes can no longer be valid whatever follows (ByteRun). The engine (output_processor.py) cuts
runs that way and begins contexts outside byte runs (context_starts), so the engine, `llm`'s own text_output
and the ensemble's `postprocess` step all make text with this one function from the same tokens and agree exactly.
"""
from __future__ import annotations

import codecs
import json
import weakref
from dataclasses import dataclass

WINDOW = 6          # tokens of context, at least, decoded with each run
MAX_PARTIAL = 3     # a UTF-8 character has at most 4 bytes: at most 3 byte-level tokens wait for the one completing it
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
    """The prompt's last WINDOW tokens, or up to MAX_PARTIAL more so that they begin between characters; with a
    byte-fallback tokenizer, as many more as it takes to begin where context_starts allows."""
    start = max(0, len(prompt_ids) - WINDOW)
    tokens = byte_tokens(tokenizer, skip_special_tokens)
    if tokens is not None:
        first = start      # where the run of byte tokens that `start` may be inside begins, outside any run
        while first > 0 and not tokens.run_ends(prompt_ids[first - 1]):
            first -= 1
        starts = context_starts(tokens, prompt_ids[first:])
        return list(prompt_ids[first + max(k for k in range(start - first + 1) if starts[k]):])
    for k in range(start, max(0, start - MAX_PARTIAL) - 1, -1):
        if not tokenizer.decode(prompt_ids[k:], skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False).startswith(PARTIAL):
            return list(prompt_ids[k:])
    return list(prompt_ids[start:])


# -- byte fallback -----------------------------------------------------------------------------------------------
NO_LEAD = frozenset(range(0x80, 0xC2)) | frozenset(range(0xF5, 0x100))   # bytes no UTF-8 character begins with


@dataclass(frozen=True)
class ByteTokens:
    """A byte-fallback tokenizer's byte tokens (<0x00> .. <0xFF>, what its ByteFallback decoder turns into bytes),
    and the tokens its decode leaves out (special tokens, when skipped): those do not end a run of byte tokens."""
    bytes_of: dict[int, int]        # token id -> its byte
    skipped: frozenset[int]

    def run_ends(self, token: int) -> bool:
        return token not in self.bytes_of and token not in self.skipped


_found: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer, skip_special_tokens: bool = True) -> ByteTokens | None:
    """The tokenizer's byte tokens, found once per tokenizer; None where its decoder has no ByteFallback (byte-level
    BPE, WordPiece, ...) or it has no Rust backend: the partial-character rule alone applies there."""
    try:
        found = _found[tokenizer]
    except KeyError:
        found = _found[tokenizer] = _find_byte_tokens(tokenizer)
    except TypeError:       # not weakly referable: not a transformers tokenizer
        found = _find_byte_tokens(tokenizer)
    return None if found is None else found[skip_special_tokens]


def _find_byte_tokens(tokenizer) -> dict[bool, ByteTokens] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or not _has_byte_fallback(json.loads(decoder.__getstate__())):
        return None
    bytes_of = {}
    for b in range(256):
        for name in (f"<0x{b:02X}>", f"<0x{b:02x}>"):    # the decoder reads either spelling
            token = backend.token_to_id(name)
            if token is not None:
                bytes_of[token] = b
    if not bytes_of:
        return None
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return {True: ByteTokens(bytes_of, special), False: ByteTokens(bytes_of, frozenset())}


def _has_byte_fallback(decoder: dict) -> bool:
    return decoder.get("type") == "ByteFallback" or any(_has_byte_fallback(d) for d in decoder.get("decoders", []))


class ByteRun:
    """Where a sequence stands in its current run of byte tokens, token by token. A run is open while its bytes
    are valid UTF-8 or could still become so: its text depends on bytes to come. Once they cannot (an invalid
    sequence is complete), the run's text is settled, one U+FFFD per byte, and so is each byte the run goes on with.
    (Python's decoder sees a surrogate's invalid bytes one byte later than the Rust decoder: the run waits it.)"""

    def __init__(self, tokens: ByteTokens):
        self.tokens = tokens
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.in_run = False
        self.open = False

    def add(self, token: int) -> bool:
        """Take the next token; True while the tokens end in an open run."""
        b = self.tokens.bytes_of.get(token)
        if b is None:
            if self.in_run and token not in self.tokens.skipped:
                self.in_run = self.open = False
                self.decoder.reset()
            return self.open
        if not self.in_run:
            self.in_run = self.open = True
        if self.open:
            try:
                self.decoder.decode(bytes((b,)))
            except UnicodeDecodeError:
                self.open = False
        return self.open


def context_starts(tokens: ByteTokens, ids: list[int]) -> list[bool]:
    """For each k in 0..len(ids), whether a context may begin at ids[k] (ids[0] being the sequence's start or itself
    such a place): outside any run of byte tokens, since a run's tail alone decodes otherwise than within its run;
    or inside one whose bytes before k are already invalid, on a byte no character begins with (then the run, and
    its part from k, render as one U+FFFD per byte, however the context cuts it). Where the next token the decoder
    sees is not known yet, only outside a run."""
    following: list[int | None] = [None] * (len(ids) + 1)    # the first token at or after k the decoder sees
    for k in range(len(ids) - 1, -1, -1):
        following[k] = following[k + 1] if ids[k] in tokens.skipped else ids[k]
    starts = [True] * (len(ids) + 1)
    run = ByteRun(tokens)
    for k in range(1, len(ids) + 1):
        run.add(ids[k - 1])
        after = following[k]
        if run.in_run and (after is None or after in tokens.bytes_of):
            starts[k] = not run.open and after is not None and tokens.bytes_of[after] in NO_LEAD
    return starts
