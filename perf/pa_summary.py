"""TTFT, inter-token latency and end-to-end latency per concurrency level from a perf_analyzer
--profile-export-file (streaming: one response timestamp per streamed response).

    python perf/pa_summary.py perf/out/perf_analyzer/ensemble/profile_export.json
"""
import json
import sys

import numpy as np


def main(path: str) -> None:
    with open(path) as f:
        doc = json.load(f)
    print(f"{'concurrency':>11}  {'requests':>8}  {'TTFT ms p50/p95/p99':>21}  {'ITL ms p50/p95/p99':>20}  "
          f"{'E2E ms p50/p95/p99':>20}")
    for exp in doc["experiments"]:
        ttft, itl, e2e = [], [], []
        for req in exp["requests"]:
            times = req["response_timestamps"]
            if not times:
                continue
            ttft.append((times[0] - req["timestamp"]) / 1e6)
            e2e.append((times[-1] - req["timestamp"]) / 1e6)
            if len(times) > 1:
                itl.append((times[-1] - times[0]) / (len(times) - 1) / 1e6)

        def pct(v):
            return "/".join(f"{np.percentile(v, p):.1f}" for p in (50, 95, 99)) if v else "n/a"
        print(f"{exp['experiment']['value']:>11}  {len(ttft):>8}  {pct(ttft):>21}  {pct(itl):>20}  {pct(e2e):>20}")


if __name__ == "__main__":
    main(sys.argv[1])
