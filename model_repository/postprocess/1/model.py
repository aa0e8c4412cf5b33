"""Triton adapter: llm token ids -> text deltas, one IncrementalDetokenizer per sequence until it finishes."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from trellm_backend.detokenizer import IncrementalDetokenizer
from trellm_backend.serving import model_parameters, resolve_model_path


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        path = resolve_model_path(params["model_path"], args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.streams = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()  # noqa: E731
            ids = get("token_ids").reshape(-1).tolist()
            num_context = int(get("num_context_tokens").reshape(-1)[0])
            key = int(get("sequence_key").reshape(-1)[0])
            finished = bool(get("finished").reshape(-1)[0])
            detok = self.streams.get(key)
            if detok is None:
                detok = self.streams[key] = IncrementalDetokenizer(self.tokenizer, ids[:num_context])
                ids = ids[num_context:]
            text = detok.add(ids)
            if finished:
                text += detok.flush()
                del self.streams[key]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                pb_utils.Tensor("num_input_tokens", get("num_input_tokens").reshape(1, 1)),
                pb_utils.Tensor("num_output_tokens", get("num_output_tokens").reshape(1, 1)),
            ]))
        return responses
