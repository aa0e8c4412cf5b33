"""The launcher: starts tritonserver, reports readiness, and on SIGTERM leaves no process behind."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_ports
from repository_helpers import processes_mentioning
from trellm_backend.tools.launch import TritonServer, openmp_wait_defaults

pytestmark = pytest.mark.server


def test_openmp_wait_default_leaves_a_callers_choice_alone():
    assert openmp_wait_defaults({}) == {"GOMP_SPINCOUNT": "10000"}
    assert openmp_wait_defaults({"OMP_WAIT_POLICY": "PASSIVE"}) == {}, "an operator's wait policy must win"
    assert openmp_wait_defaults({"GOMP_SPINCOUNT": "0"}) == {}


def test_load_models_need_explicit_model_control():
    """Explicit model control itself is exercised by test_add_model.py, test_load_errors.py and test_deploy.py."""
    with pytest.raises(ValueError, match="explicit"):
        TritonServer(load_models=["ensemble"])
    with pytest.raises(ValueError, match="model_control_mode='manual'"):
        TritonServer(model_control_mode="manual")
    r = subprocess.run([sys.executable, "-m", "trellm_backend.tools.launch", "--load-model", "ensemble"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "load_models needs model_control_mode='explicit'" in r.stderr


def test_sigterm_stops_server_and_stubs(default_model_path, tmp_path):
    # A private copy of the repository, so this test's server and stubs are recognisable by their paths.
    repo = tmp_path / "model_repository"
    subprocess.run(["cp", "-r", os.path.join(REPO, "model_repository"), str(repo)], check=True)
    os.symlink(os.path.join(REPO, "hf_models"), tmp_path / "hf_models")
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "server.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
         f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--log-file={log}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300
        before_ready = []
        for line in launcher.stdout:
            if "tritonserver is ready" in line or time.monotonic() > deadline:
                break
            before_ready.append(line)
        summary = "".join(launcher.stdout.readline() for _ in range(4))
        assert f"localhost:{grpc}" in summary and str(log) in summary
        # tritonserver's own log (glog lines such as "I1123 ...") is in the file, not among the launcher's lines.
        assert not any(re.match(r"[IWE]\d{4} ", line) for line in before_ready), before_ready
        assert "Started GRPCInferenceService" in log.read_text()
        assert len(processes_mentioning(str(repo))) >= 4      # the server and a stub per Python model
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        assert processes_mentioning(str(repo)) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
