"""act(gate) * up after a merged gate/up projection: SiLU (Llama, Qwen, Mistral, Phi-3) or GELU's tanh approximation
(Gemma)."""
import torch
import torch.nn.functional as F

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_activation import silu_and_mul_triton
        return silu_and_mul_triton(x)
    ops = cpu_ops.for_tensor(x)
    if ops is not None and x.is_contiguous():
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        ops.silu_and_mul(out, x)
        return out
    return silu_and_mul_reference(x)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns gelu_tanh(gate) * up, [..., I] (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_activation import gelu_tanh_and_mul_triton
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_reference(x)
