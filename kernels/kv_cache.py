"""Write new keys and values into the paged KV cache through a slot mapping.

slot = block_id * block_size + offset_in_block; a slot of -1 means "skip" (padding), so padded batches are safe.
"""
import torch

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
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
