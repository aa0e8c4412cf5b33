"""Bookkeeping of the paged KV cache: which fixed-size blocks are free, which belong to which request, and which
hold a known prefix that a later request may reuse (prefix caching).

The cache tensor itself lives in the model runner; this class only hands out block ids. A request's block table
(`request.block_ids`) is append-only while it runs and released whole when it finishes, is aborted or preempted.

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


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Insertion-ordered set of free block ids: popitem(last=False) takes the LRU one, pop(id) removes any in O(1).
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks     # (parent hash, tokens) of a cached block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                             # hash -> block id
        self.num_queries = 0        # prompt blocks looked up since start (for the hit rate)
        self.num_hits = 0

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self.free_ids)

    # -- prefix cache ----------------------------------------------------------------------------------------
    def _keys(self, req: Request, num_blocks: int):
        """(hash, key) of the first `num_blocks` full blocks of `req`'s tokens, computed once per block."""
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1][0] if i else hash(("salt", req.cache_salt))
            key = (parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))
            hashes.append((hash(key), key))
        return hashes[:num_blocks]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Ids of cached blocks holding the longest known prefix of `req`; nothing is taken yet. The last token
        is never covered, so a hit still leaves at least one token to compute (its logits give the next token)."""
        if not self.enable_prefix_caching or req.block_ids:
            return []
        hit = []
        for h, key in self._keys(req, (req.num_tokens - 1) // self.block_size):
            bid = self.cached.get(h)
            if bid is None or self.block_key[bid] != key:
                break
            hit.append(bid)
        return hit

    def can_admit(self, req: Request, hit: list[int], num_tokens: int) -> bool:
        """Whether `req`, reusing the cached blocks `hit`, can get blocks for `num_tokens` tokens."""
        reclaimed = sum(1 for b in hit if self.ref_count[b] == 0)   # free now, but no longer once taken
        return blocks_for(num_tokens, self.block_size) - len(hit) <= len(self.free_ids) - reclaimed

    def admit(self, req: Request, hit: list[int], num_tokens: int) -> None:
        """Take the cached blocks `hit` (their tokens count as computed) and grow to `num_tokens` tokens."""
        for bid in hit:
            if self.ref_count[bid] == 0:
                del self.free_ids[bid]
            self.ref_count[bid] += 1
            req.block_ids.append(bid)
        req.num_computed_tokens = len(hit) * self.block_size
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.num_queries += (req.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0
            self.num_hits += len(hit)
        self.grow(req, num_tokens)

    # -- allocation --------------------------------------------------------------------------------------------
    def blocks_missing(self, req: Request, num_tokens: int) -> int:
        """How many more blocks `req` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(req.block_ids))

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_missing(req, num_tokens) <= len(self.free_ids)

    def grow(self, req: Request, num_tokens: int) -> None:
        """Give `req` enough blocks for `num_tokens` tokens (the caller checked `can_grow`), and register the
        blocks those tokens fill. Registering at scheduling time is safe: the tokens are known, and their K/V is
        written in this step's forward pass before any later step can read it."""
        for _ in range(self.blocks_missing(req, num_tokens)):
            bid, _ = self.free_ids.popitem(last=False)
            self._evict(bid)
            self.ref_count[bid] = 1
            req.block_ids.append(bid)
        if self.enable_prefix_caching:
            full = num_tokens // self.block_size
            for i, (h, key) in enumerate(self._keys(req, full)[req.num_registered_blocks:], req.num_registered_blocks):
                bid = req.block_ids[i]
                if self.block_hash[bid] is None and h not in self.cached:
                    self.block_hash[bid], self.block_key[bid] = h, key
                    self.cached[h] = bid
            req.num_registered_blocks = max(req.num_registered_blocks, full)

    def _evict(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is not None:
            if self.cached.get(h) == bid:
                del self.cached[h]
            self.block_hash[bid] = self.block_key[bid] = None

    def free(self, req: Request) -> None:
        """Drop `req`'s references; blocks nobody else uses go to the free list, tail blocks first, so a shared
        prefix outlives the private ends of the sequences that used it."""
        for bid in reversed(req.block_ids):
            self.ref_count[bid] -= 1
            if self.ref_count[bid] == 0:
                self.free_ids[bid] = None
        req.block_ids = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay where they are)."""
        for bid in range(self.num_blocks):
            self._evict(bid)
