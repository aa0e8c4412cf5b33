"""A tensor-parallel worker: rank r of N, started by rank 0 (workers.py) as `python -m
trellm_backend.distributed.worker FD`, FD being its end of a socket to rank 0. It joins the group, reads its share of
the weights, allocates its share of the KV cache (the pool's blocks, its K/V heads), then runs each step rank 0 sends
until the socket closes. Any error ends it (rank 0 notices: its collectives fail and its watcher sees the exit)."""
from __future__ import annotations

import logging
import select
import socket
import sys
import time

import torch

from trellm_backend.distributed.group import GroupFailure, TensorGroup
from trellm_backend.distributed.workers import recv_msg, send_msg, unpack_step
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.forward_inputs import allocate_kv_cache
from trellm_backend.engine.limits import resolve_device_dtype, resolve_kv_cache_dtype
from trellm_backend.engine.runner import load_rank_model
from trellm_backend.models.config import load_model_config
from trellm_backend.models.llama import AttentionMetadata
from trellm_backend.models.lora import LoraStep, load_adapter
from trellm_backend.models.sharding import shard_config, shard_of

log = logging.getLogger("trellm")

POLL_BETWEEN_STEPS_S = 5e-3


def main(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    hello = recv_msg(sock)
    if hello is None:
        return 0
    rank = hello["rank"]
    logging.basicConfig(level=logging.INFO, format=f"[trellm rank {rank}] %(message)s")
    torch.set_num_threads(hello["threads"])
    cfg = EngineConfig(**hello["config"])
    model_cfg = load_model_config(cfg.model_path)
    shard = shard_of(model_cfg, rank, hello["world"])
    group = TensorGroup(hello["region"], shard, hello["timeout_s"])
    try:
        device, dtype = resolve_device_dtype(cfg, model_cfg)
        model = load_rank_model(cfg, model_cfg, hello["max_model_len"], device, dtype, group)
        sizes = recv_msg(sock)
        if sizes is None:
            return 0
        cache, scales = allocate_kv_cache(shard_config(model_cfg, shard), sizes["num_blocks"], cfg.block_size,
                                          resolve_kv_cache_dtype(cfg, dtype), device)
    except Exception as e:   # the load error goes to rank 0, whose load fails with it
        log.exception("loading failed")
        send_msg(sock, {"error": f"{type(e).__name__}: {e}"})
        return 1
    send_msg(sock, {"weight_bytes": model.weight_bytes()})
    log.info("ready: %d threads, %.1f MiB of weights", hello["threads"], model.weight_bytes() / 2**20)
    adapters = AdapterShards(model_cfg, cfg.max_lora_rank, dtype, device, shard)
    with torch.inference_mode():
        while wait_for_step(sock) and (msg := recv_msg(sock)) is not None:
            input_ids, meta, rows, lora = unpack_step(msg, AttentionMetadata)
            lora = lora and LoraStep([(adapters.get(key), rows) for key, rows in lora])
            try:
                model.forward(input_ids, meta, cache, rows, scales, lora)
            except GroupFailure as e:   # another rank is lost: this one cannot go on either
                log.error("%s; exiting", e)
                return 1
    return 0


def wait_for_step(sock: socket.socket) -> bool:
    """Poll for the next step's plan for a while before blocking on it: steps follow each other within a
    millisecond or two while requests run, and a process woken from a blocking read can start that much later (a
    virtual CPU that halted). Returns True (the blocking read comes next)."""
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
    sys.exit(main(int(sys.argv[1])))
