"""Owns the model weights and the KV cache tensor; turns a scheduler output into one forward pass and samples.

Batch preparation works on whole tensors: Python touches each scheduled sequence once, never each token.
"""
from __future__ import annotations

import logging

import torch

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.limits import kv_budget, kv_bytes_per_block, resolve_device_dtype, resolve_kv_cache_dtype
from trellm_backend.models.config import ModelConfig
from trellm_backend.models.llama import AttentionMetadata, LlamaModel
from trellm_backend.engine.sampler import SampledToken, sample
from trellm_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from trellm_backend.engine.structured_output import apply_masks
from trellm_backend.models.lora import AdapterStack, LoraStep, stack_adapters, step_rows
from trellm_backend.models.weights import load_state_dict
from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton
from trellm_kernels.kv_cache import QMAX, SCALE_DTYPE

log = logging.getLogger("trellm")


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 draft_cfg: ModelConfig | None = None):
        """`draft_cfg`: a speculative draft model whose K/V share the pool's blocks (draft.py): each block is sized
        for both, so the same budget holds fewer blocks."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.draft_cfg = draft_cfg
        self.device, self.dtype = resolve_device_dtype(cfg, model_cfg)
        self.kv_dtype = resolve_kv_cache_dtype(cfg, self.dtype)
        if self.device.type == "cpu":
            cpu_ops.load()   # build or load the C++ operators now, at model load, never on a request
        state = load_state_dict(model_cfg.path, self.dtype)
        self.model = LlamaModel(model_cfg, state, self.device, self.dtype, max_model_len, cfg.quantization)
        log.info("linear layers: %s", self.model.linear_paths())
        # The adapter sets of recent steps, stacked: {their ids: (the adapters, their stack)}.
        self._lora_stacks: dict[tuple[int, ...], tuple[tuple, AdapterStack]] = {}
        self.block_size = cfg.block_size
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache, self.kv_scales = allocate_kv_cache(model_cfg, self.num_blocks, self.block_size, self.kv_dtype,
                                                          self.device)
        log.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB, %s on %s", self.num_blocks,
                 self.block_size, self.num_blocks * self.block_size, self.num_blocks * kv_bytes_per_block(
                     model_cfg, self.block_size, self.kv_dtype) / 2**20,
                 str(self.kv_dtype).removeprefix("torch.") + (" (float16 scale per token and head)"
                                                              if self.kv_scales is not None else ""), self.device)

    def _num_kv_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model_cfg, self.block_size, self.kv_dtype, self.draft_cfg)
        budget, setting = kv_budget(self.cfg, self.device, per_block)
        n = budget // per_block
        if n < 1:
            raise ValueError(f"KV cache budget of {budget} bytes ({setting}) holds no block of {per_block} bytes; "
                             "raise kv_cache_bytes (CPU) or gpu_memory_utilization (GPU)")
        return n

    def _lora_step(self, chunks: list[ScheduledChunk], cu: torch.Tensor) -> LoraStep | None:
        groups = _lora_rows(chunks, cu)
        if not groups:
            return None
        if not use_triton(self.kv_cache):   # a CPU: each adapter's term over its rows
            return LoraStep([(adapter, step_rows(ranges, int(cu[-1]), self.device)) for adapter, ranges in groups])
        # The kernels: the step's adapters stacked (kept for the next steps with the same set) and a slot per token.
        # Keyed by the adapter objects, not their names (an adapter replaced under its name is another object; the
        # entry holds them, so their ids stay theirs).
        adapters = tuple(a for a, _ in groups)
        key = tuple(id(a) for a in adapters)
        _, stack = self._lora_stacks.pop(key, None) or (adapters, stack_adapters(list(adapters), self.model_cfg))
        self._lora_stacks[key] = (adapters, stack)
        while len(self._lora_stacks) > 4:
            self._lora_stacks.pop(next(iter(self._lora_stacks)))
        slots = torch.full((int(cu[-1]),), -1, dtype=torch.int32)
        for slot, (_, ranges) in enumerate(groups):
            for start, end in ranges:
                slots[start:end] = slot
        return LoraStep(stack=stack, slots=slots.to(self.device))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        """Run the scheduled chunks; return the sampled tokens of each chunk that samples, in chunk order: one,
        or with guesses one per guess and one after them (the target's own choice at each of those positions).
        `grammar_bitmask` (structured_output.py) masks the sampled rows' logits before any sampling control."""
        chunks = sched.chunks
        ids: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
        meta, cu = attention_metadata([c.start for c in chunks], [c.num_new_tokens for c in chunks],
                                      [c.block_ids for c in chunks], self.block_size, self.device,
                                      [c.rope_long for c in chunks] if self.model.long_rope_from is not None else None)
        # Logits of each sampling chunk's last row, and with guesses of one row per guess before it too.
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        rows = [len(chunks[i].sampling) for i in sampling]
        ends = cu[1:][sampling]
        if sum(rows) == len(sampling):
            logits_indices = ends - 1
        else:
            logits_indices = torch.cat([torch.arange(e - r, e) for e, r in zip(ends.tolist(), rows)])
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        logits = self.model.forward(input_ids, meta, self.kv_cache, logits_indices.to(self.device), self.kv_scales,
                                    self._lora_step(chunks, cu))
        if not sampling:
            return []
        if grammar_bitmask is not None:
            apply_masks(logits, grammar_bitmask, self.model_cfg.vocab_size)
        return sample(logits, [r for c in chunks for r in c.sampling], self.model_cfg.eos_token_ids)


def _lora_rows(chunks: list[ScheduledChunk], cu: torch.Tensor) -> list[tuple[object, list[tuple[int, int]]]]:
    """[(adapter, its requests' [start, end) rows of the flat batch)] for the chunks of LoRA requests (by adapter
    object: requests that started before an adapter was replaced under its name keep the old one)."""
    groups: dict[int, tuple[object, list]] = {}
    bounds = cu.tolist()
    for i, c in enumerate(chunks):
        adapter = c.adapter
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append((bounds[i], bounds[i + 1]))
    return list(groups.values())


def allocate_kv_cache(mc: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in kv_dtype and, for an INT8/FP8
    cache, its scales [num_layers, 2, num_blocks, block_size, num_kv_heads] (float16), else None."""
    shape = (mc.num_layers, 2, num_blocks, block_size, mc.num_kv_heads)
    cache = torch.zeros(*shape, mc.head_dim, dtype=kv_dtype, device=device)
    scales = torch.zeros(*shape, dtype=SCALE_DTYPE, device=device) if kv_dtype in QMAX else None
    return cache, scales


def attention_metadata(starts: list[int], q_lens: list[int], tables: list[list[int]], block_size: int,
                       device: torch.device, rope_long: list[bool] | None = None
                       ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Where each token of a flat batch sits: sequence b runs q_lens[b] tokens from position starts[b], through
    block table tables[b] (with longrope, rotated with the long factors where rope_long[b]). Returns the metadata
    (on `device`) and cu_seqlens_q on the CPU."""
    B, T = len(starts), sum(q_lens)
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    torch.cumsum(q_lens_t, 0, out=cu[1:])
    seq_of_tok = torch.repeat_interleave(torch.arange(B), q_lens_t, output_size=T)
    positions = torch.arange(T, dtype=torch.int32) - cu[:-1][seq_of_tok] + starts_t[seq_of_tok]
    slots = block_tables[seq_of_tok, positions // block_size] * block_size + positions % block_size
    seq_lens = starts_t + q_lens_t
    meta = AttentionMetadata(
        positions=positions.to(device), slot_mapping=slots.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=seq_lens.to(device), block_tables=block_tables.to(device),
        max_seqlen_q=max(q_lens), max_seqlen_k=int(seq_lens.max()),
        rope_long=None if rope_long is None else torch.tensor(rope_long, dtype=torch.bool)[seq_of_tok].to(device))
    return meta, cu

