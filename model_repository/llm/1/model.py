"""Triton adapter over the engine: `execute` validates each request and hands it to the engine loop, which
runs in a background thread and answers through each request's response sender."""
import itertools
import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.config import EngineConfig
from trellm_backend.engine import LLMEngine
from trellm_backend.engine_loop import EngineLoop
from trellm_backend.serving import (SCALAR_INPUTS, ResponsePlan, model_parameters, parse_llm_inputs,
                                    resolve_model_path)

INPUTS = ["input_ids", "input_lengths", *SCALAR_INPUTS]
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="[trellm] %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        params["model_path"] = resolve_model_path(params["model_path"], args["model_repository"])
        self.engine = LLMEngine(EngineConfig.from_strings(params))
        self.loop = EngineLoop(self.engine)
        self.keys = itertools.count(1)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = {}
                for name in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        tensors[name] = t.as_numpy()
                spec = parse_llm_inputs(tensors)
                key = next(self.keys)
                req = self.engine.make_request(str(key), spec.prompt_ids, spec.params)
            except ValueError as e:
                _fail(sender, str(e))
                continue
            self.loop.submit(req, _Sink(sender, key, ResponsePlan(spec.prompt_ids, spec.stream, spec.echo_prompt)))
        return None

    def finalize(self):
        self.loop.stop()


class _Sink:
    """Sends one request's outputs through its Triton response sender."""

    def __init__(self, sender, key, plan):
        self.sender, self.key, self.plan = sender, key, plan

    def send(self, output):
        p = self.plan.on_output(output)
        if p is None:
            return
        tensors = [
            pb_utils.Tensor("token_ids", np.array([p.token_ids], dtype=np.int32)),
            pb_utils.Tensor("num_context_tokens", np.array([[p.num_context_tokens]], dtype=np.int32)),
            pb_utils.Tensor("sequence_key", np.array([[self.key]], dtype=np.uint64)),
            pb_utils.Tensor("finished", np.array([[p.finished]], dtype=np.bool_)),
            pb_utils.Tensor("num_input_tokens", np.array([[p.num_input_tokens]], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([[p.num_output_tokens]], dtype=np.int32)),
        ]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if p.finished else 0)

    def fail(self, message):
        _fail(self.sender, message)

    def is_cancelled(self):
        return self.sender.is_cancelled()


def _fail(sender, message):
    error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
    sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
