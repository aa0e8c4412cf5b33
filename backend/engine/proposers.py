"""Speculative decoding's proposers: cheap guesses of a sequence's next tokens, which the target model then checks
in one forward pass. The model runner calls its proposer after the target's forward pass and sampling, as vLLM v1
runs its drafter; the scheduler appends the guesses to the request's next decode chunk, and the runner's
`num_accepted` keeps the longest prefix the target agrees with. A guess never changes the output, only how many
tokens a step yields.

A proposer sees every chunk of every step it is asked about, so one that keeps state of its own (a draft model's
KV cache) can keep it in step with the target's, and is told when a request's state is void (it finished, was
aborted or preempted, or starts over).

NgramProposer is prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
`max_n` down to `min_n`) and propose the tokens that followed it (a match near the end is read as a repeat of
the span after it, which guesses loops). Outputs that copy spans of their prompt (code
edits, summaries, extraction) are guessed well; free text rarely. Each request keeps an index {n-gram: where its
continuation starts}, extended by the tokens added since the last step, so a lookup costs O(max_n) whatever the
sequence length (scanning the sequence each step would cost the stepping thread O(length) per sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trellm_backend.engine.config import check_prompt_lookup


@dataclass(frozen=True)
class ProposalInput:
    """One chunk of the step just run, as a proposer reads it (plain data, in chunk order)."""
    request_id: str
    token_ids: list[int]   # the request's tokens known after the step (the runner's record: read only)
    start: int             # where the step's chunk began
    block_table: torch.Tensor   # [num_blocks] int32: slots for every position the step may write, lookahead too
    num_tokens: int        # guesses wanted after the last token (0: none, but the chunk ran this step)


class Proposer(Protocol):
    def propose(self, seqs: list[ProposalInput]) -> list[list[int]]:
        """Up to seqs[i].num_tokens guessed tokens following seqs[i].token_ids."""
        ...

    def forget(self, request_id: str) -> None:
        """The request's state is void (finished, aborted, preempted or started over): drop what is kept for it."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        check_prompt_lookup(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        # request id -> ({n-gram: index of the token after its latest occurrence}, tokens indexed so far)
        self.index: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def propose(self, seqs: list[ProposalInput]) -> list[list[int]]:
        return [self.lookup(s.request_id, s.token_ids, s.num_tokens) if s.num_tokens > 0 else [] for s in seqs]

    def lookup(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following `tokens` (which only grow between calls with the same id)."""
        table, done = self.index.setdefault(request_id, ({}, [0]))
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
