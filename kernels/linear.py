"""The model's matrix multiplications: y = x W^T + b, with W prepared once at load for the device's fastest path.

On a CPU, torch's fp32 `linear` calls MKL's sgemm, which is slow at the small token counts of decode steps;
oneDNN's matmul (`mkldnn._linear_pointwise`, what torch.compile's CPU freezing path emits) is faster there and no
slower for large prefill chunks (perf/RESULTS.md, "Linear layers"). bf16 `linear` already runs oneDNN. On CUDA,
`linear` is cuBLAS and the weight is used as it is. TRELLM_CPU_LINEAR=torch keeps torch's own path on a CPU.

Weight-only INT8 (`quantization="int8"`): each output row of W is scaled by its largest magnitude / 127 and rounded
to int8 at load, so a decode step reads a quarter of the fp32 bytes. The reference dequantizes and multiplies; CUDA
runs the Triton kernel (triton_linear.py), a CPU torch's `_weight_int8pack_mm`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trellm_kernels.dispatch import use_triton


QUANTIZATIONS = ("none", "int8")


@dataclass
class Weight:
    """A linear layer's weight [out, in], held once: dense, only in its prepared layout (keeping both would
    double the memory of every linear layer), or as int8 rows with one scale each."""
    dense: torch.Tensor | None
    prepared: torch.Tensor | None = None   # oneDNN's layout on a CPU
    qweight: torch.Tensor | None = None    # int8 [out, in]
    scales: torch.Tensor | None = None     # [out], in the activations' dtype: W ~= qweight * scales[:, None]

    def tensor(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (a copy when only the prepared or quantized form is held)."""
        if self.qweight is not None:
            return (self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(self.scales.dtype)
        return self.dense if self.dense is not None else self.prepared.to_dense()


def quantize_int8(w: torch.Tensor) -> Weight:
    """Symmetric per-output-row INT8: scale = max |w| of the row / 127 (rows of zeros get scale 1)."""
    amax = w.detach().float().abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w.float() / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Weight(None, qweight=q, scales=scales.to(w.dtype).contiguous())


def cpu_linear_mode() -> str:
    mode = os.environ.get("TRELLM_CPU_LINEAR", "onednn")
    if mode not in ("onednn", "torch"):
        raise ValueError(f"TRELLM_CPU_LINEAR={mode!r} is not one of onednn, torch")
    return mode


def prepare_weight(w: torch.Tensor, quantization: str = "none", typical_tokens: int = 64) -> Weight:
    """Prepare W for `linear`; `typical_tokens` is oneDNN's hint for the layout (any token count works)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "int8":
        return quantize_int8(w)
    if w.device.type == "cpu" and w.dtype == torch.float32 and cpu_linear_mode() == "onednn" \
            and torch.backends.mkldnn.is_available():
        return Weight(None, torch.ops.mkldnn._reorder_linear_weight(w, typical_tokens))
    return Weight(w)


def linear_reference(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.tensor(), bias)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]."""
    if w.qweight is not None:
        return int8_linear(x, w, bias)
    if w.prepared is not None:
        return torch.ops.mkldnn._linear_pointwise(x, w.prepared, bias, "none", [], "")
    return linear_reference(x, w, bias)


def int8_linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_linear import int8_linear_triton
        return int8_linear_triton(x, w.qweight, w.scales, bias)
    K = x.shape[-1]
    if x.device.type == "cpu" and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and K % 64 == 0)):
        # int8 x float rows, converted in registers; one GEMM for all tokens. (torch 2.13's bf16 kernel reads past
        # rows whose length is not a multiple of its vector: it crashed at 130 and 40 and returned inf at 130.)
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w.qweight, w.scales)
        y = y.reshape(*x.shape[:-1], w.qweight.shape[0])
        return y if bias is None else y + bias
    return linear_reference(x, w, bias)
