"""Bookkeeping of the paged KV cache: which fixed-size blocks are free, which belong to which request, and which
hold a known prefix that a later request may reuse (prefix caching).

The cache tensor itself lives in the model runner; this class only hands out block ids. It owns every request's
block table (`req_to_blocks`, as vLLM v1's KVCacheManager does) and its prefix hashes; a table grows at its end
while the request runs and is released whole when it finishes, is aborted or preempted.

Sliding windows: when every layer attends only within the last `window` keys (Mistral v0.1, Phi-3), a block whose
keys all fell out of a request's window is never read again. It goes back to the pool as the request advances and
its table entry becomes NULL_BLOCK, so a long generation holds about window / block_size blocks, as vLLM's
sliding-window manager does. Such a block keeps its hash, like any freed one, until it is taken.

Looking up a cached prefix changes nothing; request progress (`num_computed_tokens`) is the scheduler's alone.

Prefix caching: a block whose tokens are all known is registered under a chained hash of (parent block's hash,
its tokens, the request's cache salt for the first block). A block is shared by reference count; when the count
drops to zero it goes to the tail of the free list but keeps its contents and hash, so a later request with the
same prefix takes it back (a hit). New blocks are taken from the head of the free list, the least recently freed
first, and lose their hash then (eviction). Every hit compares the stored parent hash and tokens, so a hash
collision can never hand out wrong contents.
"""
from __future__ import annotations

from collections import OrderedDict

from trellm_backend.engine.request import Request


NULL_BLOCK = -1      # a table entry whose block fell out of the sliding window and went back to the pool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0):
        """window > 0: every layer of every model reading the tables attends within its last `window` keys."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.num_dropped: dict[str, int] = {}                       # request id -> its leading NULL_BLOCK entries
        # Insertion-ordered set of free block ids: popitem(last=False) takes the LRU one, pop(id) removes any in O(1).
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks     # (parent hash, tokens) of a cached block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                             # hash -> block id
        self.req_to_blocks: dict[str, list[int]] = {}                # request id -> its block table
        # Per request: (hash, key) of its full blocks, computed once and kept across preemption; and how many of
        # its blocks are registered in the cache.
        self.req_to_hashes: dict[str, list[tuple[int, tuple]]] = {}
        self.num_registered: dict[str, int] = {}
        self.num_queries = 0        # prompt blocks looked up at first admission (for the hit rate)
        self.num_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached prefixes among them, evicted when taken)."""
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free

    def block_ids(self, request_id: str) -> list[int]:
        """The block table of a request (empty when it holds none)."""
        return self.req_to_blocks.get(request_id, [])

    # -- prefix cache ----------------------------------------------------------------------------------------
    def _keys(self, req: Request, num_blocks: int):
        """(hash, key) of the first `num_blocks` full blocks of `req`'s tokens, computed once per block."""
        bs = self.block_size
        hashes = self.req_to_hashes.setdefault(req.request_id, [])
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1][0] if i else hash(("salt", req.cache_salt))
            key = (parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))
            hashes.append((hash(key), key))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Ids of cached blocks holding the longest known prefix of `req`; nothing is taken, and the request is not
        touched. The last token is never covered, so a hit still leaves at least one token to compute (its logits
        give the next token)."""
        if not self.enable_prefix_caching or self.req_to_blocks.get(req.request_id):
            return []
        hit = []
        for h, key in self._keys(req, (req.num_tokens - 1) // self.block_size):
            bid = self.cached.get(h)
            if bid is None or self.block_key[bid] != key:
                break
            hit.append(bid)
        return hit

    def count_prefix_query(self, req: Request, hit: list[int]) -> None:
        """Count a first admission's lookup for the hit-rate counters."""
        if self.enable_prefix_caching:
            self.num_queries += (req.num_tokens - 1) // self.block_size
            self.num_hits += len(hit)

    def can_allocate(self, req: Request, hit: list[int], num_tokens: int) -> bool:
        """Whether `req`, reusing the cached blocks `hit`, can get blocks for `num_tokens` tokens."""
        reclaimed = sum(1 for b in hit if self.ref_count[b] == 0)   # free now, but no longer once taken
        return blocks_for(num_tokens, self.block_size) - len(hit) <= len(self.free_ids) - reclaimed

    def allocate(self, req: Request, hit: list[int], num_tokens: int) -> None:
        """Take the cached blocks `hit` for `req`'s table and grow it to hold `num_tokens` tokens."""
        table = self.req_to_blocks.setdefault(req.request_id, [])
        for bid in hit:
            if self.ref_count[bid] == 0:
                del self.free_ids[bid]
            self.ref_count[bid] += 1
            table.append(bid)
        self.allocate_slots(req, num_tokens)

    # -- allocation --------------------------------------------------------------------------------------------
    def blocks_missing(self, req: Request, num_tokens: int) -> int:
        """How many more blocks `req` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.block_ids(req.request_id)))

    def can_allocate_slots(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_missing(req, num_tokens) <= len(self.free_ids)

    def allocate_slots(self, req: Request, num_tokens: int) -> None:
        """Give `req` enough blocks for `num_tokens` tokens (the caller checked `can_allocate_slots`), and register
        the blocks those tokens fill. Registering at scheduling time is safe: the tokens are known, and their K/V is
        written in this step's forward pass before any later step can read it. Speculative guesses past the known
        tokens get slots but are not registered: their block is registered once they are accepted."""
        table = self.req_to_blocks.setdefault(req.request_id, [])
        for _ in range(self.blocks_missing(req, num_tokens)):
            bid, _ = self.free_ids.popitem(last=False)
            self._evict(bid)
            self.ref_count[bid] = 1
            table.append(bid)
        if self.enable_prefix_caching:
            full = min(num_tokens, req.num_tokens) // self.block_size   # guessed tokens are not known yet
            done = self.num_registered.get(req.request_id, 0)
            for i, (h, key) in enumerate(self._keys(req, full)[done:], done):
                bid = table[i]
                if bid != NULL_BLOCK and self.block_hash[bid] is None and h not in self.cached:
                    self.block_hash[bid], self.block_key[bid] = h, key
                    self.cached[h] = bid
            self.num_registered[req.request_id] = max(done, full)

    def dropped(self, request_id: str) -> int:
        """How many leading entries of the request's table the window has set to NULL_BLOCK."""
        return self.num_dropped.get(request_id, 0)

    def drop_outside_window(self, req: Request, first_query: int) -> None:
        """With a window, return the blocks of `req` whose keys all sit at positions <= first_query - window:
        `first_query` is the position of the step's first query, later ones sit further on, so nothing reads them
        again. The scheduler calls it as it plans the step."""
        if not self.window:
            return
        table = self.req_to_blocks.get(req.request_id, [])
        done = self.num_dropped.get(req.request_id, 0)
        outside = min(len(table), max(0, first_query - self.window + 1) // self.block_size)
        for i in range(done, outside):
            self._release(table[i])
            table[i] = NULL_BLOCK
        self.num_dropped[req.request_id] = max(done, outside)

    def _release(self, bid: int) -> None:
        """One reference fewer; a block nobody references goes to the free list's tail with its hash."""
        self.ref_count[bid] -= 1
        if self.ref_count[bid] == 0:
            self.free_ids[bid] = None

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks of `req`'s table past those `num_tokens` tokens need (speculative guesses that were
        rejected). They hold no registered prefix, so they go to the head of the free list, to be reused first."""
        table = self.req_to_blocks.get(req.request_id, [])
        while len(table) > max(blocks_for(num_tokens, self.block_size), self.num_dropped.get(req.request_id, 0)):
            bid = table.pop()
            self._release(bid)
            if self.ref_count[bid] == 0:
                self.free_ids.move_to_end(bid, last=False)

    def _evict(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is not None:
            if self.cached.get(h) == bid:
                del self.cached[h]
            self.block_hash[bid] = self.block_key[bid] = None

    def free(self, req: Request, keep_hashes: bool = False) -> None:
        """Drop `req`'s references; blocks nobody else uses go to the free list, tail blocks first, so a shared
        prefix outlives the private ends of the sequences that used it. `keep_hashes`: the request comes back
        (preemption), and its tokens' hashes are still right."""
        for bid in reversed(self.req_to_blocks.pop(req.request_id, [])):
            if bid != NULL_BLOCK:
                self._release(bid)
        self.num_registered.pop(req.request_id, None)
        self.num_dropped.pop(req.request_id, None)
        if not keep_hashes:
            self.req_to_hashes.pop(req.request_id, None)
