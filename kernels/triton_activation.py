"""Triton SiLU-and-multiply for a merged gate/up projection: x [..., 2I] -> silu(x[..., :I]) * x[..., I:].

Grid: (rows, column blocks). Every output element depends only on the gate and up values in its own column, so
rows are flattened and each program handles one row's slice of BLOCK columns, reading the matching gate and up
slices once. Rounding matches PyTorch: silu(gate) is rounded to x's dtype before the multiply by up.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns [..., I] in x's dtype."""
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * inter)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    o2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, o2, x2.stride(0), o2.stride(0), inter,
                                                                       BLOCK=block)
    return out
