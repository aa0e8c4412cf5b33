"""The Kubernetes deployment (deploy/k8s/): the manifests render with kubectl's kustomize and validate against the
API schemas of Kubernetes 1.29-1.32, and what they rely on (ports, probe commands and paths, the metric the
autoscaler reads, the drain's timing) is what a live server does."""
from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import kubernetes_validate
import pytest
import yaml

from conftest import REPO, free_ports
from trellm_backend.engine.limits import DEFAULT_BLOCK_SIZE
from trellm_backend.tools import launch
from trellm_backend.tools.healthcheck import generate_probe
from trellm_backend.tools.testbed import metric_samples, metric_sum, private_repository, wait_until
from trellm_client.client import LLMClient

K8S = os.path.join(REPO, "deploy", "k8s")
KUBERNETES_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0"]
# The gauges the endpoint picker (deploy/k8s/inference-extension/epp.yaml) reads of a vLLM-like model server: its
# core-metrics-extractor's "vllm" engine. Its LoRA gauge, vllm:lora_requests_info, appears once adapters are
# declared (tests/test_metrics_reporter.py checks its labels).
EPP_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              "vllm:cache_config_info")


@functools.cache
def rendered(folder: str) -> str:
    out = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, folder)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(folder: str) -> list[dict]:
    """The folder's objects, parsed afresh each call (a test may change its copy)."""
    return [d for d in yaml.safe_load_all(rendered(folder)) if d]


def base() -> dict[str, dict]:
    return {d["kind"]: d for d in render("base")}


def container() -> dict:
    return base()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def inference_extension() -> dict[str, dict]:
    """The endpoint picker's objects by kind, without the InferencePool (returned by `inference_pool`)."""
    return {d["kind"]: d for d in render("inference-extension") if d["kind"] != "InferencePool"}


def inference_pool() -> dict:
    (pool,) = [d for d in render("inference-extension") if d["kind"] == "InferencePool"]
    return pool


def epp_config() -> dict:
    return yaml.safe_load(inference_extension()["ConfigMap"]["data"]["epp-config.yaml"])


@pytest.mark.unit
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_render_and_validate_against_the_kubernetes_api(version):
    """Every object but the InferencePool, whose schema is the extension's CRD, not the API server's."""
    docs = render("base") + render("prometheus-adapter") + list(inference_extension().values())
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                         "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)   # raises naming the field


@pytest.mark.unit
def test_a_broken_manifest_fails_validation():
    """The validation above can fail: a probe with a misspelt field is refused."""
    deployment = base()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 15
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.unit
def test_the_pieces_name_each_other():
    """Service ports target the container's named ports; the scrape annotation names the metrics port; the
    autoscaler scales this Deployment on the name the adapter gives the engine's waiting-requests gauge; the
    budget and the Service select the pods."""
    docs = base()
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} == set(ports)
    pod = docs["Deployment"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        selector = docs[kind]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    (rule,) = yaml.safe_load(render("prometheus-adapter")[0]["data"]["config.yaml"])["rules"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300, "no pod removed mid-burst"


@pytest.mark.unit
def test_the_inference_pool_and_its_endpoint_picker_name_each_other():
    """The InferencePool picks ../base's pods and sends to their OpenAI front door; it asks the EPP's Service on the
    port the EPP serves; the EPP runs under the account its Role is bound to, reads the config file its ConfigMap
    mounts, and scrapes each pod's /metrics on the pool's port (the front door, which relays Triton's)."""
    pool, epp = inference_pool(), inference_extension()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    pod = base()["Deployment"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["openai"]]

    spec = epp["Deployment"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args, rest = {}, list(c["args"])
    while rest:     # "--flag value" or "--flag=value"
        flag = rest.pop(0)
        name, _, value = flag.partition("=")
        args[name] = value if value else rest.pop(0)
    assert args["--pool-name"] == pool["metadata"]["name"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == epp["Service"]["metadata"]["name"]
    (grpc,) = [p for p in epp["Service"]["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert epp_ports[grpc["targetPort"]] == int(args["--grpc-port"])
    assert epp["Service"]["spec"]["selector"].items() <= epp["Deployment"]["spec"]["template"]["metadata"][
        "labels"].items()
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == int(args["--grpc-health-port"]) == epp_ports["grpc-health"]
    (mount,) = c["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == epp["ConfigMap"]["metadata"]["name"]
    assert args["--config-file"] == f"{mount['mountPath']}/epp-config.yaml"
    assert spec["serviceAccountName"] == epp["ServiceAccount"]["metadata"]["name"]
    binding = epp["RoleBinding"]
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    assert binding["roleRef"]["name"] == epp["Role"]["metadata"]["name"]
    assert any("inferencepools" in r["resources"] for r in epp["Role"]["rules"])

    config = epp_config()
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    assert plugins["metrics-data-source"]["path"] == "/metrics" and "port" not in plugins["metrics-data-source"]
    assert "defaultEngine" not in plugins["core-metrics-extractor"], "the vllm names (EPP_GAUGES) are the default"
    profile = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= profile <= set(plugins)


@pytest.mark.server
def test_ports_probes_and_metrics_are_what_a_live_server_has(triton_server):
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    defaults = launch.parser().parse_args([])      # what the container's command leaves to the launcher
    assert ports["metrics"] == defaults.metrics_port
    assert "http" not in ports and not defaults.http_public, "Triton's own HTTP port is the pod's loopback only"
    assert not defaults.grpc_public, "Triton's own gRPC port is the pod's loopback only"
    assert f"--openai-port={ports['openai']}" in c["command"]
    assert f"--openai-grpc-port={ports['grpc']}" in c["command"], "the pod's gRPC port is the front door's relay"
    # Startup (inside the container): the probe's own command, pointed at the live server, passes; at a port with
    # no server, fails.
    for probe in ("startupProbe",):
        cmd = c[probe]["exec"]["command"]
        assert cmd[cmd.index("--url") + 1] == f"localhost:{defaults.http_port}"
        live = [sys.executable if a == "python3" else a for a in cmd]
        live[cmd.index("--url") + 1] = triton_server.http_url
        assert subprocess.run(live, capture_output=True, timeout=60).returncode == 0
        dead = list(live)
        dead[cmd.index("--url") + 1] = f"localhost:{free_ports(1)[0]}"
        assert subprocess.run(dead, capture_output=True, timeout=60).returncode == 1
        assert c[probe]["timeoutSeconds"] > float(cmd[cmd.index("--timeout") + 1])
    port = free_ports(1)[0]
    front_door = launch.start_front_door(triton_server, port, None)
    try:
        # Ready and live from outside the pod: the front door's port, which relays Triton's health routes.
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == "openai"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{c[probe]['httpGet']['path']}", timeout=10) as r:
                assert r.status == 200
        # What the endpoint picker reads, on the port it scrapes: the front door's /metrics, which relays Triton's.
        # The prefix scorer hashes prompts in the block size it reads there.
        path = {p["type"]: p for p in epp_config()["plugins"]}["metrics-data-source"]["parameters"]["path"]
        relayed = metric_samples(f"http://127.0.0.1:{port}{path}")
    finally:
        launch.stop_front_door(front_door)
    # The series the adapter's rule selects is exported, per model, by the server's metrics endpoint.
    (rule,) = yaml.safe_load(render("prometheus-adapter")[0]["data"]["config.yaml"])["rules"]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    samples = metric_samples(triton_server.metrics_port)
    assert any(s.name == series for s in samples)
    names = {s.name for s in relayed}
    assert set(EPP_GAUGES) <= names, set(EPP_GAUGES) - names
    (info,) = [s for s in relayed if s.name == "vllm:cache_config_info" and s.labels["model"] == "llm"]
    assert info.value == 1 and info.labels["block_size"] == str(DEFAULT_BLOCK_SIZE["cpu"])   # the repository's 0
    (blocks,) = [s for s in relayed if s.name == "trellm:kv_cache_total_blocks" and s.labels["model"] == "llm"]
    assert int(info.labels["num_gpu_blocks"]) == blocks.value > 0


@pytest.mark.server
def test_a_terminated_pod_drains_and_exits_within_its_grace_period(default_model_path, tmp_path):
    """The container's command under a queue (llm with max_num_seqs 2, twelve streams), then SIGTERM, as Kubernetes
    sends it after preStop. While requests wait in the engine, Triton's queue metric for llm shows no wait (why the
    autoscaler reads vllm:num_requests_waiting instead); after SIGTERM every stream ends, the running ones with
    finish_reason abort, and the launcher with its server and front door exits in under half the grace period left
    after preStop. (Twelve streams, not six: on a fast host the tiny model answers a whole stream in about a second,
    and six emptied the queue within the 3 s the test watches it.)"""
    pod = base()["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    budget = pod["terminationGracePeriodSeconds"] - pre_stop
    repo = private_repository(os.path.join(REPO, "model_repository"), str(tmp_path / "repo"),
                              {"llm": {"max_num_seqs": "2"}}, model_dir=default_model_path)
    http, grpc, metrics, openai, relay = free_ports(5)
    cmd = [sys.executable if a == "python3" else a for a in c["command"]]
    cmd = [a for a in cmd if not a.startswith(("--model-repository=", "--openai-port=", "--openai-grpc-port="))]
    cmd += [f"--model-repository={repo}", f"--http-port={http}", f"--grpc-port={grpc}",
            f"--metrics-port={metrics}", f"--openai-port={openai}", f"--openai-grpc-port={relay}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while generate_probe(f"localhost:{http}", timeout=10) is not None or not listening(openai):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        ends: dict[int, str] = {}

        def stream(i):
            try:
                with LLMClient(f"localhost:{grpc}") as client:
                    for chunk in client.stream_chunks("The Python language", max_tokens=4000, ignore_eos=True):
                        if chunk.final:
                            ends[i] = chunk.finish_reason
            except Exception as e:     # a request still waiting when the server stops may end in an error
                ends[i] = f"error: {e}"
        def openai_stream():
            import httpx2 as httpx   # the HTTP client the openai SDK (pinned) brings
            body = {"model": "ensemble", "prompt": "The Python language", "max_tokens": 1900, "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", f"http://localhost:{openai}/v1/completions", json=body, timeout=120) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                ends["openai"] = "done" if lines and lines[-1] == "data: [DONE]" else f"cut after {lines[-1:]}"
            except Exception as e:
                ends["openai"] = f"error: {e}"
        streams = 12
        readers = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        readers.append(threading.Thread(target=openai_stream))
        for r in readers:
            r.start()

        def llm_samples():
            return {s.name: s.value for s in metric_samples(metrics)
                    if s.labels.get("model") == "llm" or s.name.startswith("vllm:")}
        wait_until(lambda: llm_samples().get("vllm:num_requests_waiting", 0) >= 4, 120, "four queued requests", 0.2)
        time.sleep(3)
        seen = llm_samples()
        assert seen["vllm:num_requests_waiting"] >= 4 and seen["vllm:num_requests_running"] == 2
        queued_us = seen.get("nv_inference_queue_duration_us", 0.0)
        print(f"4+ requests waiting in the engine for 3 s; Triton's llm queue time so far: {queued_us:.0f} us")
        # Had Triton counted the engine's queue, 4 requests waiting 3 s would be 12 s of it; what it counts is the
        # moments before execute() takes each request (0.1 s in all has been seen on a busy 2-core host).
        assert queued_us < 1_000_000, "Triton's queue metric does see the engine's queue after all"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=budget)
        took = time.monotonic() - t0
        for r in readers:
            r.join(10)
            assert not r.is_alive(), "a stream outlived the server"
        assert ends.pop("openai") == "done", "the OpenAI stream must end with [DONE], not be cut"
        assert sorted(ends) == list(range(streams)) and list(ends.values()).count("abort") >= 2, ends
        assert took < budget / 2, f"exit took {took:.1f} s of the {budget:.0f} s the pod has after preStop"
        print(f"SIGTERM to exit: {took:.1f} s (grace left after preStop: {budget:.0f} s); streams: {ends}")
    finally:
        if proc.poll() is None:      # a failed check: the launcher's own stop takes its server (a process group
            proc.send_signal(signal.SIGTERM)    # of its own) down with it; SIGKILL only if that hangs
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def hpa_desired(current: int, per_pod: float, spec: dict, tolerance: float = 0.1) -> int:
    """The replica count Kubernetes' HPA asks for (its documented algorithm) with one Pods metric at an AverageValue
    target: ceil(current * value / target), unchanged within the tolerance, at most the scale-up policy's pods more
    than now, within min and max."""
    target = float(spec["metrics"][0]["pods"]["target"]["averageValue"])
    ratio = per_pod / target
    if abs(ratio - 1) <= tolerance:
        return current
    want = math.ceil(current * ratio)
    if want > current:
        want = min(want, current + max(p["value"] for p in spec["behavior"]["scaleUp"]["policies"]))
    return max(spec["minReplicas"], min(spec["maxReplicas"], want))


@pytest.mark.server
def test_the_autoscaler_asks_for_more_replicas_as_the_queue_grows(default_model_path, tmp_path):
    """One replica (llm running 2 sequences at a time) under a rising load of 2, 6 and 14 streams: its
    vllm:num_requests_waiting series, averaged as the adapter's rule does, fed to the HPA's arithmetic with
    hpa.yaml's target and policies, asks for 1, 1 (4 waiting is the target itself) and 3 replicas (12 waiting is
    three replicas' worth, within the scale-up policy's two more). Each reader streams again as soon as its stream
    ends, so the load stays at its level however fast the host answers (a fast one finished the first streams before
    the third level was reached)."""
    from trellm_backend.tools.launch import TritonServer
    spec = base()["HorizontalPodAutoscaler"]["spec"]
    repo = private_repository(os.path.join(REPO, "model_repository"), str(tmp_path / "repo"),
                              {"llm": {"max_num_seqs": "2"}}, model_dir=default_model_path)
    server = TritonServer(repo, *free_ports(3), log_path=str(tmp_path / "server.log")).start()
    stop = threading.Event()

    def stream():
        with LLMClient(server.grpc_url) as client:
            while not stop.is_set():
                for _ in client.stream_chunks("The Python language", max_tokens=1900, ignore_eos=True):
                    if stop.is_set():
                        return
    readers = []
    try:
        asked = []
        for streams in (2, 6, 14):
            while len(readers) < streams:
                readers.append(threading.Thread(target=stream, daemon=True))
                readers[-1].start()
            wait_until(lambda: waiting(server) >= streams - 4, 60, f"{streams - 4} of {streams} streams queued", 0.1)
            series = []
            for _ in range(20):          # the rule's mean over its window, here 2 s of samples
                series.append(waiting(server))
                time.sleep(0.1)
            asked.append(hpa_desired(1, sum(series) / len(series), spec))
        assert asked == [1, 1, 3], asked
    finally:
        stop.set()
        server.stop()
        for r in readers:
            r.join(30)


def waiting(server) -> float:
    return metric_sum(server.metrics_port, "vllm:num_requests_waiting")


def listening(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def pipeline() -> dict[str, dict]:
    return {d["kind"]: d for d in render("pipeline")}


@pytest.mark.unit
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_pipeline_manifest_validates(version):
    """The LeaderWorkerSet's own schema is its controller's CRD: its two pod templates validate as Pods."""
    docs = pipeline()
    assert set(docs) == {"LeaderWorkerSet", "Service"}
    kubernetes_validate.validate(docs["Service"], version, strict=True)
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    for name, template in lws["spec"]["leaderWorkerTemplate"].items():
        if name.endswith("Template"):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name.lower(), **template["metadata"]},
                   "spec": template["spec"]}
            kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.unit
def test_the_pipeline_leader_writes_a_model_whose_stages_meet_where_the_workers_join(default_model_path, tmp_path):
    """The leader's command, run here with the group's variables set as the controller sets them, writes an entry
    whose llm runs a stage per pod and meets them at the address and port each worker joins; the Service sends to the
    leader only, on its named ports; both pods read the model from the same place."""
    spec = pipeline()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    (leader,) = spec["leaderTemplate"]["spec"]["containers"]
    (worker,) = spec["workerTemplate"]["spec"]["containers"]
    env = {**os.environ, "LWS_GROUP_SIZE": str(spec["size"]), "LWS_LEADER_ADDRESS": "leader.example",
           "LWS_WORKER_INDEX": "1"}
    add = leader["command"][-1].split(" && exec ")[0].replace("python3", sys.executable)
    add = add.replace("/opt/trellm/hf_models/my-model", default_model_path).replace("/var/run/trellm", str(tmp_path))
    done = subprocess.run(["sh", "-c", add], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from trellm_backend.tools.repository import read_config
    params = {k: v.string_value for k, v in read_config(str(tmp_path / "repository" / "chat_llm" /
                                                                "config.pbtxt")).parameters.items()}
    assert params["pipeline_parallel_size"] == str(spec["size"])
    join = subprocess.run(["sh", "-c", "echo " + worker["command"][-1].split("worker", 1)[1]], env=env,
                          capture_output=True, text=True).stdout.split()
    assert join == ["--join", params["distributed_init"], "--rank", "1"]
    port = int(params["distributed_init"].rsplit(":", 1)[1])
    assert {"name": "stages", "containerPort": port} in leader["ports"]
    service = pipeline()["Service"]["spec"]
    assert service["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert {p["targetPort"] for p in service["ports"]} <= {p["name"] for p in leader["ports"]}
    assert "--model-repository=/var/run/trellm/repository" in leader["command"][-1]
    mounts = [{m["name"]: m for m in c["volumeMounts"]}["models"] for c in (leader, worker)]
    assert mounts[0] == mounts[1]
