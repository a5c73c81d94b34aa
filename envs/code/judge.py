"""Judge a Python or C++ program against tests, in the sandbox: all of a program's tests inside
one sandbox start (:meth:`Sandbox.run_many`), each test its own process with its own limits.

``language``: ``"python"`` (default) or ``"cpp"``. A C++ program is compiled once, inside the same
start and layers, under the compile limits (``SandboxConfig.compile_time_limit`` /
``compile_memory_mb``), then its binary runs each test under the run limits. A program that does
not compile gets ``compile_error`` on every test (``detail``: the compiler's message;
``Judgement.compile``: the compile step's status and figures). C++ takes stdin/stdout tests only.

Three kinds of test (a dict each; the kind is read from its keys):

- stdin/stdout: ``{"input": str, "output": str}``; outputs compared token by token (whitespace
  tolerant), numbers within ``float_tol`` when it is set.
- function call: ``{"fn": name, "args": [...], "kwargs": {...}, "expected": value}``; the arguments
  go to the sandbox as JSON (tuples arrive as lists, dict keys as strings; a set, or anything else
  JSON cannot carry, is refused with ``ValueError`` when the test is made); a harness
  inside the sandbox loads the program as a module, calls the function and prints the JSON of
  the return value after a per-run nonce (so that what the program prints itself is never taken
  for the result). The program runs in the harness's process, so one written to cheat can read the
  nonce from the harness's frame and print a result line of its own; that gains it nothing it could
  not have by returning the value, since the expected value never enters the sandbox. Sets (and
  frozensets) come back as sorted lists, and an expected set is compared as a set; a dict's keys
  come back as JSON writes them, and an expected dict's keys are compared so (``{10: 2}`` equals the
  result ``{"10": 2}``; a key JSON cannot hold, a tuple, comes back as its JSON text: ``{(1, 2): 3}``
  equals ``{"[1, 2]": 3}``); infinities and nan come back as such (JSON's extension); integers of any
  size come back whole (the host parses at most ``MAX_RESULT_DIGITS`` digits of integers longer
  than Python's default string-conversion limit, 4300 digits, per result).
- assertion (HumanEval style): ``{"code": str}``; the test code runs after the program in the
  same namespace; the test passes when it finishes (the harness prints the nonce at the very end,
  so a program that merely calls ``exit(0)`` early does not pass). The tests run in the program's own
  process, so a program written to cheat can read them and the nonce from the harness's frame, or
  replace ``exec``, and pass: judge with assertion tests only programs you trust (a reference, a
  validator's target). A policy's programs are scored on stdin/stdout or function-call tests (the code
  environments' seeds take stdin/stdout tests only), whose expected values never enter the sandbox.

The harnesses get the nonce and the call or the test code on stdin, so the sandbox holds no test
but the one running (expected outputs never enter it). Tests run one after another in the start;
no process, file or global of one test is left for the next.

Verdicts per test: accepted, wrong_answer, time_limit, memory_limit, runtime_error,
output_limit, compile_error (C++), and skipped (not run: stopped early or out of total time). A
test cut short by ``total_timeout`` while it ran is a time_limit whose ``detail`` says so (its
verdict's ``limits_hit``: ``total_time``, not ``wall_time``).
"""
from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from envs.code.sandbox import Run, Sandbox, SandboxConfig, Verdict, default_sandbox

__all__ = ["TestCase", "TestResult", "Judgement", "Judge", "compare_output", "compare_values",
           "TEST_STATUSES", "load_tests", "parse_result"]

TEST_STATUSES = ("accepted", "wrong_answer", "time_limit", "memory_limit", "runtime_error",
                 "output_limit", "compile_error", "skipped")

_SANDBOX_TO_TEST = {"time_limit": "time_limit", "memory_limit": "memory_limit",
                    "output_limit": "output_limit", "runtime_error": "runtime_error",
                    "killed": "runtime_error", "compile_error": "compile_error"}
_SOURCE = {"python": "main.py", "cpp": "main.cpp"}
MAX_RESULT_DIGITS = 100_000   # digits of long integers (over 4300 digits each) parsed per result line
_PLAIN_INT_DIGITS = 4000      # within Python's default int/str conversion limit (4300)


@dataclass
class TestCase:
    kind: str                       # "stdio" | "call" | "assert"
    input: str = ""
    output: str | None = None
    fn: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    expected: Any = None
    code: str = ""

    def __post_init__(self):
        if self.kind == "call":  # the arguments go to the sandbox as JSON: refuse what it cannot carry
            named = [(f"argument {i}", a) for i, a in enumerate(self.args)]
            for where, value in named + [(f"keyword argument {k!r}", v) for k, v in self.kwargs.items()]:
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as e:  # a set, an object; a cycle, an integer too long
                    raise ValueError(f"{where} of {self.fn!r} cannot be passed to the sandbox as JSON ({e}): "
                                     "use lists, dicts, str, int, float, bool or None (a list for a set)") from None

    @classmethod
    def from_dict(cls, d: dict | "TestCase") -> "TestCase":
        if isinstance(d, TestCase):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"a test must be a dict, not {type(d).__name__}")
        if "fn" in d:
            if "expected" not in d:
                raise ValueError(f"function-call test of {d['fn']!r} has no 'expected'")
            return cls("call", fn=str(d["fn"]), args=list(d.get("args", [])),
                       kwargs=dict(d.get("kwargs", {})), expected=d["expected"])
        if "code" in d:
            return cls("assert", code=str(d["code"]))
        if "output" in d:
            return cls("stdio", input=str(d.get("input", "")), output=str(d["output"]))
        raise ValueError(f"cannot tell the kind of test from keys {sorted(d)}: need 'output' (stdin/stdout), "
                         f"'fn' + 'expected' (function call) or 'code' (assertions)")


def load_tests(path: str) -> list[TestCase]:
    """Tests from a JSONL file (one test dict per line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(TestCase.from_dict(json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    if not out:
        raise ValueError(f"{path}: no tests")
    return out


@dataclass
class TestResult:
    index: int
    status: str
    time: float = 0.0
    detail: str = ""
    verdict: dict | None = None

    @property
    def passed(self) -> bool:
        return self.status == "accepted"


@dataclass
class Judgement:
    status: str                 # "accepted" or the status of the first failing test
    passed: int
    total: int
    results: list[TestResult]
    wall_time: float
    language: str = "python"
    compile: dict | None = None   # C++: the compile step (status, exit_code, wall/cpu time, peak memory)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def accepted(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fraction"] = self.fraction
        d["wall_time"] = round(self.wall_time, 4)
        return d


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------
_DECIMAL_TOKEN = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def _num(tok: str) -> float | None:
    """A token's value if it is a decimal number as programs print them (not ``1_000``, ``\u0661\u0660``, ``inf``,
    which Python's ``float()`` reads too)."""
    if not _DECIMAL_TOKEN.fullmatch(tok):
        return None
    v = float(tok)
    return v if math.isfinite(v) else None


def _close(a: float, b: float, tol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):  # an infinity equals itself only, nan nothing
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(b))


def compare_output(got: str, expected: str, float_tol: float | None = None) -> bool:
    """Token-wise equality (any whitespace); with ``float_tol``, numeric tokens may differ by
    ``float_tol`` absolute or relative (relative beyond magnitude 1)."""
    g, e = got.split(), expected.split()
    if len(g) != len(e):
        return False
    for a, b in zip(g, e):
        if a == b:
            continue
        if float_tol is None:
            return False
        x, y = _num(a), _num(b)
        if x is None or y is None or not _close(x, y, float_tol):
            return False
    return True


def _frozen(v: Any) -> Any:
    """A hashable form of a JSON-like value, equal where :func:`compare_values` (without a
    tolerance) finds equality: lists and tuples alike, bools apart from numbers."""
    if isinstance(v, bool):
        return (bool, v)
    if isinstance(v, (list, tuple)):
        return (list, tuple(_frozen(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return (set, frozenset(_frozen(x) for x in v))
    if isinstance(v, dict):
        return (dict, frozenset((_frozen(k), _frozen(x)) for k, x in v.items()))
    return v


def _same_set(got: Any, expected: set | frozenset, float_tol: float | None) -> bool:
    """``got`` (a list from the JSON of a set, or a set) holds exactly the elements of ``expected``."""
    if not isinstance(got, (list, tuple, set, frozenset)) or len(got) != len(expected):
        return False
    mine = [_frozen(x) for x in got]
    theirs = {_frozen(x) for x in expected}
    if len(set(mine)) == len(mine) and set(mine) == theirs:
        return True
    if float_tol is None or len(got) > 2000:
        return False
    left = list(expected)  # within the tolerance: each returned element matches a distinct expected one
    for g in got:
        k = next((i for i, e in enumerate(left) if compare_values(g, e, float_tol)), None)
        if k is None:
            return False
        left.pop(k)
    return True


def compare_values(got: Any, expected: Any, float_tol: float | None = None) -> bool:
    """Structural equality of JSON-like values (tuples as lists); floats within ``float_tol`` (an
    infinity equals only itself, nan nothing). An expected set or frozenset is compared as a set (the
    JSON of a returned set is a list); dict keys are compared as JSON writes them (``{10: 2}`` equals
    ``{"10": 2}``; ``True``, ``False``, ``None``: ``"true"``, ``"false"``, ``"null"``; a tuple: its JSON
    text, ``(1, 2)``: ``"[1, 2]"``)."""
    if isinstance(expected, (set, frozenset)):
        return _same_set(got, expected, float_tol)
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if float_tol is not None and (isinstance(got, float) or isinstance(expected, float)):
            return _close(float(got), float(expected), float_tol)
        return got == expected
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(compare_values(a, b, float_tol) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        g = {_json_key(k): v for k, v in got.items()}
        e = {_json_key(k): v for k, v in expected.items()}
        return g.keys() == e.keys() and all(compare_values(g[k], e[k], float_tol) for k in g)
    return got == expected


def _json_default(o: Any) -> Any:
    """What the call harness writes for a value JSON cannot hold (its ``enc``): a set as a sorted list, else repr."""
    if isinstance(o, (set, frozenset)):
        try:
            return sorted(o)
        except TypeError:  # elements of mixed types
            return sorted(o, key=repr)
    return repr(o)


def _json_key(k: Any) -> Any:
    """A dict key as JSON writes it (a returned dict comes back through JSON: its keys are strings);
    a key JSON cannot hold as a key (a tuple) as its JSON text, which is what the call harness writes
    for it (``(1, 2)``: ``"[1, 2]"``)."""
    if isinstance(k, str):
        return k
    if isinstance(k, bool) or k is None:
        return {True: "true", False: "false", None: "null"}[k]
    if isinstance(k, int):
        try:
            return int.__repr__(k)
        except ValueError:  # past the int/str conversion limit: no JSON text to compare with
            return k
    if isinstance(k, float):
        return ("NaN" if k != k else "Infinity" if k == math.inf else "-Infinity" if k == -math.inf
                else float.__repr__(k))
    try:
        return json.dumps(k, default=_json_default)
    except ValueError:  # an integer past the conversion limit in it: no JSON text to compare with
        return k


def parse_result(line: str) -> Any:
    """The value of a function-call test's result line (JSON). Integers longer than Python's default
    conversion limit (4300 digits) are read whole, up to ``MAX_RESULT_DIGITS`` digits of them in all
    (reading one costs time quadratic in its length); raises ``ValueError`` (not JSON, or longer
    integers) or ``RecursionError`` (nested too deep)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer past the conversion limit: read them whole, within a budget
        pass
    from decimal import Decimal

    left = [MAX_RESULT_DIGITS]

    def parse_int(s: str) -> int:
        if len(s) <= _PLAIN_INT_DIGITS:
            return int(s)
        left[0] -= len(s)
        if left[0] < 0:
            raise ValueError(f"the result holds more than {MAX_RESULT_DIGITS} digits of long integers")
        return int(Decimal(s))  # no conversion limit on this path

    return json.loads(line, parse_int=parse_int)


# --------------------------------------------------------------------------------------------
# harnesses (run inside the sandbox; the nonce comes on stdin before any untrusted code runs)
# --------------------------------------------------------------------------------------------
# the line the host reads goes to file descriptor 1 itself: the program may have replaced sys.stdout
_PUT = r"""
def _put(text):
    try:
        sys.stdout.flush()  # what the program printed comes first
    except Exception:
        pass
    data = text.encode()
    while data:
        data = data[os.write(1, data):]
"""

_CALL_HARNESS = r"""
import json, os, sys, runpy
def _main():
    nonce = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    ns = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "solution.py"),
                        run_name="solution")
    fn = ns.get(spec["fn"])
    if not callable(fn):
        raise SystemExit("cascade-judge: no function named %r" % spec["fn"])
    res = fn(*spec["args"], **spec["kwargs"])
    def enc(o):  # judge.py's _json_default
        if isinstance(o, (set, frozenset)):
            try:
                return sorted(o)
            except TypeError:  # elements of mixed types
                return sorted(o, key=repr)
        return repr(o)
    def keyed(o):  # a dict key JSON cannot hold (a tuple) as its JSON text, as the host compares it
        if isinstance(o, dict):
            return {k if k is None or isinstance(k, (str, int, float)) else json.dumps(k, default=enc): keyed(v)
                    for k, v in o.items()}
        return [keyed(x) for x in o] if isinstance(o, (list, tuple)) else o
    if hasattr(sys, "set_int_max_str_digits"):  # integers of any size, whole
        sys.set_int_max_str_digits(0)
    try:
        line = json.dumps(res, default=enc)
    except TypeError:  # such a key
        line = json.dumps(keyed(res), default=enc)
    _put("\n" + nonce + line + "\n")
""" + _PUT + "_main()\n"

_ASSERT_HARNESS = r"""
import json, os, sys
def _main():
    nonce = sys.stdin.readline().strip()
    tests = json.loads(sys.stdin.readline())
    here = os.path.dirname(os.path.abspath(__file__))
    g = {"__name__": "solution", "__builtins__": __builtins__}
    with open(os.path.join(here, "solution.py")) as f:
        exec(compile(f.read(), "solution.py", "exec"), g)
    exec(compile(tests, "tests.py", "exec"), g)
    _put("\n" + nonce + "\n")
""" + _PUT + "_main()\n"


_HARNESS_FILES = {"call": ("_judge_call.py", _CALL_HARNESS), "assert": ("_judge_assert.py", _ASSERT_HARNESS)}


class Judge:
    """Runs a program against tests, all of them in one sandbox start (see the module docstring),
    one after another. Safe to use from several threads at once (each judgement has its own start):
    that is how environments verify several responses at a time (``envs.base.verify_all``)."""

    def __init__(self, sandbox: Sandbox | None = None, *, time_limit: float | None = None,
                 memory_mb: int | None = None, float_tol: float | None = None):
        self.sandbox = sandbox or default_sandbox(SandboxConfig())
        self.time_limit = time_limit
        self.memory_mb = memory_mb
        self.float_tol = float_tol

    def _runs(self, program: str, cases: list[TestCase], time_limit: float | None, language: str = "python"):
        """The files of the session and, per test, its run and nonce."""
        if language not in _SOURCE:
            raise ValueError(f"unknown language {language!r}; choose from {', '.join(_SOURCE)}")
        if language != "python" and any(t.kind != "stdio" for t in cases):
            raise ValueError(f"{language} programs take stdin/stdout tests only (function-call and "
                             "assertion tests need Python)")
        main = _SOURCE[language]
        files = {main: program}
        runs, nonces = [], []
        for t in cases:
            nonce = secrets.token_hex(16)
            if t.kind == "stdio":
                runs.append(Run(main, t.input, (), time_limit, self.memory_mb, language))
            elif t.kind in _HARNESS_FILES:
                name, text = _HARNESS_FILES[t.kind]
                files[name] = text
                files["solution.py"] = program
                spec = (json.dumps({"fn": t.fn, "args": t.args, "kwargs": t.kwargs}) if t.kind == "call"
                        else json.dumps(t.code))
                runs.append(Run(name, f"{nonce}\n{spec}\n", (), time_limit, self.memory_mb))
            else:
                raise ValueError(f"unknown test kind {t.kind!r}")
            nonces.append(nonce)
        return files, runs, nonces

    def _grade(self, v: Verdict, test: TestCase, nonce: str, index: int) -> TestResult:
        vd = v.to_dict(excerpt=400)
        if v.status == "compile_error":
            return TestResult(index, "compile_error", 0.0, v.stderr[:2000], vd)
        if v.status != "ok":
            last = v.stderr.strip().rsplit("\n", 1)[-1][:200] if v.stderr.strip() else ""
            status = _SANDBOX_TO_TEST[v.status]
            if "total_time" in v.limits_hit:  # its own time limit was not reached: the judgement's was
                return TestResult(index, status, v.wall_time,
                                  f"out of total time: stopped after {v.wall_time:.2f} s, when the judgement's "
                                  f"total_timeout ran out", vd)
            if test.kind == "assert" and status == "runtime_error" and last.startswith("AssertionError"):
                status = "wrong_answer"  # a failed assertion of the tests is a wrong answer
            return TestResult(index, status, v.wall_time, last, vd)
        if test.kind == "stdio":
            ok = compare_output(v.stdout, test.output or "", self.float_tol)
            detail = "" if ok else "output differs"
        elif test.kind == "call":
            lines = [ln[len(nonce):] for ln in v.stdout.splitlines() if ln.startswith(nonce)]
            if not lines:
                return TestResult(index, "runtime_error", v.wall_time, "no result (the function did not return)", vd)
            try:
                got = parse_result(lines[-1])
            except (ValueError, RecursionError) as e:  # not JSON, too deep, or too long integers
                why = "result not JSON" if isinstance(e, json.JSONDecodeError) else f"result not parsed: {e}"
                return TestResult(index, "runtime_error", v.wall_time, why[:200], vd)
            try:
                ok = compare_values(got, test.expected, self.float_tol)
            except (RecursionError, OverflowError):  # too deep, or an integer beyond any float compared with one
                ok = False
            detail = "" if ok else f"returned {lines[-1][:100]}"
        else:
            ok = any(ln == nonce for ln in v.stdout.splitlines())
            detail = "" if ok else "tests did not run to completion"
            if not ok:
                return TestResult(index, "runtime_error", v.wall_time, detail, vd)
        return TestResult(index, "accepted" if ok else "wrong_answer", v.wall_time, detail, vd)

    def judge(self, program: str, tests: list, *, stop_on_failure: bool = False,
              total_timeout: float | None = None, time_limit: float | None = None,
              language: str = "python") -> Judgement:
        """Run every test, one after another inside one sandbox start; stop at the first failure if
        asked; bound the whole judgement by ``total_timeout`` seconds (tests not started in time,
        or after a failure that stopped the judgement, are ``skipped``). ``language="cpp"``: C++
        source, compiled first in the same start (a compile error fails every test)."""
        cases = [TestCase.from_dict(t) for t in tests]
        t0 = time.monotonic()
        deadline = t0 + total_timeout if total_timeout is not None else None
        per_test = time_limit if time_limit is not None else (self.time_limit or self.sandbox.config.time_limit)
        results: list[TestResult | None] = [None] * len(cases)
        stopped = []
        compiled: list[dict] = []
        if cases:
            files, runs, nonces = self._runs(program, cases, per_test, language)

            def graded(i: int, v: Verdict) -> bool:
                if v.compile is not None and not compiled:
                    compiled.append(v.compile)
                results[i] = r = self._grade(v, cases[i], nonces[i], i)
                if stop_on_failure and not r.passed:
                    stopped.append(i)
                    return False
                return True

            self.sandbox.run_many(files, runs, deadline=deadline, on_verdict=graded)
        elif language not in _SOURCE:
            raise ValueError(f"unknown language {language!r}; choose from {', '.join(_SOURCE)}")
        why = "stopped after a failure" if stopped else "out of total time"
        done = [r if r is not None else TestResult(i, "skipped", detail=why) for i, r in enumerate(results)]
        passed = sum(r.passed for r in done)
        first_bad = next((r for r in done if not r.passed and r.status != "skipped"), None)
        if first_bad is None:
            first_bad = next((r for r in done if not r.passed), None)
        status = "accepted" if passed == len(cases) and cases else (first_bad.status if first_bad else "skipped")
        return Judgement(status, passed, len(cases), done, time.monotonic() - t0, language,
                         compiled[0] if compiled else None)
