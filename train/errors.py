"""Failures of a run that are not bugs in it: a part outside this process went away (every rollout
server down, the trainer ranks exited or stopped answering). Commands print them in one line (exit 1;
``CASCADE_DEBUG=1`` shows the traceback); the run directory keeps its last complete checkpoint."""
from __future__ import annotations

import contextlib
import signal
import threading


class RunFailure(RuntimeError):
    pass


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption or time limit, ``kill``): stopped as Ctrl-C stops it."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


@contextlib.contextmanager
def sigterm_interrupts(on: bool = True):
    """Inside, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread, so that a
    command unwinds as it does on Ctrl-C instead of ending at once; the previous handler comes back after.
    Off (or outside the main thread, where Python cannot set handlers) it changes nothing."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
