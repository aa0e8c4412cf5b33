"""Speculative decoding's draft-model proposer: a smaller model with the target's tokenizer guesses the next k
tokens greedily, one forward pass per guessed position, batched over every sequence that speculates.

Its KV cache is a second tensor indexed by the target's block ids: a request's draft K/V live in the same blocks as
its target K/V, so they are taken, shared through the prefix cache, freed and dropped on preemption together, by
the one KV cache manager, with no bookkeeping of their own. The pool's blocks are sized for both (runner.py).

Keeping in step: the runner calls it after every target step (proposers.py). When some chunk wants guesses, the
first pass runs every chunk of the step (prefill chunks included), each from where the draft's K/V of that request
end up to the request's last known token: the token the target just sampled, whose logits give the first guess.
Later passes feed each guess to get the next. A guess's K/V are written at the position it would take, in the
lookahead slots the scheduler gave the request (the pool's blocks, counted in its budget); positions without a slot
are not guessed. They stand once the target accepts the guesses; the next call checks which did. A step in which no
chunk wants guesses (a batch past `speculative_disable_batch_size`) costs the draft nothing; it catches up in one
chunk when guessing resumes. A request's first chunk trusts the draft K/V of the prefix-cache blocks it reuses;
blocks computed while the draft was behind hold none, which makes guesses over such a prefix worse, never the output
wrong. The guesses are the draft's argmax: a point-mass proposal, which verification (sampler.py) turns into exactly
the target's distribution. An EAGLE-style head would be another proposer with the same two methods, reading the
target's hidden states instead of running a model of its own.
"""
from __future__ import annotations

import itertools
import os

import torch
from torch.nn.utils.rnn import pad_sequence

from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.forward_inputs import StepInputs, allocate_kv_cache
from trellm_backend.engine.kv_cache_manager import NULL_BLOCK
from trellm_backend.engine.proposers import ProposalInput
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
        self.inputs = StepInputs(device)
        self.computed: dict[str, int] = {}     # request id -> positions whose draft K/V are written
        # request id -> (position of the first guess fed last time, the guesses fed): those the target accepted
        # extend `computed` at the next call.
        self.fed: dict[str, tuple[int, list[int]]] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[ProposalInput]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in seqs]
        for s in seqs:   # a request not seen yet starts after its cached prefix
            self.computed.setdefault(s.request_id, s.start)
        if not any(s.num_tokens for s in seqs):
            return guesses
        # Pass 1: each sequence from where its draft K/V end to its last token with a slot; the logits of the last
        # token of those that guess.
        starts, tokens, tables, rows, guessing = [], [], [], [], []
        for i, s in enumerate(seqs):
            start = self._accepted(s)
            end = min(len(s.token_ids), len(s.block_table) * self.block_size)
            if end <= start:
                continue
            if s.num_tokens > 0 and end == len(s.token_ids):
                guessing.append(i)
                rows.append(len(starts))
            starts.append(start)
            tokens.append(s.token_ids[start:end])
            tables.append(s.block_table)
            self.computed[s.request_id] = end
        if not guessing:
            return guesses
        for i, t in zip(guessing, self._forward(starts, tokens, tables, rows)):
            guesses[i].append(t)
        # Passes 2..k: each guessing sequence feeds its latest guess at the position it would take, while it wants
        # more and that position has a slot.
        for j in range(1, max(seqs[i].num_tokens for i in guessing)):
            more = [i for i in guessing if seqs[i].num_tokens > j
                    and len(seqs[i].token_ids) + j - 1 < len(seqs[i].block_table) * self.block_size]
            if not more:
                break
            pos = [len(seqs[i].token_ids) + j - 1 for i in more]
            last = self._forward(pos, [[guesses[i][-1]] for i in more], [seqs[i].block_table for i in more],
                                 list(range(len(more))))
            for i, t in zip(more, last):
                guesses[i].append(t)
        for i in guessing:
            s = seqs[i]
            self.fed[s.request_id] = (len(s.token_ids), guesses[i][:-1])   # the last guess was never fed
        return guesses

    def _accepted(self, s: ProposalInput) -> int:
        """Where `s`'s draft K/V end: its computed positions, then the guesses fed last time that the target
        accepted (the same tokens at the same positions)."""
        done = self.computed[s.request_id]
        at, fed = self.fed.pop(s.request_id, (-1, []))
        if at == done:
            n = 0
            while n < len(fed) and at + n < len(s.token_ids) and s.token_ids[at + n] == fed[n]:
                n += 1
            done += n
        return done

    def _forward(self, starts, tokens, tables, sample_rows) -> list[int]:
        """One draft forward over sequences given as (start, tokens, block table); returns the argmax token after
        the last row of each sequence in `sample_rows`."""
        ends = list(itertools.accumulate(len(t) for t in tokens))
        ids, meta, logits_rows, _ = self.inputs.build(
            [t for seq in tokens for t in seq], starts, [len(t) for t in tokens],
            pad_sequence(tables, batch_first=True, padding_value=NULL_BLOCK), self.block_size,
            torch.tensor([ends[i] - 1 for i in sample_rows], dtype=torch.int32))
        logits = self.model.forward(ids, meta, self.kv_cache, logits_rows, self.kv_scales)
        return logits.argmax(dim=-1).tolist()

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.fed.pop(request_id, None)


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
