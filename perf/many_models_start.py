"""Start a repository of several models again and again, with the cores kept busy, and count what died.

    .venv/bin/python perf/many_models_start.py --starts 10 [--models 3] [--busy 2] [--streams 8]

The repository is what an MLOps team builds with add_model: `--models` copies of the default model, the first two
with three LoRA adapters each, every one with its vllm_model entry, started in the default model-control mode.
Each start waits until the server is ready, then holds it `--hold-s` seconds (with `--streams` streams against the
first model), and reads the server's log for stub deaths ("Segmentation fault", "not healthy", a stub's "Fatal
Python error"). `--busy N` runs N spinning processes meanwhile: a stub crash that races other models' loading
shows under load, not on an idle machine. Prints one line per start and a total; exits 1 if any start had a death
or failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

DEATH_MARKS = ("Segmentation fault", "is not healthy", "Fatal Python error", "Stub process exited")


def build_repository(root: str, models: int, model_path: str) -> list[str]:
    """`models` entries added with add_model under root/repository; the first two with three adapters each."""
    from hf_models import LORAS, make_lora
    from trellm_backend.tools.add_model import add_model
    repo = os.path.join(root, "repository")
    os.makedirs(repo)
    adapters = {n: make_lora(model_path, n, os.path.join(root, "loras", n)) for n in LORAS}
    names = []
    for i in range(models):
        engine = {"kv_cache_bytes": str(64 << 20)}
        if i < 2:
            engine["lora_adapters"] = json.dumps(adapters)
        add_model(f"m{i}", model_path, repo, engine)
        names.append(f"m{i}")
    return names


def deaths_in(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return [line.strip()[:200] for line in f if any(mark in line for mark in DEATH_MARKS)]


def run_streams(url: str, model: str, n: int, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    """n threads each streaming one request after another to `model` until `stop` (HTTP generate_stream)."""
    import urllib.request

    def loop():
        body = json.dumps({"text_input": "The Python language", "max_tokens": 16, "stream": True}).encode()
        while not stop.is_set():
            try:
                req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream", data=body)
                with urllib.request.urlopen(req, timeout=60) as r:
                    answer = r.read()
                counts["ok" if b"text_output" in answer and b'"error"' not in answer else "failed"] += 1
            except Exception:     # counted, not raised: the start's verdict reads the log and the server
                counts["failed"] += 1
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2, help="spinning processes kept running meanwhile")
    ap.add_argument("--streams", type=int, default=0, help="streams against the first model while it is held")
    ap.add_argument("--hold-s", type=float, default=5.0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="for one start to become ready")
    ap.add_argument("--model", default=os.path.join(REPO, "hf_models", "tiny-llama"))
    args = ap.parse_args(argv)
    from trellm_backend.tools.launch import TritonServer
    from trellm_backend.tools.testbed import free_ports
    root = tempfile.mkdtemp(prefix="many-models-")
    names = build_repository(root, args.models, args.model)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    bad = 0
    try:
        for i in range(args.starts):
            log = os.path.join(root, f"server-{i}.log")
            server = TritonServer(os.path.join(root, "repository"), *free_ports(3), log_path=log)
            t0 = time.monotonic()
            error, counts, stop = "", {"ok": 0, "failed": 0}, threading.Event()
            try:
                server.start(timeout=args.timeout_s)
                ready_s = time.monotonic() - t0
                threads = run_streams(server.http_url, names[0], args.streams, stop, counts)
                time.sleep(args.hold_s)
                stop.set()
                for t in threads:
                    t.join(timeout=60)
                if server.proc.poll() is not None:
                    error = f"server exited ({server.proc.returncode})"
            except Exception as e:
                ready_s, error = time.monotonic() - t0, f"{type(e).__name__}: {e}"
            finally:
                server.stop()
            deaths = deaths_in(log)
            bad += bool(deaths or error)
            print(f"start {i + 1}/{args.starts}: ready in {ready_s:.1f} s, {len(deaths)} stub deaths, streams "
                  f"{counts['ok']} ok {counts['failed']} failed{', ' + error if error else ''}"
                  + "".join(f"\n    {d}" for d in deaths[:3]), flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(f"{args.starts} starts of {args.models} models ({len(names) * 5} entries), {args.busy} busy processes: "
          f"{bad} with a stub death or failure (logs in {root})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
