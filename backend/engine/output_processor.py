"""Per-request text in the engine process: which tokens' text is settled, and stop strings.

Stop strings are matched on the text, so text is made where tokens are made (as vLLM's output processor does).
Tokens go out together with their text, in runs that begin and end between characters, and each output says
which tokens its text was made after (`context_ids`): so its text is exactly detokenizer.run_text of its tokens,
and a stateless step (the ensemble's `postprocess`) remakes it from the token ids alone. A token waits while it
is one of the first bytes of a character, or while the text could be the start of a stop string; a completed stop
string ends the request in that step, and `cut_chars` says how much of the text (the stop string and what
followed) is cut. With a byte-fallback tokenizer a run of byte tokens waits whole until it ends or its bytes can
no longer be valid UTF-8 (detokenizer.ByteRun), and a context begins only where detokenizer.context_starts allows:
so the streamed text is exactly the whole answer's, invalid runs included. A run whose bytes stay valid has no
bound but its end (the answer's at the latest): its text depends on every byte of it, so no earlier text would be
exact. Stop strings are matched on the text as it reads if the answer ended at the token, which is how it ends
when one is found.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trellm_backend.engine.detokenizer import (MAX_PARTIAL, PARTIAL, WINDOW, ByteRun, TokenRun, byte_tokens,
                                               context_starts, prompt_context, run_text)
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
        # A byte-fallback tokenizer: the run of byte tokens the sequence is in, and for each pending token whether a
        # release may end after it (it splits no run whose text is not settled). None: no byte fallback.
        self.byte_tokens = byte_tokens(tokenizer, self.skip)
        if self.byte_tokens is not None:
            self.byte_run = ByteRun(self.byte_tokens)
            for t in self.runs[0]:
                self.byte_run.add(t)
            self.may_end: list[bool] = []

    @property
    def context(self) -> list[int]:
        return [t for run in self.runs for t in run]

    def _text(self, ids: list[int]) -> str:
        return run_text(self.tok, TokenRun(self.context, ids), self.skip)

    def _release(self, n: int, text: str, cut: int = 0, stopped: bool = False) -> Release:
        out = Release(n, text, self.context, cut, stopped)
        self.runs.append(self.pending[:n])
        del self.pending[:n]
        if self.byte_tokens is None:
            while sum(map(len, self.runs)) - len(self.runs[0]) >= WINDOW:
                self.runs.pop(0)
        else:
            del self.may_end[:n]
            self._trim_context()
        return out

    def _trim_context(self):
        """Drop the oldest released runs that leave WINDOW tokens and a context beginning where it may: after a
        token that ends any run of byte tokens, or where context_starts allows (looked at only then). An invalid
        run that goes on in ASCII or lead bytes keeps its context back to its start, or to its last byte no
        character begins with."""
        total = sum(map(len, self.runs))
        at, drop, starts = 0, 0, None
        for k, run in enumerate(self.runs[:-1]):
            at += len(run)
            if total - at < WINDOW:
                break
            if run and not self.byte_tokens.run_ends(run[-1]):
                if starts is None:
                    starts = context_starts(self.byte_tokens, self.context)
                if not starts[at]:
                    continue
            drop = k + 1
        del self.runs[:drop]

    def _track(self, token: int) -> bool:
        """Follow the run of byte tokens; True while the tokens end in one whose text is not settled."""
        was_open = self.byte_run.open
        held = self.byte_run.add(token)
        if was_open and not self.byte_run.in_run:
            # The run ended before this token: a release may end after its last byte, and the skipped tokens after it.
            i = len(self.may_end) - 1
            while i >= 0 and self.pending[i] in self.byte_tokens.skipped:
                self.may_end[i] = True
                i -= 1
            if i >= 0:
                self.may_end[i] = True
        self.may_end.append(not held)
        return held

    def add(self, token: int, finished: bool, match_stop: bool = True) -> Release:
        """Take one new token; `finished`: the request ends with it, so everything pending goes out."""
        self.pending.append(token)
        held = self.byte_tokens is not None and self._track(token)
        stops = bool(self.stop) and match_stop
        if held and not finished and not stops:
            return Release()        # a run of byte tokens whose text depends on bytes to come
        text = self._text(self.pending)
        if not finished and self.byte_tokens is None and text.endswith(PARTIAL) and self.unsettled < MAX_PARTIAL:
            self.unsettled += 1     # the first bytes of a character: wait for the rest (invalid bytes go later)
            return Release()
        self.unsettled = 0
        if stops:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                return self._release(len(self.pending), text[:cut], len(text) - cut, stopped=True)
        if held and not finished:
            return Release()
        keep = self._partial_match_length(text) if stops and not finished else 0
        if not keep:
            return self._release(len(self.pending), text)
        # Release the longest run of pending tokens whose text ends before the possible stop string (and splits no
        # byte run whose text is not settled: a settled one may end in U+FFFD).
        for n in range(len(self.pending) - 1, 0, -1):
            if self.byte_tokens is not None and not self.may_end[n - 1]:
                continue
            head = self._text(self.pending[:n])
            if head and (self.byte_tokens is not None or not head.endswith(PARTIAL)) and len(head) <= len(text) - keep:
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
