"""Triton adapter over the engine: `execute` validates each request and hands it to the engine loop, which
runs in a background thread and answers through each request's response sender (backend/triton/responses.py)."""
import itertools
from functools import partial
import json
import logging
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from trellm_backend.engine.cores import yield_process
from trellm_backend.engine.detokenizer import run_text
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.loop import DuplicateClientId, EngineLoop, QueueFull
from trellm_backend.triton.checks import serving_config
from trellm_backend.triton.fields import auto_complete_llm_inputs, llm_tensor_names
from trellm_backend.triton.llm import ResponsePlan, apply_lora_control, fan_out, parse_llm_inputs
from trellm_backend.triton.metrics import MetricsReporter, cache_config_labels
from trellm_backend.triton.parameters import model_parameters
from trellm_backend.triton.responses import ResponseGroup, SequenceSink, fail, is_stop_request, lora_control, send
from trellm_backend.triton.shutdown import watch_server_shutdown
from trellm_backend.triton.stack_dumps import enable_stack_dumps
from trellm_backend.triton.tokenization import load_tokenizer
from trellm_backend.tracing import RequestTrace, RequestTracer, make_tracer, triton_carrier

INPUTS = llm_tensor_names()


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return auto_complete_llm_inputs(auto_complete_model_config)

    def initialize(self, args):
        enable_stack_dumps()   # a crash, or SIGUSR1 on a stub that stopped answering: stacks to the server log
        logging.basicConfig(level=logging.INFO, format="[trellm] %(message)s")
        params = model_parameters(json.loads(args["model_config"]))
        # Checks the folder, the KV budget and memory first; a failure names the file and value (Triton's load error).
        config = serving_config(params, args["model_repository"])
        self.model_dir = args["model_repository"]
        # The engine needs text (stop strings are matched on it), so it gets the model folder's tokenizer.
        self.tokenizer = load_tokenizer(config.model_path)
        self.engine = LLMEngine(config, tokenizer=self.tokenizer)
        self.metrics = None
        if config.enable_metrics:
            try:
                self.metrics = MetricsReporter(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
            except Exception as e:  # e.g. a server started with --allow-metrics=false: serve without them
                logging.getLogger("trellm").warning("metrics disabled: %s", e)
        # With OTEL_EXPORTER_OTLP_*ENDPOINT set, each request's engine span joins tritonserver's trace of it.
        tracer = make_tracer("trellm-engine")
        self.tracer = RequestTracer(tracer) if tracer is not None else None
        self.model_name = args["model_name"]
        self.loop = EngineLoop(self.engine, on_finished=self.metrics.record if self.metrics else None,
                               tracer=self.tracer)
        self.engine.on_worker_lost(self._worker_lost)
        if self.loop.idle_helpers:
            # tritonserver's threads and the other stubs wake per streamed token: on a CPU they wait for the
            # compute's gaps (cores.py).
            yield_process(os.getppid(), with_children=True)
        if self.metrics is not None:
            self.metrics.start(self.loop.stats, cache_config_labels(self.engine))
        self.keys = itertools.count(1)
        # On the server's stop: refuse new requests, end those in flight (finish_reason abort) within the grace.
        self.serving = threading.Event()
        self.end_shutdown_watch = watch_server_shutdown(
            pb_utils, args["model_name"],
            lambda how: self.loop.shut_down(config.shutdown_grace_s, f"tritonserver is stopping ({how})"),
            self.serving)

    def _worker_lost(self, message):
        """A worker of the split model is lost, so this model cannot step any more: its requests in flight fail (their
        step raises), then this stub ends, so that no `llm` stays ready that cannot step; the launcher's supervisor
        restarts the server with the models it had."""
        logging.getLogger("trellm").error("%s: ending the llm stub (pid %d)", message, os.getpid())
        self.loop.shut_down(60.0, reason=message)   # new requests: UNAVAILABLE, as from a server that restarts
        time.sleep(1.0)   # the failed requests' errors go out first
        self.engine.close()
        os._exit(1)

    def execute(self, requests):
        self.serving.set()
        for request in requests:
            sender = request.get_response_sender()
            if is_stop_request(pb_utils, request):
                # TRT-LLM-style stop: abort the running request(s) with this request_id; the stop itself gets
                # one final response without outputs. Works where a client cancel cannot reach (an ensemble step).
                self.loop.abort_client_id(request.request_id())
                sender.send(pb_utils.InferenceResponse(output_tensors=[]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            control = lora_control(pb_utils, request)
            if control is not None:
                # Adds or removes LoRA adapters; requests in flight go on with the adapter they started with.
                try:
                    result = apply_lora_control(self.engine.loras, control, self.model_dir)
                except ValueError as e:   # AdapterError included: the folder, key and shape at fault
                    fail(pb_utils, sender, str(e))
                    continue
                text = np.array([[json.dumps(result).encode()]], dtype=np.object_)
                send(pb_utils, sender, {"text_output": text}, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            try:
                tensors = {}
                for name in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        tensors[name] = t.as_numpy()
                requested = frozenset(request.requested_output_names())
                spec = parse_llm_inputs(tensors, requested)
                key = next(self.keys)
                samples = fan_out(spec.params)   # n parallel samples: engine requests <key>#<i>
                reqs = [self.engine.make_request(f"{key}#{i}" if len(samples) > 1 else str(key), spec.prompt_ids, p)
                        for i, p in enumerate(samples)]
                carrier = triton_carrier(request) if self.tracer is not None else None
                if carrier:   # tritonserver traces this request (its sampling rate decides): the engine joins in
                    attributes = {"gen_ai.response.model": self.model_name, "gen_ai.request.n": len(reqs)}
                    if request.request_id():
                        attributes["trellm.client_request_id"] = request.request_id()
                    trace = RequestTrace(carrier, attributes)
                    for r in reqs:
                        r.trace = trace
            except ValueError as e:
                fail(pb_utils, sender, str(e))
                continue
            group = ResponseGroup(pb_utils, sender, len(reqs), self.engine.config.block_size, requested)
            interval = self.engine.config.stream_interval
            text_of = partial(run_text, self.tokenizer, skip_special_tokens=spec.params.skip_special_tokens) \
                if spec.outputs.text else None
            echo = spec.prompt_ids if spec.echo_prompt else None
            sinks = [SequenceSink(group, i, ResponsePlan(spec.stream, interval, text_of, echo), spec.outputs)
                     for i in range(len(reqs))]
            try:
                self.loop.submit(reqs, sinks, client_id=request.request_id())
            except QueueFull as e:
                group.fail(str(e), pb_utils.TritonError.UNAVAILABLE)
            except DuplicateClientId as e:
                group.fail(str(e))
        return None

    def finalize(self):
        if self.metrics is not None:
            self.metrics.stop()
        self.loop.stop()
        self.end_shutdown_watch()
        if self.tracer is not None:
            self.tracer.stop()
