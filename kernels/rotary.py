"""Rotary position embedding (rotate-half convention of Hugging Face Llama/Qwen) from a cos/sin cache."""
import torch

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton


def rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """q: [T, H, D], k: [T, KVH, D], positions: [T], cos_sin_cache: [max_pos, R] fp32 holding cos (first R/2
    columns) and sin (last R/2) for the rotated width R <= D. Returns new (q, k)."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]

    def rotate(x):
        xr, xp = x[..., :rot], x[..., rot:]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = xr.chunk(2, dim=-1)
        out = xr * c + torch.cat((-x2, x1), dim=-1) * s
        return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out

    return rotate(q), rotate(k)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotate q and k by their positions; returns (q, k) (the Triton kernel and the CPU operator rotate in place
    and return them)."""
    if use_triton(q):
        from trellm_kernels.triton_rotary import rotary_triton
        return rotary_triton(q, k, positions, cos_sin_cache)
    ops = cpu_ops.for_tensor(q)
    if ops is not None and q.is_contiguous() and k.is_contiguous() and cos_sin_cache.dtype == torch.float32:
        ops.rotary(q, k, positions.to(torch.int32), cos_sin_cache.contiguous())
        return q, k
    return rotary_reference(q, k, positions, cos_sin_cache)
