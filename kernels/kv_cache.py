"""Write new keys and values into the paged KV cache through a slot mapping, quantizing them when the cache is INT8
or FP8 (`kv_cache_dtype`).

slot = block_id * block_size + offset_in_block; a slot of -1 means "skip" (padding), so padded batches are safe.

Quantized caches (k_cache.dtype int8 or float8_e4m3fn) come with scale tensors beside them, [num_blocks,
block_size, KVH] float16: one scale per token and KV head. Why per token and head rather than per block:
- a token's K/V are written once, in the step that computes them, and never touched again; a per-block scale would
  have to grow as a block fills (decodes add one token at a time), re-quantizing the block's earlier tokens on every
  write that raises its maximum, a read-modify-write racing with the other tokens of the same chunk;
- keys differ in size from token to token (the first token's and some outlier tokens' keys are many times larger
  than the rest): a block-wide scale set by one of them would leave the others a few of the 255 levels;
- the cost is 2 bytes per head_dim values (3% of an INT8 head of 64; scales in float16, so that INT8 still holds
  more than 1.9x the tokens of a 2-byte cache at head_dim 64).
One scale per token and head is also the finest a kernel can apply outside its dot products: the scale of key j
multiplies score j, the scale of value j the softmax weight p_j, so attention never dequantizes a whole tile.

The quantizer, exactly (every implementation follows these steps in float32 and agrees bit for bit):
    amax = max_d |x_d|;  s = float16(max(amax / QMAX, 2**-14));  y = x / float(s)   (IEEE division)
    INT8:     q = clamp(round_half_even(y), -127, 127)                     QMAX = 127 (symmetric, -128 unused)
    FP8 e4m3: q = float8_e4m3fn(clamp(y, -448, 448)), round half to even   QMAX = 448 (the format's largest)
and x is read back as float(q) * float(s). The floor on s (float16's smallest normal) keeps an all-zero row
finite; values that small quantize to zero anyway.
"""
import torch

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton
from trellm_kernels.rotary import apply_rotary

# kv_cache_dtype parameter -> the cache tensor's dtype (auto: the model's dtype, no scales).
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -14


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (q [..., D] in cache_dtype, scales [...] float16), the quantizer of the module docstring."""
    xf = x.float()
    qmax = QMAX[cache_dtype]
    s = (xf.abs().amax(dim=-1) / qmax).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    y = xf / s.float()[..., None]
    if cache_dtype == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), s
    return y.clamp(-qmax, qmax).to(cache_dtype), s


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float(q) * float(scale), per token and head, in `dtype`."""
    return (q.float() * scales.float()[..., None]).to(dtype)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, KVH, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; slot_mapping: [T] int; for an INT8 or
    FP8 cache, k_scale, v_scale: [num_blocks, block_size, KVH] float16."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_quantized(cache):
            q, s = quantize_kv(x[valid], cache.dtype)
            cache.view(-1, *cache.shape[2:])[slots] = q
            scale.view(-1, scale.shape[-1])[slots] = s
        else:
            cache.view(-1, *cache.shape[2:])[slots] = x[valid].to(cache.dtype)


def _check_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are quantized; a quantized cache must come with both scales and caches of one dtype."""
    quantized = is_quantized(k_cache)
    if quantized and (k_scale is None or v_scale is None or k_cache.dtype != v_cache.dtype):
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale, and v_cache of the same dtype")
    return quantized


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store k and v at their slots in the caches (in place), quantized for an INT8/FP8 cache."""
    quantized = _check_scales(k_cache, v_cache, k_scale, v_scale)
    if use_triton(k):
        from trellm_kernels.triton_kv_cache import write_kv_triton
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ops = cpu_ops.for_tensor(k)
    if ops is not None and _rows_of_contiguous_heads(k) and _rows_of_contiguous_heads(v) \
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k.dtype == v.dtype:
        if not quantized and k.dtype == k_cache.dtype:
            return ops.write_kv(k, v, k_cache, v_cache, slot_mapping.to(torch.int32))
        if quantized and k.dtype in (torch.float32, torch.bfloat16) and k_scale.is_contiguous() \
                and v_scale.is_contiguous():
            return ops.write_kv_quantized(k, v, k_cache.view(torch.int8), v_cache.view(torch.int8), k_scale,
                                          v_scale, slot_mapping.to(torch.int32), k_cache.dtype == torch.int8)
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None,
                        v_scale=None) -> torch.Tensor:
    """Rotate q and k by their positions (rotary.py) and store k and v at their slots: on a GPU in one launch
    (triton_kv_cache.rotary_write_kv_triton, which reads k's rows where they are), else the two operations one
    after the other. Returns the rotated q; k is not to be read afterwards (the cache holds it)."""
    if use_triton(q):
        _check_scales(k_cache, v_cache, k_scale, v_scale)
        from trellm_kernels.triton_kv_cache import rotary_write_kv_triton
        return rotary_write_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
                                      v_scale)
    q, k = apply_rotary(q, k.contiguous(), positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def _rows_of_contiguous_heads(t: torch.Tensor) -> bool:
    """[T, KVH, D] whose KVH * D values of each token are contiguous (a view into a merged qkv qualifies)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]
