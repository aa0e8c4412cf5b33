"""What splitting a model across processes costs (backend/distributed/).

    .venv/bin/python perf/bench_parallel.py --collectives          # one all-reduce: gloo's TCP against our region
    .venv/bin/python perf/bench_parallel.py --model hf_models/anchor --split tensor_parallel_size [--users 24]
    .venv/bin/python perf/bench_parallel.py --model hf_models/anchor --split pipeline_parallel_size

--collectives times an all-reduce of [rows, 512] float32 between two processes, gloo's (torch.distributed over TCP
loopback) and the shared-memory region's (distributed/group.py), alternated in the same processes.
--split times decode steps of `--users` sequences split two ways against one process, alternated, and says how much
of a split step rank 0 spent in its own forward and how much waiting for the other ranks (collectives, or the
pipeline's transfers).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def _collectives(rank: int, port: int, region: str, rows_list: list[int], repeats: int, out) -> None:
    import torch.distributed as dist
    from trellm_backend.distributed.group import TensorGroup
    from trellm_backend.models.sharding import Shard
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    group = TensorGroup(region, Shard(rank, 2, 1, 1, 0, 1, 2, 1), 60.0)
    for rows in rows_list:
        x = torch.ones(rows, 512)
        times = {"gloo": 0.0, "region": 0.0}
        for _ in range(3):   # alternated
            for name, call in (("gloo", lambda: pg.allreduce([x]).wait()), ("region", lambda: group.all_reduce(x))):
                for _ in range(20):
                    call()
                start = time.perf_counter()
                for _ in range(repeats):
                    call()
                times[name] += (time.perf_counter() - start) / repeats / 3
        if rank == 0:
            out.put((rows, times))


def collectives(repeats: int) -> None:
    import socket
    from trellm_backend.distributed.group import create_region
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    region = create_region(2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rows_list = [1, 48, 512]
    procs = [ctx.Process(target=_collectives, args=(r, port, region, rows_list, repeats, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for _ in rows_list:
            rows, t = out.get(timeout=600)
            print(f"all-reduce of [{rows}, 512] float32 between 2 processes: gloo {t['gloo'] * 1e6:.0f} us, "
                  f"the shared region {t['region'] * 1e6:.1f} us ({t['gloo'] / t['region']:.0f}x)")
        for p in procs:
            p.join()
    finally:
        os.unlink(region)


def split_steps(model: str, split: str, users: int, steps: int) -> None:
    from trellm_backend.distributed import group as tp_group, pipeline
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    from trellm_backend.engine.request import SamplingParams
    waited = {"s": 0.0}

    def timed(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                waited["s"] += time.perf_counter() - start
        return call
    # rank 0's waits on the others: the region's exchanges, or the pipeline's transfers
    tp_group.TensorGroup._exchange = timed(tp_group.TensorGroup._exchange)
    pipeline.Transfers._wait = timed(pipeline.Transfers._wait)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (32,), generator=g).tolist() for _ in range(users)]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    engines = {1: LLMEngine(EngineConfig(model)), 2: LLMEngine(EngineConfig(model, **{split: 2}))}
    try:
        for n, eng in engines.items():
            eng.generate(prompts[:2], params)   # warm-up
        for run in range(2):
            for n, eng in engines.items():
                forward_s = {"s": 0.0}
                plain = eng.runner.model.forward
                eng.runner.model.forward = lambda *a, **k: _add_time(forward_s, plain, a, k)
                waited["s"] = 0.0
                start = time.perf_counter()
                eng.generate(prompts, params)
                wall = time.perf_counter() - start
                eng.runner.model.forward = plain
                per = steps + 1
                line = f"run {run + 1}, {split}={n}: {wall / per * 1e3:.2f} ms a step"
                if n > 1:
                    line += (f"; rank 0's forward {forward_s['s'] / per * 1e3:.2f} ms, waiting on the others "
                             f"{waited['s'] / per * 1e3:.2f} ms")
                print(line, flush=True)
    finally:
        for eng in engines.values():
            eng.close()


def _add_time(acc: dict, fn, a, k):
    start = time.perf_counter()
    try:
        return fn(*a, **k)
    finally:
        acc["s"] += time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", action="store_true")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--model", default="hf_models/anchor")
    ap.add_argument("--split", choices=("tensor_parallel_size", "pipeline_parallel_size"),
                    default="tensor_parallel_size")
    ap.add_argument("--users", type=int, default=24)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    print(f"cores {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args.collectives:
        collectives(args.repeats)
    else:
        split_steps(args.model, args.split, args.users, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
