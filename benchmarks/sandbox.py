"""The code sandbox against bare execution: one program, and one program judged on 20 stdin tests.

Prints one JSON line. Usage: python benchmarks/sandbox.py [--n 40] [--repeats 5] [--tests 20]

- ``ratio_seq``: time of one sandboxed run of a trivial program (``Sandbox.run``, sandbox starts
  kept ready ahead by the pool) over a bare ``python -S`` subprocess of the same interpreter on
  the same file, runs one after another (goal <= 1.5). This is the SPARE-CORE regime, which flatters
  the sandbox: one run at a time leaves a core idle, and the pool makes the next start on it while
  the run goes, so the start's cost (most of a sandboxed run's CPU, see ``cpu_ms``) is off the wall
  clock. ``ratio_par``, both sides from ``--workers`` threads (one per core by default, no core
  spare), is the realistic regime of a busy verifier (RL verifying a batch): quote it beside
  ``ratio_seq``. ``ratio_seq_cold``: runs one after another without the pool (each run pays its start).
- ``judge_ratio``: ``Judge.judge`` of one program on 20 stdin tests (one sandbox start, each test
  its own process) over the 20 tests run bare one after another, each compared (goal <= 1.3). Its
  start comes from the same pool, one judgement at a time: the spare-core regime too (no parallel
  judge figure is taken).
- ``cpu_ms``: CPU time (this process and everything it starts, from a cpuacct cgroup of its own
  when it may make one) per run or judgement, both sides: the pool starts sandboxes on another
  core, so the sandbox side may spend more CPU than its wall time.
- ``start_phases_ms``: where one sandbox start's time goes (medians over cold starts: box
  directory, cgroup creation, spawn, bwrap + the cgroup join + interpreter start until the
  supervisor's first line, its imports until ready, and ``cpu_in_sandbox``: the CPU the start's own
  cgroup counted, from the join (after bwrap's namespaces and mounts) on); ``ablation_ms``: bwrap
  alone with /bin/true, one layer added at a time (network namespace, seccomp), and python -S bare
  and in bwrap, to price each layer; ``run_phases_ms``: one run inside a ready start.

Ratios are medians over ``--repeats`` interleaved repeats, with min and max.

Measured on this project's 2-core CPU (2026-12-02, quiet machine, defaults), code of commit f847c05,
three runs: ``ratio_seq`` 1.40, 1.43 and 1.28 (every repeat 1.19-1.46; 10.6-12.7 ms bare, 15.4-15.8 ms
sandboxed: this machine ran ``python -S`` 30-40% slower than on 2026-12-01), ``ratio_seq_cold`` 2.7-3.0,
``judge_ratio`` 0.45, 0.41, 0.46 (95-107 ms against 234-244 ms for 20 tests), ``ratio_par`` 2.4-2.7
(the realistic regime, no core spare, beside the spare-core ``ratio_seq``).
Two earlier runs the same day, one bind mount more per start (commit b1979b4): ratio_seq 1.36 and 1.60
(repeats 1.23-1.84). Side by side, two alternating runs each on a loaded machine: the code of
2026-12-01 (commit 4f209f3) 1.45 and 1.76, with the fast exit alone (commit 4a58c74) 1.37 and 1.45.
Re-run at 9a464f0 (2026-12-06: a run that exits 0 is ok whatever its stderr says; one run, a machine that ran this
session's test suite ~30% slower than the last): ``ratio_seq`` 1.76 (repeats 1.47-1.91; 12.03 ms bare,
19.12 ms sandboxed), ``ratio_seq_cold`` 3.99, ``judge_ratio`` 0.42, ``ratio_par`` 3.17 (realistic; the
goal's ``ratio_seq`` is the spare-core regime): the goal (<= 1.5) missed in this run. Re-run at 6cd3ff2 (2026-12-06,
later: the run's standard streams reopenable, System V objects removed by id; one run, alone): ``ratio_seq`` 1.40
(6.55 ms bare, 9.22 ms sandboxed), ``ratio_seq_cold`` 2.65, ``judge_ratio`` 0.43, ``ratio_par`` 2.74. Re-run at 86b25b7
(2026-12-06, later: the sandbox's waits poll instead of select; one run, alone): ``ratio_seq`` 1.42 (repeats
1.31-1.49; 6.85 ms bare, 9.77 ms sandboxed), ``ratio_seq_cold`` 2.82, ``judge_ratio`` 0.40, ``ratio_par`` 2.83.

Where the time goes: a run inside a ready start is ~4.6-6 ms (``run_phases_ms``: fork and set-up
~1.7-2.2, the program ~2.2-3.0), about half of a bare ``python -S``; the start is made on the other core
by the pool: bwrap (namespaces and mounts, ~5-6 ms with the network namespace and seccomp, from
``ablation_ms``), then the supervisor's interpreter (``cpu_in_sandbox`` 11-13 ms of CPU from the
cgroup join on), ~2 ms to close. Sequential runs are bound by the CPU of two cores: 25-27 ms of CPU
per sandboxed run against 10.6-12.6 bare (``cpu_ms``). What changed since 2026-12-01 (ratio_seq
1.52-1.67 then): the run's child no longer tears down the interpreter at exit (Python's finalisation
freed every object the child shares with the supervisor page by page: ~3 ms of a ~5 ms run; it now
ends as ``python PROGRAM`` ends, tests/test_sandbox.py checks 17 endings against bare python), and the
start has no ``sh`` layer (bwrap's ``--info-fd``/``--block-fd`` let the host move its processes into
the cgroups).

Re-run at a345f38 (2026-12-06, later: seccomp also refuses the keyring calls, a private /dev/shm tmpfs, the pids
cgroup's headroom set once the supervisor is up; one run, quiet machine): ``ratio_seq`` 1.41 (repeats 1.29-1.57; 6.43
ms bare, 8.97 ms sandboxed; the spare-core regime), ``ratio_par`` 2.71 (2.44-2.76; the realistic one),
``ratio_seq_cold`` 2.72, ``judge_ratio`` 0.42.

At fc4d7a5 (2026-12-07, another machine (AMD EPYC): every site-packages directory under the bound roots an empty
mount, /etc 0755, umask 022 in the sandbox, seccomp refusing nested user namespaces and clone3; three runs, the last
two interleaved with two of 3f5064d's code from a worktree, alone): ``ratio_seq`` 1.60, 1.40, 1.58 against 1.44,
1.44 (bare 8.9-9.7 ms, sandboxed 13.2-15.4 ms); ``ratio_par`` 2.73, 2.71, 2.68 against 2.86, 2.58;
``ratio_seq_cold`` 2.80, 2.95, 3.44 against 2.91, 2.74; ``judge_ratio`` 0.40, 0.46, 0.43 against 0.41, 0.40. The
extra mounts may cost a few percent of a start; this machine's run-to-run noise is as large.
Re-run at bbe8685 (2026-12-07; alone, medians of five): ``ratio_seq`` 1.46, ``ratio_par`` 2.82, ``judge_ratio`` 0.41.
Re-run at 66ce378 (2026-12-07, a later session: a run's time and memory limits are checked before any run; alone,
medians of five): ``ratio_seq`` 1.44 (1.39-1.50), ``ratio_seq_cold`` 2.94, ``ratio_par`` 3.00 (2.22-3.00),
``judge_ratio`` 0.38.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.code import sandbox as sbx  # noqa: E402
from envs.code.judge import Judge, compare_output  # noqa: E402
from envs.code.sandbox import Sandbox, SandboxConfig  # noqa: E402

PROGRAM = "print(sum(range(10)))\n"
JUDGED = "n = int(input())\nprint(n * (n + 1) // 2)\n"


_CPUACCT: list[str] = []


def _own_cpuacct() -> str:
    """Move this process into a cgroup v1 cpuacct group of its own, when it may: the sandbox's
    run cgroups are made under it, and it counts all of their CPU, even after they are removed
    (rusage cannot: a pid namespace's processes are not reaped into our children's times)."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _hid, ctrls, path = line.split(":", 2)
        if "cpuacct" in ctrls.split(","):
            base = os.path.join("/sys/fs/cgroup/cpuacct", path.lstrip("/"))
            if not os.path.isdir(base):
                base = os.path.join("/sys/fs/cgroup/cpu,cpuacct", path.lstrip("/"))
            d = os.path.join(base, f"cascade-bench-{os.getpid()}")
            try:
                os.mkdir(d)
                with open(os.path.join(d, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            except OSError:
                return ""
            _CPUACCT[:] = [d, base]
            return d
    return ""


def _drop_cpuacct() -> None:
    """Move this process, and what it started that still lives (math-verify workers, sandbox starts
    kept ready), back to where they were, and remove the group."""
    if _CPUACCT:
        d, base = _CPUACCT
        for pid in [os.getpid(), *map(int, open(os.path.join(d, "cgroup.procs")).read().split())]:
            try:
                with open(os.path.join(base, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError:  # it ended meanwhile
                pass
        os.rmdir(d)


def _cpu() -> float:
    if _CPUACCT:
        with open(os.path.join(_CPUACCT[0], "cpuacct.usage")) as f:
            return int(f.read()) / 1e9
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def timed(fn, n: int, workers: int = 1, settle=None) -> tuple[float, float]:
    """(seconds per call, CPU seconds per call) over ``n`` calls after one warm-up call.

    ``settle`` (called after the timed calls, outside the wall time, inside the CPU time) ends
    the work still under way for these calls (the pool's starts), so their CPU is counted."""
    fn()
    c, t = _cpu(), time.perf_counter()
    if workers == 1:
        for _ in range(n):
            fn()
    else:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(lambda _: fn(), range(n)))
    wall = (time.perf_counter() - t) / n
    if settle is not None:
        settle()
    return wall, (_cpu() - c) / n


def summary(xs: list[float], nd: int = 2) -> dict:
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd)}


def ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 2)


def start_phases(sb: Sandbox, n: int) -> tuple[dict, dict]:
    """Medians of the phases of ``n`` cold sandbox starts, and of one run in a ready start."""
    starts, runs, closes = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        cell = sbx._Cell(sb)
        cell.put_files({"main.py": PROGRAM})
        v = sb._cell_run(cell, sbx.Run("main.py"), 10.0)
        assert v.status == "ok", v
        runs.append(dict(cell.run_phases))
        t = time.perf_counter()
        cell.close()
        closes.append(time.perf_counter() - t)
        starts.append(cell.phases)
    out = {k: ms([p[k] for p in starts]) for k in starts[0]}
    out["close"] = ms(closes)
    return out, {k: ms([p[k] for p in runs]) for k in runs[0]}


def ablation(sb: Sandbox, n: int) -> dict:
    """bwrap with /bin/true: its namespaces and mounts, then + network namespace, + seccomp; and
    python -S in it instead of /bin/true (the interpreter start)."""
    cfg = sb.config
    exe, prefix = sbx._python_install(cfg)
    box = tempfile.mkdtemp()
    os.chmod(box, 0o755)
    base = [sbx._bwrap(), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session"]
    if os.getuid() == 0:
        base += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
    else:
        base += ["--unshare-user"]
    binds = sbx._bind_args(exe, prefix, box, cfg.tmpfs_mb << 20, sb._bwrap_has_size()) + ["--mqueue", "/dev/mqueue"]
    env = {"PATH": "/usr/bin:/bin"}

    def run(argv, seccomp=False):
        fds = []
        if seccomp:
            r, w = os.pipe()
            os.write(w, sbx.seccomp_filter())
            os.close(w)
            fds = [r]
            argv = argv[:-1] + ["--seccomp", str(r), argv[-1]] if argv[-1] == "/bin/true" else argv
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, pass_fds=fds)
        for fd in fds:
            os.close(fd)

    def med(fn):
        fn()
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t)
        return ms(xs)

    out = {
        "true_bare": med(lambda: run(["/bin/true"])),
        "bwrap_mounts_pid_ipc_uts": med(lambda: run(base + binds + ["/bin/true"])),
        "bwrap_+net": med(lambda: run(base + ["--unshare-net"] + binds + ["/bin/true"])),
        "bwrap_+net_+seccomp": med(lambda: run(base + ["--unshare-net"] + binds + ["/bin/true"], seccomp=True)),
        "python_S_bare": med(lambda: run([exe, "-S", "-s", "-B", "-c", "pass"])),
        "bwrap_all_python_S": med(lambda: run(base + ["--unshare-net"] + binds + [exe, "-S", "-s", "-B", "-c", "pass"])),
    }
    os.rmdir(box)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40, help="runs per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tests", type=int, default=20, help="stdin tests of the judged program")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--warm", type=int, default=SandboxConfig().warm, help="sandbox starts kept ready")
    a = ap.parse_args()
    cpu_source = "cgroup cpuacct" if _own_cpuacct() else "rusage (misses the sandbox's pid namespace)"
    try:
        run(a, cpu_source)
    finally:
        _drop_cpuacct()


def run(a, cpu_source: str) -> None:
    sb = Sandbox(SandboxConfig(time_limit=10, warm=a.warm))
    cold = Sandbox(SandboxConfig(time_limit=10, warm=0))
    sb.check()
    exe, _ = sbx._python_install(sb.config)
    tests = [{"input": f"{i * 37 + 5}\n", "output": str((i * 37 + 5) * (i * 37 + 6) // 2)} for i in range(a.tests)]
    judge = Judge(sb)
    settle = sb.close  # the pool is made again by the next run
    with tempfile.TemporaryDirectory() as d:
        prog, judged = os.path.join(d, "prog.py"), os.path.join(d, "judged.py")
        with open(prog, "w") as f:
            f.write(PROGRAM)
        with open(judged, "w") as f:
            f.write(JUDGED)
        env = {"PATH": "/usr/bin:/bin"}

        def bare():
            r = subprocess.run([exe, "-S", "-s", "-B", prog], capture_output=True, env=env)
            assert r.stdout.strip() == b"45"

        def boxed(s=sb):
            v = s.run(PROGRAM)
            assert v.status == "ok" and v.stdout.strip() == "45", v

        def bare_judge():
            ok = 0
            for t in tests:
                r = subprocess.run([exe, "-S", "-s", "-B", judged], input=t["input"].encode(), capture_output=True,
                                   env=env, timeout=10)
                ok += r.returncode == 0 and compare_output(r.stdout.decode(), t["output"])
            assert ok == len(tests)

        def boxed_judge():
            j = judge.judge(JUDGED, tests)
            assert j.accepted, j

        out = {"benchmark": "sandbox", "n": a.n, "repeats": a.repeats, "tests": a.tests, "workers": a.workers,
               "warm": a.warm, "layers": [k for k, v in sb.layers.items() if v is None], "cpu_source": cpu_source}
        rows: dict[str, list] = {}
        for _ in range(a.repeats):
            nj = max(3, a.n // a.tests)
            for name, fn, n, w, st in (("bare_seq", bare, a.n, 1, None), ("sandbox_seq", boxed, a.n, 1, settle),
                                       ("sandbox_seq_cold", lambda: boxed(cold), a.n, 1, None),
                                       ("bare_par", bare, a.n, a.workers, None),
                                       ("sandbox_par", boxed, a.n, a.workers, settle),
                                       ("bare_judge", bare_judge, nj, 1, None),
                                       ("sandbox_judge", boxed_judge, nj, 1, settle)):
                rows.setdefault(name, []).append(timed(fn, n, w, st))
        wall = {k: [x[0] for x in v] for k, v in rows.items()}
        cpu = {k: [x[1] for x in v] for k, v in rows.items()}
        for label, num, den in (("ratio_seq", "sandbox_seq", "bare_seq"),
                                ("ratio_seq_cold", "sandbox_seq_cold", "bare_seq"),
                                ("ratio_par", "sandbox_par", "bare_par"),
                                ("judge_ratio", "sandbox_judge", "bare_judge")):
            out[label] = summary([s / b for s, b in zip(wall[num], wall[den])])
        out["ms_per_run"] = {k: ms(v) for k, v in wall.items() if "judge" not in k}
        out["ms_per_judgement"] = {k: ms(v) for k, v in wall.items() if "judge" in k}
        out["cpu_ms"] = {k: ms(v) for k, v in cpu.items()}
        out["start_phases_ms"], out["run_phases_ms"] = start_phases(cold, 15)
        out["ablation_ms"] = ablation(sb, 15)
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    sb.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
