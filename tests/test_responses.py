"""The llm model's response plumbing (backend/triton/responses.py) against a fake pb_utils: FINAL rides on the last
response of the last sequence, errors end a request once, a sender is never asked is_cancelled() after FINAL, and
no Tensor dies inside `send` (where tritonserver 2.51's stub would free it without the GIL)."""
from __future__ import annotations

import weakref

import numpy as np

from trellm_backend.engine.request import RequestOutput
from trellm_backend.triton.llm import ResponsePlan
from trellm_backend.triton.responses import ResponseGroup, SequenceSink, fail, is_stop_request

FINAL = 1


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class TritonError:
        INVALID_ARG, UNAVAILABLE = "INVALID_ARG", "UNAVAILABLE"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def as_numpy(self):
            return self.value

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors = {t.name: t.value for t in output_tensors}
            self.held = list(output_tensors)    # the C++ response's own references to its Tensors
            self.error = error

    @staticmethod
    def get_input_tensor_by_name(request, name):
        value = request.get(name)
        return None if value is None else FakePbUtils.Tensor(name, value)


class FakeSender:
    def __init__(self):
        self.sent, self.cancelled, self.asked_after_final = [], False, False

    def send(self, response, flags=0):
        # As 2.51's stub does with the GIL released: the response lets go of its Tensors (those pruned as
        # unrequested). A Tensor nobody else held would be freed right there, without the GIL.
        alive = [weakref.ref(t) for t in response.held]
        response.held.clear()
        dead = [r for r in alive if r() is None]
        assert not dead, f"{len(dead)} of {len(alive)} tensors were freed inside send"
        self.sent.append((response, flags))

    def is_cancelled(self):
        if any(flags == FINAL for _, flags in self.sent):
            self.asked_after_final = True
        return self.cancelled


def output(rid, token, text, finished=False, reason=None):
    return RequestOutput(rid, [token], finished, reason, num_prompt_tokens=3, num_output_tokens=1, text=text)


def test_final_rides_on_the_last_sequence_to_finish():
    sender = FakeSender()
    group = ResponseGroup(FakePbUtils, sender, num_sequences=2, block_size=16)
    spell = {5: "x", 6: "y", 7: "z"}
    plans = [ResponsePlan(stream=True, text_of=lambda run: "".join(spell[t] for t in run.token_ids)) for _ in range(2)]
    sinks = [SequenceSink(group, i, plans[i]) for i in range(2)]
    sinks[0].send(output("a", 5, "x"))
    sinks[1].send(output("b", 6, "y", finished=True, reason="length"))
    assert [flags for _, flags in sender.sent] == [0, 0]
    assert not sinks[0].is_cancelled()
    sinks[0].send(output("a", 7, "z", finished=True, reason="stop"))
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]
    last = sender.sent[-1][0].tensors
    assert set(last) == {"text_output", "finish_reason", "token_ids", "batch_index", "sequence_index"}
    assert last["text_output"].tolist() == [[b"z"]] and last["sequence_index"].tolist() == [[0]]
    sender.cancelled = True
    assert not sinks[1].is_cancelled() and not sender.asked_after_final   # never asked once FINAL is out
    sinks[1].fail("late")                                                 # nothing more after FINAL
    assert len(sender.sent) == 3


def test_a_failure_ends_the_request_once_with_its_code():
    sender = FakeSender()
    group = ResponseGroup(FakePbUtils, sender, num_sequences=2, block_size=16)
    group.fail("the server is at capacity", FakePbUtils.TritonError.UNAVAILABLE)
    group.fail("again")
    SequenceSink(group, 0, ResponsePlan(stream=True)).send(output("a", 5, "x"))
    ((response, flags),) = sender.sent
    assert flags == FINAL and response.error.code == "UNAVAILABLE" and response.error.message.endswith("capacity")
    other = FakeSender()
    fail(FakePbUtils, other, "top_p must be in (0, 1]")
    assert other.sent[0][0].error.code == "INVALID_ARG" and other.sent[0][1] == FINAL


def test_stop_requests_are_recognised():
    assert is_stop_request(FakePbUtils, {"stop": np.array([[True]])})
    assert not is_stop_request(FakePbUtils, {"stop": np.array([[False]])})
    assert not is_stop_request(FakePbUtils, {"input_ids": np.array([[1]])})


def test_only_requested_outputs_are_sent_and_none_is_freed_inside_send():
    for requested, names in [(None, {"text_output", "finish_reason", "token_ids", "batch_index", "sequence_index"}),
                             (frozenset({"token_ids", "finish_reason", "num_input_tokens"}),
                              {"token_ids", "finish_reason"})]:
        sender = FakeSender()
        group = ResponseGroup(FakePbUtils, sender, num_sequences=1, block_size=16, requested=requested)
        sink = SequenceSink(group, 0, ResponsePlan(stream=True, text_of=lambda run: "x" * len(run.token_ids)))
        sink.send(output("a", 5, "x"))
        sink.send(output("a", 6, "x", finished=True, reason="length"))
        assert [set(r.tensors) for r, _ in sender.sent] == [names, names]
        assert sender.sent[-1][0].tensors["token_ids"].tolist() == [[6]]
