"""The Llama-family forward (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3's text model, and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse layers are models/moe.py's) over a flat batch of tokens and a paged
KV cache.

Tokens of all sequences in a step are concatenated ([T, hidden]); attention finds each sequence's keys and
values through its block table, so prefill chunks and single-token decodes share one forward.
q/k/v and gate/up are merged into one matrix each, so a layer costs four matmuls.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, replace

import torch

from trellm_backend.distributed.group import TensorGroup
from trellm_backend.models.config import ModelConfig, ModelConfigError
from trellm_backend.models.decode_stack import DecodeStack
from trellm_backend.models.gguf import GgufState
from trellm_backend.models.moe import SparseMlp, load_sparse_mlp
from trellm_backend.models.rope import cos_sin_cache, long_rope_from
from trellm_backend.models.weights import Checkpoint
from trellm_kernels.activation import gelu_tanh_and_mul, silu_and_mul
from trellm_kernels.attention import paged_attention
from trellm_kernels.dispatch import use_triton
from trellm_kernels.kv_cache import rotary_and_write_kv
from trellm_kernels.linear import Weight, linear, linear_path
from trellm_kernels.rmsnorm import fused_add_rms_norm, rms_norm


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch sits. B sequences, T tokens in all."""
    positions: torch.Tensor      # [T] position of each token in its sequence
    slot_mapping: torch.Tensor   # [T] KV slot each new token is written to
    cu_seqlens_q: torch.Tensor   # [B+1] offsets of each sequence's tokens in the flat batch
    seq_lens: torch.Tensor       # [B] context length of each sequence after this step
    block_tables: torch.Tensor   # [B, max_blocks] block ids, -1 padded
    max_seqlen_q: int
    max_seqlen_k: int
    rope_long: torch.Tensor | None = None   # [T] bool: longrope's long factors for this token (None: short)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight | None          # the dense MLP; None in a sparse layer
    gate_up_bias: torch.Tensor | None
    down: Weight | None
    down_bias: torch.Tensor | None
    sparse: SparseMlp | None = None
    attn_out_norm: torch.Tensor | None = None   # Gemma: the attention's output normed before the residual add
    mlp_out_norm: torch.Tensor | None = None    # Gemma: the MLP's output normed before the residual add
    cos_sin: torch.Tensor | None = None         # the layer's own rope table (Gemma's sliding layers); None: the model's
    window: int = 0                             # the layer's sliding window; 0: full attention


class LlamaModel:
    """Weights and forward. Not an nn.Module: there is nothing to train, and plain tensors keep it explicit."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 max_positions: int, quantization: str = "none", group: TensorGroup | None = None,
                 layers: range | None = None):
        """The checkpoint's names mapped to the layers (weights.Checkpoint takes each tensor and prepares the
        linears). `quantization` applies to the layers' linears; the embedding and the LM head keep the dtype (as
        GPTQ and AWQ checkpoints do: logits are the most sensitive). With a tensor-parallel `group`, `cfg` and
        `state` are this rank's share (models/sharding.py): the partial sums of o and down are added across the
        ranks, the embeddings looked up where they are held and the logits gathered. A pipeline stage holds only the
        decoder `layers` it runs (the first stage the embeddings, the last the final norm and the LM head)."""
        self.cfg = cfg
        self.group = group
        self.layer_ids = layers if layers is not None else range(cfg.num_layers)
        self.first_stage = self.layer_ids.start == 0
        self.last_stage = self.layer_ids.stop == cfg.num_layers
        self.device = device
        self.dtype = dtype
        ck = Checkpoint(cfg, state, device, dtype, quantization)
        take, source = ck.take, cfg.path
        gemma = cfg.gemma

        def norm(name: str) -> torch.Tensor:
            # Gemma stores its norms' weights as w and scales by 1 + w
            return take(name) + 1 if gemma is not None else take(name)

        # a tensor, or a GGUF file's blocks (GroupWeight); on the last stage of a pipeline only for a tied LM head
        held = self.first_stage or (self.last_stage and cfg.tie_word_embeddings)
        self.embed = ck.embeddings() if held else None
        if held and tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ModelConfigError(f"{source}: model.embed_tokens.weight has shape {tuple(self.embed.shape)}, "
                                   f"config.json says vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}")
        self.cos_sin = cos_sin_cache(cfg, max_positions).to(device)
        local_cos_sin = None
        if gemma is not None and "sliding_attention" in gemma.layer_types:
            local_cos_sin = cos_sin_cache(replace(cfg, rope_theta=gemma.local_rope_theta, rope_scaling=None),
                                          max_positions).to(device)
        self.layers: list[LayerWeights] = []
        for i in self.layer_ids:
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            sparse = cfg.moe is not None and cfg.moe.is_sparse(i)
            fused = cfg.family == "phi3"      # Phi-3 stores q/k/v and gate/up already merged
            gate_up = None
            if not sparse:
                gate_up = ck.linear(m + "gate_up_proj") if fused else ck.linear(m + "gate_proj", m + "up_proj")
            self.layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=ck.linear(a + "qkv_proj") if fused else ck.linear(a + "q_proj", a + "k_proj", a + "v_proj"),
                qkv_bias=ck.stacked(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if cfg.qkv_bias else None,
                o=ck.linear(a + "o_proj"),
                o_bias=take(a + "o_proj.bias") if cfg.o_bias else None,
                q_norm=norm(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if cfg.qk_norm else None,
                # the norm before the MLP: Gemma names it pre_feedforward (its post_attention one is attn_out_norm)
                post_norm=norm(p + ("pre_feedforward" if gemma else "post_attention") + "_layernorm.weight"),
                gate_up=gate_up,
                gate_up_bias=ck.stacked(m + "gate_proj.bias", m + "up_proj.bias") if cfg.mlp_bias else None,
                down=None if sparse else ck.linear(m + "down_proj"),
                down_bias=take(m + "down_proj.bias") if cfg.mlp_bias else None,
                sparse=load_sparse_mlp(ck, cfg, p) if sparse else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
                cos_sin=local_cos_sin if gemma and gemma.layer_types[i] == "sliding_attention" else None,
                window=cfg.layer_windows[i] if cfg.layer_windows else 0,
            ))
        self.norm = norm("model.norm.weight") if self.last_stage else None
        self.lm_head = ck.lm_head(self.embed) if self.last_stage else None
        if not self.first_stage:
            self.embed = None
        unread = state.leftover() if isinstance(state, GgufState) else []
        if unread:
            raise ModelConfigError(f"{state.file}: tensors {', '.join(unread)} are not read by the {cfg.family} "
                                   "model; the file holds something the engine does not implement")
        self.max_positions = max_positions
        self.long_rope_from = long_rope_from(cfg)
        self.scale = cfg.head_dim ** -0.5 if gemma is None else gemma.attention_scale
        # Gemma: embeddings times sqrt(hidden) (rounded to the dtype first, as transformers does), GELU-tanh, and
        # optional tanh caps on the attention scores and the logits
        self.embed_scale = None if gemma is None else torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device)
        self.gelu = gemma is not None
        self.logit_cap = None if gemma is None else gemma.final_logit_softcapping
        self.attention_cap = (gemma and gemma.attn_logit_softcapping) or 0.0
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # On a CPU, short steps run the layers in one C++ call where they hold nothing else (decode_stack.py); its
        # layers have no collectives between them
        whole = group is None and layers is None
        self.decode_stack = DecodeStack.build(self) if device.type == "cpu" and whole else None

    def weight_bytes(self) -> int:
        """Bytes of every tensor the model holds (each once), rope tables aside."""
        seen, total = set(), 0

        def visit(x):
            nonlocal total
            if isinstance(x, torch.Tensor):
                key = id(x) if x.is_mkldnn else x.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += x.numel() * x.element_size()
            elif dataclasses.is_dataclass(x):
                for f in dataclasses.fields(x):
                    if f.name != "cos_sin":
                        visit(getattr(x, f.name))
            elif isinstance(x, (list, tuple)):
                for item in x:
                    visit(item)
        visit([self.embed, self.layers, self.norm, self.lm_head])
        return total

    def has_sparse_layers(self) -> bool:
        return any(layer.sparse is not None for layer in self.layers)

    def linear_paths(self) -> str:
        """Which implementation each linear layer runs, e.g. "qkv, o, gate_up, down: fp32 C++ (AVX-512); lm_head:
        oneDNN float32" (logged at load, so that a host's paths show without a profile)."""
        counts = Counter((site, linear_path(getattr(layer, site)))
                         for layer in self.layers for site in ("qkv", "o", "gate_up", "down")
                         if getattr(layer, site) is not None)
        by_path: dict[tuple[str, int], list[str]] = {}
        for (site, path), n in counts.items():
            by_path.setdefault((path, n), []).append(site)
        parts = [f"{', '.join(sites)}{'' if n == len(self.layers) else f' in {n} of {len(self.layers)} layers'}: {path}"
                 for (path, n), sites in by_path.items()]
        sparse = [layer.sparse.experts for layer in self.layers if layer.sparse is not None]
        if sparse:
            parts.append(f"experts in {len(sparse)} of {len(self.layers)} layers: " + (
                "Triton fused MoE" if sparse[0].stacked is not None else linear_path(sparse[0].gate_up[0])))
        return "; ".join(parts + ([f"lm_head: {linear_path(self.lm_head)}"] if self.lm_head is not None else []))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                logits_indices: torch.Tensor, kv_scales: torch.Tensor | None = None,
                lora: LoraStep | None = None, carried: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [len(logits_indices), vocab] (fp32) of the selected tokens.

        A pipeline stage after the first starts from `carried`, the hidden states and residuals [2, T, hidden] the
        stage before it returned; a stage before the last returns its own instead of logits.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; new K/V are written into it.
        kv_scales: with an INT8/FP8 kv_cache, its float16 scales [num_layers, 2, num_blocks, block_size,
        num_kv_heads] (kernels/kv_cache.py).
        lora: the step's LoRA adapters and their tokens (models/lora.py), added to the linears they target.
        """
        cfg = self.cfg
        T = input_ids.shape[0]
        h, residual = (carried[0], carried[1]) if carried is not None else (self._embed(input_ids), None)
        stack = self.decode_stack
        if stack is not None and lora is None and meta.rope_long is None and stack.takes(T, meta.max_seqlen_q):
            h, residual = stack.forward(h, meta, kv_cache, kv_scales)
        else:
            h, residual = self._layers(h, residual, meta, kv_cache, kv_scales, lora)
        if not self.last_stage:
            return torch.stack([h, residual])
        # Only the rows that will be sampled go through the final norm and the vocabulary projection.
        h = h[logits_indices]
        residual = residual[logits_indices]
        x, _ = fused_add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)
        logits = linear(x, self.lm_head).float()
        if self.group is not None:
            logits = self.group.gather_vocab(logits)
        if self.logit_cap is not None:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (Gemma's scaled), from the rows this rank holds with tensor parallelism."""
        if self.group is not None:
            h = self.group.embed(self.embed, input_ids)
        elif isinstance(self.embed, torch.Tensor):
            h = self.embed[input_ids]
        else:
            h = self.embed.take_rows(input_ids).to(self.dtype)
        return h if self.embed_scale is None else h * self.embed_scale

    def _layers(self, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                lora: LoraStep | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers from Python, operator by operator: (h, residual) after the last one (`residual` None
        before the first layer). kv_cache holds this model's layers only, in order."""
        cfg = self.cfg
        T = h.shape[0]
        rope_rows = meta.positions
        if meta.rope_long is not None:
            # longrope: the long factors are the table's second half (the scheduler decides which tokens take them)
            rope_rows = meta.positions + meta.rope_long.to(meta.positions.dtype) * self.max_positions
        for j, (i, w) in enumerate(zip(self.layer_ids, self.layers)):
            if residual is None:
                residual = h
                x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = fused_add_rms_norm(h, residual, w.input_norm, cfg.rms_norm_eps)
            qkv = linear(x, w.qkv, w.qkv_bias)
            if lora is not None:
                lora.add(qkv, x, i, "qkv")
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(T, cfg.num_heads, cfg.head_dim)
            k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
            if w.q_norm is not None:  # Qwen3, Gemma 3: RMSNorm of each head before rotary
                if not use_triton(q):   # the C++ operator takes rows of their own (the decode stack's too)
                    q, k = q.contiguous(), k.contiguous()
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            k_cache, v_cache = kv_cache[j, 0], kv_cache[j, 1]
            k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[j, 0], kv_scales[j, 1])
            cos_sin = self.cos_sin if w.cos_sin is None else w.cos_sin
            q = rotary_and_write_kv(q.contiguous(), k, v, rope_rows, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                    k_scale, v_scale)
            attn = paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   self.scale, meta.max_seqlen_q, meta.max_seqlen_k, k_scale, v_scale,
                                   window=w.window, softcap=self.attention_cap)
            attn = attn.reshape(T, self.q_size)
            h = linear(attn, w.o, w.o_bias)
            if lora is not None:
                lora.add(h, attn, i, "o")
            if self.group is not None:
                self.group.all_reduce(h)
            if w.attn_out_norm is not None:
                h = rms_norm(h, w.attn_out_norm, cfg.rms_norm_eps)
            x, residual = fused_add_rms_norm(h, residual, w.post_norm, cfg.rms_norm_eps)
            if w.sparse is not None:
                h = w.sparse(x)
                if self.group is not None:
                    self.group.all_reduce(h)
                continue
            gu = linear(x, w.gate_up, w.gate_up_bias)
            if lora is not None:
                lora.add(gu, x, i, "gate_up")
            act = gelu_tanh_and_mul(gu) if self.gelu else silu_and_mul(gu)
            h = linear(act, w.down, w.down_bias)
            if lora is not None:
                lora.add(h, act, i, "down")
            if self.group is not None:
                self.group.all_reduce(h)
            if w.mlp_out_norm is not None:
                h = rms_norm(h, w.mlp_out_norm, cfg.rms_norm_eps)
        return h, residual
