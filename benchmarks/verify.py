"""Verifying an RL batch: one response at a time vs ``rl.verify_workers`` threads (envs.base.verify_all).

Prints ONE JSON line. Usage: python benchmarks/verify.py [--rollouts 64] [--workers 2 4] [--repeats 3]

Batches of ``--rollouts`` responses, as one RL step of the math (or RLVE) stage would verify them:
- ``code``: ``code/solve`` responses over its seed problems (difficulties 1-3): a third the reference
  program (accepted: every test runs), a third a wrong program (judged until its first failed test),
  a third without a code block (no sandbox start). Each judged response is one sandbox start.
- ``math``: answers to the ``math`` environment's built-in problems whose answers are expressions, sets,
  intervals or matrices (two of three the gold spelled with LaTeX spaces, one another problem's answer): each
  goes to a math-verify worker process. Until 2026-12-06 the batch was whole-number answers written as a
  fraction over 1 or a decimal, which the verifier now compares by value itself (no worker: ~1 ms for 64), and
  before 0922158 ``math/arith``'s, which now reads its answers itself.
- ``adapters`` (added 2026-12-08): answers to eight of the packages' own environments (RLVE-Gym, reasoning-gym,
  reasoning-core: ``ADAPTER_ENVS``), whose scorers run in isolated worker processes (envs/isolated.py), as an RLVE
  step verifies them: a third the reference answer, a third a wrong one, a third no answer (no worker).
- ``reward_model``: ``ifeval`` responses under the behavior stage's gated reward model (a tiny random
  Qwen3 classifier): ``verify`` one at a time (one forward per response that follows its instructions)
  against ``verify_all``, which hands them to ``GatedRewardEnv.verify_many`` (the checker on each, then
  padded forwards of 16); ``same_scores`` compares correct, and reward within 1e-5 (until 33f0479 both rounded to
  5 decimals, which a value on a rounding boundary fails for float noise of ~1e-8: one run said false).

For each batch: ``seq_s`` (``workers=1``: every response here, one after another, as the trainer did
before ``verify_workers``) and ``threads_s`` per worker count, wall time of ``verify_all`` over the
whole batch, measured here; ``speedup`` their ratio; ``cores_busy`` the CPU seconds of this process
and everything it starts (a cpuacct cgroup of its own where it may make one, as in
benchmarks/sandbox.py: the sandbox's pid namespaces escape rusage) per wall second of the pass;
``same_scores`` whether every score (reward, correct, judge status) agrees with the sequential pass.
One untimed pass of each setting first (the sandbox's warm pool fills, math workers start; three for ``adapters``); then
``--repeats`` interleaved passes, median with min and max beside it.

Measured on this project's 2-core CPU (2026-12-04, commits a88caf3 / 626b988, defaults, five runs):
``code`` one at a time 0.91, 0.93, 1.15, 1.00, 1.07 s, with 2 threads 1.15x, 1.14x, 1.06x, 1.09x, 1.16x
and with 4 1.16x, 1.18x, 1.27x, 1.10x, 1.13x; ``math`` 0.22-0.34 s one at a time, with 2 threads 2.30x,
2.43x, 1.73x, 1.78x, 2.39x and with 4 1.59-2.22x; the same scores every time. Why (``cores_busy``, the
last two runs): both batches are bound by the CPU of these two cores. One code response at a time
already keeps 1.60-1.62 cores busy (the sandbox's warm pool makes the next starts on the other core
while a program runs), and threads take it to 1.84-1.87; one math answer at a time keeps one core
busy (the caller waits on its math-verify worker), and threads, a worker each, take it to 1.88-1.97.
How it scales with more cores was not measured (no such machine was lent).
Re-run at d52fa63 (one run): ``code`` 0.92 s one at a time, 1.13x with 2 threads, 1.14x with 4 (cores busy 1.62,
1.83, 1.87); ``math`` 0.21 s, 2.06x with 2, 1.63x with 4; ``reward_model`` 0.112 -> 0.064 s (1.76x); same scores.
Re-run at d9aab17 (2026-12-05: math-verify's workers through ``envs.workers``, the same protocol; one run): ``code``
0.70 s one at a time, 1.13x with 2 threads, 1.18x with 4 (cores busy 1.54, 1.78, 1.85); ``math`` 0.20 s, 1.94x with 2,
1.99x with 4 (cores busy 0.99, 1.98, 1.95); ``reward_model`` 0.092 -> 0.049 s (1.89x); same scores.
Re-run at 6f000cc (one run): ``code`` 0.74 s, 1.16x with 2, 1.20x with 4; ``math`` 0.21 s, 2.14x with 2, 1.92x with
4; ``reward_model`` 0.090 -> 0.053 s (1.70x); same scores.
Re-run at a2508dc (2026-12-06; the math batch now the ``math`` environment's sample problems with whole-number
answers, shorter for math-verify than ``math/arith``'s fractions; one run): ``code`` 0.72 s, 1.14x with 2, 1.16x with 4;
``math`` 0.073 s one at a time, 1.64x with 2, 1.88x with 4 (cores busy 0.99, 1.95, 1.90); ``reward_model`` 0.091 ->
0.052 s (1.74x); same scores. Re-run at 58f57a8 (2026-12-06, later: the code environments gained their aggregation
template, nothing on the verify path; one run): ``code`` 0.73 s, 1.16x with 2, 1.18x with 4; ``math`` 0.077 s, 1.39x
with 2, 1.95x with 4; ``reward_model`` 0.091 -> 0.050 s (1.81x); same scores. At 69fad46 (2026-12-06, later: plain
numbers compared by value, so the math batch became answers that need math-verify, as described above; one run):
``code`` 0.64 s, 1.18x with 2, 1.20x with 4; ``math`` 0.33 s one at a time (0.27-0.51 over the repeats), 2.56x with
2, 2.96x with 4 (cores busy 1.00, 1.93, 1.95: one at a time a core waits on each round trip to the worker);
``reward_model`` 2.07x then 1.83x in two runs; same scores. (The whole-number batch of before: 0.001 s for 64.)
At a345f38 (2026-12-06, later: the sandbox and code environments' fixes; one run): ``code`` 0.89 s one at a time,
1.32x with 2 and with 4; ``math`` 0.31 s, 2.59x with 2, 1.96x with 4; ``reward_model`` 1.82x; same scores.
At 2ca2976 (2026-12-06, later: IFEval's language checks by langdetect, unfinished thinking no answer, math numbers
with names and units; one run): ``code`` 0.89 s, 1.28x with 2, 1.31x with 4; ``math`` 0.29 s, 2.10x with 2, 3.08x
with 4; ``reward_model`` 0.100 -> 0.058 s (1.72x); same scores. At 3a0a6c1 (2026-12-06, later: batched reward scores
only where the model's pad id is the tokenizer's, here it is; code seeds with larger tests; one run): ``code`` 1.03 s,
1.38x with 2 and 4; ``math`` 0.26 s, 1.77x with 2, 1.75x with 4 (its sequential repeats ranged 0.25-0.52 s: a noisy
hour); ``reward_model`` 0.102 -> 0.058 s (1.77x); same scores. At 131d608 (2026-12-06, later: the math verifier's hedge,
equation and set/interval checks; the reward-model scores compared within 1e-5; one run: a run at 6a316f8, which
compared them rounded to 5 decimals, said they differed, while they differed by at most 1.5e-8): ``code`` 1.17 s, 1.37x with 2, 1.35x with 4; ``math``
0.30 s (repeats 0.21-0.52 s), 2.47x with 2, 4.46x with 4; ``reward_model`` 0.122 -> 0.069 s (1.77x); same scores.
At 6e4e5fe (2026-12-06, later: math-verify's and the sandbox's workers wait with poll; one run, alone): ``code`` 1.10 s,
1.35x with 2, 1.38x with 4; ``math`` 0.34 s (repeats 0.18-0.48 s), 2.80x with 2, 5.03x with 4; ``reward_model``
0.107 -> 0.065 s (1.65x); same scores.
At fc73bd7 (2026-12-07, another machine (AMD EPYC); six code seeds gained tests at their stated sizes, 10^5-element
inputs; one run, alone): ``code`` 2.23 s, 1.48x with 2, 1.47x with 4 (22 correct); ``math`` 0.31 s (repeats
0.21-0.69 s), 2.21x with 2, 3.69x with 4; ``reward_model`` 0.161 -> 0.105 s (1.53x); same scores.
At fc4d7a5 (2026-12-07, later: the math verifier's exact decimals, spaced digits and value words;
seven more code seeds with tests at their stated sizes; the sandbox masks site-packages; one run, alone): ``code``
2.16 s, 1.39x with 2, 1.48x with 4 (22 correct); ``math`` 0.39 s (repeats 0.26-0.89 s), 3.24x with 2, 2.74x with 4;
``reward_model`` 0.141 -> 0.080 s (1.76x); same scores. At 6f90c2d (2026-12-07, later: the third-party scorers'
eval without the caller's variables, the workers' kill of what a scorer started, code/arc and code/falsify's one
prepare(); one run, a benchmark's start beside it): ``code`` 1.56 s, 1.46x with 2, 1.49x with 4 (22 correct);
``math`` 0.31 s (repeats 0.22-0.59 s), 2.62x with 2, 2.14x with 4; ``reward_model`` 0.106 -> 0.073 s (1.47x); same
scores.
``reward_model`` (one run, 2026-12-04): 0.116 s one at a time, 0.063 s batched (1.84x; 38 of 64 scored by the
model), same scores; a model this small is mostly per-call overhead, and a real reward model on a GPU was
not measured.
Re-run at bbe8685 (2026-12-07, later; alone): math 2.82x with 2 threads, 3.68x with 4; code/solve 1.42x, 1.45x;
reward model 1.58x; same scores both ways.
Re-run at ef957db (2026-12-07, a later session, after the gym/math grading fixes; alone): math 3.86x with 2 threads,
3.97x with 4; code/solve 1.50x, 1.50x; reward model 1.54x; same scores both ways.
Re-run at 66ce378 (2026-12-07, a later session: a gold listing answers with "or" is a list; alone, two runs): math
5.70x with 2 threads, 5.18x with 4, then 3.15x, 3.94x (one at a time 0.19-0.61 s over the repeats: the math figure
is this machine's noise as much as the threads'); code/solve 1.40x, 1.54x then 1.46x, 1.48x; reward model 1.64x,
1.58x; same scores both ways.
Re-run at 12d906c (later that session: a hedged gold such as "5 or more" is not answered by a plain "5"; alone):
math 5.64x with 2 threads, 5.80x with 4 (one at a time 0.36-0.59 s); code/solve 1.30x, 1.35x; reward model 1.68x;
same scores both ways.
Re-run at 2b5d4e6 (a later session; envs/math.py as at 60413a1, a refactor of 12d906c's check; alone): math 2.37x with
2 threads, 3.58x with 4 (one at a time 0.31-0.55 s over the repeats: this machine's noise); code/solve 1.52x, 1.49x;
reward model 1.55x; same scores both ways.
``adapters`` at 6ce97e5 (2026-12-08: the workers forked from one long-lived thread, ``envs.workers.spawn``) against
34fb9ee's envs/workers.py (before it), interleaved, two runs each, alone; each setting's passes in a row, as an RL stage
verifies step after step: with 2 threads 0.019 and 0.014 s for the 64 answers (4 threads 0.27 and 0.03 s: some of the
four workers still importing a package for the first time after three warm passes) against 3.66 and 3.55 s (4 threads
7.78 and 7.78 s) before, when every pass's workers died with its threads (bwrap's ``--die-with-parent`` follows the
forking thread) and the next pass started them again; one at a time 0.014-0.018 s either way (the main thread's
workers lived on). One of the two runs before the change scored a pass differently from the first (``same_scores``
false): a call can land on a worker being killed, whose answer is then a zero. code/solve, math and the reward model
the same either way (1.33-1.42x, 2.58-3.66x, 1.57-1.89x with 2 threads).
Re-run at 6003712 (the spawner reset in a forked child; the pipeline's interrupt, off this path; one run, alone):
``adapters`` 0.016 s with 2 threads, 0.021 s with 4 (0.014 s one at a time); ``math`` 2.28x with 2 threads, 3.76x with
4; code/solve 1.40x, 1.39x; reward model 1.56x; same scores everywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sandbox import _cpu, _drop_cpuacct, _own_cpuacct  # noqa: E402  (benchmarks/sandbox.py)


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
    from envs.math import plain_number

    # the built-in sample's answers that are not plain numbers (those are compared by value, without math-verify)
    env = get_env("math", heldout=0.0)
    rows = [r for r in env.rows if plain_number(r["answer"]) is None]
    items = []
    for i in range(n):
        row = rows[i % len(rows)]
        p = env.problem(row["problem"], row["answer"], i, 0)
        # two of three the gold spelled with LaTeX spaces (equal, but not as written: math-verify decides), one of
        # three another problem's answer (wrong)
        ans = row["answer"] if i % 3 < 2 else rows[(i + 1) % len(rows)]["answer"]
        text = "\\boxed{\\," + ans.replace(" ", "\\,") + "}" if i % 3 < 2 else f"\\boxed{{{ans}}}"
        items.append((env, p, text))
    return items


ADAPTER_ENVS = ("rlve/Maze", "rlve/Kakurasu", "rlve/BlockImage", "rlve/VisibleLine", "rg/basic_arithmetic",
                "rg/word_sorting", "rc/arithmetics", "rc/graph_successors")


def adapter_batch(n: int):
    """Answers to the packages' own environments (RLVE-Gym, reasoning-gym, reasoning-core), whose scorers run in the
    isolated worker processes (envs/isolated.py): a third the reference answer, a third a wrong one, a third without
    an answer (scored here, no worker)."""
    from envs import get_env

    items = []
    for i in range(n):
        env = get_env(ADAPTER_ENVS[i % len(ADAPTER_ENVS)])
        p = env.generate(i // len(ADAPTER_ENVS), 0)
        kind = (i // len(ADAPTER_ENVS)) % 3
        text = (env.reference_response(p) if kind == 0 else "<answer>qx9 ### zz</answer>" if kind == 1 else
                "I could not solve it.")
        items.append((env, p, text))
    return items


def rm_batch(n: int, tmp: str):
    """``n`` ifeval responses (references, some padded out, some empty) under a reward model: a tiny
    random Qwen3 sequence classifier (2 layers, hidden 64) built with the tiny-dense tokenizer."""
    from cascade.reward_model import GatedRewardEnv, RewardModel, build_tiny_reward_model
    from envs import get_env
    from train.presets import init_model

    init_model("tiny-dense", tmp, seed=0)
    base = get_env("ifeval")
    env = GatedRewardEnv(base, RewardModel(build_tiny_reward_model(os.path.join(tmp, "rm"), tmp)))
    items = []
    for i in range(n):
        p = env.generate(i, i % 3)
        ref = base.reference_response(p)
        items.append((env, p, "" if i % 4 == 3 else ref + " and so on" * (i % 7)))
    return items


def key(scores):
    return [(s.reward, s.correct, s.info.get("status")) for s in scores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    out = {"rollouts": a.rollouts, "cores": os.cpu_count(), "repeats": a.repeats,
           "cpu_source": "cgroup cpuacct" if _own_cpuacct() else "rusage (misses the sandbox's pid namespace)"}
    try:
        for name, build in (("code", code_batch), ("math", math_batch)):
            out[name] = measure(build(a.rollouts), a.workers, a.repeats)
        # (three untimed passes: a worker imports each package the first time it scores one of its environments,
        # up to 2 s for RLVE-Gym's, which imports torch)
        out["adapters"] = measure(adapter_batch(a.rollouts), a.workers, a.repeats, warmups=3, blocked=True)
        with tempfile.TemporaryDirectory() as d:
            out["reward_model"] = measure_batched(rm_batch(a.rollouts, d), a.repeats)
    finally:
        from envs.code.sandbox import _close_pools

        _close_pools()  # the starts kept ready hold cgroups inside ours
        _drop_cpuacct()
    print(json.dumps(out))


def measure_batched(items, repeats: int) -> dict:
    """``verify`` one response at a time against ``verify_all`` (the environment's ``verify_many``)."""
    from envs import verify_all

    one, many, same = [], [], True
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        ref = [env.verify(p, r) for env, p, r in items]
        t1 = time.perf_counter()
        got = verify_all(items, workers=1)
        t2 = time.perf_counter()
        # (within 1e-5: batched forwards differ from single ones in float rounding, ~1e-8 here; rounding both to 5
        # decimals split a value on a rounding boundary, and said the scores differed)
        same &= len(got) == len(ref) and all(g.correct == s.correct and abs(g.reward - s.reward) <= 1e-5
                                             for g, s in zip(got, ref))
        if rep:
            one.append(t1 - t0)
            many.append(t2 - t1)
    return {"one_at_a_time_s": round(statistics.median(one), 4), "verify_many_s": round(statistics.median(many), 4),
            "speedup": round(statistics.median(one) / statistics.median(many), 2),
            "scored_by_the_model": sum(s.correct for s in ref), "same_scores": same}


def measure(items, workers: list[int], repeats: int, warmups: int = 1, blocked: bool = False) -> dict:
    """Timings of verify_all over ``items`` one at a time and at each of ``workers`` (see the module docstring), after
    ``warmups`` untimed passes of each setting; the settings' passes interleaved, or with ``blocked`` each setting's
    in a row, the threads' first (as an RL stage verifies step after step)."""
    from envs import verify_all

    settings = [1, *workers]
    ref = None
    times: dict[int, list[float]] = {w: [] for w in settings}
    busy: dict[int, list[float]] = {w: [] for w in settings}
    same = True
    order = ([(rep, w) for w in [*workers, 1] for rep in range(repeats + warmups)] if blocked else
             [(rep, w) for rep in range(repeats + warmups) for w in settings])
    for rep, w in order:
        c0, t0 = _cpu(), time.perf_counter()
        scores = verify_all(items, workers=w)
        dt = time.perf_counter() - t0
        ref = ref or key(scores)
        same &= key(scores) == ref
        if rep >= warmups:
            times[w].append(dt)
            busy[w].append((_cpu() - c0) / dt)
    med = {w: statistics.median(ts) for w, ts in times.items()}
    return {"seq_s": round(med[1], 3),
            "threads_s": {str(w): round(med[w], 3) for w in workers},
            "speedup": {str(w): round(med[1] / med[w], 2) for w in workers},
            "range_s": {str(w): [round(min(ts), 3), round(max(ts), 3)] for w, ts in times.items()},
            "cores_busy": {str(w): round(statistics.median(b), 2) for w, b in busy.items()},
            "correct": sum(c for _, c, _ in ref), "same_scores": same}


if __name__ == "__main__":
    main()
