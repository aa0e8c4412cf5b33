"""Decode steps padded to a batch-size bucket over persistent input buffers: the shape a CUDA graph replays.

A step in which every sequence decodes one token (no prefill chunk, no guesses) runs as a batch of the smallest
bucket that holds it: 1, 2, 4, 8, then steps of 8 up to max_num_seqs, the sizes vLLM captures. Its inputs are
written into one int32 tensor allocated at load, a record per row (token id, position, KV slot, sequence length,
block table), so on a GPU the rows in use reach the device in one non-blocking copy from pinned memory. Padding rows
decode token 0 at position 0 into the pool's scratch block, which no request owns, and attend to it alone: they
write and read nothing of any request, and their logits are dropped. With `enforce_eager=false` a GPU replays a CUDA
graph of each bucket over these buffers (cuda_graphs.py); a CPU runs the padded batch eagerly, the same inputs, so a
test holds it to the unpadded path.
"""
from __future__ import annotations

import bisect

import torch

from trellm_backend.engine.forward_inputs import kv_slots
from trellm_backend.engine.kv_cache_manager import NULL_BLOCK
from trellm_backend.models.llama import AttentionMetadata

ID, POSITION, SLOT, SEQ_LEN, TABLE = range(5)    # the columns of a row's record; its block table from TABLE on


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then steps of 8, ending at max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class PaddedDecode:
    def __init__(self, max_num_seqs: int, max_blocks: int, scratch_block: int, block_size: int,
                 device: torch.device):
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks = max_blocks
        self.device = device
        n = self.buckets[-1]
        on_gpu = device.type == "cuda"
        self.host = torch.empty((n, TABLE + max_blocks), dtype=torch.int32, pin_memory=on_gpu)
        self.pad_row = torch.full((TABLE + max_blocks,), NULL_BLOCK, dtype=torch.int32)
        self.pad_row[:TABLE] = torch.tensor([0, 0, scratch_block * block_size, 1], dtype=torch.int32)
        self.pad_row[TABLE] = scratch_block
        self.host[:] = self.pad_row
        self.rows = torch.empty_like(self.host, device=device) if on_gpu else self.host
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)   # one query per row, always
        self.steps = 0      # padded steps run

    def bucket(self, num_seqs: int, table_width: int) -> int | None:
        """The padded size for a decode step of `num_seqs` sequences, or None when it runs as scheduled."""
        if num_seqs > self.buckets[-1] or table_width > self.max_blocks:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def fill(self, token_ids: list[int], starts: list[int], block_tables: torch.Tensor, block_size: int,
             size: int) -> None:
        """Write the first `size` rows (the step's sequences, then padding) and send them to the device.
        block_tables: [B, width] int32, the sequences' tables (engine/block_tables.py)."""
        B, width = block_tables.shape
        h = self.host
        h[B:size] = self.pad_row
        pos = torch.tensor(starts, dtype=torch.int32)
        h[:B, ID] = torch.tensor(token_ids, dtype=torch.int32)
        h[:B, POSITION] = pos
        h[:B, SLOT] = kv_slots(block_tables, torch.arange(B), pos, block_size)
        h[:B, SEQ_LEN] = pos + 1
        h[:B, TABLE:TABLE + width] = block_tables
        h[:B, TABLE + width:] = NULL_BLOCK
        if self.rows is not h:
            self.rows[:size].copy_(h[:size], non_blocking=True)
        self.steps += 1

    def inputs(self, size: int, max_seqlen_k: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The input ids and metadata of the first `size` rows, read from the device rows (inside a CUDA graph
        these reads are captured too, so a replay sees what the last `fill` wrote)."""
        rows = self.rows[:size]
        return rows[:, ID].contiguous(), AttentionMetadata(
            positions=rows[:, POSITION].contiguous(), slot_mapping=rows[:, SLOT].contiguous(),
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seq_lens=rows[:, SEQ_LEN].contiguous(),
            block_tables=rows[:, TABLE:].contiguous(), max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
