"""GPTQ and AWQ 4-bit checkpoints: their Hugging Face safetensors layouts, read into the engine's INT4 weights
(kernels/int4.py), and written by backend/tools/quantize_checkpoint.py so the reader is tested on bytes laid out as
those tools lay them out.

Why here: most 4-bit Llama checkpoints on the hub are GPTQ or AWQ files; reading them keeps the quantizer's choices
(GPTQ's error feedback, AWQ's activation-aware scales) that quantizing a float checkpoint at load cannot make.

Layouts, per linear layer `<prefix>.` (K inputs, N outputs, G = number of groups), as read on 2026-11-25 in
AutoGPTQ (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py: QuantLinear.pack and the torch dequantization in its
forward) and AutoAWQ (awq/modules/linear/gemm.py: WQLinear_GEMM.from_linear); vLLM's gptq and awq layers and
transformers' GPTQConfig/AwqConfig read the same tensors and config keys.

GPTQ (config.json quantization_config: quant_method "gptq", bits 4, group_size, desc_act, sym):
  qweight int32 [K/8, N]   eight inputs per int32 along K: q[k, n] is bits 4*(k % 8) of qweight[k // 8, n]
  qzeros  int32 [G, N/8]   eight outputs per int32: bits 4*(n % 8) of qzeros[g, n // 8] hold zero[g, n] - 1.
                           The -1 is the original format's convention (AutoGPTQ packs `zeros -= 1`, its readers
                           and vLLM add 1 back); GPTQModel's checkpoint_format "gptq_v2" stores the zero itself.
                           A v1 file therefore cannot hold zero 0 (-1 would spill into the other nibbles).
  scales  fp16  [G, N]     G = ceil(K / group_size)
  g_idx   int32 [K]        the group of input k: k // group_size, or with desc_act ("act-order", inputs quantized
                           in decreasing order of the Hessian's diagonal) a permutation of that
  W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]); sym=True fixes every zero at 8.
AWQ (quant_method "awq", version "gemm", zero_point true, bits 4, group_size):
  qweight int32 [K, N/8]   eight outputs per int32 in the order AWQ_ORDER: bits 4*i of qweight[k, c] hold
                           q[k, 8c + AWQ_ORDER[i]]
  qzeros  int32 [K/g, N/8] the zeros, same order, no offset
  scales  fp16  [K/g, N]   K must be a multiple of the group size
  W[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])
"""
from __future__ import annotations

import os

import torch

from trellm_backend.models.config import ModelConfigError, QuantFormat
from trellm_kernels.int4 import Int4Weight, pack_nibbles

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantization_config(fmt: QuantFormat) -> dict:
    """What the packer writes into config.json (the keys transformers' GPTQConfig / AwqConfig write)."""
    if fmt.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": fmt.group_size, "desc_act": fmt.desc_act,
            "sym": fmt.sym, "checkpoint_format": "gptq" if fmt.zero_offset else "gptq_v2"}


# ------------------------------------------------------------------------------------------------- int32 words

def pack_words(v: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: v[..., i] in bits 4*i (bit 31 is the sign bit of the int32)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (v.to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_words(w: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> uint8 [..., 8]: bits 4*i of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((w.to(torch.int32).unsqueeze(-1) >> shifts) & 15).to(torch.uint8)


# -------------------------------------------------------------------------------------------------------- GPTQ

def gptq_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
              zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in the layer's input order, scales/zeros [G, N], g_idx [K] -> the GPTQ tensors."""
    N, K = q.shape
    if K % 8 or N % 8:
        raise ValueError(f"GPTQ packs 8 values per int32: {N} outputs x {K} inputs are not multiples of 8")
    if zero_offset and int(zeros.min()) < zero_offset:
        raise ValueError("GPTQ's original layout stores zero - 1 and cannot hold a zero point of 0")
    qweight = pack_words(q.t().reshape(K // 8, 8, N).transpose(1, 2))
    qzeros = pack_words((zeros.to(torch.int64) - zero_offset).reshape(zeros.shape[0], N // 8, 8))
    return {"qweight": qweight.contiguous(), "qzeros": qzeros.contiguous(),
            "scales": scales.to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32).contiguous()}


def gptq_unpack(t: dict[str, torch.Tensor], fmt: QuantFormat, where: str) -> Int4Weight:
    """The GPTQ tensors of one linear -> Int4Weight (act-order as a permutation of the inputs). `where` names the
    file and the layer in errors."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = -(-K // fmt.group_size)
    if qzeros.shape != (G, N // 8) or scales.shape != (G, N) or qweight.dtype != torch.int32 \
            or qzeros.dtype != torch.int32:
        raise ModelConfigError(f"{where}: qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros "
                               f"{tuple(qzeros.shape)} {qzeros.dtype}, scales {tuple(scales.shape)} do not form a "
                               f"GPTQ layer of group_size {fmt.group_size} (expected int32 [K/8, N], int32 [{G}, "
                               f"{N // 8}], [{G}, {N}])")
    q = unpack_words(qweight).permute(0, 2, 1).reshape(K, N).t()
    zeros = (unpack_words(qzeros).reshape(G, N).to(torch.int16) + fmt.zero_offset).to(torch.uint8)
    natural = torch.arange(K) // fmt.group_size
    g_idx = t.get("g_idx")
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (K,):
            raise ModelConfigError(f"{where}: g_idx has shape {tuple(g_idx.shape)}, expected ({K},)")
        if not torch.equal(g_idx, natural):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], natural):
                raise ModelConfigError(f"{where}: g_idx does not put {fmt.group_size} inputs in each group "
                                       "(not an act-order permutation)")
            q = q[:, perm]
    return Int4Weight(pack_nibbles(q.contiguous()), scales.contiguous(), zeros.contiguous(), fmt.group_size, K, perm)


# --------------------------------------------------------------------------------------------------------- AWQ

def awq_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """q uint8 [N, K], scales/zeros [K/g, N] -> the AWQ (gemm) tensors."""
    N, K = q.shape
    if N % 8 or K % scales.shape[0]:
        raise ValueError(f"AWQ needs outputs a multiple of 8 and whole groups: {N} outputs x {K} inputs")
    order = torch.tensor(AWQ_ORDER)

    def words(v):   # [R, N] -> int32 [R, N/8], nibble i holding column 8c + AWQ_ORDER[i]
        return pack_words(v.reshape(v.shape[0], N // 8, 8)[:, :, order])

    return {"qweight": words(q.t()).contiguous(), "qzeros": words(zeros).contiguous(),
            "scales": scales.to(torch.float16).contiguous()}


def awq_unpack(t: dict[str, torch.Tensor], fmt: QuantFormat, where: str) -> Int4Weight:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    K, N = qweight.shape[0], qweight.shape[1] * 8
    G = K // fmt.group_size
    if K % fmt.group_size or qzeros.shape != (G, N // 8) or scales.shape != (G, N) \
            or qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ModelConfigError(f"{where}: qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros "
                               f"{tuple(qzeros.shape)} {qzeros.dtype}, scales {tuple(scales.shape)} do not form an "
                               f"AWQ layer of group_size {fmt.group_size} (expected int32 [K, N/8] with K a multiple "
                               f"of the group, int32 [K/g, N/8], [K/g, N])")
    order = torch.tensor(AWQ_ORDER)

    def columns(w):   # int32 [R, N/8] -> uint8 [R, N]
        v = unpack_words(w)
        out = torch.empty_like(v)
        out[:, :, order] = v
        return out.reshape(w.shape[0], N)

    q = columns(qweight).t().contiguous()
    return Int4Weight(pack_nibbles(q), scales.contiguous(), columns(qzeros).contiguous(), fmt.group_size, K)


PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


def take_int4(state: dict[str, torch.Tensor], prefix: str, fmt: QuantFormat, path: str) -> Int4Weight:
    """Pop `<prefix>.qweight` etc. from a loaded state dict and read them (on CPU; scales as stored)."""
    t = {}
    for part in PARTS[fmt.method]:
        v = state.pop(f"{prefix}.{part}", None)
        if v is None and part != "g_idx":
            raise ModelConfigError(f"{path}: {fmt.method} weight {prefix}.{part!s} missing from the safetensors files")
        if v is not None:
            t[part] = v
    where = f"{os.path.join(path, '*.safetensors')}: {prefix}"
    return (gptq_unpack if fmt.method == "gptq" else awq_unpack)(t, fmt, where)
