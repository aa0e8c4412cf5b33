"""The benchmark's workloads: the seeds' three profiles, issue 14's `anchor` profile, and their seeded requests with
exact token lengths.

Prompts are windows of the model's own tokenization of the text the default model was trained on (CPython's help
topics), so a prompt of n tokens is n tokens for the server's tokenizer too (BOS included).
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field


@dataclass
class Profile:
    name: str
    concurrency: list[int]              # one measured level per entry, run in this order
    requests_per_level: list[int]
    prompt_tokens: tuple[int, int]      # inclusive range, drawn uniformly per request
    output_tokens: tuple[int, int]


@dataclass
class Item:
    prompt: str
    prompt_ids: list[int] = field(repr=False)
    output_tokens: int                  # asked for (max_tokens, and min_tokens when the server has it)
    lora_name: str | None = None        # a LoRA adapter of the served model (None: the base)


PROFILE_NAMES = ("low", "high", "variable", "anchor", "sweep")


def profiles(smoke: bool = False, variable_requests: int = 48, variable_concurrency: int = 64,
             anchor_requests: int = 48) -> dict[str, Profile]:
    """The seeds' three profiles, `anchor` and `sweep`; `smoke` shrinks each to a few short requests (for CI).

    anchor is the workload of issue 14's table (CPU throughput against vLLM-CPU): `anchor_requests` requests all
    sent at t=0, prompts of 16-512 tokens and answers of exactly 16-256 tokens, for the `--size anchor` model."""
    if smoke:
        return {
            "low": Profile("low", [1, 2], [2, 2], (16, 16), (8, 8)),
            "high": Profile("high", [8], [8], (16, 16), (8, 8)),
            "variable": Profile("variable", [4], [4], (16, 64), (4, 16)),
            "anchor": Profile("anchor", [4], [4], (16, 64), (8, 16)),
            "sweep": Profile("sweep", [1, 2], [2, 2], (16, 16), (8, 8)),
        }
    return {
        "low": Profile("low", [1, 2, 4], [4, 8, 16], (128, 128), (128, 128)),
        "high": Profile("high", [64, 128], [128, 256], (128, 128), (128, 128)),
        "variable": Profile("variable", [variable_concurrency], [variable_requests], (16, 2048), (16, 512)),
        "anchor": Profile("anchor", [anchor_requests], [anchor_requests], (16, 512), (16, 256)),
        # latency against throughput, concurrency doubling from 1 to 64 (README's plot)
        "sweep": Profile("sweep", [1, 2, 4, 8, 16, 32, 64], [4, 8, 16, 32, 48, 64, 128], (128, 128), (128, 128)),
    }


class PromptMaker:
    """Token-exact prompts cut from the corpus, for one model folder's tokenizer."""

    def __init__(self, model_dir: str):
        from trellm_backend.tools.default_model import corpus_text
        from trellm_backend.triton.tokenization import load_tokenizer
        self.tokenizer = load_tokenizer(model_dir)     # the one the server's preprocess loads
        # A quarter of the help topics (~30k tokens) is plenty for windows of a few thousand tokens.
        self.corpus_ids = self.tokenizer(corpus_text()[:150_000], add_special_tokens=False).input_ids
        self.special = len(self.tokenizer("x").input_ids) - len(self.tokenizer("x", add_special_tokens=False).input_ids)
        with open(os.path.join(model_dir, "config.json")) as f:
            self.max_len = json.load(f)["max_position_embeddings"]

    def prompt(self, rng: random.Random, n_tokens: int) -> tuple[str, list[int]]:
        # Decoding a window and encoding it again can merge tokens at the edges: trim until the count fits.
        body = max(1, n_tokens - self.special)
        start = rng.randrange(0, len(self.corpus_ids) - body - 1)
        window = self.corpus_ids[start:start + body]
        while True:
            text = self.tokenizer.decode(window)
            ids = self.tokenizer(text).input_ids
            if len(ids) <= n_tokens or len(window) == 1:
                return text, ids
            window = window[:-1]


def make_items(maker: PromptMaker, profile: Profile, n: int, seed: int) -> list[Item]:
    """`n` requests of `profile`, the same for the same seed; prompt + output never exceed the model's length."""
    rng = random.Random(f"{seed}-{profile.name}-{n}")
    items = []
    for _ in range(n):
        out = rng.randint(*profile.output_tokens)
        want = min(rng.randint(*profile.prompt_tokens), maker.max_len - out)
        text, ids = maker.prompt(rng, want)
        items.append(Item(text, ids, out))
    return items


@dataclass
class EngineRun:
    """What an in-process engine made of requests sent at once."""
    tokens: list[list[int]]        # each request's output token ids, in the requests' order
    first_token_s: list[float]     # each request's time to its first token
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def run_at_once(engine, requests: list[tuple[list[int], int]], lora_names: list[str | None] | None = None) -> EngineRun:
    """Add every (prompt ids, output tokens) request to an LLMEngine at t=0, greedy and exactly that many output
    tokens each (request i on LoRA adapter lora_names[i] where given), and step until all are done (the engine-alone
    baselines and perf/bench_*.py)."""
    from trellm_backend.engine.request import SamplingParams
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    first: dict[str, float] = {}
    start = time.perf_counter()
    for i, (ids, n) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                                                       lora_name=lora_names[i] if lora_names else None))
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            first.setdefault(o.request_id, now - start)
    order = [str(i) for i in range(len(requests))]
    return EngineRun([tokens[r] for r in order], [first[r] for r in order], time.perf_counter() - start)
