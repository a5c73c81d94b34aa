"""Self-check of an environment: the contract every registered environment must keep.

For each (difficulty, seed): generation is deterministic (same problem twice, regardless of what
was generated in between) and JSON-serialisable; the reference response verifies as correct; no
corruption verifies as correct; every reward is in [-1, 1]; every verify returns within the
environment's ``verify_time_limit``. An environment with a ``no_reference_reason`` (no oracle
answer exists) is exempt from "the reference verifies" only.

:func:`check_ids` (``cascade envs check``) checks environments in worker processes, ``jobs`` at a
time, with every ``generate`` under a time bound: a generator that exceeds it at difficulty ``d``
is stopped (its worker killed), the environment is capped at ``d - 1`` and checked again below
``d``; :func:`update_caps` records the caps where :func:`envs.base.get_env` reads them
(``envs/caps.py``). Each result carries generation and verification timings.
"""
from __future__ import annotations

import fnmatch
import json
import os
import time
from dataclasses import dataclass, field
from typing import Iterable

from envs.base import Environment, Problem, Score, get_env, list_envs

__all__ = ["self_check", "check_ids", "check_one", "expand_ids", "CheckResult", "update_caps"]


def _problem_key(p: Problem) -> str:
    return json.dumps(p.to_dict(), sort_keys=True, default=repr)


def _timed_verify(env: Environment, p: Problem, response: str) -> tuple[Score, float]:
    t = time.perf_counter()
    s = env.verify(p, response)
    return s, time.perf_counter() - t


def self_check(env: Environment, difficulties: Iterable[int] = range(6), seeds: Iterable[int] = (0, 1, 2),
               time_limit: float | None = None) -> list[str]:
    """Failures of ``env`` over the grid ``difficulties x seeds`` (an empty list means it passes)."""
    name = getattr(env, "id", "") or type(env).__name__
    limit = float(time_limit if time_limit is not None else getattr(env, "verify_time_limit", 5.0))
    grid = [(int(d), int(s)) for d in difficulties for s in seeds]
    fails: list[str] = []

    def fail(d: int, s: int, what: str) -> None:
        fails.append(f"{name} d={d} seed={s}: {what}")

    first: dict[tuple[int, int], Problem] = {}
    for d, s in grid:
        try:
            p = env.generate(s, d)
        except Exception as e:  # noqa: BLE001 - report, do not stop the check
            fail(d, s, f"generate raised {type(e).__name__}: {e}")
            continue
        if not isinstance(p, Problem) or not isinstance(p.prompt, str) or not p.prompt.strip():
            fail(d, s, "generate did not return a Problem with a non-empty prompt")
            continue
        try:
            json.dumps(p.to_dict())
        except (TypeError, ValueError) as e:
            fail(d, s, f"problem is not JSON-serialisable: {e}")
        first[(d, s)] = p
    for d, s in reversed(grid):  # other order: shared random state would show here
        if (d, s) not in first:
            continue
        try:
            again = env.generate(s, d)
        except Exception as e:  # noqa: BLE001
            fail(d, s, f"second generate raised {type(e).__name__}: {e}")
            continue
        if _problem_key(again) != _problem_key(first[(d, s)]):
            fail(d, s, "generate is not deterministic in (seed, difficulty)")

    for (d, s), p in first.items():
        try:
            ref = env.reference_response(p)
            bad = list(env.corruptions(p))
        except Exception as e:  # noqa: BLE001
            fail(d, s, f"reference_response/corruptions raised {type(e).__name__}: {e}")
            continue
        cases = [("reference", ref)] + [(f"corruption {i}", c) for i, c in enumerate(bad)]
        for label, resp in cases:
            score, dt = _timed_verify(env, p, resp)
            if not isinstance(score, Score):
                fail(d, s, f"{label}: verify returned {type(score).__name__}, not Score")
                continue
            if not -1.0 <= score.reward <= 1.0:
                fail(d, s, f"{label}: reward {score.reward} outside [-1, 1]")
            if dt > limit:
                fail(d, s, f"{label}: verify took {dt:.2f}s > {limit:.2f}s")
            if label == "reference" and not score.correct and not getattr(env, "no_reference_reason", ""):
                fail(d, s, f"reference response not correct (reward {score.reward}, info {_short(score.info)})")
            if label != "reference" and score.correct:
                fail(d, s, f"{label} judged correct: {resp[:80]!r}")
    return fails


def _short(info: dict) -> str:
    return json.dumps(info, default=repr)[:300]


_SAID: set[tuple[str, str]] = set()


def is_pattern(text: str) -> bool:
    """Whether an environment id in a config is a pattern for :func:`match_pattern` (a glob or ``A|B``)."""
    return any(ch in text for ch in "*?[|")


def match_pattern(pattern: str, known: Iterable[str], say: bool = True) -> list[str]:
    """Ids in ``known`` matching ``pattern``: a ``*`` glob, or alternatives ``A|B|...`` of which the
    first that matches anything is used (``"rlve/*|gym/*"``: RLVE-Gym's environments where the
    package is installed, Cascade's own otherwise); with ``say``, prints which one was used."""
    known = list(known)
    alts = [a.strip() for a in pattern.split("|") if a.strip()]
    for alt in alts:
        hits = [i for i in known if fnmatch.fnmatchcase(i, alt)] if any(c in alt for c in "*?[") else \
            [i for i in known if i == alt]
        if hits:
            if say and len(alts) > 1 and (pattern, alt) not in _SAID:
                import sys

                _SAID.add((pattern, alt))
                skipped = alts[:alts.index(alt)]
                why = f" ({', '.join(skipped)} matched nothing: package not installed?)" if skipped else ""
                print(f"[envs] {pattern!r}: using {alt!r}, {len(hits)} environments{why}", file=sys.stderr,
                      flush=True)
            return hits
    return []


def expand_ids(patterns: Iterable[str] | None) -> list[str]:
    """Registered ids matching any of ``patterns`` (exact ids, ``*`` globs or ``pkg.mod:Class``)."""
    all_ids = list_envs()
    patterns = list(patterns or [])
    if not patterns:
        return all_ids
    out: list[str] = []
    for pat in patterns:
        if ":" in pat:
            hits = [pat]
        elif is_pattern(pat):
            hits = match_pattern(pat, all_ids)
        else:
            hits = [pat]  # get_env explains an unknown id
        if not hits:
            raise KeyError(f"no environment matches {pat!r}")
        out.extend(h for h in hits if h not in out)
    return out


def _instrument(env: Environment, stats: dict, notify=None) -> None:
    """Time ``env``'s generate and verify calls into ``stats``; ``notify`` hears each generate start/end."""
    gen, ver = env.generate, env.verify
    stats.update(gen_n=0, gen_s=0.0, gen_max_s=0.0, ver_n=0, ver_s=0.0)

    def generate(seed, difficulty):
        if notify is not None:
            # when it starts, by the clocks the parent compares with: wall, and this process's CPU time
            notify(("gen", int(difficulty), int(seed), time.perf_counter(), sum(os.times()[:4])))
        t = time.perf_counter()
        try:
            return gen(seed, difficulty)
        finally:
            dt = time.perf_counter() - t
            stats["gen_n"] += 1
            stats["gen_s"] += dt
            stats["gen_max_s"] = max(stats["gen_max_s"], dt)
            if notify is not None:
                notify(("gen_end",))

    def verify(problem, response):
        t = time.perf_counter()
        try:
            return ver(problem, response)
        finally:
            stats["ver_n"] += 1
            stats["ver_s"] += time.perf_counter() - t

    env.generate, env.verify = generate, verify


def _check_stats(env_id: str, difficulties: list[int], seeds: list[int], env_kwargs: dict | None = None,
                 notify=None) -> tuple[str, list[str], float, dict]:
    t = time.perf_counter()
    stats: dict = {}
    try:
        env = get_env(env_id, **(env_kwargs or {}))
    except Exception as e:  # noqa: BLE001
        return env_id, [f"{env_id}: cannot build: {type(e).__name__}: {e}"], time.perf_counter() - t, stats
    try:
        env.prepare()  # one-time loading, not timed as a generate
    except Exception as e:  # noqa: BLE001
        return env_id, [f"{env_id}: cannot prepare: {type(e).__name__}: {e}"], time.perf_counter() - t, stats
    _instrument(env, stats, notify)
    return env_id, self_check(env, difficulties, seeds), time.perf_counter() - t, stats


def check_one(env_id: str, difficulties: list[int], seeds: list[int], env_kwargs: dict | None = None) -> tuple[str, list[str], float]:
    """(id, failures, seconds) of one environment; an environment that fails to build is a failure."""
    return _check_stats(env_id, difficulties, seeds, env_kwargs)[:3]


# -- the supervised, parallel check ------------------------------------------------------------------
@dataclass
class CheckResult:
    env_id: str
    failures: list[str]
    seconds: float
    stats: dict = field(default_factory=dict)
    cap: int | None = None  # highest difficulty whose generation kept within the time bound, if capped
    cap_reason: str = ""


def _worker(conn, env_kwargs) -> None:  # pragma: no cover - runs in a child process
    os.environ["CASCADE_NO_DIFFICULTY_CAPS"] = "1"  # measure the generators themselves
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        env_id, diffs, seeds = msg
        try:
            res = _check_stats(env_id, diffs, seeds, env_kwargs, notify=conn.send)
        except BaseException as e:  # noqa: BLE001
            res = (env_id, [f"{env_id}: check crashed: {type(e).__name__}: {e}"], 0.0, {})
        conn.send(("result",) + tuple(res))


def _preload(ids: list[str]) -> None:
    """Import the heavy third-party packages once in the parent, so forked workers share them."""
    import importlib

    for prefix, mods in (("rlve/", ("Gym.environments", "Gym.parameter_controllers")),
                         ("rg/", ("reasoning_gym",)), ("rc/", ("reasoning_core",))):
        if any(i.startswith(prefix) for i in ids):
            for m in mods:
                try:
                    importlib.import_module(m)
                except Exception:  # noqa: BLE001 - the worker reports the failure per environment
                    pass


class _Slot:
    def __init__(self, ctx, env_kwargs):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, env_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.job = None  # (env_id, diffs, t0)
        self.gen = None  # (difficulty, seed, t0, cpu0) of the generate in progress

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5)
        except Exception:  # noqa: BLE001
            pass
        self.conn.close()


def check_ids(ids: list[str], difficulties: list[int], seeds: list[int], jobs: int = 2,
              env_kwargs: dict | None = None, gen_limit: float | None = None,
              env_limit: float = 300.0, in_process: bool = False):
    """Yield a :class:`CheckResult` per id (in completion order), checking ``jobs`` at a time.

    Each environment runs in a worker process. One ``generate`` that takes longer than
    ``gen_limit`` seconds (default: the environment's ``generate_time_limit``, else
    :data:`envs.caps.GENERATE_TIME_LIMIT`) at difficulty ``d`` stops the worker (CPU seconds of the worker, or
    :data:`envs.caps.WALL_BACKSTOP` times the limit in wall time: :func:`envs.caps.overdue`); the environment
    is then capped at ``d - 1`` (``CheckResult.cap``) and checked again on the difficulties below
    ``d`` (a bound at the lowest difficulty checked is a failure). A whole check of one environment
    longer than ``env_limit`` seconds is a failure. ``in_process=True`` checks in this process,
    without time bounds.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from envs import caps as _caps

    diffs, seeds = sorted(set(int(d) for d in difficulties)), list(seeds)
    if in_process:
        for i in ids:
            env_id, fails, dt, stats = _check_stats(i, diffs, seeds, env_kwargs)
            yield CheckResult(env_id, fails, dt, stats)
        return
    default_limit = float(gen_limit) if gen_limit else None
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    if ctx.get_start_method() == "fork":
        _preload(ids)
    pending = [(i, diffs) for i in ids]
    first_t: dict[str, float] = {}
    capped: dict[str, tuple[int, str]] = {}
    limits: dict[str, float] = {}

    def limit_of(env_id: str) -> float:
        if default_limit:
            return default_limit
        if env_id not in limits:
            lim = _caps.GENERATE_TIME_LIMIT
            if ":" not in env_id:
                try:
                    from envs.base import _FACTORIES, _REGISTRY  # noqa: PLC0415

                    obj = _REGISTRY.get(env_id) or getattr(_FACTORIES.get(env_id), "func", None)
                    lim = float(getattr(obj, "generate_time_limit", None) or lim)
                except Exception:  # noqa: BLE001
                    pass
            limits[env_id] = lim
        return limits[env_id]

    slots = [_Slot(ctx, env_kwargs) for _ in range(max(1, min(int(jobs), len(ids))))]
    try:
        while pending or any(s.job for s in slots):
            for k, s in enumerate(slots):
                if s.job is None and pending:
                    env_id, ds = pending.pop(0)
                    first_t.setdefault(env_id, time.perf_counter())
                    try:
                        s.conn.send((env_id, ds, seeds))
                    except (BrokenPipeError, OSError):
                        s.kill()
                        slots[k] = s = _Slot(ctx, env_kwargs)
                        s.conn.send((env_id, ds, seeds))
                    s.job, s.gen = (env_id, ds, time.perf_counter()), None
            busy = [s for s in slots if s.job]
            ready = wait([s.conn for s in busy], timeout=0.2)
            now = time.perf_counter()
            for k, s in enumerate(slots):
                if s.job is None:
                    continue
                env_id, ds, t0 = s.job
                done = None
                if s.conn in ready:
                    try:
                        while s.conn.poll():
                            msg = s.conn.recv()
                            if msg[0] == "gen":
                                s.gen = msg[1:5]
                            elif msg[0] == "gen_end":
                                s.gen = None
                            elif msg[0] == "result":
                                done = msg
                                break
                    except (EOFError, OSError):
                        done = ("result", env_id, [f"{env_id}: the check's worker died"], now - t0, {})
                        s.kill()
                        slots[k] = _Slot(ctx, env_kwargs)
                if done is not None:
                    _, _, fails, _, stats = done
                    cap = capped.get(env_id)
                    slots[k].job = None
                    yield CheckResult(env_id, list(fails), time.perf_counter() - first_t[env_id], stats,
                                      cap[0] if cap else None, cap[1] if cap else "")
                    continue
                lim = limit_of(env_id)
                if s.gen is not None:
                    cpu = _caps.process_cpu_seconds(s.proc.pid)
                    late = _caps.overdue(None if cpu is None else cpu - s.gen[3], now - s.gen[2], lim)
                else:
                    late = False
                if late:
                    d, seed = s.gen[0], s.gen[1]
                    s.kill()
                    slots[k] = _Slot(ctx, env_kwargs)
                    lower = [x for x in ds if x < d]
                    reason = f"generate(seed={seed}, difficulty={d}) took over {lim:g}s"
                    if not lower:
                        yield CheckResult(env_id, [f"{env_id} d={d} seed={seed}: {reason} at the lowest "
                                                   f"difficulty checked"], now - first_t[env_id], {},
                                          d - 1 if d > 0 else None, reason)
                        continue
                    capped[env_id] = (d - 1, reason)
                    pending.insert(0, (env_id, lower))
                elif now - t0 > env_limit:
                    s.kill()
                    slots[k] = _Slot(ctx, env_kwargs)
                    yield CheckResult(env_id, [f"{env_id}: the check took over {env_limit:g}s"],
                                      now - first_t[env_id], {})
    finally:
        for s in slots:
            try:
                if s.proc.is_alive():
                    s.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for s in slots:
            s.proc.join(2)
            if s.proc.is_alive():
                s.kill()


def update_caps(results: list[CheckResult], difficulties: list[int], path=None, write: bool = True) -> dict:
    """Caps after ``results``: the caps found are recorded; a recorded cap is dropped when the check covered every
    difficulty above it without hitting the time bound. A cap found above a recorded one replaces it
    only where the check covered every difficulty between them (a time-out at ``d`` says nothing of the
    difficulties below it that were not checked: one at 4 of a check of 4 alone would raise a cap of 1 to 3).
    Written to ``path`` if ``write``."""
    from envs import caps as _caps

    caps = dict(_caps.load_caps(path))
    top = max(difficulties)
    for r in results:
        if r.cap is not None and r.cap >= 0:
            old = caps.get(r.env_id, {}).get("max_difficulty")
            if old is None or r.cap <= old or set(range(old + 1, r.cap + 1)) <= set(difficulties):
                caps[r.env_id] = {"max_difficulty": int(r.cap), "reason": r.cap_reason}
        elif r.cap is None and r.env_id in caps and not r.failures and caps[r.env_id]["max_difficulty"] < top and \
                set(range(caps[r.env_id]["max_difficulty"] + 1, top + 1)) <= set(difficulties):
            del caps[r.env_id]  # every difficulty past the cap was checked and now generates in time
    if write:
        _caps.save_caps(caps, path)
    return caps
