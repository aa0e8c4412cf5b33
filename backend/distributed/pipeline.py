"""Rank 0's side of a pipeline: the decoder's layers split into stages, stage s a process of its own, on this host or
on others. Rank 0 (the engine's process) is stage 0: it holds the embeddings and the first layers, keeps the scheduler,
the KV block manager and the sampler, and sends every stage each step's plan (the forward's inputs) over a TCP socket.
Hidden states go from stage to stage, and the last stage's logits back to rank 0, over torch.distributed's gloo
backend; its TCPStore at `distributed_init` is where the stages meet.

With `distributed_init` empty, rank 0 starts stages 1..P-1 on this host itself. With it set (tcp://HOST:PORT, HOST an
address of this host the other stages reach), rank 0 waits for them to join: on each other host,
`python -m trellm_backend.distributed.worker --join tcp://HOST:PORT --rank S` with the same model folder.

A lost stage is seen as in tensor parallelism (workers.py): its socket to rank 0 closes when it ends, a transfer
that a stopped stage holds up passes its deadline, and a stage started here is watched as a process.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trellm_backend.distributed.group import GroupFailure
from trellm_backend.models.config import ModelConfigError
from trellm_backend.models.gguf import gguf_file_of
from trellm_backend.distributed.messages import recv_msg, send_msg
from trellm_backend.distributed.workers import WorkerSet, threads_per_rank

log = logging.getLogger("trellm")

JOIN_TIMEOUT_S = 300.0   # for every stage to join
PLAN_PORT_KEY = "trellm/plan_port"


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers stage `stage` of `stages` runs: as even a split as there is, the earlier stages one more."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_holds(name: str, layers: range, num_layers: int, tied: bool) -> bool:
    """Whether the checkpoint's tensor `name` belongs to the stage that runs `layers`."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    if name == "model.embed_tokens.weight":
        return layers.start == 0 or (tied and layers.stop == num_layers)
    if name in ("model.norm.weight", "lm_head.weight"):
        return layers.stop == num_layers
    return True


def check_stages(cfg, stages: int) -> None:
    """Raise ModelConfigError naming what keeps the model (models.config.ModelConfig) from `stages` stages."""
    if cfg.num_layers < stages:
        raise ModelConfigError(f"{os.path.join(cfg.path, 'config.json')}: pipeline_parallel_size={stages} exceeds "
                               f"num_hidden_layers={cfg.num_layers}: every stage runs one layer at least")
    if gguf_file_of(cfg.path) is not None:
        raise ModelConfigError(f"{cfg.path}: pipeline_parallel_size={stages}: GGUF files are not split across "
                               "stages yet; serve it with pipeline_parallel_size 1")


def parse_init(url: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST, PORT); ValueError naming the setting otherwise."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    if not url.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"distributed_init={url!r} must be tcp://HOST:PORT (an address of this host the other "
                         "stages reach, and a free port)")
    return host, int(port)


def gloo_group(store: dist.Store, rank: int, world: int, address: str, timeout_s: float) -> dist.ProcessGroupGloo:
    """The stages' group, this rank's transfers on the interface of `address`."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


class Transfers:
    """A stage's sends and receives of hidden states and logits, each with a deadline."""

    def __init__(self, pg: dist.ProcessGroupGloo, rank: int, timeout_s: float):
        self.pg, self.rank, self.timeout = pg, rank, timedelta(seconds=timeout_s)

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise GroupFailure(f"pipeline {what} on stage {self.rank} failed: {e}") from None

    def isend(self, t: torch.Tensor, to: int, tag: int):
        """Start sending `t` to stage `to`; wait_all ends it (the tensor is kept alive until then)."""
        t = t.contiguous()
        return self.pg.send([t], to, tag), t, to

    def wait_all(self, sends) -> None:
        for work, _, to in sends:
            self._wait(work, f"send to stage {to}")

    def recv(self, shape, dtype: torch.dtype, source: int, tag: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self._wait(self.pg.recv([t], source, tag), f"receive from stage {source}")
        return t


class Pipeline(WorkerSet):
    """Stages 1..P-1, started here or joined from other hosts, each on a TCP socket with rank 0."""
    kind = "pipeline stage"

    def __init__(self, engine_config: dict, max_model_len: int, num_layers: int, timeout_s: float):
        """Start (or wait for) stages 1..P-1 and join the group with them."""
        super().__init__(timeout_s)
        stages = engine_config["pipeline_parallel_size"]
        init = engine_config["distributed_init"]
        host, port = parse_init(init) if init else ("127.0.0.1", 0)
        self.stages = stages
        self._store = dist.TCPStore(host, port, stages, True, timedelta(seconds=JOIN_TIMEOUT_S),
                                    wait_for_workers=False)
        listener = socket.create_server((host, 0))
        self._store.set(PLAN_PORT_KEY, str(listener.getsockname()[1]))
        if not init:
            for s in range(1, stages):
                self._start(s, ["--join", f"tcp://{host}:{self._store.port}", "--rank", str(s)])
        else:
            log.info("pipeline: waiting for stages 1..%d to join at %s", stages - 1, init)
        # the stages started here share this host's cores with rank 0; one that joined has its host's
        self.threads = threads_per_rank(len(self._procs) + 1)
        try:
            self._accept(listener, stages)
        finally:
            listener.close()
        for s, sock in self._socks.items():
            send_msg(sock, {"rank": s, "world": stages, "config": engine_config, "max_model_len": max_model_len,
                            "timeout_s": timeout_s, "threads": self.threads if s in self._procs else None,
                            "layers": tuple(stage_layers(num_layers, stages, s)[i] for i in (0, -1))})
        self.layers = stage_layers(num_layers, stages, 0)
        self.transfers = Transfers(gloo_group(self._store, 0, stages, host, timeout_s), 0, timeout_s)

    def _accept(self, listener: socket.socket, stages: int) -> None:
        listener.settimeout(0.2)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(self._socks) < stages - 1:
            self._check_started("join")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, stages)) - set(self._socks))
                self.close()
                raise RuntimeError(f"pipeline stages {missing} did not join within {JOIN_TIMEOUT_S:.0f} s")
            try:
                sock, address = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(10)
            try:
                first = recv_msg(sock)
            except (OSError, ValueError):   # BadMessage included
                first = None
            sock.settimeout(None)
            rank = first.get("rank") if isinstance(first, dict) else None
            if not isinstance(rank, int) or not 0 < rank < stages or rank in self._socks:
                log.warning("pipeline: refused a connection from %s (rank %r)", address, rank)
                sock.close()
                continue
            self._socks[rank] = sock

    def start(self, num_blocks: int) -> list[int]:
        """Give the stages the KV pool's size, wait until each has its layers and cache; each stage's weight bytes."""
        sizes = self._start_all(num_blocks)
        for s, sock in self._socks.items():
            threading.Thread(target=self._watch_socket, args=(s, sock), daemon=True, name=f"pp-watch-{s}").start()
        return sizes

    def pass_on(self, carried: torch.Tensor, batch: int):
        """Stage 0's hidden states [2, T, hidden] of micro-batch `batch` to stage 1 (sent while stage 0 goes on)."""
        return self.transfers.isend(carried, 1, batch)

    def logits_of(self, batch: int, num_rows: int, vocab: int) -> torch.Tensor:
        """The last stage's logits [num_rows, vocab] of micro-batch `batch`."""
        if not num_rows:
            return torch.empty(0, vocab)
        return self.transfers.recv((num_rows, vocab), torch.float32, self.stages - 1, batch)

    def _watch_socket(self, stage: int, sock: socket.socket) -> None:
        """A stage never writes after its start: anything here is its connection ending (a stage on another host
        that died)."""
        try:
            sock.recv(1)
        except OSError:
            pass
        if not self._closed.is_set():
            self._lost(self._diagnose(settle_s=1.0) or f"pipeline stage {stage}'s connection closed while the group "
                                                        f"was {self.doing}")
