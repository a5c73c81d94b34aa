"""Seeds, judge and code environments: every seed's reference passes its tests and each wrong
solution fails one; the judge's test kinds and limits; each code environment's self-check."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from envs.base import get_env
from envs.check import self_check
from envs.code import sandbox as sbx
from envs.code.envs import extract_code, extract_program
from envs.code.judge import Judge, compare_output, compare_values
from envs.code.seeds import Seed, builtin_seeds, load_seeds

pytestmark = pytest.mark.skipif(sbx.detect_layers()["namespaces"] is not None,
                                reason="the code sandbox needs bubblewrap")

SEEDS = builtin_seeds()


@pytest.fixture(scope="module")
def judge() -> Judge:
    return Judge(sbx.default_sandbox(sbx.SandboxConfig(time_limit=5.0)))


def test_at_least_30_seeds_with_the_full_schema():
    assert len(SEEDS) >= 30
    assert len({s.id for s in SEEDS}) == len(SEEDS)
    for s in SEEDS:
        assert s.statement and s.input_spec and s.output_spec and s.validator and s.wrong
        assert len(s.tests) >= 4, s.id
    assert {s.difficulty for s in SEEDS} == {1, 2, 3}


def test_every_reference_passes_and_every_wrong_fails(judge):
    def one(s: Seed):
        ref = judge.judge(s.reference, s.tests, time_limit=5.0)
        wrong = [judge.judge(w, s.tests, stop_on_failure=True, time_limit=5.0).accepted for w in s.wrong]
        return s.id, ref, wrong

    with ThreadPoolExecutor(2) as ex:
        out = list(ex.map(one, SEEDS))
    for sid, ref, wrong in out:
        assert ref.accepted, (sid, [(r.index, r.status, r.detail) for r in ref.results if not r.passed])
        assert not any(wrong), f"{sid}: a wrong solution passes every test"


_VALIDATE_ALL = r"""
import io, json, sys
inputs = json.loads(sys.stdin.read())
src = open("/box/validator.py").read()
res = []
for text in inputs:
    sys.stdin = io.StringIO(text)
    try:
        exec(compile(src, "validator.py", "exec"), {"__name__": "__main__"})
        res.append(True)
    except SystemExit as e:
        res.append(e.code in (None, 0))
    except Exception:
        res.append(False)
print(json.dumps(res))
"""


def test_validators_accept_every_test_input_and_reject_garbage(judge):
    def one(s: Seed):
        inputs = [t["input"] for t in s.tests] + ["?-?\n", ""]
        v = judge.sandbox.run(_VALIDATE_ALL, json.dumps(inputs), files={"validator.py": s.validator})
        assert v.status == "ok", (s.id, v.stderr)
        return s.id, json.loads(v.stdout)

    with ThreadPoolExecutor(2) as ex:
        for sid, res in ex.map(one, SEEDS):
            assert all(res[:-2]), f"{sid}: validator rejects a test input: {res}"
            assert res[-2:] == [False, False], f"{sid}: validator accepts garbage or empty input"


def test_compare_helpers():
    assert compare_output("1 2\n3\n", "1  2 3")
    assert not compare_output("1 2", "1 2 3")
    assert not compare_output("0.3333", "0.333333")
    assert compare_output("0.3333", "0.333333", float_tol=1e-3)
    assert not compare_output("abc", "abd", float_tol=1.0)
    assert compare_values((1, [2.0, "a"]), [1, [2, "a"]])
    assert not compare_values(True, 1) and not compare_values([1], [1, 2])
    assert compare_values({"x": 0.1 + 0.2}, {"x": 0.3}, float_tol=1e-9)


def test_judge_function_call_and_assertion_tests(judge):
    prog = "def f(x, y=1):\n    return [x * y, x / 2]\n\nif __name__ == '__main__':\n    print('not run')\n"
    j = judge.judge(prog, [{"fn": "f", "args": [3], "expected": [3, 1.5]},
                           {"fn": "f", "args": [3], "kwargs": {"y": 2}, "expected": [6, 1.5]},
                           {"fn": "f", "args": [1], "expected": [2, 0.5]},
                           {"fn": "g", "args": [], "expected": None}])
    assert [r.status for r in j.results] == ["accepted", "accepted", "wrong_answer", "runtime_error"]
    assert j.passed == 2 and j.status == "wrong_answer"
    # a printed line that looks like a result cannot fake one: the nonce is unknown to the program
    fake = "import sys\ndef f():\n    print('\\n[5]')\n    return 4\n"
    assert judge.judge(fake, [{"fn": "f", "expected": [5]}]).status == "wrong_answer"
    add = "def add(a, b):\n    return a + b\n"
    j = judge.judge(add, [{"code": "assert add(1, 2) == 3"}, {"code": "assert add(1, 2) == 4"},
                          {"code": "add(1)"}])
    assert [r.status for r in j.results] == ["accepted", "wrong_answer", "runtime_error"]
    # exiting early with status 0 does not pass the tests
    cheat = "import os\nos._exit(0)\n" + add
    assert judge.judge(cheat, [{"code": "assert add(1, 2) == 3"}]).status == "runtime_error"
    cheat2 = add + "import sys\nsys.exit(0)\n"
    assert judge.judge(cheat2, [{"code": "assert add(1, 2) == 4"}]).status == "runtime_error"


def test_judge_stdio_limits_early_stop_and_total_time(judge):
    tests = [{"input": f"{i}\n", "output": str(2 * i)} for i in range(4)]
    assert judge.judge("print(2 * int(input()))", tests).accepted
    j = judge.judge("import time\ntime.sleep(10)", tests, stop_on_failure=True, time_limit=0.5)
    assert j.status == "time_limit" and j.passed == 0
    assert sum(r.status == "skipped" for r in j.results) >= 1 and j.wall_time < 4
    j = judge.judge("x = bytearray(1 << 40)", tests[:1])
    assert j.status == "memory_limit"
    j = judge.judge("while True:\n    print('y' * 100)", tests[:1], time_limit=3.0)
    assert j.status == "output_limit"
    j = judge.judge("import time\ntime.sleep(0.4)\nprint(2 * int(input()))", tests, total_timeout=1.0)
    assert 1 <= j.passed < 4 and j.results[-1].status == "skipped" and j.wall_time < 2.5


def test_extract_code():
    r = "<think>```python\nprint(0)\n```</think>Answer:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```"
    assert extract_code(r) == "print(2)\n"
    assert extract_code("```\nprint(1)\n```") is None
    assert extract_code("```python\nprint(1)\n") is None  # unclosed
    assert extract_code(None) is None
    # C++ fences: the last program counts, its fence names the language
    both = "```python\nprint(1)\n```\n```cpp\nint main(){}\n```"
    assert extract_program(both) == ("cpp", "int main(){}\n")
    assert extract_code(both) == "print(1)\n"  # extract_code stays Python only
    assert extract_program(both, ("python",)) == ("python", "print(1)\n")
    for fence in ("cpp", "c++", "C++", "cxx", "cc"):
        assert extract_program(f"x\n```{fence}\nint main(){{}}\n```") == ("cpp", "int main(){}\n"), fence
    for fence in ("py", "python3", "Python"):
        assert extract_program(f"```{fence}\nprint(1)\n```") == ("python", "print(1)\n"), fence
    assert extract_program("```c\nint main(){}\n```") is None  # C is not C++
    assert extract_program("```cpp\nint main(){}\n```<think>", ("python",)) is None
    # markdown as models write it: Windows line ends, a fence in a list item or a quote (its indent comes off),
    # ``` inside a string (not a closing fence), the closing fence after the last code line
    assert extract_code("Here:\r\n```python\r\nx = 1\r\nprint(x)\r\n```\r\n") == "x = 1\nprint(x)\n"
    assert extract_code("1. Code:\n   ```python\n   def f():\n       return 1\n   print(f())\n   ```") == \
        "def f():\n    return 1\nprint(f())\n"
    assert extract_code("> ```python\n> print(1)\n> ```") == "print(1)\n"
    assert extract_code("```python\ns = '```'\nprint(s)\n```") == "s = '```'\nprint(s)\n"
    assert extract_code("```python\nprint(1)```") == "print(1)\n"
    assert extract_code("```text\n```python\n```\nno code") is None  # a fence inside another block is text
    hostile = "```py\n" * 40000  # unclosed openings: one pass, whatever the text holds
    t = time.perf_counter()
    assert extract_code(hostile) is None and time.perf_counter() - t < 1.0


def test_generate_is_deterministic_and_difficulty_picks_tiers():
    env = get_env("code/solve")
    for d in (1, 2, 3):
        a, b = env.generate(5, d), env.generate(5, d)
        assert a.to_dict() == b.to_dict()
        assert env.by_id[a.meta["seed_id"]].difficulty == d
        assert "```python" in a.prompt
    assert env.by_id[env.generate(0, 0).meta["seed_id"]].difficulty == 1  # clamped to the lowest tier
    assert env.generate(3, 99).meta["seed_id"] in env.by_id


def test_seeds_from_jsonl(tmp_path):
    row = {"id": "triple", "statement": "Print 3 times n.", "input_spec": "One integer n.", "output_spec": "3n.",
           "difficulty": 1, "reference": "print(3 * int(input()))\n", "wrong": ["print(3 + int(input()))\n"],
           "validator": "n = int(input())\n", "tests": [{"input": "1\n", "output": "3"}, {"input": "2\n", "output": "6"},
                                                       {"input": "5\n", "output": "15"}]}
    path = tmp_path / "more.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert load_seeds(str(path))[0].id == "triple"
    env = get_env("code/solve", seeds_path=str(path), include_builtin=False)
    assert [s.id for s in env.seeds] == ["triple"]
    p = env.generate(0, 1)
    assert env.verify(p, env.reference_response(p)).correct
    assert not env.verify(p, "```python\nprint(3 + int(input()))\n```").correct
    frac = get_env("code/solve", seeds_path=str(path), include_builtin=False, reward="fraction")
    s = frac.verify(p, "```python\nn = int(input())\nprint(3 if n == 1 else 0)\n```")
    assert not s.correct and abs(s.reward - 1 / 3) < 1e-9
    both = get_env("code/solve", seeds_path=str(path))
    assert len(both.seeds) == len(SEEDS) + 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "statement": "s", "reference": "r", "tests": []}) + "\n")
    with pytest.raises(ValueError, match="wrong"):
        load_seeds(str(bad))
    with pytest.raises(ValueError, match="duplicate"):
        get_env("code/solve", seeds_path=str(path), seeds=[load_seeds(str(path))[0]])


@pytest.mark.parametrize("env_id", ["code/solve", "code/io_predict", "code/io_propose", "code/arc", "code/falsify"])
def test_self_check(env_id):
    env = get_env(env_id)
    fails = self_check(env, difficulties=(1, 2, 3), seeds=(0, 1))
    assert fails == []


def test_verify_never_raises_on_odd_responses():
    for env_id in ("code/solve", "code/io_propose", "code/falsify"):
        env = get_env(env_id)
        p = env.generate(2, 2)
        for resp in ("", "\\boxed{", "```python\n" + "(" * 5000 + "\n```", "\\boxed{" + "9" * 30000 + "}"):
            s = env.verify(p, resp)
            assert not s.correct and -1 <= s.reward <= 1


def test_cli_run_and_judge(tmp_path, capsys):
    from envs.code.cli import main

    prog = tmp_path / "p.py"
    prog.write_text("import sys\nprint(sum(map(int, sys.stdin.read().split())))\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("1 2 3\n")
    assert main(["run", str(prog), "--stdin", str(stdin), "--time-limit", "3", "--memory-mb", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"].strip() == "6" and out["peak_memory_bytes"] > 0
    tests = tmp_path / "t.jsonl"
    tests.write_text('{"input": "1 2", "output": "3"}\n{"input": "5", "output": "6"}\n')
    assert main(["judge", str(prog), "--tests", str(tests)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "wrong_answer" and [r["status"] for r in out["results"]] == ["accepted", "wrong_answer"]
    loop = tmp_path / "loop.py"
    loop.write_text("while True: pass\n")
    assert main(["run", str(loop), "--time-limit", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "time_limit"
    with pytest.raises(FileNotFoundError):
        main(["run", str(tmp_path / "missing.py")])


SUM_CPP = "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n"


def test_solve_in_cpp_language_from_the_fence():
    seed = [s for s in SEEDS if s.id == "sum-two"]
    env = get_env("code/solve", seeds=seed, include_builtin=False, language="cpp")
    p = env.generate(0, 1)
    assert "```cpp" in p.prompt and "C++17" in p.prompt and p.meta["language"] == "cpp"
    ok = env.verify(p, f"Here:\n```cpp\n{SUM_CPP}```")
    assert ok.correct and ok.info["language"] == "cpp", ok.info
    wrong = SUM_CPP.replace("a + b", "(a < 0 ? -a : a) + (b < 0 ? -b : b)")
    s = env.verify(p, f"```c++\n{wrong}```")
    assert not s.correct and s.info["status"] == "wrong_answer" and s.info["language"] == "cpp"
    s = env.verify(p, "```cpp\nint main() { std::cout << 1; }\n```")
    assert not s.correct and s.reward == 0 and s.info["status"] == "compile_error"
    assert "cout" in s.info["compile_error"]
    # a Python answer is judged as Python; a C++ block after it wins
    assert env.verify(p, f"```python\n{seed[0].reference}```").info["language"] == "python"
    s = env.verify(p, f"```python\n{seed[0].reference}```\nfinal:\n```cpp\nint main() {{ retur 0; }}\n```")
    assert s.info["status"] == "compile_error"
    # Python-only: C++ fences are not programs
    py_only = get_env("code/solve", seeds=seed, include_builtin=False, languages=("python",))
    assert "```python" in py_only.generate(0, 1).prompt and py_only.generate(0, 1).meta["language"] == "python"
    s = py_only.verify(p, f"```cpp\n{SUM_CPP}```")
    assert not s.correct and not s.format_ok
    with pytest.raises(ValueError):
        get_env("code/solve", language="cpp", languages=("python",))
    with pytest.raises(ValueError):
        get_env("code/solve", language="rust")


def test_cli_runs_and_judges_cpp(tmp_path, capsys):
    from envs.code.cli import main

    prog = tmp_path / "p.cpp"
    prog.write_text(SUM_CPP)
    stdin = tmp_path / "in.txt"
    stdin.write_text("1 2\n")
    assert main(["run", str(prog), "--stdin", str(stdin), "--time-limit", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"].strip() == "3" and out["compile"]["status"] == "ok"
    tests = tmp_path / "t.jsonl"
    tests.write_text('{"input": "1 2", "output": "3"}\n{"input": "5 0", "output": "6"}\n')
    bad = tmp_path / "bad.txt"  # the extension says nothing: --language does
    bad.write_text("int main() { return x; }\n")
    assert main(["judge", str(bad), "--tests", str(tests), "--language", "cpp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "compile_error" and out["language"] == "cpp"
    assert "'x' was not declared" in out["results"][0]["detail"].replace("‘", "'").replace("’", "'")


def test_responses_verified_in_threads_score_as_one_at_a_time():
    """A batch of code/solve responses (references, wrong programs, a time-out, no code) through
    envs.base.verify_all with 3 threads: the same scores as one after another, in order."""
    from envs import get_env, verify_all

    env = get_env("code/solve")
    items = []
    for seed in range(6):
        p = env.generate(seed, 1 + seed % 3)
        s = env.seed_of(p)
        items += [(env, p, env.reference_response(p)), (env, p, f"```python\n{s.wrong[0]}\n```"),
                  (env, p, "no code")]
    items.append((env, items[0][1], "```python\nwhile True:\n    pass\n```"))
    alone = [env.verify(p, r) for _, p, r in items]
    together = verify_all(items, workers=3)
    assert [(s.reward, s.correct, s.info.get("status")) for s in together] == \
        [(s.reward, s.correct, s.info.get("status")) for s in alone]
    assert [s.correct for s in alone] == [True, False, False] * 6 + [False]
    assert alone[-1].info["status"] == "time_limit"


def test_the_tests_a_wrong_program_fails_do_not_depend_on_the_machine_being_busy():
    """code/arc and code/falsify build problems from the tests a wrong program fails: a wrong program that is
    right on a test but slower than the time limit there (as a busy machine makes a program) must not count
    that test as failed, or two processes build different problems for the same seed."""
    import dataclasses

    base = [s for s in SEEDS if s.id == "sum-two"][0]
    slow = "import time\ntime.sleep(0.6)\n" + base.reference  # right, in 0.6 s: over 0.3, under the trusted limit
    seed = dataclasses.replace(base, id="sum-two-slow", wrong=[slow], tests=base.tests[:2], time_limit=0.3)
    env = get_env("code/arc", seeds=[seed], include_builtin=False)
    assert env.failing_tests(seed, 0) == []
