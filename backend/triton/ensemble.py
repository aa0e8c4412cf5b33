"""The TRT-LLM-shaped `ensemble` contract's last step: what `llm` sends, reshaped into the ensemble's outputs
(`postprocess` calls this; it is stateless)."""
from __future__ import annotations

import numpy as np


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
