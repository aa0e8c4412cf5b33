"""Every thread's Python stack in the server log, where a stub cannot say what it is doing: on a crash in native
code, and on SIGUSR1 (`kill -USR1 <stub pid>`), for a stub that stopped answering. The stubs' stderr is
tritonserver's, so the stacks land in its log; perf/soak.py sends the signal when a request hangs."""
from __future__ import annotations

import faulthandler
import signal

STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)


def enable_stack_dumps() -> None:
    """Call once in a model's initialize."""
    faulthandler.enable()
    if STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
