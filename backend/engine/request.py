"""A request as the engine sees it: sampling settings, token ids, and how far the model has computed them."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings. temperature 0 means greedy. Allowed ranges: api.FIELDS."""
    max_tokens: int = 16
    min_tokens: int = 0               # EOS and stop ids are masked until this many tokens are out
    temperature: float = 1.0
    top_k: int = 0                    # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0                # drop tokens below min_p * the top token's probability
    repetition_penalty: float = 1.0   # on prompt and output tokens: logit / p if positive, * p if negative
    presence_penalty: float = 0.0     # subtracted once from each token already in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)          # stop strings (need the engine's tokenizer)
    bad_words: list[str] = field(default_factory=list)     # never generated (tokenized by the engine)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    n: int = 1                        # parallel samples (fanned out by the serving layer)
    logprobs: int | None = None       # None: none; k: the sampled token's logprob and the top k alternatives
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        from trellm_backend.triton.fields import validate_sampling_params   # the field table is the one source of ranges
        validate_sampling_params(self)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int                                  # prompt + output may not exceed this (context / pool limit)
    token_ids: list[int] = field(init=False)      # prompt then generated tokens
    num_computed_tokens: int = 0                  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None      # a seeded request draws from its own stream
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    # Timestamps (time.time_ns()) for TRT-LLM's perf-metric outputs.
    arrival_time_ns: int = field(default_factory=time.time_ns)
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    output_processor: object | None = None        # text and stop strings (output_processor.py), with a tokenizer
    # Prefix caching (block_manager.py): hashes of full blocks, computed once; blocks registered in the cache.
    cache_salt: str | None = None                 # requests with different salts never share cached blocks
    block_hashes: list = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0                    # prompt tokens found in the prefix cache at first admission

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None   # "stop", "length" or "abort" once finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text: str = ""                     # new text (with a tokenizer): complete characters, stop strings cut off
    logprobs: list[float] | None = None                      # of each new token, when asked
    # Per new token: (its rank, the top alternatives as (id, logprob)), when asked.
    top_logprobs: list[tuple[int, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float = 0.0
    metrics: tuple[int, int, int, int] = (0, 0, 0, 0)   # arrival, first scheduled, first token, last token (ns)
    num_cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache
