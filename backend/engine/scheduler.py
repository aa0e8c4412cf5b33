"""Iteration-level scheduling (continuous batching) under a token budget.

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (a decode costs one token,
an unfinished prefill the next chunk of its prompt, at most `long_prefill_token_threshold` of it), then waiting
requests in arrival order, up to
`max_num_seqs` running. Prefill and decode tokens share a step. When blocks run out, the most recently admitted
running request is preempted (its blocks freed, its computed count reset) and put back at the head of the
waiting queue; it is recomputed when readmitted (mostly from the prefix cache, which keeps its freed blocks).
Waiting requests are not admitted in a step that preempted. A waiting request starts after the longest cached
prefix of its tokens (kv_cache_manager.py).

Speculative decoding: the guesses a request gets in a step were proposed after its previous step, by the model
runner's proposer (proposers.py, draft.py), as vLLM v1's drafter does. Once the step is planned, the budget it
left over goes to those guesses, appended to decode chunks, while no more than `speculative_disable_batch_size`
sequences run (past that, a step is no longer bound by reading the weights, and verifying guesses costs more than it
saves: perf/RESULTS.md), and only for requests whose guesses have been paying: one whose recent acceptance fell
below `MIN_ACCEPTANCE` asks for a single token every `PROBE_EVERY` steps until its guesses are right again (failed
guesses cost a CPU step about as much as extra sequences do). Each sampling chunk says how many guesses to propose
for the next step; a draft model writes its K/V at those positions while guessing, so it gets slots for them now
(lookahead slots, while free blocks allow). The guesses get KV slots like any token and count as computed; after
the forward pass, `verify` takes back the rejected ones (vLLM v1 does the same) and returns blocks that only they
needed.

The scheduler alone advances request progress: once a step is planned, each scheduled request's
`num_computed_tokens` already counts that step's tokens (vLLM v1 does the same), and the output is plain data fixed
at planning time (where each chunk starts, its tokens, its block table, what sampling its rows reads, its adapter),
so the model runner and the sampler read facts that no later update can change and never see a live `Request`.
Only the scheduler and the engine hold those. The scheduler also applies a step's outcome (`update_from_output`, as
vLLM v1's does): the sampled tokens appended, stops and lengths checked, finished requests' blocks returned.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from trellm_backend.engine.kv_cache_manager import KVCacheManager
from trellm_backend.engine.request import Request, RequestOutput, Status, request_output
from trellm_backend.engine.sampler import SampledToken, SamplingRow
from trellm_backend.engine.stats import SchedulerStats

log = logging.getLogger("trellm")


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int                # position of the first new token (the request's computed tokens before this step)
    token_ids: list[int]      # the tokens run this step: token_ids[start:start + num_new_tokens]
    # The request's block table for this step, as what changed since its previous chunk (engine/block_tables.py):
    # its length, the blocks appended at its end, and how many leading blocks a sliding window has dropped.
    num_blocks: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    num_dropped: int = 0
    # One row per sampled position: none when the chunk ends before the known tokens do (a prefill chunk), one
    # after the last token, and with guesses one at each guess's position before that.
    sampling: tuple[SamplingRow, ...] = ()
    draft_token_ids: list[int] = field(default_factory=list)   # guesses at the end of token_ids, to verify
    adapter: object | None = None   # the request's LoRA adapter (models/lora.LoraAdapter), or None
    rope_long: bool = False   # longrope: rotate with the long factors (the sequence is past the pretraining length)
    # Speculation: guesses to propose after this step for the next one, by how many of this step's guesses the
    # target accepts (what the scheduler will allow the request then: scheduler._guesses_wanted).
    guesses_wanted: tuple[int, ...] = (0,)
    # With speculation, on the first chunk of a request's run on its blocks (admitted, or again after a preemption):
    # its tokens before `start` (the cached prefix), so the runner's record of its tokens is whole.
    prefix_ids: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return bool(self.sampling)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Requests whose per-request state in the runner is void: finished or aborted since the last step, preempted,
    # or restarted from their first token (longrope). The runner drops it before running the step.
    reset_ids: list[str] = field(default_factory=list)


def sampling_row(req: Request) -> SamplingRow:
    """What sampling `req`'s next token reads of it, as it stands now. The tokens are copied only for a request
    whose penalties or bad words read them."""
    p = req.params
    history = list(req.token_ids) if p.needs_penalties or p.bad_words_ids else []
    return SamplingRow(p, req.num_prompt_tokens, req.num_tokens, history, req.generator, req.grammar is not None)


# A request's acceptance rate (a moving average over its verified steps) under which it stops guessing but for a
# one-token probe every PROBE_EVERY decode steps; ACCEPTANCE_DECAY weighs the past against the latest step.
MIN_ACCEPTANCE = 0.3
PROBE_EVERY = 8
ACCEPTANCE_DECAY = 0.7


def decayed(acceptance: float, latest: float) -> float:
    """A request's acceptance rate after a step whose guesses were accepted at the rate `latest`."""
    return ACCEPTANCE_DECAY * acceptance + (1 - ACCEPTANCE_DECAY) * latest


@dataclass
class SpecCounters:
    """Speculative decoding since start, with vLLM's meanings: drafts (a chunk with guesses), guessed tokens,
    accepted ones, and accepted ones by position in the guess."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 num_speculative_tokens: int = 0, speculative_disable_batch_size: int = 0,
                 lookahead_slots: bool = False, max_loras: int = 0, long_rope_from: int | None = None,
                 eos_token_ids: frozenset[int] = frozenset()):
        """`lookahead_slots`: the proposer writes K/V at the positions it guesses (a draft model), so a request
        that asks for guesses gets slots for them in the step before. `eos_token_ids`: the model's end of
        generation, which finishes a request unless it ignores EOS."""
        self.kv = kv_cache_manager
        self.eos_token_ids = eos_token_ids
        self.long_rope_from = long_rope_from   # longrope's pretraining length (models/rope.py), or None
        self.max_loras = max_loras      # most LoRA adapters among the running requests (0: no limit)
        self.num_speculative_tokens = num_speculative_tokens
        self.lookahead_slots = lookahead_slots
        self.speculative_disable_batch_size = speculative_disable_batch_size
        self.spec = SpecCounters(accepted_per_pos=[0] * num_speculative_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Most prompt tokens one request may prefill in a step (0: no cap), so a long prompt leaves room in each
        # step for the prompts that arrive behind it. Only with chunked prefill.
        capped = enable_chunked_prefill and long_prefill_token_threshold > 0
        self.prefill_cap = long_prefill_token_threshold if capped else max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}     # by id: those added and not yet finished or aborted
        self.num_preemptions = 0
        self.reset_ids: list[str] = []     # for the next step's output

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _schedule(self, out: SchedulerOutput, planned: list[Request], req: Request, n: int,
                  first: bool = False) -> None:
        """Plan `n` tokens of `req` for this step and count them as computed (`first`: its run on its blocks starts
        with this chunk)."""
        start = req.num_computed_tokens
        self.kv.drop_outside_window(req, start)
        req.num_computed_tokens = start + n
        samples = req.num_computed_tokens == req.num_tokens
        prefix = req.token_ids[:start] if first and self.num_speculative_tokens else None
        out.chunks.append(ScheduledChunk(req.request_id, start, req.token_ids[start:start + n],
                                         sampling=(sampling_row(req),) if samples else (), adapter=req.lora,
                                         rope_long=req.rope_long, prefix_ids=prefix))
        planned.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        planned: list[Request] = []     # the request of each chunk
        budget = self.max_num_batched_tokens

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            restarted = self._rope_regime(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.prefill_cap)
            target = req.num_computed_tokens + n
            while not self.kv.can_allocate_slots(req, target):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:   # it preempted itself
                break
            self.kv.allocate_slots(req, target)
            self._schedule(out, planned, req, n, first=restarted)
            budget -= n
            i += 1

        # Then waiting requests, in order, while budget, sequence slots and blocks allow.
        # A cached prefix costs no budget: only the tokens after it are computed.
        adapters = {r.lora.name for r in self.running if r.lora is not None} if self.max_loras else set()
        passed_over = []    # requests of an adapter that would exceed max_loras: they keep their place
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.max_loras and req.lora is not None and req.lora.name not in adapters:
                if len(adapters) >= self.max_loras:
                    passed_over.append(self.waiting.popleft())
                    continue
                adapters.add(req.lora.name)
            self._rope_regime(req)
            hit = self.kv.get_computed_blocks(req)
            computed = len(hit) * self.kv.block_size
            remaining = req.num_tokens - computed
            # Without chunked prefill a prompt waits for a step with room for all of it; one longer than a whole
            # step's budget (a long prompt, or a preempted request's prompt plus output) is chunked regardless.
            if not self.enable_chunked_prefill and budget < remaining <= self.max_num_batched_tokens:
                break
            n = min(remaining, budget, self.prefill_cap)
            if not self.kv.can_allocate(req, hit, computed + n):
                break
            self.waiting.popleft()
            self.kv.allocate(req, hit, computed + n)
            req.num_computed_tokens = computed
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
                self.kv.count_prefix_query(req, hit)
            if not req.times.first_scheduled_ns:
                req.times.first_scheduled_ns = time.time_ns()
            req.status = Status.RUNNING
            self.running.append(req)
            self._schedule(out, planned, req, n, first=True)
            budget -= n
        self.waiting.extendleft(reversed(passed_over))
        if self.num_speculative_tokens and out.chunks:
            self._add_guesses(out, planned, budget)
        for i, (c, req) in enumerate(zip(out.chunks, planned)):
            table = self.kv.block_ids(req.request_id)
            out.chunks[i] = dataclasses.replace(c, num_blocks=len(table), new_block_ids=table[req.num_blocks_sent:],
                                                num_dropped=self.kv.dropped(req.request_id))
            req.num_blocks_sent = len(table)
        if any(c.adapter is not None for c in out.chunks):
            # Each adapter's chunks side by side (the base's first): its tokens are then one slice of the step's
            # batch, which its LoRA term reads and writes in place (models/lora.py).
            out.chunks.sort(key=lambda c: ("", 0) if c.adapter is None else ("+" + c.adapter.name, id(c.adapter)))
        out.reset_ids, self.reset_ids = self.reset_ids, []
        return out

    def _add_guesses(self, out: SchedulerOutput, planned: list[Request], budget: int) -> None:
        """Give decode chunks the guesses proposed for them after the last step, from the budget and free blocks
        the step left over, and ask each sampling chunk for the next step's guesses. The guesses never take a
        sampled token past max_tokens or the context (a step yields at most its guesses plus one)."""
        speculate = len(self.running) <= self.speculative_disable_batch_size
        free = self.kv.num_free
        for i, (c, req) in enumerate(zip(out.chunks, planned)):
            guesses, req.spec_token_ids = req.spec_token_ids, []
            if not c.samples:
                continue
            room = min(req.params.max_tokens - req.num_output_tokens - 1, req.max_len - req.num_tokens - 1)
            k = 0
            if speculate and c.num_new_tokens == 1 and req.params.speculative_decoding:
                k = min(self._guesses_for(req), len(guesses), budget, room)
                while k > 0 and self.kv.blocks_missing(req, req.num_computed_tokens + k) > free:
                    k -= 1
            drafts = guesses[:k]
            if drafts:
                budget -= k
                free -= self.kv.blocks_missing(req, req.num_computed_tokens + k)
                self.kv.allocate_slots(req, req.num_computed_tokens + k)
                req.num_computed_tokens += k
            # The next step's guesses: this step yields at least one token, so at most room - 1 are of use.
            wanted_by_verdict = (0,)
            if speculate and req.params.speculative_decoding:
                wanted_by_verdict = tuple(max(0, min(w, room - 1)) for w in self._guesses_wanted(req, len(drafts)))
            wanted = max(wanted_by_verdict)
            if wanted and self.lookahead_slots:
                while wanted > 0 and self.kv.blocks_missing(req, req.num_computed_tokens + wanted) > free:
                    wanted -= 1
                free -= self.kv.blocks_missing(req, req.num_computed_tokens + wanted)
                self.kv.allocate_slots(req, req.num_computed_tokens + wanted)
                wanted_by_verdict = tuple(min(w, wanted) for w in wanted_by_verdict)
            req.spec_lookahead = wanted if self.lookahead_slots else 0
            if drafts or wanted:
                # Row j follows the first j guesses, so penalties, bad words and min_tokens see the sequence as it
                # would be had they been generated.
                rows = tuple(c.sampling[0].after(drafts[:j]) for j in range(len(drafts) + 1))
                out.chunks[i] = dataclasses.replace(c, token_ids=c.token_ids + drafts, sampling=rows,
                                                    draft_token_ids=drafts, guesses_wanted=wanted_by_verdict)

    def _guesses_for(self, req: Request) -> int:
        """How many tokens `req` may guess this step: all, or while its guesses keep failing a probe of one now and
        then (so a request whose text turns repetitive starts guessing again). Called once per decode step."""
        if req.spec_acceptance >= MIN_ACCEPTANCE:
            return self.num_speculative_tokens
        req.spec_steps_since_probe += 1
        if req.spec_steps_since_probe < PROBE_EVERY:
            return 0
        req.spec_steps_since_probe = 0
        return 1

    def _guesses_wanted(self, req: Request, num_drafts: int) -> tuple[int, ...]:
        """How many guesses to propose for `req`'s next step, by how many of this step's `num_drafts` guesses the
        target accepts: what `_guesses_for` will allow then, with that verdict in."""
        due = req.spec_steps_since_probe + 1 >= PROBE_EVERY
        acceptance = [req.spec_acceptance] if not num_drafts else \
            [decayed(req.spec_acceptance, a / num_drafts) for a in range(num_drafts + 1)]
        return tuple(self.num_speculative_tokens if a >= MIN_ACCEPTANCE else int(due) for a in acceptance)

    def verify(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Apply the runner's verdict on a chunk's guesses (sampler.num_accepted): the rejected ones were not
        computed after all, and blocks only they used go back; lookahead slots for the next guesses stay."""
        req.num_computed_tokens -= num_drafts - num_accepted
        self.kv.trim(req, req.num_computed_tokens + req.spec_lookahead)
        req.num_blocks_sent = min(req.num_blocks_sent, len(self.kv.block_ids(req.request_id)))
        req.spec_acceptance = decayed(req.spec_acceptance, num_accepted / num_drafts)
        s = self.spec
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1

    def _rope_regime(self, req: Request) -> None:
        """Longrope, as transformers runs it: a sequence longer than the pretraining length has every token rotated
        with the long factors, so the step at which one grows past it recomputes all its tokens (what it holds was
        rotated with the short ones). Its blocks and their prefix-cache hashes go; the new salt keeps the two
        rotations' blocks apart in the cache. Returns whether it started over."""
        if self.long_rope_from is None or req.rope_long or req.num_tokens <= self.long_rope_from:
            return False
        req.rope_long = True
        req.cache_salt = f"{req.cache_salt or ''}|rope:long"
        self.kv.free(req)
        self._void(req)
        return True

    def _void(self, req: Request) -> None:
        """`req` holds no blocks now: nothing of its computed state stands, in the runner either."""
        req.num_computed_tokens = req.num_blocks_sent = 0
        req.spec_token_ids, req.spec_lookahead = [], 0
        self.reset_ids.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, keep_hashes=True)
        self._void(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        req.times.preempted_ns.append(time.time_ns())
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take `req` out of the queues and return its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        self.reset_ids.append(req.request_id)
        del self.requests[req.request_id]
        req.status = Status.FINISHED
        req.finish_reason = reason

    # -- a step's results ---------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: list[list[SampledToken]],
                           guesses: dict[str, list[int]]) -> list[RequestOutput]:
        """Apply what the runner made of the step `out` planned (runner.RunnerOutput: the tokens of each sampling
        chunk, in chunk order, and the guesses proposed for the next step): an output for each request that got
        tokens, those that finished taken out of the queues with their blocks returned."""
        rows = iter(sampled)
        return [self._advance(self.requests[c.request_id], c, next(rows), guesses.get(c.request_id, []))
                for c in out.chunks if c.samples]

    def _advance(self, req: Request, chunk: ScheduledChunk, rows: list[SampledToken],
                 guesses: list[int]) -> RequestOutput:
        """Append the step's tokens to `req`: the guesses the target sampled the same token for, then the target's
        token at the first disagreement (or after the last guess); stop at the first token that finishes the request
        (the rest are dropped, so max_tokens and stops are never overshot). The output carries the tokens whose text
        is settled (output_processor.py); the rest wait in `req.unsent`. `guesses`: those proposed for the
        request's next step."""
        if chunk.draft_token_ids:
            self.verify(req, len(chunk.draft_token_ids), len(rows) - 1)
        if req.generator is not None and rows[-1].rng_state is not None:
            req.generator.set_state(rows[-1].rng_state)
        now = time.time_ns()
        req.times.first_token_ns = req.times.first_token_ns or now
        req.times.last_token_ns = now
        texts, context, cut, released, reason = [], None, 0, 0, None
        for s in rows:
            token = s.token_id
            req.token_ids.append(token)
            req.unsent.append(s)
            if s.logprob is not None:
                req.cumulative_logprob += s.logprob
            reason = self._finish_reason(req, token)
            if req.grammar is not None:
                if not req.grammar.accept_token(token):
                    log.warning("%s: token %d is outside its grammar; ending it", req.request_id, token)
                    reason = "stop"
                elif req.grammar.is_terminated():   # the grammar took a stop token: done, ignore_eos or not
                    reason = "stop"
            if req.output_processor is None:
                released = len(req.unsent)
            else:
                # Like EOS, stop strings count only once min_tokens are out.
                r = req.output_processor.add(token, reason is not None,
                                             req.num_output_tokens >= req.params.min_tokens)
                if r.num_tokens and context is None:
                    context = r.context_ids
                released, cut = released + r.num_tokens, r.cut_chars
                texts.append(r.text)
                reason = "stop" if r.stopped else reason
            if reason:
                break
        if reason:
            self.finish(req, reason)
        else:
            req.spec_token_ids = guesses
        return request_output(req, released, "".join(texts), context, cut)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_len:
            return "length"
        return None

    def make_stats(self) -> SchedulerStats:
        kv = self.kv
        s = self.spec
        return SchedulerStats(len(self.running), len(self.waiting), kv.num_used, kv.num_blocks, self.num_preemptions,
                              kv.num_queries, kv.num_hits, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                              tuple(s.accepted_per_pos))
