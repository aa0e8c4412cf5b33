"""Triton RMSNorm, alone and fused with the residual add, in Hugging Face Llama's rounding order.

Grid: one program per row of the last dimension (any leading dims are flattened to rows, so a per-head norm on
[T, H, D] is T*H rows of D). The whole row fits one tile, so the variance is a single in-register reduction and
x is read once. Rounding follows the reference exactly: x + residual is rounded to the input dtype (and stored as
the new residual), the variance and normalisation run in fp32, the normalised value is rounded to the input dtype
and only then multiplied by the weight. All arithmetic is done on fp32 values, never on fp16/bf16 registers.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, s_x, s_r, s_o, s_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * s_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)          # round to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, residual, weight, eps):
    n = x.shape[-1]
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=in_dtype, device=x.device)
    x2 = _rows(x, n)
    r2 = x2 if residual is None else _rows(residual, n)
    o2, ro2 = out.view(-1, n), (out if res_out is None else res_out).view(-1, n)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), o2, ro2, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=min(16, max(1, block // 512)))
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading dims); weight: [x.shape[-1]]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + residual), x + residual) from one pass over the rows."""
    return _launch(x, residual, weight, eps)
