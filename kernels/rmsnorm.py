"""RMSNorm, alone and fused with the residual add, in Hugging Face Llama's rounding order:
the variance in fp32, the normalised value cast back to the input dtype before the weight multiply."""
import torch

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))      # float64 stays: the tests' exact oracle
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    if use_triton(x):
        from trellm_kernels.triton_rmsnorm import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    ops = cpu_ops.for_tensor(x)
    if ops is not None and x.is_contiguous() and weight.dtype == x.dtype:
        out = torch.empty_like(x)
        ops.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual stream and the next block's input in one pass."""
    if use_triton(x):
        from trellm_kernels.triton_rmsnorm import fused_add_rms_norm_triton
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    ops = cpu_ops.for_tensor(x)
    if ops is not None and x.is_contiguous() and residual.is_contiguous() and x.dtype == residual.dtype == weight.dtype:
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
        ops.fused_add_rms_norm(out, res_out, x, residual, weight, eps)
        return out, res_out
    return fused_add_rms_norm_reference(x, residual, weight, eps)
