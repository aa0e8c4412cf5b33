"""Triton's KServe gRPC API on the front door's port (openai_api/grpc_relay.py), relayed to a real tritonserver whose
own gRPC port listens on loopback: tritonclient's gRPC clients work through it unchanged, keys and limits hold,
admin calls are refused, and no public port in any model control mode takes an uploaded model.py."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from google.rpc import error_details_pb2, status_pb2
from tritonclient.utils import InferenceServerException

from conftest import free_ports
from trellm_backend.tools import launch
from trellm_backend.tools.testbed import listening_addresses, perf_analyzer_env
from trellm_client.client import infer_input

pytestmark = pytest.mark.server
PROMPT = "The Python language"
KEYS = """
sk-good      name=good
sk-twice     name=twice    rpm=2
sk-one       name=one      concurrency=1
sk-tokens    name=tokens   tpm=40
"""
GOOD = {"authorization": "Bearer sk-good"}


@pytest.fixture(scope="module")
def door(triton_server, tmp_path_factory):
    """A front door with a keys file and its gRPC relay, on the session's server: (HTTP address, gRPC address)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    http_port, grpc_port = free_ports(2)
    proc = launch.start_front_door(triton_server, http_port, str(keys), grpc_port=grpc_port, host="127.0.0.1")
    yield f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    launch.stop_front_door(proc)


def ensemble_inputs(module, prompt: str = PROMPT, max_tokens: int = 12) -> list:
    return [infer_input(module, "text_input", np.array([[prompt.encode()]], dtype=object)),
            infer_input(module, "max_tokens", np.array([[max_tokens]], dtype=np.int32)),
            infer_input(module, "stream", np.array([[True]])),
            infer_input(module, "ignore_eos", np.array([[True]]))]


def stream_text(url: str, headers: dict | None, requests: int = 1, prompt: str = PROMPT,
                max_tokens: int = 12) -> list[str]:
    """The streamed text of `requests` ensemble requests sent on one sync tritonclient stream, in request order."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    try:
        for i in range(requests):
            client.async_stream_infer("ensemble", ensemble_inputs(grpcclient, prompt, max_tokens), request_id=str(i))
        texts, finished = {str(i): "" for i in range(requests)}, 0
        while finished < requests:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            response = result.get_response()
            texts[response.id] += result.as_numpy("text_output").reshape(-1)[0].decode()
            finished += response.parameters["triton_final_response"].bool_param
        return [texts[str(i)] for i in range(requests)]
    finally:
        client.stop_stream()
        client.close()


def stream_status(url: str, headers: dict | None) -> str | None:
    """The status a sync tritonclient stream ends with after one ensemble request (its callback's error)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put(error), headers=headers)
    try:
        try:
            client.async_stream_infer("ensemble", ensemble_inputs(grpcclient))
        except InferenceServerException:
            pass    # the stream had already ended: its callback has the reason
        error = results.get(timeout=60)
        return None if error is None else error.status()
    finally:
        client.stop_stream()
        client.close()


def test_triton_grpc_listens_on_loopback_only(triton_server):
    assert listening_addresses(triton_server.grpc_port) == {"127.0.0.1"}
    assert listening_addresses(triton_server.http_port) == {"127.0.0.1"}


def test_tritonclient_grpc_works_through_the_relay_as_on_triton(triton_server, door):
    _, relay = door
    client = grpcclient.InferenceServerClient(relay)
    assert client.is_server_live() and client.is_server_ready()        # health wants no key
    assert client.is_model_ready("ensemble", headers=GOOD)
    direct = grpcclient.InferenceServerClient(triton_server.grpc_url)
    assert client.get_model_metadata("ensemble", headers=GOOD) == direct.get_model_metadata("ensemble")
    assert client.get_model_config("llm", headers=GOOD).config.model_transaction_policy.decoupled
    assert client.get_server_metadata(headers=GOOD).name == "triton"
    assert client.get_inference_statistics("ensemble", headers=GOOD).model_stats[0].name == "ensemble"
    # a non-decoupled model's unary infer
    text = infer_input(grpcclient, "text_input", np.array([[PROMPT.encode()]], dtype=object))
    ids = client.infer("preprocess", [text], headers=GOOD)
    assert ids.as_numpy("input_ids").shape[-1] > 1
    # a stream: the same text as Triton's own port, and two requests on one stream each get their own answer
    expected = stream_text(triton_server.grpc_url, None)[0]
    assert expected and stream_text(relay, GOOD) == [expected]
    assert stream_text(relay, GOOD, requests=2) == [expected, expected]


def test_tritonclient_grpc_aio_works_through_the_relay(triton_server, door):
    _, relay = door

    async def run():
        client = grpcaio.InferenceServerClient(relay)
        try:
            assert await client.is_server_ready()

            async def requests():
                yield {"model_name": "ensemble", "inputs": ensemble_inputs(grpcaio), "request_id": "a"}
            text = ""
            async for result, error in client.stream_infer(requests(), headers=GOOD):
                assert error is None, error
                text += result.as_numpy("text_output").reshape(-1)[0].decode()
            return text
        finally:
            await client.close()
    assert asyncio.run(run()) == stream_text(triton_server.grpc_url, None)[0]


def test_no_key_or_a_wrong_key_is_unauthenticated(door):
    _, relay = door
    client = grpcclient.InferenceServerClient(relay)
    for headers in (None, {"authorization": "Bearer sk-wrong"}, {"authorization": "sk-good"}):
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("ensemble", headers=headers)
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        assert stream_status(relay, headers) == "StatusCode.UNAUTHENTICATED"


def test_admin_calls_are_refused_even_with_a_good_key(door, tmp_path):
    _, relay = door
    client = grpcclient.InferenceServerClient(relay)
    calls = [lambda: client.load_model("uploaded", config=json.dumps(UPLOADED_CONFIG), files=upload_files(tmp_path),
                                       headers=GOOD),
             lambda: client.unload_model("ensemble", headers=GOOD),
             lambda: client.get_model_repository_index(headers=GOOD),
             lambda: client.register_system_shared_memory("r", "/r", 64, headers=GOOD),
             lambda: client.get_system_shared_memory_status(headers=GOOD),
             lambda: client.unregister_cuda_shared_memory(headers=GOOD),
             lambda: client.get_trace_settings(headers=GOOD),
             lambda: client.update_log_settings({"log_verbose_level": 1}, headers=GOOD)]
    for call in calls:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.PERMISSION_DENIED", e.value
    assert not (tmp_path / "ran").exists()
    assert client.is_model_ready("ensemble", headers=GOOD)


def test_over_a_limit_is_resource_exhausted_with_retry_information(door):
    _, relay = door
    twice = {"authorization": "Bearer sk-twice"}
    channel = grpc.insecure_channel(relay)
    ready = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    client = grpcclient.InferenceServerClient(relay)
    text = [infer_input(grpcclient, "text_input", np.array([[PROMPT.encode()]], dtype=object))]
    for _ in range(2):
        client.infer("preprocess", text, headers=twice)
    with pytest.raises(InferenceServerException) as e:
        client.infer("preprocess", text, headers=twice)
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "retry after" in e.value.message()
    # the trailers: seconds to wait, and google.rpc.RetryInfo
    from tritonclient.grpc import service_pb2
    request = service_pb2.ModelInferRequest(model_name="preprocess")
    with pytest.raises(grpc.RpcError) as raw:
        ready(request.SerializeToString(), metadata=tuple(twice.items()))
    trailers = dict(raw.value.trailing_metadata())
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 1 <= int(trailers["retry-after"]) <= 60
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.seconds == int(trailers["retry-after"])
    channel.close()
    # the first stream request over the limit ends its stream with the same code
    assert stream_status(relay, twice) == "StatusCode.RESOURCE_EXHAUSTED"


def test_a_token_limit_counts_what_the_model_says_without_changing_the_answer(triton_server, door):
    """Key `tokens` may use 40 tokens a minute. Its requests ask for no token counts; the relay asks the model for
    them on its behalf, counts them, and takes them out again, so the client sees what it would see on Triton's own
    port. Requests are admitted while the minute has tokens left, then refused with RESOURCE_EXHAUSTED."""
    _, relay = door
    key = {"authorization": "Bearer sk-tokens"}
    results: queue.Queue = queue.Queue()
    direct = grpcclient.InferenceServerClient(triton_server.grpc_url)
    direct.start_stream(callback=lambda result, error: results.put((result, error)))
    counts = [infer_input(grpcclient, "return_num_input_tokens", np.array([[True]])),
              infer_input(grpcclient, "return_num_output_tokens", np.array([[True]]))]
    direct.async_stream_infer("ensemble", ensemble_inputs(grpcclient) + counts)
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    direct.stop_stream()
    per_request = int(result.as_numpy("num_input_tokens").reshape(-1)[0] + result.as_numpy("num_output_tokens")
                      .reshape(-1)[0])
    # the first request: the text Triton's own port gives, and no count outputs the client had not asked for
    client = grpcclient.InferenceServerClient(relay)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=key)
    client.async_stream_infer("ensemble", ensemble_inputs(grpcclient))
    text, names = "", set()
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        text += result.as_numpy("text_output").reshape(-1)[0].decode()
        names |= {o.name for o in result.get_response().outputs}
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    assert text == stream_text(triton_server.grpc_url, None)[0]
    assert "text_output" in names and not names & {"num_input_tokens", "num_output_tokens"}
    admitted = 1
    while stream_status(relay, key) is None:
        admitted += 1
        assert admitted < 10, "the token limit never refused"
    assert admitted == -(-40 // per_request)      # admitted while the minute's 40 tokens were not all used
    assert stream_status(relay, key) == "StatusCode.RESOURCE_EXHAUSTED"


def test_a_stream_request_over_the_concurrency_limit_fails_alone(triton_server, door):
    """Key `one` may run one request at a time: the second request on its stream, sent while the first runs, gets
    an error response of its own, and the first is answered whole."""
    _, relay = door
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(relay)
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"authorization": "Bearer sk-one"})
    try:
        client.async_stream_infer("ensemble", ensemble_inputs(grpcclient, max_tokens=48), request_id="first")
        client.async_stream_infer("ensemble", ensemble_inputs(grpcclient), request_id="second")
        text, errors = "", []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                errors.append(error)
                continue
            text += result.as_numpy("text_output").reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert len(errors) == 1 and "1 concurrent" in errors[0].message() and "retry after" in errors[0].message()
        assert text == stream_text(triton_server.grpc_url, None, max_tokens=48)[0]
    finally:
        client.stop_stream()
        client.close()
    # its slot is free again once the stream's request ended
    assert len(stream_text(relay, {"authorization": "Bearer sk-one"})[0]) > 0


def test_perf_analyzer_measures_through_the_relay_with_a_key(door, tmp_path):
    _, relay = door
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"data": [{"text_input": [PROMPT], "max_tokens": [8], "stream": [True]}]}))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "perf_analyzer"), "-m", "ensemble", "-u", relay,
                        "-i", "grpc", "--streaming", "-H", "authorization:Bearer sk-good", "--input-data",
                        str(inputs), "--concurrency-range", "2", "--measurement-mode", "count_windows",
                        "--measurement-request-count", "6", "--stability-percentage", "100"],
                       capture_output=True, text=True, timeout=300, env=perf_analyzer_env())
    assert r.returncode == 0 and "Throughput:" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    # and without the key it is refused
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "perf_analyzer"), "-m", "ensemble", "-u", relay,
                        "-i", "grpc", "--streaming", "--input-data", str(inputs), "--concurrency-range", "1",
                        "--measurement-mode", "count_windows", "--measurement-request-count", "2"],
                       capture_output=True, text=True, timeout=120, env=perf_analyzer_env())
    assert r.returncode != 0 and "API key" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_bad_connection_costs_one_log_line_and_others_go_on(door):
    import socket
    _, relay = door
    host, port = relay.rsplit(":", 1)
    junks = (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 40)
    for junk in junks:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(2)
            try:
                s.recv(1024)
            except OSError:
                pass
    assert len(stream_text(relay, GOOD)[0]) > 0


# -- no public port takes an uploaded model.py, in any model control mode --------------------------------------------
UPLOADED_CONFIG = {"name": "uploaded", "backend": "python", "max_batch_size": 0,
                   "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
                   "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}


def upload_files(marker_dir) -> dict[str, bytes]:
    """A model.py that, if the server ever ran it, would leave a file named `ran` in `marker_dir`."""
    source = textwrap.dedent(f"""
        open({str(marker_dir / "ran")!r}, "w").write("uploaded code ran")
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """)
    return {"file:1/model.py": source.encode()}


def echo_repository(root) -> str:
    """A repository of one small Python model, quick to load."""
    model = root / "repo" / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(textwrap.dedent("""
        backend: "python"
        max_batch_size: 0
        input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]
        output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]
        instance_group [{ kind: KIND_CPU, count: 1 }]
    """))
    (model / "1" / "model.py").write_text(textwrap.dedent("""
        import triton_python_backend_utils as pb_utils
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(
                    r, "IN").as_numpy())]) for r in requests]
    """))
    return str(root / "repo")


@pytest.mark.parametrize("mode", ["explicit", "poll", "none"])
def test_an_uploaded_model_py_is_refused_on_every_public_port(mode, tmp_path):
    """Triton's own ports made public (with the launcher's admin key) and the front door's HTTP and gRPC ports: the
    upload is refused on each and nothing runs; with the admin key Triton's own port takes repository calls."""
    http, grpc_port, metrics, door_http, door_grpc = free_ports(5)
    server = launch.TritonServer(echo_repository(tmp_path), http, grpc_port, metrics, log_path=str(tmp_path / "log"),
                                 model_control_mode=mode, load_models=["echo"] if mode == "explicit" else None,
                                 http_public=True, grpc_public=True, admin_key="adm1n-key").start(timeout=120)
    door = None
    try:
        door = launch.start_front_door(server, door_http, None, grpc_port=door_grpc, host="127.0.0.1")
        config, files = json.dumps(UPLOADED_CONFIG), upload_files(tmp_path)
        grpc_triton = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        http_triton = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        for upload in (lambda: grpc_triton.load_model("uploaded", config=config, files=files),
                       lambda: http_triton.load_model("uploaded", config=config, files=files),
                       lambda: grpcclient.InferenceServerClient(f"127.0.0.1:{door_grpc}").load_model(
                           "uploaded", config=config, files=files),
                       lambda: httpclient.InferenceServerClient(f"127.0.0.1:{door_http}").load_model(
                           "uploaded", config=config, files=files),
                       lambda: grpc_triton.unload_model("echo"),
                       lambda: http_triton.register_system_shared_memory("r", "/r", 64)):
            with pytest.raises(InferenceServerException):
                upload()
        time.sleep(0.5)
        assert not (tmp_path / "ran").exists()
        assert grpc_triton.is_model_ready("echo")
        # Triton's own public ports, with the admin key, still serve the repository API to the operator
        assert [m.name for m in grpc_triton.get_model_repository_index(
            headers=server.grpc_admin_headers).models] == ["echo"]
        assert [m["name"] for m in http_triton.get_model_repository_index(headers=server.admin_headers)] == ["echo"]
        assert listening_addresses(grpc_port) - {"127.0.0.1"}, "--grpc-public listens on every interface"
        # the front door still lists models: it reads Triton's repository index with the admin key
        with urllib.request.urlopen(f"http://127.0.0.1:{door_http}/v1/models", timeout=30) as r:
            assert r.status == 200 and json.load(r)["object"] == "list"
    finally:
        if door is not None:
            launch.stop_front_door(door)
        server.stop()
