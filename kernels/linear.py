"""The model's matrix multiplications: y = x W^T + b, with W prepared once at load for the device's fastest path.

On a CPU, torch's fp32 `linear` calls MKL's sgemm, which is slow at the small token counts of decode steps;
oneDNN's matmul (`mkldnn._linear_pointwise`, what torch.compile's CPU freezing path emits) is faster there and no
slower for large prefill chunks (perf/RESULTS.md, "Linear layers"). bf16 `linear` already runs oneDNN. On CUDA,
`linear` is cuBLAS and the weight is used as it is. TRELLM_CPU_LINEAR=torch keeps torch's own path on a CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Weight:
    """A linear layer's weight [out, in], held once: dense, or only in its prepared layout (keeping both would
    double the memory of every linear layer)."""
    dense: torch.Tensor | None
    prepared: torch.Tensor | None = None   # oneDNN's layout on a CPU

    def tensor(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (a copy when only the prepared layout is held)."""
        return self.dense if self.dense is not None else self.prepared.to_dense()


def cpu_linear_mode() -> str:
    mode = os.environ.get("TRELLM_CPU_LINEAR", "onednn")
    if mode not in ("onednn", "torch"):
        raise ValueError(f"TRELLM_CPU_LINEAR={mode!r} is not one of onednn, torch")
    return mode


def prepare_weight(w: torch.Tensor, typical_tokens: int = 64) -> Weight:
    """Prepare W for `linear`; `typical_tokens` is oneDNN's hint for the layout (any token count works)."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and cpu_linear_mode() == "onednn" \
            and torch.backends.mkldnn.is_available():
        return Weight(None, torch.ops.mkldnn._reorder_linear_weight(w, typical_tokens))
    return Weight(w)


def linear_reference(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.tensor(), bias)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]."""
    if w.prepared is not None:
        return torch.ops.mkldnn._linear_pointwise(x, w.prepared, bias, "none", [], "")
    return linear_reference(x, w, bias)
