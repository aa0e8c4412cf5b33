"""Paged attention over a mixed batch: prefill chunks that continue a cached prefix and single-token decodes.

Sequence b owns the flat query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its keys/values are the first
seq_lens[b] slots reached through block_tables[b]. Query row i of b sits at position seq_lens[b] - q_len + i and
attends causally. Query heads are grouped onto their KV head (GQA). Two options every implementation takes:
`window` > 0 is a sliding window (row p sees keys p - window < j <= p, as transformers' sliding layers do; blocks
wholly before it are never read, so they may be freed), and `softcap` > 0 caps each scaled score s at
softcap * tanh(s / softcap) before the softmax (Gemma 2).

Three implementations behind one dispatch: the Triton-lang kernels on CUDA, the C++ operator of kernels/cpu/ on a
CPU for decodes and short chunks (it reads the blocks in place; see cpu_ops.py for how it is built) with torch's
fused attention for long prefill chunks, and the PyTorch reference below, which is the tests' oracle and the CPU
fallback when no compiler is present.

An INT8 or FP8 cache (kv_cache.py) comes with k_scale, v_scale [num_blocks, block_size, KVH] float16: key j of
head h reads as float(k_cache[j, h]) * k_scale[j, h]. The reference dequantizes the blocks the batch uses and runs
the float reference on them; the kernels fold the scales into the scores and the softmax weights.
"""
from functools import partial

import torch
import torch.nn.functional as F

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton
from trellm_kernels.kv_cache import dequantize_kv, is_quantized


DECODE_GROUPS = 4


def paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                              max_seqlen_q: int, max_seqlen_k: int, k_scale=None, v_scale=None, window: int = 0,
                              softcap: float = 0.0):
    """q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; cu_seqlens_q: [B+1]; seq_lens: [B];
    block_tables: [B, max_blocks] (-1 padded); k_scale, v_scale: an INT8/FP8 cache's scales. Returns [T, H, D] in
    q's dtype.

    All decodes (one query row each) run as one padded batch; each prefill chunk runs alone, so a 512-token chunk
    does not pad every decode in the step to 512 rows."""
    if is_quantized(k_cache):
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, q.dtype)
    B = seq_lens.shape[0]
    if B == 1 and max_seqlen_q > 1:
        return _padded_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                 max_seqlen_q, max_seqlen_k, window, softcap)
    out = torch.empty_like(q)
    starts, lens, kv_lens = cu_seqlens_q[:-1].tolist(), (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist(), \
        seq_lens.tolist()
    # Decodes sorted by length and cut into a few groups, each padded only to its own longest sequence: with
    # mixed lengths, padding everything to the longest would gather and multiply mostly padding.
    decodes = sorted((b for b in range(B) if lens[b] == 1), key=kv_lens.__getitem__)
    groups = DECODE_GROUPS if len(decodes) >= 4 * DECODE_GROUPS else 1
    for g in range(groups):
        group = decodes[g * len(decodes) // groups:(g + 1) * len(decodes) // groups]
        if not group:
            continue
        rows = torch.tensor([starts[b] for b in group], device=q.device)
        sel = torch.tensor(group, device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, seq_lens[sel], block_tables[sel], scale,
                                      kv_lens[group[-1]], window, softcap)
    _chunks_alone(out, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, longer_than=1,
                  chunk_attention=partial(_padded_chunk, window=window, softcap=softcap))
    return out


def dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, dtype):
    """The blocks `block_tables` uses, dequantized to `dtype` and numbered 0.. in a compact pair of caches, and the
    tables renumbered to match (-1 stays -1): the float reference then runs unchanged, reading only those blocks."""
    used = block_tables[block_tables >= 0].long().unique()
    renumber = torch.full((k_cache.shape[0],), -1, dtype=block_tables.dtype, device=block_tables.device)
    renumber[used] = torch.arange(used.numel(), dtype=block_tables.dtype, device=block_tables.device)
    tables = torch.where(block_tables >= 0, renumber[block_tables.clamp(min=0).long()], -1)
    return (dequantize_kv(k_cache[used], k_scale[used], dtype), dequantize_kv(v_cache[used], v_scale[used], dtype),
            tables)


def _padded_chunk(q, k_cache, v_cache, table_row, ctx: int, scale, window: int = 0, softcap: float = 0.0):
    """One chunk's rows (the last q.shape[0] positions of a `ctx`-token sequence) through the padded reference."""
    n = q.shape[0]
    cu = torch.tensor([0, n], device=q.device, dtype=torch.int32)
    lens = torch.tensor([ctx], device=q.device, dtype=torch.int32)
    return _padded_attention(q, k_cache, v_cache, cu, lens, table_row[None], scale, n, ctx, window, softcap)


def _chunks_alone(out, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, longer_than: int,
                  chunk_attention):
    """Write into `out` the attention of every chunk with more than `longer_than` query rows, each chunk alone:
    `chunk_attention(q_rows, k_cache, v_cache, table_row, context_len, scale)`."""
    starts, ends, kv_lens = cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), seq_lens.tolist()
    for b, (s, e) in enumerate(zip(starts, ends)):
        if e - s > longer_than:
            out[s:e] = chunk_attention(q[s:e], k_cache, v_cache, block_tables[b], kv_lens[b], scale)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The reference's arithmetic type: float32, or float64 where the tests run it as their exact oracle."""
    return torch.promote_types(dtype, torch.float32)


def _capped(scores, softcap: float):
    """Scores capped at softcap * tanh(s / softcap) (Gemma 2's attention soft-capping); 0: unchanged."""
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def _decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, max_seqlen_k: int, window: int = 0,
                      softcap: float = 0.0):
    """One query row per sequence (q: [B, H, D]). Keys and values are gathered once, block by block, straight into
    [B, blocks, KVH, block_size, D], the layout both products read as it is; softmax runs over (blocks, slots)."""
    B, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    n_blocks = (max_seqlen_k + block_size - 1) // block_size
    bt = block_tables[:, :n_blocks].clamp(min=0).long()
    wide = _wide(q.dtype)
    k = k_cache.permute(0, 2, 1, 3)[bt].to(wide)                             # [B, nb, KVH, bs, D]
    v = v_cache.permute(0, 2, 1, 3)[bt].to(wide)
    qg = q.to(wide).view(B, 1, KVH, H // KVH, D)
    scores = _capped(torch.matmul(qg, k.transpose(-1, -2)) * scale, softcap)   # [B, nb, KVH, G, bs]
    pos = torch.arange(n_blocks * block_size, device=q.device).view(1, n_blocks, 1, 1, block_size)
    ends = seq_lens.long().view(B, 1, 1, 1, 1)
    hidden = pos >= ends
    if window > 0:
        hidden |= pos < ends - window
    scores.masked_fill_(hidden, float("-inf"))
    scores = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))
    out = torch.matmul(scores, v).sum(dim=1) / scores.sum(dim=(1, 4))[..., None]   # [B, KVH, G, D]
    return out.reshape(B, H, D).to(q.dtype)


def _padded_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                      max_seqlen_q: int, max_seqlen_k: int, window: int = 0, softcap: float = 0.0):
    """The reference on sequences padded to (max_seqlen_q, max_seqlen_k): a few tensor ops for the batch."""
    T, H, D = q.shape
    B = seq_lens.shape[0]
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    n_blocks = (max_seqlen_k + block_size - 1) // block_size
    bt = block_tables[:, :n_blocks].clamp(min=0).long()
    k = k_cache[bt].reshape(B, n_blocks * block_size, KVH, D)[:, :max_seqlen_k]
    v = v_cache[bt].reshape(B, n_blocks * block_size, KVH, D)[:, :max_seqlen_k]

    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=T)
    row_in_seq = torch.arange(T, device=q.device) - cu_seqlens_q[:-1].long()[seq_of_row]
    qp = q.new_zeros(B, max_seqlen_q, H, D)
    qp[seq_of_row, row_in_seq] = q

    q_pos = (seq_lens - q_lens).long()[:, None] + torch.arange(max_seqlen_q, device=q.device)[None, :]
    k_pos = torch.arange(max_seqlen_k, device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens.long()[:, None, None])
    if window > 0:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window

    wide = _wide(q.dtype)
    qg = qp.view(B, max_seqlen_q, KVH, G, D).permute(0, 2, 3, 1, 4).to(wide)  # [B, KVH, G, Lq, D]
    kg = k.permute(0, 2, 1, 3)[:, :, None].to(wide)                            # [B, KVH, 1, Lk, D]
    vg = v.permute(0, 2, 1, 3)[:, :, None].to(wide)
    scores = _capped(torch.matmul(qg, kg.transpose(-1, -2)) * scale, softcap)  # [B, KVH, G, Lq, Lk]
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vg)                      # [B, KVH, G, Lq, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(B, max_seqlen_q, H, D)
    return out[seq_of_row, row_in_seq].to(q.dtype)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    max_seqlen_q: int, max_seqlen_k: int, k_scale=None, v_scale=None, window: int = 0,
                    softcap: float = 0.0):
    """Attention of each query row over its sequence's cached keys/values; see the module docstring."""
    if use_triton(q):
        from trellm_kernels.triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                      max_seqlen_q, max_seqlen_k, k_scale=k_scale, v_scale=v_scale, window=window,
                                      softcap=softcap)
    ops = cpu_ops.for_tensor(q)
    if ops is not None and (not is_quantized(k_cache) or q.dtype in (torch.float32, torch.bfloat16)):
        return _paged_attention_cpu(ops, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                    max_seqlen_q, k_scale, v_scale, window, softcap)
    return paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                     max_seqlen_q, max_seqlen_k, k_scale, v_scale, window, softcap)


# Chunks with more query rows than this run in torch's fused attention; decodes and short chunks (speculative
# verification, the tail of a prompt) run in the C++ operator. Measured with perf/bench_attention.py.
CPU_OP_MAX_Q_LEN = 16


def _paged_attention_cpu(ops, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q,
                         k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0):
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.int(), seq_lens.int()
    tables = block_tables.int().contiguous()
    if is_quantized(k_cache):
        ops.paged_attention_quantized(out, q.contiguous(), k_cache.view(torch.int8), v_cache.view(torch.int8),
                                      k_scale.contiguous(), v_scale.contiguous(), cu, lens, tables, scale,
                                      CPU_OP_MAX_Q_LEN, k_cache.dtype == torch.int8, window, softcap)
    else:
        ops.paged_attention(out, q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), cu, lens, tables, scale,
                            CPU_OP_MAX_Q_LEN, window, softcap)
    if max_seqlen_q > CPU_OP_MAX_Q_LEN:
        if softcap > 0:   # torch's fused attention cannot cap scores: the reference's GEMMs, on the dequantized blocks
            chunk = partial(_padded_chunk, window=window, softcap=softcap)
            if is_quantized(k_cache):
                k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_tables,
                                                                   q.dtype)
        else:
            chunk = partial(_sdpa_chunk, k_scale=k_scale, v_scale=v_scale, window=window)
        _chunks_alone(out, q, k_cache, v_cache, cu, lens, block_tables, scale, longer_than=CPU_OP_MAX_Q_LEN,
                      chunk_attention=chunk)
    return out


def _sdpa_chunk(q, k_cache, v_cache, table_row, ctx: int, scale, k_scale=None, v_scale=None, window: int = 0):
    """One long chunk's rows on a CPU: its keys and values gathered once from its blocks (small next to a long
    chunk's work), then torch's fused CPU attention with the causal mask aligned to the chunk's last row. Unlike
    the reference's GEMMs it never builds the score matrix and skips the masked upper triangle of a fresh prompt
    (perf/bench_attention.py's prefill row; perf/RESULTS.md). With a window, only the blocks from the first row's
    window on are gathered."""
    n, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    first_block = max(0, ctx - n - window + 1) // block_size if window > 0 else 0
    start = first_block * block_size                  # position of the first gathered key
    blocks = table_row[first_block:(ctx + block_size - 1) // block_size].long()
    if k_scale is None:
        k, v = k_cache[blocks], v_cache[blocks]
    else:   # INT8/FP8: the chunk's blocks dequantized as they are gathered (a long chunk's work dwarfs this)
        k, v = _gather_dequantized(k_cache, k_scale, blocks, q.dtype), _gather_dequantized(v_cache, v_scale, blocks,
                                                                                           q.dtype)
    keys = ctx - start
    k = k.reshape(-1, KVH, D)[:keys].transpose(0, 1)[None]   # [1, KVH, keys, D]
    v = v.reshape(-1, KVH, D)[:keys].transpose(0, 1)[None]
    # Row i sits at position ctx - n + i and sees keys up to that position (the lower-right causal mask), and with
    # a window none more than window - 1 before it.
    mask = None
    if n != keys or window > 0:
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
        if window > 0:
            mask &= torch.ones_like(mask).triu(keys - n - window + 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=H != KVH)
    return o[0].transpose(0, 1)


def _gather_dequantized(cache, scales, blocks, dtype):
    """cache[blocks] * scales[blocks] in `dtype`: the C++ operator on a CPU (one pass, many times faster than torch's
    gather, cast and multiply: perf/RESULTS.md, section "KV cache in INT8 / FP8"), else torch."""
    ops = cpu_ops.for_tensor(cache)
    if ops is None or dtype not in (torch.float32, torch.bfloat16):
        return dequantize_kv(cache[blocks], scales[blocks], dtype)
    out = torch.empty(blocks.shape[0], *cache.shape[1:], dtype=dtype, device=cache.device)
    ops.gather_dequantize(out, cache.view(torch.int8), scales, blocks.contiguous(), cache.dtype == torch.int8)
    return out
