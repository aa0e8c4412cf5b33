"""Turn a batch of logits into next tokens, with every sampling control applied to the whole batch at once.

Order (vLLM's): logit_bias, penalties (repetition on prompt + output, presence and frequency on the output), token bans
(EOS and stop ids before min_tokens, bad words), then greedy rows take the argmax; the others get temperature,
top-k, top-p and min-p, and draw with the exponential-race trick (argmax of p / Exp(1) noise, equivalent to
drawing from p). A seeded request draws its noise row from its own generator and every control depends only on
its own tokens, so its output does not depend on which other requests share the batch. Logprobs are the
log-softmax of the final processed logits, computed only for the rows that asked.

Speculative decoding needs nothing else here: each guessed position is sampled as it would be without guesses,
and verification (`num_accepted`) keeps a guess only if the sampled token equals it. For a guess proposed with
certainty (a point mass q, which both proposers give) that is exactly the standard rejection rule: the guess is
accepted with probability p(guess) = min(1, p/q), and a rejected one is replaced by a draw from p without the
guess, renormalised, i.e. from (p - q)+ normalised. Greedy and seeded outputs are therefore the same token for token with
speculation on or off.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trellm_backend.engine.request import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What sampling one row reads of its request, fixed when the step was planned (scheduler.sampling_row): the
    sampler never sees a live request."""
    params: SamplingParams
    num_prompt_tokens: int
    num_tokens: int                  # prompt + output before this row
    history: list[int]               # those tokens, when penalties or bad words read them; else []
    generator: torch.Generator | None   # a seeded request's own random stream, drawn from in place
    guided: bool                     # a grammar guides the row: it ends where the grammar does, min_tokens or not

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def after(self, guesses: list[int]) -> "SamplingRow":
        """The row that follows `guesses` (speculative decoding: a guessed position is sampled as if the guesses
        before it had been generated)."""
        history = self.history + guesses if self.history else []
        return replace(self, num_tokens=self.num_tokens + len(guesses), history=history)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None                    # when the request asked for logprobs
    top: list[tuple[int, float]] | None = None      # the top-k alternatives (token id, logprob), best first
    rank: int | None = None                         # 1 + how many tokens were more likely than the sampled one
    # A seeded row that drew, followed by a guessed row of the same request: its generator's state right after
    # this row's draw. When the later rows are thrown away (rejected guesses), the generator goes back to the state
    # after the last row kept, so a seeded request gives the same tokens with and without speculation.
    rng_state: torch.Tensor | None = None


def num_accepted(draft_token_ids: list[int], sampled: list[SampledToken]) -> int:
    """How many of a chunk's guesses stand: those the target sampled the same token for, up to the first
    disagreement (`sampled`: the target's token at each guess's position, then one more)."""
    n = 0
    while n < len(draft_token_ids) and sampled[n].token_id == draft_token_ids[n]:
        n += 1
    return n


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids=()) -> list[SampledToken]:
    """logits [B, V] fp32 -> one SampledToken per row."""
    logits = apply_logit_bias(logits, rows)
    logits = apply_penalties(logits, rows)
    logits = apply_bans(logits, rows, eos_token_ids)
    temps = [r.params.temperature for r in rows]
    states = {}
    if all(t == 0.0 for t in temps):
        token_ids = logits.argmax(dim=-1)
        processed = logits
    else:
        token_ids, processed, states = _draw(logits, rows, temps)
    out = _with_logprobs(token_ids, processed, rows)
    for i, state in states.items():
        out[i].rng_state = state
    return out


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (one indexed add for the batch, from tensors each request built
    once)."""
    picked = [(i, *r.params.logit_bias_columns()) for i, r in enumerate(rows) if r.params.logit_bias]
    if not picked:
        return logits
    dev = logits.device
    row_ids = torch.repeat_interleave(torch.tensor([i for i, _, _ in picked]),
                                      torch.tensor([len(ids) for _, ids, _ in picked]))
    token_ids = torch.cat([ids for _, ids, _ in picked])
    biases = torch.cat([b for _, _, b in picked]).to(dev, logits.dtype)
    logits = logits.clone()
    logits.index_put_((row_ids.to(dev), token_ids.to(dev)), biases, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties for the rows that set any (counts built only for those)."""
    picked = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not picked:
        return logits
    dev, V = logits.device, logits.shape[1]
    penalized = [rows[i] for i in picked]
    # Token ids padded with V (a dummy column) into [R, L], then counted per row with one scatter_add.
    seqs = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.history) for r in penalized], batch_first=True,
                                           padding_value=V)
    n_prompt = torch.tensor([r.num_prompt_tokens for r in penalized])
    is_output = torch.arange(seqs.shape[1])[None, :] >= n_prompt[:, None]
    seqs, is_output = seqs.to(dev), is_output.to(dev)
    ones = torch.ones_like(seqs, dtype=logits.dtype)
    output_counts = torch.zeros(len(picked), V + 1, dtype=logits.dtype, device=dev)
    output_counts.scatter_add_(1, seqs, ones * is_output)
    seen = torch.zeros(len(picked), V + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, seqs, True)
    output_counts, seen = output_counts[:, :V], seen[:, :V]

    def col(values):
        return torch.tensor(values, dtype=logits.dtype, device=dev)[:, None]

    rep = col([r.params.repetition_penalty for r in penalized])
    sub = logits[picked]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - col([r.params.frequency_penalty for r in penalized]) * output_counts
    sub = sub - col([r.params.presence_penalty for r in penalized]) * (output_counts > 0).to(logits.dtype)
    logits = logits.clone()
    logits[picked] = sub
    return logits


def apply_bans(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids=()) -> torch.Tensor:
    """-inf for EOS and stop ids while a row is below min_tokens (unless a grammar guides it), and for the last token of each bad word whose
    earlier tokens end the sequence so far (single-token bad words always)."""
    banned_rows, banned_ids = [], []
    for i, r in enumerate(rows):
        p = r.params
        if r.num_output_tokens < p.min_tokens and not r.guided:   # a guided row ends where its grammar does
            ids = [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)]
            banned_rows += [i] * len(ids)
            banned_ids += ids
        if p.bad_words_ids:
            always, after = p.bad_word_table()
            ids = list(always)
            for n, heads in after.items():
                ids += heads.get(tuple(r.history[-n:]), ())
            banned_rows += [i] * len(ids)
            banned_ids += ids
    if not banned_rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(banned_rows, device=logits.device), torch.tensor(banned_ids, device=logits.device)] = \
        float("-inf")
    return logits


def _draw(logits: torch.Tensor, rows: list[SamplingRow], temps: list[float]):
    """Greedy rows: argmax of the penalized logits; random rows: temperature, top-k/top-p/min-p, then a draw.
    Returns the token ids, the logits each row's token was finally chosen from, and {row: its generator's state
    after its draw} for the seeded rows that a row of the same request follows."""
    device, V = logits.device, logits.shape[1]
    greedy_ids = logits.argmax(dim=-1)
    temp = torch.tensor([t if t > 0 else 1.0 for t in temps], device=device, dtype=torch.float32)
    scaled = logits / temp[:, None]
    top_k = [r.params.top_k if r.params.top_k > 0 else V for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    min_p = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_p):
        scaled = _apply_min_p(scaled, torch.tensor(min_p, device=device, dtype=torch.float32))

    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        noise.exponential_()
    states = {}
    for i in seeded:
        # Drawn on CPU from the request's own generator: reproducible on any device and in any batch.
        gen = rows[i].generator
        noise[i] = torch.empty(V).exponential_(generator=gen).to(device)
        if i + 1 < len(rows) and rows[i + 1].generator is gen:   # a guessed row of the same request follows
            states[i] = gen.get_state()
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0.0 for t in temps], device=device)
    return torch.where(is_greedy, greedy_ids, sampled), torch.where(is_greedy[:, None], logits, scaled), states


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass strictly above each token
    drop |= before >= p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability (p_i < min_p * p_max, i.e.
    logit_i < logit_max + log(min_p))."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _with_logprobs(token_ids: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    ids = token_ids.cpu().tolist()
    out = [SampledToken(t) for t in ids]
    picked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not picked:
        return out
    logprobs = torch.log_softmax(processed[picked].float(), dim=-1)
    chosen_t = logprobs.gather(1, token_ids[picked][:, None])
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).cpu().tolist()
    chosen = chosen_t.squeeze(1).cpu().tolist()
    k = max(rows[i].params.logprobs for i in picked)
    top_vals, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    top_vals, top_ids = top_vals.cpu().tolist(), top_ids.cpu().tolist()
    for j, i in enumerate(picked):
        n = rows[i].params.logprobs
        out[i].logprob, out[i].rank = chosen[j], ranks[j]
        out[i].top = [(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n]) if v != float("-inf")]
    return out
