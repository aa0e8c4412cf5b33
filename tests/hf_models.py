"""Small Hugging Face checkpoints of the Llama-family configurations the engine must cover, made with transformers
itself (random weights, fixed seed) and saved as ordinary folders, plus transformers' greedy output as the oracle."""
from __future__ import annotations

import os

import torch

# name -> (transformers config class, kwargs). Each differs from the default model in something the forward
# must get right.
VARIANTS = {
    # Qwen2: q/k/v biases, GQA ratio 4, large rope theta, tied embeddings
    "qwen2-bias-gqa4": ("Qwen2Config", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6,
                                            tie_word_embeddings=True, max_position_embeddings=512)),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim 8 (tiny heads), GQA ratio 3
    "qwen3-qknorm-hd8": ("Qwen3Config", dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                             max_position_embeddings=512)),
    # Llama 3.x: llama3 rope scaling, attention and MLP biases, no GQA
    "llama3-rope-bias": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                             mlp_bias=True, max_position_embeddings=512,
                                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                               high_freq_factor=4.0,
                                                               original_max_position_embeddings=64))),
    # Llama 2/3 proportions: head_dim 128 (the common size, and the Triton kernels' widest tile), GQA ratio 4
    "llama-gqa4-hd128": ("LlamaConfig", dict(hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=1,
                                             max_position_embeddings=512)),
    # Mistral: GQA ratio 2, linear rope scaling
    "mistral-linear-rope": ("MistralConfig", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=512, sliding_window=None,
                                                  rope_scaling=dict(rope_type="linear", factor=2.0))),
    # Phi-3: q/k/v and gate/up stored merged, partial rotary (12 of 16 dims), longrope whose pretraining length (24)
    # the longer prompts start past and the shorter ones cross while they decode
    "phi3-longrope": ("Phi3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=512, partial_rotary_factor=0.75,
                                         original_max_position_embeddings=24, sliding_window=None, pad_token_id=0,
                                         rope_scaling=dict(rope_type="longrope",
                                                           short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                           long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 13.0]))),
    # Gemma 3 (text): (1 + w) norms around both halves of each layer, embeddings scaled by sqrt(hidden), GELU-tanh,
    # q/k norms, query_pre_attn_scalar 24 (not the head size), a sliding layer (window 20, rope base 10k) and a full
    # one (1e6, linear scaling), tied embeddings, the logits capped at 30
    "gemma3-text": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             query_pre_attn_scalar=24, max_position_embeddings=512, sliding_window=20,
                                             layer_types=["sliding_attention", "full_attention"],
                                             final_logit_softcapping=30.0, pad_token_id=0,
                                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                                                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 1e6}})),
    # Gemma 2: attention scores capped at 3 (sharp attention exceeds it), the logits at 30, a sliding layer (window
    # 10, inside one block) then a full one, one rope base for both
    "gemma2-softcap": ("Gemma2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            query_pre_attn_scalar=16, max_position_embeddings=512, sliding_window=10,
                                            attn_logit_softcapping=3.0, final_logit_softcapping=30.0, pad_token_id=0)),
    # Mistral v0.1: every layer slides (window 24, across block edges)
    "mistral-sliding": ("MistralConfig", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512, sliding_window=24)),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide (here layer 1, window 33)
    "qwen2-sliding": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                          sliding_window=33, max_window_layers=1, max_position_embeddings=512)),
    # Mixtral: 8 experts, top-2, the top-2 weights renormalised, GQA ratio 2
    "mixtral-moe8": ("MixtralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                           num_experts_per_tok=2, max_position_embeddings=512, sliding_window=None)),
    # Qwen3-MoE: 8 experts, top-3 renormalised (norm_topk_prob), q/k norms, head_dim 8
    "qwen3-moe8-qknorm": ("Qwen3MoeConfig", dict(hidden_size=48, intermediate_size=96, moe_intermediate_size=40,
                                                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                                 head_dim=8, num_experts=8, num_experts_per_tok=3,
                                                 norm_topk_prob=True, max_position_embeddings=512)),
    # Qwen2-MoE: a sigmoid-gated shared expert, top-2 not renormalised, q/k/v biases; layer 1 dense (mlp_only_layers)
    "qwen2-moe-shared": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                                num_experts_per_tok=2, mlp_only_layers=[1],
                                                max_position_embeddings=512)),
}


# Variants whose attention projections are scaled up so that scores are of order one: with the default init
# (std 0.02) attention is near uniform and a wrong rotation changes no greedy token.
SHARP_ATTENTION = {"phi3-longrope": 6.0, "gemma3-text": 6.0, "gemma2-softcap": 6.0, "mistral-sliding": 6.0,
                   "qwen2-sliding": 6.0}


def make_variant(name: str, out_dir: str, vocab_size: int = 320, changes: dict | None = None) -> str:
    """Variant `name` (with `changes` to its config, where given) saved to `out_dir`."""
    import transformers
    cls_name, kwargs = VARIANTS[name]
    config = getattr(transformers, cls_name)(vocab_size=vocab_size, eos_token_id=vocab_size - 1,
                                             bos_token_id=0, **{**kwargs, **(changes or {})})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random biases and norm weights (defaults are 0 and 1) so that a forward that ignored them would differ.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
            if name in SHARP_ATTENTION and any(k in n for k in ("q_proj", "k_proj", "qkv_proj")):
                p.mul_(SHARP_ATTENTION[name])
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def with_tokenizer(name: str, tokenizer_dir: str, out_dir: str, changes: dict | None = None) -> str:
    """Variant `name` over the vocabulary of the tokenizer in `tokenizer_dir` (copied beside the weights): a folder
    a server can take as it takes a downloaded one."""
    import json
    import shutil
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        vocab_size = max(json.load(f)["model"]["vocab"].values()) + 1
    make_variant(name, out_dir, vocab_size, changes)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, file), out_dir)
    return out_dir


# model types transformers' GGUF loader does not map, and the type whose tensor names theirs share
GGUF_LOADED_AS = {"mistral": "llama"}


def hf_model(model_dir: str):
    """transformers' float32 model of a folder; of a GGUF folder (config.json names `gguf_file`), transformers' own GGUF
    loader on the file (its names, un-permuting and dequantizers) with the folder's config."""
    import json
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(os.path.join(model_dir, "config.json")) as f:
        gguf_file = json.load(f).get("gguf_file")
    if gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in GGUF_LOADED_AS:
        return AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32, config=config)
    like = AutoConfig.for_model(GGUF_LOADED_AS[config.model_type],
                                **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32, config=like)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects), EOS ignored."""
    return model_greedy(hf_model(model_dir), prompts, max_new_tokens)


def model_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A loaded transformers model's greedy continuation of each prompt, as hf_greedy."""
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def random_prompts(seed: int, vocab_size: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size - 1, (n,), generator=g).tolist() for n in lengths]


def model_dir_for(tmp_root: str, name: str) -> str:
    d = os.path.join(tmp_root, name)
    if not os.path.isfile(os.path.join(d, "model.safetensors")):
        make_variant(name, d)
    return d


# LoRA adapters for the default model: name -> (target modules, r, lora_alpha, use_rslora). PEFT's own random
# initialisation of A and B (init_lora_weights=False; the default makes B zero, an adapter that changes nothing),
# so each one visibly moves the greedy output.
LORAS = {
    "attn-r8": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, False),
    "mlp-r4-rslora": (["gate_proj", "up_proj", "down_proj"], 4, 8, True),
    "all-r16": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, 8, False),
}


def make_lora(base_dir: str, name: str, out_dir: str) -> str:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for the model at `base_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    targets, r, alpha, rslora = LORAS[name]
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(sorted(LORAS).index(name) + 7)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                                  lora_dropout=0.0, init_lora_weights=False))
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_lora_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int,
                   merged: bool = False, base_weights=None) -> list[list[int]]:
    """transformers + peft greedy continuations with the adapter applied unmerged (or merged into the weights with
    merge_and_unload), one prompt at a time, EOS ignored; the base model alone when adapter_dir is None.
    `base_weights(w)`, if given, replaces the weight of each decoder layer's linear first (a quantized base)."""
    from peft import PeftModel
    model = hf_model(base_dir)
    if base_weights is not None:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.data = base_weights(module.weight.data)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    out = []
    for p in prompts:
        ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out
