"""The vLLM-shaped contract (`vllm_model`, vllm_backend's tensor names): its inputs parsed into field values for
`llm`, and `llm`'s responses reshaped into its outputs."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from trellm_backend.triton import fields


VLLM_OUTPUTS = ["text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                "num_output_tokens"]
# The llm outputs they are made from (what vllm_model asks llm for).
FROM_LLM = ["text_output", "finish_reason", "token_ids", "output_log_probs", "top_logprobs", "cum_log_probs",
            "num_input_tokens"]


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
    values = fields.values_from_sampling_json(strings.get("sampling_parameters") or "")
    values.setdefault("temperature", 1.0)
    flags = {k: bools.get(k, False) for k in fields.VLLM_INPUTS if k.startswith("return_")}
    if flags["return_cumulative_logprob"] and values.get("logprobs") is None:
        values["return_log_probs"] = True    # logprobs of the sampled tokens only
    if flags["return_num_input_tokens"]:
        values["return_num_input_tokens"] = True   # llm sends only the outputs its request switches on
    fields.sampling_params(values)              # every range error now, before anything is sent to llm
    stream = bools.get("stream", False)
    values["stream"] = stream
    values["exclude_input_in_output"] = True  # the prompt is echoed here, as the client sent it
    return VllmRequest(prompt, values, stream, echo_prompt=not bools.get("exclude_input_in_output", False)
                       and not stream, flags=flags)
