"""Speculative decoding's draft-model proposer: a smaller model with the target's tokenizer guesses the next k
tokens greedily, one forward pass per guessed position, batched over every sequence that speculates.

Its KV cache is a second tensor indexed by the target's block ids: a request's draft K/V live in the same blocks as
its target K/V, so they are taken, shared through the prefix cache, freed and dropped on preemption together, by
the one KV cache manager, with no bookkeeping of their own. The pool's blocks are sized for both (runner.py).

Keeping in step: the first pass of a step that guesses runs every chunk the target runs (prefill chunks
included), each from where the draft's K/V of that request end: the chunk's start, except after a step that
accepted every guess (the draft has not yet seen the last guess: one token behind), after steps that guessed
nothing (a batch past `speculative_disable_batch_size` costs the draft nothing; it catches up in one chunk when
guessing resumes), or on a preempted request, which starts over with the target. A request's first chunk trusts
the draft K/V of the prefix-cache blocks it reuses; blocks computed while the draft was behind hold none, which
makes guesses over such a prefix worse, never the output wrong. The guesses are the draft's argmax: a point-mass
proposal, which verification (scheduler.verify, sampler.py) turns into exactly the target's distribution. An EAGLE-style
head would be another proposer with the same two methods, reading the target's hidden states instead of running a
model of its own.
"""
from __future__ import annotations

import os

import torch

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.runner import allocate_kv_cache, attention_metadata
from trellm_backend.models.config import ModelConfig, ModelConfigError, load_model_config
from trellm_backend.models.llama import LlamaModel
from trellm_backend.models.weights import load_state_dict


class DraftModelProposer:
    def __init__(self, draft_cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, kv_dtype: torch.dtype | None = None):
        """kv_dtype: the target's KV cache dtype (INT8/FP8 too: a block's draft K/V are quantized as its target K/V
        are, which is what limits.kv_bytes_per_block counts); default `dtype`."""
        self.cfg = draft_cfg
        self.block_size, self.device = block_size, device
        self.model = LlamaModel(draft_cfg, load_state_dict(draft_cfg.path, dtype), device, dtype, max_model_len)
        self.kv_cache, self.kv_scales = allocate_kv_cache(draft_cfg, num_blocks, block_size, kv_dtype or dtype,
                                                          device)
        self.computed: dict[str, int] = {}     # request id -> positions whose draft K/V are written

    @torch.inference_mode()
    def propose(self, chunks: list, requests: list, num_tokens: list[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in chunks]
        if not any(num_tokens):
            # A step without guesses (a large batch) costs the draft nothing: it only notes where a request it has
            # not seen starts (the cached prefix before its first chunk), and catches up later.
            for c in chunks:
                self.computed.setdefault(c.request_id, c.start)
            return guesses
        # Pass 1: every chunk, from where its draft K/V end; logits of the last row of those that guess.
        starts, tokens, tables, guessing = [], [], [], []
        for i, (c, req, k) in enumerate(zip(chunks, requests, num_tokens)):
            start = min(self.computed.get(c.request_id, c.start), c.start)
            starts.append(start)
            tokens.append(req.token_ids[start:c.start] + c.token_ids)
            tables.append(c.block_ids)
            self.computed[c.request_id] = c.start + c.num_new_tokens
            if k > 0:
                guessing.append(i)
        last = self._forward(starts, tokens, tables, guessing)
        for i, t in zip(guessing, last):
            guesses[i].append(t)
        # Passes 2..k: each guessing sequence feeds its latest guess, while it wants more.
        for j in range(1, max(num_tokens, default=0)):
            rows = [i for i in guessing if num_tokens[i] > j]
            if not rows:
                break
            pos = [chunks[i].start + chunks[i].num_new_tokens + j - 1 for i in rows]
            last = self._forward(pos, [[guesses[i][-1]] for i in rows], [chunks[i].block_ids for i in rows],
                                 list(range(len(rows))))
            for i, p, t in zip(rows, pos, last):
                guesses[i].append(t)
                self.computed[chunks[i].request_id] = p + 1
        return guesses

    def _forward(self, starts, tokens, tables, sample_rows) -> list[int]:
        """One draft forward over sequences given as (start, tokens, block table); returns the argmax token after
        the last row of each sequence in `sample_rows`."""
        meta, cu = attention_metadata(starts, [len(t) for t in tokens], tables, self.block_size, self.device)
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=self.device)
        logits_indices = (cu[1:] - 1)[sample_rows].to(self.device)
        logits = self.model.forward(ids, meta, self.kv_cache, logits_indices, self.kv_scales)
        return logits.argmax(dim=-1).tolist()

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)


def load_draft_config(config: EngineConfig, target: ModelConfig, max_model_len: int) -> ModelConfig | None:
    """The draft model's config when speculative_method is draft, after checking that its guesses are token ids
    the target understands and that it reaches as far as the target serves."""
    if config.speculative_method != "draft":
        return None
    path = config.draft_model_path
    if not os.path.isdir(path):
        raise ModelConfigError(f"draft_model_path={path} is not a folder")
    draft = load_model_config(path)
    cfg_file = os.path.join(path, "config.json")
    if draft.vocab_size != target.vocab_size:
        raise ModelConfigError(f"{cfg_file}: vocab_size={draft.vocab_size}, but the target model's is "
                               f"{target.vocab_size}: a draft model must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ModelConfigError(f"{cfg_file}: max_position_embeddings={draft.max_position_embeddings} is below the "
                               f"served max_model_len={max_model_len}; lower max_model_len or use a longer draft")
    return draft
