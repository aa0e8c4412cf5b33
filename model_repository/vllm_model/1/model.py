"""Triton adapter for the vLLM-shaped contract: parse (backend/triton/vllm.py parse_vllm_request), tokenize
(backend/triton/tokenization.py), stream from the llm model over BLS, reshape (vllm_outputs). A BLS stream is read
by blocking calls, so each request is served on a worker of one pool made at load: execute returns at once,
requests run concurrently in the engine, and no thread is started per request. The pool has
`max_concurrent_requests` workers, and a request beyond that many in flight is refused at once with UNAVAILABLE
rather than queued without bound behind them."""
import concurrent.futures
import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.triton.fields import VLLM_INPUTS, request_parameters_error, tensors_from_values
from trellm_backend.triton.parameters import model_parameters, resolve_model_path
from trellm_backend.triton.responses import fail, send
from trellm_backend.triton.stack_dumps import enable_stack_dumps
from trellm_backend.triton.vllm import FROM_LLM, parse_vllm_request, vllm_outputs
from trellm_backend.triton.tokenization import decode_utf8, encode_prompt, load_tokenizer, prompt_char_limit
from trellm_backend.tracing import traces_endpoint, triton_carrier

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Requests streamed at once when config.pbtxt does not say (max_concurrent_requests): above what one engine runs
# (max_num_seqs) plus its waiting queue's usual depth.
DEFAULT_MAX_CONCURRENT_REQUESTS = 256


class TritonPythonModel:
    def initialize(self, args):
        enable_stack_dumps()   # a crash, or SIGUSR1 on a stub that stopped answering: stacks to the server log
        params = model_parameters(json.loads(args["model_config"]))
        self.llm_model = params["llm_model"]
        self.traced = traces_endpoint() is not None    # then each request's trace is passed on to llm
        path = resolve_model_path(params["model_path"], args["model_repository"])
        self.tokenizer = load_tokenizer(path)
        self.max_prompt_chars = prompt_char_limit(path)
        self.max_in_flight = _positive_int(params.get("max_concurrent_requests", DEFAULT_MAX_CONCURRENT_REQUESTS),
                                           "max_concurrent_requests", args["model_repository"])
        self.workers = concurrent.futures.ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="vllm_model")
        self.in_flight = 0
        self.in_flight_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                error = request_parameters_error(request.parameters())
                if error:
                    raise ValueError(error)
                strings = {n: _one(request, n, decode_utf8) for n in ("text_input", "sampling_parameters")}
                bools = {n: _one(request, n, _as_bool) for n, kind in VLLM_INPUTS.items() if kind == "bool"}
                spec = parse_vllm_request(strings, {k: v for k, v in bools.items() if v is not None})
                ids = encode_prompt(self.tokenizer, spec.prompt, max_chars=self.max_prompt_chars)
            except ValueError as e:
                fail(pb_utils, sender, str(e))
                continue
            with self.in_flight_lock:
                admitted = self.in_flight < self.max_in_flight
                self.in_flight += admitted
            if not admitted:
                fail(pb_utils, sender, f"vllm_model is at capacity: {self.max_in_flight} requests in flight "
                     f"(max_concurrent_requests={self.max_in_flight}); retry later", pb_utils.TritonError.UNAVAILABLE)
                continue
            # tritonserver's trace of this request goes on in llm's engine span (tracing.triton_carrier)
            carrier = triton_carrier(request) if self.traced else {}
            requested = frozenset(request.requested_output_names())
            self.workers.submit(self._serve_counted, sender, spec, ids, carrier, requested)
        return None

    def finalize(self):
        self.workers.shutdown(wait=False, cancel_futures=True)

    def _serve_counted(self, sender, spec, ids, carrier, requested):
        try:
            self._serve(sender, spec, ids, carrier, requested)
        finally:
            with self.in_flight_lock:
                self.in_flight -= 1

    def _serve(self, sender, spec, ids, carrier, requested):
        request_id = uuid.uuid4().hex    # also names this request in a stop request
        tensors = {"input_ids": np.array([ids], dtype=np.int32),
                   "input_lengths": np.array([[len(ids)]], dtype=np.int32), **tensors_from_values(spec.values)}
        inputs = [pb_utils.Tensor(name, value) for name, value in tensors.items()]
        traced = {"parameters": carrier} if carrier else {}     # untraced: the request as before tracing existed
        llm_request = pb_utils.InferenceRequest(model_name=self.llm_model, inputs=inputs, request_id=request_id,
                                                requested_output_names=FROM_LLM, **traced)
        remaining = spec.values.get("n", 1)
        prefix = spec.prompt if spec.echo_prompt else ""
        try:
            responses = llm_request.exec(decoupled=True)
            for response in responses:
                if sender.is_cancelled():
                    self._stop(request_id)
                    # Read llm's stream to its end (the abort ends it within a step) before the client's FINAL: on
                    # 2.51 a stream left unread keeps its shared memory (53 MiB after 4,000 cancels, perf/soak.py),
                    # and reading it after the FINAL crashed the stub.
                    for _ in responses:
                        pass
                    sender.send(flags=FINAL)
                    return
                if response.has_error():   # llm's refusal or failure, with its code (UNAVAILABLE when full)
                    fail(pb_utils, sender, response.error().message(), response.error().code())
                    return
                got = {n: t.as_numpy() for n in FROM_LLM
                       if (t := pb_utils.get_output_tensor_by_name(response, n)) is not None}
                if "text_output" not in got:   # the flag-only end of the llm's stream
                    continue
                remaining -= bool(got["finish_reason"].reshape(-1)[0])
                out = vllm_outputs(got, spec.flags, prefix)
                prefix = ""
                send(pb_utils, sender, out, FINAL if remaining == 0 else 0, requested)
                if remaining == 0:
                    return
            sender.send(flags=FINAL)
        except Exception as e:   # a failure here must still end the client's stream
            fail(pb_utils, sender, f"vllm_model: {e}")

    def _stop(self, request_id):
        """Ask llm to abort the generation running under `request_id` (the client went away)."""
        stop = pb_utils.InferenceRequest(model_name=self.llm_model, request_id=request_id,
                                         inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=np.bool_))],
                                         requested_output_names=[])
        for _ in stop.exec(decoupled=True):
            pass


def _positive_int(value: str, name: str, model_dir: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{model_dir}/config.pbtxt: parameter {name}={value!r} must be an integer >= 1")
    return n


def _one(request, name, convert):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got shape {list(a.shape)}")
    return convert(a.reshape(-1)[0], name)


def _as_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be BOOL, got {type(value).__name__}")
    return bool(value)
