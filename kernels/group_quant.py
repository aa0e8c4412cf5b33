"""Group-quantized weights: integers with a float32 scale, and optionally a float32 minimum, per output and group of
16 or 32 inputs (GGUF's blocks), or 64 or 128 (INT4's, int4.py, with z * s as the minimum):

    W[n, k] = q[n, k] * scales[k // group, n] - mins[k // group, n]

q is int8, or for 4-bit formats uint8 values 0..15 (held two to a byte).

Why: every GGUF block format the engine reads has this form, with scales that are products of fp16 and small
integers, exact in float32 (Q8_0: q and a scale per 32; Q4_0: q - 8; Q4_1, Q4_K and Q5_K: a scale and a minimum
per 32; Q6_K: q - 32 and a scale per 16). So one representation holds each of them as the file's own values, 4-bit
ones at their own size, and one operator multiplies by it (kernels/linear.py's group_linear, which calls
cpu/group_linear.cpp: the bytes read once, widened in registers, each group's sums scaled once, and with minimums
each token's sum over the group times the minimum taken off), so that a token's result does not depend on the
other tokens of the call; on a GPU, a Triton kernel (triton_linear.py) that dequantizes each group's tile in
registers.

Held packed for the C++ operator on a CPU where the outputs fill its blocks: int8 q as kernels/linear.py's
pack_blocks, [N/32, K, 32]; 4-bit q as bytes [N/32, K/2, 32] holding input 2i in the low nibble and 2i + 1 in the
high one; each group's scales, then its minimums, side by side per block: [N/32, K/group, 1 or 2, 32]. Elsewhere (a
GPU, a width the blocks do not take) as rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm_kernels import cpu_ops

GROUPS = (16, 32, 64, 128)      # what the C++ operator runs (GGUF's 16 and 32, INT4's 64 and 128)
BLOCK = 32             # kernels/linear.py's CPU_BLOCK: outputs per packed block


@dataclass
class GroupWeight:
    q: torch.Tensor                    # int8 [N, K] or 4-bit uint8 [N, K]; packed [N/32, K, 32] or [N/32, K/2, 32]
    scales: torch.Tensor               # float32 [K/group, N], or packed with the minimums [N/32, K/group, 1 or 2, 32]
    mins: torch.Tensor | None          # float32 [K/group, N], subtracted (None: the format has none, or packed)
    group: int

    @property
    def packed(self) -> bool:
        return self.q.dim() == 3

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == torch.uint8 else 8

    @property
    def has_mins(self) -> bool:
        return self.scales.shape[2] == 2 if self.packed else self.mins is not None

    @property
    def out_features(self) -> int:
        return self.q.shape[0] * self.q.shape[2] if self.packed else self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group if self.packed else self.scales.shape[0] * self.group

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K], as a weight tensor's."""
        return self.out_features, self.in_features

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [N, K], the scales [K/group, N] and the minimums [K/group, N] or None (copies when held packed)."""
        if not self.packed:
            return self.q, self.scales, self.mins
        q = self.q
        if self.bits == 4:          # [N/32, K/2, 32] bytes -> [N/32, K, 32] values
            q = torch.stack([q & 15, q >> 4], dim=2).reshape(q.shape[0], -1, q.shape[2])
        q = q.permute(0, 2, 1).reshape(self.out_features, -1)
        epilogue = self.scales.permute(2, 1, 0, 3).reshape(self.scales.shape[2], self.scales.shape[1], -1)
        return q, epilogue[0], epilogue[1] if self.has_mins else None

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 [len(ids), K], decoded as `tensor` decodes them: an embedding lookup
        that reads only the looked-up rows' blocks."""
        if self.packed:
            block, lane = ids // BLOCK, ids % BLOCK
            q = self.q[block, :, lane]                        # [T, K] values, or [T, K/2] bytes
            if self.bits == 4:
                q = torch.stack([q & 15, q >> 4], dim=2).reshape(len(ids), 2 * q.shape[1])
            epilogue = self.scales[block, :, :, lane]          # [T, K/group, 1 or 2]
            scales, mins = epilogue[..., 0], epilogue[..., 1] if self.has_mins else None
        else:
            q, scales, mins = self.q[ids], self.scales[:, ids].t(), None if self.mins is None else self.mins[:, ids].t()
        w = q.to(torch.float32) * scales.repeat_interleave(self.group, dim=1)
        return w if mins is None else w - mins.repeat_interleave(self.group, dim=1)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K], computed in float32 (float64 for a float64 oracle) and rounded once to `dtype`."""
        wide = torch.promote_types(dtype, torch.float32)
        q, scales, mins = self.rows()
        w = q.to(wide) * scales.t().to(wide).repeat_interleave(self.group, dim=1)
        if mins is not None:
            w = w - mins.t().to(wide).repeat_interleave(self.group, dim=1)
        return w.to(dtype)


def regroup(w: GroupWeight, group: int) -> GroupWeight:
    """The same weight with groups of `group` inputs (a divisor of w.group): each scale and minimum repeated, exact."""
    q, scales, mins = w.rows()
    if group == w.group:
        return GroupWeight(q, scales, mins, group)
    times = w.group // group
    return GroupWeight(q, scales.repeat_interleave(times, dim=0),
                       None if mins is None else mins.repeat_interleave(times, dim=0), group)


def cat_outputs(parts: list[GroupWeight]) -> GroupWeight:
    """Weights sharing one input, stacked along the outputs (merged q/k/v, gate/up), at the finest group among them."""
    group = min(p.group for p in parts)
    parts = [regroup(p, group) for p in parts]
    if len({p.q.dtype for p in parts}) > 1:      # 4-bit beside int8 parts: all held as int8 (0..15 fits)
        parts = [GroupWeight(p.q.to(torch.int8), p.scales, p.mins, group) for p in parts]
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts], dim=1)
    return GroupWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts], dim=1), mins, group)


def pack_takes(t: torch.Tensor) -> bool:
    """Whether weights living where `t` does can be held for the C++ operator (a CPU build with the operators)."""
    return t.device.type == "cpu" and cpu_ops.for_tensor(t) is not None


def pack(w: GroupWeight) -> GroupWeight:
    """Held for the C++ operator where it runs it (a CPU build with the operators, outputs filling its blocks)."""
    N = w.out_features
    if w.packed or not pack_takes(w.q) or N % BLOCK or w.group not in GROUPS:
        return w
    q, scales, mins = w.rows()
    epilogue = torch.stack([scales] if mins is None else [scales, mins])          # [1 or 2, K/g, N]
    packed_q = q.view(N // BLOCK, BLOCK, -1).permute(0, 2, 1)
    if w.bits == 4:
        packed_q = packed_q[:, 0::2] | (packed_q[:, 1::2] << 4)
    packed_q = packed_q.contiguous()
    packed_epilogue = epilogue.view(epilogue.shape[0], epilogue.shape[1], N // BLOCK, BLOCK).permute(2, 1, 0, 3)
    return GroupWeight(packed_q, packed_epilogue.contiguous(), None, w.group)
