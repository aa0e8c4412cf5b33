"""Random inputs for the kernels: the paged-attention batches that tests/test_kernels.py and tests/test_cpu_ops.py
check and that perf/bench_attention.py and perf/bench_kv_cuda.py time, and the mixture-of-experts cases of
tests/test_kernels.py and tests/test_moe.py, built in one place so that what is timed is what is tested."""
import torch

from trellm_kernels import kv_cache, moe


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def paged_case(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """A batch whose sequence b has ctx_lens[b] cached tokens and q_lens[b] new ones, as paged_attention's
    arguments. Blocks are a random permutation (so neither contiguous nor ordered), the table is -1 padded, spare
    blocks hold garbage."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    n_blocks = [-(-s // block_size) for s in seq_lens]
    total = sum(n_blocks) + 3
    perm = torch.randperm(total, generator=g).to(torch.int32)
    tables = torch.full((len(q_lens), max(n_blocks) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[used:used + n]
        used += n
    k_cache = randn(g, total, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(g, total, block_size, kv_heads, head_dim, dtype=dtype)
    q = randn(g, sum(q_lens), heads, head_dim, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, head_dim ** -0.5,
            max(q_lens), max(seq_lens))


def quantized(args, cache_dtype):
    """paged_case's arguments with its caches quantized to cache_dtype (kv_cache.quantize_kv), and their scales."""
    q, k_cache, v_cache = args[:3]
    qk, k_scale = kv_cache.quantize_kv(k_cache, cache_dtype)
    qv, v_scale = kv_cache.quantize_kv(v_cache, cache_dtype)
    return (q, qk, qv, *args[3:]), dict(k_scale=k_scale, v_scale=v_scale)


def moe_case(tokens, experts, top_k, hidden, inter, dtype=torch.float32, seed=0):
    """fused_moe's arguments in stacked form: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (scaled to keep outputs of order
    one), and a routing of random logits, renormalised for even seeds."""
    g = torch.Generator().manual_seed(seed)
    x = randn(g, tokens, hidden, dtype=dtype)
    w13 = (randn(g, experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype)
    w2 = (randn(g, experts, hidden, inter) / inter ** 0.5).to(dtype)
    weights, ids = moe.route(randn(g, tokens, experts), top_k, renormalize=seed % 2 == 0)
    return x, w13, w2, weights, ids
