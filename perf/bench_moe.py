"""A mixture of experts against the dense model with the same active parameters, served, in one run: the anchor
profile (48 requests at t=0) through tritonserver for the dense anchor (hf_models/anchor) and for its Mixtral twin
(hf_models/anchor-moe: 8 experts, top-2, each half the anchor's MLP width), one after the other, and the ratio of
their output tokens per second.

    .venv/bin/python perf/bench_moe.py [--rounds 2] [--llm-param kv_cache_bytes=2147483648]

Both folders are built at random initialisation when missing (tools/default_model.py). The MoE layers hold 4x the
anchor's MLP weights, of which a token reads a quarter. Each round serves both models; the ratio is printed per
round and the results go to perf/out/bench_moe/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"dense": ("anchor", "anchor"), "moe": ("anchor-moe", "anchor-moe")}   # label -> (folder, size)


def serve_anchor(model_dir: str, out: str, llm_params: list[str]) -> float:
    """Output tokens per second of the anchor profile served from `model_dir` (perf/benchmark.py)."""
    cmd = [sys.executable, os.path.join(REPO, "perf", "benchmark.py"), "--start-server", "--model-dir", model_dir,
           "--profiles", "anchor", "--out", out, "--no-progress", *(f"--llm-param={p}" for p in llm_params)]
    subprocess.run(cmd, check=True, cwd=REPO)
    with open(os.path.join(out, "benchmark.json")) as f:
        [level] = json.load(f)["levels"]
    return level["output_tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llm-param", action="append", default=["kv_cache_bytes=2147483648"], metavar="KEY=VALUE")
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "bench_moe"))
    args = ap.parse_args()
    from trellm_backend.tools.default_model import build
    dirs = {label: build(os.path.join(REPO, "hf_models", folder), 0, size=size)
            for label, (folder, size) in MODELS.items()}
    for r in range(args.rounds):
        tok_s = {label: serve_anchor(d, os.path.join(args.out, f"{label}-{r}"), args.llm_param)
                 for label, d in dirs.items()}
        print(f"round {r}: dense {tok_s['dense']:.1f} out tok/s, moe {tok_s['moe']:.1f} out tok/s, "
              f"moe/dense {tok_s['moe'] / tok_s['dense']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
