"""What the tests, the perf scripts and the launcher share about a running server: free ports, a private copy of
the model repository with its parameters changed, the samples of its metrics endpoint, its processes as seen from
outside (by command line, with their resident memory), and waiting for any of these to change."""
from __future__ import annotations

import os
import re
import shutil
import socket
import time
import urllib.request
from dataclasses import dataclass


def perf_analyzer_env() -> dict[str, str]:
    """The environment to run tritonclient[all]'s perf_analyzer (beside this interpreter) in: it links CUDA's runtime
    library even on a CPU host, which the nvidia-cuda-runtime-cu12 wheel provides; this interpreter's folder first
    on PATH (genai-perf runs the `perf_analyzer` it finds there)."""
    import sys
    bindir = os.path.dirname(sys.executable)
    cudart = os.path.join(os.path.dirname(bindir), "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                          "site-packages", "nvidia", "cuda_runtime", "lib")
    env = dict(os.environ)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["LD_LIBRARY_PATH"] = cudart + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    return env


def listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at `port`, from /proc/net/tcp and tcp6 (an IPv4-mapped IPv6
    address as its IPv4 one: gRPC binds 127.0.0.1 that way)."""
    import ipaddress
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:    # 0A: LISTEN
                continue
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                                               for i in range(0, len(address), 8)))
            found.add(str(ip.ipv4_mapped if ip.version == 6 and ip.ipv4_mapped else ip))
    return found


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (all held at once while they are picked)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition", interval: float = 0.02):
    """Call `predicate` until it returns something true, and return that; TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(interval)
    return value


def private_repository(src: str, dest: str, settings: dict[str, dict[str, str]] | None = None,
                       model_dir: str | None = None) -> str:
    """A copy of the model repository `src` at `dest` (replacing what is there) whose `model_path` parameters are
    absolute (`model_dir` instead, where given) and whose models get `settings` ({model: {key: value}}) as
    config.pbtxt parameters, edited through protobuf as add_model does."""
    from trellm_backend.tools.repository import read_config, set_parameters, write_config
    src = os.path.abspath(src)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in os.listdir(dest):
        path = os.path.join(dest, name, "config.pbtxt")
        if not os.path.isfile(path):
            continue
        cfg = read_config(path)
        if "model_path" in cfg.parameters:     # a relative one is relative to the repository
            model_path = os.path.abspath(model_dir) if model_dir else os.path.normpath(
                os.path.join(src, cfg.parameters["model_path"].string_value))
            set_parameters(cfg, {"model_path": model_path})
        set_parameters(cfg, (settings or {}).get(name, {}))
        write_config(path, cfg)
    return dest


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$', re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(metrics: int | str, timeout: float = 5.0) -> list[Sample]:
    """Every sample of a server's metrics endpoint (its metrics port, or the endpoint's URL), in Prometheus' text
    format; raises OSError when the endpoint cannot be read."""
    url = metrics if isinstance(metrics, str) else f"http://localhost:{metrics}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    return [Sample(name, dict(LABEL.findall(labels or "")), float(value))
            for name, labels, value in SAMPLE.findall(text)]


def metric_sum(metrics: int | str, name: str, timeout: float = 5.0, **labels: str) -> float:
    """The sum of `name`'s samples that carry `labels` (all of them when none is given) on a metrics endpoint."""
    return sum(s.value for s in metric_samples(metrics, timeout)
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def command_line(pid: int) -> bytes:
    """The process's arguments, each ended by a NUL (b"" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes_mentioning(text: str) -> list[int]:
    """The processes (but this one) whose command line contains `text`."""
    needle = text.encode()
    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != os.getpid() and needle in command_line(int(pid))]


def rss_bytes(pid: int) -> int:
    """The process's resident memory (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except (OSError, ValueError):
        return 0
