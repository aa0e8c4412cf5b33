"""backend/triton/shutdown.py's watch of the server's stop, with a fake pb_utils: no IPC to the server before the
model's first request (asked while other models loaded, is_model_ready crashed the stub), and a stop noticed by
polling after it."""
import threading
import time

import pytest

from trellm_backend.triton.shutdown import watch_server_shutdown

pytestmark = pytest.mark.unit


class FakeServer:
    """pb_utils' is_model_ready: records each call; raises once `stopping` is set, as 2.51 does while exiting."""

    def __init__(self):
        self.calls = 0
        self.stopping = False

    def is_model_ready(self, name):
        self.calls += 1
        if self.stopping:
            raise RuntimeError("Server not ready")
        return True


def watch(server, serving, fired):
    """The watch started off the main thread (as a test must: the main thread's SIGTERM handler stays pytest's),
    so only its polling runs."""
    ends = []
    t = threading.Thread(target=lambda: ends.append(watch_server_shutdown(server, "llm", fired.append, serving,
                                                                          poll_s=0.01)))
    t.start()
    t.join()
    return ends[0]


def test_no_call_reaches_the_server_before_the_first_request_and_a_stop_is_noticed_after_it():
    server, serving, fired = FakeServer(), threading.Event(), []
    end = watch(server, serving, fired)
    try:
        server.stopping = True            # also the answer while other models load: it must not be asked
        time.sleep(0.2)
        assert server.calls == 0 and fired == []
        server.stopping = False
        serving.set()                     # a request reached the model
        deadline = time.monotonic() + 5
        while server.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.calls >= 3 and fired == []
        server.stopping = True
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fired) == 1 and "Server not ready" in fired[0]
        calls = server.calls
        time.sleep(0.1)
        assert server.calls == calls, "polling ends once the stop is noticed"
    finally:
        end()


def test_an_ended_watch_never_asks():
    server, serving, fired = FakeServer(), threading.Event(), []
    end = watch(server, serving, fired)
    end()
    serving.set()
    time.sleep(0.1)
    assert server.calls == 0 and fired == []
