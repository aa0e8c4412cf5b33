"""Command line: python -m trellm_client generate "prompt" | models"""
import argparse
import sys

from trellm_client.client import LLMClient, ServerUnavailable


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trellm_client")
    ap.add_argument("--url", default="localhost:8001", help="gRPC address of tritonserver")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream an answer to the terminal")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    sub.add_parser("models", help="list the repository's models and their state")
    args = ap.parse_args(argv)
    try:
        with LLMClient(args.url) as client:
            if args.cmd == "models":
                for m in client.models():
                    print(f"{m.get('name')}\t{m.get('version', '')}\t{m.get('state', '')}")
                return 0
            params = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                        ("top_k", args.top_k), ("top_p", args.top_p), ("seed", args.seed))
                      if v is not None}
            for delta in client.stream(args.prompt, **params):
                print(delta, end="", flush=True)
            print()
            return 0
    except ServerUnavailable as e:
        print(f"error: {e}\nIs the server running? Start it with `make serve`.", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
