"""LoRA's shrink and expand over a token -> adapter-slot index (models/lora.py stacks the step's adapters): the Triton
kernels on a GPU, the PyTorch reference otherwise (a CPU runs models/lora.py's grouped matmuls instead)."""
import torch

from trellm_kernels.dispatch import use_triton


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
