"""Triton weight-only INT8 and INT4 linears: y = x (q * scale)^T + b (INT8: one scale per output row),
y = x ((q - zero) * scale)^T + b (INT4: a scale and zero point per group of inputs; kernels/int4.py) and
y = x (q * scale - min)^T (INT8 with a scale and a minimum per group of 16 or 32 inputs: GGUF's blocks,
kernels/group_quant.py; its tiles are dequantized in registers as INT4's are).

Grid: one program per (BLOCK_M rows of x) x (BLOCK_N output features). Each K step loads a [BLOCK_M, BLOCK_K] tile
of x and a [BLOCK_K, BLOCK_N] tile of q (transposed by its strides), converts q to the activation dtype in
registers (exact: |q| <= 127; fp16/bf16 then use the tensor cores) and accumulates in fp32 (fp32 activations: exact
products, no TF32; bf16 under the CPU interpreter: fp32 operands, as the attention kernel does); the per-row scale
multiplies the finished accumulator once,
so the weight is read from memory as one byte per element and never expanded in memory. Decode steps are
memory-bound, which is where the halved (bf16) or quartered (fp32) weight bytes pay.

INT4 reads its nibble-packed weight (uint8 [out, ceil(in/2)], even inputs in the low nibble) a byte per two
weights: each k of the tile loads byte k // 2 (the second load of a byte hits the cache) and shifts by 4 (k % 2),
so the unpacking is fused into the load and the weight never exists unpacked in memory. A K tile never spans two
groups (its size divides the group), so each tile loads one scale and zero per output column; the tile is
dequantized in registers, (q - zero) * scale in fp32, and rounded to the activations' dtype before the dot, exactly
as the reference rounds its dequantized weight. On a GPU it runs well behind cuBLAS's fp16 GEMM: correct, not yet
fast (per-element scale loads were slower still; loading the bytes once for two dots, even and odd inputs, was
slower too; perf/RESULTS.md, section "Weight-only INT4", its CUDA table). A split-K decode variant is what is left
for speed.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _int8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_qn, s_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        q = tl.load(q_ptr + rn[None, :].to(tl.int64) * s_qn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(x, q.to(x.dtype), input_precision=PREC)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (any float dtype), q [out, in] int8, scales [out] -> [..., out] in x's dtype."""
    K = x.shape[-1]
    N = q.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N, BLOCK_K = 64, 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not isinstance(_int8_linear_kernel, triton.runtime.JITFunction)
    _int8_linear_kernel[grid](x2, q, scales, bias if bias is not None else scales, y, M, N, K,
                              x2.stride(0), q.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PREC=prec, UPCAST=upcast)
    return y.reshape(*x.shape[:-1], N)


@triton.jit
def _int4_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_qn, s_ym,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        byte = tl.load(q_ptr + rn[None, :].to(tl.int64) * s_qn + kk[:, None] // 2,
                       mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        q = (byte.to(tl.int32) >> ((kk[:, None] % 2) * 4)) & 15
        g = k0 // GROUP          # BLOCK_K divides GROUP: the tile lies in one group, one scale and zero per column
        scale = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0).to(tl.float32)
        w = (q.to(tl.float32) - zero[None, :]) * scale[None, :]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (any float dtype), packed uint8 [out, ceil(in/2)], scales [G, out], zeros uint8 [G, out] ->
    [..., out] in x's dtype. Inputs already in the weight's stored order (act-order is gathered by the caller)."""
    K = x.shape[-1]
    N = packed.shape[0]
    if group not in (32, 64, 128) or packed.shape[1] != (K + 1) // 2 or scales.shape != (-(-K // group), N) or zeros.shape != scales.shape:
        raise ValueError(f"int4_linear_triton: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, zeros "
                         f"{tuple(zeros.shape)} do not fit {K} inputs in groups of {group}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N, BLOCK_K = 64, min(group, 64)   # group sizes are powers of two >= 32
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not isinstance(_int4_linear_kernel, triton.runtime.JITFunction)
    _int4_linear_kernel[grid](x2, packed, scales.contiguous(), zeros.contiguous(),
                              bias if bias is not None else scales, y, M, N, K, x2.stride(0), packed.stride(0),
                              y.stride(0), GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
                              BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PREC=prec, UPCAST=upcast)
    return y.reshape(*x.shape[:-1], N)


@triton.jit
def _group_linear_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, s_xm, s_qn, s_ym,
                              GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, GROUP):      # a K tile is one group: one scale (and minimum) per column
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + kk[None, :], mask=rm[:, None] < M, other=0.0)
        q = tl.load(q_ptr + rn[None, :].to(tl.int64) * s_qn + kk[:, None], mask=rn[None, :] < N, other=0)
        g = k0 // GROUP
        scale = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0)
        w = q.to(tl.float32) * scale[None, :]
        if HAS_MINS:
            w -= tl.load(m_ptr + g * N + rn, mask=rn < N, other=0.0)[None, :]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PREC)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def group_linear_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                             mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [..., K] (any float dtype), q int8 [N, K], float32 scales (and minimums) [K/group, N] -> [..., N] in x's
    dtype: y = x (q * scale - min)^T, each group's tile dequantized in fp32 and rounded to x's dtype before the dot
    (kernels/group_quant.py; GGUF's blocks)."""
    K, N = x.shape[-1], q.shape[0]
    if group not in (16, 32) or q.shape[1] != K or K % group or scales.shape != (K // group, N) or (
            mins is not None and mins.shape != scales.shape):
        raise ValueError(f"group_linear_triton: q {tuple(q.shape)}, scales {tuple(scales.shape)} do not fit {K} "
                         f"inputs in groups of {group}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N = 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not isinstance(_group_linear_kernel, triton.runtime.JITFunction)
    _group_linear_kernel[grid](x2, q, scales, mins if mins is not None else scales, y, M, N, K, x2.stride(0),
                                    q.stride(0), y.stride(0), GROUP=group, HAS_MINS=mins is not None,
                                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PREC=prec, UPCAST=upcast)
    return y.reshape(*x.shape[:-1], N)
