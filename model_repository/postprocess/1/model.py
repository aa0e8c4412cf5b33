"""Triton adapter: what llm sends -> the ensemble's TRT-LLM-shaped outputs (backend/triton/ensemble.py)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.triton.ensemble import POSTPROCESS_INPUTS, trtllm_outputs


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            got = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in POSTPROCESS_INPUTS}
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in trtllm_outputs(got).items()]))
        return responses
