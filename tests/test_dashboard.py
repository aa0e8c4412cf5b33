"""The Grafana dashboard (deploy/grafana/trellm-dashboard.json) against a real Prometheus (Debian's package) scraping
a live tritonserver and its OpenAI front door with deploy/prometheus.yml: every panel's every query returns data,
and the ones that count the traffic sent return it. A query naming a metric the code no longer exports fails the
static check without a server."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from trellm_backend.tools.testbed import free_ports, private_repository, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "trellm-dashboard.json")
PROMETHEUS_CONFIG = os.path.join(REPO, "deploy", "prometheus.yml")
NAME = re.compile(r"\b(vllm:[a-z0-9_:]+|trellm:[a-z0-9_:]+|trellm_openai_[a-z0-9_]+|nv_[a-z0-9_]+)\b")


def queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def exported_names() -> set[str]:
    """Every metric family the llm model and the front door export (histograms with their series' suffixes)."""
    from trellm_backend.triton import metrics
    from trellm_openai.server import Metrics
    names = {*metrics.COUNTERS, *metrics.GAUGES, metrics.LORA_INFO, metrics.CACHE_CONFIG_INFO}
    names |= {h + suffix for h in metrics.HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    names |= set(re.findall(r"^# TYPE (\S+)", Metrics().text(), re.M))
    return names


@pytest.mark.unit
def test_every_dashboard_query_names_metrics_the_code_exports():
    """A renamed or dropped metric leaves a panel empty in every operator's Grafana: caught here first (Triton's own
    nv_ metrics are checked by the live test)."""
    exported = exported_names()
    panels = queries()
    assert len(panels) >= 20
    for title, expr in panels:
        named = set(NAME.findall(expr))
        assert named, (title, expr)
        missing = {n for n in named if not n.startswith("nv_")} - exported
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which nothing exports"
    covered = {n for _, expr in panels for n in NAME.findall(expr)}
    for family in ("vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                   "vllm:spec_decode_num_accepted_tokens_total", "vllm:lora_requests_info",
                   "trellm:structured_output_compile_requests_total", "trellm_openai_requests_total",
                   "trellm_openai_tokens_total", "trellm_openai_rate_limited_total", "vllm:request_success_total"):
        assert family in covered, f"no panel shows {family}"


KEYS = "sk-a name=a rpm=2\nsk-b name=b\n"


@pytest.fixture(scope="module")
def watched(default_model_path, tmp_path_factory):
    """A tritonserver whose llm serves a LoRA adapter with n-gram speculation, its front door with two keys, and
    Prometheus scraping both with deploy/prometheus.yml (targets on loopback, scraped every second)."""
    from hf_models import make_lora
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    prometheus = shutil.which("prometheus")
    assert prometheus, "Prometheus is missing: scripts/setup.sh installs Debian's package"
    root = tmp_path_factory.mktemp("dashboard")
    adapter = make_lora(default_model_path, "attn-r8", str(root / "attn-r8"))
    repo = private_repository(os.path.join(REPO, "model_repository"), str(root / "repo"),
                              {"llm": {"lora_adapters": json.dumps({"a8": adapter}), "speculative_method": "ngram"}})
    server = TritonServer(repo, *free_ports(3), log_path=str(root / "server.log")).start()
    door_port, prom_port = free_ports(2)
    (root / "keys.txt").write_text(KEYS)
    door = start_front_door(server, door_port, str(root / "keys.txt"), "hermes")
    with open(PROMETHEUS_CONFIG) as f:
        config = yaml.safe_load(f)
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    targets = {"triton": f"127.0.0.1:{server.metrics_port}", "openai": f"127.0.0.1:{door_port}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = subprocess.Popen([prometheus, f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=open(root / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{prom_port}"
    try:
        wait_until(lambda: _get(url + "/-/ready") is not None, timeout=60, what="Prometheus ready")
        yield server, f"http://127.0.0.1:{door_port}", url
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        stop_front_door(door)
        server.stop()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read()
    except OSError:
        return None


def query(prom: str, expr: str) -> list[dict]:
    body = _get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body is not None, expr
    answer = json.loads(body)
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def send_traffic(server, door: str) -> None:
    """Streams over gRPC with and without the adapter (repetitive text, so n-gram guesses are accepted), OpenAI
    requests from two keys, one of them until it passes its limit (a 429), and one with a JSON guide."""
    from openai import OpenAI, RateLimitError
    from trellm_client.client import LLMClient
    with LLMClient(server.grpc_url) as c:
        for i in range(4):
            list(c.stream("one two three one two three one two three one two", max_tokens=16,
                          **({"lora_name": "a8"} if i % 2 else {})))
    b = OpenAI(base_url=door + "/v1", api_key="sk-b", max_retries=0)
    for i in range(3):
        b.completions.create(model="ensemble", prompt=f"The number {i} is", max_tokens=8)
    b.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "A JSON object"}],
                              max_tokens=12, response_format={"type": "json_object"})
    a = OpenAI(base_url=door + "/v1", api_key="sk-a", max_retries=0)
    with pytest.raises(RateLimitError):     # 2 a minute: the third at the latest
        for _ in range(3):
            a.completions.create(model="ensemble", prompt="Hello", max_tokens=4)


@pytest.mark.server
def test_every_dashboard_panel_returns_data_from_a_real_prometheus(watched):
    server, door, prom = watched
    send_traffic(server, door)
    rate_window = "1m"

    def expr_of(expr: str) -> str:   # Grafana's variables, as the dashboard's defaults resolve them
        return expr.replace("$__rate_interval", rate_window).replace("$model", ".+")

    finished = 'sum(vllm:request_success_total{model="llm"})'

    def scraped(expr: str) -> float:
        result = query(prom, expr)
        return float(result[0]["value"][1]) if result else 0.0
    # A counter's series starts at its first increment, and rate() needs an increase between two samples: so the
    # traffic comes in two rounds, the second after Prometheus has seen the first.
    wait_until(lambda: scraped(finished) >= 8 and scraped("sum(trellm_openai_rate_limited_total)") >= 1, timeout=60,
               what="Prometheus has scraped the first round")
    first = scraped(finished)
    send_traffic(server, door)
    wait_until(lambda: scraped(finished) >= first + 8 and scraped("sum(trellm_openai_rate_limited_total)") >= 2,
               timeout=60, what="Prometheus has scraped the second round")
    panels = queries()
    empty = [(title, expr) for title, expr in panels if not query(prom, expr_of(expr))]
    assert not empty, f"panels without data: {empty}"

    def value(expr: str) -> float:
        return max(float(s["value"][1]) for s in query(prom, expr_of(expr)))
    first = {}                    # each panel's first query (the p50 of a latency panel)
    for title, expr in panels:
        first.setdefault(title, expr)
    assert value(first["Finished requests per second, by reason"]) > 0
    assert value(first["Rate-limited (429) per second, by key"]) > 0
    ttft = query(prom, expr_of(first["Time to first token"]))
    assert 0 < float(ttft[0]["value"][1]) < 60
    acceptance = value(first["Speculative decoding: accepted / guessed tokens"])
    assert 0 < acceptance <= 1, "the repetitive prompts' n-gram guesses are partly accepted"
    assert {s["metric"]["key"] for s in query(prom, "trellm_openai_tokens_total")} == {"a", "b"}
    compiles = query(prom, 'sum(trellm:structured_output_compile_requests_total{model="llm"})')
    assert float(compiles[0]["value"][1]) >= 1


@pytest.mark.unit
def test_the_compose_monitoring_profile_provisions_this_dashboard_and_prometheus_config():
    """`docker compose --profile monitoring up` runs Prometheus with deploy/prometheus.yml and Grafana with this
    dashboard and a datasource whose uid is the dashboard's default; both only in that profile."""
    r = subprocess.run(["docker-compose", "--profile", "monitoring", "config"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    # "source:target:ro" (Debian's docker-compose 1) or {source, target} (Compose 2)
    mounts = dict((v.split(":")[:2] if isinstance(v, str) else (v["source"], v["target"]))
                  for s in ("prometheus", "grafana") for v in services[s]["volumes"])
    assert mounts[PROMETHEUS_CONFIG] == "/etc/prometheus/prometheus.yml"
    assert mounts[DASHBOARD].startswith("/var/lib/grafana/dashboards/")
    provisioning = os.path.join(REPO, "deploy", "grafana", "provisioning")
    with open(os.path.join(provisioning, "datasources", "prometheus.yml")) as f:
        uid = yaml.safe_load(f)["datasources"][0]["uid"]
    with open(DASHBOARD) as f:
        variables = {v["name"]: v for v in json.load(f)["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == uid
    with open(os.path.join(provisioning, "dashboards", "trellm.yml")) as f:
        assert yaml.safe_load(f)["providers"][0]["options"]["path"] == os.path.dirname(mounts[DASHBOARD])
