"""Does a kind of stream leave its model held after it ended? N gRPC streams to a model, each read to its final
response and then closed with or without cancelling, then an unload through the repository API: a model something
still holds stays UNLOADING (and tritonserver's stop then waits out its exit timeout).

    .venv/bin/python perf/held_model.py --model vllm_model --sampling '{"n": 2}' --cancel --streams 60

Prints tritonserver's RSS before and after the streams and the model's state 12 s after the unload. What it found is
in perf/RESULTS.md ("tritonserver's memory under the soak's traffic").
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vllm_model", choices=["vllm_model", "ensemble"])
    ap.add_argument("--sampling", default="{}", help="vllm_model's sampling_parameters (JSON) besides max_tokens")
    ap.add_argument("--cancel", action="store_true", help="stop_stream(cancel_requests=True) after the final")
    ap.add_argument("--cancel-after", type=int, default=0, metavar="K",
                    help="cancel each stream after its K-th response instead of reading it to its final (implies --cancel)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--log-verbose", action="store_true", help="tritonserver --log-verbose=1 (its gRPC states)")
    args = ap.parse_args()
    import tritonclient.grpc as grpcclient

    from trellm_backend.tools.launch import TritonServer
    from trellm_backend.tools.testbed import free_ports, rss_bytes
    from trellm_client.client import build_inputs, stop_stream, vllm_inputs
    server = TritonServer(os.path.join(REPO, "model_repository"), *free_ports(3), log_path=os.path.join(
        REPO, "perf", "out", "held_model.log"), model_control_mode="explicit", load_models=["*"],
        extra_args=["--log-verbose=1"] if args.log_verbose else []).start()
    try:
        before = rss_bytes(server.proc.pid) / 2**20
        for i in range(args.streams):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            if args.model == "vllm_model":
                inputs = vllm_inputs(grpcclient, "The Python language",
                                     {"max_tokens": args.max_tokens, "temperature": 0.7, "seed": i, **json.loads(args.sampling)})
            else:
                inputs = build_inputs(grpcclient, "The Python language", {"max_tokens": args.max_tokens, "stream": True})
            client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
            for n in range(1, 100_000):
                result, error = results.get(timeout=60)
                if error is not None:
                    raise error
                if result.get_response().parameters["triton_final_response"].bool_param or n == args.cancel_after:
                    break
            stop_stream(client, cancel=args.cancel or args.cancel_after > 0)
            client.close()
        after = rss_bytes(server.proc.pid) / 2**20
        url = f"http://{server.http_url}/v2/repository"
        urllib.request.urlopen(urllib.request.Request(f"{url}/models/{args.model}/unload", data=b"{}"), timeout=60)
        deadline, state = time.monotonic() + 12, None
        while time.monotonic() < deadline:
            index = json.loads(urllib.request.urlopen(urllib.request.Request(f"{url}/index", data=b"{}"),
                                                      timeout=10).read())
            state = next(m.get("state") for m in index if m["name"] == args.model)
            if state == "UNAVAILABLE":
                break
            time.sleep(0.5)
        how = (f"cancelled after {args.cancel_after} responses" if args.cancel_after else
               "closed with a cancel" if args.cancel else "closed without a cancel")
        print(f"{args.model} {args.sampling} x{args.streams}, {how}: tritonserver {before:.1f} -> {after:.1f} MiB; "
              f"after the unload: {state}")
    finally:
        server.stop(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
