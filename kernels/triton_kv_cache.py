"""Triton kernel that scatters this step's K and V rows into the paged KV cache.

Grid: one program per token. A token's keys (and values) for all KV heads are one small [KVH, D] tile, so a
program moves the whole token with one load and one store per cache; tokens never share a slot, so programs are
independent. slot = block_id * block_size + offset_in_block; a slot of -1 marks padding and the program stores
nothing, leaving that part of the cache untouched.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, block_size, num_kv_heads, head_dim,
                     s_kt, s_kh, s_vt, s_vh,
                     s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * s_kt + h * s_kh + d, mask=mask)
        v = tl.load(v_ptr + t64 * s_vt + h * s_vh + d, mask=mask)
        tl.store(kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] (any row strides); caches: [num_blocks, block_size, KVH, D]; slot_mapping: [T]."""
    T, KVH, D = k.shape
    if T == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), k_cache.shape[1], KVH, D,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(KVH), BLOCK_D=triton.next_power_of_2(D))
