"""What the front door's gRPC relay costs by itself: a stand-in upstream that answers each streamed request at once
(one response with text, then the final flag), reached directly and through `GrpcRelay` in a process of its own.
No engine runs, so the difference is the relay's two extra hops on a quiet host; perf/relay_overhead.py measures the
same relay in front of a real tritonserver.

    .venv/bin/python perf/relay_stand_in.py [--requests 300]

Requests one at a time, alternating between the paths, each on a ModelStreamInfer of its own (as a
tritonclient.grpc.aio client sends them); prints each path's first-response latency p50 and mean, and the difference.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

SERVICE = "inference.GRPCInferenceService"
WARM_UP = 5


async def stand_in(port: int) -> None:
    """An upstream whose every streamed request gets a text response and then its flag-only final one."""
    async def stream(request_iterator, context):
        async for raw in request_iterator:
            request = service_pb2.ModelInferRequest.FromString(raw)
            text = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            out = text.outputs.add(name="text_output", datatype="BYTES")
            out.shape.extend([1, 1])
            text.raw_output_contents.append(np.array([1], dtype="<u4").tobytes() + b"x")
            text.parameters["triton_final_response"].bool_param = False
            yield service_pb2.ModelStreamInferResponse(infer_response=text).SerializeToString()
            final = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            final.parameters["triton_final_response"].bool_param = True
            yield service_pb2.ModelStreamInferResponse(infer_response=final).SerializeToString()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def relay(upstream_port: int, port: int) -> None:
    from trellm_openai import grpc_relay
    from trellm_openai.keys import KeyStore, Limiter
    server = await grpc_relay.serve(grpc_relay.GrpcRelay(f"127.0.0.1:{upstream_port}", KeyStore(None), Limiter()),
                                    "127.0.0.1", port)
    await server.wait_for_termination()


async def first_response_s(client, aio) -> float:
    text = aio.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hi"]], dtype=object))

    async def requests():
        yield {"model_name": "ensemble", "inputs": [text]}
    start, first = time.perf_counter(), None
    async for _result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(str(error))
        if first is None:
            first = time.perf_counter() - start
    return first


async def measure(ports: dict[str, int], requests: int) -> dict[str, list[float]]:
    from tritonclient.grpc import aio
    clients = {name: aio.InferenceServerClient(f"127.0.0.1:{port}") for name, port in ports.items()}
    out: dict[str, list[float]] = {name: [] for name in ports}
    try:
        for i in range(requests + WARM_UP):
            for name in (list(clients) if i % 2 == 0 else list(reversed(clients))):
                t = await first_response_s(clients[name], aio)
                if i >= WARM_UP:
                    out[name].append(t)
    finally:
        for c in clients.values():
            await c.close()
    return out


def listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--role", choices=("stand-in", "relay"), help=argparse.SUPPRESS)
    ap.add_argument("--ports", type=int, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "stand-in":
        asyncio.run(stand_in(args.ports[0]))
        return 0
    if args.role == "relay":
        asyncio.run(relay(*args.ports))
        return 0
    from trellm_backend.tools.testbed import free_ports
    up, relayed = free_ports(2)
    procs = [subprocess.Popen([sys.executable, __file__, "--role", role, "--ports", str(up), str(relayed)])
             for role in ("stand-in", "relay")]
    try:
        for port in (up, relayed):
            listening(port)
        out = asyncio.run(measure({"direct": up, "relay": relayed}, args.requests))
    finally:
        for p in procs:
            p.kill()
    p50 = {name: statistics.median(v) * 1e3 for name, v in out.items()}
    for name, v in out.items():
        print(f"{name:7s} first response p50 {p50[name]:.3f} ms, mean {statistics.mean(v) * 1e3:.3f} ms")
    print(f"relay: +{p50['relay'] - p50['direct']:.3f} ms at the first response (p50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
