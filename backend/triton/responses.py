"""The response side of a decoupled Triton model, with `pb_utils` passed in (so it is unit-tested with a fake).

One Triton request of `llm` may fan out into n engine requests (parallel samples); they share one response sender,
and FINAL must ride on the last response of the last sequence to finish. A sender whose FINAL is out must never
be asked `is_cancelled()` again: on tritonserver 2.51 that reads a freed response factory and segfaults.
"""
from __future__ import annotations

import threading

from trellm_backend.engine.request import RequestOutput
from trellm_backend.triton.llm import OutputSwitches, ResponsePlan, response_tensors


def send(pb_utils, sender, tensors: dict, flags: int = 0, requested: frozenset[str] | None = None) -> None:
    """Send one response of `tensors` ({name: array}), only the names in `requested` (None: all).

    tritonserver 2.51's stub releases the GIL in `send` and then drops the tensors the caller did not request. A
    Tensor whose last reference went there was freed without the GIL, and the interpreter's memory was corrupted
    while another thread ran Python: the stub segfaulted later in numpy, in whatever thread touched the freed
    memory (python_backend fixed it after 2.51: "Hold GIL when deleting numpy array"). So nothing unrequested is
    sent, and this frame holds every Tensor until `send` has returned."""
    kept = [pb_utils.Tensor(n, v) for n, v in tensors.items() if requested is None or n in requested]
    sender.send(pb_utils.InferenceResponse(output_tensors=kept), flags=flags)
    del kept   # here, with the GIL held


def fail(pb_utils, sender, message: str, code=None) -> None:
    """End a request with one error response (INVALID_ARG unless `code` says otherwise)."""
    error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG if code is None else code)
    sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def is_stop_request(pb_utils, request) -> bool:
    """A TRT-LLM-style stop request: `stop`=true (with the request_id of the generation to abort)."""
    t = pb_utils.get_input_tensor_by_name(request, "stop")
    return t is not None and bool(t.as_numpy().reshape(-1)[0])


def lora_control(pb_utils, request) -> str | None:
    """The JSON of a LoRA control request (its `lora_control` input), or None for any other request."""
    t = pb_utils.get_input_tensor_by_name(request, "lora_control")
    if t is None:
        return None
    value = t.as_numpy().reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


class ResponseGroup:
    """The response sender of one Triton request, shared by its n sequences."""

    def __init__(self, pb_utils, sender, num_sequences: int, block_size: int,
                 requested: frozenset[str] | None = None):
        self.pb = pb_utils
        self.sender, self.remaining, self.block_size = sender, num_sequences, block_size
        self.requested = requested    # the output names the request asked for (None: all)
        self.lock = threading.Lock()
        self.done = False

    def send(self, tensors: dict, sequence_finished: bool) -> None:
        pb = self.pb
        with self.lock:
            if self.done:
                return
            self.remaining -= sequence_finished
            self.done = self.remaining == 0
            send(pb, self.sender, tensors, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if self.done else 0, self.requested)

    def fail(self, message: str, code=None) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                fail(self.pb, self.sender, message, code)

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.done and self.sender.is_cancelled()


class SequenceSink:
    """The engine loop's OutputSink for one sequence: its outputs, shaped by a ResponsePlan and cut to the outputs
    the request switched on, go out through the group's sender."""

    def __init__(self, group: ResponseGroup, sequence_index: int, plan: ResponsePlan,
                 outputs: OutputSwitches = OutputSwitches()):
        self.group, self.index, self.plan, self.outputs = group, sequence_index, plan, outputs

    def send(self, output: RequestOutput) -> None:
        p = self.plan.on_output(output)
        if p is not None:
            self.group.send(response_tensors(p, self.index, self.group.block_size, self.outputs), p.finished)

    def fail(self, message: str) -> None:
        self.group.fail(message)

    def is_cancelled(self) -> bool:
        return self.group.is_cancelled()
