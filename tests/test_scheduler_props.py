"""Property tests of the scheduler and block manager, with a cheap fake in place of the model runner.

The fake "computes" a token by writing its id into a fake KV pool at the slot its block table gives, and checks
that every position a request attends to holds that request's token: so a prefix-cache hit that handed out wrong
contents, a block shared while still written, or a block table gone stale would all fail here.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trellm_backend.engine.kv_cache_manager import BlockManager, blocks_for
from trellm_backend.engine.request import Request, SamplingParams, Status
from trellm_backend.engine.scheduler import Scheduler

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21], [30] * 9, []]


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 50


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
                chunked=draw(st.booleans()), prefix_caching=draw(st.booleans()), cap=draw(st.integers(0, 8)))


def check_invariants(bm: BlockManager, sched: Scheduler, out, budget: int) -> None:
    assert sum(c.num_new_tokens for c in out.chunks) <= budget
    assert len(sched.running) <= sched.max_num_seqs
    refs = [0] * bm.num_blocks
    for r in sched.running:
        assert r.status is Status.RUNNING
        assert len(r.block_ids) >= blocks_for(r.num_computed_tokens, bm.block_size)
        for b in r.block_ids:
            refs[b] += 1
    for r in sched.waiting:
        assert r.status is Status.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
    assert refs == bm.ref_count, "reference counts must equal the block tables' use of each block"
    free = set(bm.free_ids)
    assert len(free) == len(bm.free_ids)
    assert all((refs[b] == 0) == (b in free) for b in range(bm.num_blocks)), "a block is both free and used"
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_and_block_manager_invariants(w):
    bs = w["block_size"]
    bm = BlockManager(w["num_blocks"], bs, w["prefix_caching"])
    sched = Scheduler(bm, w["max_num_seqs"], w["budget"], w["chunked"], w["cap"])
    pool_tokens = w["num_blocks"] * bs
    kv = [[None] * bs for _ in range(w["num_blocks"])]
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
            assert all(c.num_new_tokens <= w["cap"] for c in out.chunks), "a prefill chunk exceeded the cap"
        for c in out.chunks:            # the fake forward pass
            req = c.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + c.num_new_tokens
            assert len(req.block_ids) * bs >= end
            for pos in range(start, end):
                b, off = req.block_ids[pos // bs], pos % bs
                kv[b][off] = req.token_ids[pos]
            for pos in range(end):      # what attention reads must be this request's own tokens
                assert kv[req.block_ids[pos // bs]][pos % bs] == req.token_ids[pos]
        for c in out.chunks:
            req = c.request
            samples = c.samples
            req.num_computed_tokens += c.num_new_tokens
            if samples:
                req.token_ids.append(next_token(req.token_ids))
                if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_len:
                    sched.finish(req, "length")
                    i = int(req.request_id)
                    done[i] = "length"
                    del live[i]
        step += 1
    assert len(done) == len(w["reqs"]), "every request must have finished or been aborted"
    assert bm.num_used == 0 and sum(bm.ref_count) == 0 and len(bm.free_ids) == bm.num_blocks


def test_outputs_do_not_depend_on_prefix_cache_or_pool():
    """The fake model's outputs are a function of the tokens only, so they must match with and without caching."""
    def run(prefix_caching, num_blocks):
        bm = BlockManager(num_blocks, 4, prefix_caching)
        sched = Scheduler(bm, 4, 8, True)
        reqs = [Request(str(i), PREFIXES[0] + [i], SamplingParams(max_tokens=6), max_len=num_blocks * 4)
                for i in range(6)]
        for r in reqs:
            sched.add(r)
        while sched.has_work():
            for c in sched.schedule().chunks:
                r = c.request
                samples = c.samples
                r.num_computed_tokens += c.num_new_tokens
                if samples:
                    r.token_ids.append(next_token(r.token_ids))
                    if r.num_output_tokens >= 6:
                        sched.finish(r, "length")
        return [r.token_ids for r in reqs], bm.num_hits
    plain, no_hits = run(False, 64)
    cached, hits = run(True, 64)
    tight, _ = run(True, 12)
    assert plain == cached == tight
    assert no_hits == 0 and hits > 0
