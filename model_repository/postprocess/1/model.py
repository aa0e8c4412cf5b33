"""Triton adapter: llm's token ids -> text_output, with the model folder's tokenizer (backend/engine/detokenizer.py).
Each request is one llm response; a batch of them is decoded in two tokenizer calls."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.engine.detokenizer import TokenRun, run_texts
from trellm_backend.triton.parameters import model_parameters, resolve_model_path
from trellm_backend.triton.stack_dumps import enable_stack_dumps
from trellm_backend.triton.tokenization import load_tokenizer, require_tokenizer_files


class TritonPythonModel:
    def initialize(self, args):
        enable_stack_dumps()   # a crash, or SIGUSR1 on a stub that stopped answering: stacks to the server log
        params = model_parameters(json.loads(args["model_config"]))
        path = resolve_model_path(params["model_path"], args["model_repository"])
        require_tokenizer_files(path)
        self.tokenizer = load_tokenizer(path)

    def execute(self, requests):
        runs = [TokenRun(_ints(r, "context_ids"), _ints(r, "token_ids"), _ints(r, "cut_chars")[0]) for r in requests]
        return [pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))])
                for text in run_texts(self.tokenizer, runs)]


def _ints(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1).tolist()
