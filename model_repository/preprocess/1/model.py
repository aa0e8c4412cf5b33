"""Triton adapter: text_input (or chat messages, with any tools) -> input_ids with the model folder's tokenizer
(backend/triton/tokenization.py). Also reports request parameters that name no input (a typo in an HTTP generate body)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.triton.fields import request_parameters_error
from trellm_backend.triton.parameters import model_parameters, resolve_model_path
from trellm_backend.triton.stack_dumps import enable_stack_dumps
from trellm_backend.triton.tokenization import (decode_utf8, encode_prompt, load_tokenizer, prompt_char_limit,
                                                 require_tokenizer_files)


class TritonPythonModel:
    def initialize(self, args):
        enable_stack_dumps()   # a crash, or SIGUSR1 on a stub that stopped answering: stacks to the server log
        params = model_parameters(json.loads(args["model_config"]))
        path = resolve_model_path(params["model_path"], args["model_repository"])
        require_tokenizer_files(path)   # names the folder, where AutoTokenizer's own error would not
        self.tokenizer = load_tokenizer(path)
        self.max_prompt_chars = prompt_char_limit(path)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            error = request_parameters_error(request.parameters())
            if error:
                raise ValueError(error)
            ids = encode_prompt(self.tokenizer, _string(request, "text_input"), _string(request, "messages"),
                                self.max_prompt_chars, _string(request, "tools"))
        except ValueError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32))])


def _string(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    a = tensor.as_numpy()
    if a.dtype != np.object_ or a.size != 1:
        raise ValueError(f"{name} must be one STRING (BYTES) value, got {a.dtype} of shape {list(a.shape)}")
    return decode_utf8(a.reshape(-1)[0], name)
