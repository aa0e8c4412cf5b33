"""Speculative decoding's proposers: cheap guesses of a sequence's next tokens, which the target model then checks
in one forward pass (the scheduler appends them to a decode chunk; its `verify` keeps the longest prefix the target
agrees with). A guess never changes the output, only how many tokens a step yields.

A proposer sees every chunk of every step it is asked about, so one that keeps state of its own (a draft model's
KV cache) can keep it in step with the target's, and is told when a request leaves.

NgramProposer is prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
`max_n` down to `min_n`) and propose the tokens that followed it (a match near the end is read as a repeat of
the span after it, which guesses loops). Outputs that copy spans of their prompt (code
edits, summaries, extraction) are guessed well; free text rarely. Each request keeps an index {n-gram: where its
continuation starts}, extended by the tokens added since the last step, so a lookup costs O(max_n) whatever the
sequence length (scanning the sequence each step would cost the stepping thread O(length) per sequence).
"""
from __future__ import annotations

from typing import Protocol

from trellm_backend.engine.config import check_prompt_lookup
from trellm_backend.engine.request import Request


class Proposer(Protocol):
    def propose(self, chunks: list, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] guessed tokens following chunk i's tokens (0: none wanted, but the chunk still runs
        this step). `chunks` are the step's ScheduledChunks, in order; requests[i] is chunk i's request, which a
        proposer only reads (its tokens so far)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop what is kept for it."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        check_prompt_lookup(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        # request id -> ({n-gram: index of the token after its latest occurrence}, tokens indexed so far)
        self.index: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def propose(self, chunks: list, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [self.lookup(r, k) if k > 0 else [] for r, k in zip(requests, num_tokens)]

    def lookup(self, req: Request, k: int) -> list[int]:
        tokens = req.token_ids
        table, done = self.index.setdefault(req.request_id, ({}, [0]))
        # Index every n-gram whose next token is known: the one ending just before position t continues at t.
        for t in range(max(done[0], 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, t) + 1):
                table[tuple(tokens[t - n:t])] = t
        done[0] = len(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            at = table.get(tuple(tokens[-n:]))
            if at is not None:
                # A match close to the end reads past it as a repeat: the sequence is taken to be periodic.
                span = tokens[at:at + k]
                return (span * (k // len(span) + 1))[:k]
        return []

    def forget(self, request_id: str) -> None:
        self.index.pop(request_id, None)
