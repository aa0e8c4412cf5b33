"""LoRA cost in the engine alone (issue 29): adapters made with peft on the model (tests/hf_models.py LORAS, r 4-16),
then the same requests decoded by the base, by the adapters mixed evenly, and one request alone.

    python perf/bench_lora.py [--model hf_models/anchor] [--requests 48] [--max-tokens 64] [--rounds 2]
                              [--one-tokens 256]

Prints, per round: output tok/s of the batch with no adapter and with the adapters mixed evenly (one continuous
batch), and the median decode tok/s of one request alone on the base and on one adapter, alternated three times;
each with its ratio to the base.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from hf_models import LORAS, make_lora, random_prompts  # noqa: E402
from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from workload import run_at_once  # noqa: E402


def tok_per_s(engine: LLMEngine, prompts, names, max_tokens: int) -> float:
    """Output tokens per second of the prompts admitted at once, prompt i with adapter names[i % len(names)]."""
    run = run_at_once(engine, [(p, max_tokens) for p in prompts], [names[i % len(names)] for i in range(len(prompts))])
    return run.output_tokens / run.wall_s


def decode_tok_per_s(engine: LLMEngine, prompt, name, max_tokens: int) -> float:
    """Decode tokens per second of one request alone (after its first token)."""
    run = run_at_once(engine, [(prompt, max_tokens)], [name])
    return (max_tokens - 1) / (run.wall_s - run.first_token_s[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "anchor"))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one-tokens", type=int, default=256, help="tokens of the lone request, base and adapter "
                    "alternated three times a round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {name: make_lora(args.model, name, os.path.join(tmp, name)) for name in LORAS}
        adapters["all-r16-b"] = adapters["all-r16"]     # a fourth name, so four adapters share the batch
        engine = LLMEngine(EngineConfig(args.model, lora_adapters=json.dumps(adapters), max_num_seqs=64))
        vocab = engine.model_config.vocab_size
        prompts = random_prompts(0, vocab, [16 + (37 * i) % 240 for i in range(args.requests)])
        tok_per_s(engine, prompts[:2], [None], 4)    # warm-up
        mixed = list(adapters)
        for rnd in range(args.rounds):
            base = tok_per_s(engine, prompts, [None], args.max_tokens)
            lora = tok_per_s(engine, prompts, mixed, args.max_tokens)
            ones = {None: [], "all-r16": []}
            for _ in range(3):
                for name in ones:
                    ones[name].append(decode_tok_per_s(engine, prompts[0], name, args.one_tokens))
            one_base, one_lora = (statistics.median(v) for v in ones.values())
            print(f"round {rnd}: {args.requests} requests: base {base:.1f} tok/s, {len(mixed)} adapters mixed "
                  f"{lora:.1f} ({lora / base:.3f}x); one request (median decode): base {one_base:.1f} tok/s, "
                  f"adapter all-r16 {one_lora:.1f} ({one_lora / one_base:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
