"""The request contract of the `llm` model, without Triton: tensors in -> a validated request; engine outputs ->
what each response carries. `model_repository/llm/1/model.py` only moves these between Triton objects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from trellm_backend.detokenizer import WINDOW
from trellm_backend.request import RequestOutput, SamplingParams

# Optional scalar inputs of the llm step (TRT-LLM names), with the numpy kind each must have.
# config.pbtxt files are checked against this table by tests/test_repository_config.py.
SCALAR_INPUTS: dict[str, str] = {
    "max_tokens": "int",
    "stream": "bool",
    "exclude_input_in_output": "bool",
    "temperature": "float",
    "top_k": "int",
    "top_p": "float",
    "seed": "uint",
    "random_seed": "uint",   # TRT-LLM's older name for seed
    "end_id": "int",
}
DEFAULT_MAX_TOKENS = 16


@dataclass
class LLMRequestSpec:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo_prompt: bool


def _scalar(name: str, arr: np.ndarray, kind: str):
    a = np.asarray(arr)
    if a.size != 1:
        raise ValueError(f"{name} must hold exactly one value per request, got shape {list(a.shape)}")
    ok = {"int": np.issubdtype(a.dtype, np.integer), "uint": np.issubdtype(a.dtype, np.integer),
          "float": np.issubdtype(a.dtype, np.floating), "bool": a.dtype == np.bool_}[kind]
    if not ok:
        raise ValueError(f"{name} has dtype {a.dtype}; expected {kind}")
    v = a.reshape(-1)[0].item()
    if kind == "uint" and v < 0:
        raise ValueError(f"{name} must be non-negative, got {v}")
    if kind == "float" and not np.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    return v


def parse_llm_inputs(tensors: dict[str, np.ndarray]) -> LLMRequestSpec:
    """Validate the llm step's tensors (`input_ids` plus optional SCALAR_INPUTS); raise ValueError naming the
    field at fault. With none of temperature, top_k, top_p given, decoding is greedy (TRT-LLM's default)."""
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
    v = {n: _scalar(n, tensors[n], kind) for n, kind in SCALAR_INPUTS.items() if n in tensors}
    sampling_given = any(k in v for k in ("temperature", "top_k", "top_p"))
    seed = v.get("seed", v.get("random_seed"))
    params = SamplingParams(
        max_tokens=int(v.get("max_tokens", DEFAULT_MAX_TOKENS)),
        temperature=float(v.get("temperature", 1.0)) if sampling_given else 0.0,
        top_k=int(v.get("top_k", 0)),
        top_p=float(v.get("top_p", 1.0)),
        seed=int(seed) if seed is not None else None,
        stop_token_ids=[int(v["end_id"])] if "end_id" in v else [],
    )
    params.validate()
    return LLMRequestSpec(ids.astype(np.int64).tolist(), params, bool(v.get("stream", False)),
                          echo_prompt=not v.get("exclude_input_in_output", False))


@dataclass
class ResponsePayload:
    """One llm response. token_ids starts with `num_context_tokens` ids that only give the detokenizer context."""
    token_ids: list[int]
    num_context_tokens: int
    finished: bool
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int


class ResponsePlan:
    """Decides what each response of one request carries.

    Streaming: every new token goes out at once, as a delta (never the prompt). Not streaming: one response at
    the end with all generated tokens, preceded by the prompt when it is echoed (TRT-LLM's
    exclude_input_in_output=false). The first response carries the prompt's last tokens as context, so the
    first word is detokenized with its leading space.
    """

    def __init__(self, prompt_ids: list[int], stream: bool, echo_prompt: bool):
        self.prompt_ids = prompt_ids
        self.stream = stream
        self.echo = echo_prompt and not stream
        self.pending: list[int] = []
        self.sent_first = False

    def on_output(self, out: RequestOutput) -> ResponsePayload | None:
        self.pending.extend(out.new_token_ids)
        if not out.finished and (not self.stream or not self.pending):
            return None
        if self.echo:
            context, ids = [], self.prompt_ids + self.pending
        else:
            context = [] if self.sent_first else self.prompt_ids[-WINDOW:]
            ids = context + self.pending
        self.sent_first = True
        self.pending = []
        return ResponsePayload(ids, len(context), out.finished, out.finish_reason, out.num_prompt_tokens,
                               out.num_output_tokens)


def resolve_model_path(value: str, model_dir: str) -> str:
    """A `model_path` parameter: absolute, or relative to the model repository's root folder."""
    value = os.path.expandvars(os.path.expanduser(value))
    if not os.path.isabs(value):
        value = os.path.join(os.path.dirname(os.path.abspath(model_dir)), value)
    return os.path.normpath(value)


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain {key: string_value} dict."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
