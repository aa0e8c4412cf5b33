"""Quantize a float Hugging Face Llama-family folder into a 4-bit GPTQ or AWQ checkpoint.

Why: the engine's GPTQ/AWQ reader must be tested on files laid out byte for byte as AutoGPTQ and AutoAWQ lay them
out (backend/models/quant_formats.py documents the layouts and the sources read), without those tools, calibration
data or a GPU. The values come from round-to-nearest (kernels/int4.py's quantizer), not from GPTQ's error feedback
or AWQ's scale search: the layout is the formats', the rounding a simpler quantizer's. With --desc-act the inputs
are quantized in decreasing order of the column norm of the weights that share them (GPTQ orders by the Hessian's
diagonal, which needs calibration inputs); q/k/v and gate/up share one order, as GPTQ's do since they share an
input, so the engine can still run each pair or triple as one matrix.

    python -m trellm_backend.tools.quantize_checkpoint SRC DST --method gptq [--group-size 128] [--desc-act] [--asym]
    python -m trellm_backend.tools.quantize_checkpoint SRC DST --method awq [--group-size 128]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

from trellm_backend.models.config import load_model_config
from trellm_backend.models.quant_formats import QuantFormat, awq_pack, gptq_pack, quantization_config
from trellm_backend.models.weights import load_state_dict
from trellm_kernels.int4 import quantize_groups

# The linears of a layer, grouped by the input they share.
SHARED_INPUTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                 ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def act_order(weights: list[torch.Tensor]) -> torch.Tensor:
    """Inputs in decreasing order of the column norm of the weights sharing them (ties: lower index first)."""
    norms = torch.cat(weights).float().norm(dim=0)
    return torch.sort(-norms, stable=True).indices


def quantize_linear(w: torch.Tensor, fmt: QuantFormat, order: torch.Tensor | None = None):
    """w [N, K] -> (q uint8 [N, K] in the layer's input order, scales fp16 [G, N], zeros uint8 [G, N], g_idx [K]):
    groups are runs of `fmt.group_size` inputs taken in `order` (default: 0..K-1)."""
    K = w.shape[1]
    if order is None:
        order = torch.arange(K)
    q_ordered, scales, zeros = quantize_groups(w[:, order], fmt.group_size, sym=fmt.sym, scale_dtype=torch.float16,
                                               min_zero=fmt.zero_offset)
    q = torch.empty_like(q_ordered)
    q[:, order] = q_ordered
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // fmt.group_size).to(torch.int32)
    return q, scales, zeros, g_idx


def quantize_state(state: dict[str, torch.Tensor], num_layers: int, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Replace each layer linear's `.weight` in `state` by its packed tensors (biases and the rest stay)."""
    out = dict(state)
    for i in range(num_layers):
        for module, names in SHARED_INPUTS:
            prefixes = [f"model.layers.{i}.{module}.{n}" for n in names]
            ws = [out.pop(p + ".weight") for p in prefixes]
            order = act_order(ws) if fmt.desc_act else None
            for prefix, w in zip(prefixes, ws):
                q, scales, zeros, g_idx = quantize_linear(w, fmt, order)
                packed = (gptq_pack(q, scales, zeros, g_idx, fmt.zero_offset) if fmt.method == "gptq"
                          else awq_pack(q, scales, zeros))
                out.update({f"{prefix}.{part}": t for part, t in packed.items()})
    return out


def quantize_folder(src: str, dst: str, fmt: QuantFormat) -> str:
    mc = load_model_config(src)
    if mc.quant is not None:
        raise ValueError(f"{os.path.join(src, 'config.json')}: already a {mc.quant.method} checkpoint")
    state = load_state_dict(src, mc.torch_dtype)
    packed = quantize_state(state, mc.num_layers, fmt)
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in packed.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):   # tokenizer and generation settings as they are
        if name not in ("config.json", "model.safetensors.index.json") and not name.endswith(".safetensors") \
                and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--method", choices=("gptq", "awq"), required=True)
    ap.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    ap.add_argument("--desc-act", action="store_true", help="gptq: act-order (g_idx a permutation of the groups)")
    ap.add_argument("--asym", action="store_true", help="gptq: zero points per group (default sym: zero 8)")
    ap.add_argument("--v2", action="store_true", help="gptq: checkpoint_format gptq_v2 (zeros stored without -1)")
    args = ap.parse_args(argv)
    if args.method == "awq" and (args.desc_act or args.asym or args.v2):
        ap.error("--desc-act, --asym and --v2 are GPTQ options (AWQ always has zero points, no act-order)")
    fmt = (QuantFormat("awq", args.group_size) if args.method == "awq" else
           QuantFormat("gptq", args.group_size, desc_act=args.desc_act, sym=not args.asym,
                       zero_offset=0 if args.v2 else 1))
    print(quantize_folder(args.src, args.dst, fmt))


if __name__ == "__main__":
    main()
