"""Command line over the ensemble:

    python -m trellm_client generate "prompt" [--max-tokens N --temperature T ... -p field=value]
    python -m trellm_client chat [--system "..."]      # interactive; the history is sent each turn
    python -m trellm_client models
    python -m trellm_client --openai http://localhost:9000 generate "prompt"   # through the OpenAI front door
"""
import argparse
import sys

import numpy as np

from trellm_client.client import INPUT_TYPES, LIST_INPUTS, LLMClient, OpenAIError, OpenAIHTTPClient, ServerUnavailable

DOWN_HINT = "Is the server running? Start it with `make serve` (or pass --url host:grpc_port)."


def field_value(text: str):
    """`name=value` -> (name, value converted by the field's type)."""
    name, sep, raw = text.partition("=")
    if not sep or name not in INPUT_TYPES:
        raise argparse.ArgumentTypeError(f"expected field=value with a field of: {', '.join(sorted(INPUT_TYPES))}")
    dtype = INPUT_TYPES[name]
    if name in LIST_INPUTS:
        return name, raw.split(",")
    if dtype is np.bool_:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise argparse.ArgumentTypeError(f"{name} takes true or false, got {raw!r}")
        return name, raw.lower() in ("true", "1")
    try:
        return name, (float if dtype is np.float32 else int)(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} takes a number, got {raw!r}") from None


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("-p", "--param", action="append", type=field_value, default=[], metavar="FIELD=VALUE",
                   help="any other ensemble input, e.g. -p repetition_penalty=1.2 -p bad_words=foo,bar")


def params_of(args) -> dict:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "seed": args.seed, "stop_words": args.stop, **dict(args.param)}
    return {k: v for k, v in params.items() if v is not None}


def chat_loop(client, params: dict, system: str | None, read=input) -> None:
    """Read a line, stream the answer, keep both in the history; ends at EOF or an empty line."""
    history = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = read("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        answer = []
        for delta in client.chat(history, **params):
            answer.append(delta)
            print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(answer)})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trellm_client")
    ap.add_argument("--url", default="localhost:8001", help="gRPC address of tritonserver")
    ap.add_argument("--model", default="ensemble", help="the TRT-LLM-shaped entry point to call")
    ap.add_argument("--openai", metavar="URL", help="go through the OpenAI front door at URL instead of gRPC")
    ap.add_argument("--api-key", default=None, help="with --openai: the API key, when the front door wants one")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream an answer to the terminal")
    g.add_argument("prompt")
    sampling_args(g)
    c = sub.add_parser("chat", help="interactive chat; the history goes with each turn (empty line ends)")
    c.add_argument("--system", help="a system message to start the chat with")
    sampling_args(c)
    sub.add_parser("models", help="list the repository's models and their state")
    args = ap.parse_args(argv)
    try:
        client = (OpenAIHTTPClient(args.openai, args.model, args.api_key) if args.openai
                  else LLMClient(args.url, args.model))
        with client:
            if args.cmd == "models":
                for m in client.models():
                    print(f"{m.get('name')}\t{m.get('version', '')}\t{m.get('state', '')}\t{m.get('reason', '')}")
            elif args.cmd == "chat":
                chat_loop(client, params_of(args), args.system)
            else:
                for delta in client.stream(args.prompt, **params_of(args)):
                    print(delta, end="", flush=True)
                print()
            return 0
    except ServerUnavailable as e:
        print(f"error: {e}\n{DOWN_HINT}", file=sys.stderr)
        return 2
    except Exception as e:   # an error the server sent (e.g. INVALID_ARG naming a field): say it, no traceback
        if type(e).__name__ != "InferenceServerException" and not isinstance(e, OpenAIError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
