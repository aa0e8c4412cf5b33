"""Shared fixtures: the default model folder, a real tritonserver. Tests that start a tritonserver are marked
`server`, those that run Triton-lang kernels in the interpreter (minutes on CPU) `kernels`; every other test is
marked `unit` here, so `pytest -m unit` takes seconds."""
from __future__ import annotations

import os
import platform

import pytest
import torch

from trellm_backend.tools.testbed import free_ports  # noqa: F401 - the tests import it from here

# Triton decides when it decorates a function whether it is interpreted, and decorates its own library (tl.sum,
# ...) at `import triton`: the interpreter is a per-process choice, and cannot be switched per test. On a CPU host
# it is the only way Triton-lang kernels run, so this session runs them interpreted; a GPU host's session never
# is (test_kernels.py then runs its interpreter tests in a process of their own).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's own cache of timed linear choices (kernels/linear_choice.py), never the user's: the suite times shapes
# while it runs servers and other tests, and its tritonservers inherit this.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["TRELLM_CACHE_DIR"] = os.path.join(REPO, ".pytest_cache", "trellm")


def pytest_sessionstart(session):
    """The host and the builds of the C++ operators the suite tests on it (tests/test_cpu_ops.py), first in the
    output at any verbosity (`-q`, as CI runs, hides pytest's own header), so a CI log says which CPU it ran on."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in host_lines():
            reporter.write_line(line)


def host_lines() -> list[str]:
    from trellm_kernels import cpu_ops
    flags = set(cpu_ops._cpu_flags().split())
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
             if f in flags]
    runnable = cpu_ops.runnable_isas()
    others = [isa for isa in cpu_ops.ISA_FLAGS if isa not in runnable]
    return [f"host: {cpu_ops.cpu_model()} ({platform.machine()}; {' '.join(shown) or 'no AVX2'})",
            f"C++ operator builds tested: {', '.join(runnable)} (engine: {cpu_ops.host_isa()})"
            + (f"; not executable here, skipped by name: {', '.join(others)}" if others else "")]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("server") is None and item.get_closest_marker("kernels") is None:
            item.add_marker(pytest.mark.unit)

pytest_plugins = ["rerun_on_upstream_abort", "pytester"]   # the first: tritonserver 2.51's own aborts

DEFAULT_MODEL = os.path.join(REPO, "hf_models", "tiny-llama")


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    """The default model's tokenizer (transformers'), one per test module."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The repository's default model (built by `make model`; built here if a test run starts without it)."""
    from trellm_backend.tools.default_model import build
    return build(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def triton_server(default_model_path, tmp_path_factory):
    """tritonserver on the repository's model_repository, on free ports; stopped when the session ends."""
    from trellm_backend.tools.launch import TritonServer
    log = tmp_path_factory.mktemp("triton") / "server.log"
    server = TritonServer(os.path.join(REPO, "model_repository"), *free_ports(3), log_path=str(log)).start()
    yield server
    server.stop()
    assert server.proc is None


@pytest.fixture(autouse=True)
def _kv_pools_sized_as_on_a_cpu(monkeypatch):
    """On a GPU host (perf/gpu_check.sh) the tests' engines take `kv_cache_bytes` as on a CPU, instead of 90% of the
    card: the tests size their pools for tiny models, and 70 GB of 4 KB blocks is millions of blocks of Python
    bookkeeping per engine. The GPU's own sizing rule is measured by perf/gpu_bench.py's engines."""
    if torch.cuda.is_available():
        from trellm_backend.engine import limits, runner
        monkeypatch.setattr(runner, "kv_budget", lambda cfg, device, per_block, weights_to_load=0:
                            limits.kv_budget(cfg, torch.device("cpu"), per_block))


@pytest.fixture(autouse=True)
def _revive_a_crashed_session_server(request):
    """One crash of the shared server (rerun_on_upstream_abort.py) fails the test it happened in, not every later
    one."""
    if "triton_server" in request.fixturenames:
        server = request.getfixturevalue("triton_server")
        if server.proc is None or server.proc.poll() is not None:
            server.stop()
            server.start()


@pytest.fixture
def kernel_settings(monkeypatch):
    """Change this process's kernel settings (trellm_kernels.dispatch, read from the environment once) for one
    test: kernel_settings(force_triton=True, attn_splits=3)."""
    import dataclasses
    from trellm_kernels import dispatch

    def change(**fields):
        monkeypatch.setattr(dispatch, "_settings", dataclasses.replace(dispatch.settings(), **fields))
    return change
