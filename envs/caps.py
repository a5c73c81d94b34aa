"""Time bounds on generation: recorded difficulty caps, and a bounded ``generate``.

Some generators slow down without end as the difficulty grows (e.g. reasoning-gym's ``jugs``
searches for puzzles with a minimum number of moves and may not return). Two safeguards:

* **Caps found by the self-check.** ``cascade envs check`` runs every ``generate`` under a time
  bound (:data:`GENERATE_TIME_LIMIT` seconds, or the environment's ``generate_time_limit``); an
  environment whose generator exceeds it at difficulty ``d`` is capped at ``d - 1`` and the cap is
  recorded in ``envs/difficulty_caps.json`` (``{id: {"max_difficulty", "reason"}}``, the reason naming the limit).
  :func:`envs.base.get_env` reads the file and lowers the environment's ``max_difficulty`` to the
  cap, so curricula never schedule a capped level.
* **A bound at run time.** Environments that set ``generate_time_limit`` (the third-party
  adapters ``rg/``, ``rlve/``, ``rc/``, and ``gym/``) get a ``generate`` that runs at most that long; past it,
  the problem is generated one level lower, and the level is capped for the rest of the process;
  at difficulty 0 another seed is drawn (three times, then an error). The environment's one-time
  ``prepare()`` (importing a third-party task) runs before the clock starts. The overdue call is
  abandoned in a daemon thread (a thread cannot be killed; it may keep a core busy until it
  returns), so a run never stalls on one generator.

Both bounds count **CPU time** (the generating thread's, or the check worker's process's), not wall time: on a
busy machine a generator gets less of a core per second, and a wall-time bound then gave another problem (a
lower level, a derived seed) for the same (seed, difficulty), so the data a run drew depended on the machine's
load. A generator that is not computing (waiting on I/O, or starved of CPU) is abandoned only after
:data:`WALL_BACKSTOP` times the bound in wall time. Where a thread's CPU clock cannot be read (no
``pthread_getcpuclockid``, no ``/proc``), the bound is wall time.

``CASCADE_NO_DIFFICULTY_CAPS=1`` disables both (the self-check sets it to measure the generators
themselves); ``CASCADE_DIFFICULTY_CAPS=PATH`` reads caps from another file.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from envs.workers import proc_stat

__all__ = ["GENERATE_TIME_LIMIT", "WALL_BACKSTOP", "caps_path", "load_caps", "save_caps", "apply", "bound_generate",
           "GenerationTimeout"]

GENERATE_TIME_LIMIT = 10.0  # CPU seconds one generate may take (RLVE's own generator default)
WALL_BACKSTOP = 10.0  # a generate is abandoned after this many times its bound in wall time, computing or not
_DEFAULT_PATH = Path(__file__).with_name("difficulty_caps.json")
_CACHE: dict[str, tuple[float, dict]] = {}


class GenerationTimeout(TimeoutError):
    pass


def disabled() -> bool:
    return os.environ.get("CASCADE_NO_DIFFICULTY_CAPS", "") not in ("", "0")


def caps_path() -> Path:
    return Path(os.environ.get("CASCADE_DIFFICULTY_CAPS") or _DEFAULT_PATH)


def load_caps(path: str | Path | None = None) -> dict[str, dict]:
    """``{env_id: {"max_difficulty", "reason"}}`` from the caps file ({} if none)."""
    p = Path(path) if path is not None else caps_path()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return {}
    hit = _CACHE.get(str(p))
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        data = {}
    data = {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("max_difficulty"), int)}
    _CACHE[str(p)] = (mtime, data)
    return data


def save_caps(caps: dict[str, dict], path: str | Path | None = None) -> Path:
    p = Path(path) if path is not None else caps_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(sorted(caps.items())), indent=1) + "\n")
    os.replace(tmp, p)
    _CACHE.pop(str(p), None)
    return p


def _lower_cap(env, level: int) -> None:
    cur = getattr(env, "max_difficulty", None)
    try:
        env.max_difficulty = level if cur is None else min(int(cur), level)
    except AttributeError:  # a read-only max_difficulty
        pass


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads, and the children it has waited for: a generator that runs programs)
    process ``pid`` has run, from ``/proc``; None where unreadable."""
    fields = proc_stat(pid)
    # utime, stime, cutime, cstime (fields 14-17 of proc(5))
    return None if fields is None else sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def overdue(cpu_used: float | None, wall_used: float, limit: float) -> bool:
    """Whether a generate that has run ``cpu_used`` CPU seconds (None: unknown) in ``wall_used`` seconds is past
    ``limit``: its CPU time over the bound, or its wall time over :data:`WALL_BACKSTOP` times the bound (over the
    bound where CPU time is unknown)."""
    if cpu_used is None:
        return wall_used > limit
    return cpu_used > limit or wall_used > limit * WALL_BACKSTOP


def _thread_cpu_start(box: dict) -> None:
    """Record, from inside the generating thread, its CPU clock and the clock's reading now (``clock`` None: no
    per-thread clock here)."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        box["cpu0"] = time.clock_gettime(clock)
    except (AttributeError, OSError):
        clock = None
    box["clock"] = clock


def _thread_cpu_used(box: dict) -> float | None:
    if "clock" not in box:
        return 0.0  # not started running yet: nothing computed
    if box["clock"] is None:
        return None
    try:
        return time.clock_gettime(box["clock"]) - box["cpu0"]
    except OSError:  # the thread has just ended (its clock went with it)
        return 0.0


def _run_bounded(target, limit: float, name: str):
    """Run ``target()`` in a daemon thread; ``(True, result_box)`` once it returns or raises, ``(False, {})`` when it
    is :func:`overdue` (the thread is left to finish on its own)."""
    box: dict = {}

    def run():
        _thread_cpu_start(box)
        try:
            box["p"] = target()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e

    t = threading.Thread(target=run, daemon=True, name=name)
    t0 = time.monotonic()
    t.start()
    while True:
        cpu, wall = _thread_cpu_used(box), time.monotonic() - t0
        if overdue(cpu, wall, limit):
            alive = t.is_alive()
            return not alive, ({} if alive else box)
        # the CPU time cannot grow faster than the wall clock: no need to look before `limit - cpu` seconds
        left = (limit - cpu) if cpu is not None else (limit - wall)
        t.join(max(0.005, min(left, limit * WALL_BACKSTOP - wall)))
        if not t.is_alive():
            return True, box


def bound_generate(env, limit: float) -> None:
    """Give ``env`` (an instance) a ``generate`` that never runs more than ``limit`` CPU seconds (or
    :data:`WALL_BACKSTOP` times that in wall time)."""
    inner = env.generate

    def generate(seed: int, difficulty: int):
        env.prepare()  # one-time loading is not generation: before the clock starts
        seed0, tries = seed, 0
        d = int(difficulty)
        cap = getattr(env, "max_difficulty", None)
        if cap is not None:
            d = min(d, int(cap))
        while True:
            done, box = _run_bounded(lambda s=seed, d=d: inner(s, d), limit,
                                     f"generate {getattr(env, 'id', '')} d={d}")
            if done:
                if "e" in box:
                    raise box["e"]
                return box["p"]
            if d <= 0:
                # the easiest level is slow for this seed: draw another problem, as RLVE's trainer
                # does when its generator fails (the Problem carries the seed it was made from)
                tries += 1
                if tries > 3:
                    raise GenerationTimeout(f"{getattr(env, 'id', env)}: generate took over {limit:g}s "
                                            f"at difficulty 0 for seed {seed0} and 3 derived seeds")
                seed = (int(seed0) * 1_000_003 + 7919 * tries) % (2 ** 62)
                continue
            _lower_cap(env, d - 1)  # this level is too slow here: do not schedule it again
            d -= 1

    generate.__wrapped__ = inner
    env.generate = generate


def apply(env_id: str, env) -> None:
    """Apply the recorded cap of ``env_id`` and the run-time bound to a freshly built ``env``."""
    if disabled():
        return
    cap = load_caps().get(env_id)
    if cap is not None:
        _lower_cap(env, int(cap["max_difficulty"]))
    limit = getattr(env, "generate_time_limit", None)
    if limit:
        bound_generate(env, float(limit))
