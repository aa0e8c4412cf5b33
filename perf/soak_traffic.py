"""The kinds of traffic of perf/soak.py, each a callable(rng) that sends one request and returns its StreamOutcome:
well-formed (which also say whether they streamed), malformed (each must be refused), cancels, disconnects, and the
overload bursts."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from soak_requests import (Record, Requests, StreamOutcome, close_stream, ensemble_inputs, error_class,
                           grpc_error_outcome, llm_inputs, next_response, send, tensor, vllm_inputs, words)
from trellm_client.client import (AsyncLLMClient, LLMClient, build_inputs, channel_args, chunk_from_result,
                                  stop_stream)

PROMPTS = ["The Python language", "A function definition", "Lists and tuples", "The import statement",
           "Once upon a time", "Exceptions are raised when", "A dictionary maps", "Modules and packages"]

SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")   # whose --child is the killed client


class Traffic(Requests):
    """The requests of a soak on the entry `args.model` (`ensemble`, or an added model's name) and its llm and
    vllm_model, recorded as they end."""

    def __init__(self, args, server, vocab_size: int, prompt_char_limit: int):
        super().__init__(server, args.deadline)
        self.args = args
        self.ensemble = args.model
        self.llm = "llm" if args.model == "ensemble" else f"{args.model}_llm"
        vllm = "vllm_model" if args.model == "ensemble" else f"{args.model}_vllm_model"
        self.vllm = vllm if os.path.isdir(os.path.join(server.repo, vllm)) else None
        self.vocab_size, self.prompt_char_limit = vocab_size, prompt_char_limit
        self.t0 = time.monotonic()
        self.records: list[Record] = []
        self.lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, kind, category, outcome, start, ttft=None, message="") -> Record:
        r = Record(kind, category, outcome, round(start, 3), round(self.now(), 3),
                   None if ttft is None else round(ttft, 4), message[:300])
        with self.lock:
            self.records.append(r)
        return r

    def random_ids(self, rng, n=None) -> list[int]:
        n = n or rng.randint(4, 24)
        return [1] + [rng.randrange(4, self.vocab_size) for _ in range(n - 1)]

    def wellformed(self) -> dict:
        kinds = {
            "grpc_ensemble_stream": self._wf_ensemble_stream,
            "grpc_ensemble_generate": self._wf_ensemble_generate,
            "grpc_ensemble_chat": self._wf_ensemble_chat,
            "grpc_llm_stream": self._wf_llm_stream,
            "http_ensemble_generate": self._wf_http_generate,
            "http_ensemble_generate_stream": self._wf_http_generate_stream,
        }
        if self.vllm:
            kinds["grpc_vllm_stream"] = self._wf_vllm_stream
            kinds["http_vllm_generate_stream"] = self._wf_http_vllm_stream
        return kinds

    def _wf_ensemble_stream(self, rng):
        fields = {"max_tokens": rng.randint(8, 48), "stream": True}
        roll = rng.random()
        if roll < 0.3:
            fields.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32))
        elif roll < 0.45:
            fields.update(stop_words=[".", "\n\n"], bad_words=["the"])
        elif roll < 0.55:
            fields.update(num_return_sequences=2, temperature=1.0, seed=rng.randrange(2**32))
        elif roll < 0.65:
            fields.update(repetition_penalty=1.2, min_tokens=4, return_num_output_tokens=True)
        return self.grpc_stream(self.ensemble, ensemble_inputs(rng.choice(PROMPTS), **fields)), True

    def _wf_ensemble_generate(self, rng):
        fields = {"max_tokens": rng.randint(8, 48), "stream": False, "exclude_input_in_output": rng.random() < 0.5}
        return self.grpc_stream(self.ensemble, ensemble_inputs(rng.choice(PROMPTS), **fields)), False

    def _wf_ensemble_chat(self, rng):
        inputs = build_inputs(grpcclient, None, {"max_tokens": rng.randint(8, 32), "stream": True},
                              messages=[{"role": "user", "content": rng.choice(PROMPTS)}])
        return self.grpc_stream(self.ensemble, inputs), True

    def _wf_llm_stream(self, rng):
        inputs = llm_inputs(self.random_ids(rng), max_tokens=rng.randint(8, 48), stream=True)
        return self.grpc_stream(self.llm, inputs), True

    def _wf_vllm_stream(self, rng):
        sampling = {"max_tokens": rng.randint(8, 48), "temperature": 0.7, "seed": rng.randrange(2**32)}
        if rng.random() < 0.3:
            sampling.update(stop=["."], n=2)
        return self.grpc_stream(self.vllm, vllm_inputs(rng.choice(PROMPTS), sampling)), True

    def _wf_http_generate(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48)}
        return self.http(f"/v2/models/{self.ensemble}/generate", body, stream=False), False

    def _wf_http_generate_stream(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48), "stream": True}
        return self.http(f"/v2/models/{self.ensemble}/generate_stream", body, stream=True), True

    def _wf_http_vllm_stream(self, rng):
        body = {"text_input": rng.choice(PROMPTS), "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": rng.randint(8, 48)})}
        return self.http(f"/v2/models/{self.vllm}/generate_stream", body, stream=True), True

    def malformed(self) -> dict:
        """name -> a callable(rng) returning a StreamOutcome; every one must be refused."""
        e, lm = self.ensemble, self.llm
        over = "x" * (self.prompt_char_limit + 100)
        many = [b"w%d" % i for i in range(1025)]
        g = self.grpc_stream
        kinds = {
            "grpc_text_input_int32": lambda rng: g(e, [tensor("text_input", np.array([[3]], dtype=np.int32))]),
            "grpc_max_tokens_fp32": lambda rng: g(e, ensemble_inputs("hello") + [
                tensor("max_tokens", np.array([[5.0]], dtype=np.float32))]),
            "grpc_max_tokens_zero": lambda rng: g(e, ensemble_inputs("hello", max_tokens=0)),
            "grpc_max_tokens_negative": lambda rng: g(e, ensemble_inputs("hello", max_tokens=-3)),
            "grpc_top_p_1.5": lambda rng: g(e, ensemble_inputs("hello", top_p=1.5)),
            "grpc_temperature_nan": lambda rng: g(e, ensemble_inputs("hello", temperature=float("nan"))),
            "grpc_n_17": lambda rng: g(e, ensemble_inputs("hello", num_return_sequences=17)),
            "grpc_beam_width_4": lambda rng: g(e, ensemble_inputs("hello", beam_width=4)),
            "grpc_end_id_out_of_vocab": lambda rng: g(e, ensemble_inputs("hello", end_id=self.vocab_size + 10)),
            "grpc_empty_prompt": lambda rng: g(e, ensemble_inputs("")),
            "grpc_missing_prompt": lambda rng: g(e, ensemble_inputs(None, max_tokens=4)),
            "grpc_invalid_utf8_prompt": lambda rng: g(e, ensemble_inputs(b"\xff\xfe bad \xc3\x28")),
            "grpc_oversize_prompt": lambda rng: g(e, ensemble_inputs(over)),
            "grpc_prompt_past_context": lambda rng: g(e, ensemble_inputs("hello " * 3000)),
            "grpc_1025_bad_words": lambda rng: g(e, ensemble_inputs("hello") + [words("bad_words", many)]),
            "grpc_257_char_bad_word": lambda rng: g(e, ensemble_inputs("hello") + [words("bad_words", [b"y" * 257])]),
            "grpc_invalid_utf8_bad_word": lambda rng: g(e, ensemble_inputs("hello") + [
                words("bad_words", [b"ok", b"\xff\xfe"])]),
            "grpc_65_stop_words": lambda rng: g(e, ensemble_inputs("hello") + [words("stop_words", many[:65])]),
            "grpc_messages_not_json": lambda rng: g(e, [tensor("messages", np.array([[b"not json"]], np.object_))]),
            "grpc_prompt_and_messages": lambda rng: g(e, ensemble_inputs("hello") + [
                tensor("messages", np.array([[b'[{"role": "user", "content": "hi"}]']], dtype=np.object_))]),
            "grpc_llm_id_out_of_vocab": lambda rng: g(lm, llm_inputs([1, self.vocab_size + 5, 7], max_tokens=4)),
            "grpc_llm_negative_id": lambda rng: g(lm, llm_inputs([1, -5, 7], max_tokens=4)),
            "grpc_llm_missing_input_ids": lambda rng: g(lm, llm_inputs(None, max_tokens=4)),
            "grpc_llm_input_ids_fp32": lambda rng: g(lm, [tensor("input_ids", np.array([[1.0, 2.0]], np.float32))]),
            "grpc_llm_prompt_past_context": lambda rng: g(lm, llm_inputs(self.random_ids(rng, 2100), max_tokens=4)),
            "grpc_llm_input_lengths_mismatch": lambda rng: g(lm, llm_inputs([1, 5, 6], max_tokens=4) + [
                tensor("input_lengths", np.array([[9]], dtype=np.int32))]),
            "grpc_unary_infer_on_decoupled": self._mf_unary,
            "grpc_unknown_model": lambda rng: g("no_such_model", ensemble_inputs("hello")),
            "http_body_not_json": lambda rng: self.http(f"/v2/models/{e}/generate", b"{not json", stream=False),
            "http_empty_body": lambda rng: self.http(f"/v2/models/{e}/generate", b"", stream=False),
            "http_max_tokens_string": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                            {"text_input": "hello", "max_tokens": "abc"}, stream=False),
            "http_unknown_field": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                        {"text_input": "hello", "max_tokns": 5}, stream=False),
            "http_top_p_out_of_range": lambda rng: self.http(f"/v2/models/{e}/generate_stream",
                                                             {"text_input": "hi", "top_p": 2.0, "stream": True},
                                                             stream=True),
            "http_invalid_utf8_body": lambda rng: self.http(f"/v2/models/{e}/generate",
                                                            b'{"text_input": "\xff\xfe", "max_tokens": 4}', stream=False),
            "http_unknown_model": lambda rng: self.http("/v2/models/no_such_model/generate", {"text_input": "hi"},
                                                        stream=False),
        }
        if self.vllm:
            v = self.vllm
            kinds.update({
                "grpc_vllm_sampling_not_json": lambda rng: g(v, vllm_inputs("hello", "{max_tokens")),
                "grpc_vllm_unknown_key": lambda rng: g(v, vllm_inputs("hello", {"max_tokns": 5})),
                "grpc_vllm_max_tokens_string": lambda rng: g(v, vllm_inputs("hello", {"max_tokens": "abc"})),
                "grpc_vllm_n_zero": lambda rng: g(v, vllm_inputs("hello", {"n": 0})),
                "grpc_vllm_invalid_utf8_prompt": lambda rng: g(v, vllm_inputs(b"\xff bad")),
                "http_vllm_max_tokens_huge": lambda rng: self.http(
                    f"/v2/models/{v}/generate", {"text_input": "hi", "sampling_parameters":
                                                 json.dumps({"max_tokens": 4294967301})}, stream=False),
            })
        return kinds

    def _mf_unary(self, rng):
        client = grpcclient.InferenceServerClient(self.server_grpc, channel_args=channel_args())
        try:
            client.infer(self.ensemble, ensemble_inputs("hello", max_tokens=2), client_timeout=self.deadline)
            return StreamOutcome("ok")
        except InferenceServerException as e:
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)
        finally:
            client.close()

    def cancels(self) -> dict:
        long_llm = dict(max_tokens=2000, ignore_eos=True, stream=True)
        kinds = {
            "grpc_cancel_llm": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm),
                after=lambda c: stop_stream(c, cancel=True)),
            # On Triton 2.51 a cancel does not reach the ensemble's running llm step: it runs to its end, so bounded.
            "grpc_cancel_ensemble": lambda rng: self.grpc_stream(
                self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=64, min_tokens=64, stream=True),
                after=lambda c: stop_stream(c, cancel=True)),
            "grpc_cancel_right_after_send": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm), after_n=0,
                after=lambda c: stop_stream(c, cancel=True)),
            # Read to the final response, then cancelled: tritonserver 2.51 keeps such a stream's state for good
            # (soak.py leaves this kind out on servers before 2.57 unless --kinds names it).
            "grpc_cancel_after_final": lambda rng: self.grpc_stream(
                self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=8, stream=True), cancel_at_close=True),
            "llmclient_leave_early": self._cancel_llmclient,
            "async_llmclient_leave_early": self._cancel_async_llmclient,
            "stop_request_ensemble": self._cancel_stop_request,
        }
        if self.vllm:
            kinds["grpc_cancel_vllm"] = lambda rng: self.grpc_stream(
                self.vllm, vllm_inputs(rng.choice(PROMPTS), {"max_tokens": 2000, "ignore_eos": True}),
                after=lambda c: stop_stream(c, cancel=True))
        return kinds

    def _cancel_llmclient(self, rng):
        start = time.monotonic()
        try:
            with LLMClient(self.server_grpc, model=self.ensemble) as c:
                chunks = c.stream_chunks(rng.choice(PROMPTS), max_tokens=2000, min_tokens=2000, stream=True)
                ttft = None
                for i, chunk in enumerate(chunks):
                    if chunk.text and ttft is None:
                        ttft = time.monotonic() - start
                    if i == 2 or chunk.final:
                        break
                chunks.close()          # the stop request goes out here
            return StreamOutcome("ok", ttft, 3)
        except Exception as e:  # noqa: BLE001 - the error is the outcome
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)

    def _cancel_async_llmclient(self, rng):
        async def leave_early():
            async with AsyncLLMClient(self.server_grpc, model=self.ensemble) as c:
                stream = c.stream(rng.choice(PROMPTS), max_tokens=2000, min_tokens=2000)
                for _ in range(3):
                    await asyncio.wait_for(stream.__anext__(), self.deadline)
                await stream.aclose()
        try:
            asyncio.run(asyncio.wait_for(leave_early(), self.deadline))
            return StreamOutcome("ok", responses=3)
        except asyncio.TimeoutError:
            return StreamOutcome("hung", message=f"not done after {self.deadline} s")
        except Exception as e:  # noqa: BLE001
            outcome, msg = grpc_error_outcome(e)
            return StreamOutcome(outcome, message=msg)

    def _cancel_stop_request(self, rng):
        """An ensemble stream stopped by a stop request to llm naming its request id (on a second stream, once 3
        responses came; its answer is awaited while this stream reads on): it must end with finish_reason abort."""
        rid = f"soak-{uuid.uuid4().hex}"
        res = self.grpc_stream(self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=2000, min_tokens=2000,
                                                              stream=True), rid, read_on=True,
                               after=lambda client: self.grpc_stream(self.llm, [tensor("stop", np.array([[True]]))],
                                                                     request_id=rid, deadline=10))
        if res.outcome == "ok" and res.finish_reason != "abort":
            res.outcome = f"ended with finish_reason {res.finish_reason or 'none'}"
        return res

    def disconnects(self) -> dict:
        def close_channel(client):
            client._channel.close()      # the connection goes, no stop_stream: a client vanishing mid-stream

        def close_socket(conn):
            conn.sock.shutdown(socket.SHUT_RDWR)
        long_llm = dict(max_tokens=2000, ignore_eos=True, stream=True)
        kinds = {
            "grpc_channel_close_llm": lambda rng: self.grpc_stream(
                self.llm, llm_inputs(self.random_ids(rng), **long_llm), after=close_channel),
            "grpc_channel_close_ensemble": lambda rng: self.grpc_stream(
                self.ensemble, ensemble_inputs(rng.choice(PROMPTS), max_tokens=64, min_tokens=64, stream=True),
                after=close_channel),
            "kill_grpc_client_process": lambda rng: self.killed_client("grpc", rng),
            "kill_http_client_process": lambda rng: self.killed_client("http", rng),
            "http_close_mid_generate_stream": lambda rng: self.http(
                f"/v2/models/{self.ensemble}/generate_stream",
                {"text_input": rng.choice(PROMPTS), "max_tokens": 64, "min_tokens": 64, "stream": True},
                stream=True, after=close_socket),
            "http_close_before_generate_answer": lambda rng: self.http(
                f"/v2/models/{self.ensemble}/generate",
                {"text_input": rng.choice(PROMPTS), "max_tokens": 64, "min_tokens": 64},
                stream=False, after=close_socket, after_n=0),
            "http_close_mid_request_body": self._half_sent_body,
        }
        if self.vllm:
            kinds["grpc_channel_close_vllm"] = lambda rng: self.grpc_stream(
                self.vllm, vllm_inputs(rng.choice(PROMPTS), {"max_tokens": 2000, "ignore_eos": True}),
                after=close_channel)
            kinds["http_close_mid_vllm_generate_stream"] = lambda rng: self.http(
                f"/v2/models/{self.vllm}/generate_stream",
                {"text_input": rng.choice(PROMPTS), "stream": True,
                 "sampling_parameters": json.dumps({"max_tokens": 2000, "ignore_eos": True})},
                stream=True, after=close_socket)
        return kinds

    def _half_sent_body(self, rng):
        try:
            with socket.create_connection(("localhost", self.server.traffic_http_port), timeout=10) as s:
                s.sendall(b"POST /v2/models/%s/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                          b"\r\nContent-Length: 4000\r\n\r\n{\"text_input\": \"Lists\", \"max_tok" % self.ensemble.encode())
                time.sleep(0.05)
            return StreamOutcome("ok")
        except OSError as e:
            return StreamOutcome(f"error: {error_class(f'{type(e).__name__} {e}')}", message=str(e))

    def killed_client(self, how: str, rng) -> StreamOutcome:
        """A client process (soak.py --child) that streams until it says it is streaming, then gets SIGKILL."""
        target = rng.choice(["llm", "vllm"] if self.vllm else ["llm"]) if how == "grpc" else \
            rng.choice(["ensemble", "vllm"] if self.vllm else ["ensemble"])
        model = {"llm": self.llm, "vllm": self.vllm, "ensemble": self.ensemble}[target]
        port = self.server.traffic_grpc_port if how == "grpc" else self.server.traffic_http_port
        proc = subprocess.Popen([sys.executable, SOAK, "--child", how, str(port), target, model,
                                 str(self.vocab_size)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], self.deadline)
            text = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
            outcome, _, message = text.partition("|")
            if text == "streaming":
                return StreamOutcome("ok", responses=1)
            if outcome.startswith("error") or outcome == "hung":
                return StreamOutcome(outcome, message=message)
            if not text and proc.poll() is None:
                return StreamOutcome("hung", message=f"the client process did not stream within {self.deadline} s")
            return StreamOutcome(f"error: client process ended ({text[:60] or proc.poll()})", message=text)
        finally:
            proc.kill()
            proc.wait()

    def bursts(self) -> list:
        targets = ["burst_grpc_llm", "burst_grpc_ensemble", "burst_http_ensemble_generate"]
        if self.vllm:
            targets.insert(2, "burst_grpc_vllm")
        return targets

    def burst(self, kind: str, size: int, max_tokens: int = 16) -> list[Record]:
        """`size` requests at once: on one gRPC stream, or one HTTP connection each."""
        start = self.now()
        if kind == "burst_http_ensemble_generate":
            results: list = [None] * size

            def one(i):
                results[i] = self.http(f"/v2/models/{self.ensemble}/generate",
                                       {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                        "min_tokens": max_tokens}, stream=False)
            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.deadline + 5)
            return [self.record(kind, "overload", r.outcome if r else "hung", start, message=r.message if r else "")
                    for r in results]
        q: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.server_grpc, channel_args=channel_args())
        outcomes: list[tuple[str, str]] = []
        settled = False
        try:
            client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
            for i in range(size):
                if kind == "burst_grpc_llm":
                    inputs = llm_inputs([1, 100 + i, 200, 300], max_tokens=max_tokens, ignore_eos=True, stream=True)
                    model = self.llm
                elif kind == "burst_grpc_vllm":
                    inputs = vllm_inputs(PROMPTS[i % len(PROMPTS)], {"max_tokens": max_tokens, "ignore_eos": True})
                    model = self.vllm
                else:
                    inputs = ensemble_inputs(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, min_tokens=max_tokens,
                                             stream=True)
                    model = self.ensemble
                broken = send(client, q, model, inputs, f"burst-{uuid.uuid4().hex}")
                if broken is not None:
                    outcomes += [grpc_error_outcome(broken)] * (size - i)
                    break
            end = time.monotonic() + self.deadline
            finals: set[str] = set()
            errors: list[tuple[str, str]] = []
            while len(finals) + len(errors) + len(outcomes) < size:
                got = next_response(q, end)
                if got is None:
                    break
                _, result, error = got
                if error is not None:
                    errors.append(grpc_error_outcome(error))
                    if not errors[-1][0].startswith("error:"):  # a gRPC status: the stream itself broke, and
                        # every request still on it with it (model errors on a stream carry no status on 2.51)
                        errors.extend([errors[-1]] * (size - len(finals) - len(errors) - len(outcomes)))
                elif chunk_from_result(result).final:
                    finals.add(result.get_response().id)
            outcomes += [("ok", "")] * len(finals) + errors
            settled = len(outcomes) == size
            outcomes += [("hung", f"no final response after {self.deadline} s")] * (size - len(outcomes))
        finally:
            close_stream(client, settled)
        return [self.record(kind, "overload", o, start, message=m) for o, m in outcomes]
