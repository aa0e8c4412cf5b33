"""A split model end to end: the shipped ensemble with `llm` split across two processes (tensor parallel, or a
pipeline of two stages), on a real tritonserver under the launcher, streams transformers' text; a worker killed
mid-stream fails every stream within seconds, and the supervisor has the server serving again, split again, within a
minute."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, free_ports
from repository_helpers import greedy_texts, processes_mentioning
from test_launcher import _read, _ready, long_stream, stop_launcher, wait_for_generate
from trellm_backend.tools.testbed import private_repository
from trellm_client.client import LLMClient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.server

PROMPTS = ["The Python language", "A function definition", "Exceptions are raised when"]
MAX_TOKENS = 24
WORKER = "trellm_backend.distributed.worker"


def workers() -> list[int]:
    return processes_mentioning(WORKER)


@pytest.mark.parametrize("split, kind", [("tensor_parallel_size", "tensor-parallel rank"),
                                         ("pipeline_parallel_size", "pipeline stage")])
def test_a_split_llm_streams_transformers_text_and_comes_back_after_losing_a_worker(default_model_path, tmp_path,
                                                                                     split, kind):
    repo = str(tmp_path / "model_repository")
    private_repository(os.path.join(REPO, "model_repository"), repo, {"llm": {split: "2", "parallel_timeout_s": "3"}})
    http, grpc, metrics = free_ports(3)
    err_path = str(tmp_path / "launcher.err")
    log_path = tmp_path / "server.log"
    before = set(workers())
    with open(err_path, "w") as err_file:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--log-file={log_path}"],
            stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + 300
        while not _ready(http):
            assert launcher.poll() is None and time.monotonic() < deadline, _read(err_path)
            time.sleep(0.5)
        log = log_path.read_text()
        assert f"{'pipeline' if 'pipeline' in split else 'tensor parallel'}: 2 ranks" in log, log[-3000:]
        assert f"[trellm {'stage' if 'pipeline' in split else 'rank'} 1] ready" in log, log[-3000:]
        expected = greedy_texts(default_model_path, PROMPTS, MAX_TOKENS)
        with LLMClient(f"localhost:{grpc}") as c:
            for p in PROMPTS:
                assert "".join(c.stream(p, max_tokens=MAX_TOKENS)) == expected[p], p

        [worker] = set(workers()) - before
        outcomes: dict[int, tuple] = {}
        started = threading.Barrier(3)
        threads = [threading.Thread(target=long_stream, args=(grpc, outcomes, i, lambda: started.wait(60)))
                   for i in range(2)]
        for t in threads:
            t.start()
        started.wait(60)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        assert sorted(o[0] for o in outcomes.values()) == ["error"] * 2, outcomes
        assert max(o[2] for o in outcomes.values()) - killed < 10, outcomes

        # In the second before its stub ends, the split llm refuses requests as a restarting server does
        # (UNAVAILABLE); then the supervisor's restart, during which nothing listens.
        while True:
            try:
                wait_for_generate(grpc, since=killed, what="the server did not come back", limit_s=60,
                                  launcher=launcher, launcher_err=err_path)
                break
            except InferenceServerException as e:
                assert "retry on another replica or after the restart" in str(e), e
                assert time.monotonic() - killed < 60
                time.sleep(0.5)
        assert f"{kind} 1 (pid {worker}) was killed by signal 9" in log_path.read_text()
        assert len(set(workers()) - before - {worker}) == 1, "the restarted llm is split again"
    finally:
        stop_launcher(launcher, repo)
    assert set(workers()) <= before, "a worker outlived its server"
