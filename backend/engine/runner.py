"""Owns the model work of a step: the weights, the KV cache tensor, the forward pass, sampling, the verdict on
speculative guesses and the proposer of the next ones (vLLM v1's shape: the scheduler plans, the runner runs, the
scheduler applies the outcome in one place, update_from_output).

Batch preparation works on whole tensors: Python touches each scheduled sequence once, never each token. With
speculation the runner keeps a record of each running request's tokens, updated from each step's chunks and
samples, which is what its proposer reads; the scheduler's `reset_ids` say which records are void.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field, replace

import torch

from trellm_backend.distributed.group import GroupFailure, TensorGroup
from trellm_backend.distributed.pipeline import Pipeline, check_stages, stage_holds
from trellm_backend.distributed.workers import Workers, threads_per_rank
from trellm_backend.engine.block_tables import BlockTables
from trellm_backend.engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from trellm_backend.engine.draft import DraftModelProposer
from trellm_backend.engine.forward_inputs import StepInputs, allocate_kv_cache
from trellm_backend.engine.kv_cache_manager import blocks_for
from trellm_backend.engine.cuda_graphs import DecodeGraphs
from trellm_backend.engine.padded_decode import PaddedDecode
from trellm_backend.engine.limits import kv_budget, kv_bytes_per_block, resolve_device_dtype, resolve_kv_cache_dtype
from trellm_backend.models.config import ModelConfig
from trellm_backend.models.llama import LlamaModel
from trellm_backend.engine.proposers import NgramProposer, ProposalInput, Proposer
from trellm_backend.engine.sampler import SampledToken, num_accepted, sample
from trellm_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from trellm_backend.engine.structured_output import apply_masks
from trellm_backend.models.lora import AdapterStack, LoraStep, stack_adapters, step_rows
from trellm_backend.models.sharding import shard_config, shard_of, shard_tensor, splits_inputs
from trellm_backend.models.weights import load_state_dict
from trellm_kernels import cpu_ops
from trellm_kernels.dispatch import use_triton

log = logging.getLogger("trellm")


@dataclass
class RunnerOutput:
    """What one step yields, for the scheduler to apply (Scheduler.update_from_output): for each chunk that samples
    (in chunk order) its tokens, the guesses the target agreed with and the target's own token after them; and the
    guesses proposed for the next step, by request id."""
    sampled: list[list[SampledToken]] = field(default_factory=list)
    guesses: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 draft_cfg: ModelConfig | None = None):
        """`draft_cfg`: a speculative draft model whose K/V share the pool's blocks (draft.py): each block is sized
        for both, so the same budget holds fewer blocks. It proposes when speculative_method is draft."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.draft_cfg = draft_cfg
        self.device, self.dtype = resolve_device_dtype(cfg, model_cfg)
        self.kv_dtype = resolve_kv_cache_dtype(cfg, self.dtype)
        # Split across processes: with tensor parallelism this rank's share of every layer (rank 0) and the workers
        # that hold the others; with a pipeline the stages after this one (stage 0).
        self.shard = shard_of(model_cfg, 0, cfg.tensor_parallel_size) if cfg.tensor_parallel_size > 1 else None
        self.pipeline = cfg.pipeline_parallel_size > 1
        self.workers = self._start_workers(max_model_len) if self.shard is not None or self.pipeline else None
        self.model = load_model(cfg, model_cfg, max_model_len, self.device, self.dtype,
                                group=self.workers.group if self.shard is not None else None,
                                layers=self.workers.layers if self.pipeline else None)
        log.info("linear layers: %s", self.model.linear_paths())
        if self.device.type == "cpu":
            log.info("short steps: %s", "the layers in one C++ call (models/decode_stack.py)"
                     if self.model.decode_stack is not None else "layer by layer from Python")
        # The adapter sets of recent steps, stacked: {their ids: (the adapters, their stack)}.
        self._lora_stacks: dict[tuple[int, ...], tuple[tuple, AdapterStack]] = {}
        self.block_size = cfg.block_size
        self.num_blocks = self._num_kv_blocks()
        # Padded decode steps write their padding rows into a scratch block past the managed ones.
        scratch = 0 if cfg.enforce_eager else 1
        # the K/V heads and layers this process holds
        kv_cfg = replace(self.model.cfg, num_layers=len(self.model.layer_ids))
        self.kv_cache, self.kv_scales = allocate_kv_cache(kv_cfg, self.num_blocks + scratch, self.block_size,
                                                          self.kv_dtype, self.device)
        log.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB%s, %s on %s", self.num_blocks,
                 self.block_size, self.num_blocks * self.block_size, self.num_blocks * kv_bytes_per_block(
                     kv_cfg, self.block_size, self.kv_dtype) / 2**20, " a rank" if self.workers else "",
                 str(self.kv_dtype).removeprefix("torch.") + (" (float16 scale per token and head)"
                                                              if self.kv_scales is not None else ""), self.device)
        if self.workers is not None:
            sizes = [self.model.weight_bytes()] + self.workers.start(self.num_blocks + scratch)
            log.info("%s: %d ranks, rank 0 with %d threads, weights %s MiB a rank (%.1f MiB together)",
                     "pipeline" if self.pipeline else "tensor parallel", len(sizes), torch.get_num_threads(),
                     ", ".join(f"{b / 2**20:.1f}" for b in sizes), sum(sizes) / 2**20)
        self.proposer = self._proposer(max_model_len)
        self.token_ids: dict[str, list[int]] = {}   # with a proposer: each running request's tokens
        self.block_tables = BlockTables(cfg.max_num_seqs, blocks_for(max_model_len, self.block_size))
        # one per micro-batch of a pipeline's step (their tensors live until the step ends); one elsewhere
        self.inputs_of_batch = [StepInputs(self.device) for _ in range(cfg.pipeline_parallel_size)]
        self.padded = None if cfg.enforce_eager or self.model.long_rope_from is not None else PaddedDecode(
            cfg.max_num_seqs, blocks_for(max_model_len + MAX_SPECULATIVE_TOKENS, self.block_size) + 1,
            self.num_blocks, self.block_size, self.device)
        self.graphs = None
        if self.padded is not None and self.device.type == "cuda" and not self.model.has_sparse_layers():
            self.graphs = DecodeGraphs(self.model, self.padded, self.kv_cache, self.kv_scales,
                                       self.padded.max_blocks * self.block_size)

    def _start_workers(self, max_model_len: int) -> Workers | Pipeline:
        """Ranks 1..N-1 of a tensor-parallel group, or the pipeline's stages 1..P-1, started (or joined) and
        connected; they read their weights meanwhile."""
        cfg = self.cfg
        if self.device.type != "cpu":
            raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size}, pipeline_parallel_size="
                             f"{cfg.pipeline_parallel_size}: a split model runs on CPU processes only so far; "
                             f"device={cfg.device!r} resolved to {self.device}")
        if self.pipeline:
            check_stages(self.model_cfg, cfg.pipeline_parallel_size)
            stages = Pipeline(dataclasses.asdict(cfg), max_model_len, self.model_cfg.num_layers,
                              cfg.parallel_timeout_s)
            torch.set_num_threads(stages.threads)
            return stages
        torch.set_num_threads(threads_per_rank(cfg.tensor_parallel_size))
        return Workers(dataclasses.asdict(cfg), self.shard, max_model_len, cfg.parallel_timeout_s)

    def close(self) -> None:
        """End the workers of a split model (tensor-parallel ranks or pipeline stages), if any."""
        if self.workers is not None:
            self.workers.close()

    def _forward(self, *batches: tuple) -> torch.Tensor:
        """The model's forward over this step's inputs, `batches` of (input_ids, meta, logits_indices, lora): the
        logits of every batch's selected rows, in order. With tensor parallelism (one batch) the workers are sent the
        same inputs first and run their shares alongside. A pipeline takes the step in micro-batches: stage 0 runs
        each and passes its hidden states on, so the next stage works on one while stage 0 runs the next, and the
        last stage's logits come back."""
        if self.workers is None:
            [(input_ids, meta, rows, lora)] = batches
            return self.model.forward(input_ids, meta, self.kv_cache, rows, self.kv_scales, lora)
        self.workers.send_step(batches)
        try:
            if self.pipeline:
                sends = [self.workers.pass_on(self.model.forward(ids, meta, self.kv_cache, rows, self.kv_scales, lora),
                                              k) for k, (ids, meta, rows, lora) in enumerate(batches)]
                logits = torch.cat([self.workers.logits_of(k, len(rows), self.model_cfg.vocab_size)
                                    for k, (_, _, rows, _) in enumerate(batches)])
                self.workers.transfers.wait_all(sends)
            else:
                [(input_ids, meta, rows, lora)] = batches
                logits = self.model.forward(input_ids, meta, self.kv_cache, rows, self.kv_scales, lora)
        except GroupFailure as e:
            raise self.workers.step_failed(e) from None
        self.workers.step_done()
        return logits

    def _proposer(self, max_model_len: int) -> Proposer | None:
        cfg = self.cfg
        if cfg.speculative_method == "ngram":
            return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if cfg.speculative_method == "draft":
            return DraftModelProposer(self.draft_cfg, self.num_blocks, self.block_size, self.device, self.dtype,
                                      max_model_len, kv_dtype=self.kv_dtype)
        return None

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
    def execute(self, sched: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None) -> RunnerOutput:
        """Run the scheduled chunks, sample, keep the guesses the target agrees with, and propose the next ones.
        `grammar_bitmask` (structured_output.py) masks the sampled rows' logits before any sampling control."""
        for rid in sched.reset_ids:
            self.token_ids.pop(rid, None)
            self.block_tables.release(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)
        chunks = sched.chunks
        if not chunks:
            return RunnerOutput()
        table_rows = [self.block_tables.update(c.request_id, c.new_block_ids, c.num_blocks, c.num_dropped)
                      for c in chunks]
        sampled = self._forward_and_sample(chunks, self.block_tables.gather(table_rows), grammar_bitmask)
        out = RunnerOutput()
        for c in chunks:
            if c.samples:
                rows = [next(sampled) for _ in range(len(c.draft_token_ids) + 1)]
                out.sampled.append(rows[:num_accepted(c.draft_token_ids, rows) + 1])
        if self.proposer is not None:
            out.guesses = self._propose(chunks, out.sampled)
        return out

    def _forward_and_sample(self, chunks: list[ScheduledChunk], block_tables: torch.Tensor,
                            grammar_bitmask: torch.Tensor | None):
        """The sampled tokens of each chunk that samples, in chunk order: one, or with guesses one per guess and
        one after them (the target's own choice at each of those positions)."""
        q_lens = [c.num_new_tokens for c in chunks]
        decode = all(n == 1 and c.samples for n, c in zip(q_lens, chunks))
        size = decode and self.padded is not None and self.padded.bucket(len(chunks), block_tables.shape[1])
        if size:
            starts = [c.start for c in chunks]
            self.padded.fill([c.token_ids[0] for c in chunks], starts, block_tables, self.block_size, size)
            lora = self._lora_step(chunks, torch.arange(size + 1, dtype=torch.int32))
            if self.graphs is not None and lora is None:
                logits = self.graphs.replay(size)[:len(chunks)]
            else:
                input_ids, meta = self.padded.inputs(size, max(starts) + 1)
                logits = self._forward((input_ids, meta, self.padded.cu_seqlens_q[:size], lora))[:len(chunks)]
        else:
            logits = self._forward_as_scheduled(chunks, q_lens, block_tables)
        if logits is None:
            return iter(())
        if grammar_bitmask is not None:
            apply_masks(logits, grammar_bitmask, self.model_cfg.vocab_size)
        return iter(sample(logits, [r for c in chunks for r in c.sampling], self.model_cfg.eos_token_ids))

    def _forward_as_scheduled(self, chunks: list[ScheduledChunk], q_lens: list[int],
                              block_tables: torch.Tensor) -> torch.Tensor | None:
        """The logits of each sampling chunk's last row, and with guesses of one row per guess before it too
        (None when no chunk samples)."""
        batches, any_rows = [], False
        for k, (a, b) in enumerate(micro_batches(q_lens, len(self.inputs_of_batch), MIN_MICRO_BATCH_TOKENS)):
            ends = list(itertools.accumulate(q_lens[a:b]))
            rows = [r for c, e in zip(chunks[a:b], ends) for r in range(e - len(c.sampling), e)]
            any_rows = any_rows or bool(rows)
            input_ids, meta, logits_rows, cu = self.inputs_of_batch[k].build(
                [t for c in chunks[a:b] for t in c.token_ids], [c.start for c in chunks[a:b]], q_lens[a:b],
                block_tables[a:b], self.block_size, torch.tensor(rows, dtype=torch.int32),
                [c.rope_long for c in chunks[a:b]] if self.model.long_rope_from is not None else None)
            batches.append((input_ids, meta, logits_rows, self._lora_step(chunks[a:b], cu)))
        logits = self._forward(*batches)
        return logits if any_rows else None

    def _propose(self, chunks: list[ScheduledChunk], sampled: list[list[SampledToken]]) -> dict[str, list[int]]:
        """Bring each chunk's request record up to date (its chunk's tokens, less the rejected guesses, plus the
        target's token) and ask the proposer for the next step's guesses."""
        seqs, kept = [], iter(sampled)
        for c in chunks:
            tokens = self.token_ids.get(c.request_id)
            if tokens is None:     # its first chunk: the scheduler sent the prefix before it
                tokens = self.token_ids[c.request_id] = list(c.prefix_ids or ())
            del tokens[c.start:]
            tokens += c.token_ids
            wanted = 0
            if c.samples:
                rows = next(kept)
                del tokens[len(tokens) - len(c.draft_token_ids) + len(rows) - 1:]
                tokens.append(rows[-1].token_id)
                wanted = c.guesses_wanted[len(rows) - 1]
            seqs.append(ProposalInput(c.request_id, tokens, c.start, self.block_tables.table(c.request_id), wanted))
        return {s.request_id: g for s, g in zip(seqs, self.proposer.propose(seqs)) if g}


def load_model(cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int, device: torch.device,
               dtype: torch.dtype, group: TensorGroup | None = None, layers: range | None = None) -> LlamaModel:
    """The model; with a tensor-parallel `group` this rank's share of every layer (models/sharding.py); with a
    pipeline stage's decoder `layers` only those (and the embeddings or the LM head where the stage holds them),
    reading only their tensors."""
    if device.type == "cpu":
        cpu_ops.load()   # build or load the C++ operators now, at model load, never on a request
    if group is None:
        tied, n = model_cfg.tie_word_embeddings, model_cfg.num_layers
        pick = None if layers is None else lambda name, t: t[:] if stage_holds(name, layers, n, tied) else None
        return LlamaModel(model_cfg, load_state_dict(model_cfg.path, dtype, pick), device, dtype, max_model_len,
                          cfg.quantization, layers=layers)
    shard = group.shard
    row_amax = {}   # INT8 made here takes each row's scale over the whole row, as one process does

    def pick(name, t):
        if cfg.quantization in ("int8", "w8a8") and splits_inputs(name):
            whole = t[:].to(dtype)
            row_amax[name.removesuffix(".weight") + ".row_amax"] = whole.float().abs().amax(dim=1)
            t = whole
        return shard_tensor(model_cfg, shard, name, t)
    state = load_state_dict(model_cfg.path, dtype, pick=pick)
    state.update(row_amax)
    return LlamaModel(shard_config(model_cfg, shard), state, device, dtype, max_model_len, cfg.quantization, group)


# A micro-batch reads the stage's weights again: below this many tokens a step (decodes) is bound by those reads and
# runs whole, above it (prefill chunks) the stages' overlap pays (perf/RESULTS.md, "Pipeline parallelism").
MIN_MICRO_BATCH_TOKENS = 256


def micro_batches(q_lens: list[int], most: int, min_tokens: int) -> list[tuple[int, int]]:
    """The step's chunks as up to `most` runs [start, end) of about equal tokens, each a micro-batch of at least
    `min_tokens` tokens (one run when the step has fewer)."""
    total = sum(q_lens)
    n = max(1, min(most, len(q_lens), total // min_tokens))
    bounds, done, a = [], 0, 0
    for i, q in enumerate(q_lens):
        done += q
        left = len(q_lens) - i - 1
        if len(bounds) < n - 1 and (done * n >= total * (len(bounds) + 1) or left == n - 1 - len(bounds)):
            bounds.append((a, i + 1))
            a = i + 1
    return bounds + [(a, len(q_lens))]


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
