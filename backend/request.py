"""A request as the engine sees it: sampling settings, token ids, and how far the model has computed them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings. temperature 0 means greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0            # 0 (or -1) = off
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        if not 1 <= self.max_tokens <= 1 << 20:
            raise ValueError(f"max_tokens must be in [1, 1048576], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")


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
