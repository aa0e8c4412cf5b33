"""Group-wise asymmetric INT4 weights: one representation for `quantization: int4` and for GPTQ/AWQ checkpoints.

Why: a decode step reads every weight once, so 4-bit weights read an eighth of fp32's bytes (a quarter of bf16's).
One scale per output row (INT8's scheme) is too coarse at 16 levels, so each row is cut into groups of `group`
inputs with a scale and an integer zero point each, which is also what GPTQ and AWQ checkpoints hold:

    W[n, k] ~= (q[n, k] - zeros[k // group, n]) * scales[k // group, n],   q, zeros in 0..15

GPTQ's act-order ("desc_act") quantizes the inputs in another order, so a group is a scattered set of inputs; such a
weight is held with its inputs permuted (`perm`) so that groups are contiguous again, and the layer gathers
x[..., perm] before multiplying (what vLLM's exllama path does too). The last group may be shorter when `group`
does not divide the inputs (GPTQ's own layout allows it: ceil(K / group) scale rows).

Layouts of `packed`:
- nibbles, uint8 [N, ceil(K/2)]: q[n, 2i] in the low four bits of byte i, q[n, 2i+1] in the high four. The
  reference and the Triton kernel (triton_linear.py) read it.
- torch's CPU int4pack (`torch._convert_weight_to_int4pack_for_cpu`), set when `cpu_scales_zeros` is: an opaque,
  ISA-dependent layout that only `torch._weight_int4pack_mm_for_cpu` reads; that operator dequantizes as
  (q - 8) * scale + zero, so it is given zero = (8 - zeros) * scales, in bf16 as it requires (its fp32 activation
  path is a scalar loop, many times slower than the bf16 one: perf/RESULTS.md, section "Weight-only INT4"). q is
  recovered from it exactly by running the operator on an identity matrix with scale 1 and zero 8 (`q()`), so
  nothing depends on the layout.
- the group operator's blocks (cpu/group_linear.cpp, kernels/group_quant.py), set when `groups` is, on a CPU where
  that operator runs: the nibbles in its blocks of 32 outputs, with float32 scales and z * s as its minimums, so
  y = sum_g (s * sum q x - z s * sum x) on float32 activations. It reads the same 4 bits a weight and was faster
  than torch's int4pack operator at every token count (perf/RESULTS.md, "INT4 on the group operator"); it is the
  CPU's layout where it takes the shape, torch's int4pack elsewhere.

The quantizer is round-to-nearest over [min(w, 0), max(w, 0)] of each group (GPTQ's quantizer without its error
feedback): 0 is always on the grid and every weight lies within half a step of its dequantized value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trellm_kernels import group_quant
from trellm_kernels.formats import GROUP_SIZES
from trellm_kernels.group_quant import GroupWeight

CPU_OP_GROUPS = (32, 64, 128, 256)     # what torch._weight_int4pack_mm_for_cpu accepts


@dataclass
class Int4Weight:
    packed: torch.Tensor                           # nibbles uint8 [N, ceil(K/2)], torch's CPU int4pack layout, or
    #                                                the group operator's blocks [N/32, G * group / 2, 32] (groups)
    scales: torch.Tensor                           # [G, N], G = ceil(K / group), the activations' dtype
    zeros: torch.Tensor                            # uint8 [G, N], integer zero points in 0..15
    group: int
    in_features: int                               # K
    perm: torch.Tensor | None = None               # int64 [K]: stored input i is the layer's input perm[i]
    cpu_scales_zeros: torch.Tensor | None = None   # bf16 [G, N, 2]: packed is torch's CPU int4pack layout
    groups: GroupWeight | None = None              # held for the group operator (packed is its nibble blocks)

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]

    @property
    def padding(self) -> int:
        """Inputs a short last group lacks; the CPU layouts pad them (q = 0, met by zero activations)."""
        return self.scales.shape[0] * self.group - self.in_features

    def padded_q(self) -> torch.Tensor:
        """q() with a short last group padded to a whole one (q = 0): [N, G * group]."""
        q = self.q()
        return torch.nn.functional.pad(q, (0, self.padding)) if self.padding else q

    def q(self) -> torch.Tensor:
        """uint8 [N, K], values 0..15, in stored (permuted) input order."""
        if self.groups is not None:
            return self.groups.rows()[0][:, :self.in_features].contiguous()
        if self.cpu_scales_zeros is None:
            return unpack_nibbles(self.packed, self.in_features)
        G, N = self.scales.shape
        unit = torch.empty(G, N, 2, dtype=torch.bfloat16)
        unit[..., 0], unit[..., 1] = 1.0, 0.0    # (q - 8) * 1 + 0, then + 8 below: exact in bf16 (|q - 8| <= 8)
        K, rows = G * self.group, []
        for k0 in range(0, self.in_features, 1024):     # rows k0.. of the identity: (q - 8)^T [rows, N]
            n = min(1024, self.in_features - k0)
            eye = torch.zeros(n, K, dtype=torch.bfloat16)
            eye[:, k0:k0 + n] = torch.eye(n, dtype=torch.bfloat16)
            rows.append(torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, unit))
        return (torch.cat(rows).float() + 8).round().to(torch.uint8).t().contiguous()

    def stored_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized weight [N, K] in stored input order, in `dtype` (default the scales'), computed in fp32
        and rounded once (in float64, exactly, for the tests' oracle)."""
        dtype = dtype or self.scales.dtype
        wide = torch.promote_types(dtype, torch.float32)
        K, (G, N) = self.in_features, self.scales.shape
        q = self.padded_q().view(N, G, self.group).to(wide)
        w = (q - self.zeros.t().to(wide)[:, :, None]) * self.scales.t().to(wide)[:, :, None]
        return w.view(N, G * self.group)[:, :K].to(dtype)

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized weight [N, K] in the layer's input order: y = x W^T."""
        w = self.stored_tensor(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (values 0..15) -> uint8 [N, ceil(K/2)], even k in the low nibble."""
    if q.shape[1] % 2:
        q = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :k].contiguous()


def quantize_groups(w: torch.Tensor, group: int, sym: bool = False, scale_dtype: torch.dtype | None = None,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest INT4 of w [N, K] in groups of `group` consecutive inputs -> (q uint8 [N, K], scales [G, N]
    in `scale_dtype` (default w's dtype), zeros uint8 [G, N]). q is computed with the scale as stored, so
    dequantizing (q - zero) * scale is exactly what the quantizer meant.

    sym: GPTQ's symmetric mode, zero fixed at 8 and scale = 2 max|w| / 15. min_zero: the smallest zero point the
    format can store (GPTQ's original layout stores zero - 1 in four bits, so it cannot hold 0)."""
    if group not in GROUP_SIZES:
        raise ValueError(f"group size {group} is not one of {', '.join(map(str, GROUP_SIZES))}")
    N, K = w.shape
    G = -(-K // group)
    wf = w.detach().float()
    if G * group != K:   # the short last group is padded with its own last column: min and max are unchanged
        wf = torch.cat([wf, wf[:, -1:].expand(N, G * group - K)], dim=1)
    wg = wf.view(N, G, group)
    lo = wg.amin(dim=2).clamp(max=0)
    hi = wg.amax(dim=2).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(scale_dtype or w.dtype)
    s = scale.float()
    if sym:
        zero = torch.full_like(s, 8)
    else:
        zero = torch.round(-lo / s).clamp(min_zero, 15)
    q = torch.clamp(torch.round(wg / s[:, :, None]) + zero[:, :, None], 0, 15).to(torch.uint8)
    return (q.view(N, G * group)[:, :K].contiguous(), scale.t().contiguous(),
            zero.to(torch.uint8).t().contiguous())


def quantize_int4(w: torch.Tensor, group: int = 128) -> Int4Weight:
    """`quantization: int4` at load: w [N, K] float -> nibble-packed Int4Weight, scales in w's dtype."""
    q, scales, zeros = quantize_groups(w, group)
    return Int4Weight(pack_nibbles(q), scales, zeros, group, w.shape[1])


def cpu_op_accepts(w: Int4Weight) -> bool:
    """Shapes torch._weight_int4pack_mm_for_cpu takes: N a multiple of 16, groups of a size it knows (a short last
    group is padded to a whole one, and the activations with zeros: to_cpu_int4pack, linear.int4_linear)."""
    return w.out_features % 16 == 0 and w.group in CPU_OP_GROUPS and w.packed.device.type == "cpu"


def to_cpu_int4pack(w: Int4Weight) -> Int4Weight:
    """The same weight in the layout of torch's CPU int4 operator (caller checks cpu_op_accepts); inputs padded
    to whole groups (the padding's q is 0: it meets zero activations)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(w.padded_q().to(torch.int32), 1)
    s = w.scales.float()
    sz = torch.stack([s, (8 - w.zeros.float()) * s], dim=-1).to(torch.bfloat16).contiguous()
    return replace(w, packed=packed, cpu_scales_zeros=sz)


def group_op_accepts(w: Int4Weight) -> bool:
    """Shapes the group operator takes (group_quant.pack): a CPU with the operators, whole blocks of outputs, and a
    group size it runs (a short last group is padded, as for torch's operator)."""
    return (w.out_features % group_quant.BLOCK == 0 and w.group in group_quant.GROUPS
            and group_quant.pack_takes(w.packed))


def to_cpu_groups(w: Int4Weight) -> Int4Weight:
    """The same weight held for the group operator (caller checks group_op_accepts): its nibbles, inputs padded to
    whole groups with q = 0 (they meet zero activations), scales in float32 and z * s as the minimums."""
    s = w.scales.float()
    groups = group_quant.pack(GroupWeight(w.padded_q(), s.contiguous(), (w.zeros.float() * s).contiguous(), w.group))
    return replace(w, packed=groups.q, groups=groups)


def cat_outputs(parts: list[Int4Weight], where: str) -> Int4Weight:
    """Weights sharing one input (q/k/v, gate/up) stacked along the outputs; they must agree on the group and on
    the input permutation (GPTQ quantizes them with one act-order, from the same inputs). `where` names them."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts[1:]:
        if p.group != first.group or p.in_features != first.in_features:
            raise ValueError(f"{where}: group size or input size differ ({p.group}, {p.in_features} vs "
                             f"{first.group}, {first.in_features})")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise ValueError(f"{where}: the act-order g_idx differ between the projections that share an input")
        if p.cpu_scales_zeros is not None or p.groups is not None:
            raise ValueError(f"{where}: join weights before converting them to the CPU layout")
    return Int4Weight(torch.cat([p.packed for p in parts]).contiguous(),
                      torch.cat([p.scales for p in parts], dim=1).contiguous(),
                      torch.cat([p.zeros for p in parts], dim=1).contiguous(), first.group, first.in_features,
                      first.perm)
