"""Build and load the C++ CPU operators (kernels/cpu/: paged attention and the elementwise layer steps) once per
machine.

The build needs a C++ compiler and `ninja`; it takes over a minute on two cores, so the setup step runs it
(`python -m trellm_kernels.cpu_ops`) and the engine loads the result when a model loads, never on a request.
The operators include ATen's tensor and dispatch headers, not `torch/extension.h`: only bindings.cpp needs
pybind11, and torch's whole C++ API in every file made the build 2.5x as long (perf/RESULTS.md).
The binary is compiled for this CPU (-march=native), so the cache folder is keyed by the source, the flags, torch's
version and the CPU's feature flags: a copied cache from another machine is never picked up. Without a compiler
the engine logs why and keeps the PyTorch path, which is also the tests' oracle.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import time

from trellm_kernels import dispatch

log = logging.getLogger("trellm")

_CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
SOURCES = [os.path.join(_CPU_DIR, name) for name in ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp",
                                                   "int8_linear.cpp", "group_linear.cpp", "fp32_linear.cpp",
                                                   "half_linear.cpp", "bf16_linear.cpp", "bf16_amx_linear.cpp",
                                                   "lora.cpp", "decode_layers.cpp")]
HEADERS = [os.path.join(_CPU_DIR, name) for name in ("vec_math.h", "blocked_linear.h", "operators.h",
                                                   "decode_layers.h")]
# -fopenmp: ATen's at::parallel_for is an inline template that splits work over torch's threads only where the
# including file is compiled with OpenMP; without it every operator here ran on one thread (perf/RESULTS.md, "the
# C++ operators on both cores"). The link names libgomp.so.1,
# which the dynamic linker resolves to the libgomp torch has already loaded (the same soname), so the process keeps
# one OpenMP runtime and torch's thread count.
# -fno-trapping-math: GCC vectorizes floorf (in exp_approx) only when it need not keep floating-point exception
# flags, which nothing here reads; without it the softmax's exponentials and SiLU-mul ran one float at a time
# (perf/RESULTS.md, "vectorized exponentials"; the values are the same, the softmax sums' order differs).
# -ffp-contract=fast lets the polynomials use FMA.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# The instruction-set builds. Each takes one branch of the sources' #if's (vec_math.h: AVX-512, AVX2 + FMA + F16C,
# else portable GCC vector code) by turning features off from -march=native, so every build this host can choose
# also runs on it. The engine loads the host's own widest build (`load`); the tests also build each narrower one
# (`load_isa`), so an AVX-512 host checks the AVX2 tiles and every x86 host the portable code.
ISA_FLAGS = {"portable": ["-mno-avx"], "avx2": ["-mno-avx512f"], "avx512": []}
ISA_CPU_FLAGS = {"portable": (), "avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f",)}
_module = None
_error: str | None = None
_isa_modules: dict = {}


def _cpuinfo(field: str) -> str | None:
    """The first /proc/cpuinfo line of `field` ("flags", "model name"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.processor()


def host_isa() -> str:
    """The widest ISA_FLAGS build this CPU runs: the one -march=native compiles."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "portable"
    have = set(_cpu_flags().split())
    return next((isa for isa in ("avx512", "avx2") if set(ISA_CPU_FLAGS[isa]) <= have), "portable")


def runnable_isas() -> list[str]:
    """Every build of ISA_FLAGS this host executes, narrowest first (on a CPU other than x86, its native build,
    which host_isa calls portable)."""
    names = list(ISA_FLAGS)
    return names[:names.index(host_isa()) + 1]


def cpu_model() -> str:
    line = _cpuinfo("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine()


def build_dir(cflags: list[str] | None = None) -> str:
    import torch
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join((cflags or CFLAGS) + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    # The build files name the sources by path: two checkouts sharing one folder would rebuild each other's build.
    h.update(_CPU_DIR.encode())
    root = dispatch.settings().cpu_ops_cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trellm", "cpu_ops")
    return os.path.join(root, h.hexdigest()[:16])


# A build takes under a minute; a lock file older than this was left by a build that was killed, and torch's
# cpp_extension would wait on it forever (every model load with it).
STALE_LOCK_S = 600


def remove_stale_lock(path: str) -> None:
    lock = os.path.join(path, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        try:
            os.remove(lock)
        except OSError:
            pass


@contextlib.contextmanager
def pinned_ninja():
    """torch builds with the first `ninja` on PATH. Ninja 1.12 changed how its log in the build folder hashes a
    command, so two versions (the pip package beside this project's Python, and a system one such as Debian's
    1.11) each took the other's log for changed commands and rebuilt everything: the server's stubs (the venv
    first on PATH) and a process started as `.venv/bin/python` (the system ninja first) took turns, each turn a full
    rebuild (perf/RESULTS.md, "The C++ operators were rebuilt over and over"). The pinned `ninja` package's binary is
    put first while building."""
    try:
        import ninja
        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((bin_dir, before))
    try:
        yield
    finally:
        os.environ["PATH"] = before


def load(verbose: bool = False):
    """The compiled module, building it first if this machine has none; None (and the reason in `error()`) when
    it cannot be built. Set TRELLM_CPU_OPS=0 to turn the operators off."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    if not dispatch.settings().cpu_ops:
        _error = "turned off by TRELLM_CPU_OPS=0"
        return None
    try:
        _module = _build("trellm_cpu_ops", CFLAGS, verbose)
    except Exception as e:  # no compiler, no ninja, a read-only cache: all mean "use the PyTorch path"
        _error = (f"the C++ CPU operators could not be built ({type(e).__name__}: {str(e).strip()[:300]}); "
                  "the slower PyTorch attention runs instead. They need g++ and the `ninja` package "
                  "(`make setup` installs ninja; Debian: apt-get install g++)")
        log.warning(_error)
    return _module


def _build(name: str, cflags: list[str], verbose: bool = False):
    from torch.utils.cpp_extension import load as load_extension
    path = build_dir(cflags)
    os.makedirs(path, exist_ok=True)
    remove_stale_lock(path)
    with pinned_ninja():
        # Copies: torch appends its own libraries to extra_ldflags, which changed build_dir()'s hash after.
        return load_extension(name=name, sources=SOURCES, extra_cflags=list(cflags), extra_ldflags=list(LDFLAGS),
                              build_directory=path, verbose=verbose)


def load_isa(isa: str):
    """The operators built for one of ISA_FLAGS' instruction sets, which this host must execute (runnable_isas):
    the engine's own module for the host's widest, else a build of its own (cached like the engine's, and loaded
    under its own module name beside it). Raises where it cannot be built."""
    if isa not in runnable_isas():
        raise ValueError(f"this CPU cannot run the {isa} build of the operators (it runs {runnable_isas()})")
    if isa == host_isa():
        module = load()
        if module is None:
            raise RuntimeError(error())
        return module
    if isa not in _isa_modules:
        _isa_modules[isa] = _build(f"trellm_cpu_ops_{isa}", CFLAGS + ISA_FLAGS[isa])
    return _isa_modules[isa]


def for_tensor(t):
    """The compiled module when `t` lives on a CPU and the operators are available, else None: the one test
    every dispatch function makes before taking the C++ path."""
    return load() if t.device.type == "cpu" else None


def error() -> str | None:
    """Why the operators are not available, or None."""
    return _error


if __name__ == "__main__":
    # `python -m trellm_kernels.cpu_ops [-v] [--isas]`: the engine's build; with --isas also each narrower build
    # this host executes (what the tests check; setup builds them beside the default model's training).
    logging.basicConfig(level=logging.INFO)
    mod = load(verbose="-v" in sys.argv)
    if mod is None:
        print(error(), file=sys.stderr)
        sys.exit(1)
    print(f"CPU operators ready in {build_dir()}")
    if "--isas" in sys.argv:
        for isa in runnable_isas():
            load_isa(isa)
        print(f"CPU operator builds ready: {', '.join(runnable_isas())}")
