"""Hugging Face transformers on the same model and requests, in three ways: one request at a time (`generate`),
static batches (left-padded, each batch runs until its longest answer is done) and transformers' own continuous
batching (the manager behind `generate_batch`). Every request gets exactly its output length (min = max new
tokens; EOS off in continuous batching), so each run produces the same useful tokens as the server did."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class BaselineResult:
    name: str
    wall_s: float
    output_tokens: int


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def one_at_a_time(model, requests: list[tuple[list[int], int]]) -> BaselineResult:
    import torch
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, n in requests:
            model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return BaselineResult("hf_one_at_a_time", time.perf_counter() - start, sum(n for _, n in requests))


def static_batching(model, requests: list[tuple[list[int], int]], batch_size: int) -> BaselineResult:
    import torch
    pad = model.generation_config.pad_token_id or 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
            n = max(n for _, n in batch)
            model.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad)
    return BaselineResult(f"hf_static_batch{batch_size}", time.perf_counter() - start, sum(n for _, n in requests))


def continuous_batching(model, requests: list[tuple[list[int], int]], max_batch_tokens: int = 2048) -> BaselineResult:
    """`generate_batch` takes one max_new_tokens for all requests; its manager takes one per request, which the
    workload needs, so the manager is driven directly, as generate_batch does."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id,
                              max_new_tokens=max(n for _, n in requests))
    hints = WorkloadHints(max_prompt_length=max(len(ids) for ids, _ in requests),
                          max_generated_length=config.max_new_tokens, num_requests=len(requests))
    # On CPU the cache is otherwise sized from free RAM (GBs of zeros, seconds to allocate): give it room for the
    # whole workload at once, so it never preempts, and the server's token budget per step.
    page = 256
    cb = ContinuousBatchingConfig(page_size=page, max_batch_tokens=max_batch_tokens,
                                  num_blocks=sum(-(-(len(ids) + n) // page) for ids, n in requests) + len(requests))
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   continuous_batching_config=cb, workload_hints=hints) as manager:
        start = time.perf_counter()   # after the manager is set up and warmed up
        for ids, n in requests:
            manager.add_request(ids, max_new_tokens=n, eos_token_id=-1)
        done, produced = 0, 0
        while done < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                done += 1
                produced += len(result.generated_tokens)
        wall = time.perf_counter() - start
    wanted = sum(n for _, n in requests)
    if produced != wanted:
        raise RuntimeError(f"transformers' continuous batching made {produced} tokens, {wanted} were asked for")
    return BaselineResult("hf_continuous_batching", wall, produced)


def run_all(model_dir: str, requests: list[tuple[list[int], int]], static_batch_size: int,
            which: tuple[str, ...] | None = None) -> list[BaselineResult]:
    """The baselines named in `which` (one_at_a_time, static, continuous; None: all three), in that order."""
    model = load(model_dir)
    runs = {"one_at_a_time": lambda: one_at_a_time(model, requests),
            "static": lambda: static_batching(model, requests, static_batch_size),
            "continuous": lambda: continuous_batching(model, requests)}
    results = []
    for name, run in runs.items():
        if which is not None and name not in which:
            continue
        results.append(run())
        r = results[-1]
        print(f"[baseline] {r.name}: {r.output_tokens} tokens in {r.wall_s:.1f} s", file=sys.stderr, flush=True)
    return results
