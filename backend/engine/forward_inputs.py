"""What a forward pass reads besides the weights: the paged KV pool, and where each token of a flat batch sits in it.
The target model's runner and the draft model both build their passes from these."""
from __future__ import annotations

import torch

from trellm_backend.models.config import ModelConfig
from trellm_backend.models.llama import AttentionMetadata
from trellm_kernels.kv_cache import QMAX, SCALE_DTYPE


def allocate_kv_cache(mc: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in kv_dtype and, for an INT8/FP8
    cache, its scales [num_layers, 2, num_blocks, block_size, num_kv_heads] (float16), else None."""
    shape = (mc.num_layers, 2, num_blocks, block_size, mc.num_kv_heads)
    cache = torch.zeros(*shape, mc.head_dim, dtype=kv_dtype, device=device)
    scales = torch.zeros(*shape, dtype=SCALE_DTYPE, device=device) if kv_dtype in QMAX else None
    return cache, scales


def kv_slots(block_tables: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slot of each token: position p of sequence seqs[i] sits at offset p % block_size of block
    block_tables[seqs[i], p // block_size]."""
    return block_tables[seqs, positions // block_size] * block_size + positions % block_size


class StepInputs:
    """The inputs of one forward pass, written into one int32 staging tensor that is reused pass after pass (pinned
    on a GPU) and sent to the device in one non-blocking copy: token ids, positions, KV slots, query offsets,
    sequence lengths, the rows to take logits of, longrope flags and block tables, each a slice of it. Sequence b
    runs q_lens[b] tokens from position starts[b] through block table block_tables[b]. It grows when a pass needs
    more room than any before."""

    def __init__(self, device: torch.device, capacity: int = 1 << 15):
        self.device = device
        self._allocate(capacity)

    def _allocate(self, n: int) -> None:
        on_gpu = self.device.type == "cuda"
        self.host = torch.empty(n, dtype=torch.int32, pin_memory=on_gpu)
        self.staged = torch.empty(n, dtype=torch.int32, device=self.device) if on_gpu else self.host

    def build(self, token_ids: list[int], starts: list[int], q_lens: list[int], block_tables: torch.Tensor,
              block_size: int, logits_rows: torch.Tensor, rope_long: list[bool] | None = None
              ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
        """(input ids, metadata, logits rows) on the device, and cu_seqlens_q on the CPU. block_tables: [B, width]
        int32 on the CPU, -1 padded; logits_rows: the flat batch's rows whose logits are wanted; rope_long[b]:
        sequence b rotates with longrope's long factors."""
        B, T, W, R = len(starts), len(token_ids), block_tables.shape[1], logits_rows.numel()
        sizes = [T, T, T, B + 1, B, R, B * W] + ([T] if rope_long is not None else [])
        need = sum(sizes)
        if need > self.host.numel():
            self._allocate(max(need, 2 * self.host.numel()))
        h = self.host
        ids, positions, slots, cu, seq_lens, rows, tables, *long = h[:need].split(sizes)
        ids.copy_(torch.tensor(token_ids, dtype=torch.int32))
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        starts_t = torch.tensor(starts, dtype=torch.int32)
        cu[0] = 0
        torch.cumsum(q_lens_t, 0, out=cu[1:])
        seq_of_tok = torch.repeat_interleave(torch.arange(B), q_lens_t, output_size=T)
        torch.add(torch.arange(T, dtype=torch.int32) - cu[:-1][seq_of_tok], starts_t[seq_of_tok], out=positions)
        slots.copy_(kv_slots(block_tables, seq_of_tok, positions, block_size))
        torch.add(starts_t, q_lens_t, out=seq_lens)
        rows.copy_(logits_rows)
        tables.view(B, W).copy_(block_tables)
        if long:
            long[0].copy_(torch.tensor(rope_long, dtype=torch.int32)[seq_of_tok])
        cu_cpu = cu.clone()
        if self.staged is not h:
            self.staged[:need].copy_(h[:need], non_blocking=True)
        d_ids, d_positions, d_slots, d_cu, d_seq_lens, d_rows, d_tables, *d_long = self.staged[:need].split(sizes)
        meta = AttentionMetadata(
            positions=d_positions, slot_mapping=d_slots, cu_seqlens_q=d_cu, seq_lens=d_seq_lens,
            block_tables=d_tables.view(B, W), max_seqlen_q=max(q_lens),
            max_seqlen_k=max(s + n for s, n in zip(starts, q_lens)),
            rope_long=d_long[0].bool() if d_long else None)
        return d_ids, meta, d_rows, cu_cpu
