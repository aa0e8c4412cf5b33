"""vLLM's offline engine on a benchmark's requests: the vLLM-CPU baseline of perf/benchmark.py.

It runs inside vLLM's own environment (vLLM pins its own torch and transformers), as a subprocess of
perf/benchmark.py, which gives it a JSON file of requests and reads back a JSON result:

    .venv-vllm/bin/python perf/vllm_baseline.py requests.json result.json

requests.json: {"model_dir": str, "dtype": "float32", "requests": [{"prompt_ids": [...], "output_tokens": n}, ...],
                "llm_kwargs": {...} (optional, more arguments of vllm.LLM, e.g. kv_cache_memory_bytes)}
result.json:   {"name", "wall_s", "output_tokens", "output_tok_s", "ttft_mean_ms" (or null, with "ttft_note"),
                "token_ids": [[...], ...] (in request order), "vllm_version", "env": the VLLM_* settings seen}

Every request is greedy, with EOS ignored and min_tokens = max_tokens, so each makes exactly its output length.
Prompts go in as token ids. The clock covers one `generate` call over all requests (all admitted at t=0), after
the engine is built and one short warm-up request has run, as the server gets one too. This file imports nothing
from this project: it must run where only vLLM is installed. Run it from a folder that has no `kernels/` in it
(not the repository root): vLLM's subprocesses put the working folder on sys.path, and transformers imports a
top-level `kernels` package when one is importable.
"""
from __future__ import annotations

import json
import os
import sys
import time


def mean_ttft_ms(outputs, start_wall: float) -> tuple[float | None, str]:
    """Mean time to first token from the RequestOutput metrics, when this vLLM fills them in."""
    ttfts = []
    for out in outputs:
        m = getattr(out, "metrics", None)
        if m is None:
            return None, "vLLM's RequestOutput.metrics is None here (the V1 engine does not fill it in offline)"
        # V0's RequestMetrics: arrival_time and first_token_time (time.time()); V1's stats: first_token_latency.
        latency = getattr(m, "first_token_latency", None)
        if latency:
            ttfts.append(latency)
            continue
        first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
        if not first:
            return None, f"vLLM's RequestOutput.metrics ({type(m).__name__}) has no first-token time"
        ttfts.append(first - (arrival or start_wall))
    return 1e3 * sum(ttfts) / len(ttfts), "from RequestOutput.metrics"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    # The settings this run was given (vLLM sets some of these itself once imported, LD_PRELOAD among them).
    given_env = {k: v for k, v in os.environ.items()
                 if k.startswith("VLLM_") or k in ("LD_PRELOAD", "OMP_NUM_THREADS")}
    import vllm
    from vllm import LLM, SamplingParams
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:   # older layouts
        TokensPrompt = dict

    requests = spec["requests"]
    # disable_log_stats=False: the per-request stats (first-token latency) are kept only with stats on.
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"), seed=0, disable_log_stats=False,
              **spec.get("llm_kwargs", {}))

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["prompt_ids"][:16])], params(4), use_tqdm=False)

    start_wall, start = time.time(), time.perf_counter()
    outputs = llm.generate(prompts, [params(r["output_tokens"]) for r in requests], use_tqdm=False)
    wall = time.perf_counter() - start

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(len(t) for t in token_ids)
    wanted = sum(r["output_tokens"] for r in requests)
    if produced != wanted:
        print(f"vllm_baseline: vLLM made {produced} tokens, {wanted} were asked for", file=sys.stderr)
        return 1
    ttft, note = mean_ttft_ms(outputs, start_wall)
    result = {"name": spec.get("name", "vllm"), "wall_s": wall, "output_tokens": produced,
              "output_tok_s": produced / wall, "ttft_mean_ms": ttft, "ttft_note": note, "token_ids": token_ids,
              "vllm_version": vllm.__version__, "env": given_env}
    with open(argv[1], "w") as f:
        json.dump(result, f)
    print(f"[vllm] {result['name']}: {produced} tokens in {wall:.1f} s = {produced / wall:.1f} out tok/s, "
          f"mean TTFT {'n/a' if ttft is None else f'{ttft:.0f} ms'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
