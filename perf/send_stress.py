"""Send many streamed responses from a thread of a decoupled Python model, with Python running on another thread,
and count what died: the check behind responses.send, which keeps each Tensor alive until tritonserver 2.51's
`send` has returned.

    .venv/bin/python perf/send_stress.py [--rounds 6] [--responses 300] [--unrequested 1000]

The model (written to a temporary repository) sends its responses through ResponseGroup with every output, while
the client asks for one: 2.51's stub drops the other `--unrequested` string tensors inside `send`, with the GIL
released. With the Tensors held only by the response, that freed Python objects without the GIL while the model's
other thread allocated, and the stub died of a segmentation fault within a few rounds. Prints one line per round
and the server log's deaths; exits 1 if the stub died or a round did not finish.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import textwrap

import numpy as np

from many_models_start import deaths_in
from trellm_backend.tools.launch import TritonServer
from trellm_backend.tools.testbed import free_ports

MODEL = textwrap.dedent('''
    import faulthandler, os, threading
    import numpy as np
    import triton_python_backend_utils as pb_utils
    from trellm_backend.triton.responses import ResponseGroup

    class TritonPythonModel:
        def initialize(self, args):
            faulthandler.enable()
            self.running, self.server = True, os.getppid()
            threading.Thread(target=self.churn, daemon=True).start()

        def churn(self):      # Python allocating on another thread, as the engine's threads do
            while self.running and os.getppid() == self.server:    # ends with a killed server too
                junk = [{"k": (i, str(i))} for i in range(200)]
                del junk

        def execute(self, requests):
            for request in requests:
                n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
                group = ResponseGroup(pb_utils, request.get_response_sender(), 1, 16)
                threading.Thread(target=self.run, args=(group, n)).start()
            return None

        def run(self, group, n):
            for i in range(n):
                tensors = {"A": np.array([i], np.int32)}
                tensors.update({f"C{k}": np.array([b"y"] * 20, np.object_) for k in range(UNREQUESTED)})
                group.send(tensors, i == n - 1)

        def finalize(self):
            self.running = False
''')


def write_repository(root: str, unrequested: int) -> None:
    os.makedirs(os.path.join(root, "stress", "1"))
    outputs = ['{ name: "A" data_type: TYPE_INT32 dims: [ -1 ] }'] + [
        f'{{ name: "C{k}" data_type: TYPE_STRING dims: [ -1 ] }}' for k in range(unrequested)]
    with open(os.path.join(root, "stress", "config.pbtxt"), "w") as f:
        f.write('name: "stress"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
                'input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                f'output [ {", ".join(outputs)} ]\ninstance_group [ {{ kind: KIND_CPU count: 1 }} ]\n')
    with open(os.path.join(root, "stress", "1", "model.py"), "w") as f:
        f.write(MODEL.replace("UNREQUESTED", str(unrequested)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--responses", type=int, default=300, help="responses per round (one stream)")
    ap.add_argument("--unrequested", type=int, default=1000, help="string outputs per response the client skips")
    args = ap.parse_args()
    import tritonclient.grpc as grpcclient
    with tempfile.TemporaryDirectory() as tmp:
        write_repository(os.path.join(tmp, "repo"), args.unrequested)
        log = os.path.join(tmp, "server.log")
        finished = 0
        with TritonServer(os.path.join(tmp, "repo"), *free_ports(3), log_path=log) as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            for r in range(args.rounds):
                got: queue.Queue = queue.Queue()
                client.start_stream(callback=lambda result, error: got.put(error))
                n = grpcclient.InferInput("N", [1], "INT32")
                n.set_data_from_numpy(np.array([args.responses], np.int32))
                client.async_stream_infer("stress", [n], outputs=[grpcclient.InferRequestedOutput("A")])
                try:
                    for _ in range(args.responses):
                        if (error := got.get(timeout=20)) is not None:
                            raise RuntimeError(error)
                except (queue.Empty, RuntimeError) as e:
                    print(f"round {r}: stopped after a response failed or none came in 20 s ({e!r})")
                    break
                finally:
                    client.stop_stream()
                finished += 1
                print(f"round {r}: {args.responses} responses", flush=True)
        deaths = deaths_in(log)
    print(f"{finished}/{args.rounds} rounds finished; stub deaths in the server log: {len(deaths)}")
    for line in deaths:
        print("  " + line)
    return 0 if finished == args.rounds and not deaths else 1


if __name__ == "__main__":
    sys.exit(main())
