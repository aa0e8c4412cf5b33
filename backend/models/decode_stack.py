"""A decoder's layers in one C++ call for CPU steps of short rows (kernels/cpu/decode_layers.cpp).

Why: at one user a small model's decode step is mostly the time between operators. Each layer of LlamaModel's
loop is a dozen calls, and from Python each pays for its dispatch about as much as the operator works.
The C++ stack calls the same operators in the same order on the same dtypes, so a step gives the same logits to
the bit with or without it (tests/test_decode_stack.py holds it to that), and TRELLM_DECODE_LAYERS=0 turns it off.

It takes dense layers (not MoE) in fp32 or bf16, of every family but longrope's Phi-3: q/k norms, Gemma's norms,
GELU and attention caps, per-layer rope tables and windows included; with linears that `linear` runs at that
step's token count on an operator the stack calls itself (kernels/linear.py's cpu_operator: the C++ operators,
oneDNN's or torch's linear). Steps with LoRA or rows longer than the C++ attention takes run the Python loop.
"""
from __future__ import annotations

import torch

from trellm_kernels import cpu_ops
from trellm_kernels.attention import CPU_OP_MAX_Q_LEN
from trellm_kernels.dispatch import settings, use_triton
from trellm_kernels.linear import cpu_operator

SITES = ("qkv", "o", "gate_up", "down")
BIASES = {"qkv": "qkv_bias", "o": "o_bias", "gate_up": "gate_up_bias", "down": "down_bias"}


def _held_as(w, dtype: torch.dtype) -> bool:
    """A dense weight is in the activations' dtype (torch's linear would round it to theirs at every call)."""
    return w.dense is None or w.dense.dtype == dtype


class DecodeStack:
    def __init__(self, model, stack, kinds: list[int]):
        self._model = model
        self._stack = stack
        self._kinds = kinds                   # the operator of each linear, layer by layer in SITES order
        self._takes: dict[int, bool] = {}     # token count -> every linear runs the stack's operator there

    @classmethod
    def build(cls, model) -> "DecodeStack | None":
        """The stack for a loaded LlamaModel, or None where its layers need more than the C++ operators (see
        the module docstring) or the operators are not built here."""
        ops = cpu_ops.for_tensor(model.cos_sin)
        if ops is None or use_triton(model.cos_sin) or not settings().decode_layers:
            return None
        if model.dtype not in (torch.float32, torch.bfloat16) or model.long_rope_from is not None:
            return None
        operators = []    # each layer's linears' operators at one token
        for w in model.layers:
            if w.sparse is not None:    # no dense MLP to hold
                return None
            norms = (w.input_norm, w.post_norm, w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm)
            layer_ops = [cpu_operator(getattr(w, site), 1) for site in SITES]
            if (any(n is not None and n.dtype != model.dtype for n in norms)
                    or (w.cos_sin if w.cos_sin is not None else model.cos_sin).dtype != torch.float32
                    or any(not _held_as(getattr(w, site), model.dtype) for site in SITES) or None in layer_ops):
                return None
            operators.append(layer_ops)
        cfg = model.cfg
        stack = ops.DecodeLayers(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale,
                                 float(model.attention_cap), model.gelu, CPU_OP_MAX_Q_LEN)
        for w, layer_ops in zip(model.layers, operators):
            stack.add_layer(w.input_norm, w.post_norm, w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm,
                            model.cos_sin if w.cos_sin is None else w.cos_sin, w.window)
            for site, (kind, weight, scales, group) in zip(SITES, layer_ops):
                stack.add_linear(kind, weight, scales, getattr(w, BIASES[site]), group)
        return cls(model, stack, [op[0] for layer_ops in operators for op in layer_ops])

    def takes(self, tokens: int, max_seqlen_q: int) -> bool:
        """Whether a step of `tokens` rows, none longer than `max_seqlen_q` a sequence, runs here: the C++
        attention takes its rows, and every linear runs the operator the stack holds at that count."""
        if max_seqlen_q > CPU_OP_MAX_Q_LEN:
            return False
        ok = self._takes.get(tokens)
        if ok is None:
            ops = [cpu_operator(getattr(w, site), tokens) for w in self._model.layers for site in SITES]
            ok = self._takes[tokens] = all(op is not None and op[0] == kind for op, kind in zip(ops, self._kinds))
        return ok

    def set_timed(self, timed: bool) -> None:
        """Time the parts of each forward from now on (or stop): linears by site, attention (rotary and the KV write
        included), the norms and activations."""
        self._stack.set_timed(timed)

    def seconds(self) -> dict[str, float]:
        """Seconds each part took over the timed forwards since the last call."""
        return self._stack.seconds()

    def forward(self, h: torch.Tensor, meta, kv_cache: torch.Tensor,
                kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) after the last layer, as LlamaModel's loop leaves them."""
        return self._stack.forward(h, meta.positions, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens,
                                   meta.block_tables, kv_cache, kv_scales, meta.max_seqlen_q)
