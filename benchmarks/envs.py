"""Environment throughput: problems generated and verifications per second over every registered
environment (or the ids/globs given), as one JSON line.

    python benchmarks/envs.py [ID_OR_GLOB ...] [--n 20] [--difficulty 2]

Each environment generates ``n`` problems (seeds 0..n-1) after one warm-up problem, then
verifies its reference response for each. Totals are summed over environments; the slowest
environments are listed so outliers are visible (``slowest_ms_per_problem``: generating a problem and verifying its
reference, each; before 33f0479 ``slowest_ms_per_call`` was their mean, half a slow generator's time per problem),
and ``reference_not_credited`` names any environment whose verifier did not credit its own reference answers (a
verifier that rejects early is fast and wrong; an empty mapping is the check passing). There is no reference run:
the figures are absolute, each environment's own cost. ``by_source`` gives the same throughput for
Cascade's own environments and for each adapted package beside them: ``rg`` (reasoning-gym),
``rlve`` (RLVE-Gym), ``rc`` (reasoning-core). Environments are built with ``get_env``, so the
adapters' generation time bound and recorded difficulty caps apply as in a run.

The warm-up verifies the warm-up problem's reference response, so an environment that checks in a
worker process or a sandbox (the adapted ones, ``code/*``) has started it before the clock starts;
an empty response was rejected before any worker started, so earlier ``verifications_per_s``
figures included the first worker's start and imports: since this change they do not.
``median_env_ms_per_call`` is ``statistics.median`` over environments (the mean of the two middle
ones for an even count) since this change; before it was the upper middle one.

Measured at a345f38 (2026-12-06; difficulty 2, 20 problems per environment, 714 environments, one run):
``verifications_per_s`` 2,474 (own 1,858, rc 1,443, rg 1,046, rlve 5,793), ``problems_per_s`` 78 (own 4,459, rc 20,
rg 16, rlve 1,254), ``median_env_ms_per_call`` 0.24; slowest generators rg/number_sequence 2.0 s and rg/countdown
0.50 s per problem. At 2ca2976 (2026-12-06, later: IFEval's language checks by langdetect, the gym reward-hack
fixes, rc generation seeded; one run): 2,424 (own 1,706, rc 1,565, rg 1,084, rlve 5,449), ``problems_per_s`` 78 (own
3,327, rc 20, rg 16, rlve 1,239), median 0.235 ms. At c9a84d9 (gym/pattern_occurrences' pattern length bounded;
one run): 2,576 (own 1,814, rc 1,591, rg 1,136, rlve 6,015), ``problems_per_s`` 79 (own 3,551, rc 20, rg 16.5, rlve
1,311), median 0.225 ms. At 6cd3ff2 (the code seeds' larger tests, rg exact checks; one run, an hour this machine ran
the pipeline benchmark ~5% slower): 2,238 (own 1,402, rc 1,524, rg 998, rlve 5,864), ``problems_per_s`` 77 (own 2,940,
rc 19.5, rg 16, rlve 1,149), median 0.233 ms. At 131d608 (2026-12-06, later: gym generators reworked, rg/rc problems
whose own answer the package fails drawn again; one run, an hour this machine ran benchmarks/train.py ~18% slower than
at c9a84d9): 1,960 (own 1,191, rc 1,226, rg 943, rlve 5,065), ``problems_per_s`` 71 (own 2,546, rc 17, rg 15, rlve
1,187), median 0.257 ms; ``reference_not_credited`` empty (the run at 6a316f8, before the adapters drew such problems
again, named rc/inverse_math 8, rg/jugs 5 and rg/string_manipulation 1 of 20); slowest generators
rg/number_sequence 4.2 s and rg/countdown 1.2 s per problem (the 2.0 s and 0.50 s above are those halved: the mean
of a generation and a verification). At db4d818 (2026-12-06, later: the rc adapter seeds through rlve_adapter's
``_seeded``, the worker's sympy name check written once, the code validators' line checks shared; one run, alone):
2,046 (own 1,182, rc 1,303, rg 1,000, rlve 5,626), ``problems_per_s`` 74 (own 2,620, rc 18.5, rg 15.6, rlve 1,016),
median 0.318 ms; ``reference_not_credited`` empty, 71 environments without oracle answers; slowest generators
rg/number_sequence 4.1 s and rg/countdown 1.1 s per problem. At fc73bd7 (2026-12-07, another machine (AMD EPYC): six
code seeds gained tests of 10^5 elements, which every code verification of them runs; toy/add and toy/max capped;
one run, alone): 1,418 (own 702, rc 1,034, rg 828, rlve 3,985), ``problems_per_s`` 59.5 (own 1,491, rc 13.4, rg
13.2, rlve 879), median 0.377 ms; ``reference_not_credited`` empty, 71 without oracle answers; slowest generators
rg/number_sequence 4.7 s and rg/countdown 1.4 s per problem (the whole machine slower: rlve, unchanged, 3,985
against 5,626). At fc4d7a5 (2026-12-07, later; seven more code seeds with tests at their stated
sizes, the math verifier's exact decimals and spaced digits, gym caps and parsers; one run, alone): 1,226 (own 685,
rc 969, rg 624, rlve 3,075), ``problems_per_s`` 54.4 (own 1,627, rc 13.4, rg 11.8, rlve 598), median 0.494 ms;
``reference_not_credited`` empty, 71 without oracle answers; slowest generators rg/number_sequence 5.2 s and
rg/countdown 1.5 s per problem (rlve, whose code is the package's, 3,075 against 3,985 at fc73bd7: this run's
machine a quarter slower, so the own environments' change cannot be told from it). At bb5e338 (code/falsify and
code/arc's wrong programs run in prepare(), code/solve's fraction reward; one run, alone): 1,307 (own 711, rc 893, rg
732, rlve 3,268); ``reference_not_credited`` empty. At 9663526 (2026-12-07, later: the scorers' eval never reads their
variables; gym's mixed numbers and unsigned lists; one run, a test file's run beside it for part of the time): 1,492
(own 852, rc 1,157, rg 780, rlve 3,510), ``problems_per_s`` 64.8; ``reference_not_credited`` empty, 71 without oracle
answers.
Re-run at bbe8685 (2026-12-07; 713 environments, rlve/Cornfield left out; one run, alone): 1,603 verifications/s
(own 808, rc 1,187, rg 928, rlve 4,368), 66.9 problems/s; every reference answer credited bar the 70 without an oracle.
Re-run at ef957db (2026-12-07, a later session, after the gym fraction and math fixes; one run, alone): 1,549
verifications/s (own 789, rc 1,072, rg 869, rlve 4,421), 63.9 problems/s; every reference answer credited bar the 70
without an oracle; no errors.
Re-run at 66ce378 (2026-12-07, a later session: math lists with "or", gym paths with arrows, code tolerances read
decimal tokens only; one run, alone): 1,487 verifications/s (own 783, rc 1,097, rg 782, rlve 4,164: the package's own
code 6% slower than at ef957db, this machine's noise), 62.7 problems/s; every reference answer credited bar the 70
without an oracle; no errors.
Re-run later that session, alone, after a hedged gold ("5 or more") stopped taking a plain "5": at 12d906c 1,220
verifications/s (own 563, rc 788, rg 781, rlve 3,938; reasoning-core's own code 28% slower too: a slow run), then at
60413a1 (a refactor of the same check) 1,464 (own 721, rc 1,180, rg 805, rlve 4,308), 65.7 problems/s; every reference
answer credited bar the 70 without an oracle; no errors.
Re-run at 8d18786 (2026-12-07, a later session: the generation time bounds count CPU time, envs/caps.py; one run,
alone): 1,518 verifications/s (own 782, rc 1,192, rg 844, rlve 4,028), 64.4 problems/s (own 1,753, rc 16.7, rg 13.6,
rlve 847); every reference answer credited bar the 70 without an oracle; no errors. The bound's own cost per
generate, old against new code on gym/catalan (2,000 calls, 3 interleaved pairs): 156/171, 162/149, 142/146 us.
Re-run at 7cf1467 (2026-12-08, 40 minutes later; envs/caps.py reads /proc through envs.workers.proc_stat, which only
the check calls: the same code on this path; two runs, alone): 1,061 and 1,029 verifications/s (own 618 / 497, rc 815 /
739, rg 503 / 606, rlve 2,754 / 3,071), 47.1 and 49.3 problems/s; no errors, every reference credited bar the 70
without an oracle. The machine was slower: the packages' own generators took longer in the same runs
(rg/number_sequence 5.8 and 5.3 s a problem against 4.6 s at 8d18786, rg/countdown 1.75 s against 1.26 s).
Re-run at faeb45c (2026-12-08, a later session: every verifier worker forked by envs.workers.spawn, on one long-lived
thread; one run, alone): 1,571 verifications/s (own 823, rc 1,129, rg 837, rlve 4,437), 65.9 problems/s
(rg/number_sequence 4.5 s a problem, rg/countdown 1.13 s); no errors, every reference credited bar the 70 without an
oracle.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ADAPTED = ("rg", "rlve", "rc")  # namespaces of the adapted packages; everything else is Cascade's own


def _source(env_id: str) -> str:
    ns = env_id.split("/", 1)[0] if "/" in env_id else ""
    return ns if ns in ADAPTED else "own"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--difficulty", type=int, default=2)
    args = ap.parse_args(argv)

    from envs import get_env
    from envs.check import expand_ids

    ids = expand_ids(args.ids)
    gen_s = ver_s = 0.0
    n_gen = n_ver = 0
    per_env = {}
    errors = {}
    refused: dict[str, int] = {}  # environment -> reference answers its verifier did not credit
    no_oracle = 0
    by_source: dict[str, dict] = {}
    for env_id in ids:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # (some packages print progress dots: stdout is the JSON)
                env = get_env(env_id)
                w = env.generate(10_000, args.difficulty)  # warm-up: imports, and a real answer so that
                env.verify(w, env.reference_response(w))  # a worker/sandbox starts here, not in the timed loop
                t = time.perf_counter()
                problems = [env.generate(s, args.difficulty) for s in range(args.n)]
                g = time.perf_counter() - t
                refs = [env.reference_response(p) for p in problems]
                t = time.perf_counter()
                scores = [env.verify(p, r) for p, r in zip(problems, refs)]
                v = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - report and go on
            errors[env_id] = f"{type(e).__name__}: {e}"[:200]
            continue
        gen_s += g
        ver_s += v
        n_gen += len(problems)
        n_ver += len(problems)
        per_env[env_id] = (g / max(1, len(problems)), v / max(1, len(problems)))
        # a verifier that rejects its own reference answer is fast and wrong (environments without an oracle
        # answer, ``no_reference_reason``, verify an empty one: counted apart)
        if getattr(env, "no_reference_reason", ""):
            no_oracle += 1
        elif wrong := sum(not s.correct for s in scores):
            refused[env_id] = wrong
        src = by_source.setdefault(_source(env_id), {"environments": 0, "problems": 0, "gen_s": 0.0, "ver_s": 0.0})
        src["environments"] += 1
        src["problems"] += len(problems)
        src["gen_s"] += g
        src["ver_s"] += v
    slowest = sorted(per_env.items(), key=lambda kv: -sum(kv[1]))[:5]
    print(json.dumps({
        "environments": len(per_env),
        "difficulty": args.difficulty,
        "problems": n_gen,
        "problems_per_s": round(n_gen / gen_s, 1) if gen_s else None,
        "verifications_per_s": round(n_ver / ver_s, 1) if ver_s else None,
        "median_env_ms_per_call": round(1000 * statistics.median(sum(gv) / 2 for gv in per_env.values()), 3)
        if per_env else None,
        # per problem: generating it, and verifying its reference answer
        "slowest_ms_per_problem": {k: {"generate": round(1000 * g, 1), "verify": round(1000 * v, 1)}
                                   for k, (g, v) in slowest},
        "reference_not_credited": refused,
        "environments_without_oracle_answers": no_oracle,
        "by_source": {k: {"environments": v["environments"], "problems": v["problems"],
                          "problems_per_s": round(v["problems"] / v["gen_s"], 1) if v["gen_s"] else None,
                          "verifications_per_s": round(v["problems"] / v["ver_s"], 1) if v["ver_s"] else None}
                      for k, v in sorted(by_source.items())},
        "errors": errors,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
