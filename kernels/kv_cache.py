"""Write new keys and values into the paged KV cache through a slot mapping.

slot = block_id * block_size + offset_in_block; a slot of -1 means "skip" (padding), so padded batches are safe.
"""
import torch

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; slot_mapping: [T] int."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store k and v at their slots in the caches (in place)."""
    if use_triton(k):
        from trellm_kernels.triton_kv_cache import write_kv_triton
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    ops = cpu_ops.for_tensor(k)
    if ops is not None and _rows_of_contiguous_heads(k) and _rows_of_contiguous_heads(v) \
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k.dtype == v.dtype == k_cache.dtype:
        return ops.write_kv(k, v, k_cache, v_cache, slot_mapping.to(torch.int32))
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def _rows_of_contiguous_heads(t: torch.Tensor) -> bool:
    """[T, KVH, D] whose KVH * D values of each token are contiguous (a view into a merged qkv qualifies)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]
