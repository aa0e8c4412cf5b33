"""Per-request text in the engine process: incremental detokenization and stop strings.

Stop strings are matched on the text, so text is made where tokens are made (as vLLM's output processor does):
each step's tokens are detokenized (detokenizer.py: complete characters only), the text is searched for a stop
string across token boundaries, and any tail that could be the start of a stop string is held back until the
next tokens settle it. A completed stop string ends the request in that step and is cut from the output, with
the text after it.
"""
from __future__ import annotations

from trellm_backend.engine.detokenizer import WINDOW, IncrementalDetokenizer
from trellm_backend.engine.request import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids[-WINDOW:], params.skip_special_tokens)
        self.stop = params.stop
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.held = ""        # text not yet emitted: it may be the start of a stop string

    def add(self, token_ids: list[int], finished: bool, match_stop: bool = True) -> tuple[str, bool]:
        """New text for `token_ids`, and whether a stop string completed (then the text ends before it).
        `finished`: the request ends with these tokens, so everything held is flushed."""
        text = self.held + self.detok.add(token_ids)
        if finished:
            text += self.detok.flush()
        self.held = ""
        if not self.stop or not match_stop:
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        if not finished:
            keep = self._partial_match_length(text)
            if keep:
                text, self.held = text[:-keep], text[-keep:]
        return text, False

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self.longest_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences of each bad word, as tokenized alone and after a space (how it appears mid-sentence).
    One batched tokenizer call and a set for duplicates: thousands of words cost milliseconds, not seconds."""
    variants = [v for w in words for v in (w, " " + w.lstrip(" "))]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for ids in tokenizer(variants, add_special_tokens=False).input_ids if variants else []:
        if ids and tuple(ids) not in seen:
            seen.add(tuple(ids))
            out.append(ids)
    return out
