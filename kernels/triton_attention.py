"""Triton paged attention for a mixed batch (prefill chunks continuing a cached prefix, and decodes) in one launch,
plus a split-sequence ("flash-decoding") path for decode-only batches with long contexts.

Single launch, grid (query tiles, KV heads). Sequence b's query rows are cut into tiles of BLOCK_Q rows; its tiles
are numbered from cu_seqlens_q[b] // BLOCK_Q + b, which never overlaps the next sequence's numbering, so
T // BLOCK_Q + B programs per KV head cover every ragged batch and a program finds its sequence by a binary search
over cu_seqlens_q (surplus programs exit). One program owns one KV head and a [BLOCK_Q rows x GROUP_P heads] block
of query vectors (the GQA group, padded to a power of two), i.e. a BLOCK_M = BLOCK_Q * GROUP_P row tile: every
K/V tile is loaded once and used by all query heads sharing that KV head. K/V tiles are TILE_N consecutive
positions gathered through the block table, the causal mask uses each row's absolute position
seq_len - q_len + i, and the softmax is online in fp32 (exp2 with a pre-scaled log2(e) * scale).

Split path, grid (B, KV heads, splits), when max_seqlen_q == 1: each program runs the same loop over one segment
of its sequence's context and writes unnormalised partials (running max, running sum, accumulator); a second
kernel, grid (T, H), merges the segments by log-sum-exp. It is chosen when few (sequence, KV head) programs would
otherwise face a long context; num_splits= or env TRELLM_ATTN_SPLITS forces a path (1 = single launch).

A sliding window (window > 0) masks keys more than window - 1 before a row and starts each program's loop at its
first row's window; soft-capping (SOFTCAP) maps each score through cap * tanh(s / cap) before the softmax.

Head sizes are padded to a power of two >= 16 with masks, and row tiles are >= 16, as tl.dot needs on GPUs.
"""

import torch
import triton
import triton.language as tl

from trellm_kernels import dispatch

LOG2E = 1.4426950408889634
TILE_N = 32          # keys per inner iteration (gathered across cache blocks, so independent of block_size)
NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for running maxima: fully masked rows never make NaN


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: Triton's CPU interpreter multiplies bf16 tiles as raw integers, so it gets fp32 operands instead.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _decode_kv(raw, dtype: tl.constexpr, QUANT: tl.constexpr):
    """An INT8 (QUANT 1) or FP8 e4m3 (QUANT 2: its bits as uint8; 3: the same, converted by the GPU's own FP8
    instructions, sm_89 and later) tile in `dtype`, before its scales. QUANT 2 decodes with integer arithmetic,
    exactly, on any GPU and in the interpreter. Every e4m3 and int8 value is exact in fp16, bf16 and fp32."""
    if QUANT == 1:
        return raw.to(tl.float32).to(dtype)    # (the interpreter casts int8 to bf16 wrongly when direct)
    if QUANT == 3:
        return raw.to(tl.float8e4nv, bitcast=True).to(dtype)
    b = raw.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -mag, mag).to(dtype)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))               # in (0, 1]: never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend(acc, m_i, l_i, q, q_pos, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, key_lo, key_hi, block_size,
            s_kb, s_ks, s_vb, s_vs, s_ksb, s_kss, s_vsb, s_vss, qk_scale, window, cap, HEAD_DIM: tl.constexpr,
            D_P: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
            SOFTCAP: tl.constexpr):
    """Online softmax of the rows q ([M, D_P], absolute positions q_pos) over keys [key_lo, key_hi), each row
    seeing keys q_pos - window < j <= q_pos. QUANT (1 INT8, 2 FP8): key j's scale multiplies score j, value j's
    scale the weight p_j, so tiles are only converted. SOFTCAP: scores (log2 domain) capped at cap * tanh(s / cap),
    cap the soft cap times log2(e)."""
    d = tl.arange(0, D_P)
    for start in range(key_lo, key_hi, TILE):
        kpos = start + tl.arange(0, TILE)
        kmask = kpos < key_hi
        blk = tl.load(bt_ptr + kpos // block_size, mask=kmask, other=0).to(tl.int64)
        slot = kpos % block_size
        lmask = kmask[None, :] & (d[:, None] < HEAD_DIM)
        k_t = tl.load(kc_ptr + blk[None, :] * s_kb + slot[None, :] * s_ks + d[:, None], mask=lmask, other=0)
        if QUANT == 0:
            s = _dot(q, k_t.to(q.dtype), PREC, UPCAST) * qk_scale                   # [M, TILE], log2 domain
        else:
            k_sc = tl.load(ks_ptr + blk * s_ksb + slot * s_kss, mask=kmask, other=0.0).to(tl.float32)
            s = _dot(q, _decode_kv(k_t, q.dtype, QUANT), PREC, UPCAST) * (k_sc * qk_scale)[None, :]
        if SOFTCAP:
            s = cap * _tanh(s / cap)
        seen = (kpos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - kpos[None, :] < window)
        s = tl.where(seen & kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + blk[:, None] * s_vb + slot[:, None] * s_vs + d[None, :],
                    mask=kmask[:, None] & (d[None, :] < HEAD_DIM), other=0)
        if QUANT == 0:
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        else:
            v_sc = tl.load(vs_ptr + blk * s_vsb + slot * s_vss, mask=kmask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + _dot((p * v_sc[None, :]).to(q.dtype), _decode_kv(v, q.dtype, QUANT),
                                              PREC, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attn_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, qk_scale,
                       window, cap, num_seqs, block_size, s_qt, s_qh, s_ot, s_oh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bt,
                       s_ksb, s_kss, s_vsb, s_vss,
                       GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                       D_P: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                       QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # Largest b with cu_q[b] // BLOCK_Q + b <= pid: the sequence whose tile numbering contains pid.
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = lo
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_len = seq_len - q_len
        m = tl.arange(0, BLOCK_Q * GROUP_P)
        qi = q_tile * BLOCK_Q + m // GROUP_P                 # query row inside the sequence
        head = kvh * GROUP + m % GROUP_P
        row_ok = (qi < q_len) & (m % GROUP_P < GROUP)
        d = tl.arange(0, D_P)
        io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
        row = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + row[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=io_mask, other=0.0)
        q_pos = tl.where(row_ok, ctx_len + qi, -1)
        key_hi = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)   # last key any row of the tile may see
        key_lo = tl.maximum(0, ctx_len + q_tile * BLOCK_Q - window + 1)  # first key the tile's first row sees
        acc = tl.zeros([BLOCK_Q * GROUP_P, D_P], dtype=tl.float32)
        m_i = tl.full([BLOCK_Q * GROUP_P], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kc_ptr + kvh * s_kh, vc_ptr + kvh * s_vh, ks_ptr + kvh,
                                vs_ptr + kvh, bt_ptr + b.to(tl.int64) * s_bt, key_lo, key_hi, block_size, s_kb,
                                s_ks, s_vb, s_vs, s_ksb, s_kss, s_vsb, s_vss, qk_scale, window, cap, HEAD_DIM, D_P,
                                TILE, PREC, UPCAST, QUANT, SOFTCAP)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _split_decode_kernel(part_acc_ptr, part_ml_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cu_q_ptr, seq_lens_ptr,
                         bt_ptr, qk_scale, window, cap, block_size, split_len, num_heads, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs,
                         s_vh, s_bt, s_ksb, s_kss, s_vsb, s_vss, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr, TILE: tl.constexpr,
                         PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_q_ptr + b)
    if tl.load(cu_q_ptr + b + 1) > q_row:                       # decode-only: the sequence has one query row
        seq_len = tl.load(seq_lens_ptr + b)
        g = tl.arange(0, BLOCK_M)
        row_ok = g < GROUP
        head = kvh * GROUP + g
        d = tl.arange(0, D_P)
        row64 = q_row.to(tl.int64)
        q = tl.load(q_ptr + row64 * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        q_pos = tl.where(row_ok, seq_len - 1, -1)
        key_lo = tl.maximum(0, seq_len - window) + split * split_len   # segments cover the row's window
        key_hi = tl.minimum(seq_len, key_lo + split_len)
        acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kc_ptr + kvh * s_kh, vc_ptr + kvh * s_vh, ks_ptr + kvh,
                                vs_ptr + kvh, bt_ptr + b.to(tl.int64) * s_bt, key_lo, key_hi, block_size, s_kb,
                                s_ks, s_vb, s_vs, s_ksb, s_kss, s_vsb, s_vss, qk_scale, window, cap, HEAD_DIM, D_P,
                                TILE, PREC, UPCAST, QUANT, SOFTCAP)
        # partials laid out [T, H, NUM_SPLITS, D_P] and [T, H, NUM_SPLITS, 2] (max, sum)
        idx = (row64 * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + idx[:, None] * D_P + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, s_ot, s_oh, num_heads, NUM_SPLITS: tl.constexpr,
                         SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    d = tl.arange(0, D_P)
    idx = (t * num_heads + h) * NUM_SPLITS + sp
    smask = sp < NUM_SPLITS
    m_s = tl.load(part_ml_ptr + idx * 2, mask=smask, other=NEG_BIG)
    l_s = tl.load(part_ml_ptr + idx * 2 + 1, mask=smask, other=0.0)
    acc_s = tl.load(part_acc_ptr + idx[:, None] * D_P + d[None, :], mask=smask[:, None], other=0.0)
    w = tl.exp2(m_s - tl.max(m_s, axis=0))                  # empty segments have m = NEG_BIG -> weight 0
    out = tl.sum(acc_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + t * s_ot + h * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def native_fp8(device: torch.device) -> bool:
    """Whether the GPU converts FP8 e4m3 itself (sm_89 and later; never in the interpreter)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
            and not dispatch.settings().triton_interpret)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int,
                      device: torch.device) -> int:
    """1 (single launch) unless the batch is decode-only and (sequence, KV head) programs are too few for the
    GPU while each faces a long context; then enough segments of >= 256 keys to give about two waves."""
    forced = dispatch.settings().attn_splits
    if max_seqlen_q != 1:
        return 1
    if forced:
        return forced
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128
    programs = num_seqs * num_kv_heads
    if programs >= sms or max_seqlen_k < 512:
        return 1
    return max(1, min(64, max_seqlen_k // 256, triton.cdiv(2 * sms, programs)))


def paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                           max_seqlen_q: int, max_seqlen_k: int, *, num_splits: int | None = None, k_scale=None,
                           v_scale=None, window: int = 0, softcap: float = 0.0):
    """Same arguments and result as paged_attention_reference ([T, H, D] in q's dtype). num_splits: None picks a
    path (see choose_num_splits); 1 forces the single launch; > 1 forces the split path (decode-only batches).
    An INT8 or FP8 cache (int8 / float8_e4m3fn) comes with its float16 scales [num_blocks, block_size, KVH]."""
    T, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    B = seq_lens.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or B == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    seen_k = min(max_seqlen_k, window) if window > 0 else max_seqlen_k     # the most keys a row sees
    if num_splits is None:
        num_splits = choose_num_splits(B, KVH, max_seqlen_q, seen_k, q.device)
    if num_splits > 1 and max_seqlen_q != 1:
        raise ValueError("the split path serves decode-only batches (max_seqlen_q == 1)")
    group = H // KVH
    group_p = triton.next_power_of_2(group)
    d_p = max(16, triton.next_power_of_2(D))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"        # fp32 inputs: exact products, no TF32
    upcast = q.dtype == torch.bfloat16 and not isinstance(_paged_attn_kernel, triton.runtime.JITFunction)
    cu_q, lens, bt = cu_seqlens_q.contiguous(), seq_lens.contiguous(), block_tables.contiguous()
    quant = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0)
    if quant == 2 and native_fp8(q.device):
        quant = 3
    if quant:
        assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1
        raw = torch.int8 if quant == 1 else torch.uint8
        k_cache, v_cache = k_cache.view(raw), v_cache.view(raw)
    else:
        k_scale = v_scale = k_cache          # not read: QUANT=0 compiles the scale loads away
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    scale_strides = (k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1))
    qk_scale = scale * LOG2E
    window = window if window > 0 else 1 << 30
    cap = softcap * LOG2E if softcap > 0 else 1.0
    if num_splits == 1:
        block_m = max(group_p, 16 if max_seqlen_q * group_p <= 16 else 64)
        block_q = block_m // group_p
        grid = (T // block_q + B, KVH)
        _paged_attn_kernel[grid](out, q, k_cache, v_cache, k_scale, v_scale, cu_q, lens, bt, qk_scale, window, cap,
                                 B, block_size, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides,
                                 bt.stride(0), *scale_strides, GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
                                 HEAD_DIM=D, D_P=d_p, TILE=TILE_N, PREC=prec, UPCAST=upcast, QUANT=quant,
                                 SOFTCAP=softcap > 0)
        return out
    split_len = triton.cdiv(triton.cdiv(seen_k, num_splits), TILE_N) * TILE_N
    part_acc = torch.empty(T, H, num_splits, d_p, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(T, H, num_splits, 2, dtype=torch.float32, device=q.device)
    _split_decode_kernel[(B, KVH, num_splits)](
        part_acc, part_ml, q, k_cache, v_cache, k_scale, v_scale, cu_q, lens, bt, qk_scale, window, cap, block_size,
        split_len,
        H, q.stride(0), q.stride(1), *kv_strides, bt.stride(0), *scale_strides, NUM_SPLITS=num_splits, GROUP=group,
        BLOCK_M=max(16, group_p), HEAD_DIM=D, D_P=d_p, TILE=TILE_N, PREC=prec, UPCAST=upcast, QUANT=quant,
        SOFTCAP=softcap > 0)
    _merge_splits_kernel[(T, H)](out, part_acc, part_ml, out.stride(0), out.stride(1), H, NUM_SPLITS=num_splits,
                                 SPLITS_P=triton.next_power_of_2(num_splits), HEAD_DIM=D, D_P=d_p)
    return out
