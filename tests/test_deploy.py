"""The deployment recipe: docker-compose.yml validates, and its replicas topology runs here without Docker: two
tritonserver replicas behind nginx (Debian's package) with the compose file's nginx template, streaming over gRPC
and HTTP through the balancer, and still answering after one replica is stopped."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import string
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.http as httpclient
import yaml

from conftest import REPO, free_ports
from repository_helpers import MAX_TOKENS, PROMPTS, greedy_texts
from trellm_backend.tools.launch import start_front_door, stop_front_door
from trellm_client.client import LLMClient, http_generate

pytestmark = pytest.mark.server

NGINX_TEMPLATE = os.path.join(REPO, "deploy", "nginx.conf.template")


def compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_compose_file_validates_and_feeds_the_nginx_template():
    quiet = compose("config", "-q")
    assert quiet.returncode == 0, quiet.stderr
    r = compose("--profile", "replicas", "config")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    # Debian's docker-compose 1 lists every profile's services; the monitoring ones are tests/test_dashboard.py's
    assert {n for n, s in services.items() if s.get("profiles") != ["monitoring"]} == {"triton", "triton-replica",
                                                                                      "balancer"}
    assert "profiles" not in services["triton"]            # `docker compose up` runs the one server
    assert services["triton-replica"]["profiles"] == services["balancer"]["profiles"] == ["replicas"]
    for name in ("triton", "triton-replica"):
        s = services[name]
        assert s["image"] == "trellm-tritonserver:26.09"
        assert s["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        # Health is a real generate, and the launcher supervises the server (tests/test_launcher.py kills a stub).
        assert s["healthcheck"]["test"][:4] == ["CMD", "python3", "-m", "trellm_backend.tools.healthcheck"]
        assert s["command"][:3] == ["python3", "-m", "trellm_backend.tools.launch"]
        assert s["restart"] == "unless-stopped" and s["init"] is True
        assert any(v.endswith(":/opt/trellm/model_repository:ro") for v in s["volumes"])
    with open(os.path.join(REPO, "Dockerfile")) as f:
        assert f.readline().startswith("#") and "FROM nvcr.io/nvidia/tritonserver:26.09-py3" in f.read()
    lb = services["balancer"]
    # gRPC clients reach each server's front door relay, never Triton's own gRPC port (loopback in the container)
    relay = next(a.split("=", 1)[1] for a in services["triton"]["command"] if a.startswith("--openai-grpc-port="))
    assert f"triton:{relay};" in lb["environment"]["TRITON_GRPC_SERVERS"]
    assert f"{NGINX_TEMPLATE}:/etc/nginx/templates/default.conf.template:ro" in lb["volumes"]
    with open(NGINX_TEMPLATE) as f:
        variables = set(re.findall(r"\$\{([A-Z_]+)\}", f.read()))
    assert variables == set(lb["environment"]), "the balancer must set exactly the template's variables"
    assert set(lb["depends_on"]) == {"triton", "triton-replica"}


def start_nginx(workdir: str, http_port: int, grpc_port: int, openai_port: int, replicas, front_doors) -> subprocess.Popen:
    """nginx in the foreground on loopback ports, with the compose file's template behind a minimal main config
    whose logs, pid and temp folders live in `workdir`; `front_doors`: (HTTP port, gRPC relay port, process)."""
    with open(NGINX_TEMPLATE) as f:
        balancer = string.Template(f.read()).safe_substitute(   # nginx's own $variables stay
            # HTTP goes to each replica's front door, which relays Triton's v2 routes (as the compose file has it)
            TRITON_HTTP_SERVERS=" ".join(f"server 127.0.0.1:{port};" for port, _, _ in front_doors),
            # gRPC goes to each replica's front door's relay (Triton's own gRPC port is on loopback)
            TRITON_GRPC_SERVERS=" ".join(f"server 127.0.0.1:{port};" for _, port, _ in front_doors),
            TRITON_OPENAI_SERVERS=" ".join(f"server 127.0.0.1:{port};" for port, _, _ in front_doors),
            LB_HTTP_PORT=f"127.0.0.1:{http_port}", LB_GRPC_PORT=f"127.0.0.1:{grpc_port}",
            LB_OPENAI_PORT=f"127.0.0.1:{openai_port}")
    assert not re.search(r"\$\{[A-Z_]+\}", balancer), "a template variable the test does not set"
    with open(os.path.join(workdir, "balancer.conf"), "w") as f:
        f.write(balancer)
    temp = "\n".join(f"    {kind}_temp_path {workdir}/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = (f"daemon off;\nworker_processes 1;\npid {workdir}/nginx.pid;\nerror_log {workdir}/error.log info;\n"
            f"events {{ worker_connections 256; }}\nhttp {{\n    access_log {workdir}/access.log;\n{temp}\n"
            f"    include {workdir}/balancer.conf;\n}}\n")
    conf = os.path.join(workdir, "nginx.conf")
    with open(conf, "w") as f:
        f.write(main)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen([nginx, "-e", f"{workdir}/error.log", "-p", workdir, "-c", conf],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(f"{workdir}/error.log").read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError("nginx did not answer /v2/health/ready")


@pytest.fixture(scope="module")
def topology(default_model_path, tmp_path_factory):
    """Two replicas of the project's repository (only `ensemble` and its steps loaded) and nginx in front."""
    from trellm_backend.tools.launch import TritonServer
    root = tmp_path_factory.mktemp("deploy")
    replicas = []
    for i in range(2):
        http, grpc, metrics = free_ports(3)
        replicas.append(TritonServer(os.path.join(REPO, "model_repository"), http, grpc, metrics,
                                     log_path=str(root / f"replica{i}.log"), model_control_mode="explicit",
                                     load_models=["ensemble"]))
    errors = []

    def start(server):
        try:
            server.start()
        except Exception as e:   # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    nginx, front_doors = None, []
    try:
        if errors:
            raise errors[0]
        for r in replicas:    # each replica's OpenAI front door, as the compose file runs one per container
            port, grpc_port = free_ports(2)
            front_doors.append((port, grpc_port, start_front_door(r, port, None, grpc_port=grpc_port)))
        lb_http, lb_grpc, lb_openai = free_ports(3)
        nginx = start_nginx(str(root), lb_http, lb_grpc, lb_openai, replicas, front_doors)
        yield (replicas, f"127.0.0.1:{lb_http}", f"127.0.0.1:{lb_grpc}", f"http://127.0.0.1:{lb_openai}/v1",
               front_doors)
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(timeout=30)
        for _, _, proc in front_doors:
            stop_front_door(proc)
        for r in replicas:
            r.stop()


def grpc_text(url: str, prompt: str) -> str:
    with LLMClient(url) as c:
        deltas = list(c.stream(prompt, max_tokens=MAX_TOKENS))
    assert len(deltas) > 1, "the answer must arrive as a stream"
    return "".join(deltas)


def http_stream_text(url: str, prompt: str) -> str:
    events = http_generate(url, prompt, stream=True, max_tokens=MAX_TOKENS)
    assert len(events) > 1, "generate_stream must send one event per delta"
    return "".join(e["text_output"] for e in events)


def ensemble_requests(server) -> int:
    with httpclient.InferenceServerClient(server.http_url) as c:
        stats = c.get_inference_statistics("ensemble")["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_the_balancer_limits_body_size_and_request_rate(topology):
    _, lb_http, _, _, _ = topology
    req = urllib.request.Request(f"http://{lb_http}/v2/models/ensemble/generate", data=b" " * (9 << 20),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413

    def status(_):
        try:
            with urllib.request.urlopen(f"http://{lb_http}/v2/health/ready", timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(status, range(120)))
    assert codes.count(429) > 0 and codes.count(200) >= 40, codes     # 20 a second, bursts of 40
    time.sleep(3)     # let the client's allowance refill for the next test


def openai_stream_text(base_url: str, prompt: str) -> str:
    from openai import OpenAI
    chunks = OpenAI(base_url=base_url, api_key="none", max_retries=0).completions.create(
        model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks)


def test_streams_through_the_balancer_and_survive_a_stopped_replica(topology, default_model_path):
    replicas, lb_http, lb_grpc, lb_openai, front_doors = topology
    want = greedy_texts(default_model_path)
    for _ in range(2):          # round robin: each replica gets requests of all three protocols
        for p in PROMPTS:
            assert grpc_text(lb_grpc, p) == want[p]
            assert http_stream_text(lb_http, p) == want[p]
            assert openai_stream_text(lb_openai, p) == want[p]
    served = [ensemble_requests(r) for r in replicas]
    assert all(n > 0 for n in served) and sum(served) == 6 * len(PROMPTS), served

    # A replica stops as its container does: the server and its front door. (With the door still up, gRPC calls it
    # relays fail UNAVAILABLE in the call's status, which nginx cannot retry elsewhere; HTTP's 503 it retries.)
    replicas[0].stop()
    stop_front_door(front_doors[0][2])
    for _ in range(2):
        for p in PROMPTS:
            assert grpc_text(lb_grpc, p) == want[p]
            assert http_stream_text(lb_http, p) == want[p]
    assert ensemble_requests(replicas[1]) == served[1] + 4 * len(PROMPTS)


def test_a_cache_aware_router_in_front_of_two_replicas(default_model_path, tmp_path):
    """SGLang's router (the .venv-router environment) forwards OpenAI requests to two replicas' front doors, with
    each of its policies: perf/bench_routing.py on a small workload answers every request, round-robin splits them
    evenly, and the engines' prefix-cache counters are read from both replicas."""
    out = tmp_path / "routing"
    run = subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), os.path.join(REPO, "perf", "bench_routing.py"),
                          "--model-dir", default_model_path, "--tenants", "4", "--requests", "16", "--concurrency", "4",
                          "--prefix-tokens", "384", "--kv-prefixes", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "cache_aware / round_robin: hit rate" in run.stdout
    results = json.loads((out / "routing.json").read_text())["results"]
    assert results["round_robin"]["requests_per_replica"] == [8, 8]
    assert sum(results["cache_aware"]["requests_per_replica"]) == 16
    for r in results.values():
        assert 0 < r["hit_rate"] <= 1 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
