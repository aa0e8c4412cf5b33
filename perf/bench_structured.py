"""Structured output (issue 28): validity through a real tritonserver, cost in the engine, a heavy guide beside a
light request.

    python perf/bench_structured.py validity [--samples 200]        # starts its own tritonserver, default model
    python perf/bench_structured.py cost [--model hf_models/anchor] # engine alone: 48 sequences, guided vs free
    python perf/bench_structured.py heavy                           # the light request's TTFT beside heavy guides

validity: each guide of tests/test_structured_output.py at temperature 1, `--samples` seeded samples on each entry
point (`ensemble` over gRPC with TRT-LLM's guide tensors, `vllm_model` over HTTP with vLLM's guided_* keys); prints
how many ended by themselves and how many of those parse and validate.
cost: the same 48 prompts decoded free and under one cached JSON schema (each run's decode tok/s; the ratio), the
mask time per step, and the TTFT of one guided request with a cold and with a warm compile cache.
heavy: a request with a guide at the size caps (the largest enum and the deepest schema allowed) sent with a
light one; the light one's TTFT, and the heavy one's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from test_structured_output import GUIDES, check  # noqa: E402
from trellm_backend.engine.config import EngineConfig  # noqa: E402
from trellm_backend.engine.engine import LLMEngine  # noqa: E402
from trellm_backend.engine.request import SamplingParams  # noqa: E402
from trellm_backend.engine.structured_output import Guide  # noqa: E402
from trellm_backend.tools.launch import TritonServer  # noqa: E402
from trellm_backend.tools.testbed import free_ports  # noqa: E402
from trellm_client.client import LLMClient, http_generate  # noqa: E402

PROMPTS = ["Hello", "The answer is", "A list:", "def f(x):", "Once upon a time", "Q: what is it? A:"]
VLLM_KEY = {"json_schema": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
            "ebnf_grammar": "guided_grammar"}


def start_server(work: str) -> TritonServer:
    http, grpc, metrics = free_ports(3)
    server = TritonServer(os.path.join(REPO, "model_repository"), http, grpc, metrics,
                          log_path=os.path.join(work, "server.log"))
    return server.start()


def ensemble_sample(server: TritonServer, guide: Guide, seed: int) -> tuple[str, str]:
    with LLMClient(server.grpc_url) as c:
        chunks = list(c.stream_chunks(PROMPTS[seed % len(PROMPTS)], max_tokens=400, temperature=1.0, seed=seed,
                                      stream=False, exclude_input_in_output=True,
                                      guided_decoding_guide_type=guide.type, guided_decoding_guide=guide.text))
    return "".join(ch.text for ch in chunks), chunks[-1].finish_reason


def vllm_sample(server: TritonServer, guide: Guide, seed: int) -> tuple[str, str]:
    value = json.loads(guide.text) if guide.type in ("json_schema", "choice") else guide.text
    [out] = http_generate(server.http_url, PROMPTS[seed % len(PROMPTS)], "vllm_model", timeout=300,
                          exclude_input_in_output=True, return_finish_reason=True, sampling_parameters=json.dumps(
                              {"temperature": 1.0, "seed": seed, "max_tokens": 400, VLLM_KEY[guide.type]: value}))
    return out["text_output"], out.get("finish_reason", "")


def validity(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    server = start_server(args.out)
    try:
        print(f"{'entry point':<12} {'guide':<13} {'samples':>7} {'ended':>6} {'valid':>6}  wall s")
        for entry, sample in (("ensemble", ensemble_sample), ("vllm_model", vllm_sample)):
            for guide in GUIDES:
                start = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    results = list(pool.map(lambda s: sample(server, guide, s), range(args.samples)))
                ended = [text for text, reason in results if reason == "stop"]
                valid = 0
                for text in ended:
                    try:
                        check(guide, text)
                        valid += 1
                    except Exception as e:  # noqa: BLE001 - counted and shown
                        print(f"  invalid {guide.type}: {text[:80]!r} ({type(e).__name__})")
                print(f"{entry:<12} {guide.type:<13} {len(results):>7} {len(ended):>6} {valid:>6}  "
                      f"{time.perf_counter() - start:.1f}", flush=True)
    finally:
        server.stop()


def decode_rate(engine: LLMEngine, prompts, params_of) -> tuple[float, int, float]:
    """(decode output tok/s, output tokens, seconds of decode-only steps) for the prompts admitted at once."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params_of(i))
    tokens, decode_s = 0, 0.0
    while engine.has_unfinished():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting
        start = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            decode_s += time.perf_counter() - start
            tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens / decode_s, tokens, decode_s


def cost(args) -> None:
    from trellm_backend.triton.tokenization import load_tokenizer
    tok = load_tokenizer(args.model)
    engine = LLMEngine(EngineConfig(model_path=args.model, max_num_seqs=64), tok)
    prompts = [tok(PROMPTS[i % len(PROMPTS)] + f" {i}")["input_ids"] for i in range(args.sequences)]
    # A schema whose strings are long enough that most sequences are still decoding for most of the run.
    schema = {"type": "object", "properties": {"title": {"type": "string", "minLength": 60, "maxLength": 80},
                                               "items": {"type": "array", "items": {"type": "integer"},
                                                         "minItems": 8, "maxItems": 12}},
              "required": ["title", "items"], "additionalProperties": False}
    guide = Guide("json_schema", json.dumps(schema))
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, guide=guide))   # warm-up; compiles the schema
    for rnd in range(args.rounds):
        m0 = (engine.grammars.stats.mask_s, engine.grammars.stats.mask_steps)
        guided = decode_rate(engine, prompts, lambda i: SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                                                       seed=i, guide=guide))
        mask_s = engine.grammars.stats.mask_s - m0[0]
        steps = engine.grammars.stats.mask_steps - m0[1]
        free = decode_rate(engine, prompts, lambda i: SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                                                     seed=i))
        print(f"round {rnd}: {args.sequences} sequences, decode tok/s guided {guided[0]:.1f} ({guided[1]} tokens), "
              f"free {free[0]:.1f} ({free[1]} tokens): guided / free = {guided[0] / free[0]:.3f}; mask fill "
              f"{1000 * mask_s / max(1, steps):.2f} ms per step over {steps} steps", flush=True)
    for label, g in (("cold", Guide("json_schema", json.dumps({**schema, "title": f"fresh {time.time()}"}))),
                     ("warm", guide)):
        start = time.perf_counter()
        engine.add_request(label, prompts[0], SamplingParams(max_tokens=1, guide=g))
        while engine.has_unfinished():
            if engine.step():
                break
        print(f"TTFT of one guided request, {label} compile cache: {1000 * (time.perf_counter() - start):.1f} ms")
        while engine.has_unfinished():
            engine.step()


def heavy(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    server = start_server(args.out)
    enum = {"enum": [f"value number {i:05d} of the list" for i in range(1900)]}    # ~65 KB, at the cap
    deep = {"type": "string", "maxLength": 3}
    for i in range(30):
        deep = {"type": "object", "properties": {f"k{i}": deep}, "required": [f"k{i}"]}
    try:
        for name, schema in (("1900-entry enum", enum), ("30-deep schema", deep)):
            times = {}

            def timed(key, **fields):
                start = time.perf_counter()
                try:
                    with LLMClient(server.grpc_url) as c:
                        for _ in c.stream_chunks("Hello", stream=True, max_tokens=8, **fields):
                            times.setdefault(key, time.perf_counter() - start)
                except Exception as e:  # noqa: BLE001 - shown in the line printed
                    times[key] = float("nan")
                    print(f"  {key}: {e}")
            heavy_t = threading.Thread(target=timed, args=("heavy",), kwargs=dict(
                guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(schema)))
            heavy_t.start()
            time.sleep(0.05)
            timed("light")
            heavy_t.join()
            print(f"{name}: light request TTFT {times['light']:.2f} s, heavy one's {times['heavy']:.2f} s",
                  flush=True)
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["validity", "cost", "heavy"])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "anchor"))
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "structured"))
    args = ap.parse_args()
    {"validity": validity, "cost": cost, "heavy": heavy}[args.part](args)


if __name__ == "__main__":
    main()
