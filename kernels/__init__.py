"""Hot-path operations of the engine, one module per operation.

Each module holds the PyTorch reference (which also serves CPUs and is the kernels' test oracle) and the one
dispatch function the engine calls. `use_triton(t)` decides, per call, whether a Triton-lang kernel runs:
on CUDA tensors always, on CPU tensors only when TRELLM_FORCE_TRITON=1 together with TRITON_INTERPRET=1
(Triton's interpreter), which is how the tests check kernels without a GPU.
"""
from trellm_kernels.dispatch import use_triton

__all__ = ["use_triton"]
