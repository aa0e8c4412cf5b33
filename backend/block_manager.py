"""Bookkeeping of the paged KV cache: which fixed-size blocks are free, which belong to which request.

The cache tensor itself lives in the model runner; this class only hands out block ids. A request's block
table (`request.block_ids`) is append-only while it runs and returned whole when it finishes, is aborted or
is preempted.
"""
from __future__ import annotations

from collections import deque

from trellm_backend.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_missing(self, req: Request, num_tokens: int) -> int:
        """How many more blocks `req` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(req.block_ids))

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_missing(req, num_tokens) <= len(self.free_ids)

    def grow(self, req: Request, num_tokens: int) -> None:
        """Give `req` enough blocks for `num_tokens` tokens; the caller checked `can_grow`."""
        for _ in range(self.blocks_missing(req, num_tokens)):
            req.block_ids.append(self.free_ids.popleft())

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks."""
        self.free_ids.extend(reversed(req.block_ids))
        req.block_ids = []
