"""The client package against a running server: the CLI as a user runs it (a subprocess), and the asyncio client."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest

from conftest import free_ports
from trellm_client.client import AsyncLLMClient, LLMClient

pytestmark = pytest.mark.server

PROMPT = "Lists"


def cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trellm_client", *args], input=stdin, capture_output=True,
                          text=True, timeout=180)


def test_cli_generate_streams_the_answer(triton_server):
    with LLMClient(triton_server.grpc_url) as c:
        expected = "".join(c.stream(PROMPT, max_tokens=12, repetition_penalty=1.5))
    run = cli("--url", triton_server.grpc_url, "generate", PROMPT, "--max-tokens", "12",
              "-p", "repetition_penalty=1.5")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"


def test_cli_reports_a_bad_field_without_a_traceback(triton_server):
    run = cli("--url", triton_server.grpc_url, "generate", PROMPT, "--top-p", "3")
    assert run.returncode == 1 and "top_p must be in (0, 1]" in run.stderr and "Traceback" not in run.stderr


def test_cli_chat_keeps_the_history(triton_server):
    first, second = "What is a list?", "And a tuple?"
    with LLMClient(triton_server.grpc_url) as c:
        answer1 = "".join(c.chat([{"role": "user", "content": first}], max_tokens=8))
        history = [{"role": "user", "content": first}, {"role": "assistant", "content": answer1},
                   {"role": "user", "content": second}]
        answer2 = "".join(c.chat(history, max_tokens=8))
    run = cli("--url", triton_server.grpc_url, "chat", "--max-tokens", "8", stdin=f"{first}\n{second}\n")
    assert run.returncode == 0, run.stderr
    # Each turn prints the prompt marker, then the streamed answer and a newline.
    assert run.stdout == f"> {answer1}\n> {answer2}\n> "


def test_cli_models_lists_both_entry_points(triton_server):
    run = cli("--url", triton_server.grpc_url, "models")
    assert run.returncode == 0, run.stderr
    ready = {line.split("\t")[0] for line in run.stdout.splitlines() if "\tREADY" in line}
    assert {"ensemble", "vllm_model", "llm", "preprocess"} <= ready


def test_cli_says_when_the_server_is_down():
    url = f"localhost:{free_ports(1)[0]}"
    for args in (("generate", "hi"), ("models",)):
        run = cli("--url", url, *args)
        assert run.returncode == 2 and "Is the server running?" in run.stderr and "Traceback" not in run.stderr


def test_async_client_matches_the_sync_client(triton_server):
    with LLMClient(triton_server.grpc_url) as c:
        expected = "".join(c.stream(PROMPT, max_tokens=10, temperature=0.8, seed=3))

    async def main():
        async with AsyncLLMClient(triton_server.grpc_url) as c:
            streams = await asyncio.gather(*(
                _collect(c.stream(PROMPT, max_tokens=10, temperature=0.8, seed=3)) for _ in range(3)))
            whole = await c.generate(PROMPT, max_tokens=10, temperature=0.8, seed=3, exclude_input_in_output=True)
        return streams, whole

    streams, whole = asyncio.run(main())
    assert all("".join(s) == expected for s in streams) and whole == expected
    assert all(len(s) > 1 for s in streams)


async def _collect(aiter):
    return [x async for x in aiter]


def test_cli_goes_through_the_openai_front_door(triton_server):
    """--openai URL: the same greedy answer and chat as over gRPC, the front door's errors said plainly."""
    from test_openai_api import start_front_door
    from trellm_backend.tools.launch import stop_front_door
    door, url = start_front_door(triton_server)
    try:
        with LLMClient(triton_server.grpc_url) as c:
            expected = "".join(c.stream(PROMPT, max_tokens=12, repetition_penalty=1.5))
            answer = "".join(c.chat([{"role": "user", "content": "What is a list?"}], max_tokens=8))
        run = cli("--openai", url, "generate", PROMPT, "--max-tokens", "12", "-p", "repetition_penalty=1.5")
        assert run.returncode == 0 and run.stdout == expected + "\n", run.stderr
        run = cli("--openai", url + "/v1", "chat", "--max-tokens", "8", stdin="What is a list?\n")
        assert run.returncode == 0 and run.stdout == f"> {answer}\n> ", run.stderr
        run = cli("--openai", url, "generate", PROMPT, "--top-p", "3")
        assert run.returncode == 1 and "top_p must be in (0, 1]" in run.stderr and "Traceback" not in run.stderr
        assert cli("--openai", url, "models").stdout.split() == ["ensemble", "READY"]
    finally:
        stop_front_door(door)
    run = cli("--openai", url, "generate", PROMPT)
    assert run.returncode == 2 and "no OpenAI front door" in run.stderr


def test_clients_reach_a_restarted_server_as_soon_as_it_serves(tmp_path):
    """A server restarted (by the supervisor, say) while other channels of the process keep asking it, as the OpenAI
    front door's do under traffic: once it serves again, a new client and the door answer within a second or so.
    gRPC's reconnect backoff grows to minutes and is shared by every channel of a process to the same address, so
    new clients failed with "failed to connect to all addresses" for seconds while the server was up."""
    import json
    import os
    import time
    import urllib.request
    import tritonclient.grpc.aio as aio
    from conftest import REPO
    from trellm_backend.tools.launch import TritonServer, start_front_door, stop_front_door
    server = TritonServer(os.path.join(REPO, "model_repository"), *free_ports(3),
                          log_path=str(tmp_path / "server.log")).start()
    [door_port] = free_ports(1)
    door = start_front_door(server, door_port, None)

    def door_answers() -> bool:
        body = json.dumps({"model": "ensemble", "prompt": "Hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://localhost:{door_port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    async def new_client_answers() -> bool:
        async with AsyncLLMClient(server.grpc_url) as client:
            try:
                return len([t async for t in client.stream("Hello", max_tokens=2)]) > 0
            except ConnectionError:
                return False

    async def seconds_until(ask, limit: float = 15.0) -> float:
        start = time.monotonic()
        while not await ask():
            assert time.monotonic() - start < limit, f"no answer {limit} s after the server was back"
            await asyncio.sleep(0.1)
        return time.monotonic() - start

    async def scenario():
        loop = asyncio.get_running_loop()
        other = aio.InferenceServerClient(server.grpc_url)    # another gRPC user of the process, tritonclient's defaults
        try:
            assert await new_client_answers() and door_answers()
            server.stop(timeout=0)
            # The server away for a while and starting again, while the other channel and the door keep asking:
            # their failed connections back off, longer each time.
            away_until = time.monotonic() + 10
            start = None
            while start is None or not start.done():
                with contextlib.suppress(Exception):
                    await other.is_server_live()
                await loop.run_in_executor(None, door_answers)
                await asyncio.sleep(0.2)
                if start is None and time.monotonic() > away_until:
                    start = loop.run_in_executor(None, server.start)
            await start
            first = await new_client_answers()      # the first try, the moment the server is back
            return first, await seconds_until(lambda: loop.run_in_executor(None, door_answers))
        finally:
            await other.close()
    try:
        new_client_answered, door_wait = asyncio.run(scenario())
    finally:
        stop_front_door(door)
        server.stop()
    assert new_client_answered, "a new client failed against a server that was back (the other channel's backoff)"
    assert door_wait < 2.0, f"the front door answered {door_wait:.1f} s after the server was back"


def test_a_cancelled_stream_leaves_no_thread_behind(triton_server):
    """tritonclient's cancel of a stream whose request has ended (what the soak's grpc_cancel_after_final does) leaves
    gRPC's request thread waiting for good, one per stream, until a long-running process can start no thread (a
    30-minute soak of such cancels did); trellm_client's stop_stream ends it."""
    import queue
    import threading
    import time
    import tritonclient.grpc as grpcclient
    from trellm_client.client import build_inputs, channel_args, stop_stream
    client = grpcclient.InferenceServerClient(triton_server.grpc_url, channel_args=channel_args())
    try:
        before = threading.active_count()
        for _ in range(6):
            responses: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            client.async_stream_infer("ensemble", build_inputs(grpcclient, PROMPT, {"max_tokens": 2}),
                                      enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=60)
                assert error is None, error
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            stop_stream(client, cancel=True)
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= before, threading.enumerate()
    finally:
        client.close()
