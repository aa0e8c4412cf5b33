"""Client-side time to first token and time per token of one gRPC stream, for the `llm` model alone (token ids
in) and for the `ensemble` (text in), so the cost of pre/postprocessing shows as a difference.

    python perf/stream_latency.py [--url localhost:8001] [--tokens 32] [--repeat 2]
"""
import argparse
import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient

from trellm_client.client import infer_input


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    arrivals: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), error)))
    common = [infer_input(grpcclient, "max_tokens", np.array([[args.tokens]], dtype=np.int32)),
              infer_input(grpcclient, "stream", np.array([[True]]))]
    cases = {
        "llm": [infer_input(grpcclient, "input_ids", np.array([[1, 347, 1656, 829, 82]], dtype=np.int32))] + common,
        "ensemble": [infer_input(grpcclient, "text_input", np.array([[b"The import statement"]], dtype=object))]
        + common,
    }
    for _ in range(args.repeat):
        for model, inputs in cases.items():
            start = time.perf_counter()
            client.async_stream_infer(model, inputs)
            times = []
            for _ in range(args.tokens):
                t, error = arrivals.get(timeout=60)
                if error is not None:
                    raise SystemExit(f"{model}: {error}")
                times.append(t - start)
            per_token = (times[-1] - times[0]) / (len(times) - 1)
            print(f"{model:9s} first_token_ms={times[0] * 1e3:6.1f} per_token_ms={per_token * 1e3:5.2f}")
    client.stop_stream()


if __name__ == "__main__":
    main()
