"""How close the engine and the served model come to what this host's CPU can do: a roofline per model and dtype.

Why: a tokens-per-second figure alone does not say whether a step is slow because of the hardware or because of
the code. A decode step of one user reads every weight once, so its floor is the bytes it reads over the read
bandwidth of wherever the weights live (memory, or the last-level cache when they fit in it); a decode step of many
users multiplies each weight by a matrix of tokens, so its linear layers' floor is their FLOP over the host's GEMM
peak. Serving adds the cost of Triton, the stubs and the client per token on top of the engine's step.

    .venv/bin/python perf/roofline.py [--models hf_models/anchor,hf_models/medium] \\
        [--dtypes float32,bfloat16,int8,int4] [--served] [--out perf/out/roofline.json]

1. The host's limits, with the threads the engine uses (torch.get_num_threads()): the read bandwidth from memory (a
   tensor several times the last-level cache, summed, the best of a few runs) and from the last-level cache (a
   tensor a quarter of it, summed repeatedly), and the GEMM peak per dtype (torch.mm of large square matrices in
   fp32 and bf16; int8 through oneDNN's quantized GEMM where this CPU runs it, kernels/linear.onednn_runs_w8a8).
2. Per model and dtype, the engine alone (prefill first, then only decode steps timed):
   - 1 user: bytes a step reads (every weight the step reads in the layout it is held in: the layers' linears and
     norms, the final norm and the LM head; the embedding table only as the tied LM head; plus the KV cache read
     for the context) over the step time, against the memory bandwidth, or the cache's when the weights fit in half
     the last-level cache;
   - `--users` users: FLOP of the linear layers (2 x out x in of every linear, the LM head included, per
     token) over the time spent in them (`linear` timed around each call), against the GEMM peak of the dtype the
     multiplications run in (bf16 for bf16; fp32 for fp32, weight-only INT8 and INT4 on the group operator, which
     multiply in fp32; bf16 for INT4 on torch's operator; oneDNN int8 for W8A8); the step's own rate beside it.
3. `--served`: a tritonserver per model and dtype (the launcher's, on a private copy of model_repository/ pointing
   at the model), `--served-requests` streamed requests one at a time over gRPC (ignore_eos, `--max-tokens`
   tokens); the mean inter-token time of the streams, and the serving overhead per token: that time less the
   engine's 1-user decode step.

Dtypes: float32, bfloat16 (the model's dtype, unquantized), int8 (weight-only), int4 (group-wise), w8a8; a
quantized one takes the engine's default activations (float32 on a CPU), or QUANT@DTYPE (int8@bfloat16).
gguf-TYPE (gguf-Q8_0, gguf-Q4_K_M, ...): the model written as a llama.cpp file of that type (tools/write_gguf.py,
under the --out folder) and served from it, its blocks held as they are stored.
The CPU time other processes spent while each part was measured is read from /proc/stat and printed beside it: a
row measured beside other work reads low.

Prints the host, its limits and one table per model (rows: dtypes); writes everything to `--out` as JSON.
A model folder named after a size of backend/tools/default_model.py (anchor, medium) is built when missing.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import time

if __name__ == "__main__":
    from trellm_backend.tools.launch import openmp_wait_defaults
    os.environ.update(openmp_wait_defaults(os.environ))   # the server's OpenMP wait policy, before torch loads

import torch  # noqa: E402

from trellm_kernels import cpu_ops, linear_choice  # noqa: E402
from trellm_kernels.linear import Weight  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = "hf_models/anchor,hf_models/medium"
DEFAULT_DTYPES = "float32,bfloat16,int8,int4"
QUANTIZED = ("int8", "int4", "w8a8")
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


# -- what a step reads and computes ---------------------------------------------------------------------------------
def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor as held (an opaque oneDNN tensor: its elements at its element size)."""
    return 0 if t is None else t.numel() * t.element_size()


def weight_read_tensors(w: Weight) -> list[torch.Tensor]:
    """The tensors `linear` reads for w on a CPU: the one form the weight is held in and its scales."""
    if w.int4 is not None:
        q = w.int4
        if q.groups is not None:         # the group operator's nibbles and its scales and minimums
            parts = [q.groups.q, q.groups.scales]
        elif q.cpu_scales_zeros is not None:
            parts = [q.packed, q.cpu_scales_zeros]
        else:
            parts = [q.packed, q.scales, q.zeros]
        return parts + ([q.perm] if q.perm is not None else [])
    if w.scales is not None:     # INT8 rows or blocks, or W8A8's oneDNN layout
        return [w.qweight if w.qweight is not None else w.prepared, w.scales]
    if w.grouped is not None:    # a GGUF file's blocks: int8 values, scales (and minimums) per group
        return [w.grouped.q, w.grouped.scales] + ([w.grouped.mins] if w.grouped.mins is not None else [])
    return [next(t for t in (w.packed, w.prepared, w.dense) if t is not None)]


def weight_shape(w: Weight) -> tuple[int, int]:
    """(out, in) of a linear weight in whatever form it is held."""
    if w.int4 is not None:
        return w.int4.out_features, w.int4.in_features
    if w.scales is not None:
        held = w.qweight if w.qweight is not None else w.prepared
        return w.scales.shape[0], held.numel() // w.scales.shape[0]
    if w.grouped is not None:
        return w.grouped.out_features, w.grouped.q.numel() // w.grouped.out_features
    if w.packed is not None:     # [out/B, in, B] or [out/B, in/2, B, 2]
        out = w.packed.shape[0] * w.packed.shape[2]
        return out, w.packed.numel() // out
    t = w.dense if w.dense is not None else w.prepared
    return t.shape[0], t.shape[1]


LAYER_LINEARS = ("qkv", "o", "gate_up", "down")
LAYER_TENSORS = ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "qkv_bias",
                 "o_bias", "gate_up_bias", "down_bias")


def linears(model) -> list[Weight]:
    """Every linear weight of a decode step: the layers' four and the LM head (dense layers only)."""
    if any(layer.sparse is not None for layer in model.layers):
        raise ValueError("mixture-of-experts layers: a step reads only the experts its tokens choose, which this "
                         "accounting does not follow")
    return [getattr(layer, site) for layer in model.layers for site in LAYER_LINEARS] + [model.lm_head]


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every linear in its held layout, the norms and biases, the final
    norm. The embedding table is read one row per token, so it counts only as the LM head when tied (lm_head is
    then prepared from it)."""
    total = sum(nbytes(t) for w in linears(model) for t in weight_read_tensors(w))
    total += sum(nbytes(getattr(layer, name)) for layer in model.layers for name in LAYER_TENSORS)
    return total + nbytes(model.norm)


def linear_flop_per_token(model) -> int:
    """FLOP of the linear layers for one token: 2 x out x in of each (the LM head included)."""
    return 2 * sum(math.prod(weight_shape(w)) for w in linears(model))


def linear_flop(model, tokens: int) -> int:
    return linear_flop_per_token(model) * tokens


def kv_bytes_per_token(runner) -> int:
    """Bytes of K and V (and their scales, for an INT8/FP8 cache) of one token over all layers."""
    from trellm_backend.engine.limits import kv_bytes_per_block
    return kv_bytes_per_block(runner.model_cfg, 1, runner.kv_dtype)


# -- the host -------------------------------------------------------------------------------------------------------
def host_info() -> dict:
    """CPU model, the flags that pick the kernels, L3 (lscpu's words) and the last-level cache the tools use."""
    lscpu = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        lscpu = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    except (OSError, subprocess.SubprocessError):
        pass
    flags = set(cpu_ops._cpu_flags().split())
    return {"cpu": lscpu.get("Model name", "").strip() or cpu_ops.cpu_model(),
            "flags": [f for f in SHOWN_FLAGS if f in flags],
            "l3": lscpu.get("L3 cache", "").strip() or "n/a",
            "last_level_cache_bytes": linear_choice.last_level_cache_bytes(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def read_bandwidth(size_bytes: int, rounds: int = 5, round_s: float = 0.05) -> float:
    """Bytes a second that torch's sum reads from an fp32 tensor of `size_bytes`, the best of `rounds` rounds, each
    summing it enough times to take about `round_s` (once, for a tensor larger than the cache)."""
    x = torch.ones(max(1, size_bytes // 4))
    x.sum()
    t = time.perf_counter()
    x.sum()
    reps = max(1, math.ceil(round_s / max(time.perf_counter() - t, 1e-6)))
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            x.sum()
        best = max(best, reps * nbytes(x) / (time.perf_counter() - t))
    return best


def gemm_peak(dtype: str, n: int, rounds: int = 3) -> float | None:
    """FLOP (or int8 operations) a second of an n x n x n GEMM: for float32/bfloat16 torch.mm or the C++ operator on
    a packed weight, whichever is faster; for int8 oneDNN's quantized GEMM as W8A8 calls it (u8 activations with a
    zero point of 128, s8 weights prepacked, fp32 out; signed activations take oneDNN's reference path on some
    hosts, at a thousandth of the rate); None where it does not run here."""
    g = torch.Generator().manual_seed(0)
    if dtype == "int8":
        from trellm_kernels import linear as lin
        if not lin.onednn_runs_w8a8():
            return None
        a = torch.randint(0, 256, (n, n), dtype=torch.uint8, generator=g)
        packed = torch.ops.onednn.qlinear_prepack(torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=g),
                                                  [n, n])
        scales = torch.ones(n)

        def run():
            return torch.ops.onednn.qlinear_pointwise.tensor(a, lin._ONE, lin._U8_ZERO, packed, scales, lin._ZERO,
                                                             None, 1.0, 0, torch.float32, "none", [None], "")
    else:
        a = torch.randn(n, n, generator=g).to(getattr(torch, dtype))
        b = torch.randn(n, n, generator=g).to(a.dtype)
        return 2 * n ** 3 / min(_best_time(run, rounds) for run in [lambda: torch.mm(a, b), *_packed_gemm(a, b)])
    return 2 * n ** 3 / _best_time(run, rounds)


def _packed_gemm(a: torch.Tensor, b: torch.Tensor) -> list:
    """The C++ operator's GEMM of a by b held packed as the engine holds a weight of that dtype, where this host's
    build runs it: on some hosts it is faster than torch's, and the peak is what the host can do."""
    from trellm_kernels import cpu_ops
    from trellm_kernels import linear as lin
    ops = cpu_ops.load()
    if ops is None or (a.dtype == torch.float32 and not ops.avx512):
        return []
    packed = lin.cpp_packing(a.dtype)(b.t().contiguous())
    return [lambda: lin.packed_linear(a, packed, None)]


def _best_time(run, rounds: int) -> float:
    run()
    return min(_timed(run) for _ in range(rounds))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def host_limits(args) -> dict:
    llc = linear_choice.last_level_cache_bytes()
    mem_size = min(max(4 * llc, 256 << 20), 2 << 30)
    limits = {"last_level_cache_bytes": llc, "mem_read_bytes": mem_size, "llc_read_bytes": llc // 4,
              "gemm_n": args.gemm_size}
    with linear_choice.LoadWatch() as load:
        limits["mem_gb_s"] = read_bandwidth(mem_size) / 1e9
        limits["llc_gb_s"] = read_bandwidth(llc // 4) / 1e9 if llc else None
        for name in ("float32", "bfloat16", "int8"):
            peak = gemm_peak(name, args.gemm_size)
            limits[f"{name}_gflop_s"] = None if peak is None else peak / 1e9
    limits["foreign_cores"] = load.foreign_cores
    return limits


# -- the engine -----------------------------------------------------------------------------------------------------
def parse_dtype(name: str) -> tuple[str, str]:
    """A --dtypes entry -> the engine's (dtype, quantization): float32 -> (float32, none), int8 -> (auto, int8),
    int8@bfloat16 -> (bfloat16, int8); gguf-TYPE (the model written as a GGUF file of that type, model_for) ->
    (auto, none)."""
    from trellm_backend.tools.write_gguf import FILE_TYPES
    if name.startswith("gguf-"):
        if name.removeprefix("gguf-") not in FILE_TYPES:
            raise ValueError(f"dtype {name!r}: gguf- takes one of {', '.join(FILE_TYPES)}")
        return "auto", "none"
    quant, _, act = name.partition("@")
    if quant in QUANTIZED:
        return act or "auto", quant
    if act or quant not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name!r}: one of float32, bfloat16, float16, {', '.join(QUANTIZED)} "
                         "(a quantization may take @DTYPE for its activations)")
    return quant, "none"


def peak_for(name: str, dtype: torch.dtype, limits: dict, model=None) -> tuple[str, float | None]:
    """The GEMM peak a row's linear layers are compared with, and its name: the dtype their multiplications run
    in (kernels/linear.py)."""
    quant = parse_dtype(name)[1]
    if quant == "w8a8":
        key = "int8"
    elif quant == "int4":                # the group operator multiplies in fp32, torch's INT4 one in bf16
        in_groups = model is not None and all(w.int4 is None or w.int4.groups is not None for w in linears(model))
        key = "float32" if in_groups else "bfloat16"
    elif quant == "int8":
        key = "float32"                  # the C++ INT8 operator multiplies in fp32 (AVX2 builds: int16 madds)
    else:
        key = "bfloat16" if dtype == torch.bfloat16 else "float32"
    return key, limits.get(f"{key}_gflop_s")


def kv_pool_bytes(model_dir: str, users: int, tokens: int, elem: int) -> int:
    """A KV pool that holds `users` sequences of `tokens` in blocks of up to 128 (the CPU default), with a spare
    block each: large enough for the run, small enough to leave memory alone."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elem
    return users * (math.ceil(tokens / 128) + 1) * 128 * per_token


def extra_tokens(users: int, prompt_len: int, budget: int) -> int:
    """Tokens a request may make beyond the warm and timed steps: those of the steps that prefill the others after
    its own first token (its prompt chunked by the step's token budget), and a few to spare."""
    return math.ceil(users * prompt_len / budget) + 4


def decode_timing(engine, users: int, prompt_len: int, steps: int, warm: int, seed: int,
                  time_linears: bool = False) -> dict:
    """`users` requests of `prompt_len` random tokens: step until every one has its first token (prefill), run
    `warm` decode steps untimed, then time `steps` decode steps of all of them together (the requests are then
    aborted). Returns seconds a step, the mean context a step attended to, and with `time_linears` the seconds a
    step spent in `linear`: timed over `steps` more steps run layer by layer from Python, since within the decode
    stack (models/decode_stack.py) the linears are not Python calls; their operators are the same."""
    import trellm_backend.models.llama as llama
    from trellm_backend.engine.request import SamplingParams
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    extra = extra_tokens(users, prompt_len, engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=warm + steps * (2 if time_linears else 1) + extra, temperature=0.0,
                            ignore_eos=True)
    ids = [f"{seed}-{i}" for i in range(users)]
    for rid in ids:
        engine.add_request(rid, torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    started: set[str] = set()
    while len(started) < users:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    for _ in range(warm):
        engine.step()
    context = [r.num_tokens for r in engine.scheduler.running]
    linear_s = [0.0]
    original = llama.linear

    def timed_linear(*a, **kw):
        t = time.perf_counter()
        r = original(*a, **kw)
        linear_s[0] += time.perf_counter() - t
        return r

    with linear_choice.LoadWatch() as load:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - t
        if time_linears:
            model = engine.runner.model
            stack, model.decode_stack, llama.linear = model.decode_stack, None, timed_linear
            try:
                for _ in range(steps):
                    engine.step()
            finally:
                model.decode_stack, llama.linear = stack, original
    running = len(engine.scheduler.running)
    for rid in ids:
        engine.abort(rid)
    if running != users or len(context) != users:
        raise RuntimeError(f"{users} sequences asked, {running} decoded through the timed steps")
    return {"step_s": elapsed / steps, "context": sum(context) / users + (steps - 1) / 2,
            "linear_s": linear_s[0] / steps if time_linears else None, "foreign_cores": load.foreign_cores}


def model_for(model_dir: str, name: str, out_dir: str) -> str:
    """The folder a row serves: the model's own, or for gguf-TYPE the model written as a GGUF file of that type (by
    tools/write_gguf.py, once, under `out_dir`/gguf/)."""
    if not name.startswith("gguf-"):
        return model_dir
    from trellm_backend.tools.write_gguf import write_gguf_folder
    kind = name.removeprefix("gguf-")
    folder = os.path.join(out_dir, "gguf", f"{os.path.basename(os.path.normpath(model_dir))}-{kind}")
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else write_gguf_folder(model_dir, folder, kind)


def measure_engine(model_dir: str, name: str, args, limits: dict) -> dict:
    """One model in one dtype: load it, time 1 user and `args.users` users, account the bytes and FLOP."""
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    from trellm_backend.engine.request import SamplingParams
    model_dir = model_for(model_dir, name, os.path.dirname(os.path.abspath(args.out)))
    dtype, quant = parse_dtype(name)
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    tokens = args.prompt_len + args.warm_steps + args.steps + extra_tokens(args.users, args.prompt_len, 2048)
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, quantization=quant,
                                    kv_cache_bytes=kv_pool_bytes(model_dir, args.users, tokens, elem),
                                    max_num_seqs=max(64, args.users), max_num_batched_tokens=2048,
                                    enable_prefix_caching=False))
    load_s = time.perf_counter() - t
    runner, model = engine.runner, engine.runner.model
    g = torch.Generator().manual_seed(0)
    engine.generate([torch.randint(10, engine.model_config.vocab_size, (16,), generator=g).tolist()],
                    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))       # warm-up
    weights = weight_bytes_per_step(model)
    kv_token = kv_bytes_per_token(runner)
    one = decode_timing(engine, 1, args.prompt_len, args.steps, args.warm_steps, seed=1)
    many = decode_timing(engine, args.users, args.prompt_len, args.steps, args.warm_steps, seed=2,
                         time_linears=True) if args.users else None
    llc = limits["last_level_cache_bytes"]
    where = "LLC" if llc and limits.get("llc_gb_s") and weights <= llc / 2 else "mem"
    bandwidth = limits["llc_gb_s"] if where == "LLC" else limits["mem_gb_s"]
    step_bytes = weights + one["context"] * kv_token
    row = {"dtype": name, "engine_dtype": str(runner.dtype).removeprefix("torch."), "quantization": quant,
           "load_s": load_s, "linear_paths": model.linear_paths(), "weight_bytes": weights,
           "linear_flop_per_token": linear_flop_per_token(model),
           "kv_bytes_per_token": kv_token, "one_user": {
               **one, "bytes": step_bytes, "gb_s": step_bytes / one["step_s"] / 1e9, "applies": where,
               "bandwidth_gb_s": bandwidth, "fraction": step_bytes / one["step_s"] / 1e9 / bandwidth}}
    if many is not None:
        flop = linear_flop(model, args.users)
        peak_name, peak = peak_for(name, runner.dtype, limits, model)
        gflop_s = flop / many["linear_s"] / 1e9
        row["users"] = {**many, "users": args.users, "linear_flop": flop, "linear_gflop_s": gflop_s,
                        "step_gflop_s": flop / many["step_s"] / 1e9, "peak": peak_name, "peak_gflop_s": peak,
                        "fraction": gflop_s / peak if peak else None}
    del engine, runner, model
    return row


# -- served ---------------------------------------------------------------------------------------------------------
def measure_served(model_dir: str, name: str, args, out_dir: str) -> dict:
    """A tritonserver serving `model_dir` in dtype `name`: the mean inter-token time of `args.served_requests`
    streams sent one at a time (after one unmeasured), each (last token - first token) / (tokens between)."""
    from trellm_backend.tools.launch import TritonServer
    from trellm_backend.tools.testbed import free_ports, private_repository
    import random
    from trellm_client.client import LLMClient
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workload import PromptMaker
    dtype, quant = parse_dtype(name)
    model_dir = model_for(model_dir, name, out_dir)
    folder = os.path.join(out_dir, "roofline-served", re.sub(r"\W", "_", f"{os.path.basename(model_dir)}-{name}"))
    repo = private_repository(os.path.join(REPO, "model_repository"), os.path.join(folder, "model_repository"),
                              {"llm": {"dtype": dtype, "quantization": quant, "enable_prefix_caching": "false"}},
                              model_dir=model_dir)
    maker, rng = PromptMaker(model_dir), random.Random(0)
    prompts = [maker.prompt(rng, args.prompt_len)[0] for _ in range(args.served_requests + 1)]
    server = TritonServer(repo, *free_ports(3), log_path=os.path.join(folder, "server.log"))
    t = time.perf_counter()
    server.start()
    start_s = time.perf_counter() - t
    itls = []
    try:
        with LLMClient(server.grpc_url) as client:
            for i, prompt in enumerate(prompts):
                first = last = None
                n_first = n_last = 0
                for chunk in client.stream_chunks(prompt, stream=True, max_tokens=args.max_tokens, ignore_eos=True,
                                                  return_num_output_tokens=True):
                    now = time.perf_counter()
                    if chunk.num_output_tokens > n_last:
                        if first is None:
                            first, n_first = now, chunk.num_output_tokens
                        last, n_last = now, chunk.num_output_tokens
                if i and first is not None and n_last > n_first:
                    itls.append((last - first) / (n_last - n_first))
    finally:
        server.stop()
    return {"start_s": start_s, "requests": len(itls), "itl_s": sum(itls) / len(itls) if itls else None,
            "log": server.log_path}


# -- the report -----------------------------------------------------------------------------------------------------
def _f(v, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, fmt)


def print_host(host: dict, limits: dict) -> None:
    print(f"host: {host['cpu']}; {' '.join(host['flags']) or 'no AVX2'}; L3 {host['l3']} "
          f"(last-level cache {host['last_level_cache_bytes'] / 2**20:.0f} MiB); {host['threads']} threads; "
          f"torch {host['torch']}")
    print(f"limits: read {limits['mem_gb_s']:.1f} GB/s from memory ({limits['mem_read_bytes'] / 2**20:.0f} MiB), "
          f"{_f(limits['llc_gb_s'], '.1f')} GB/s from the last-level cache "
          f"({limits['llc_read_bytes'] / 2**20:.0f} MiB); GEMM {limits['gemm_n']}^3: fp32 "
          f"{_f(limits['float32_gflop_s'], '.0f')}, bf16 {_f(limits['bfloat16_gflop_s'], '.0f')} GFLOP/s, "
          f"int8 (oneDNN) {_f(limits['int8_gflop_s'], '.0f')} GOP/s; other processes "
          f"{limits['foreign_cores']:.2f} cores")


def columns(users: int) -> tuple[str, ...]:
    return ("dtype", "weights MB", "1u ms", "GB/s", "% bw", f"{users}u ms", "lin ms", "lin GFLOP/s", "% peak", "ITL ms",
            "ovh ms/tok", "other cores")


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        one, many, served = r["one_user"], r.get("users"), r.get("served") or {}
        pct_bw = f"{one['fraction']:.0%} {one['applies']}"
        pct_peak = "n/a" if not many or many["fraction"] is None else f"{many['fraction']:.0%} {many['peak']}"
        foreign = max(one["foreign_cores"], many["foreign_cores"] if many else 0.0)
        out.append([r["dtype"], f"{r['weight_bytes'] / 1e6:.1f}", f"{one['step_s'] * 1e3:.2f}", f"{one['gb_s']:.1f}",
                    pct_bw,
                    _f(many and many["step_s"], ".1f", 1e3), _f(many and many["linear_s"], ".1f", 1e3),
                    _f(many and many["linear_gflop_s"], ".0f"), pct_peak, _f(served.get("itl_s"), ".2f", 1e3),
                    _f(served.get("overhead_s"), ".2f", 1e3),
                    f"{foreign:.2f}" + (" !" if foreign > linear_choice.FOREIGN_CORES_MAX else "")])
    return out


def print_table(model_dir: str, rows: list[dict], users: int) -> None:
    print(f"\n{model_dir}: linear FLOP per token {rows[0]['linear_flop_per_token'] / 1e6:.1f} M")
    cells = [list(columns(users))] + table_rows(rows)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"  weights MB: what a decode step reads of them; 1u: one user's decode step; GB/s: (weights + KV read) / "
          f"step; % bw: of the memory (mem) or last-level cache (LLC) read bandwidth, by where the weights fit; "
          f"{users}u: {users} users' decode step; lin: its time in the linear layers and their FLOP/s; % peak: of the "
          f"GEMM peak of the dtype they multiply in; ITL: served inter-token time; ovh: ITL - 1u; other cores: other "
          f"processes' CPU use while timed (! above {linear_choice.FOREIGN_CORES_MAX})")
    for r in rows:
        print(f"  {r['dtype']} linear layers: {r['linear_paths']}")


def ensure_model(model_dir: str) -> str:
    """The folder (a relative one not found here: under the checkout); one named after a default_model size
    (anchor, medium) is built when missing."""
    from trellm_backend.tools.default_model import DEFAULT_TRAIN_STEPS, MODEL_SIZES, build
    if not os.path.isabs(model_dir) and not os.path.exists(model_dir):
        model_dir = os.path.join(REPO, model_dir)
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return model_dir
    size = os.path.basename(os.path.normpath(model_dir))
    if size not in MODEL_SIZES:
        raise SystemExit(f"{model_dir}: no model.safetensors (build one with "
                         f"`python -m trellm_backend.tools.default_model {model_dir} --size SIZE`)")
    print(f"building {model_dir} (--size {size}, random init)", file=sys.stderr)
    return build(model_dir, DEFAULT_TRAIN_STEPS[size], size=size)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model folders")
    ap.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma-separated: float32, bfloat16, int8, int4, w8a8 "
                    "(QUANT@DTYPE: a quantization with those activations)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each timed sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--warm-steps", type=int, default=2, help="decode steps run untimed after the prefill")
    ap.add_argument("--users", type=int, default=48, help="sequences of the batched decode step (0: none)")
    ap.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n x n GEMMs timed for the peak")
    ap.add_argument("--served", action="store_true", help="also serve each model and dtype through tritonserver")
    ap.add_argument("--served-requests", type=int, default=8, help="streams timed per server (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens of each served stream")
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out", "roofline.json"))
    args = ap.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    args.dtype_list = [d for d in args.dtypes.split(",") if d]
    for name in args.dtype_list:
        try:
            parse_dtype(name)
        except ValueError as e:
            ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    host = host_info()
    limits = host_limits(args)
    print_host(host, limits)
    result = {"host": host, "limits": limits, "settings": {k: v for k, v in vars(args).items()
                                                           if k not in ("model_list", "dtype_list")}, "models": {}}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    for model_dir in args.model_list:
        model_dir = ensure_model(model_dir)
        rows = []
        for name in args.dtype_list:
            row = measure_engine(model_dir, name, args, limits)
            gc.collect()     # the engine's weights and KV pool, before the next one or a server loads
            if args.served:
                served = measure_served(model_dir, name, args, out_dir)
                if served["itl_s"] is not None:
                    served["overhead_s"] = served["itl_s"] - row["one_user"]["step_s"]
                row["served"] = served
            rows.append(row)
        result["models"][model_dir] = rows
        print_table(model_dir, rows, args.users)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
