"""genai-perf, the load client our users run, against both entry points of a real tritonserver: a small streaming
profile each (`--backend tensorrtllm -m ensemble`, `--backend vllm -m vllm_model`, Triton's KServe gRPC API), checked
on the files it exports. genai-perf lives in its own environment (.venv-genai-perf, made by scripts/setup.sh unless
WITH_GENAI_PERF=0) and drives the perf_analyzer of .venv; it counts tokens with the served model's own tokenizer
folder, passed with --tokenizer (no model hub here)."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess

import pytest

from trellm_backend.tools.testbed import perf_analyzer_env

pytestmark = pytest.mark.server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENAI_PERF = os.path.join(ROOT, os.environ.get("GENAI_PERF_VENV", ".venv-genai-perf"), "bin", "genai-perf")
REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 8, 2, 16, 12
TIME_LIMIT_S = 120   # one profile takes about 8 s on 2 cores, most of it genai-perf's own start


def _env() -> dict:
    """genai-perf runs `perf_analyzer` from PATH: the one of this test's environment (tritonclient[all]), which needs
    CUDA's runtime library (from the nvidia-cuda-runtime-cu12 wheel) even on a CPU host."""
    env = perf_analyzer_env()
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"   # the tokenizer is a local folder: never ask a hub
    return env


def _clip(out: str) -> str:
    return out if len(out) < 12000 else f"{out[:4000]}\n[...]\n{out[-8000:]}"


def _run(cmd: list[str], cwd) -> str:
    """Runs cmd in its own process group under TIME_LIMIT_S; on overrun the group (genai-perf and its perf_analyzer)
    is killed and the test fails with what it printed."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"genai-perf ran past {TIME_LIMIT_S} s:\n{_clip(out)}")
    assert proc.returncode == 0, f"genai-perf exited with {proc.returncode}:\n{_clip(out)}"
    return out


def _csv_metrics(path) -> dict[str, dict[str, float]]:
    """profile_export_genai_perf.csv: two tables (per-request statistics, then totals), blank-line separated;
    numbers may carry thousands separators."""
    rows: dict[str, dict[str, float]] = {}
    header: list[str] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                header = []
            elif not header:
                header = row
            else:
                rows[row[0]] = {h: float(v.replace(",", "")) for h, v in zip(header[1:], row[1:]) if v != "N/A"}
    return rows


@pytest.fixture(scope="module")
def relay(triton_server, tmp_path_factory):
    """The front door's gRPC relay on the session's server, with a keys file: (its address, the key's header)."""
    from conftest import free_ports
    from trellm_backend.tools.launch import start_front_door, stop_front_door
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("sk-genai-perf name=genai-perf\n")
    http_port, grpc_port = free_ports(2)
    door = start_front_door(triton_server, http_port, str(keys), grpc_port=grpc_port, host="127.0.0.1")
    yield f"127.0.0.1:{grpc_port}", "authorization:Bearer sk-genai-perf"
    stop_front_door(door)


@pytest.mark.parametrize("model, backend, via", [("ensemble", "tensorrtllm", "triton"), ("vllm_model", "vllm", "triton"),
                                                 ("ensemble", "tensorrtllm", "relay"), ("vllm_model", "vllm", "relay")])
def test_genai_perf_streaming_profile(triton_server, default_model_path, tmp_path, model, backend, via, request):
    """`via`: Triton's own gRPC port (loopback), or the front door's gRPC relay with an API key (-H)."""
    if via == "relay":
        url, header = request.getfixturevalue("relay")
        target = ["-u", url, "--header", header]
    else:
        target = ["-u", triton_server.grpc_url]
    if not os.path.exists(GENAI_PERF):
        pytest.fail(f"genai-perf is not installed ({GENAI_PERF} is missing): run `make setup` or "
                    "`bash scripts/setup.sh`, which installs it into .venv-genai-perf unless WITH_GENAI_PERF=0")
    # The server's own token count comes back in each response (return_num_output_tokens), so the length check
    # does not rest on genai-perf re-tokenizing the text; vllm_model sends finish_reason only when asked.
    # The log probabilities are asked for because perf_analyzer 2.51 requests every output the model declares and
    # writes, for one a response does not carry, stale bytes into its export: a stale float that reads as NaN or
    # Inf makes its JSON writer stop, and perf_analyzer leaves an empty profile_export.json (exit 0) that genai-perf
    # then fails to parse (seen about once in 15 runs against the ensemble). The stale integers that remain are
    # harmless, and no check reads them.
    extra = ["return_num_output_tokens:true"] + (
        ["return_log_probs:true"] if backend == "tensorrtllm"
        else ["return_finish_reason:true", "return_cumulative_logprob:true"])
    artifacts = tmp_path / "artifacts"
    _run([GENAI_PERF, "profile", "-m", model, "--backend", backend, "--endpoint-type", "kserve", "--streaming",
          *target, "--tokenizer", default_model_path,
          "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
          "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-mean-deterministic", "--random-seed", "0",
          "--num-dataset-entries", str(REQUESTS), "--concurrency", str(CONCURRENCY),
          "--request-count", str(REQUESTS), "--warmup-request-count", "0",
          "--server-metrics-url", f"http://localhost:{triton_server.metrics_port}/metrics",
          "--artifact-dir", str(artifacts), *(a for e in extra for a in ("--extra-inputs", e))], cwd=tmp_path)
    (run_dir,) = [p for p in artifacts.iterdir() if p.is_dir()]   # <model>-triton-<backend>-concurrency2

    # perf_analyzer's raw export, as genai-perf wrote it: every request, what it sent and each streamed response.
    raw = json.loads((run_dir / "profile_export.json").read_text())
    assert raw["service_kind"] == "triton"
    (experiment,) = raw["experiments"]
    assert experiment["experiment"] == {"mode": "concurrency", "value": CONCURRENCY}
    requests = experiment["requests"]
    assert len(requests) == REQUESTS
    for r in requests:
        sent = r["request_inputs"]
        assert sent["stream"] is True and sent["text_input"]
        # How genai-perf asks for a fixed output length: min_length = max_tokens on the TRT-LLM-shaped ensemble,
        # min_tokens = max_tokens (as strings) in vllm_model's sampling_parameters.
        if backend == "tensorrtllm":
            assert sent["max_tokens"] == sent["min_length"] == OUTPUT_TOKENS, sent
        else:
            assert json.loads(sent["sampling_parameters"]) == {"max_tokens": str(OUTPUT_TOKENS),
                                                              "min_tokens": str(OUTPUT_TOKENS)}, sent
        outs, stamps = r["response_outputs"], r["response_timestamps"]
        assert 1 < len(outs) == len(stamps) <= OUTPUT_TOKENS, r
        # No empty chunk: each carries text, or a token whose text is empty (a special token such as <unk>, which
        # the model may pick when a busy server's batch shifts its logits; decoded with its special tokens skipped)
        assert all(o["text_output"] or o["num_output_tokens"] > 0 for o in outs), outs
        assert stamps == sorted(stamps) and stamps[0] > r["timestamp"]
        # Only the last response carries a finish reason, and it is the length: the output ran to what was asked.
        assert [o["finish_reason"] for o in outs] == [""] * (len(outs) - 1) + ["length"], outs
        counts = [o["num_output_tokens"] for o in outs]
        if backend == "tensorrtllm":   # TRT-LLM's backend counts the tokens so far
            assert counts == sorted(counts) and counts[-1] == OUTPUT_TOKENS, counts
            logprobs = [lp for o in outs for lp in (o["output_log_probs"] if isinstance(o["output_log_probs"], list)
                                                     else [o["output_log_probs"]])]
            assert len(logprobs) == OUTPUT_TOKENS and max(logprobs) <= 0, logprobs
            assert outs[-1]["cum_log_probs"] == pytest.approx(sum(logprobs), rel=1e-4, abs=1e-4)
        else:                          # vllm_backend counts each response's new tokens, and sums logprobs so far
            assert min(counts) >= 1 and sum(counts) == OUTPUT_TOKENS, counts
            cumulative = [o["cumulative_logprob"] for o in outs]
            assert cumulative == sorted(cumulative, reverse=True) and cumulative[0] <= 0, cumulative

    # genai-perf's own export: what a user reads.
    stats = json.loads((run_dir / "profile_export_genai_perf.json").read_text())
    assert stats["request_count"]["avg"] == REQUESTS
    assert stats["input_config"]["endpoint"]["backend"] == backend
    ttfts = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in requests]
    ttft, itl, latency = stats["time_to_first_token"], stats["inter_token_latency"], stats["request_latency"]
    assert ttft["unit"] == itl["unit"] == latency["unit"] == "ms"
    assert ttft["min"] > 0 and ttft["avg"] == pytest.approx(sum(ttfts) / len(ttfts), rel=1e-6)
    assert 0 < itl["min"] <= itl["avg"] <= itl["max"] < latency["max"]
    assert ttft["max"] < latency["max"]
    # genai-perf's sequence lengths are its tokenizer's count of the prompt and of the streamed text joined up,
    # not the server's: byte-level BPE can merge across the streamed tokens' boundaries ("\n" x 7 -> fewer tokens),
    # so they are compared with that count here, and the exact length was checked above on the server's count.
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path)
    n_out = [len(tok.encode("".join(o["text_output"] for o in r["response_outputs"]), add_special_tokens=False))
             for r in requests]
    n_in = [len(tok.encode(r["request_inputs"]["text_input"], add_special_tokens=False)) for r in requests]
    osl, isl = stats["output_sequence_length"], stats["input_sequence_length"]
    assert (osl["min"], osl["max"]) == (min(n_out), max(n_out)) and osl["avg"] == pytest.approx(sum(n_out) / REQUESTS)
    assert (isl["min"], isl["max"]) == (min(n_in), max(n_in)) and isl["avg"] == pytest.approx(sum(n_in) / REQUESTS)
    assert osl["min"] >= 1 and isl["min"] >= 1

    # ... and the CSV beside it says the same.
    table = _csv_metrics(run_dir / "profile_export_genai_perf.csv")
    assert table["Request Count (count)"]["Value"] == REQUESTS
    assert table["Time To First Token (ms)"]["avg"] == pytest.approx(ttft["avg"], abs=0.01)
    assert table["Inter Token Latency (ms)"]["avg"] == pytest.approx(itl["avg"], abs=0.01) and itl["avg"] > 0
    assert table["Output Sequence Length (tokens)"]["avg"] == pytest.approx(osl["avg"], abs=0.01)


@pytest.mark.parametrize("endpoint_type", ["chat", "completions"])
def test_genai_perf_profiles_the_openai_front_door(triton_server, default_model_path, tmp_path, endpoint_type):
    """genai-perf's OpenAI mode (`--endpoint-type chat` / `completions`) against the front door, unchanged: every
    request streamed to the end in OpenAI's chunks, and its figures computed from them."""
    from test_openai_api import start_front_door
    from trellm_backend.tools.launch import stop_front_door
    if not os.path.exists(GENAI_PERF):
        pytest.fail(f"genai-perf is not installed ({GENAI_PERF} is missing): run `make setup`")
    door, url = start_front_door(triton_server)
    try:
        artifacts = tmp_path / "artifacts"
        _run([GENAI_PERF, "profile", "-m", "ensemble", "--endpoint-type", endpoint_type, "--streaming",
              "-u", url.removeprefix("http://"), "--tokenizer", default_model_path,
              "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
              "--output-tokens-mean", str(OUTPUT_TOKENS), "--random-seed", "0",
              "--num-dataset-entries", str(REQUESTS), "--concurrency", str(CONCURRENCY),
              "--request-count", str(REQUESTS), "--warmup-request-count", "0", "--artifact-dir", str(artifacts),
              "--extra-inputs", "ignore_eos:true"],    # vLLM's key, as genai-perf users send it to vLLM
             cwd=tmp_path)
    finally:
        stop_front_door(door)
    (run_dir,) = [p for p in artifacts.iterdir() if p.is_dir()]   # ensemble-openai-<type>-concurrency2
    raw = json.loads((run_dir / "profile_export.json").read_text())
    assert raw["service_kind"] == "openai"
    requests = raw["experiments"][0]["requests"]
    assert len(requests) == REQUESTS
    key = "delta" if endpoint_type == "chat" else "text"
    for r in requests:
        sent = json.loads(r["request_inputs"]["payload"])
        assert sent["model"] == "ensemble" and sent["stream"] is True and sent["ignore_eos"] is True
        events = [e["response"] for e in r["response_outputs"]]
        assert events[-1].strip() == "data: [DONE]"
        chunks = [json.loads(e.strip()[len("data: "):]) for e in events[:-1]]
        assert all(c["choices"][0][key] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    stats = json.loads((run_dir / "profile_export_genai_perf.json").read_text())
    assert stats["request_count"]["avg"] == REQUESTS
    assert 0 < stats["time_to_first_token"]["avg"] < stats["request_latency"]["max"]
    assert stats["output_sequence_length"]["min"] >= 1 and stats["output_token_throughput"]["avg"] > 0
