"""LoRA's term on the kernels' two paths. A GPU: shrink and expand over a token -> adapter-slot index (models/lora.py
stacks the step's adapters), the Triton kernels, with PyTorch references. A CPU: `lora_add` over one adapter's rows
(models/lora.py runs it per adapter), the C++ operator for decode-sized row counts, else two matmuls."""
import torch

from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton

# Most rows `lora_add` sends to the C++ operator: from about 8 rows torch's matmuls (threaded, blocked) are as fast
# (perf/RESULTS.md, section "LoRA, second part").
CPU_OP_MAX_ROWS = 4


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, scale: float) -> None:
    """out += scale * ((x @ at) @ bt), in place: x [T, K], at = A^T [K, R], bt = B^T [R, N], out [T, N]."""
    out.addmm_(x @ at, bt, alpha=scale)


def lora_add(out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, spans: torch.Tensor,
             scale: float) -> None:
    """lora_add_reference's term, where bt's rank row r is zero outside its columns spans[r] = (first, count)."""
    ops = cpu_ops.for_tensor(x)
    if (ops is not None and x.shape[0] <= CPU_OP_MAX_ROWS and x.dtype == out.dtype == torch.float32
            and x.stride(1) == 1 and out.stride(1) == 1):
        ops.lora_add(out, x, at, bt, spans, scale)
        return
    lora_add_reference(out, x, at, bt, scale)


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [L, R, K], slots [T] (-1: no adapter) -> t [T, R] fp32 (zeros for slot -1)."""
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = slots == slot
            t[rows] = x[rows].float() @ a[slot].float().T
    return t


def lora_expand_reference(out: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                          scales: torch.Tensor, col0: int, r0: int) -> None:
    """out[tok, col0:col0 + N] += scales[slot] * (t[tok, r0:r0 + R] @ b[slot]^T) for tokens of slot >= 0."""
    N, R = b.shape[1], b.shape[2]
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = slots == slot
            d = (t[rows, r0:r0 + R] @ b[slot].float().T) * scales[slot].float()
            out[rows, col0:col0 + N] = (out[rows, col0:col0 + N].float() + d).to(out.dtype)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_lora import lora_shrink_triton
        return lora_shrink_triton(x, a, slots)
    return lora_shrink_reference(x, a, slots)


def lora_expand(out: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                col0: int, r0: int) -> None:
    if use_triton(out):
        from trellm_kernels.triton_lora import lora_expand_triton
        lora_expand_triton(out, t, b, slots, scales, col0, r0)
    else:
        lora_expand_reference(out, t, b, slots, scales, col0, r0)
