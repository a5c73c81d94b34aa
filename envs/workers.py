"""Persistent worker processes that compute on model output under a deadline.

A computation on a model's answer can run for ever (sympy on ``10**10**10``, a third-party scorer's
``eval``); a thread cannot be stopped, and ``signal.alarm`` works only in the main thread. So such work
runs in worker processes (``python -c "from MODULE import worker_main; worker_main()"``), one per
concurrent caller: a request is one JSON line on the worker's stdin, and the worker answers with one
JSON line per stage of the work (:func:`serve`). The caller gives each line its own deadline
(:meth:`Pool.call`); a worker that misses one is killed and the call answers None. Used by
:mod:`envs.math` (math-verify comparisons) and :mod:`envs.isolated` (the adapters' third-party
verifiers)."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (the state first), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, found through /proc (torchrun starts each rank in a
    session of its own, out of the agent's process group, so ``killpg`` does not reach them)."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if (fields := proc_stat(d)) is not None:
            children.setdefault(int(fields[1]), []).append(int(d))  # field 4: the parent's pid
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


_spawner: ThreadPoolExecutor | None = None  # its one thread
_spawner_lock = threading.Lock()


def _forked() -> None:  # (a forked child has neither the parent's thread nor, if another thread held it, the lock)
    global _spawner, _spawner_lock
    _spawner, _spawner_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(*args, **kwargs)`` run on one thread that lives as long as this process. A child's
    parent-death signal (bwrap's ``--die-with-parent``, ``PR_SET_PDEATHSIG``) fires when the *thread* that forked
    it exits, not the process: a worker started from a short-lived thread (one of :func:`envs.base.verify_all`'s)
    was SIGKILLed as soon as that thread ended, and every RL step started its verifier workers again (2 s each for
    RLVE-Gym's, which import torch)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="cascade-spawner")
        ex = _spawner
    return ex.submit(subprocess.Popen, *args, **kwargs).result()


class WorkerStartError(RuntimeError):
    pass


class Worker:
    """One worker process running ``module.worker_main``, which says ``ready`` once it has imported what it
    needs (within ``startup_timeout`` seconds); ``wrap``: a command that runs it (a sandbox's, ending in
    ``--``)."""

    def __init__(self, module: str, startup_timeout: float, wrap: Sequence[str] = ()) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env.setdefault("PYTHONHASHSEED", "0")  # (as the cascade and ttc commands run: envs.base.fixed_hash_seed)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = spawn(
            [*wrap, sys.executable, "-c", f"from {module} import worker_main; worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        self._buf = b""  # what was read of the worker's stdout past the last line returned
        self._ended = False  # its output ended (it died), as opposed to a deadline passed
        self.failure: str | None = None  # why the last ask answered None: "timeout" or "died"
        try:
            ready = self._readline(startup_timeout)
        except BaseException:
            self.kill()  # (not left running)
            raise
        if ready != '"ready"':
            self.kill()
            raise WorkerStartError(f"a worker process of {module} did not start within {startup_timeout:g} s")

    def _readline(self, timeout: float) -> str | None:
        """The next line, or None at the deadline or the end of the output. Reads the descriptor itself: a
        buffered reader could hold the next line already, where ``poll`` no longer sees it. (``poll``, not
        ``select``: a process holding over 1,023 descriptors gets one that ``select`` refuses, and every verify
        scored zero.)"""
        deadline = time.monotonic() + max(0.0, timeout)
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b"\n" not in self._buf:
            ready = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._ended = True
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def ask(self, request: Any, timeouts: Sequence[float]) -> list | None:
        """The worker's answer lines to ``request``, one per deadline in ``timeouts`` (seconds, each from the
        line before; fewer when a line is an ``{"error": ...}``, the last), or None when one is missed or the
        worker died (it is then dead)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.failure = "died"
            self.kill()
            return None
        out = []
        for t in timeouts:
            line = self._readline(t)
            try:
                out.append(json.loads(line) if line else None)
            except ValueError:
                line = None
            if not line:
                self.failure = "died" if self._ended or self.proc.poll() is not None else "timeout"
                self.kill()
                return None
            if isinstance(out[-1], dict) and "error" in out[-1]:
                break
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker and whatever it started (a scorer's subprocess would outlive it unconfined)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Pool:
    """Idle workers of one module; a caller takes one (starting a new one if none is idle) and gives it
    back after an answer. Safe from any thread, and after a fork (the child starts its own). ``wrap``: a
    callable giving the command that runs each worker (see :class:`Worker`), or ``()`` for none; when a
    worker does not start that way, the pool warns once and starts them without it (``wrapped`` says which)."""

    def __init__(self, module: str, startup_timeout: float, wrap: Callable[[], Sequence[str]] | None = None) -> None:
        self.module, self.startup_timeout = module, startup_timeout
        self._wrap, self.wrapped = wrap, None
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._local = threading.local()  # why this thread's last call answered None

    def call(self, request: Any, timeouts: Sequence[float]) -> list | None:
        """:meth:`Worker.ask` on an idle (or new) worker. Raises :class:`WorkerStartError` when a new one
        does not start."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's workers are not ours
                self._idle, self._pid = [], os.getpid()
            w = self._idle.pop() if self._idle else None
        if w is None or not w.alive():
            w = self._start()
        try:
            result = w.ask(request, timeouts)
        except BaseException:
            w.kill()  # (a worker in an unknown state is not given back, nor left running)
            raise
        self._local.failure = w.failure if result is None else None
        if result is not None and w.alive():
            with self._lock:
                self._idle.append(w)
        return result

    def failure(self) -> str | None:
        """Why this thread's last :meth:`call` answered None: ``"timeout"`` (a deadline passed; the worker was
        stopped) or ``"died"`` (its process ended: a crash, the memory limit)."""
        return getattr(self._local, "failure", None)

    def _start(self) -> Worker:
        wrap = self._wrap() if self._wrap is not None and self.wrapped is not False else ()
        if not wrap:
            return Worker(self.module, self.startup_timeout)
        try:
            w = Worker(self.module, self.startup_timeout, wrap)
            self.wrapped = True
            return w
        except (WorkerStartError, OSError) as e:
            if self.wrapped:  # confined workers started before: this one failed for another reason, not the
                raise        # sandbox (an unconfined worker then, unsaid and with wrapped still True, was not so)
            self.wrapped = False
            warnings.warn(f"{self.module}'s workers run unconfined: {wrap[0]} did not start one ({e})",
                          stacklevel=3)
            return Worker(self.module, self.startup_timeout)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


def serve(handle: Callable[[Any, Callable[[Any], None]], Any]) -> None:
    """A worker's loop: says ready, then for each request line calls ``handle(request, emit)``; ``emit(x)``
    sends an intermediate line (a stage done), the return value the last one. An exception is answered as
    ``{"error": "Type: message"}``. The answers go out on a copy of the stdout descriptor; what the work itself
    prints to stdout goes where stderr goes (it would break the protocol)."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def emit(x: Any) -> None:
        out.write(json.dumps(x, default=str) + "\n")
        out.flush()

    emit("ready")
    for line in sys.stdin:
        try:
            result = handle(json.loads(line), emit)
        except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
        emit(result)
