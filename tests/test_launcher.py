"""The launcher: starts tritonserver, reports readiness, and on SIGTERM leaves no process behind."""
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, free_ports


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_sigterm_stops_server_and_stubs(default_model_path, tmp_path):
    # A private copy of the repository, so this test's server and stubs are recognisable by their paths.
    repo = tmp_path / "model_repository"
    subprocess.run(["cp", "-r", os.path.join(REPO, "model_repository"), str(repo)], check=True)
    os.symlink(os.path.join(REPO, "hf_models"), tmp_path / "hf_models")
    http, grpc, metrics = free_ports(3)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trellm_backend.launch", f"--model-repository={repo}", f"--http-port={http}",
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
