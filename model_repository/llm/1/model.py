"""Triton adapter over the engine: `execute` validates each request and hands it to the engine loop, which
runs in a background thread and answers through each request's response sender."""
import itertools
import json
import logging
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.triton.fields import llm_tensor_names
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.loop import EngineLoop, QueueFull
from trellm_backend.triton.metrics import MetricsReporter
from trellm_backend.triton.llm import ResponsePlan, fan_out, kv_block_counts, parse_llm_inputs
from trellm_backend.triton.parameters import model_parameters
from trellm_backend.triton.tokenization import load_tokenizer
from trellm_backend.triton.checks import serving_config

INPUTS = llm_tensor_names()
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="[trellm] %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        # Checks the folder, the KV budget and memory first; a failure names the file and value (Triton's load error).
        config = serving_config(params, args["model_repository"])
        # The engine makes the text (stop strings are matched on it), so it gets the model folder's tokenizer.
        self.tokenizer = load_tokenizer(config.model_path)
        self.engine = LLMEngine(config, tokenizer=self.tokenizer)
        self.loop = EngineLoop(self.engine)
        self.metrics = None
        if self.engine.config.enable_metrics:
            try:
                self.metrics = MetricsReporter(pb_utils, self.loop, {"model": args["model_name"],
                                                                     "version": args["model_version"]})
            except Exception as e:  # e.g. a server started with --allow-metrics=false: serve without them
                logging.getLogger("trellm").warning("metrics disabled: %s", e)
        self.keys = itertools.count(1)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if _is_stop_request(request):
                # TRT-LLM-style stop: abort the running request(s) with this request_id; the stop itself gets
                # one final response without outputs. Works where a client cancel cannot reach (an ensemble step).
                self.loop.abort_client_id(request.request_id())
                sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                continue
            try:
                tensors = {}
                for name in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        tensors[name] = t.as_numpy()
                spec = parse_llm_inputs(tensors)
                key = next(self.keys)
                samples = fan_out(spec.params)   # n parallel samples: engine requests <key>#<i>
                reqs = [self.engine.make_request(f"{key}#{i}" if len(samples) > 1 else str(key), spec.prompt_ids, p)
                        for i, p in enumerate(samples)]
            except ValueError as e:
                _fail(sender, str(e))
                continue
            echo = ""
            if spec.echo_prompt and not spec.stream:
                echo = self.tokenizer.decode(spec.prompt_ids, skip_special_tokens=True)
            group = _Responses(sender, len(reqs), self.engine.config.block_size)
            try:
                for i, req in enumerate(reqs):
                    self.loop.submit(req, _Sink(group, i, ResponsePlan(spec.stream, echo)),
                                     client_id=request.request_id())
            except QueueFull as e:
                for submitted in reqs[:i]:
                    self.loop.abort(submitted.request_id)
                group.fail(str(e), pb_utils.TritonError.UNAVAILABLE)
        return None

    def finalize(self):
        if self.metrics is not None:
            self.metrics.stop()
        self.loop.stop()


class _Responses:
    """The response sender of one Triton request, shared by its n sequences: FINAL rides on the last response of
    the last sequence to finish."""

    def __init__(self, sender, num_sequences, block_size):
        self.sender, self.remaining, self.block_size = sender, num_sequences, block_size
        self.lock = threading.Lock()
        self.done = False

    def send(self, tensors, sequence_finished):
        with self.lock:
            if self.done:
                return
            self.remaining -= sequence_finished
            self.done = self.remaining == 0
            self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if self.done else 0)

    def fail(self, message, code=None):
        with self.lock:
            if not self.done:
                self.done = True
                _fail(self.sender, message, code)


class _Sink:
    """Sends one sequence's outputs (text deltas and their numbers) through its request's response sender."""

    def __init__(self, group, sequence_index, plan):
        self.group, self.index, self.plan = group, sequence_index, plan

    def send(self, output):
        p = self.plan.on_output(output)
        if p is None:
            return
        new, reused, total = kv_block_counts(p, self.group.block_size)
        tensors = [
            pb_utils.Tensor("text_output", np.array([[p.text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([[(p.finish_reason or "").encode()]], dtype=np.object_)),
            pb_utils.Tensor("token_ids", np.array([p.token_ids], dtype=np.int32)),
            pb_utils.Tensor("output_log_probs", np.array([p.logprobs], dtype=np.float32)),
            pb_utils.Tensor("top_logprobs", np.array([[p.top_logprobs_json().encode()]], dtype=np.object_)),
            pb_utils.Tensor("cum_log_probs", np.array([[p.cumulative_logprob]], dtype=np.float32)),
            pb_utils.Tensor("num_input_tokens", np.array([[p.num_input_tokens]], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([[p.num_output_tokens]], dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.array([[self.index]], dtype=np.int32)),
            pb_utils.Tensor("perf_metrics", np.array([[*p.metrics, new, reused, total]], dtype=np.int64)),
        ]
        self.group.send(tensors, p.finished)

    def fail(self, message):
        self.group.fail(message)

    def is_cancelled(self):
        # Under the lock and only before FINAL: asking a sender whose final response is out reads a freed
        # response factory (tritonserver 2.51 segfaults in TRITONBACKEND_ResponseFactoryIsCancelled).
        with self.group.lock:
            return not self.group.done and self.group.sender.is_cancelled()


def _is_stop_request(request):
    t = pb_utils.get_input_tensor_by_name(request, "stop")
    return t is not None and bool(t.as_numpy().reshape(-1)[0])


def _fail(sender, message, code=None):
    error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG if code is None else code)
    sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
