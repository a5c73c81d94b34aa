"""Failures of a run that are not bugs in it: a part outside this process went away (every rollout
server down, the trainer ranks exited or stopped answering). Commands print them in one line (exit 1;
``CASCADE_DEBUG=1`` shows the traceback); the run directory keeps its last complete checkpoint."""
from __future__ import annotations


class RunFailure(RuntimeError):
    pass
