"""One rank's view of a tensor-parallel group on one host: the collectives the model's forward calls, over a shared
memory region that every rank maps (as vLLM's CPU build does; gloo's TCP all-reduce is many times slower on
loopback: perf/RESULTS.md, "Issue 61").

The region holds a counter per rank and two sets of slots, one slot per rank. For its k-th collective a rank writes
its part into its slot of set k % 2, publishes k in its counter, waits until every counter reaches k, and reads the
slots; each rank adds them in rank order, so every rank gets the same bits. Two sets are enough: a rank that starts
collective k + 2 (writing set k % 2 again) has seen every rank arrive at k + 1, so all have finished reading k. x86
keeps stores in order, so a counter is never seen before the slot written ahead of it.

A wait has a deadline, and the region a `lost` flag that rank 0's watcher raises when a worker exits: a collective
whose peer died or stopped raises GroupFailure, so the stepping thread never waits on a lost rank for good.
"""
from __future__ import annotations

import math
import mmap
import os
import time

import numpy as np
import torch

from trellm_backend.models.sharding import Shard

SLOT_BYTES = 2 << 20      # a larger tensor goes through in pieces
LINE = 64                 # bytes between two counters: each on a cache line of its own
HEADER_BYTES = 4096
SPIN_S = 50e-6            # wait this long without giving up the interpreter,
SLEEP_AFTER_S = 2e-3      # then poll with sleep(0) until this long, then with real sleeps that leave the core


class GroupFailure(RuntimeError):
    """A rank of the group is lost: the model can no longer step (the server restarts it)."""


def region_bytes(world: int) -> int:
    return HEADER_BYTES + 2 * world * SLOT_BYTES


def create_region(world: int) -> str:
    """A new region in /dev/shm for a group of `world` ranks; returns its path (unlinked once all have mapped it)."""
    path = f"/dev/shm/trellm-tp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, region_bytes(world))
    finally:
        os.close(fd)
    return path


class TensorGroup:
    def __init__(self, region_path: str, shard: Shard, timeout_s: float):
        self.shard = shard
        self.timeout_s = timeout_s
        fd = os.open(region_path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, region_bytes(shard.world))
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64, count=HEADER_BYTES // 8)
        self._counters = words[:shard.world * LINE // 8:LINE // 8]
        self._lost = words[shard.world * LINE // 8:][:1]
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES,
                                       count=2 * shard.world * SLOT_BYTES)
        self._count = int(self._counters[shard.rank])

    def mark_lost(self) -> None:
        """Make every rank's waiting collective fail now (rank 0's watcher: a worker exited)."""
        self._lost[0] = 1

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `part` (at most SLOT_BYTES), in rank order, once all have written theirs."""
        self._count += 1
        k, world = self._count, self.shard.world
        base = (k % 2) * world
        n = part.numel() * part.element_size()
        slots = [self._slots[(base + r) * SLOT_BYTES:(base + r) * SLOT_BYTES + n].view(part.dtype).view(part.shape)
                 for r in range(world)]
        slots[self.shard.rank].copy_(part)
        self._counters[self.shard.rank] = k
        start = time.monotonic()
        while self._counters.min() < k:
            if self._lost[0]:
                raise GroupFailure(f"rank {self.shard.rank}: a rank of the tensor-parallel group is lost")
            waited = time.monotonic() - start
            if waited > SPIN_S:
                if waited > self.timeout_s:
                    late = [r for r in range(world) if self._counters[r] < k]
                    raise GroupFailure(f"rank {self.shard.rank} waited {self.timeout_s:.0f} s at a collective for "
                                       f"rank(s) {late}")
                time.sleep(0 if waited < SLEEP_AFTER_S else 50e-6)
        return slots

    def _rows_per_piece(self, x: torch.Tensor) -> int:
        return max(1, SLOT_BYTES // max(1, math.prod(x.shape[1:]) * x.element_size()))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` ([rows, ...], contiguous) over the ranks, in place."""
        step = self._rows_per_piece(x)
        for start in range(0, x.shape[0], step):
            piece = x[start:start + step]
            parts = self._exchange(piece)
            torch.add(parts[0], parts[1], out=piece)
            for p in parts[2:]:
                piece.add_(p)
        return x

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` from a table of this rank's vocabulary rows, summed over the ranks (each token's
        row comes from the one rank that holds it; the others add zeros)."""
        local = ids - self.shard.vocab_start
        held = (local >= 0) & (local < self.shard.vocab_rows)
        rows = table[local.clamp(0, self.shard.vocab_rows - 1)]
        return self.all_reduce(torch.where(held[:, None], rows, torch.zeros((), dtype=rows.dtype)).contiguous())

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's vocabulary rows] -> [rows, vocab]: every rank's logits side by side."""
        logits = logits.contiguous()
        out = logits.new_empty(logits.shape[0], self.shard.world * logits.shape[1])
        step = self._rows_per_piece(logits)
        for start in range(0, logits.shape[0], step):
            parts = self._exchange(logits[start:start + step])
            torch.cat(parts, dim=-1, out=out[start:start + step])
        return out[:, :self.shard.vocab]
