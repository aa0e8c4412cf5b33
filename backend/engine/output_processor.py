"""Per-request text in the engine process: which tokens' text is settled, and stop strings.

Stop strings are matched on the text, so text is made where tokens are made (as vLLM's output processor does).
Tokens go out together with their text, in runs that begin and end between characters, and each output says
which tokens its text was made after (`context_ids`): so its text is exactly detokenizer.run_text of its tokens,
and a stateless step (the ensemble's `postprocess`) remakes it from the token ids alone. A token waits while it
is one of the first bytes of a character, or while the text could be the start of a stop string; a completed stop
string ends the request in that step, and `cut_chars` says how much of the text (the stop string and what
followed) is cut.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trellm_backend.engine.detokenizer import MAX_PARTIAL, PARTIAL, WINDOW, TokenRun, prompt_context, run_text
from trellm_backend.engine.request import SamplingParams


@dataclass
class Release:
    """The oldest `num_tokens` pending tokens go out now, with their text (made after `context_ids`)."""
    num_tokens: int = 0
    text: str = ""
    context_ids: list[int] = field(default_factory=list)
    cut_chars: int = 0
    stopped: bool = False       # a stop string completed: the request ends here


class OutputProcessor:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tok = tokenizer
        self.skip = params.skip_special_tokens
        # Whole runs released last (the prompt's tail first): a context that begins between characters.
        self.runs = [prompt_context(tokenizer, prompt_ids, self.skip)]
        self.pending: list[int] = []
        self.unsettled = 0      # tokens in a row whose text ended in a partial character
        self.stop = params.stop
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    @property
    def context(self) -> list[int]:
        return [t for run in self.runs for t in run]

    def _text(self, ids: list[int]) -> str:
        return run_text(self.tok, TokenRun(self.context, ids), self.skip)

    def _release(self, n: int, text: str, cut: int = 0, stopped: bool = False) -> Release:
        out = Release(n, text, self.context, cut, stopped)
        self.runs.append(self.pending[:n])
        while sum(map(len, self.runs)) - len(self.runs[0]) >= WINDOW:
            self.runs.pop(0)
        del self.pending[:n]
        return out

    def add(self, token: int, finished: bool, match_stop: bool = True) -> Release:
        """Take one new token; `finished`: the request ends with it, so everything pending goes out."""
        self.pending.append(token)
        text = self._text(self.pending)
        if not finished and text.endswith(PARTIAL) and self.unsettled < MAX_PARTIAL:
            self.unsettled += 1     # the first bytes of a character: wait for the rest (invalid bytes go later)
            return Release()
        self.unsettled = 0
        if self.stop and match_stop:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                return self._release(len(self.pending), text[:cut], len(text) - cut, stopped=True)
        keep = self._partial_match_length(text) if self.stop and match_stop and not finished else 0
        if not keep:
            return self._release(len(self.pending), text)
        # Release the longest run of pending tokens whose text ends before the possible stop string.
        for n in range(len(self.pending) - 1, 0, -1):
            head = self._text(self.pending[:n])
            if head and not head.endswith(PARTIAL) and len(head) <= len(text) - keep:
                return self._release(n, head)
        return Release()

    def flush(self) -> Release:
        """Everything pending, as the end of the text (an abort)."""
        return self._release(len(self.pending), self._text(self.pending)) if self.pending else Release()

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
