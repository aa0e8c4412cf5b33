"""Notice, from inside a Python-backend model, that tritonserver has begun to stop.

On SIGTERM tritonserver 2.51 waits up to its exit timeout for in-flight requests and then exits without telling
the models: `finalize()` is not called while any response sender is alive, and a stream still running at that point
is simply cut (an ensemble stream froze with no final response and no error). The model therefore watches for the
stop itself, two ways:
- SIGTERM to the server's process group (the launcher stops the server that way) reaches the stub, whose own C
  handler ignores it; a Python handler with a wakeup fd turns it into a byte on a socket that a thread waits on.
- `pb_utils.is_model_ready` raises once the server is exiting ("Server not ready"), whichever process got the
  signal; a thread asks every `poll_s` seconds (an IPC round trip each time), but only once a request has reached
  the model. Asked earlier, while the server was still loading other models, the call crashed the stub
  ("Fatal Python error: Segmentation fault" in poll_server; perf/many_models_start.py, perf/RESULTS.md), and a
  model that has had no request has no stream to end anyway.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Callable

log = logging.getLogger("trellm")


def watch_server_shutdown(pb_utils, model_name: str, on_shutdown: Callable[[str], None], serving: threading.Event,
                          poll_s: float = 0.5) -> Callable[[], None]:
    """Call `on_shutdown(how)` once, on a background thread, when the server starts stopping. `serving` is set by the
    model once a request has reached it (the server was up then); polling starts only after it. Returns a function
    that ends the watch."""
    fired = threading.Event()
    ended = threading.Event()

    def fire(how: str) -> None:
        if not fired.is_set() and not ended.is_set():
            fired.set()
            on_shutdown(how)

    reader = writer = None
    try:   # only the stub's main thread (initialize) may set signal handlers
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        # Python installs its handlers without SA_RESTART, so the signal made a blocking call of the stub's C++ IPC
        # fail with EINTR; the stub's boost semaphore wait throws on that and the stub died (1 run in 5): its
        # streams then hung until the exit timeout. The stub's own handler restarts such calls; so must ours.
        signal.siginterrupt(signal.SIGTERM, False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        log.info("not on the main thread: the server's stop is noticed by polling only")
        reader = None

    def wait_for_signal() -> None:
        try:
            if reader.recv(1):
                fire("SIGTERM")
        except OSError:
            pass

    def poll_server() -> None:
        # No IPC before the first request (see the module's docstring): the server has loaded its models then.
        # Once the stop is noticed (by the signal, usually first), polling ends: on 2.51 an is_model_ready during
        # the stop can block in the IPC with the GIL held, which froze every thread of the stub, the engine's too,
        # so the streams never got their final abort responses (1 run in 4 of the SIGTERM test).
        while not serving.wait(poll_s):
            if ended.is_set() or fired.is_set():
                return
        while not ended.wait(poll_s) and not fired.is_set():
            try:
                pb_utils.is_model_ready(model_name)
            except Exception as e:     # the server is exiting (or gone)
                fire(f"the server is stopping ({e})")
                return

    if reader is not None:
        threading.Thread(target=wait_for_signal, name="trellm-sigterm", daemon=True).start()
    threading.Thread(target=poll_server, name="trellm-shutdown-poll", daemon=True).start()

    def end() -> None:
        ended.set()
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:   # not the main thread: the fd stays set, its bytes unread, harmlessly
            pass
    end.sockets = (reader, writer)    # kept alive: a collected writer would close the wakeup fd under the handler
    return end
