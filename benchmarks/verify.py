"""Verifying an RL batch: one response at a time vs ``rl.verify_workers`` threads (envs.base.verify_all).

Prints ONE JSON line. Usage: python benchmarks/verify.py [--rollouts 64] [--workers 2 4] [--repeats 3]

Two batches of ``--rollouts`` responses, as one RL step of the math stage would verify them:
- ``code``: ``code/solve`` responses over its seed problems (difficulties 1-3): a third the reference
  program (accepted: every test runs), a third a wrong program (judged until its first failed test),
  a third without a code block (no sandbox start). Each judged response is one sandbox start.
- ``math``: ``math/arith`` answers that need math-verify (the gold as a fraction over 1 or a
  decimal, and a wrong one): each goes to a math-verify worker process.

For each batch: ``seq_s`` (``workers=1``: every response here, one after another, as the trainer did
before ``verify_workers``) and ``threads_s`` per worker count, wall time of ``verify_all`` over the
whole batch, measured here; ``speedup`` their ratio; ``cores_busy`` the CPU seconds of this process
and its finished children (the sandbox starts) per wall second of the pass; ``same_scores`` whether every score (reward,
correct, judge status) agrees with the sequential pass. One untimed pass of each setting first (the
sandbox's warm pool fills, math workers start); then ``--repeats`` interleaved passes, median with
min and max beside it.

Measured on this project's 2-core CPU (2026-12-04, commit 5801168 plus this change, defaults, three runs):
``code`` 0.91, 0.93, 1.15 s one at a time against 0.79, 0.82, 1.09 s with 2 threads (1.15x, 1.14x,
1.06x) and 0.79, 0.79, 0.90 s with 4 (1.16x, 1.18x, 1.27x); ``math`` 0.22, 0.29, 0.24 s against 0.10,
0.12, 0.14 s with 2 threads (2.30x, 2.43x, 1.73x) and 0.12, 0.13, 0.15 s with 4; the same scores
every time. Math answers wait on math-verify worker processes, so threads overlap the waits (a
worker per thread). The sandbox gains little on these two cores although ``cores_busy`` says the
machine is mostly idle during the pass (0.36-0.45; the starts made ahead by the sandbox's warm pool
are counted when they end, so this undercounts): the warm pool's size does not change it (warm 2, 4,
8 starts gave 0.80, 0.73, 0.79 s at 2 threads in one run), bwrap's own start is ~3 ms and runs 1.8x
faster two at a time (``bwrap --unshare-net true``), and where the rest goes is not yet found. How it scales
with more cores was not measured (no such machine was lent).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_batch(n: int):
    from envs import get_env

    env = get_env("code/solve")
    items = []
    for i in range(n):
        p = env.generate(i // 3, 1 + (i // 3) % 3)
        s = env.seed_of(p)
        kind = i % 3
        text = (env.reference_response(p) if kind == 0 else
                f"My solution:\n```python\n{s.wrong[(i // 3) % len(s.wrong)]}\n```" if kind == 1 else
                "I could not solve it.")
        items.append((env, p, text))
    return items


def math_batch(n: int):
    from envs import get_env

    env = get_env("math/arith")
    items = []
    for i in range(n):
        p = env.generate(i, 2)
        ans = str(p.answer)
        text = (f"\\boxed{{\\frac{{{ans}}}{{1}}}}" if i % 3 == 0 else f"\\boxed{{{ans}.0}}" if i % 3 == 1
                else f"\\boxed{{\\frac{{{ans}}}{{7}}}}")
        items.append((env, p, text))
    return items


def cpu() -> float:
    """CPU seconds of this process and its reaped children (sandbox starts, math workers' are not:
    those live on)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def key(scores):
    return [(s.reward, s.correct, s.info.get("status")) for s in scores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from envs import verify_all

    out = {"rollouts": a.rollouts, "cores": os.cpu_count(), "repeats": a.repeats}
    for name, build in (("code", code_batch), ("math", math_batch)):
        items = build(a.rollouts)
        settings = [1, *a.workers]
        ref = None
        times: dict[int, list[float]] = {w: [] for w in settings}
        busy: dict[int, list[float]] = {w: [] for w in settings}
        same = True
        for rep in range(a.repeats + 1):
            for w in settings:
                c0, t0 = cpu(), time.perf_counter()
                scores = verify_all(items, workers=w)
                dt = time.perf_counter() - t0
                ref = ref or key(scores)
                same &= key(scores) == ref
                if rep:
                    times[w].append(dt)
                    busy[w].append((cpu() - c0) / dt)
        med = {w: statistics.median(ts) for w, ts in times.items()}
        out[name] = {"seq_s": round(med[1], 3),
                     "threads_s": {str(w): round(med[w], 3) for w in a.workers},
                     "speedup": {str(w): round(med[1] / med[w], 2) for w in a.workers},
                     "range_s": {str(w): [round(min(ts), 3), round(max(ts), 3)] for w, ts in times.items()},
                     "cores_busy": {str(w): round(statistics.median(b), 2) for w, b in busy.items()},
                     "correct": sum(c for _, c, _ in ref), "same_scores": same}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
