"""Incremental detokenization: text deltas whose concatenation is exactly the full decode.

Each new token is decoded together with a window of earlier tokens, and only the text beyond what the window
already produced is emitted; a delta that ends in an incomplete character (U+FFFD from a split UTF-8 byte
sequence) is held back until later tokens complete it, and flushed at the end.
"""
from __future__ import annotations

WINDOW = 6   # earlier tokens decoded with each new one; enough for space handling and multi-byte characters


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context_ids or [])
        self.prefix_offset = max(0, len(self.ids) - WINDOW)   # start of the decoding window
        self.read_offset = len(self.ids)                      # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        # The tokens just emitted become the next window.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
