"""Many runs inside one sandbox start (the supervisor): each run keeps its own limits and verdict
when others kill, hang, fork or flood; nothing of a run (file, process, global, IPC object) is seen
by the next; the judge runs a program's tests in one start; a start is never reused by a second
session; a start lost in the middle of a session does not cost the remaining runs."""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

from envs.code import judge as jdg
from envs.code import sandbox as sbx
from envs.code.judge import Judge, compare_output, compare_values
from envs.code.sandbox import Run, Sandbox, SandboxConfig
from tests.conftest import assert_no_processes_of

# a uid of our own, so that concurrent test sessions' sandboxes are not taken for our leftovers
UID = 57000 + os.getpid() % 4000
CFG = SandboxConfig(time_limit=2.0, memory_mb=256, output_limit_bytes=1 << 20, max_processes=16, uid=UID, gid=UID,
                    warm=1)
LAYERS = sbx.detect_layers(CFG)
pytestmark = pytest.mark.skipif(
    LAYERS["namespaces"] is not None, reason=f"sandbox needs bubblewrap: {LAYERS['namespaces']}")

# which start a run ran in: its namespaces and the start time of the start's pid 1 (a namespace's inode number
# can be reused by a start made after an earlier one ended)
NS = ("import os\nprint(os.readlink('/proc/self/ns/pid'), os.readlink('/proc/self/ns/net'),\n"
      "      open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19])\n")

# one program, many behaviours: what it does is read from stdin
MIXED = r"""
import os, sys, time
cmd = sys.stdin.readline().strip()
ns = os.readlink("/proc/self/ns/pid") + os.readlink("/proc/self/ns/net")
if cmd == "kill":
    try:
        os.kill(os.getppid(), 9)          # the supervisor: not ours to signal
        r = "sent"
    except OSError as e:
        r = type(e).__name__
    os.kill(-1, 9)                        # everything it may signal: nothing but itself
    print(r, ns, flush=True)
    os.kill(os.getpid(), 9)
elif cmd == "hang":
    time.sleep(100)
elif cmd == "fork":
    while True:
        try:
            os.fork()
        except OSError:
            pass
elif cmd == "mem":
    x = [bytearray(16 << 20) for _ in range(64)]
elif cmd == "spam":
    while True:
        print("y" * 100)
elif cmd == "caps":
    st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    print(os.getuid(), os.geteuid(), *(int(st[k].strip(), 16) for k in ("CapPrm", "CapEff", "CapAmb")),
          st["NoNewPrivs"].strip())
else:
    print(int(cmd) * 2, ns)
"""


@pytest.fixture(scope="module")
def sb():
    s = Sandbox(CFG)
    s.check()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert_no_processes_of(UID)


def test_hostile_runs_among_passing_ones_keep_their_own_verdicts(sb):
    cmds = ["1", "kill", "2", "hang", "3", "fork", "4", "mem", "5", "spam", "6", "caps", "7"]
    limits = {"hang": 1.0, "fork": 1.5}
    runs = [Run("main.py", c + "\n", time_limit=limits.get(c)) for c in cmds]
    t = time.monotonic()
    vs = sb.run_many({"main.py": MIXED}, runs)
    assert time.monotonic() - t < 20
    by = dict(zip(cmds, vs))
    good = [by[c] for c in cmds if c.isdigit()]
    assert [v.status for v in good] == ["ok"] * 7, [(v.status, v.stderr[-200:]) for v in good]
    assert [v.stdout.split()[0] for v in good] == [str(2 * int(c)) for c in cmds if c.isdigit()]
    # all of them in one start: the same pid and network namespaces
    spaces = {v.stdout.split()[1] for v in good} | {by["kill"].stdout.split()[1]}
    assert len(spaces) == 1, spaces
    assert by["kill"].status == "killed" and by["kill"].signal == 9
    assert by["kill"].stdout.split()[0] == "PermissionError"
    assert by["hang"].status == "time_limit" and "wall_time" in by["hang"].limits_hit
    assert 0.9 <= by["hang"].wall_time < 3.0
    assert by["fork"].status == "time_limit" and "processes" in by["fork"].limits_hit
    assert by["mem"].status == "memory_limit"
    assert by["spam"].status == "output_limit" and len(by["spam"].stdout) <= CFG.output_limit_bytes + (1 << 16)
    # a run holds no capability and cannot gain one; it runs as the sandbox uid
    assert by["caps"].stdout.split() == [str(UID), str(UID), "0", "0", "0", "1"]
    # each run has its own figures
    assert all(v.peak_memory_bytes and v.peak_memory_bytes < 200 << 20 for v in good)
    assert all(v.wall_time < 1.0 for v in good)


WRITER = r"""
import builtins, ctypes, json, os, signal, sys, time
open("/tmp/leak.txt", "w").write("secret")
os.makedirs("/tmp/d/e/f")
open("/tmp/d/e/f/g", "w").write("y")
os.mkdir("/tmp/locked")
open("/tmp/locked/z", "w").write("z")
os.chmod("/tmp/locked", 0)
os.mkfifo("/tmp/fifo")
os.symlink("/etc/hostname", "/tmp/link")
open("here.txt", "w").write("cwd")
builtins.LEAK = json.LEAK = sys.LEAK = 1
os.environ["LEAK"] = "1"
sys.setrecursionlimit(77)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
libc = ctypes.CDLL(None, use_errno=True)
print("shm", libc.shmget(0x5EED, 4096, 0o1666) >= 0)
# mode 0: "ipcrm --all" finds objects by *_STAT, which needs read permission; they survived into the next run
print("ipc0", libc.shmget(0x5EEE, 4096, 0o1000) >= 0 and libc.msgget(0x5EEF, 0o1000) >= 0
      and libc.semget(0x5EF0, 1, 0o1000) >= 0)
libc.mq_open.restype = ctypes.c_int
print("mq", libc.mq_open(b"/leak", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0)
if os.fork() == 0:  # a daemon that would write after the run
    os.setsid()
    time.sleep(0.4)
    open("/tmp/late.txt", "w").write("late")
    os._exit(0)
os.umask(0o777)
"""

READER = r"""
import builtins, ctypes, json, os, signal, sys, time
time.sleep(0.6)
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
print(json.dumps({
    "tmp": sorted(os.listdir("/tmp")), "cwd": os.getcwd(),
    "globals": [hasattr(builtins, "LEAK"), hasattr(json, "LEAK"), hasattr(sys, "LEAK"), "LEAK" in os.environ],
    "recursion": sys.getrecursionlimit(), "umask": os.umask(0o022),
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "shm": libc.shmget(0x5EED, 0, 0) >= 0, "mq": libc.mq_open(b"/leak", os.O_RDONLY) >= 0,
    "mqueue": os.listdir("/dev/mqueue"),
    "sysvipc": sum(len(open(f"/proc/sysvipc/{k}").read().splitlines()) - 1 for k in ("shm", "msg", "sem")),
}))
"""


def test_nothing_of_a_run_is_seen_by_the_next(sb):
    vs = sb.run_many({"w.py": WRITER, "r.py": READER, "ns.py": NS},
                     [Run("ns.py"), Run("w.py"), Run("r.py"), Run("ns.py")])
    assert [v.status for v in vs] == ["ok"] * 4, [v.stderr[-300:] for v in vs]
    assert vs[0].stdout == vs[3].stdout  # one start for the whole session
    assert vs[1].stdout.split() == ["shm", "True", "ipc0", "True", "mq", "True"]  # the writer did create them
    got = json.loads(vs[2].stdout)
    assert got == {"tmp": [], "cwd": "/tmp", "globals": [False] * 4, "recursion": 1000, "umask": 0o022,
                   "sigterm": True, "shm": False, "mq": False, "mqueue": [], "sysvipc": 0}


CALLS = "seen = []\ndef f(x):\n    seen.append(x)\n    return [x, len(seen)]\n"


def test_judge_runs_a_program_in_one_start_with_per_test_verdicts(sb):
    prog = MIXED.replace("print(int(cmd) * 2, ns)", "print(int(cmd) * 2)")
    tests = [{"input": f"{c}\n", "output": str(2 * int(c)) if c.isdigit() else "0"}
             for c in ["1", "kill", "2", "hang", "3", "fork", "4"]]
    j = Judge(sb, time_limit=1.0).judge(prog, tests)
    assert [r.status for r in j.results] == ["accepted", "runtime_error", "accepted", "time_limit", "accepted",
                                             "time_limit", "accepted"]
    assert j.passed == 4 and j.status == "runtime_error"
    # function-call tests: a global of one call is not seen by the next
    j = Judge(sb).judge(CALLS, [{"fn": "f", "args": [i], "expected": [i, 1]} for i in range(4)])
    assert j.accepted, [(r.status, r.detail) for r in j.results]
    # assertion tests: the sandbox holds the running test only (its code comes on stdin)
    add = "def add(a, b):\n    return a + b\n"
    look = "import os\nassert not any('SECRET' in open('/box/' + n).read() for n in os.listdir('/box'))"
    j = Judge(sb).judge(add, [{"code": "assert add(2, 2) == 4  # SECRET"}, {"code": look}])
    assert j.accepted, [(r.status, r.detail) for r in j.results]


def test_a_start_serves_one_session_only(sb):
    a, b = sb.run(NS), sb.run(NS)
    assert a.status == b.status == "ok" and a.stdout != b.stdout


def test_a_start_lost_mid_session_costs_no_run(monkeypatch):
    cells = []
    init = sbx._Cell.__init__

    def record(self, s):
        init(self, s)
        cells.append(self)

    monkeypatch.setattr(sbx._Cell, "__init__", record)
    s = Sandbox(replace(CFG, warm=0))

    def lose_it(i, v):
        if i == 0:  # the whole start goes (bwrap and everything in it), between two runs
            os.killpg(cells[-1].proc.pid, 9)
        return True

    vs = s.run_many({"main.py": NS}, [Run(), Run(), Run()], on_verdict=lose_it)
    assert [v.status for v in vs] == ["ok"] * 3
    assert vs[0].stdout != vs[1].stdout == vs[2].stdout and len(cells) == 2
    # stopping early: the runs after it are not run
    vs = s.run_many({"main.py": NS}, [Run(), Run(), Run()], on_verdict=lambda i, v: i < 1)
    assert [v is not None for v in vs] == [True, True, False]


def test_every_process_of_a_start_is_in_its_cgroup(sb):
    """bwrap, its sandbox child and the supervisor all sit in the start's cgroup(s) (joined while
    bwrap holds the child, before anything of the supervisor runs)."""
    cell = sbx._Cell(sb)
    try:
        assert cell.cgroup is not None
        tree, todo = set(), [cell.proc.pid]
        while todo:  # bwrap's process tree on the host
            p = todo.pop()
            tree.add(p)
            try:
                kids = open(f"/proc/{p}/task/{p}/children").read().split()
            except OSError:
                kids = []
            todo += [int(k) for k in kids]
        assert len(tree) >= 3  # bwrap, its child (the pid namespace's init), the supervisor
        for f in cell.cgroup.procs_files():
            assert tree <= {int(x) for x in open(f).read().split()}, f
    finally:
        cell.close()


SETS_AND_BIG_INTS = """
def primes(n):
    return {p for p in range(2, n) if all(p % d for d in range(2, p))}
def pairs(n):
    return frozenset((i, -i) for i in range(n))
def fact(n):
    r = 1
    for i in range(2, n + 1):
        r *= i
    return r
"""


def test_function_results_sets_and_long_integers_compare_as_values(sb):
    """A returned set is sorted by value (not by repr: [11, 2, 3, ...]) and compared as a set when a set
    is expected; an integer past Python's 4300-digit conversion limit comes back whole."""
    import math

    tests = [{"fn": "primes", "args": [12], "expected": [2, 3, 5, 7, 11]},
             {"fn": "primes", "args": [12], "expected": {2, 3, 5, 7, 11}},
             {"fn": "pairs", "args": [3], "expected": {(0, 0), (1, -1), (2, -2)}},
             {"fn": "fact", "args": [2000], "expected": math.factorial(2000)},
             {"fn": "primes", "args": [12], "expected": {2, 3, 5, 7}},
             {"fn": "fact", "args": [2000], "expected": math.factorial(2000) + 1}]
    j = Judge(sb).judge(SETS_AND_BIG_INTS, tests)
    assert [r.status for r in j.results] == ["accepted"] * 4 + ["wrong_answer"] * 2, \
        [(r.status, r.detail) for r in j.results]


FAKE_RESULT = """
import sys, os
def f(x):
    nonce = sys._getframe(1).f_locals["nonce"]   # the harness's own local
    sys.stdout.write("\\n" + nonce + {payload} + "\\n")
    sys.stdout.flush()
    os._exit(0)
"""


def test_a_result_line_the_host_cannot_parse_is_a_verdict_not_a_crash(sb):
    """A program may write a result line of its own (it can read the nonce); one the host's JSON parser
    refuses (an integer of a million digits, nesting 100000 deep) is the test's runtime error."""
    for payload in ("'1' * 1000000", "'[' * 100000", "'{'"):
        j = Judge(sb).judge(FAKE_RESULT.format(payload=payload), [{"fn": "f", "args": [1], "expected": 1}])
        assert j.status == "runtime_error" and j.results[0].detail.startswith("result not"), j.results[0]


POOL = """
import sys
from multiprocessing import Pool
def sq(x):
    return x * x
if __name__ == "__main__":
    with Pool(2) as p:
        print(sum(p.map(sq, range(int(sys.stdin.read())))))
"""

SHM = r"""
import os, sys
if sys.argv[1] == "fill":  # /dev/shm is capped at tmpfs_mb
    n = 0
    try:
        for i in range(64):
            with open(f"/dev/shm/f{i}", "wb") as f:
                for _ in range(8):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    n += 1
    except OSError as e:
        print("stopped", e.errno)
    print(n)
elif sys.argv[1] == "write":
    open("/dev/shm/left", "w").write("x")
    print(oct(os.stat("/dev/shm").st_mode & 0o7777))
else:
    print(os.listdir("/dev/shm"))
"""


def test_multiprocessing_works_and_dev_shm_is_private_capped_and_emptied(sb):
    """/dev/shm is a private tmpfs (1777, capped like /tmp) where multiprocessing's semaphores live; what one
    run leaves there is gone for the next."""
    capped = sb._bwrap_has_size()  # (an old bwrap without --size: the cgroup alone bounds it)
    runs = [Run("pool.py", "10"), Run("shm.py", args=("write",)), Run("shm.py", args=("list",))]
    runs += [Run("shm.py", args=("fill",)), Run("shm.py", args=("list",))] if capped else []
    vs = sb.run_many({"pool.py": POOL, "shm.py": SHM}, runs)
    assert [v.status for v in vs] == ["ok"] * len(runs), [v.stderr[-300:] for v in vs]
    assert vs[0].stdout == "285\n"
    assert vs[1].stdout == "0o1777\n" and vs[2].stdout == "[]\n"
    if capped:
        stopped, n = vs[3].stdout.split("\n")[:2]
        assert stopped == "stopped 28" and CFG.tmpfs_mb - 2 <= int(n) <= CFG.tmpfs_mb, vs[3].stdout  # ENOSPC
        assert vs[4].stdout == "[]\n"


def test_a_run_cut_by_the_total_budget_says_so(sb):
    """A test cut short by total_timeout did not exceed its own time limit: limits_hit names total_time."""
    prog = "import time\ntime.sleep(0.9)\nprint(input())\n"
    j = Judge(sb).judge(prog, [{"input": "1", "output": "1"}, {"input": "2", "output": "2"}, {"input": "3", "output": "3"}],
                        time_limit=2.0, total_timeout=1.5)
    first, cut, skipped = j.results
    assert first.status == "accepted" and skipped.status == "skipped", j.results
    assert cut.status == "time_limit" and cut.detail.startswith("out of total time"), cut
    assert cut.verdict["limits_hit"] == ["total_time"] and cut.time < 1.0
    v = sb.run_many({"m.py": "import time\ntime.sleep(5)\n"}, [Run("m.py", time_limit=3.0)],
                    deadline=time.monotonic() + 0.5)[0]
    assert v.status == "time_limit" and v.limits_hit == ["total_time"]


def test_answers_that_made_the_judge_raise_are_verdicts(sb):
    """A function returning an integer beyond any float, compared with a float expected value, raised
    OverflowError out of Judge.judge; a lone surrogate in a program or its stdin raised UnicodeEncodeError."""
    j = Judge(sb, float_tol=1e-6)
    for code, expected in (("def f():\n    return 10**400\n", 1.5), ("def f():\n    return [10**400]\n", [1.5])):
        assert j.judge(code, [{"fn": "f", "args": [], "expected": expected}]).status == "wrong_answer"
    assert sb.run("print('\ud800')\n").status != "ok"
    assert sb.run("import sys\nprint(len(sys.stdin.buffer.read()))\n", "a\ud800").stdout.strip() == "4"


def test_infinities_compare_with_a_tolerance():
    """With float_tol, inf never equalled inf (inf - inf is nan), and any finite number equalled an
    infinity (|x - inf| <= tol * inf); each infinity equals itself only, and nan nothing (as without)."""
    inf, nan = float("inf"), float("nan")
    assert compare_values(inf, inf, 1e-6) and compare_values(-inf, -inf, 1e-6)
    assert compare_values([1.0, -inf], [1.0, -inf], 1e-9) and compare_values(inf, inf)
    assert not compare_values(inf, -inf, 1e-6) and not compare_values(-inf, inf, 1e-6)
    assert not compare_values(5.0, inf, 1e-6) and not compare_values(inf, 1e308, 1e-6)
    assert not compare_values(1e308, -1e308, 1e-6)
    assert not compare_values(nan, nan, 1e-6) and not compare_values(nan, nan) and not compare_values(1.0, nan, 1e-6)
    assert compare_values(1.0 + 1e-9, 1.0, 1e-6) and not compare_values(1.1, 1.0, 1e-6)
    assert compare_output("inf 1", "inf 1.0000001", 1e-6) and not compare_output("5", "inf", 1e-6)


INF_AND_DICTS = """
def dist(a, b):
    return float("inf") if a != b else 0.0
def freq(xs):
    d = {}
    for x in xs:
        d[x] = d.get(x, 0) + 1
    return d
def size(s):
    return len(s)
"""


def test_function_results_infinity_and_dicts_with_non_string_keys(sb):
    """A returned infinity matches an expected one under float_tol; a dict's keys come back as JSON has
    them (strings), so an expected dict is compared with its keys as JSON writes them ({10: 2} is
    {"10": 2}; True, False, None: "true", "false", "null")."""
    tests = [{"fn": "dist", "args": [1, 2], "expected": float("inf")},
             {"fn": "dist", "args": [1, 1], "expected": 0.0},
             {"fn": "freq", "args": [[10, 10, 20]], "expected": {10: 2, 20: 1}},
             {"fn": "freq", "args": [[1.5, True, None]], "expected": {1.5: 1, True: 1, None: 1}},
             {"fn": "freq", "args": [["a", "a"]], "expected": {"a": 2}},
             {"fn": "freq", "args": [[10, 10, 20]], "expected": {10: 2, 21: 1}},
             {"fn": "freq", "args": [[10]], "expected": {11: 1}},
             {"fn": "dist", "args": [1, 2], "expected": -float("inf")}]
    j = Judge(sb, float_tol=1e-6).judge(INF_AND_DICTS, tests)
    assert [r.status for r in j.results] == ["accepted"] * 5 + ["wrong_answer"] * 3, \
        [(r.status, r.detail) for r in j.results]
    assert compare_values({"10": 2, "true": 1}, {10: 2, True: 1}) and not compare_values({"10": 2}, {10.0: 2})
    assert compare_values({"1.5": [1.0]}, {1.5: [1.0 + 1e-9]}, 1e-6)


TUPLE_KEYS = """
def pairs(xs):
    out = {}
    for k in zip(xs, xs[1:]):
        out[k] = out.get(k, 0) + 1
    return out
def nested():
    return {"a": [{(1, (2, True)): None, 3: "x"}], (None, 1.5): frozenset({2, 1})}
def wrong():
    return {(2, 1): 2}
"""


def test_function_results_dicts_with_tuple_keys(sb):
    """A returned dict with tuple keys made the harness's json.dumps raise (a runtime error for a correct
    function); such a key comes back as its JSON text, which is how an expected tuple key is compared."""
    tests = [{"fn": "pairs", "args": [[1, 2, 1]], "expected": {(1, 2): 1, (2, 1): 1}},
             {"fn": "pairs", "args": [[1, 2, 1, 2]], "expected": {(1, 2): 2, (2, 1): 1}},
             {"fn": "nested", "args": [], "expected": {"a": [{(1, (2, True)): None, 3: "x"}], (None, 1.5): {1, 2}}},
             {"fn": "pairs", "args": [[1, 2, 1, 2]], "expected": {(1, 2): 3, (2, 1): 1}},
             {"fn": "wrong", "args": [], "expected": {(1, 2): 2}},
             {"fn": "pairs", "args": [[1, 2]], "expected": {(1, 2, 3): 1}}]
    j = Judge(sb).judge(TUPLE_KEYS, tests)
    assert [r.status for r in j.results] == ["accepted"] * 3 + ["wrong_answer"] * 3, \
        [(r.status, r.detail) for r in j.results]
    assert compare_values({(1, 2): 2}, {(1, 2): 2}) and not compare_values({(1, 2): 2}, {(2, 1): 2})


STDOUT_REPLACED = """
import io, sys
print("not the result")
sys.stdout = {stdout}
def f(x):
    return x + 1
"""


def test_a_program_that_replaces_sys_stdout_still_has_its_result_read(sb):
    """The harness wrote its result line to sys.stdout, which the program may replace at module level
    (sys.stdout = io.StringIO()): a correct function had "no result". The line goes to file descriptor 1."""
    tests = [{"fn": "f", "args": [1], "expected": 2}, {"fn": "f", "args": [1], "expected": 3},
             {"code": "assert f(1) == 2"}, {"code": "assert f(1) == 3"}]
    for stdout in ("io.StringIO()", "None"):
        j = Judge(sb).judge(STDOUT_REPLACED.format(stdout=stdout), tests)
        assert [r.status for r in j.results] == ["accepted", "wrong_answer"] * 2, \
            (stdout, [(r.status, r.detail) for r in j.results])


def test_arguments_json_cannot_carry_are_refused_up_front(sb):
    """A set among a function-call test's arguments made the judge raise TypeError out of json.dumps; the
    arguments go to the sandbox as JSON, so the test is refused when made, naming the argument."""
    with pytest.raises(ValueError, match=r"argument 0 of .size. cannot be passed.*type set"):
        Judge(sb).judge(INF_AND_DICTS, [{"fn": "size", "args": [{1, 2, 3}], "expected": 3}])
    with pytest.raises(ValueError, match=r"keyword argument .s. of .size.*type frozenset"):
        jdg.TestCase.from_dict({"fn": "size", "kwargs": {"s": frozenset({1})}, "expected": 1})
    with pytest.raises(ValueError, match=r"argument 1 of .f.*type object"):
        jdg.TestCase("call", fn="f", args=[1, [object()]], expected=1)
    j = Judge(sb).judge(INF_AND_DICTS, [{"fn": "size", "args": [[1, 2, 3]], "expected": 3}])
    assert j.status == "accepted"
