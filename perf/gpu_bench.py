"""The CUDA path's figures against what the card allows: the figures half of perf/gpu_check.sh.

    python perf/gpu_bench.py --out DIR            # on a GPU: the issue's shapes (a 1.1B-shape bf16 Llama, random)
    python perf/gpu_bench.py --out DIR --dry-run  # on a CPU: the same code on tiny shapes, so it cannot rot

Each section writes its figures into DIR/figures.json as soon as it has them, and an error in one section is
recorded there and does not stop the next, so a run cut short by its time limit still leaves what it measured.
Sections:
- copy: device-to-device copy bandwidth (bytes read + bytes written per second): the card's practical peak.
- decode: engine decode-step time at 1, 8 and 64 sequences against the floor (weight bytes + KV bytes read once,
  at the copy bandwidth), as scheduled and padded to its batch-size bucket (CUDA graphs on a GPU), with a profile
  of one step at batch 1 of each (profile_decode_batches.txt, profile_decode_padded.txt) saying where the time
  goes and how many launches the host makes.
- attention: the paged decode attention kernel at 64 sequences x 2k tokens (bandwidth achieved), beside torch's
  SDPA over the same keys laid out contiguously (and flash_attn's paged kernel when it is installed).
- prefill: engine prompt tokens per second (16 prompts of 1k tokens, max_tokens 1).
- anchor: the anchor profile's 48 requests through the engine (perf/workload.py), output tokens per second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The decode/prefill model on a GPU: TinyLlama-1.1B's shape (22 layers, GQA 4, head_dim 64), random bf16 weights:
# big enough that a decode step reads 2 GB of weights, so its floor is not all launch latency.
GPU_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, max_position_embeddings=4096, vocab_size=32000)
DRY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, vocab_size=320)


class Clock:
    """Wall time of GPU work: synchronizes before reading the clock on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def best_of(self, fn, repeats: int) -> float:
        """Seconds of the fastest of `repeats` calls, after one warm-up call."""
        fn()
        best = float("inf")
        for _ in range(repeats):
            t = self.now()
            fn()
            best = min(best, self.now() - t)
        return best


def make_model(folder: str, shape: dict, dtype: torch.dtype, device: torch.device) -> str:
    """A random-weight Llama folder (config.json + model.safetensors) of `shape`, built on `device` (fast on a GPU)."""
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import transformers
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def weight_bytes_per_step(mc, dtype: torch.dtype) -> int:
    """Bytes of weights a decode step reads: every layer's matrices and norms, the final norm and the LM head (the
    embedding table is read one row per token)."""
    h, i, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    attn = h * d * (mc.num_heads + 2 * mc.num_kv_heads) + mc.num_heads * d * h
    per_layer = attn + 3 * h * i + 2 * h
    return (mc.num_layers * per_layer + h + mc.vocab_size * h) * dtype.itemsize


def section_copy(dev, dry, clock) -> dict:
    n = (1 << 20) if dry else (2 << 30)
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    src.fill_(1)
    s = clock.best_of(lambda: dst.copy_(src), 3 if dry else 10)
    return {"bytes": n, "seconds": s, "copy_GBps": 2 * n / s / 1e9}


def _engine(model_dir, dev, dtype, **kw):
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    mem = dict(kv_cache_bytes=64 << 20) if dev.type == "cpu" else dict(gpu_memory_utilization=0.5)
    return LLMEngine(EngineConfig(model_path=model_dir, device=dev.type, dtype=str(dtype).removeprefix("torch."),
                                  **mem, **kw))


def _prompts(vocab, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def section_decode(dev, dry, clock, model_dir, dtype, copy_GBps, out_dir) -> dict:
    """The decode step as scheduled (`batches`) and padded to its bucket (`padded`: CUDA graphs replayed on a GPU,
    the same inputs run eagerly on a CPU), each against its floor, with a profile of a batch-1 step of each."""
    batches = (1, 2, 4) if dry else (1, 8, 64)
    figures = {}
    for mode, eager in (("batches", True), ("padded", False)):
        t = clock.now()
        engine = _engine(model_dir, dev, dtype, max_num_seqs=max(batches), max_num_batched_tokens=8192,
                         enforce_eager=eager)
        load_s = clock.now() - t
        steps = decode_steps(engine, dev, dry, clock, batches, copy_GBps, out_dir, f"profile_decode_{mode}.txt")
        if eager:
            figures.update(steps)
        else:
            graphs = engine.runner.graphs
            figures["padded"] = {"batches": steps["batches"], "profile": steps.get("profile", {}), "load_s": load_s,
                                 "graphs": graphs is not None, "buckets": engine.runner.padded.buckets,
                                 "replays": graphs.replays if graphs else 0,
                                 "capture_s": graphs.capture_s if graphs else None,
                                 "capture_MiB": graphs.capture_mib if graphs else None}
        del engine
    return figures


def decode_steps(engine, dev, dry, clock, batches, copy_GBps, out_dir, profile_name) -> dict:
    from trellm_backend.engine.request import SamplingParams
    context, timed = (32, 2) if dry else (512, 20)
    mc = engine.model_config
    dtype = engine.runner.dtype
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    weights = weight_bytes_per_step(mc, dtype)
    figures = {"model": {k: getattr(mc, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                       "head_dim", "vocab_size")},
               "dtype": str(dtype), "context": context, "weight_bytes": weights, "batches": {}}
    params = SamplingParams(max_tokens=timed + 16, temperature=0.0, ignore_eos=True)
    for b in batches:
        for i, p in enumerate(_prompts(mc.vocab_size, b, context, seed=b)):
            engine.add_request(f"{b}-{i}", p, params)
        while sum(len(o.new_token_ids) for o in engine.step()) < b:   # until every request decodes
            pass
        for _ in range(3):     # a new batch size compiles its attention variant and picks its GEMMs: not timed
            engine.step()
        t = clock.now()
        for _ in range(timed):
            engine.step()
        step = (clock.now() - t) / timed
        floor = (weights + b * (context + timed) * kv_per_token) / (copy_GBps * 1e9)
        figures["batches"][str(b)] = {"step_ms": step * 1e3, "floor_ms": floor * 1e3, "x_floor": step / floor,
                                      "tok_per_s": b / step}
        if b == batches[0]:
            try:
                figures["profile"] = profile_step(engine, dev, out_dir, step, profile_name)
            except Exception:   # noqa: BLE001 -- the profile explains the figures; losing it must not lose them
                figures["profile"] = {"error": traceback.format_exc()}
        for i in range(b):
            engine.abort(f"{b}-{i}")
    return figures


def profile_step(engine, dev, out_dir, step_s, name: str) -> dict:
    """Profile one decode step: the kernels' summed GPU time against the step's wall time says whether the step
    waits on the GPU or on the host (Python, launches, the sampler's copy back); launches counts the host's kernel
    and graph launch calls."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.step()
    avg = prof.key_averages()
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    # The host's side of the same kind of step, by Python function: what the GPU waits on when its busy share is low.
    import cProfile
    import io
    import pstats
    host = cProfile.Profile()
    host.runcall(engine.step)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(avg.table(sort_by=sort, row_limit=25))
        f.write("\n\nOne more step under cProfile (host time by Python function, by own time):\n" + text.getvalue())
    if dev.type != "cuda":
        return {}
    gpu_us = sum(e.self_device_time_total for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CPU
                   and ("LaunchKernel" in e.key or "GraphLaunch" in e.key))
    return {"gpu_busy_ms": gpu_us / 1e3, "gpu_busy_share": gpu_us / 1e6 / step_s, "kernels_per_step": kernels,
            "launches_per_step": launches}


def section_attention(dev, dry, clock, copy_GBps) -> dict:
    from trellm_kernels import attention
    from trellm_kernels.triton_attention import paged_attention_triton
    B, T, H, KVH, D, bs = (4, 64, 4, 2, 16, 16) if dry else (64, 2048, 32, 8, 128, 16)
    dtype = torch.float32 if dry else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = B * T // bs
    k_cache = torch.randn(blocks, bs, KVH, D, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(blocks, bs, KVH, D, generator=g, device=dev).to(dtype)
    tables = torch.randperm(blocks, generator=g, device=dev).to(torch.int32).view(B, T // bs)
    q = torch.randn(B, H, D, generator=g, device=dev).to(dtype)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    lens = torch.full((B,), T, dtype=torch.int32, device=dev)
    args = (q, k_cache, v_cache, cu, lens, tables, D ** -0.5, 1, T)
    ours = paged_attention_triton(*args)
    torch.testing.assert_close(ours.float(), attention.paged_attention_reference(*args).float(), atol=2e-2, rtol=2e-2)
    kv_bytes = 2 * B * T * KVH * D * dtype.itemsize
    s = clock.best_of(lambda: paged_attention_triton(*args), 3 if dry else 20)
    figures = {"shape": dict(seqs=B, tokens=T, heads=H, kv_heads=KVH, head_dim=D, block_size=bs, dtype=str(dtype)),
               "kv_bytes": kv_bytes, "triton_ms": s * 1e3, "triton_GBps": kv_bytes / s / 1e9,
               "triton_share_of_copy": kv_bytes / s / 1e9 / copy_GBps}
    # torch's SDPA over the same keys, contiguous [B, KVH, T, D] (no paging): what a dense kernel reads at.
    k = k_cache[tables.long()].reshape(B, T, KVH, D).transpose(1, 2).contiguous()
    v = v_cache[tables.long()].reshape(B, T, KVH, D).transpose(1, 2).contiguous()
    qd = q.view(B, H, 1, D)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=True)  # noqa: E731
    torch.testing.assert_close(sdpa().view(B, H, D).float(), ours.float(), atol=2e-2, rtol=2e-2)
    s = clock.best_of(sdpa, 3 if dry else 20)
    figures.update(sdpa_ms=s * 1e3, sdpa_GBps=kv_bytes / s / 1e9)
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        figures["flash_attn"] = "not installed"
    else:
        fa = lambda: flash_attn_with_kvcache(q.view(B, 1, H, D), k_cache, v_cache, cache_seqlens=lens,  # noqa: E731
                                             block_table=tables)
        s = clock.best_of(fa, 20)
        figures.update(flash_attn_ms=s * 1e3, flash_attn_GBps=kv_bytes / s / 1e9)
    return figures


def section_prefill(dev, dry, clock, model_dir, dtype) -> dict:
    from trellm_backend.engine.request import SamplingParams
    n, length = (2, 48) if dry else (16, 1024)
    engine = _engine(model_dir, dev, dtype, max_num_batched_tokens=8192, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(_prompts(engine.model_config.vocab_size, 2, 16, seed=99), one)        # warm-up
    prompts = _prompts(engine.model_config.vocab_size, n, length)
    t = clock.now()
    engine.generate(prompts, one)
    s = clock.now() - t
    return {"prompts": n, "prompt_tokens": length, "seconds": s, "prompt_tok_per_s": n * length / s}


def section_anchor(dev, dry, model_dir, dtype) -> dict:
    from workload import PromptMaker, make_items, profiles, run_at_once
    profile = profiles(smoke=dry)["anchor"]
    n = profile.requests_per_level[0]
    items = make_items(PromptMaker(model_dir), profile, n, 0)
    engine = _engine(model_dir, dev, dtype, enable_prefix_caching=False)   # the warm-up must not cache the prompts
    work = [(it.prompt_ids, it.output_tokens) for it in items]
    # Warm-up: the whole workload once, untimed. On a bare machine its batch sizes and chunk lengths compile Triton
    # variants one by one, and a short warm-up left that inside the timed run (711 against 2972 out tok/s warm).
    run_at_once(engine, work)
    run = run_at_once(engine, work)
    ttft = sorted(run.first_token_s)
    return {"requests": n, "dtype": str(dtype), "output_tokens": run.output_tokens, "seconds": run.wall_s,
            "out_tok_per_s": run.output_tokens / run.wall_s, "ttft_mean_s": sum(ttft) / len(ttft)}


def profile_lines(p: dict, name: str) -> list[str]:
    if "error" in p:
        return [f"  - batch-1 step profile FAILED: {p['error'].strip().splitlines()[-1]}"]
    if not p:
        return []
    return [f"  - batch-1 step profile: GPU busy {p['gpu_busy_ms']:.2f} ms ({p['gpu_busy_share']:.0%} of the step), "
            f"{p['kernels_per_step']} kernels, {p['launches_per_step']} launches from the host ({name})"]


def summarize(out_dir: str) -> str:
    """perf/gpu_check.sh's summary.md: each step's status and test counts, then the figures, as markdown."""
    def read(name):
        path = os.path.join(out_dir, name)
        return open(path).read() if os.path.isfile(path) else ""

    env = [line for line in read("env.txt").splitlines() if line.startswith(("python", "NVIDIA", "cpu"))
           or "sm_" in line]
    lines = ["# GPU check", "", *[f"    {line}" for line in env], "", "| step | exit | seconds | result |",
             "|---|---|---|---|"]
    for row in read("status.txt").splitlines():
        name, rc, secs = row.split()
        log = read(f"{name}.log").strip().splitlines()
        lines.append(f"| {name} | {rc}{' (time limit)' if rc in ('124', '137') else ''} | {secs} | "
                     f"{log[-1] if log else ''} |")
    fig = json.loads(read("figures.json") or "{}")
    lines += ["", f"Figures ({fig.get('device', '?')}{', dry run' if fig.get('dry_run') else ''}):", ""]
    if "copy" in fig:
        lines.append(f"- device-to-device copy: {fig['copy']['copy_GBps']:.0f} GB/s (read + write)")
    if "decode" in fig:
        d = fig["decode"]
        m = d["model"]
        lines.append(f"- decode step, {m['num_layers']} layers x {m['hidden_size']} ({d['dtype']}, "
                     f"{d['weight_bytes'] / 1e9:.2f} GB of weights), {d['context']}-token contexts:")
        lines += [f"  - batch {b}: {v['step_ms']:.2f} ms (floor {v['floor_ms']:.2f} ms, {v['x_floor']:.1f}x), "
                  f"{v['tok_per_s']:.0f} tok/s" for b, v in d["batches"].items()]
        lines += profile_lines(d.get("profile", {}), "profile_decode_batches.txt")
        if "padded" in d:
            g = d["padded"]
            how = (f"CUDA graphs of {len(g['buckets'])} batch sizes, captured in {g['capture_s']:.1f} s, "
                   f"{g['capture_MiB']:.0f} MiB, {g['replays']} replays" if g["graphs"] else "run eagerly")
            lines.append(f"- decode step padded to its bucket ({how}; engine load {g['load_s']:.1f} s):")
            lines += [f"  - batch {b}: {v['step_ms']:.2f} ms ({v['x_floor']:.1f}x floor), {v['tok_per_s']:.0f} tok/s"
                      for b, v in g["batches"].items()]
            lines += profile_lines(g.get("profile", {}), "profile_decode_padded.txt")
    if "attention" in fig:
        a = fig["attention"]
        sh = a["shape"]
        fa = (f", flash_attn {a['flash_attn_GBps']:.0f} GB/s" if "flash_attn_GBps" in a
              else f", flash_attn {a.get('flash_attn')}")
        lines.append(f"- decode attention, {sh['seqs']} seqs x {sh['tokens']} tokens, {sh['heads']}/{sh['kv_heads']} "
                     f"heads x {sh['head_dim']}: Triton {a['triton_ms']:.3f} ms = {a['triton_GBps']:.0f} GB/s "
                     f"({a['triton_share_of_copy']:.0%} of copy); SDPA contiguous {a['sdpa_GBps']:.0f} GB/s{fa}")
    if "prefill" in fig:
        p = fig["prefill"]
        lines.append(f"- prefill: {p['prompts']} x {p['prompt_tokens']} tokens, {p['prompt_tok_per_s']:.0f} tok/s")
    if "anchor" in fig:
        a = fig["anchor"]
        lines.append(f"- anchor profile through the engine ({a['requests']} requests, {a['dtype']}): "
                     f"{a['out_tok_per_s']:.0f} out tok/s, mean TTFT {a['ttft_mean_s']:.2f} s")
    for name, err in fig.get("errors", {}).items():
        lines.append(f"- {name} FAILED: {err.strip().splitlines()[-1]}")
    served = json.loads(read(os.path.join("served", "benchmark.json")) or "{}")
    if served.get("levels"):
        lv, others = served["levels"][0], served.get("other_entry_points", {})
        alone = next((b for b in served.get("baselines", []) if b["name"] == "engine_alone"), None)
        parts = [f"ensemble {lv['output_tok_s']:.0f} out tok/s (TTFT p50 {lv['ttft_ms']['p50']:.0f} ms, ITL p50 "
                 f"{lv['itl_ms']['p50']:.2f} ms)"]
        parts += [f"{m} {o[0]['output_tok_s']:.0f}" for m, o in others.items() if o]
        if alone is not None:
            parts.append(f"engine alone {alone['output_tok_s']:.0f}; ensemble / engine alone "
                         f"{lv['output_tok_s'] / alone['output_tok_s']:.2f}")
        lines.append(f"- served by tritonserver, the {lv['profile']} profile ({lv['requests']} requests, "
                     f"{lv['errors']} errors): " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", metavar="DIR", help="print perf/gpu_check.sh's summary of DIR and exit")
    ap.add_argument("--out", help="folder for figures.json and the decode profiles")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on whatever device is there (CPU in CI)")
    ap.add_argument("--models", default=None, help="where to build the benchmark models (default: OUT/models)")
    ap.add_argument("--anchor-model", default=None, help="the anchor model folder (default: built in --models)")
    ap.add_argument("--only", default=None, help="comma-separated sections to run")
    args = ap.parse_args()
    if args.summarize:
        return print(summarize(args.summarize), end="")
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = args.dry_run
    clock = Clock(dev)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    models = args.models or os.path.join(args.out, "models")
    figures = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dry_run": dry,
               "errors": {}}
    path = os.path.join(args.out, "figures.json")

    def run(name, fn):
        if args.only and name not in args.only.split(","):
            return
        t = time.perf_counter()
        try:
            figures[name] = fn()
            figures[name]["section_s"] = round(time.perf_counter() - t, 1)
        except Exception:   # noqa: BLE001 -- one section's failure is recorded; the others still measure
            figures["errors"][name] = traceback.format_exc()
            print(f"[gpu_bench] {name} failed:\n{figures['errors'][name]}", file=sys.stderr, flush=True)
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"[gpu_bench] {name}: {json.dumps(figures.get(name), default=str)[:400]}", flush=True)

    run("copy", lambda: section_copy(dev, dry, clock))
    copy_GBps = figures.get("copy", {}).get("copy_GBps", 1.0)
    model_dir = make_model(os.path.join(models, "dry" if dry else "llama-1b-shape"), DRY_MODEL if dry else GPU_MODEL,
                           dtype, dev)
    run("decode", lambda: section_decode(dev, dry, clock, model_dir, dtype, copy_GBps, args.out))
    run("attention", lambda: section_attention(dev, dry, clock, copy_GBps))
    run("prefill", lambda: section_prefill(dev, dry, clock, model_dir, dtype))

    def anchor():
        folder = args.anchor_model
        if folder is None:
            from trellm_backend.tools.default_model import build
            folder = build(os.path.join(models, "tiny" if dry else "anchor"), train_steps=0,
                           size="tiny" if dry else "anchor")
        return section_anchor(dev, dry, folder, dtype)
    run("anchor", anchor)
    print(f"[gpu_bench] done: {len(figures['errors'])} section(s) failed"
          + (f" ({', '.join(figures['errors'])})" if figures["errors"] else ""))
    sys.exit(1 if figures["errors"] else 0)


if __name__ == "__main__":
    main()
