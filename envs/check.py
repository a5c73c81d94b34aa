"""Self-check of an environment: the contract every registered environment must keep.

For each (difficulty, seed): generation is deterministic (same problem twice, regardless of what
was generated in between) and JSON-serialisable; the reference response verifies as correct; no
corruption verifies as correct; every reward is in [-1, 1]; every verify returns within the
environment's ``verify_time_limit``. An environment with a ``no_reference_reason`` (no oracle
answer exists) is exempt from "the reference verifies" only.
"""
from __future__ import annotations

import fnmatch
import json
import time
from typing import Iterable

from envs.base import Environment, Problem, Score, get_env, list_envs

__all__ = ["self_check", "check_ids", "expand_ids"]


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
        elif any(ch in pat for ch in "*?["):
            hits = [i for i in all_ids if fnmatch.fnmatchcase(i, pat)]
        else:
            hits = [pat]  # get_env explains an unknown id
        if not hits:
            raise KeyError(f"no environment matches {pat!r}")
        out.extend(h for h in hits if h not in out)
    return out


def check_one(env_id: str, difficulties: list[int], seeds: list[int], env_kwargs: dict | None = None) -> tuple[str, list[str], float]:
    """(id, failures, seconds) of one environment; an environment that fails to build is a failure."""
    t = time.perf_counter()
    try:
        env = get_env(env_id, **(env_kwargs or {}))
    except Exception as e:  # noqa: BLE001
        return env_id, [f"{env_id}: cannot build: {type(e).__name__}: {e}"], time.perf_counter() - t
    return env_id, self_check(env, difficulties, seeds), time.perf_counter() - t


def check_ids(ids: list[str], difficulties: list[int], seeds: list[int], jobs: int = 1,
              env_kwargs: dict | None = None):
    """Yield ``check_one`` results for ``ids``, in order, using ``jobs`` processes."""
    if jobs <= 1 or len(ids) <= 1:
        for i in ids:
            yield check_one(i, difficulties, seeds, env_kwargs)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
        futs = [ex.submit(check_one, i, difficulties, seeds, env_kwargs) for i in ids]
        for f in futs:
            yield f.result()
