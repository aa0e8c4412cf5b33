"""The model's matrix multiplications: y = x W^T + b, with W prepared once at load for the device's fastest path.

On a CPU, torch's fp32 `linear` calls MKL's sgemm, which is slow at the small token counts of decode steps;
oneDNN's matmul (`mkldnn._linear_pointwise`, what torch.compile's CPU freezing path emits) is faster there and no
slower for large prefill chunks (perf/RESULTS.md, "Linear layers"). Faster still at decode sizes, where the
weights stream from memory every step, is the C++ operator (cpu/fp32_linear.cpp: faster than oneDNN up to 48 tokens,
level above; perf/RESULTS.md, "fp32 linear layers on AVX-512: a C++ operator"), on AVX-512 builds for weights whose
outputs are a multiple of its 32-output blocks; other fp32 weights take oneDNN. bf16 and fp16 weights stay dense for
torch's `linear`, except where its half GEMM goes row by row (no bf16/fp16 dot products, below AVX-512): there a
weight whose outputs fill the 32-output blocks is packed for the C++ operator (cpu/half_linear.cpp, fp32 arithmetic
on weights widened in cache), others take `dense_linear`. On a CPU with AVX512-BF16 the timed choice also offers a
bf16 operator on bf16 dot products (cpu/bf16_linear.cpp, the weight packed in k-pairs, `pack_pairs`).
On CUDA, `linear` is cuBLAS and the weight is used as it is.
That rule is one host's measurements; by default (TRELLM_CPU_LINEAR=auto) each shape's layout and calls are instead
chosen by timing them on this host at load (linear_choice.py). TRELLM_CPU_LINEAR=cpp forces the rule above,
`onednn` oneDNN's layout for fp32, `torch` torch's own path.

Weight-only INT8 (`quantization="int8"`): each output row of W is scaled by its largest magnitude / 127 and rounded to
int8 at load, so a decode step reads a quarter of the fp32 bytes. The reference dequantizes and multiplies; CUDA runs
the Triton kernel (triton_linear.py); a CPU the C++ operator (cpu/int8_linear.cpp), with the weights packed in
blocks of 32 outputs at load, at every token count. With AVX-512 it multiplies in fp32 (bf16/fp16 activations are
widened for it); with AVX2 only, whose fp32 FMAs would make INT8 no faster than fp32 at batch, it quantizes the
activations per token to int16 and multiplies on integer multiply-adds (1.5-2x fp32's speed per call from 16 tokens;
the activations' rounding is ~256x finer than the weights'; perf/RESULTS.md, "INT8 with AVX2: int16 activations").
(torch's own `_weight_int8pack_mm` was slower than fp32 oneDNN even for one token, perf/RESULTS.md, "Weight-only INT8
on a CPU"; its bf16 form crashed on rows not a multiple of its vector.)

W8A8 (`quantization="w8a8"`, as vLLM's CPU backend runs INT8 checkpoints): the weights as INT8's, and each call's
activations rounded per token to int8 too (scale max |x| / 127), so the products are integer dot products (VNNI,
AMX-INT8) with exact sums, then scaled by the token's and the weight row's scales. On a CPU with int8 dot products
it runs oneDNN's quantized GEMM on the weight prepacked at load; elsewhere (and on CUDA) the same rounding through a
float GEMM of the rounded integers. It is a mode of its own, not a candidate of INT8's: rounding the activations
moves greedy tokens further from the float model's than weight-only INT8 does (tests/test_quantization.py).

Weight-only INT4 (`quantization="int4"`, or "int4-g64"/"int4-g32" for smaller groups; GPTQ and AWQ checkpoints):
group-wise with zero points (int4.py says why and how it is laid out). CUDA runs the Triton kernel
(triton_linear.py), which unpacks the nibbles in registers. A CPU runs the group operator of GGUF's blocks
(`group_linear`, z * s as its minimum, fp32 activations) where the outputs fill its blocks of 32, faster than torch's
`_weight_int4pack_mm_for_cpu` at every token count measured (perf/RESULTS.md, "INT4 on the group operator"); torch's
operator (bf16 activations) where only it takes the shape (outputs a multiple of 16); and dequantize-then-GEMM (the
reference) for the rest. A short last group is padded to a whole one for either operator.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trellm_kernels import cpu_ops
from trellm_kernels import dispatch
from trellm_kernels import linear_choice
from trellm_kernels.dispatch import use_triton
from trellm_kernels.int4 import (Int4Weight, cpu_op_accepts, group_op_accepts, quantize_int4, to_cpu_groups,
                                 to_cpu_int4pack)
from trellm_kernels.group_quant import GroupWeight


# int4 is int4-g128: 128 inputs per scale, what most GPTQ/AWQ checkpoints use.
INT4_GROUPS = {"int4": 128, "int4-g64": 64, "int4-g32": 32}
QUANTIZATIONS = ("none", "int8", "w8a8", *INT4_GROUPS)


@dataclass
class Weight:
    """A linear layer's weight [out, in], held once: dense, only in its prepared layout (keeping both would
    double the memory of every linear layer), as int8 rows with one scale each, or as group-wise INT4."""
    dense: torch.Tensor | None
    prepared: torch.Tensor | None = None   # oneDNN's layout on a CPU (W8A8: its quantized GEMM's, int8)
    packed: torch.Tensor | None = None     # [out/B, in, B] (B = CPU_BLOCK): fp32 for cpu/fp32_linear.cpp, bf16/fp16
    #                                        for cpu/half_linear.cpp; or bf16 [out/B, in/2, B, 2] for bf16_linear.cpp
    qweight: torch.Tensor | None = None    # int8 [out, in], or packed [out/B, in, B] (B = CPU_BLOCK) on a CPU
    scales: torch.Tensor | None = None     # [out], in the activations' dtype: W ~= qweight * scales[:, None]
    int4: Int4Weight | None = None
    grouped: GroupWeight | None = None   # integers with a scale (and a minimum) per group of inputs: GGUF's blocks
    w8a8: bool = False                     # INT8 (qweight rows, or oneDNN's prepacked in `prepared`) with int8
    #                                        activations
    calls: tuple[str, ...] | None = None   # on a CPU, timed: the call of each token-count range (linear_choice)

    def int8_rows(self) -> torch.Tensor:
        """The INT8 weight as [out, in] rows (a copy when it is held packed, for the C++ operator or oneDNN)."""
        if self.qweight is None:
            return self.prepared.to_dense().t()
        return self.qweight if self.qweight.dim() == 2 else unpack_blocks(self.qweight)

    def tensor_device(self) -> torch.device:
        """Where the one form of the weight that is held lives."""
        held = (self.dense, self.prepared, self.packed, self.qweight, self.int4 and self.int4.packed,
                self.grouped and self.grouped.q)
        return next(t for t in held if t is not None).device

    def int8_fp32(self) -> torch.Tensor:
        """An INT8 weight dequantized in fp32 (not rounded to the activations' dtype)."""
        return self.int8_rows().to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def tensor(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (a copy when only the prepared or quantized form is held)."""
        if self.int4 is not None:
            return self.int4.tensor()
        if self.grouped is not None:
            return self.grouped.tensor()
        if self.scales is not None:
            return self.int8_fp32().to(self.scales.dtype)
        if self.packed is not None:
            return unpack_blocks(self.packed)
        return self.dense if self.dense is not None else self.prepared.to_dense()


CPU_BLOCK = 32   # outputs per packed block of the C++ linear operators (BLOCK in cpu/int8_linear.cpp, fp32_linear.cpp)


def pack_blocks(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/B, in, B]: for each input, a block's B weights side by side (the C++ operators' layout)."""
    out_f, in_f = w.shape
    return w.view(out_f // CPU_BLOCK, CPU_BLOCK, in_f).permute(0, 2, 1).contiguous()


def unpack_blocks(q: torch.Tensor) -> torch.Tensor:
    """pack_blocks, or pack_pairs, undone (a copy)."""
    if q.dim() == 4:
        return q.permute(0, 2, 1, 3).reshape(q.shape[0] * q.shape[2], q.shape[1] * q.shape[3])
    return q.permute(0, 2, 1).reshape(q.shape[0] * q.shape[2], q.shape[1])


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/B, in/2, B, 2]: for each pair of inputs, a block's B weights side by side, each with its
    two inputs' values together (cpu/bf16_linear.cpp's layout: one bf16 dot product takes a pair). `in` must be even."""
    out_f, in_f = w.shape
    return w.view(out_f // CPU_BLOCK, CPU_BLOCK, in_f // 2, 2).permute(0, 2, 1, 3).contiguous()


def amx_takes(packed: torch.Tensor) -> bool:
    """Whether AMX tiles take this packed weight here: bf16 k-pairs (pack_pairs) whose `in` they hold."""
    return packed.dim() == 4 and linear_choice.amx_holds(
        torch.bfloat16, (packed.shape[0] * packed.shape[2], packed.shape[1] * packed.shape[3]))


def cpp_packing(dtype: torch.dtype):
    """How a weight of `dtype` is packed for this host's C++ operator: k-pairs for bf16 where the build has bf16 dot
    products, else blocks."""
    ops = cpu_ops.for_tensor(torch.empty(0))
    return pack_pairs if dtype == torch.bfloat16 and ops is not None and ops.avx512_bf16 else pack_blocks


def quantize_int8(w: torch.Tensor, packed: bool | None = None, row_amax: torch.Tensor | None = None) -> Weight:
    """Symmetric per-output-row INT8: scale = max |w| of the row / 127 (rows of zeros get scale 1). Packed for the
    C++ operator (by default on a CPU where the outputs fill its blocks), else [out, in] rows. `row_amax`: each
    row's max |w| where `w` holds only part of each row (a tensor-parallel rank's share of its inputs)."""
    amax = w.detach().float().abs().amax(dim=1) if row_amax is None else row_amax.float()
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w.float() / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    if packed is None:
        packed = w.device.type == "cpu" and q.shape[0] % CPU_BLOCK == 0
    return Weight(None, qweight=pack_blocks(q) if packed else q, scales=scales.to(w.dtype).contiguous())


def quantize_w8a8(w: torch.Tensor, typical_tokens: int = 64, row_amax: torch.Tensor | None = None) -> Weight:
    """INT8 weights (quantize_int8's rounding) for W8A8: prepacked for oneDNN's quantized GEMM where this CPU runs
    it (onednn_runs_w8a8), else the rows."""
    q = quantize_int8(w, packed=False, row_amax=row_amax)
    q.w8a8 = True
    if w.device.type == "cpu" and onednn_runs_w8a8():
        q.prepared = torch.ops.onednn.qlinear_prepack(q.qweight, [typical_tokens, w.shape[1]])
        q.qweight = None
    return q


# Without VNNI or AMX-INT8, oneDNN's int8 GEMM on x86 adds pairs of u8 x s8 products in int16, which can saturate.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def onednn_runs_w8a8() -> bool:
    """Whether oneDNN's quantized GEMM runs here with exact sums: an x86 CPU with VNNI or AMX-INT8."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
            and bool(set(INT8_DOT_FLAGS) & set(cpu_ops._cpu_flags().split())))


def prepare_weight(w: torch.Tensor, quantization: str = "none", typical_tokens: int = 64,
                   row_amax: torch.Tensor | None = None) -> Weight:
    """Prepare W for `linear`; `typical_tokens` is oneDNN's hint for the layout (any token count works)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "int8":
        return quantize_int8(w, row_amax=row_amax)
    if quantization == "w8a8":
        return quantize_w8a8(w, typical_tokens, row_amax)
    if quantization in INT4_GROUPS:
        return prepare_int4(quantize_int4(w, INT4_GROUPS[quantization]))
    if w.device.type != "cpu" or not w.is_floating_point():
        return Weight(w)
    mode = dispatch.settings().cpu_linear
    static = static_layout(w, mode)
    if mode != "auto":
        return hold(w, static, typical_tokens)
    choice = linear_choice.choose(w, static, static_calls(static, w.dtype, tuple(w.shape)))
    held = hold(w, choice.layout, typical_tokens)
    held.calls = choice.calls
    return held


def static_layout(w: torch.Tensor, mode: str) -> str:
    """The layout the written-down rule (module docstring) gives a CPU weight: the C++ operators' blocks (fp32 on
    AVX-512, bf16/fp16 with AVX2 alone where torch's half GEMM goes row by row, bf16 k-pairs where AMX tiles take
    them too) for outputs that fill them, else oneDNN's for fp32, else torch's dense tensor."""
    shape = tuple(w.shape)
    if mode in ("cpp", "auto") and linear_choice.cpp_holds(w.dtype, shape) and (
            w.dtype == torch.float32 or half_gemm_is_row_by_row(w.dtype) or linear_choice.amx_holds(w.dtype, shape)):
        return "cpp"
    if w.dtype == torch.float32 and mode != "torch" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "torch"


def static_calls(layout: str, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[str, ...]:
    """The written-down rule's call in `layout` at each of linear_choice.COUNTS tokens (linear() without a timed
    choice): packed bf16 k-pairs on AMX tiles from AMX_FROM_TOKENS where the host has them, other packed half weights
    unpacked from HALF_UNPACKED_FROM_TOKENS, dense half ones widened to fp32 from HALF_AS_FP32_FROM_TOKENS where
    torch's half GEMM goes row by row."""
    def at(tokens: int) -> str:
        half = dtype != torch.float32
        if layout == "cpp":
            if linear_choice.amx_holds(dtype, shape):
                return "cpp-amx" if tokens >= AMX_FROM_TOKENS else "cpp"
            return "cpp-unpacked" if half and tokens >= HALF_UNPACKED_FROM_TOKENS else "cpp"
        if layout == "torch" and half and half_gemm_is_row_by_row(dtype) and tokens >= HALF_AS_FP32_FROM_TOKENS:
            return "torch-fp32"
        return layout
    return tuple(at(n) for n in linear_choice.COUNTS)


def hold(w: torch.Tensor, layout: str, typical_tokens: int = 64) -> Weight:
    """W in one layout (linear_choice.LAYOUT_CALLS), the only copy kept."""
    if layout == "cpp":
        return Weight(None, packed=cpp_packing(w.dtype)(w))
    if layout == "onednn":
        return Weight(None, torch.ops.mkldnn._reorder_linear_weight(w, typical_tokens))
    return Weight(w)


def prepare_int4(w: Int4Weight) -> Weight:
    """An INT4 weight (quantized here or read from a GPTQ/AWQ checkpoint) in the layout its device's path reads: on
    a CPU the group operator's blocks where it takes the shape, else torch's int4pack where that takes it."""
    if group_op_accepts(w):
        w = to_cpu_groups(w)
    elif w.packed.device.type == "cpu" and cpu_op_accepts(w):
        w = to_cpu_int4pack(w)
    return Weight(None, int4=w)


def linear_reference(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.tensor(), bias)


# torch's bf16 and fp16 `linear` on a CPU where oneDNN has no path for the type (x86 below AVX-512 and without
# AVX-NE-CONVERT: no bf16 or fp16 dot products) multiplies one token row at a time, so from 4 tokens it is faster to
# widen the weight to fp32 for the call and run fp32's GEMM: 5x at 48 tokens, 8x at 512 (perf/RESULTS.md, "bf16 on an
# AVX2 CPU"). Below 4, reading half the bytes wins. The widened copy is made WIDEN_ROWS output rows at a time, so
# that a large LM head (128k x 4096: 2 GiB in fp32) needs 32 MiB of scratch, not a second copy of itself.
HALF_AS_FP32_FROM_TOKENS = 4
WIDEN_ELEMENTS = 8 << 20


@functools.cache
def half_gemm_is_row_by_row(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM in `dtype` (bf16 or fp16) goes row by row here: oneDNN, which torch uses for them
    where it can, cannot (measured on AVX2; elsewhere torch's path is kept)."""
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    return supported is not None and not (torch.backends.mkldnn.is_available() and supported())


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's linear on a dense weight (any float dtype: it is rounded to x's when they differ), except for calls of
    4+ bf16/fp16 tokens on a CPU where that GEMM goes row by row: those multiply in fp32 (the sum is fp32 as in
    torch's half GEMM, rounded once), the weight widened a slice of output rows at a time."""
    tokens = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or tokens < HALF_AS_FP32_FROM_TOKENS or not half_gemm_is_row_by_row(x.dtype):
        return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
    return linear_in_fp32(x, weight, bias)


def linear_in_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b computed in fp32 and rounded to x's dtype once, W widened WIDEN_ELEMENTS at a time."""
    xf, n = x.float(), weight.shape[0]
    rows = max(1, WIDEN_ELEMENTS // weight.shape[1])
    if rows >= n:
        return torch.nn.functional.linear(xf, weight.float(), None if bias is None else bias.float()).to(x.dtype)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    for r in range(0, n, rows):
        part = torch.nn.functional.linear(xf, weight[r:r + rows].float(),
                                          None if bias is None else bias[r:r + rows].float())
        y[..., r:r + rows] = part
    return y


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]."""
    if w.calls is not None:
        return CALLS[w.calls[linear_choice.count_index(x.numel() // x.shape[-1])]](x, w, bias)
    if w.int4 is not None:
        return int4_linear(x, w.int4, bias)
    if w.grouped is not None:
        return group_linear(x, w.grouped, bias)
    if w.scales is not None:
        return w8a8_linear(x, w, bias) if w.w8a8 else int8_linear(x, w, bias)
    if w.packed is not None:
        tokens = x.numel() // x.shape[-1]
        if w.packed.dim() == 3 and w.packed.dtype != torch.float32 and tokens >= HALF_UNPACKED_FROM_TOKENS:
            return dense_linear(x, w.tensor(), bias)
        return packed_linear(x, w.packed, bias, tokens >= AMX_FROM_TOKENS and amx_takes(w.packed))
    if w.prepared is not None:
        return torch.ops.mkldnn._linear_pointwise(x, w.prepared, bias, "none", [], "")
    return dense_linear(x, w.dense, bias)


# The operators a CPU linear layer runs on, numbered as cpu/decode_layers.h's LinearKind.
FP32_PACKED, HALF_PACKED, BF16_PAIRS, INT8_PACKED, GROUPS, TORCH, ONEDNN = range(7)


def cpu_operator(w: Weight, tokens: int) -> tuple[int, torch.Tensor, torch.Tensor | None, int] | None:
    """Which operator `linear` runs for w at `tokens` rows of w's dtype on a CPU with the C++ operators built, as
    (kind, the weight it reads, its scales, inputs per group); None where it runs something else (AMX tiles, a
    widened or dequantized weight, W8A8). cpu/decode_layers.cpp calls that operator itself, so this follows `linear`
    branch by branch."""
    if w.calls is not None:
        call = w.calls[linear_choice.count_index(tokens)]
        if call == "onednn":
            return ONEDNN, w.prepared, None, 0
        if call == "torch" and w.dense is not None:
            return TORCH, w.dense, None, 0
        return _packed_operator(w.packed) if call == "cpp" else None
    if w.int4 is not None:
        g = w.int4
        if g.perm is not None or g.groups is None or g.padding:
            return None
        return (GROUPS, g.groups.q, g.groups.scales, g.groups.group) if g.groups.packed else None
    if w.grouped is not None:
        return (GROUPS, w.grouped.q, w.grouped.scales, w.grouped.group) if w.grouped.packed else None
    if w.scales is not None:
        return (INT8_PACKED, w.qweight, w.scales, 0) if not w.w8a8 and w.qweight.dim() == 3 else None
    if w.packed is not None:
        if (tokens >= AMX_FROM_TOKENS and amx_takes(w.packed)) or (
                w.packed.dim() == 3 and w.packed.dtype != torch.float32 and tokens >= HALF_UNPACKED_FROM_TOKENS):
            return None
        return _packed_operator(w.packed)
    if w.prepared is not None:
        return ONEDNN, w.prepared, None, 0
    if tokens < HALF_AS_FP32_FROM_TOKENS or not half_gemm_is_row_by_row(w.dense.dtype):   # dense_linear's branch
        return TORCH, w.dense, None, 0
    return None


def _packed_operator(packed: torch.Tensor) -> tuple[int, torch.Tensor, None, int]:
    """packed_linear's operator (without AMX) for a weight held packed."""
    kind = BF16_PAIRS if packed.dim() == 4 else FP32_PACKED if packed.dtype == torch.float32 else HALF_PACKED
    return kind, packed, None, 0


# The calls a CPU weight's timed choice can name (linear_choice.LAYOUT_CALLS), each f(x, weight, bias).
CALLS = {
    "cpp": lambda x, w, b: packed_linear(x, w.packed, b),
    "cpp-amx": lambda x, w, b: packed_linear(x, w.packed, b, amx=True),
    "cpp-unpacked": lambda x, w, b: dense_linear(x, unpack_blocks(w.packed), b),
    "onednn": lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w.prepared, b, "none", [], ""),
    "torch": lambda x, w, b: torch.nn.functional.linear(x, w.dense.to(x.dtype), b),
    "torch-fp32": lambda x, w, b: linear_in_fp32(x, w.dense, b),
}


def cpp_build(ops) -> str:
    """The C++ operators' build, in words."""
    return "C++ (AVX-512)" if ops.avx512 else "C++ (AVX2)" if ops.avx2 else "C++ (portable)"


def linear_path(w: Weight) -> str:
    """Which implementation `linear` runs for `w`, in words, for the load log: the same tests in the same order."""
    device = w.tensor_device()
    if w.calls is not None:
        layout = "cpp" if w.packed is not None else "onednn" if w.prepared is not None else "torch"
        dtype = (w.packed if w.packed is not None else w.prepared if w.prepared is not None else w.dense).dtype
        return f"{dtype_name(dtype)} timed, {linear_choice.describe(layout, w.calls)}"
    ops = cpu_ops.for_tensor(torch.empty(0, device=device))
    triton = device.type == "cuda" or dispatch.settings().force_triton   # as use_triton decides for the call
    if w.int4 is not None:
        if w.int4.groups is not None:
            return f"INT4 (groups of {w.int4.group}) on the group operator, {cpp_build(ops)}, float32 activations"
        if triton:
            return "INT4 Triton kernel"
        if w.int4.cpu_scales_zeros is not None:
            return "INT4 torch _weight_int4pack_mm_for_cpu (bf16 activations)"
        return f"INT4 dequantized, then {dense_path(w.int4.scales.dtype)}"
    if w.grouped is not None:
        g = w.grouped
        where = "Triton kernel" if triton else (
            cpp_build(ops) if g.packed else "dequantized, then torch linear float32")
        return (f"{'4-bit' if g.bits == 4 else 'INT8'} with a scale{' and a minimum' if g.has_mins else ''} per "
                f"{g.group} inputs, {where}")
    if w.w8a8:
        return ("W8A8 oneDNN (int8 activations per token)" if w.prepared is not None else
                f"W8A8 as {dense_path(torch.float32)} on the rounded integers")
    if w.qweight is not None:
        if triton:
            return "INT8 Triton kernel"
        if ops is None or w.qweight.dim() != 3:
            return f"INT8 dequantized, then {dense_path(w.scales.dtype)}"
        return ("INT8 C++ (AVX-512)" if ops.avx512 else "INT8 C++ (AVX2, int16 activations)" if ops.avx2 else
                "INT8 C++ (portable)")
    if w.packed is not None:
        if w.packed.dtype == torch.float32:
            return "fp32 C++ (AVX-512)"
        if w.packed.dim() == 4:
            amx = f", AMX from {AMX_FROM_TOKENS} tokens" if amx_takes(w.packed) else ""
            return f"bfloat16 C++ (AVX512-BF16{amx})"
        return (f"{dtype_name(w.packed.dtype)} C++ (AVX2), unpacked + torch linear float32 from "
                f"{HALF_UNPACKED_FROM_TOKENS} tokens")
    if w.prepared is not None:
        return f"oneDNN {dtype_name(w.prepared.dtype)}"
    return f"torch linear {dtype_name(w.dense.dtype)} (cuBLAS)" if device.type == "cuda" else dense_path(w.dense.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense_path(dtype: torch.dtype) -> str:
    """dense_linear's choice on a CPU for activations of `dtype`, in words."""
    if half_gemm_is_row_by_row(dtype):
        return f"torch linear {dtype_name(dtype)}, in float32 from {HALF_AS_FP32_FROM_TOKENS} tokens"
    return f"torch linear {dtype_name(dtype)}"


# The half operator (cpu/half_linear.cpp) multiplies in fp32 FMAs on weights widened in cache: 2-3x faster than
# widening the whole weight for torch's fp32 GEMM at 2-16 tokens, level at 48-128, but 0.7-0.9x from 512, where
# the GEMM's tiles run closer to the FMAs' peak; so calls from 256 tokens (prefill chunks) unpack the weight and take
# dense_linear (perf/RESULTS.md, "bf16 on AVX2: a C++ operator for the weights").
HALF_UNPACKED_FROM_TOKENS = 256
# The k-pair operator takes one 16-lane pair product at a time, AMX tiles 16 tokens' at once: with the next block
# prefetched the tiles read memory as fast at one token and win from four (perf/RESULTS.md, "AMX tiles on the k-pair
# weight").
AMX_FROM_TOKENS = 4


def rows_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as contiguous rows [tokens, in] of `dtype`, converted only where it must be: each torch call costs about a
    microsecond even when it changes nothing, and a decode step makes ~50 linear calls."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == dtype and x2.is_contiguous() else x2.to(dtype).contiguous()


def output_like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An operator's rows y [tokens, out] in x's dtype and leading shape (rows_as undone)."""
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, amx: bool = False) -> torch.Tensor:
    """A C++ operator on a weight held packed [out/B, in, B]: fp32 (cpu/fp32_linear.cpp), or bf16/fp16
    (cpu/half_linear.cpp, which multiplies in fp32: x and the bias are widened for it, the result rounded back); or
    bf16 in k-pairs [out/B, in/2, B, 2] (cpu/bf16_linear.cpp: x in bf16, sums in fp32, rounded back once; with
    `amx`, cpu/bf16_amx_linear.cpp on the same weight, which rounds to bf16 itself)."""
    ops = cpu_ops.for_tensor(x)
    if amx or packed.dim() == 4:
        run, x_dtype = (ops.bf16_amx_linear if amx else ops.bf16_linear), torch.bfloat16
    else:
        run, x_dtype = (ops.fp32_linear if packed.dtype == torch.float32 else ops.half_linear), torch.float32
    x2 = rows_as(x, x_dtype)
    y_dtype = x.dtype if amx and x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    y = torch.empty(x2.shape[0], packed.shape[0] * packed.shape[2], dtype=y_dtype)
    run(y, x2, packed, None if bias is None else bias.float())
    return output_like(y, x)


def int8_linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        from trellm_kernels.triton_linear import int8_linear_triton
        return int8_linear_triton(x, w.int8_rows(), w.scales, bias)
    ops = cpu_ops.for_tensor(x)
    if ops is None or w.qweight.dim() != 3:
        return dense_linear(x, w.int8_fp32(), bias)
    # The operator takes fp32 activations (bf16/fp16 ones are widened for it; with AVX2 only it quantizes them to
    # int16 per token itself), and the bias is added before the result is rounded back to their dtype.
    x2 = rows_as(x, torch.float32)
    y = torch.empty(x2.shape[0], w.scales.shape[0], dtype=torch.float32)
    ops.int8_linear(y, x2, w.qweight, w.scales if w.scales.dtype == torch.float32 else w.scales.float())
    if bias is not None:
        y += bias
    return output_like(y, x)


_ONE, _ZERO = torch.tensor(1.0), torch.tensor(0)    # oneDNN's activation scale and zero point: the ints as they are
_U8_ZERO = torch.tensor(128)                        # the zero point of int8 activations shifted to u8


def w8a8_linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x rounded per token to int8 (int8_activations); oneDNN's exact int32 sums times the weight rows' scales
    where it holds the weight, else a float32 GEMM of the rounded integers (exact below 2^24, rounded above, as a
    float GEMM is); then times the tokens' scales; the bias is added before the result is rounded to x's dtype."""
    xq, x_scale = int8_activations(x)
    if w.prepared is not None:
        # oneDNN's fast int8 kernels take unsigned activations: the same integers moved up by 128 (the XOR of the
        # sign bit), with a zero point of 128, give the same exact sums; signed ones took a reference path on a
        # host with VNNI and no AMX (perf/RESULTS.md, "W8A8's activations").
        xu = xq.view(torch.uint8).bitwise_xor(128)
        y = torch.ops.onednn.qlinear_pointwise.tensor(xu, _ONE, _U8_ZERO, w.prepared, w.scales.float(), _ZERO, None,
                                                      1.0, 0, torch.float32, "none", [None], "")
    else:
        y = torch.nn.functional.linear(xq.float(), w.qweight.float()) * w.scales.float()
    y *= x_scale
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def w8a8_reference(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """What w8a8_linear computes, without a bias, from exact integer sums: the float32 rounding of
    (sum * weight scale) * token scale."""
    xq, x_scale = int8_activations(x)
    sums = (xq.to(torch.int64) @ w.int8_rows().to(torch.int64).T).to(torch.float32)
    return sums * w.scales.float() * x_scale


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's activations rounded to int8 with the float32 scale max |x| / 127: xq [tokens, in] int8 and
    the scale [tokens, 1]. The C++ operator's one pass where it is built, else torch's (bit for bit the same)."""
    x2 = x.reshape(-1, x.shape[-1])
    ops = cpu_ops.for_tensor(x)
    if ops is None:
        xq, x_scale = per_token_rounding(x2, 127)
        return xq.to(torch.int8), x_scale
    xq = torch.empty(x2.shape, dtype=torch.int8)
    x_scale = torch.empty(x2.shape[0], 1)
    ops.quantize_rows_int8(xq, x_scale, x2.contiguous())
    return xq, x_scale


def per_token_rounding(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] rounded per token to integers in [-qmax, qmax] (as float32) with the float32 scale
    max |x| / qmax (1 for a row of zeros): x is about the result times the scale."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(float(qmax)) / amax, torch.ones_like(amax))
    x_scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.round(x * inv).clamp_(-qmax, qmax), x_scale


INT16_ACTIVATION_CHUNK = 256   # k per exact int32 partial sum in cpu/int8_linear.cpp's AVX2 tile (KC there)


def int16_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The AVX2 INT8 tile's rounding of activations: each token's to int16 (int64 here) with the fp32 scale
    max |x| / 32767; x is about xq * scale."""
    xq, x_scale = per_token_rounding(x.reshape(-1, x.shape[-1]), 32767)
    return xq.to(torch.int64), x_scale


def int8_linear_int16_reference(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """What the C++ INT8 operator built for AVX2 alone computes, bit for bit, without a bias: each token's
    activations rounded to int16 with scale max |x| / 32767, exact integer sums over chunks of k added in float32 in
    order, then times the weight's and the token's scales."""
    xq, x_scale = int16_activations(x)
    q = w.int8_rows().to(torch.int64)
    sums = torch.zeros(x.shape[0], q.shape[0])
    for k0 in range(0, x.shape[1], INT16_ACTIVATION_CHUNK):
        k1 = k0 + INT16_ACTIVATION_CHUNK
        sums += (xq[:, k0:k1] @ q[:, k0:k1].T).to(torch.float32)
    return sums * w.scales.float() * x_scale


def group_linear(x: torch.Tensor, w: GroupWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Group-quantized weights (group_quant.py: GGUF's blocks, INT4's): on a GPU (or with force_triton) the Triton
    kernel, which rounds each dequantized tile to x's dtype as INT4's does; on a CPU the C++ operator on fp32
    activations (bf16/fp16 ones are widened for it, the bias added before the result is rounded back), or, where
    the weight is not held packed for it, the dequantized weight in fp32."""
    if use_triton(x):
        from trellm_kernels.triton_linear import group_linear_triton
        y = group_linear_triton(x, *w.rows(), w.group)    # rows: on a GPU they are what is held
        return y if bias is None else y + bias
    if not w.packed:
        return linear_in_fp32(x, w.tensor(torch.float32), bias)
    x2 = rows_as(x, torch.float32)
    y = torch.empty(x2.shape[0], w.out_features, dtype=torch.float32)
    cpu_ops.for_tensor(x2).group_linear(y, x2, w.q, w.scales, w.group)
    if bias is not None:
        y += bias
    return output_like(y, x)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.perm is not None:     # act-order: the stored inputs are the layer's in this order
        x = x.index_select(-1, w.perm)
    if w.groups is not None:
        return group_linear(torch.nn.functional.pad(x, (0, w.padding)) if w.padding else x, w.groups, bias)
    if use_triton(x):
        from trellm_kernels.triton_linear import int4_linear_triton
        return int4_linear_triton(x, w.packed, w.scales, w.zeros, w.group, bias)
    if w.cpu_scales_zeros is not None:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if w.padding:       # a short last group, padded at load
            x2 = torch.nn.functional.pad(x2, (0, w.padding))
        y = torch._weight_int4pack_mm_for_cpu(x2, w.packed, w.group, w.cpu_scales_zeros).to(x.dtype)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
    return dense_linear(x, w.stored_tensor(), bias)
