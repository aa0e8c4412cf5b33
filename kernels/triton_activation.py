"""Triton activation-and-multiply for a merged gate/up projection: x [..., 2I] -> act(x[..., :I]) * x[..., I:], with
act SiLU (Llama, Qwen, Mistral, Phi-3) or GELU's tanh approximation (Gemma).

Grid: (rows, column blocks). Every output element depends only on the gate and up values in its own column, so
rows are flattened and each program handles one row's slice of BLOCK columns, reading the matching gate and up
slices once. Rounding matches PyTorch: act(gate) is rounded to x's dtype before the multiply by up. GELU-tanh is
computed as g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3), which is 0.5 g (1 + tanh z).
"""
import torch
import triton
import triton.language as tl

SILU, GELU_TANH = 0, 1


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, inter, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    else:
        a = g * tl.sigmoid(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))
    act = a.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * inter)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    o2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, o2, x2.stride(0), o2.stride(0), inter,
                                                                      ACT=act, BLOCK=block)
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns silu(gate) * up, [..., I] in x's dtype."""
    return _act_and_mul(x, SILU)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]; returns gelu_tanh(gate) * up, [..., I] in x's dtype."""
    return _act_and_mul(x, GELU_TANH)
