"""Pack the nvidia-pytriton wheel's tritonserver into one archive for a host that has no wheel of it: a lent GPU
machine, whose image has torch, triton and transformers but neither tritonserver nor tritonclient, and which reaches
no package index. perf/gpu_check.sh unpacks it there and serves the anchor profile on the GPU (perf/gpu_served.sh).

    .venv/bin/python perf/pack_tritonserver.py perf/out/gpu-pack.tar.xz --python 3.12   # for the GPU image
    .venv/bin/python perf/pack_tritonserver.py /tmp/pack.tar                              # this interpreter's

The archive holds two folders:
  - tritonserver/: bin/tritonserver, backends/python (with the Python-backend stub for `--python`, in the place the
    backend looks for it), and libs/, only the wheel's libraries that the server, the backend and the stub load
    (`ldd`). TRELLM_TRITONSERVER_HOME=<it> makes the launcher (backend/tools/launch.py) start this server.
  - site/: what the benchmark's client needs beyond the image: tritonclient (pure Python) and python-rapidjson's
    extension for `--python` (this environment's where the versions match, else its wheel from the index).
  - numpy1/: numpy 1.26.4 for `--python`, for the Python-backend stubs where the host's numpy is 2 (gpu_served.sh):
    this server's stub sends empty tensors from numpy 2 arrays.
A name ending in .tar.xz is compressed (about a quarter of the ~110 MB); one ending in .tar is not (CI's dry run).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile


def wheel_dirs() -> tuple[str, str]:
    import pytriton
    site = os.path.dirname(os.path.dirname(pytriton.__file__))
    return os.path.join(os.path.dirname(pytriton.__file__), "tritonserver"), os.path.join(site,
                                                                                          "nvidia_pytriton.libs")


def needed_libs(binaries: list[str], libs_dir: str) -> set[str]:
    """The files of `libs_dir` that `binaries` load, as ldd resolves them."""
    found = set()
    real = os.path.realpath(libs_dir)
    for b in binaries:
        out = subprocess.run(["ldd", b], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split("=>")
            if len(parts) == 2 and parts[1].split():
                path = os.path.realpath(parts[1].split()[0])
                if os.path.dirname(path) == real:
                    found.add(path)
    return found


def from_wheel(requirement: str, version: str, dest: str, keep) -> None:
    """The files of `requirement`'s wheel for Python `version` whose names pass `keep`, into `dest`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", version, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "-d", tmp, requirement], check=True)
        [wheel] = glob.glob(os.path.join(tmp, f"*-cp{version.replace('.', '')}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if keep(name):
                    z.extract(name, dest)


def rapidjson_extension(version: str, dest: str) -> None:
    """python-rapidjson's compiled module for Python `version` into `dest`."""
    if version == f"{sys.version_info.major}.{sys.version_info.minor}":
        import rapidjson
        shutil.copy2(rapidjson.__file__, dest)
        return
    from_wheel("python-rapidjson", version, dest, lambda n: n.startswith("rapidjson.") and n.endswith(".so"))


def numpy1(version: str, dest: str) -> None:
    """numpy 1.26.4 for Python `version` into `dest`: tritonserver 2.51's stub (python_backend r24.10) sends empty
    tensors from numpy 2 arrays, and GPU images carry numpy 2."""
    def keep(name):
        return name.startswith(("numpy/", "numpy.libs/")) and "/tests/" not in name
    if version == f"{sys.version_info.major}.{sys.version_info.minor}":
        import numpy
        if numpy.__version__ == "1.26.4":
            site = os.path.dirname(os.path.dirname(numpy.__file__))
            for name in ("numpy", "numpy.libs"):
                shutil.copytree(os.path.join(site, name), os.path.join(dest, name),
                                ignore=shutil.ignore_patterns("__pycache__", "tests"))
            return
    from_wheel("numpy==1.26.4", version, dest, keep)


def pack(out: str, version: str) -> None:
    src, libs = wheel_dirs()
    stub = os.path.join(src, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.path.isfile(stub):
        raise SystemExit(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    with tempfile.TemporaryDirectory() as tmp:
        home = os.path.join(tmp, "tritonserver")
        os.makedirs(os.path.join(home, "bin"))
        shutil.copy2(os.path.join(src, "bin", "tritonserver"), os.path.join(home, "bin"))
        backend = os.path.join(home, "backends", "python")
        shutil.copytree(os.path.join(src, "backends", "python"), backend,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, backend)
        os.makedirs(os.path.join(home, "libs"))
        # ldd on the wheel's own files, whose run paths lead to its libraries (the copies' do not)
        binaries = [os.path.join(src, "bin", "tritonserver"), os.path.join(src, "backends", "python",
                                                                             "libtriton_python.so"), stub]
        for lib in needed_libs(binaries, libs):
            shutil.copy2(lib, os.path.join(home, "libs"))
        site = os.path.join(tmp, "site")
        import tritonclient
        shutil.copytree(os.path.dirname(tritonclient.__file__), os.path.join(site, "tritonclient"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        rapidjson_extension(version, site)
        numpy1(version, os.path.join(tmp, "numpy1"))
        mode = "w:xz" if out.endswith(".xz") else "w"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with tarfile.open(out + ".tmp", mode, **({"preset": 6} if mode == "w:xz" else {})) as tar:
            tar.add(home, "tritonserver")
            tar.add(site, "site")
            tar.add(os.path.join(tmp, "numpy1"), "numpy1")
        os.replace(out + ".tmp", out)
    print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB (tritonserver with the Python {version} stub, "
          "tritonclient, numpy 1.26.4)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the archive to write (.tar.xz compressed, .tar not)")
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="the Python version (X.Y) of the host that will run it (default: this one's)")
    args = ap.parse_args()
    pack(args.out, args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
