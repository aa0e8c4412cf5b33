"""Triton adapter: text_input -> input_ids (the model folder's tokenizer, special tokens such as BOS added)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from trellm_backend.serving import model_parameters, resolve_model_path


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        path = resolve_model_path(params["model_path"], args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
            if tensor is None:
                responses.append(_error("text_input is missing: every request needs a prompt"))
                continue
            texts = tensor.as_numpy().reshape(-1)
            try:
                prompts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]
            except UnicodeDecodeError as e:
                responses.append(_error(f"text_input is not valid UTF-8: {e}"))
                continue
            if any(not p for p in prompts):
                responses.append(_error("text_input is empty: send at least one character of prompt"))
                continue
            ids = [self.tokenizer(p).input_ids for p in prompts]
            width = max(len(i) for i in ids)
            padded = np.zeros((len(ids), width), dtype=np.int32)
            for row, i in enumerate(ids):
                padded[row, :len(i)] = i
            lengths = np.array([[len(i)] for i in ids], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", padded), pb_utils.Tensor("input_lengths", lengths)]))
        return responses


def _error(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
