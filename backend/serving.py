"""The `llm` model's contract without Triton: tensors in -> validated engine requests; engine outputs -> what
each response carries. `model_repository/llm/1/model.py` only moves these between Triton objects.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from trellm_backend import api
from trellm_backend.request import RequestOutput, SamplingParams


@dataclass
class LLMRequestSpec:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo_prompt: bool


def parse_llm_inputs(tensors: dict[str, np.ndarray]) -> LLMRequestSpec:
    """Validate the llm step's tensors (`input_ids` plus any of api.FIELDS' tensors); raise ValueError naming the
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
    values = api.values_from_tensors(tensors)
    params = api.sampling_params(values)
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
    metrics: tuple[int, int, int, int]
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
                            out.num_output_tokens, out.metrics, out.num_cached_tokens)
        self.prefix = ""
        self.text, self.token_ids, self.logprobs, self.top = [], [], [], []
        return p


def kv_block_counts(p: ResponsePayload, block_size: int) -> tuple[int, int, int]:
    """(new, reused, total) KV blocks of a sequence so far: TRT-LLM's kv_cache_alloc_* outputs."""
    total = -(-(p.num_input_tokens + p.num_output_tokens) // block_size)
    reused = p.num_cached_tokens // block_size
    return total - reused, reused, total


def resolve_model_path(value: str, model_dir: str) -> str:
    """A `model_path` parameter: absolute, or relative to the model repository's root folder."""
    value = os.path.expandvars(os.path.expanduser(value))
    if not os.path.isabs(value):
        value = os.path.join(os.path.dirname(os.path.abspath(model_dir)), value)
    return os.path.normpath(value)


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain {key: string_value} dict."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


# -- what llm sends, reshaped for each contract --------------------------------------------------------------
POSTPROCESS_INPUTS = ["text_output", "finish_reason", "output_log_probs", "cum_log_probs", "num_input_tokens",
                      "num_output_tokens", "sequence_index", "perf_metrics"]
PERF_METRIC_OUTPUTS = {"arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64,
                       "first_token_time_ns": np.int64, "last_token_time_ns": np.int64,
                       "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
                       "kv_cache_alloc_total_blocks": np.int32}


def trtllm_outputs(llm: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ensemble's outputs ([1, ...]: batch of one, beam of one) from one llm response's tensors."""
    metrics = llm["perf_metrics"].reshape(-1)
    out = {
        "text_output": llm["text_output"].reshape(1, -1),
        "finish_reason": llm["finish_reason"].reshape(1, 1),
        "cum_log_probs": llm["cum_log_probs"].reshape(1, 1).astype(np.float32),
        "output_log_probs": llm["output_log_probs"].reshape(1, 1, -1).astype(np.float32),
        "num_input_tokens": llm["num_input_tokens"].reshape(1, 1),
        "num_output_tokens": llm["num_output_tokens"].reshape(1, 1),
        "batch_index": np.zeros((1, 1), dtype=np.int32),     # one prompt per request
        "sequence_index": llm["sequence_index"].reshape(1, 1),
    }
    for (name, dtype), value in zip(PERF_METRIC_OUTPUTS.items(), metrics):
        out[name] = np.array([[value]], dtype=dtype)
    return out


VLLM_OUTPUTS = ["text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                "num_output_tokens"]


def vllm_outputs(llm: dict[str, np.ndarray], flags: dict[str, bool], prefix: str = "") -> dict[str, np.ndarray]:
    """vllm_model's outputs from one llm response: text_output always, the others when their return_* switch is
    on (vllm_backend's contract). `prefix` is prepended to the text (the echoed prompt)."""
    text = b"".join(llm["text_output"].reshape(-1)).decode("utf-8")
    out = {"text_output": np.array([(prefix + text).encode("utf-8")], dtype=np.object_)}
    if flags.get("return_finish_reason"):
        out["finish_reason"] = llm["finish_reason"].reshape(1)
    if flags.get("return_cumulative_logprob"):
        out["cumulative_logprob"] = llm["cum_log_probs"].reshape(1).astype(np.float32)
    if flags.get("return_logprobs"):
        out["logprobs"] = np.array([_vllm_logprobs_json(llm).encode()], dtype=np.object_)
    if flags.get("return_num_input_tokens"):
        out["num_input_tokens"] = llm["num_input_tokens"].reshape(1).astype(np.uint32)
    if flags.get("return_num_output_tokens"):
        out["num_output_tokens"] = np.array([llm["token_ids"].size], dtype=np.uint32)   # new in this response
    return out


def _vllm_logprobs_json(llm: dict[str, np.ndarray]) -> str:
    """vLLM's per-position logprobs of this response's tokens: [{token_id: {"logprob": x, "rank": r}}, ...] with
    the sampled token and its top alternatives; `null` when the request did not ask (sampling_parameters
    logprobs unset)."""
    chosen = llm["output_log_probs"].reshape(-1).tolist()
    if not chosen:
        return "null"
    raw = llm["top_logprobs"].reshape(-1)[0]
    top = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    positions = []
    for token, lp, (rank, alternatives) in zip(llm["token_ids"].reshape(-1).tolist(), chosen, top):
        entry = {str(t): {"logprob": v, "rank": r} for r, (t, v) in enumerate(alternatives, 1)}
        entry[str(token)] = {"logprob": lp, "rank": rank}
        positions.append(entry)
    return json.dumps(positions)


# -- the vLLM-shaped entry point ---------------------------------------------------------------------------
@dataclass
class VllmRequest:
    prompt: str
    values: dict          # api field values, sent to llm as its tensors
    stream: bool
    echo_prompt: bool
    flags: dict           # the return_* switches


def parse_vllm_request(strings: dict[str, str | None], bools: dict[str, bool]) -> VllmRequest:
    """The vLLM contract's inputs (text_input and sampling_parameters as str, the BOOL inputs as bools) -> what
    vllm_model sends llm. vLLM's defaults apply: temperature 1 unless given."""
    prompt = strings.get("text_input")
    if prompt is None:
        raise ValueError("text_input is missing: every request needs a prompt")
    values = api.values_from_sampling_json(strings.get("sampling_parameters") or "")
    values.setdefault("temperature", 1.0)
    flags = {k: bools.get(k, False) for k in api.VLLM_INPUTS if k.startswith("return_")}
    if flags["return_cumulative_logprob"] and values.get("logprobs") is None:
        values["return_log_probs"] = True    # logprobs of the sampled tokens only
    api.sampling_params(values)              # every range error now, before anything is sent to llm
    stream = bools.get("stream", False)
    values["stream"] = stream
    values["exclude_input_in_output"] = True  # the prompt is echoed here, as the client sent it
    return VllmRequest(prompt, values, stream, echo_prompt=not bools.get("exclude_input_in_output", False)
                       and not stream, flags=flags)
