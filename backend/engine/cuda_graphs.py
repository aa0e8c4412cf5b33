"""CUDA graphs of padded decode steps: one per batch-size bucket, captured at load and replayed for each decode step
that fits, over the persistent buffers padded_decode.py fills. A step then costs the host one graph launch instead
of one launch per kernel (vLLM, SGLang and TensorRT-LLM replay decode steps the same way).

A graph fixes every kernel's grid and every Python-side size at capture: attention is captured for the longest
context a request can reach (each row still stops at its own sequence length), and the logits of every row of the
bucket are computed (the padding rows' are dropped). Steps with LoRA adapters, and models with sparse (MoE) layers,
run the padded batch eagerly instead.
"""
from __future__ import annotations

import logging
import time

import torch

from trellm_backend.engine.padded_decode import PaddedDecode

log = logging.getLogger("trellm")


class DecodeGraphs:
    def __init__(self, model, padded: PaddedDecode, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 max_seqlen_k: int):
        self.model, self.padded, self.kv_cache, self.kv_scales = model, padded, kv_cache, kv_scales
        self.max_seqlen_k = max_seqlen_k
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool, side = None, torch.cuda.Stream()
        for size in reversed(padded.buckets):    # the largest first: the smaller ones reuse its memory pool
            padded.host[:size] = padded.pad_row
            padded.rows[:size].copy_(padded.host[:size])
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):         # Triton compiles and tunes outside the capture
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.capture_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        log.info("CUDA graphs: decode batch sizes %s captured in %.1f s, %.0f MiB (enforce_eager=true skips them)",
                 padded.buckets, self.capture_s, self.capture_mib)

    def _forward(self, size: int) -> torch.Tensor:
        ids, meta = self.padded.inputs(size, self.max_seqlen_k)
        return self.model.forward(ids, meta, self.kv_cache, self.padded.cu_seqlens_q[:size], self.kv_scales)

    def replay(self, size: int) -> torch.Tensor:
        """The logits [size, vocab] of the rows the last `fill` wrote (valid until the next replay)."""
        graph, logits = self.graphs[size]
        graph.replay()
        self.replays += 1
        return logits
