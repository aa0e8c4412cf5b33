"""KV blocks a sliding-window model holds (issue 46): the engine alone on the test checkpoint whose every layer
slides (tests/hf_models.py's mistral-sliding: window 24), a few long generations, the peak of blocks in use with the
window's blocks given back (the default) and with every block kept.

    .venv/bin/python perf/bench_sliding_window.py [--requests 4] [--prompt-len 90] [--gen-len 400]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from hf_models import model_dir_for, random_prompts  # noqa: E402
from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from trellm_backend.engine.request import SamplingParams  # noqa: E402


def peak_blocks(model_dir: str, prompts: list[list[int]], gen_len: int, keep_every_block: bool) -> int:
    engine = LLMEngine(EngineConfig(model_path=model_dir, block_size=16, kv_cache_bytes=8 << 20))
    if keep_every_block:
        engine.kv.window = 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv_blocks_used())
    return peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=90)
    ap.add_argument("--gen-len", type=int, default=400)
    args = ap.parse_args()
    model_dir = model_dir_for(tempfile.mkdtemp(), "mistral-sliding")
    prompts = random_prompts(0, 320, [args.prompt_len] * args.requests)
    total = args.prompt_len + args.gen_len
    for keep in (False, True):
        print(f"{'every block kept' if keep else 'window blocks given back'}: {args.requests} requests of "
              f"{total} tokens, window 24, peak {peak_blocks(model_dir, prompts, args.gen_len, keep)} blocks of 16")


if __name__ == "__main__":
    main()
