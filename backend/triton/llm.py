"""The `llm` model's contract without Triton: tensors in -> validated engine requests; engine outputs -> what
each response carries. `model_repository/llm/1/model.py` only moves these between Triton objects.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from trellm_backend.engine.request import RequestOutput, RequestTimes, SamplingParams
from trellm_backend.triton import fields


@dataclass
class LLMRequestSpec:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo_prompt: bool


def parse_llm_inputs(tensors: dict[str, np.ndarray]) -> LLMRequestSpec:
    """Validate the llm step's tensors (`input_ids` plus any of fields.FIELDS' tensors); raise ValueError naming the
    field at fault."""
    if "input_ids" not in tensors:
        raise ValueError("input_ids is missing")
    ids = np.asarray(tensors["input_ids"])
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"one prompt per request is supported, got a batch of {ids.shape[0]}; "
                             "send one request per prompt")
        ids = ids[0]
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids has dtype {ids.dtype}; expected integers")
    if "input_lengths" in tensors:
        ids = ids[: int(np.asarray(tensors["input_lengths"]).reshape(-1)[0])]
    values = fields.values_from_tensors(tensors)
    params = fields.sampling_params(values)
    return LLMRequestSpec(ids.astype(np.int64).tolist(), params, bool(values.get("stream", False)),
                          echo_prompt=not values.get("exclude_input_in_output", False))


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """One engine request per parallel sample; with a seed, sample i uses seed + i (so samples differ)."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64))
            for i in range(params.n)]


@dataclass
class ResponsePayload:
    """One llm response of one sequence."""
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[int, list[tuple[int, float]]]]    # per token: (rank, [(id, logprob), ...])
    finished: bool
    finish_reason: str | None
    cumulative_logprob: float
    num_input_tokens: int
    num_output_tokens: int
    times: RequestTimes
    num_cached_tokens: int

    def top_logprobs_json(self) -> str:
        return json.dumps([[rank, [[t, lp] for t, lp in top]] for rank, top in self.top_logprobs]) \
            if self.top_logprobs else ""


class ResponsePlan:
    """Decides what each response of one sequence carries.

    Streaming: new text goes out as soon as there is some; a step that produced no text yet (a held character or
    a possible stop string) is held and merged into the next response, so no non-final response is empty.
    Not streaming: one response at the end, the prompt's text first when it is echoed (TRT-LLM's
    exclude_input_in_output=false)."""

    def __init__(self, stream: bool, echo_text: str = ""):
        self.stream = stream
        self.prefix = "" if stream else echo_text
        self.text, self.token_ids, self.logprobs, self.top = [], [], [], []

    def on_output(self, out: RequestOutput) -> ResponsePayload | None:
        self.text.append(out.text)
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
            self.top.extend(out.top_logprobs or [])
        if not out.finished and (not self.stream or not any(self.text)):
            return None
        p = ResponsePayload(self.prefix + "".join(self.text), self.token_ids, self.logprobs, self.top,
                            out.finished, out.finish_reason, out.cumulative_logprob, out.num_prompt_tokens,
                            out.num_output_tokens, out.times, out.num_cached_tokens)
        self.prefix = ""
        self.text, self.token_ids, self.logprobs, self.top = [], [], [], []
        return p


@dataclass(frozen=True)
class PerfMetrics:
    """TRT-LLM's perf fields of one response, in the order of the `perf_metrics` tensor that carries them from
    `llm` to `postprocess` (an ensemble step passes tensors, so they travel packed; these names unpack them)."""
    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    kv_cache_alloc_new_blocks: int
    kv_cache_reused_blocks: int
    kv_cache_alloc_total_blocks: int

    @classmethod
    def of(cls, p: ResponsePayload, block_size: int) -> "PerfMetrics":
        """The payload's times, and its sequence's KV blocks so far (new, reused from the prefix cache, total)."""
        total = -(-(p.num_input_tokens + p.num_output_tokens) // block_size)
        reused = p.num_cached_tokens // block_size
        t = p.times
        return cls(t.arrival_ns, t.first_scheduled_ns, t.first_token_ns, t.last_token_ns, total - reused, reused,
                   total)

    def to_array(self) -> np.ndarray:
        return np.array([dataclasses.astuple(self)], dtype=np.int64)

    @classmethod
    def from_array(cls, a: np.ndarray) -> "PerfMetrics":
        return cls(*(int(v) for v in np.asarray(a).reshape(-1)))


# What every llm response carries (config.pbtxt output list; tests/test_api.py checks).
LLM_OUTPUTS = ["text_output", "finish_reason", "token_ids", "output_log_probs", "top_logprobs", "cum_log_probs",
               "num_input_tokens", "num_output_tokens", "sequence_index", "perf_metrics"]


def response_tensors(p: ResponsePayload, sequence_index: int, block_size: int) -> dict[str, np.ndarray]:
    """One llm response's tensors ([1, ...]: batch of one), named as LLM_OUTPUTS."""
    return {
        "text_output": np.array([[p.text.encode("utf-8")]], dtype=np.object_),
        "finish_reason": np.array([[(p.finish_reason or "").encode()]], dtype=np.object_),
        "token_ids": np.array([p.token_ids], dtype=np.int32),
        "output_log_probs": np.array([p.logprobs], dtype=np.float32),
        "top_logprobs": np.array([[p.top_logprobs_json().encode()]], dtype=np.object_),
        "cum_log_probs": np.array([[p.cumulative_logprob]], dtype=np.float32),
        "num_input_tokens": np.array([[p.num_input_tokens]], dtype=np.int32),
        "num_output_tokens": np.array([[p.num_output_tokens]], dtype=np.int32),
        "sequence_index": np.array([[sequence_index]], dtype=np.int32),
        "perf_metrics": PerfMetrics.of(p, block_size).to_array(),
    }
