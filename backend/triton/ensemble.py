"""The TRT-LLM-shaped `ensemble` contract's last step: what `llm` sends, reshaped into the ensemble's outputs
(`postprocess` calls this; it is stateless)."""
from __future__ import annotations

import dataclasses

import numpy as np

from trellm_backend.triton.llm import PerfMetrics

POSTPROCESS_INPUTS = ["text_output", "finish_reason", "output_log_probs", "cum_log_probs", "num_input_tokens",
                      "num_output_tokens", "sequence_index", "perf_metrics"]
# The ensemble's output dtype of each perf field (times INT64, block counts INT32).
PERF_METRIC_DTYPES = {f.name: np.int64 if f.name.endswith("_ns") else np.int32
                      for f in dataclasses.fields(PerfMetrics)}


def trtllm_outputs(llm: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ensemble's outputs ([1, ...]: batch of one, beam of one) from one llm response's tensors."""
    metrics = dataclasses.asdict(PerfMetrics.from_array(llm["perf_metrics"]))
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
    for name, dtype in PERF_METRIC_DTYPES.items():
        out[name] = np.array([[metrics[name]]], dtype=dtype)
    return out
