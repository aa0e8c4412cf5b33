"""A repository of several models, as add_model builds it, starts clean in the default model-control mode with the
cores kept busy: no stub dies while the others load (perf/many_models_start.py; its ten-start figure is in
perf/RESULTS.md), and the first model answers streams meanwhile."""
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.server


def test_three_models_with_adapters_start_twice_under_load_without_a_stub_death(default_model_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "perf", "many_models_start.py"), "--starts", "2",
                        "--busy", "2", "--streams", "8", "--hold-s", "8", "--model", default_model_path],
                       capture_output=True, text=True, timeout=900)
    lines = [line for line in r.stdout.splitlines() if line.startswith(("start", "2 starts", "    "))]
    assert r.returncode == 0 and len(lines) >= 3, r.stdout[-3000:] + r.stderr[-3000:]
    for line in lines[:2]:
        assert ", 0 stub deaths, streams " in line and " 0 failed" in line and "streams 0 ok" not in line, line
