"""Speculative decoding on and off, in one run: output tokens/s, inter-token latency and acceptance at a few
concurrency levels, on a repetitive workload and on the variable profile's kind of prompts (engine alone, in
process, so the figures are the engine's; the served path adds the same cost with speculation on or off).

Workloads (prompts are token windows of the text the default model was trained on, perf/workload.py):
- repetitive: a passage, then its first half again; the model continues the passage, so its output copies spans
  of the prompt (the code-editing / summarising case prompt lookup is for);
- variable: one window of 16-1024 tokens, 16-256 output tokens (the variable profile's shape, shortened to run in
  minutes).
A closed loop keeps `concurrency` requests in flight until `requests` have finished. Greedy, EOS ignored, so every
request makes exactly its output length and the engines produce the same tokens (checked).

    .venv/bin/python perf/bench_spec.py                       # tiny-llama (draft: tiny-draft), concurrency 1 4 16
    .venv/bin/python perf/bench_spec.py --modes off ngram ngram-always --concurrency 1 2 4 8 16
"""
from __future__ import annotations

import argparse
import os
import random
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from workload import PromptMaker  # noqa: E402
from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from trellm_backend.engine.request import SamplingParams  # noqa: E402


def make_requests(maker: PromptMaker, workload: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(f"{seed}-{workload}")
    out = []
    for _ in range(n):
        if workload == "repetitive":
            _, ids = maker.prompt(rng, rng.randint(96, 256))
            body = ids[1:]
            out.append((ids + body[:len(body) // 2], rng.randint(64, 160)))
        else:
            _, ids = maker.prompt(rng, rng.randint(16, 1024))
            out.append((ids, rng.randint(16, 256)))
    return out


def run_closed_loop(engine: LLMEngine, reqs, concurrency: int) -> dict:
    pending = list(enumerate(reqs))
    tokens: dict[int, list[int]] = {}
    itl, in_flight = [], 0
    before = engine.stats()
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, (prompt, n) = pending.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            tokens[i] = []
            in_flight += 1
        for o in engine.step():
            tokens[int(o.request_id)].extend(o.new_token_ids)
            if o.finished:
                in_flight -= 1
                if o.num_output_tokens > 1:
                    itl.append((o.times.last_token_ns - o.times.first_token_ns) / 1e9 / (o.num_output_tokens - 1))
    wall = time.perf_counter() - t0
    s = engine.stats()
    drafted = s.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = s.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    out_tokens = sum(len(t) for t in tokens.values())
    return dict(tok_s=out_tokens / wall, itl_ms=1000 * sum(itl) / len(itl), wall=wall, drafted=drafted,
                accepted=accepted, tokens=[tokens[i] for i in range(len(reqs))])


class WrongGuesses:
    """k guesses of token 0 (<unk>, which the models never make): every one is rejected."""

    def propose(self, seqs):
        return [[0] * s.num_tokens for s in seqs]

    def forget(self, request_id):
        pass


MODES = {   # name: engine settings
    "off": dict(speculative_method="none"),
    "ngram": dict(speculative_method="ngram"),                 # with the batch-size rule
    "ngram-always": dict(speculative_method="ngram", speculative_disable_batch_size=1 << 20),
    # Guesses that are always wrong (every position rejected): what verification costs when speculation fails.
    "wrong-always": dict(speculative_method="ngram", speculative_disable_batch_size=1 << 20),
    "draft": dict(speculative_method="draft"),
    "draft-always": dict(speculative_method="draft", speculative_disable_batch_size=1 << 20),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "variable"])
    ap.add_argument("--modes", nargs="+", default=["off", "ngram", "draft"], choices=sorted(MODES))
    ap.add_argument("--draft-model", default=os.path.join(REPO, "hf_models", "tiny-draft"),
                    help="for the draft modes (built here when it is the default and missing)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=0, help="per level (default: 2 x concurrency, at least 4)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--speculative-disable-batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per level, modes alternating; the fastest counts")
    args = ap.parse_args()

    maker = PromptMaker(args.model)
    if any(m.startswith("draft") for m in args.modes) and not os.path.isdir(args.draft_model):
        from trellm_backend.tools.default_model import build
        build(args.draft_model, size="tiny-draft")
    engines = {}
    for mode in args.modes:
        kw = dict(MODES[mode], num_speculative_tokens=args.num_speculative_tokens, draft_model_path=args.draft_model)
        if args.prompt_lookup_min is not None:
            kw["prompt_lookup_min"] = args.prompt_lookup_min
        if args.speculative_disable_batch_size is not None and mode in ("ngram", "draft"):
            kw["speculative_disable_batch_size"] = args.speculative_disable_batch_size
        engines[mode] = LLMEngine(EngineConfig(args.model, **kw))
        if mode == "wrong-always":
            engines[mode].runner.proposer = WrongGuesses()
        engines[mode].generate([[1, 2, 3]], SamplingParams(max_tokens=4))     # warm-up
    print(f"model {args.model}, draft {args.draft_model}, k={args.num_speculative_tokens}, greedy; engine alone")
    print("| workload | concurrency | mode | out tok/s | vs off | mean ITL ms | accepted / guessed |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for c in args.concurrency:
            reqs = make_requests(maker, workload, args.requests or max(4, 2 * c), args.seed)
            # Modes alternate, `repeats` rounds; each keeps its fastest round (bursts of other load on a shared
            # machine only ever slow a round down).
            results = {}
            for _ in range(args.repeats):
                for mode in args.modes:
                    r = run_closed_loop(engines[mode], reqs, c)
                    if mode not in results or r["tok_s"] > results[mode]["tok_s"]:
                        results[mode] = r
            base = results[args.modes[0]]
            for mode, r in results.items():
                same = "" if r["tokens"] == base["tokens"] else " (tokens differ!)"
                rate = f"{r['accepted']} / {r['drafted']} ({r['accepted'] / r['drafted']:.0%})" if r["drafted"] else "-"
                print(f"| {workload} | {c} | {mode} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
                      f"{r['itl_ms']:.2f} | {rate}{same} |", flush=True)


if __name__ == "__main__":
    main()
