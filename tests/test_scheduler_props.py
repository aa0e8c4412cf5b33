"""Property tests of the scheduler and block manager, with a cheap fake in place of the model runner (and, in some
workloads, a fake proposer of speculative guesses, some right and some wrong).

The fake "computes" a token by writing its id into a fake KV pool at the slot its block table gives, "attends" by
reading every earlier position back through the table, and derives the next token from what it read: so a
prefix-cache hit that handed out wrong contents, a block shared while still written, or a block table gone stale
would change the outputs (and fail the invariant test's direct check too). With a sliding window it reads only the
window's positions, and a table entry dropped while a query still needed it fails the read.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from trellm_backend.engine.block_tables import BlockTables
from trellm_backend.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager, blocks_for
from trellm_backend.engine.request import Request, SamplingParams, Status
from trellm_backend.engine.scheduler import ScheduledChunk, Scheduler

pytestmark = pytest.mark.unit

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21], [30] * 9, []]


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 50


class FakeRunner:
    """The runner's side of a step's plain data: block tables rebuilt from each chunk's delta (engine/block_tables.py,
    started small so that it grows), void rows dropped on reset_ids."""

    def __init__(self):
        self.tables = BlockTables(1, 1)

    def tables_of(self, out) -> dict[str, list[int]]:
        for rid in out.reset_ids:
            self.tables.release(rid)
        for c in out.chunks:
            self.tables.update(c.request_id, c.new_block_ids, c.num_blocks, c.num_dropped)
        return {c.request_id: self.tables.table(c.request_id).tolist() for c in out.chunks}


def fake_forward(kv: list[list[int]], block_size: int, chunk: ScheduledChunk, table: list[int],
                 window: int = 0) -> list[int]:
    """Write the chunk's tokens at the slots of its block table, then read back every position it attends to: from
    the first query's window on (window > 0), else from 0."""
    end = chunk.start + chunk.num_new_tokens
    assert len(table) * block_size >= end
    for pos, token in enumerate(chunk.token_ids, chunk.start):
        assert table[pos // block_size] != NULL_BLOCK, "a new token's slot was dropped"
        kv[table[pos // block_size]][pos % block_size] = token
    first = max(0, chunk.start - window + 1) if window else 0
    assert all(table[pos // block_size] != NULL_BLOCK for pos in range(first, end)), \
        "a block still inside a query's window was dropped"
    return [kv[table[pos // block_size]][pos % block_size] for pos in range(first, end)]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(4, 40))
    pool = num_blocks * block_size
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(0, 49), min_size=0 if prefix else 1, max_size=20))
        prompt = (prefix + tail)[: pool - 1]
        arrival = draw(st.integers(0, 30))
        cancel_at = draw(st.one_of(st.none(), st.integers(arrival, arrival + 40)))
        salt = draw(st.sampled_from([None, None, "tenant-b"]))
        reqs.append((arrival, prompt, draw(st.integers(1, 12)), cancel_at, salt))
    return dict(block_size=block_size, num_blocks=num_blocks, reqs=reqs,
                max_num_seqs=draw(st.integers(1, 6)), budget=draw(st.integers(1, 24)),
                chunked=draw(st.booleans()), prefix_caching=draw(st.booleans()), cap=draw(st.integers(0, 8)),
                spec_k=draw(st.sampled_from([0, 0, 1, 3])), spec_seed=draw(st.integers(0, 1000)),
                lookahead=draw(st.booleans()), window=draw(st.sampled_from([0, 0, 1, 3, 6])))


class FakeGuesses:
    """Guesses the fake model's true next tokens for a pseudo-random number of positions, then wrong ones, so
    verification accepts some and rejects the rest."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def guess(self, tokens: list[int], k: int) -> list[int]:
        tokens, guess = list(tokens), []
        right = self.rng.randint(0, k)
        for j in range(k):
            t = next_token(tokens)
            guess.append(t if j < right else (t + 1) % 50)
            tokens.append(guess[-1])
        return guess


def check_invariants(bm: KVCacheManager, sched: Scheduler, out, budget: int) -> None:
    assert sum(c.num_new_tokens for c in out.chunks) <= budget
    assert len(sched.running) <= sched.max_num_seqs
    refs = [0] * bm.num_blocks
    for r in sched.running:
        assert r.status is Status.RUNNING
        assert len(bm.block_ids(r.request_id)) >= blocks_for(r.num_computed_tokens, bm.block_size)
        for b in bm.block_ids(r.request_id):
            if b != NULL_BLOCK:
                refs[b] += 1
    for r in sched.waiting:
        assert r.status is Status.WAITING and bm.block_ids(r.request_id) == [] and r.num_computed_tokens == 0
    assert refs == bm.ref_count, "reference counts must equal the block tables' use of each block"
    free = set(bm.free_ids)
    assert len(free) == len(bm.free_ids)
    assert all((refs[b] == 0) == (b in free) for b in range(bm.num_blocks)), "a block is both free and used"
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_and_kv_cache_manager_invariants(w):
    bs = w["block_size"]
    bm = KVCacheManager(w["num_blocks"], bs, w["prefix_caching"], window=w["window"])
    sched = Scheduler(bm, w["max_num_seqs"], w["budget"], w["chunked"], w["cap"], num_speculative_tokens=w["spec_k"],
                      speculative_disable_batch_size=4, lookahead_slots=w["lookahead"])
    proposer = FakeGuesses(w["spec_seed"])
    runner = FakeRunner()
    pool_tokens = w["num_blocks"] * bs
    kv = [[-1] * bs for _ in range(w["num_blocks"])]
    pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1][0])
    live: dict[int, Request] = {}
    done: dict[int, str] = {}
    step = 0
    while pending or sched.has_work():
        assert step < 5000, "the scheduler stopped making progress (deadlock or starvation)"
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, _, salt) = pending.pop(0)
            req = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens), max_len=pool_tokens)
            req.cache_salt = salt
            live[i] = req
            sched.add(req)
        for i, req in list(live.items()):
            cancel_at = w["reqs"][i][3]
            if cancel_at is not None and step >= cancel_at:
                sched.finish(req, "abort")
                done[i] = "abort"
                del live[i]
        out = sched.schedule()
        check_invariants(bm, sched, out, w["budget"])
        if w["chunked"] and w["cap"]:
            assert all(c.num_new_tokens - len(c.draft_token_ids) <= w["cap"] for c in out.chunks), "a prefill chunk exceeded the cap"
        by_id = {r.request_id: r for r in live.values()}
        tables = runner.tables_of(out)
        for c in out.chunks:            # the fake forward pass
            req = by_id[c.request_id]
            assert c.start + c.num_new_tokens == req.num_computed_tokens, "planned progress is the request's"
            assert tables[c.request_id] == bm.block_ids(c.request_id), "the runner's table is not the request's"
            seen = fake_forward(kv, bs, c, tables[c.request_id], w["window"])
            first = max(0, c.start - w["window"] + 1) if w["window"] else 0
            assert seen == (req.token_ids + c.draft_token_ids)[first:first + len(seen)], \
                "attention must read this request's own tokens"
            if w["window"]:     # blocks wholly before the window went back to the pool
                assert all(b == NULL_BLOCK for b in tables[c.request_id][:first // bs]), \
                    "a block outside the window is held"
        for c in out.chunks:
            req = by_id[c.request_id]
            if c.samples:       # the target's token after each accepted guess; stop at the first disagreement
                drafts, new = c.draft_token_ids, []
                while True:
                    new.append(next_token(req.token_ids + new))
                    if len(new) > len(drafts) or new[-1] != drafts[len(new) - 1]:
                        break
                if drafts:
                    sched.verify(req, len(drafts), len(new) - 1)
                    assert len(bm.block_ids(req.request_id)) == blocks_for(
                        req.num_computed_tokens + req.spec_lookahead, bs), "blocks of rejected guesses must go back"
                wanted = c.guesses_wanted[len(new) - 1]
                if w["lookahead"] and wanted:
                    # A draft model writes its K/V at the next guesses' positions: they have slots of this request
                    # alone, held past the verdict.
                    table = bm.block_ids(req.request_id)
                    for pos in range(req.num_computed_tokens, req.num_computed_tokens + wanted):
                        assert pos // bs < len(table) and bm.ref_count[table[pos // bs]] == 1, "no lookahead slot"
                for t in new:
                    req.token_ids.append(t)
                    if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_len:
                        sched.finish(req, "length")
                        i = int(req.request_id)
                        done[i] = "length"
                        del live[i]
                        break
                else:
                    req.spec_token_ids = proposer.guess(req.token_ids, wanted)
                assert req.num_output_tokens <= req.params.max_tokens and req.num_tokens <= req.max_len
        check_invariants(bm, sched, out, w["budget"])
        step += 1
    assert len(done) == len(w["reqs"]), "every request must have finished or been aborted"
    assert bm.num_used == 0 and sum(bm.ref_count) == 0 and len(bm.free_ids) == bm.num_blocks


class WrongBlocksKVCacheManager(KVCacheManager):
    """A prefix cache with a bug: every hit hands out the block after the right one."""

    def get_computed_blocks(self, req):
        return [(b + 1) % self.num_blocks for b in super().get_computed_blocks(req)]


def run_fake_model(manager_cls, prefix_caching: bool, num_blocks: int):
    """Six requests sharing a prefix, each token derived from what the fake model reads from its KV pool."""
    bm = manager_cls(num_blocks, 4, prefix_caching)
    sched = Scheduler(bm, 4, 8, True)
    kv = [[-1] * 4 for _ in range(num_blocks)]
    reqs = [Request(str(i), PREFIXES[0] + [i], SamplingParams(max_tokens=6), max_len=num_blocks * 4)
            for i in range(6)]
    for r in reqs:
        sched.add(r)
    by_id = {r.request_id: r for r in reqs}
    runner = FakeRunner()
    while sched.has_work():
        out = sched.schedule()
        tables = runner.tables_of(out)
        for c in out.chunks:
            seen = fake_forward(kv, 4, c, tables[c.request_id])
            if c.samples:
                req = by_id[c.request_id]
                req.token_ids.append(next_token(seen))
                if req.num_output_tokens >= 6:
                    sched.finish(req, "length")
    return [r.token_ids for r in reqs], bm.num_hits


def test_outputs_do_not_depend_on_prefix_cache_or_pool():
    """The fake model's outputs come from what it reads out of the KV pool, so they match with and without caching
    only if every cache hit handed out the right contents; a prefix cache that hands out wrong blocks shows."""
    plain, no_hits = run_fake_model(KVCacheManager, False, 64)
    cached, hits = run_fake_model(KVCacheManager, True, 64)
    tight, _ = run_fake_model(KVCacheManager, True, 12)
    assert plain == cached == tight
    assert no_hits == 0 and hits > 0
    wrong, wrong_hits = run_fake_model(WrongBlocksKVCacheManager, True, 64)
    assert wrong_hits > 0 and wrong != plain


def test_a_lookup_changes_nothing_and_planning_fixes_the_step():
    """get_computed_blocks leaves the request and the pool alone; the scheduler alone moves num_computed_tokens,
    and a chunk's facts (start, tokens, table, what its sampling reads) stay as planned when the request moves on."""
    bm = KVCacheManager(8, 4)
    sched = Scheduler(bm, 4, 64, True)
    first = Request("a", list(range(10)), SamplingParams(max_tokens=2), max_len=32)
    sched.add(first)
    (chunk,) = sched.schedule().chunks
    assert (chunk.start, chunk.num_new_tokens, chunk.samples) == (0, 10, True) and first.num_computed_tokens == 10
    first.token_ids.append(7)
    assert chunk.token_ids == list(range(10)) and chunk.samples and chunk.num_blocks == 3
    assert chunk.sampling[0].num_output_tokens == 0, "what the sampler reads is the request as planned"
    second = Request("b", list(range(10)), SamplingParams(), max_len=32)
    used, free, queries = bm.num_used, list(bm.free_ids), bm.num_queries
    hit = bm.get_computed_blocks(second)
    assert hit == bm.block_ids("a")[:2]
    assert second.num_computed_tokens == 0 and second.num_cached_tokens == 0 and bm.block_ids("b") == []
    assert bm.num_used == used and list(bm.free_ids) == free and bm.num_queries == queries


def test_a_steps_chunks_come_grouped_by_adapter():
    """Requests of LoRA adapters arriving interleaved are planned side by side, the base's first, so each adapter's
    tokens are one slice of the step's batch (models/lora.py adds its term to that slice in place)."""
    from types import SimpleNamespace
    sched = Scheduler(KVCacheManager(64, 4), 16, 256, True)
    names = ["b", None, "a", "b", None, "a", "b"]
    for i, name in enumerate(names):
        req = Request(str(i), [1, 2, 3, i], SamplingParams(max_tokens=3), max_len=64)
        req.lora = None if name is None else SimpleNamespace(name=name)
        sched.add(req)
    for _ in range(3):
        got = [None if c.adapter is None else c.adapter.name for c in sched.schedule().chunks]
        assert got == [None, None, "a", "a", "b", "b", "b"], got


def test_the_scheduler_plans_without_a_model():
    """The scheduler plans a step as plain data and runs no model: the forward pass, sampling, the verdict on guesses
    and the proposer of the next ones are the runner's (engine/runner.py), which a step graph can then capture whole.
    A scheduler that imported torch, a model, the runner or a proposer would be running model work again."""
    import ast
    import trellm_backend.engine.scheduler as module
    tree = ast.parse(open(module.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    model_work = {m for m in imported if m.split(".")[0] == "torch" or m.startswith("trellm_backend.models")
                  or m.split(".")[-1] in ("runner", "draft", "proposers", "structured_output")}
    assert not model_work, f"the scheduler imports model work: {sorted(model_work)}"
