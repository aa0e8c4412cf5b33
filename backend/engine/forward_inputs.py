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


def attention_metadata(starts: list[int], q_lens: list[int], block_tables: torch.Tensor, block_size: int,
                       device: torch.device, rope_long: list[bool] | None = None
                       ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Where each token of a flat batch sits: sequence b runs q_lens[b] tokens from position starts[b], through
    block table block_tables[b] ([B, max_blocks] int32 on the CPU, -1 padded; with longrope, rotated with the long
    factors where rope_long[b]). Returns the metadata (on `device`) and cu_seqlens_q on the CPU."""
    B, T = len(starts), sum(q_lens)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    torch.cumsum(q_lens_t, 0, out=cu[1:])
    seq_of_tok = torch.repeat_interleave(torch.arange(B), q_lens_t, output_size=T)
    positions = torch.arange(T, dtype=torch.int32) - cu[:-1][seq_of_tok] + starts_t[seq_of_tok]
    slots = block_tables[seq_of_tok, positions // block_size] * block_size + positions % block_size
    seq_lens = starts_t + q_lens_t
    meta = AttentionMetadata(
        positions=positions.to(device), slot_mapping=slots.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=seq_lens.to(device), block_tables=block_tables.to(device),
        max_seqlen_q=max(q_lens), max_seqlen_k=int(seq_lens.max()),
        rope_long=None if rope_long is None else torch.tensor(rope_long, dtype=torch.bool)[seq_of_tok].to(device))
    return meta, cu
