"""A worker process of a split model: a tensor-parallel rank r of N, started by rank 0 (workers.py) as `python -m
trellm_backend.distributed.worker FD`, FD being its end of a socket to rank 0; or a pipeline stage (pipeline.py),
started by rank 0 or on another host as `... --join tcp://HOST:PORT --rank S`. It joins its group, reads its share of
the weights, allocates its share of the KV cache (the pool's blocks; its K/V heads, or its layers), then runs each
step rank 0 sends until the socket closes. Any error ends it (rank 0 notices: its transfers fail, and its watcher
sees the exit or the closed connection)."""
from __future__ import annotations

import argparse
import logging
import select
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from trellm_backend.distributed.group import GroupFailure, TensorGroup
from trellm_backend.distributed.pipeline import JOIN_TIMEOUT_S, PLAN_PORT_KEY, Transfers, gloo_group, parse_init
from trellm_backend.distributed.messages import recv_msg, send_msg, unpack_step
from trellm_backend.distributed.workers import threads_per_rank
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.forward_inputs import allocate_kv_cache
from trellm_backend.engine.limits import resolve_device_dtype, resolve_kv_cache_dtype
from trellm_backend.engine.runner import load_model
from trellm_backend.models.config import load_model_config
from trellm_backend.models.llama import AttentionMetadata
from trellm_backend.models.lora import LoraStep, load_adapter
from trellm_backend.models.sharding import shard_config, shard_of

log = logging.getLogger("trellm")

POLL_BETWEEN_STEPS_S = 5e-3


def main(argv: list[str]) -> int:
    """`FD`: a tensor-parallel rank on its socket to rank 0; `--join tcp://HOST:PORT --rank S`: pipeline stage S."""
    if argv and argv[0].isdigit():
        return tensor_rank(socket.socket(fileno=int(argv[0])))
    ap = argparse.ArgumentParser(prog="python -m trellm_backend.distributed.worker")
    ap.add_argument("--join", required=True, help="rank 0's distributed_init, tcp://HOST:PORT")
    ap.add_argument("--rank", type=int, required=True, help="this pipeline stage, 1..pipeline_parallel_size-1")
    args = ap.parse_args(argv)
    return pipeline_stage(args.join, args.rank)


def tensor_rank(sock: socket.socket) -> int:
    hello = recv_msg(sock)
    if hello is None:
        return 0
    model_cfg = load_model_config(hello["config"]["model_path"])
    shard = shard_of(model_cfg, hello["rank"], hello["world"])
    group = TensorGroup(hello["region"], shard, hello["timeout_s"])

    def load(cfg, device, dtype):
        return load_model(cfg, model_cfg, hello["max_model_len"], device, dtype, group=group)

    def step(model, cache, scales, batches):
        [(input_ids, meta, rows, lora)] = batches
        model.forward(input_ids, meta, cache, rows, scales, lora)
    return serve(sock, hello, f"rank {hello['rank']}", load, shard_config(model_cfg, shard), shard, step)


def pipeline_stage(url: str, rank: int) -> int:
    host, port = parse_init(url)
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=JOIN_TIMEOUT_S))
    sock = socket.create_connection((host, int(store.get(PLAN_PORT_KEY))))
    send_msg(sock, {"rank": rank})
    hello = recv_msg(sock)
    if hello is None:
        return 0
    world, (first, last) = hello["world"], hello["layers"]
    layers = range(first, last + 1)
    transfers = Transfers(gloo_group(store, rank, world, sock.getsockname()[0], hello["timeout_s"]), rank,
                          hello["timeout_s"])
    model_cfg = load_model_config(hello["config"]["model_path"])

    def load(cfg, device, dtype):
        return load_model(cfg, model_cfg, hello["max_model_len"], device, dtype, layers=layers)

    def step(model, cache, scales, batches):
        """Each micro-batch in turn: its hidden states from the stage before, its layers here, the result on (the
        last stage's logits to rank 0) while the next one is received."""
        sends = []
        for k, (input_ids, meta, rows, lora) in enumerate(batches):
            carried = transfers.recv((2, input_ids.shape[0], model_cfg.hidden_size), model.dtype, rank - 1, k)
            out = model.forward(input_ids, meta, cache, rows, scales, lora, carried=carried)
            if not model.last_stage:
                sends.append(transfers.isend(out, rank + 1, k))
            elif rows.numel():
                sends.append(transfers.isend(out, 0, k))
        transfers.wait_all(sends)
    return serve(sock, hello, f"stage {rank}", load, replace(model_cfg, num_layers=len(layers)), None, step)


def serve(sock: socket.socket, hello: dict, name: str, load, kv_cfg, shard, step) -> int:
    """Load this rank's model (`load`), allocate its KV cache (`kv_cfg`: its heads and layers) with the pool's
    blocks, then run each step rank 0 sends (`step`) until the socket closes."""
    logging.basicConfig(level=logging.INFO, format=f"[trellm {name}] %(message)s")
    threads = hello["threads"] or threads_per_rank(1)
    torch.set_num_threads(threads)
    cfg = EngineConfig(**hello["config"])
    try:
        device, dtype = resolve_device_dtype(cfg, kv_cfg)
        model = load(cfg, device, dtype)
        sizes = recv_msg(sock)
        if sizes is None:
            return 0
        cache, scales = allocate_kv_cache(kv_cfg, sizes["num_blocks"], cfg.block_size,
                                          resolve_kv_cache_dtype(cfg, dtype), device)
    except Exception as e:   # the load error goes to rank 0, whose load fails with it
        log.exception("loading failed")
        send_msg(sock, {"error": f"{type(e).__name__}: {e}"})
        return 1
    send_msg(sock, {"weight_bytes": model.weight_bytes()})
    log.info("ready: %d threads, %.1f MiB of weights", threads, model.weight_bytes() / 2**20)
    adapters = AdapterShards(load_model_config(cfg.model_path), cfg.max_lora_rank, dtype, device, shard)
    with torch.inference_mode():
        while wait_for_step(sock) and (msg := recv_msg(sock)) is not None:
            batches = []
            for packed in msg:
                input_ids, meta, rows, lora = unpack_step(packed, AttentionMetadata)
                batches.append((input_ids, meta, rows, lora and LoraStep([(adapters.get(key), r) for key, r in lora])))
            try:
                step(model, cache, scales, batches)
            except GroupFailure as e:   # another rank is lost: this one cannot go on either
                log.error("%s; exiting", e)
                return 1
    return 0


def wait_for_step(sock: socket.socket) -> bool:
    """Poll for the next step's plan for a while before blocking on it: while requests run, steps follow each other
    closely, and a process woken from a blocking read can start late (a virtual CPU that halted). Returns True (the
    blocking read comes next)."""
    deadline = time.monotonic() + POLL_BETWEEN_STEPS_S
    while time.monotonic() < deadline and not select.select([sock], [], [], 0)[0]:
        pass
    return True


class AdapterShards:
    """This rank's share of the LoRA adapters the steps use, read from their folders on first use, by rank 0's key
    (name, folder, object id: an adapter replaced under its name is read again); the least recently used go first."""
    KEEP = 16

    def __init__(self, model_cfg, max_rank: int, dtype, device, shard):
        self._read = lambda name, path: load_adapter(name, path, model_cfg, max_rank, dtype, device, shard)
        self._held: dict = {}

    def get(self, key):
        adapter = self._held.pop(key, None) or self._read(key[0], key[1])
        self._held[key] = adapter
        while len(self._held) > self.KEEP:
            self._held.pop(next(iter(self._held)))
        return adapter


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
