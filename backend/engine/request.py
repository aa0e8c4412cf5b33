"""A request as the engine sees it: sampling settings, token ids, and how far the model has computed them."""
from __future__ import annotations

import enum
import math
import re
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from trellm_backend.engine.structured_output import Guide

if TYPE_CHECKING:
    import torch


def parse_bool(value) -> bool:
    """A boolean as config files and JSON clients write it: true/false/1/0 (any case) as text, 0/1, or a bool.
    Raises ValueError on anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"not a boolean: {value!r}")


U64_MAX = (1 << 64) - 1
I32_MAX = (1 << 31) - 1
# How long the word lists of one request may be: each is checked on every step of every sequence of the request
# (stop strings against the text, bad words and stop ids against the tokens), on the thread that steps everyone.
# {attribute: (the names a request uses, most entries, most characters per entry)}.
LIST_LIMITS = {"stop": ("stop_words / stop", 64, 256), "bad_words": ("bad_words", 1024, 256),
               "stop_token_ids": ("stop_token_ids", 256, None)}
LOGIT_BIAS_MOST = 1024             # entries of logit_bias (added to each row's logits on every step)
LOGIT_BIAS_BOUNDS = (-100, 100)    # OpenAI's range: -100 bans a token in effect, 100 all but forces it
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


@dataclass(frozen=True)
class Bounds:
    """An allowed range, inclusive unless lo_open; None = unbounded on that side."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def text(self) -> str:
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi is None else ']'}"

    def check(self, value, shown: str) -> None:
        """Raise ValueError naming `shown` (the name the caller used) and the range; None and lists' None pass."""
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{shown} must be a finite number in {self.text()}, got {v}")
            low_bad = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
            if low_bad or (self.hi is not None and v > self.hi):
                raise ValueError(f"{shown} must be in {self.text()}, got {value}")


def check_logit_bias(bias: dict) -> dict[int, float]:
    """Raise ValueError naming logit_bias unless it maps at most LOGIT_BIAS_MOST token ids to numbers in
    LOGIT_BIAS_BOUNDS; return it."""
    if len(bias) > LOGIT_BIAS_MOST:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {LOGIT_BIAS_MOST} are allowed")
    lo, hi = LOGIT_BIAS_BOUNDS
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ValueError(f"logit_bias values must be numbers in [{lo}, {hi}], got {value!r} for token {token}")
    return bias


def parse_logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, as a JSON object or its text) -> {token id: bias}, checked
    (check_logit_bias); raises ValueError naming what is wrong."""
    import json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"logit_bias is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError('logit_bias must be an object of token ids and biases: {"50256": -100}')
    if len(value) > LOGIT_BIAS_MOST:     # first: a body of 4 MiB holds hundreds of thousands of entries
        raise ValueError(f"logit_bias has {len(value)} entries; at most {LOGIT_BIAS_MOST} are allowed")
    out = {}
    for key, bias in value.items():
        # token ids as written: digits, no sign, no leading zero, so that two keys never name one token
        if not isinstance(key, str) or not TOKEN_ID_KEY.fullmatch(key):
            raise ValueError(f"logit_bias keys must be token ids written as integers (\"50256\"), got {key!r}")
        out[int(key)] = bias
    return check_logit_bias(out)


def _num(x) -> str:
    if x == U64_MAX:
        return "2**64-1"
    if x == I32_MAX:
        return "2**31-1"
    return str(int(x)) if float(x).is_integer() else str(x)


def _bounded(default, lo=None, hi=None, lo_open=False):
    kw = {"default_factory": list} if default == [] else {"default": default}
    return field(**kw, metadata={"bounds": Bounds(lo, hi, lo_open)})


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings. temperature 0 means greedy. These defaults and ranges are the
    request fields' (triton/fields.py reads them from here)."""
    max_tokens: int = _bounded(16, 1, 1 << 20)
    min_tokens: int = _bounded(0, 0, 1 << 20)       # EOS and stop ids are masked until this many tokens are out
    temperature: float = _bounded(1.0, 0, 100)
    top_k: int = _bounded(0, -1, I32_MAX)           # 0 (or -1) = off
    top_p: float = _bounded(1.0, 0, 1, lo_open=True)
    min_p: float = _bounded(0.0, 0, 1)              # drop tokens below min_p * the top token's probability
    repetition_penalty: float = _bounded(1.0, 0, 100, lo_open=True)   # prompt and output: logit / p if > 0, else * p
    presence_penalty: float = _bounded(0.0, -2, 2)  # subtracted once from each token already in the output
    frequency_penalty: float = _bounded(0.0, -2, 2)  # subtracted per occurrence in the output
    seed: int | None = _bounded(None, 0, U64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] = _bounded([], 0, I32_MAX)
    stop: list[str] = field(default_factory=list)          # stop strings (need the engine's tokenizer)
    bad_words: list[str] = field(default_factory=list)     # never generated (tokenized by the engine)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    n: int = _bounded(1, 1, 16)                      # parallel samples (fanned out by the serving layer)
    logprobs: int | None = _bounded(None, 0, 20)     # None: none; k: the sampled token's logprob and the top k
    skip_special_tokens: bool = True
    speculative_decoding: bool = True                # false: this request's steps carry no guesses (same output)
    guide: Guide | None = None                       # structured output (structured_output.py)
    lora_name: str | None = None                     # a LoRA adapter of the model (models/lora.py); None: the base
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit before sampling

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        for f in fields(self):
            if "bounds" in f.metadata:
                f.metadata["bounds"].check(getattr(self, f.name), f.name)
        for attr, (shown, most, chars) in LIST_LIMITS.items():
            values = getattr(self, attr)
            if len(values) > most:
                raise ValueError(f"{shown} has {len(values)} entries; at most {most} are allowed")
            if chars is not None and any(len(v) > chars for v in values):
                longest = max(len(v) for v in values)
                raise ValueError(f"{shown} has an entry of {longest} characters; at most {chars} are allowed")
        if self.guide is not None:
            self.guide.validate()
        check_logit_bias(self.logit_bias)

    def logit_bias_columns(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        """logit_bias as (token ids, biases) tensors, built once per request: a step then joins tensors instead of
        turning up to 1024 Python numbers a row into tensors."""
        cached = self.__dict__.get("_logit_bias_columns")
        if cached is None or cached[0] is not self.logit_bias:
            import torch
            cached = self.__dict__["_logit_bias_columns"] = (
                self.logit_bias, torch.tensor(list(self.logit_bias), dtype=torch.long),
                torch.tensor([float(b) for b in self.logit_bias.values()], dtype=torch.float32))
        return cached[1], cached[2]

    def bad_word_table(self) -> tuple[list[int], dict[int, dict[tuple[int, ...], list[int]]]]:
        """bad_words_ids as (ids banned always, {head length: {head: ids banned after it}}), built once: a sampling
        step then costs one lookup per distinct head length, not one comparison per word."""
        cached = self.__dict__.get("_bad_word_table")
        if cached is None or cached[0] is not self.bad_words_ids:
            always, after = [], {}
            for word in self.bad_words_ids:
                if len(word) == 1:
                    always.append(word[0])
                else:
                    after.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
            cached = self.__dict__["_bad_word_table"] = (self.bad_words_ids, always, after)
        return cached[1], cached[2]

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class RequestTimes:
    """Life-cycle timestamps (time.time_ns()) for TRT-LLM's perf-metric outputs, the latency metrics and the
    request's trace: the scheduler stamps the first scheduling and each preemption, the engine the tokens."""
    arrival_ns: int
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    preempted_ns: list[int] = field(default_factory=list)


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
    num_computed_tokens: int = 0                  # tokens whose K/V are in the cache (moved by the scheduler only)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None      # a seeded request draws from its own stream
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.time_ns()))
    output_processor: object | None = None        # text and stop strings (output_processor.py), with a tokenizer
    unsent: list = field(default_factory=list)    # sampled tokens (SampledToken) whose text is still pending
    cache_salt: str | None = None                 # requests with different salts never share cached blocks
    rope_long: bool = False                       # longrope: its tokens are rotated with the long factors
    num_cached_tokens: int = 0                    # prompt tokens found in the prefix cache at first admission
    spec_acceptance: float = 1.0                  # speculative guesses: recent acceptance rate (the scheduler's)
    spec_steps_since_probe: int = 0
    spec_token_ids: list[int] = field(default_factory=list)   # guesses proposed after its last step, for the next
    spec_lookahead: int = 0                       # slots held past its computed tokens for the proposer's K/V
    num_blocks_sent: int = 0                      # entries of its block table the runner has (the scheduler's)
    grammar_future: object | None = None          # a guided request's compiled grammar (concurrent.futures.Future)
    grammar: object | None = None                 # its xgrammar matcher, made when the engine takes the request
    lora: object | None = None                    # its LoRA adapter (models/lora.LoraAdapter), or None
    trace: object | None = None                   # when traced: its parent span and attributes (tracing.RequestTrace)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.seed is not None:
            import torch   # here, not at the top: the Python models that only parse requests load without torch
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
    text: str = ""                     # the new tokens' text (with a tokenizer): complete characters, stops cut off
    context_ids: list[int] = field(default_factory=list)   # the tokens the text was made after (detokenizer.py)
    cut_chars: int = 0                 # the last output: characters of its tokens' text cut at a stop string
    logprobs: list[float] | None = None                      # of each new token, when asked
    # Per new token: (its rank, the top alternatives as (id, logprob)), when asked.
    top_logprobs: list[tuple[int, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float = 0.0
    times: RequestTimes = field(default_factory=lambda: RequestTimes(0))
    num_cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache

    def then(self, later: "RequestOutput") -> "RequestOutput":
        """This output and the same request's next one as a single output: the new tokens, text and logprobs of
        both, the rest as of the later one (a responder that fell behind sends one response instead of two)."""
        def both(a, b):
            return None if a is None or b is None else a + b
        return replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids, text=self.text + later.text,
            context_ids=self.context_ids if self.new_token_ids else later.context_ids,
            logprobs=both(self.logprobs, later.logprobs), top_logprobs=both(self.top_logprobs, later.top_logprobs))


def request_output(req: Request, num_released: int, text: str = "", context_ids: list[int] | None = None,
                   cut_chars: int = 0) -> RequestOutput:
    """`req`'s output for its oldest `num_released` unsent tokens (with their logprobs), which leave `req.unsent`."""
    out, req.unsent = req.unsent[:num_released], req.unsent[num_released:]
    logprobs = [s.logprob for s in out] if out and out[0].logprob is not None else None
    top = [(s.rank, s.top) for s in out] if out and out[0].top is not None else None
    return RequestOutput(req.request_id, [s.token_id for s in out], finished=req.status is Status.FINISHED,
                         finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                         num_output_tokens=req.num_output_tokens, text=text, context_ids=context_ids or [],
                         cut_chars=cut_chars, logprobs=logprobs, top_logprobs=top,
                         cumulative_logprob=req.cumulative_logprob, times=replace(req.times),
                         num_cached_tokens=req.num_cached_tokens)
