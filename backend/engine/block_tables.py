"""The model runner's block tables: one persistent row per running request, updated in place from each step's
chunks by what changed since that request's previous chunk (the scheduler sends only that: blocks appended, the
table's new length after rejected guesses gave blocks back, and how many leading blocks a sliding window dropped).
A step's [B, width] table is then a gather of its requests' rows, with no Python list per request and step; on a
GPU the rows can live on the device and be patched by the same deltas.
"""
from __future__ import annotations

import torch

from trellm_backend.engine.kv_cache_manager import NULL_BLOCK


class BlockTables:
    def __init__(self, max_rows: int, max_blocks: int):
        self.rows = torch.full((max_rows, max_blocks), NULL_BLOCK, dtype=torch.int32)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.length = [0] * max_rows      # entries in use per row
        self.dropped = [0] * max_rows     # leading entries a sliding window set to NULL_BLOCK

    def update(self, request_id: str, new_block_ids: list[int], num_blocks: int, num_dropped: int) -> int:
        """Apply one chunk's table delta (ScheduledChunk) to its request's row; returns the row."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free_rows:
                self._grow(rows=self.rows.shape[0])
            row = self.row_of[request_id] = self.free_rows.pop()
        if num_blocks > self.rows.shape[1]:
            self._grow(cols=num_blocks)
        r, old = self.rows[row], self.length[row]
        first_new = num_blocks - len(new_block_ids)
        if num_blocks < old:      # blocks of rejected guesses went back
            r[num_blocks:old] = NULL_BLOCK
        if new_block_ids:
            r[first_new:num_blocks] = torch.tensor(new_block_ids, dtype=torch.int32)
        if num_dropped > self.dropped[row]:
            r[self.dropped[row]:num_dropped] = NULL_BLOCK
            self.dropped[row] = num_dropped
        self.length[row] = num_blocks
        return row

    def table(self, request_id: str) -> torch.Tensor:
        """The request's current table (a view: valid until the next update)."""
        row = self.row_of[request_id]
        return self.rows[row, :self.length[row]]

    def gather(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), width] tables of a step's sequences in order, NULL_BLOCK padded, width their longest."""
        width = max(self.length[r] for r in rows)
        return self.rows[torch.tensor(rows), :width]

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.rows[row, :self.length[row]] = NULL_BLOCK
            self.length[row] = self.dropped[row] = 0
            self.free_rows.append(row)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        """More rows or columns than planned at load (a bound was passed): copied once into a larger tensor."""
        old_rows, old_cols = self.rows.shape
        new = torch.full((old_rows + rows, max(old_cols, cols)), NULL_BLOCK, dtype=torch.int32)
        new[:old_rows, :old_cols] = self.rows
        self.rows = new
        self.free_rows = list(range(old_rows + rows - 1, old_rows - 1, -1)) + self.free_rows
        self.length += [0] * rows
        self.dropped += [0] * rows
