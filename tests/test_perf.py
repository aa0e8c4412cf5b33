"""The benchmark suite in perf/ against a real tritonserver: the benchmark command in smoke mode writes its JSON
and plots, with transformers baselines; the locustfile's gRPC and HTTP users stream without failures."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "perf"))


def test_workload_prompts_have_the_asked_token_lengths(default_model_path):
    from workload import Profile, PromptMaker, make_items
    maker = PromptMaker(default_model_path)
    profile = Profile("variable", [4], [6], (16, 300), (16, 64))
    items = make_items(maker, profile, 6, seed=3)
    assert [i.prompt for i in items] == [i.prompt for i in make_items(maker, profile, 6, seed=3)]
    assert [i.prompt for i in items] != [i.prompt for i in make_items(maker, profile, 6, seed=4)]
    for item in items:
        assert maker.tokenizer(item.prompt).input_ids == item.prompt_ids
        assert 8 <= len(item.prompt_ids) <= 300 and 16 <= item.output_tokens <= 64


def test_anchor_profile_is_issue_14s_workload():
    from workload import profiles
    anchor = profiles()["anchor"]
    assert (anchor.concurrency, anchor.requests_per_level) == ([48], [48])   # all 48 in flight at t=0
    assert (anchor.prompt_tokens, anchor.output_tokens) == ((16, 512), (16, 256))
    assert profiles(anchor_requests=8)["anchor"].concurrency == [8] and "anchor" in profiles(smoke=True)


def test_baselines_flag_takes_a_list_and_alone_means_transformers(tmp_path):
    import pytest
    from benchmark import parse_args
    assert parse_args(["--baselines"]).baselines == ["hf"]
    assert parse_args([]).baselines == []
    args = parse_args(["--profiles", "anchor", "--baselines", "hf_static,engine"])
    assert args.baselines == ["hf_static", "engine"] and args.baseline_profile == "anchor"
    assert parse_args(["--baselines", "--no-progress"]).baseline_profile == "variable"
    with pytest.raises(SystemExit):
        parse_args(["--baselines", "hf,gpt"])
    with pytest.raises(SystemExit):   # no vLLM environment there: a clear error before any server starts
        parse_args(["--baselines", "vllm", "--vllm-python", str(tmp_path / "none" / "python")])


def test_baseline_helpers():
    from benchmark import cpu_list, greedy_agreement, served_engine_settings
    assert cpu_list({0, 1, 2, 3, 6}) == "0-3,6" and cpu_list({5}) == "5"
    settings = served_engine_settings(os.path.join(REPO, "model_repository"), {"kv_cache_bytes": "2147483648"})
    assert settings["kv_cache_bytes"] == "2147483648" and settings["max_num_seqs"] == "64"
    assert "model_path" not in settings
    agreement = greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert agreement["identical"] == 1 and abs(agreement["mean_agreeing_prefix"] - (1 + 1 / 3) / 2) < 1e-9


FAKE_VLLM = """
import argparse, asyncio, json, sys
from aiohttp import web
ap = argparse.ArgumentParser()
ap.add_argument("-m"); ap.add_argument("--model"); ap.add_argument("--dtype"); ap.add_argument("--port", type=int)
ap.add_argument("--kv-cache-memory-bytes")
args = ap.parse_args()
if args.dtype != "float32":
    sys.exit(f"unsupported dtype {args.dtype}")

async def health(request):
    return web.Response(text="")

async def completions(request):
    body = await request.json()
    assert body["model"] == args.model and body["min_tokens"] == body["max_tokens"], body
    r = web.StreamResponse()
    await r.prepare(request)
    for _ in range(body["max_tokens"]):
        text = "" if body["prompt"] == "special" else "x"   # vLLM streams skipped special tokens as ""
        await r.write(b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\\n\\n")
        await asyncio.sleep(0.001)
    usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
    final = {"choices": [{"text": "", "finish_reason": "length"}]}
    await r.write(b"data: " + json.dumps(final).encode() + b"\\n\\n")
    await r.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")
    return r

app = web.Application()
app.add_routes([web.get("/health", health), web.post("/v1/completions", completions)])
web.run_app(app, host="127.0.0.1", port=args.port, print=None)
"""


def _fake_vllm_python(tmp_path) -> str:
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_vllm.py'} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def test_vllm_served_baseline_runs_the_plan_against_its_server_and_stops_it(tmp_path, default_model_path):
    from benchmark import parse_args, run_vllm_served
    from workload import Item
    python = _fake_vllm_python(tmp_path)
    args = parse_args(["--profiles", "sweep", "--baselines", "vllm_served", "--vllm-python", python,
                       "--model-dir", default_model_path, "--out", str(tmp_path), "--no-progress"])
    items = [Item(prompt=p, prompt_ids=[1, 2], output_tokens=n) for p, n in (("hello", 3), ("special", 5),
                                                                               ("hello", 7))]
    levels = run_vllm_served(args, [("sweep", 1, items[:1]), ("sweep", 2, items)])
    assert [(lv["profile"], lv["concurrency"], lv["errors"]) for lv in levels] == [("sweep", 1, 0), ("sweep", 2, 0)]
    timings = levels[1]["timings"]
    assert [t["output_tokens"] for t in timings] == [3, 5, 7]
    # An answer of tokens without text (skipped special tokens) still has a first token and one gap per token;
    # the closing chunk without text is not a token.
    assert timings[1]["ttft"] < timings[1]["e2e"] and timings[1]["itl"] > 0.0005
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "fake_vllm.py")], capture_output=True).returncode == 1

    bad = parse_args(["--profiles", "sweep", "--baselines", "vllm_served", "--vllm-python", python,
                      "--vllm-dtype", "bfloat16", "--model-dir", default_model_path, "--out", str(tmp_path)])
    with pytest.raises(RuntimeError, match="(?s)failed to start.*unsupported dtype bfloat16"):
        run_vllm_served(bad, [("sweep", 1, items[:1])])


def test_a_request_timing_counts_its_responses_and_longest_gap():
    from grpc_load import _timing
    from workload import Item
    item = Item(prompt="p", prompt_ids=[1, 2, 3], output_tokens=5)
    # Five tokens in three responses (the server merged two pairs): ITL spreads the span over the tokens, the
    # longest gap shows the stream's stall.
    t = _timing(item, 0.0, 1.0, [1.1, 1.2, 1.5], 5, None)
    assert (t.responses, t.output_tokens) == (3, 5)
    assert t.max_gap == pytest.approx(0.3) and t.itl == pytest.approx(0.1) and t.ttft == pytest.approx(0.1)
    lone = _timing(item, 0.0, 1.0, [1.1], 1, None)
    assert lone.max_gap is None and lone.itl is None
    import report
    level = report.summarize("low", 1, [t], 1.0, None)
    assert level["responses_per_token"] == pytest.approx(0.6) and level["max_gap_ms"]["p50"] == pytest.approx(300)
    row = report.table([level], []).splitlines()[1].split()
    assert row[-2:] == ["0.60", "300.0/300.0"]


def test_against_puts_each_level_beside_the_other_servers_and_plot_draws_both(tmp_path):
    import report
    from grpc_load import RequestTiming

    def level(conc, tok_s, ttft):
        t = RequestTiming(prompt_tokens=4, output_tokens=int(tok_s), requested_tokens=int(tok_s), start=0.0,
                          ttft=ttft, e2e=1.0, itl=0.01)
        return report.summarize("sweep", conc, [t], 1.0, None)

    mine, theirs = [level(1, 100, 0.05), level(2, 300, 0.08)], [level(1, 80, 0.04), level(2, 200, 0.1)]
    lines = report.against(mine, theirs, "vLLM").splitlines()
    assert lines[1].split()[:5] == ["sweep", "1", "100.0", "80.0", "1.25x"]
    assert lines[2].split()[:7] == ["sweep", "2", "300.0", "200.0", "1.50x", "80.0", "100.0"]
    with pytest.raises(ValueError, match="levels differ"):
        report.against(mine, theirs[::-1], "vLLM")
    one, = report.plot(mine, str(tmp_path / "one_"))[:1]
    two, = report.plot(mine, str(tmp_path / "two_"), {"vLLM": theirs})[:1]
    assert os.path.getsize(one) > 10_000 and open(one, "rb").read() != open(two, "rb").read()


def test_engine_alone_baseline_makes_every_asked_token(default_model_path):
    from benchmark import run_engine_alone
    requests = [(list(range(10, 30)), 5), (list(range(40, 52)), 3)]
    result = run_engine_alone(default_model_path, requests, {"kv_cache_bytes": "16777216"})
    assert [len(t) for t in result["token_ids"]] == [5, 3] and result["output_tokens"] == 8
    assert result["wall_s"] > 0 and result["ttft_mean_ms"] > 0


def test_peak_kv_reads_the_vllm_gauge_when_exported():
    import http.server
    import threading

    from grpc_load import read_gauge
    body = (b"# TYPE vllm:gpu_cache_usage_perc_total counter\nvllm:gpu_cache_usage_perc_total 9\n"
            b'vllm:gpu_cache_usage_perc{model_name="llm"} 0.25\nvllm:gpu_cache_usage_perc{model_name="b"} 0.5\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert read_gauge(f"http://127.0.0.1:{server.server_port}/metrics") == 0.5
        assert read_gauge(f"http://127.0.0.1:{server.server_port}/metrics", ("vllm:num_requests_running",)) is None
    finally:
        server.shutdown()


@pytest.mark.server
def test_benchmark_smoke_writes_json_and_plots(triton_server, default_model_path, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(REPO, "perf", "benchmark.py"), "--url", triton_server.grpc_url,
           "--metrics-url", f"http://localhost:{triton_server.metrics_port}/metrics", "--model-dir",
           default_model_path, "--smoke", "--baselines", "--out", str(out), "--no-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TTFT ms p50/p95/p99" in run.stdout and "hf_continuous_batching" in run.stdout

    doc = json.loads((out / "benchmark.json").read_text())
    assert [lv["profile"] for lv in doc["levels"]] == ["low", "low", "high", "variable"]
    for lv in doc["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == len(lv["timings"])
        assert lv["output_tokens"] == sum(t["output_tokens"] for t in lv["timings"]) > 0
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"]
        assert 0 < lv["e2e_s"]["p50"] * 1e3 and lv["output_tok_s"] > 0
        for t in lv["timings"]:
            # The server never gives more than asked, and the first token comes before the last.
            assert 0 < t["output_tokens"] <= t["requested_tokens"] and t["ttft"] <= t["e2e"]
    variable = doc["levels"][-1]
    assert {b["name"] for b in doc["baselines"]} == {"hf_one_at_a_time", "hf_static_batch8", "hf_continuous_batching"}
    # The ratio from the raw measurements: tokens counted per request over the level's wall clock (which must
    # cover its longest request), against the baseline's tokens over its own wall clock.
    assert variable["wall_s"] >= max(t["e2e"] for t in variable["timings"])
    server_tok_s = sum(t["output_tokens"] for t in variable["timings"]) / variable["wall_s"]
    for b in doc["baselines"]:
        assert b["output_tokens"] == variable["output_tokens"] and b["wall_s"] > 0
        assert b["server_ratio"] == pytest.approx(server_tok_s / (b["output_tokens"] / b["wall_s"]), rel=1e-9)
    for name in ("throughput_latency.png", "ttft_distribution.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.server
def test_locust_users_stream_without_failures(triton_server, tmp_path):
    """Through the front door with an API key, as against a deployment: its HTTP port's v2 routes and its gRPC
    relay."""
    from conftest import free_ports
    from trellm_backend.tools.launch import start_front_door, stop_front_door
    locust = os.path.join(REPO, ".venv-locust", "bin", "locust")
    prefix = tmp_path / "locust"
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-locust name=locust\n")
    http_port, grpc_port = free_ports(2)
    door = start_front_door(triton_server, http_port, str(keys), grpc_port=grpc_port, host="127.0.0.1")
    # --stop-timeout lets each user finish its answer: a stream cancelled mid-answer leaves the ensemble request
    # in flight on Triton 2.51, and the server's shutdown then waits out its exit timeout.
    cmd = [locust, "-f", os.path.join(REPO, "perf", "locustfile.py"), "--headless", "-u", "2", "-r", "2",
           "-t", "5s", "--stop-timeout", "10", "--host", f"http://127.0.0.1:{http_port}",
           "--grpc-url", f"127.0.0.1:{grpc_port}", "--api-key", "sk-locust", "--max-tokens", "8",
           "--csv", str(prefix), "--only-summary"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        stop_front_door(door)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(f"{prefix}_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f) if r["Type"]}
    for kind in ("grpc-stream", "http-sse"):
        for event in ("ttft", "inter_token", "e2e"):
            row = rows[(kind, event)]
            assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        assert 0 < float(rows[(kind, "e2e")]["Average Content Size"]) <= 8   # tokens per answer, at most as asked


def test_cpu_by_process_counts_an_engine_threads_time_under_its_name():
    """--cpu-by-process's accounting: a process whose busy thread is named as the engine loop names its stepping
    thread shows that thread's CPU time on its own row, the idle ones under "other", and the table turns it into
    milliseconds per output token."""
    import cpu_use
    code = ("import threading, time, sys\n"
            "from trellm_backend.engine.cores import name_os_thread\n"
            "def spin():\n"
            "    name_os_thread(); end = time.process_time() + 0.6\n"
            "    while time.process_time() < end: pass\n"
            "    print('done', flush=True); sys.stdin.readline()\n"
            "threading.Thread(target=spin, name='trellm-engine').start()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        use = cpu_use.CPUUse(proc.pid)
        before = use.snapshot()
        assert proc.stdout.readline().strip() == "done"
        rows = cpu_use.cpu_seconds(before, use.snapshot())
    finally:
        proc.communicate("\n", timeout=30)
    assert rows["tritonserver trellm-engine"] >= 0.4, rows
    assert rows.get("tritonserver other", 0.0) < 0.3, rows
    text = cpu_use.table([{"profile": "low", "concurrency": 1, "cpu_s": rows, "wall_s": 1.0, "output_tokens": 100}])
    engine_line = next(line for line in text.splitlines() if line.startswith("tritonserver trellm-engine"))
    assert abs(float(engine_line.split()[-1]) - 1000 * rows["tritonserver trellm-engine"] / 100) < 1e-3


def test_roofline_counts_every_weight_a_decode_step_reads_and_the_linears_flop(default_model_path, monkeypatch):
    """perf/roofline.py's accounting against the checkpoint itself: a decode step reads every tensor of the file
    but the embedding table (one row a token; the default model's LM head is a tensor of its own) once, at 4 bytes
    in float32 and 2 in bfloat16, in whatever layout each weight is held; weight-only INT8 reads the layers'
    linears at 1 byte with a float32 scale per output row. The linears' FLOP are 2 x their elements per token."""
    import math
    import torch
    from safetensors import safe_open
    import roofline
    from trellm_backend.models.config import load_model_config
    from trellm_backend.models.llama import LlamaModel
    from trellm_backend.models.weights import load_state_dict
    from trellm_kernels import dispatch
    # The written-down layouts (C++ blocks, oneDNN's, dense), not timed at load: seconds on a busy host.
    monkeypatch.setattr(dispatch, "_settings", dispatch.KernelSettings(cpu_linear="cpp"))
    with safe_open(os.path.join(default_model_path, "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert "lm_head.weight" in shapes
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    layer_linears = [name for name in shapes if name.endswith("_proj.weight")]
    read = sum(numel.values()) - numel["model.embed_tokens.weight"]
    linear = sum(numel[name] for name in layer_linears) + numel["lm_head.weight"]
    cfg = load_model_config(default_model_path)
    for dtype, quantization, expected in (
            (torch.float32, "none", 4 * read), (torch.bfloat16, "none", 2 * read),
            (torch.float32, "int8", 4 * read - 3 * sum(numel[n] for n in layer_linears)
             + 4 * sum(shapes[n][0] for n in layer_linears))):
        model = LlamaModel(cfg, load_state_dict(default_model_path, dtype), torch.device("cpu"), dtype, 64,
                           quantization)
        assert roofline.weight_bytes_per_step(model) == expected, (dtype, quantization)
        assert roofline.linear_flop(model, 48) == 2 * linear * 48
