"""The launcher: starts tritonserver, reports readiness, and on SIGTERM leaves no process behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_ports
from repository_helpers import processes_mentioning
from trellm_backend.tools.launch import TritonServer


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
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trellm_backend.tools.launch", f"--model-repository={repo}", f"--http-port={http}",
         f"--grpc-port={grpc}", f"--metrics-port={metrics}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300
        for line in launcher.stdout:
            if "tritonserver is ready" in line or time.monotonic() > deadline:
                break
        assert f"localhost:{grpc}" in launcher.stdout.readline() + launcher.stdout.readline() + \
            launcher.stdout.readline()
        assert len(processes_mentioning(str(repo))) >= 4      # the server and a stub per Python model
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        assert processes_mentioning(str(repo)) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
