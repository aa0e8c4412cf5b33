"""Iteration-level scheduling (continuous batching) under a token budget.

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (a decode costs one token,
an unfinished prefill the next chunk of its prompt, at most `long_prefill_token_threshold` of it), then waiting
requests in arrival order, up to
`max_num_seqs` running. Prefill and decode tokens share a step. When blocks run out, the most recently admitted
running request is preempted (its blocks freed, its computed count reset) and put back at the head of the
waiting queue; it is recomputed when readmitted (mostly from the prefix cache, which keeps its freed blocks).
Waiting requests are not admitted in a step that preempted. A waiting request starts after the longest cached
prefix of its tokens (kv_cache_manager.py).

The output is plain data for the model runner: which requests, how many new tokens each.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trellm_backend.engine.kv_cache_manager import BlockManager
from trellm_backend.engine.request import Request, Status


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
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Most prompt tokens one request may prefill in a step (0: no cap), so a long prompt leaves room in each
        # step for the prompts that arrive behind it. Only with chunked prefill.
        capped = enable_chunked_prefill and long_prefill_token_threshold > 0
        self.prefill_cap = long_prefill_token_threshold if capped else max_num_batched_tokens
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
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.prefill_cap)
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
        # A cached prefix costs no budget: only the tokens after it are computed.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.blocks.find_cached_prefix(req)
            computed = len(hit) * self.blocks.block_size
            remaining = req.num_tokens - computed
            # Without chunked prefill a prompt waits for a step with room for all of it; one longer than a whole
            # step's budget (a long prompt, or a preempted request's prompt plus output) is chunked regardless.
            if not self.enable_chunked_prefill and budget < remaining <= self.max_num_batched_tokens:
                break
            n = min(remaining, budget, self.prefill_cap)
            if not self.blocks.can_admit(req, hit, computed + n):
                break
            self.waiting.popleft()
            self.blocks.admit(req, hit, computed + n)
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
