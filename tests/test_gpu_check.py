"""perf/gpu_check.sh's dry run: the GPU check's steps on a CPU (kernels interpreted, tiny shapes), so the script a
session runs on the rare GPU it is lent works on the day, with nothing to write then."""
import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.kernels
def test_gpu_check_dry_run_passes_every_step_and_writes_its_figures(tmp_path, default_model_path):
    out = tmp_path / "check"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the script sets its own
    env["TRELLM_GPU_CHECK_MODELS"] = str(tmp_path / "models")
    run = subprocess.run(["bash", os.path.join(REPO, "perf", "gpu_check.sh"), "--dry-run", str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    status = {line.split()[0]: line.split()[1] for line in (out / "status.txt").read_text().splitlines()}
    assert status == {"kernels": "0", "parity": "0", "bench": "0", "served": "0"}
    for step in ("kernels", "parity"):
        last = (out / f"{step}.log").read_text().strip().splitlines()[-1]
        assert " passed" in last and "failed" not in last and "skipped" not in last, (step, last)
    figures = json.loads((out / "figures.json").read_text())
    assert figures["errors"] == {}
    assert figures["copy"]["copy_GBps"] > 0
    assert {"1", "2", "4"} == set(figures["decode"]["batches"])
    for b in figures["decode"]["batches"].values():
        assert b["step_ms"] > 0 and b["floor_ms"] > 0
    assert figures["attention"]["triton_GBps"] > 0 and figures["attention"]["sdpa_GBps"] > 0
    assert figures["prefill"]["prompt_tok_per_s"] > 0
    assert figures["anchor"]["output_tokens"] > 0
    # tritonserver from the packed archive (what a GPU image without the wheel runs), not the wheel's own
    served = json.loads((out / "served" / "benchmark.json").read_text())
    assert [lv["errors"] for lv in served["levels"]] == [0] and served["levels"][0]["output_tokens"] > 0
    assert "/tritonserver/backends/python/libtriton_python.so" in (out / "served" / "server.log").read_text()
    summary = (out / "summary.md").read_text()
    assert "served by tritonserver, the anchor profile" in summary and "ensemble / engine alone" in summary
    assert "| kernels | 0 |" in summary and "decode attention" in summary and "FAILED" not in summary
    assert set(figures["decode"]["padded"]["batches"]) == {"1", "2", "4"}
    assert figures["decode"]["padded"]["graphs"] is False, "a CPU runs the padded steps eagerly"
    assert "decode step padded to its bucket (run eagerly" in summary
    for mode in ("batches", "padded"):
        assert (out / f"profile_decode_{mode}.txt").read_text().strip()
