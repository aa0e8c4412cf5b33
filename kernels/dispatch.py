"""The kernel choice in one place: the settings that pick an operation's implementation, read from the environment
once, and the test every dispatch function makes first.

Each operation module (activation, attention, kv_cache, linear, rmsnorm, rotary) tries its implementations in
one order: the Triton-lang kernel when `use_triton(t)`, else the C++ CPU operator when `cpu_ops.for_tensor(t)` has
one and the inputs suit it, else its PyTorch reference (the tests' oracle).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

CPU_LINEAR_MODES = ("auto", "cpp", "onednn", "torch")


@dataclass(frozen=True)
class KernelSettings:
    force_triton: bool = False       # TRELLM_FORCE_TRITON=1: Triton kernels on CPU tensors (with TRITON_INTERPRET=1)
    cpu_ops: bool = True             # TRELLM_CPU_OPS=0: no C++ CPU operators (the PyTorch path)
    cpu_ops_cache: str | None = None  # TRELLM_CPU_OPS_CACHE: where the C++ operators are built (cpu_ops.build_dir)
    cpu_linear: str = "auto"         # TRELLM_CPU_LINEAR: CPU linear layers: auto (timed at load), cpp, onednn, torch
    decode_layers: bool = True       # TRELLM_DECODE_LAYERS=0: short steps run layer by layer from Python on a CPU too
    attn_splits: int | None = None   # TRELLM_ATTN_SPLITS: decode attention's key segments on a GPU (None: chosen)
    triton_interpret: bool = False   # TRITON_INTERPRET=1: Triton's interpreter (read by Triton itself too)

    @classmethod
    def from_env(cls, env=os.environ) -> "KernelSettings":
        linear = env.get("TRELLM_CPU_LINEAR", "auto")
        if linear not in CPU_LINEAR_MODES:
            raise ValueError(f"TRELLM_CPU_LINEAR={linear!r} is not one of {', '.join(CPU_LINEAR_MODES)}")
        splits = env.get("TRELLM_ATTN_SPLITS")
        if splits is not None and not (splits.isdigit() and int(splits) >= 1):
            raise ValueError(f"TRELLM_ATTN_SPLITS={splits!r} must be an integer >= 1")
        return cls(force_triton=env.get("TRELLM_FORCE_TRITON", "0") == "1",
                   cpu_ops=env.get("TRELLM_CPU_OPS", "1") != "0",
                   cpu_ops_cache=env.get("TRELLM_CPU_OPS_CACHE") or None,
                   cpu_linear=linear,
                   decode_layers=env.get("TRELLM_DECODE_LAYERS", "1") != "0",
                   attn_splits=int(splits) if splits else None,
                   triton_interpret=env.get("TRITON_INTERPRET") == "1")


_settings: KernelSettings | None = None


def settings() -> KernelSettings:
    """This process's kernel settings (read from the environment at the first call)."""
    global _settings
    if _settings is None:
        _settings = KernelSettings.from_env()
    return _settings


def use_triton(t: torch.Tensor) -> bool:
    """Whether an operation on tensor `t` runs its Triton kernel rather than the C++ operator or the reference."""
    return t.is_cuda or settings().force_triton
