"""The one place that decides between a Triton-lang kernel and its PyTorch reference."""
import os

import torch


def force_triton() -> bool:
    """True when kernels must run through Triton even on CPU tensors (with TRITON_INTERPRET=1)."""
    return os.environ.get("TRELLM_FORCE_TRITON", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an operation on tensor `t` runs its Triton kernel rather than the PyTorch reference."""
    return t.is_cuda or force_triton()
