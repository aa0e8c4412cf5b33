"""Iteration-level scheduling (continuous batching) under a token budget.

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (a decode costs one token,
an unfinished prefill the next chunk of its prompt), then waiting requests in arrival order, up to
`max_num_seqs` running. Prefill and decode tokens share a step. When blocks run out, the most recently admitted
running request is preempted (its blocks freed, its computed count reset) and put back at the head of the
waiting queue; it is recomputed when readmitted. Waiting requests are not admitted in a step that preempted.

The output is plain data for the model runner: which requests, how many new tokens each.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trellm_backend.block_manager import BlockManager
from trellm_backend.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int       # tokens token_ids[num_computed: num_computed + num_new_tokens] run this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a next token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            target = req.num_computed_tokens + n
            while not self.blocks.can_grow(req, target):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:   # it preempted itself
                break
            self.blocks.grow(req, target)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
            i += 1

        # Then waiting requests, in order, while budget, sequence slots and blocks allow.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > budget and not self.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            target = req.num_computed_tokens + n
            if not self.blocks.can_grow(req, target):
                break
            self.waiting.popleft()
            self.blocks.grow(req, target)
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take `req` out of the queues and return its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
