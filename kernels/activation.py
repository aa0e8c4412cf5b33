"""SiLU(gate) * up after a merged gate/up projection."""
import torch
import torch.nn.functional as F

from trellm_kernels.dispatch import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_activation import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
