"""Shared fixtures: the default model folder, small Hugging Face models of other configs, a real tritonserver."""
from __future__ import annotations

import os
import socket

import pytest
import torch

# Without a GPU, Triton-lang kernels run in Triton's interpreter. The flag must be set before anything imports
# triton (transformers and torch may), so it is set here, first; a GPU host compiles the kernels for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "hf_models", "tiny-llama")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The repository's default model (built by `make model`; built here if a test run starts without it)."""
    from trellm_backend.tools.default_model import build
    return build(DEFAULT_MODEL)


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def triton_server(default_model_path, tmp_path_factory):
    """tritonserver on the repository's model_repository, on free ports; stopped when the session ends."""
    from trellm_backend.tools.launch import TritonServer
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    server = TritonServer(os.path.join(REPO, "model_repository"), http, grpc, metrics, log_path=str(log))
    server.start()
    yield server
    server.stop()
    assert server.proc is None
