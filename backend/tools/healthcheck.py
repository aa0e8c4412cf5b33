"""Is this server able to generate? One one-token generate, for a container health check and the supervisor.

    python -m trellm_backend.tools.healthcheck [--url localhost:8000] [--model ensemble] [--timeout 30]

exits 0 when the model answers with text and 1 (printing what went wrong) otherwise. `/v2/health/ready` is not
enough: on tritonserver 2.51 it stays 200 after the llm stub has died and every generate fails.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.request


def generate_probe(http_url: str, model: str = "ensemble", timeout: float = 30.0) -> str | None:
    """One one-token generate through `model`: None when it answers with text, else what went wrong."""
    body = json.dumps({"text_input": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if "error" in answer or "text_output" not in answer:
        return f"no text_output in {str(answer)[:300]}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Exit 0 when a one-token generate through the model answers.")
    ap.add_argument("--url", default="localhost:8000", help="the server's HTTP address")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer")
    args = ap.parse_args(argv)
    problem = generate_probe(args.url, args.model, args.timeout)
    if problem:
        print(f"unhealthy: {args.model} at {args.url}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
