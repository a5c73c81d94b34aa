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
from envs.code.envs import SHOWN_CHARS, extract_code, extract_program
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


_RELAID = r"""
import contextlib, io, json, sys
tests = json.loads(sys.stdin.read())
validator, reference = open("/box/validator.py").read(), open("/box/reference.py").read()

def run(src, text):
    sys.stdin, out = io.StringIO(text), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(src, "prog.py", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        return (e.code in (None, 0)), out.getvalue()
    except Exception:
        return False, out.getvalue()
    return True, out.getvalue()

bad = []
for text in tests:
    for laid in ("\n".join(text.split()) + "\n", " ".join(text.split()) + "\n"):
        if laid.split() != text.split() or laid == text or not run(validator, laid)[0]:
            continue
        if run(reference, laid)[1].split() != run(reference, text)[1].split():
            bad.append(laid[:60])
print(json.dumps(bad))
"""


def test_validators_refuse_inputs_laid_out_on_other_lines(judge):
    """The validators checked the values, not their lines: the same values one per line (or all on one line) were
    valid, the reference (reading by lines) misread them, and falsify paid for such "counterexamples" while
    io_propose took them. Each test input laid out otherwise is now refused, or read alike."""
    def one(s: Seed):
        v = judge.sandbox.run(_RELAID, json.dumps([t["input"] for t in s.tests]),
                              files={"validator.py": s.validator, "reference.py": s.reference})
        assert v.status == "ok", (s.id, v.stderr)
        return s.id, json.loads(v.stdout)

    with ThreadPoolExecutor(2) as ex:
        bad = {sid: res for sid, res in ex.map(one, [s for s in SEEDS if s.validator]) if res}
    assert not bad, bad


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
    t = time.process_time()  # (this process's CPU time: a busy machine must not fail it)
    assert extract_code(hostile) is None and time.process_time() - t < 1.0


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
                                                       {"input": "5\n", "output": "15"},
                                                       {"input": "7\n", "output": "21"}]}
    path = tmp_path / "more.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert load_seeds(str(path))[0].id == "triple"
    env = get_env("code/solve", seeds_path=str(path), include_builtin=False)
    assert [s.id for s in env.seeds] == ["triple"]
    p = env.generate(0, 1)
    assert env.verify(p, env.reference_response(p)).correct
    assert not env.verify(p, "```python\nprint(3 + int(input()))\n```").correct
    frac = get_env("code/solve", seeds_path=str(path), include_builtin=False, reward="fraction")
    # the fraction of the hidden tests (the two the prompt does not show): right on 1 and 2 (shown) and on 5
    s = frac.verify(p, "```python\nn = int(input())\nprint({1: 3, 2: 6, 5: 15}.get(n, 0))\n```")
    assert not s.correct and abs(s.reward - 1 / 2) < 1e-9
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


def test_any_language_needs_every_language_accepted():
    """language="any" with languages=("cpp",) prompted "Python 3 or C++17" while only C++ was graded, and claimed a
    reference answer (the Python reference scored 0): refused, naming the language to ask for instead."""
    for env_id in ("code/solve", "code/arc"):
        for only in ("cpp", "python"):
            with pytest.raises(ValueError, match=f"pass language='{only}' instead"):
                get_env(env_id, language="any", languages=(only,))
            assert get_env(env_id, language=only, languages=(only,)).language == only
        assert get_env(env_id, language="any", languages=["cpp", "python"]).no_reference_reason == ""


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


CODE_ENVS = ["code/solve", "code/io_predict", "code/io_propose", "code/arc", "code/falsify"]
BY_ID = {s.id: s for s in SEEDS}


def _seed_env(env_id: str, *ids: str, **kw):
    """``env_id`` over the named built-in seeds only, none held out (every one drawn by generate)."""
    return get_env(env_id, seeds=[BY_ID[i] for i in ids], include_builtin=False, heldout=0, **kw)


def _example_inputs(prompt: str) -> list[str]:
    import re

    return re.findall(r"Example \d+ input:\n```\n(.*?)\n```", prompt, re.DOTALL)


def test_held_out_problems_never_come_from_a_training_seed():
    """Held-out evaluation is not the training set: ~20% of each tier's seeds (the same in all five environments)
    are held out; generate never draws them and heldout draws only them, so no training prompt (io_predict's and
    io_propose's show the reference program) shows a held-out seed's program."""
    envs = {e: get_env(e) for e in CODE_ENVS}
    for e in ("code/arc", "code/falsify"):  # which tests a wrong program fails does not decide the split
        envs[e].failing_tests = lambda s, wi: [0]
    held = {s.id for s in envs["code/solve"].heldout_seeds}
    assert all({s.id for s in env.heldout_seeds} == held for env in envs.values())
    assert {BY_ID[i].difficulty for i in held} == {1, 2, 3} and 0.15 <= len(held) / len(SEEDS) <= 0.3
    for e, env in envs.items():
        train = [env.generate(seed, d) for d in (1, 2, 3) for seed in range(120)]
        evals = [env.heldout(10**9 + seed, d) for d in (1, 2, 3) for seed in range(60)]
        assert not {p.meta["seed_id"] for p in train} & held, e
        assert {p.meta["seed_id"] for p in evals} == held, e
        assert all(p.meta.get("heldout") for p in evals) and not any(p.meta.get("heldout") for p in train)
        assert not {p.prompt for p in train} & {p.prompt for p in evals}, e
        if e in ("code/io_predict", "code/io_propose"):
            refs = [BY_ID[i].reference.strip() for i in held]
            assert not any(r in p.prompt for p in train for r in refs), e
    # heldout=0: every seed trains, and held-out evaluation is refused with a clear message
    none = get_env("code/solve", heldout=0)
    assert not none.heldout_seeds and len(none.train_seeds) == len(SEEDS)
    with pytest.raises(ValueError, match="no held-out seed"):
        none.heldout(0, 1)
    with pytest.raises(ValueError, match="heldout"):
        get_env("code/solve", heldout=1.0)
    # a seed file's split is its own: the built-in seeds keep their side whatever else is loaded
    extra = [Seed.from_dict({**BY_ID["sum-two"].to_dict(), "id": f"extra-{i}"}) for i in range(6)]
    more = get_env("code/io_predict", seeds=extra)
    assert {s.id for s in more.heldout_seeds} - {s.id for s in extra} == held
    assert {s.id for s in more.heldout_seeds} & {s.id for s in extra}  # a tier of two or more holds one out
    # a tier without a held-out seed (its lone seed trains): held-out problems of that level come from a lower tier
    few = get_env("code/solve", seeds=[BY_ID[i] for i in ("sum-two", "gcd", "palindrome", "balanced-brackets")],
                  include_builtin=False)
    assert [s.id for s in few.train_seeds if s.difficulty == 2] == ["balanced-brackets"] and few.heldout_seeds
    assert {few.heldout(seed, 2).meta["seed_id"] for seed in range(20)} <= {s.id for s in few.heldout_seeds}
    assert {few.generate(seed, 2).meta["seed_id"] for seed in range(20)} == {"balanced-brackets"}


def test_falsify_shows_only_an_example_the_wrong_program_gets_right():
    """The falsify prompt's example used to be the first shown test whatever the candidate printed on it, so on
    ~42% of problems pasting Example 1's input was a full-credit answer; now it is one the candidate passes, or
    none (run-length's wrong program fails every test)."""
    env = _seed_env("code/falsify", "gcd", "even-sum", "reverse-words", "run-length")
    seen = set()
    for seed in range(60):
        p = env.generate(seed, 1)
        s = env.seed_of(p)
        shown = _example_inputs(p.prompt)
        if s.id == "run-length":
            assert shown == [], p.prompt
        else:
            assert len(shown) == 1, s.id
            bad = env.failing_tests(s, p.meta["wrong"])
            assert not any(s.tests[i]["input"].rstrip("\n") == shown[0] for i in bad), s.id
            if s.id not in seen:  # pasting the example's input: a valid input the candidate gets right
                sc = env.verify(p, "\\boxed{" + shown[0] + "}")
                assert not sc.correct and sc.info["candidate_output"] == sc.info["expected"], (s.id, sc)
        seen.add(s.id)
    assert seen == {"gcd", "even-sum", "reverse-words", "run-length"}


def test_arc_holds_out_half_the_tests_and_no_constant_passes_them():
    """code/arc level 1 held out one fixed test of most seeds (print('NO') passed palindrome); now at least half
    the tests are held out, with different outputs wherever the seed's tests have them."""
    level1 = [s.id for s in SEEDS if s.difficulty == 1]
    env = _seed_env("code/arc", *level1)
    with ThreadPoolExecutor(2) as ex:  # the tests each wrong program fails, once per seed
        list(ex.map(lambda s: env.failing_tests(s, 0), env.seeds))
    problems: dict[str, list] = {}
    for seed in range(200):
        p = env.generate(seed, 1)
        problems.setdefault(p.meta["seed_id"], []).append(p)
    assert set(problems) == set(level1)
    for sid, ps in problems.items():
        s = BY_ID[sid]
        outputs = {tuple(t["output"].split()) for t in s.tests}
        for const in outputs:  # a program printing one of the seed's outputs whatever its input
            passes = sum(all(tuple(s.tests[i]["output"].split()) == const for i in p.meta["held_out"]) for p in ps)
            assert passes <= len(ps) // 2, (sid, const, passes, len(ps))
        for p in ps:
            assert len(p.meta["held_out"]) * 2 >= len(s.tests) and p.meta["shown"], sid
            if len(outputs) > 1:
                assert len({tuple(s.tests[i]["output"].split()) for i in p.meta["held_out"]}) > 1, sid
    p = problems["palindrome"][0]
    for guess in ("YES", "NO"):
        assert not env.verify(p, f"```python\nprint('{guess}')\n```").correct


WEAK_WRONG = {
    # forgets k %= n (wrong when k >= 2n and k % n != 0)
    "rotate-right": "n, k = map(int, input().split())\na = input().split()\nprint(' '.join(a[n - k:] + a[:n - k]))\n",
    # no modulo
    "grid-paths": "r, c = map(int, input().split())\ng = [input().strip() for _ in range(r)]\n"
                  "dp = [[0] * c for _ in range(r)]\n"
                  "for i in range(r):\n    for j in range(c):\n        if g[i][j] == '#':\n            continue\n"
                  "        dp[i][j] = 1 if i == j == 0 else (dp[i - 1][j] if i else 0) + (dp[i][j - 1] if j else 0)\n"
                  "print(dp[-1][-1])\n",
    "coin-change-ways": "n, A = map(int, input().split())\nw = [1] + [0] * A\nfor c in map(int, input().split()):\n"
                        "    for v in range(c, A + 1):\n        w[v] += w[v - c]\nprint(w[A])\n",
    # every subset (2^n; n is up to 100)
    "knapsack": "from itertools import combinations\nn, W = map(int, input().split())\n"
                "it = [tuple(map(int, input().split())) for _ in range(n)]\n"
                "print(max(sum(v for _, v in s) for k in range(n + 1) for s in combinations(it, k) "
                "if sum(w for w, _ in s) <= W))\n",
}


def test_seed_tests_catch_the_wrong_programs_they_used_to_pass(judge):
    def one(sid):
        s = BY_ID[sid]
        return sid, judge.judge(WEAK_WRONG[sid], s.tests, stop_on_failure=True, time_limit=s.time_limit)

    with ThreadPoolExecutor(2) as ex:
        for sid, j in ex.map(one, WEAK_WRONG):
            assert not j.accepted, sid
            assert j.status == ("time_limit" if sid == "knapsack" else "wrong_answer"), (sid, j.status)


SUM_PY = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_the_graded_block_is_the_last_in_the_prompts_language():
    """The prompt says the last ```python (```cpp) block is graded: a later block in another language (a sketch)
    does not replace it; with none in the prompt's language the last accepted block is graded; with
    language="any" the last block of either language."""
    sketch = "```cpp\n// the same in C++: a + b\n```\n"
    py = get_env("code/solve", seeds=[BY_ID["sum-two"]], include_builtin=False)
    p = py.generate(0, 1)
    s = py.verify(p, f"```python\n{SUM_PY}```\nFor reference, in C++:\n{sketch}")
    assert s.correct and s.info["language"] == "python", s.info
    s = py.verify(p, f"```cpp\n{SUM_CPP}```")  # no Python block: C++ is accepted
    assert s.correct and s.info["language"] == "cpp", s.info
    cpp = get_env("code/solve", seeds=[BY_ID["sum-two"]], include_builtin=False, language="cpp")
    s = cpp.verify(cpp.generate(0, 1), f"```cpp\n{SUM_CPP}```\nIn Python:\n```python\nprint(0)\n```")
    assert s.correct and s.info["language"] == "cpp", s.info
    both = get_env("code/solve", seeds=[BY_ID["sum-two"]], include_builtin=False, language="any")
    s = both.verify(both.generate(0, 1), f"```python\n{SUM_PY}```\nfinal:\n{sketch}")
    assert not s.correct and s.info["status"] == "compile_error"


def test_cpp_prompts_declare_that_there_is_no_reference_answer():
    """The seeds' references are Python: with language="cpp" the reference response does not answer the prompt
    (code/solve and code/arc); the environment says so, and the self-check's other requirements still hold."""
    for env_id in ("code/solve", "code/arc"):
        assert get_env(env_id).no_reference_reason == ""
        assert get_env(env_id, language="any").no_reference_reason == ""
        env = get_env(env_id, seeds=[BY_ID["sum-two"]], include_builtin=False, language="cpp", languages=["cpp"])
        assert "Python" in env.no_reference_reason
        assert self_check(env, difficulties=(1,), seeds=(0,)) == []
    assert get_env("code/io_predict", language="cpp").no_reference_reason == ""  # no program to write


def test_seeds_above_the_top_tier_are_refused():
    import dataclasses

    row = {**BY_ID["sum-two"].to_dict(), "id": "sum-two-hard", "difficulty": 4}
    with pytest.raises(ValueError, match="difficulty 4 is above 3"):
        Seed.from_dict(row)
    with pytest.raises(ValueError, match="sum-two-hard.*difficulty outside 1-3"):
        get_env("code/solve", seeds=[dataclasses.replace(BY_ID["sum-two"], id="sum-two-hard", difficulty=4)])
    assert Seed.from_dict({**row, "difficulty": 3}).difficulty == 3
    for low in (0, -5):  # (turned into tier 1 silently, though the docstring said refused)
        with pytest.raises(ValueError, match=f"difficulty {low} is below 1"):
            Seed.from_dict({**row, "difficulty": low})


def test_a_test_with_an_empty_output_is_not_asked_about_in_a_box():
    """An empty \\boxed{} is no answer: a test printing nothing made an io_predict problem only ``\\boxed{\\text{}}``
    solved (the reference response itself scored 0)."""
    seed = Seed.from_dict({**BY_ID["sum-two"].to_dict(), "id": "quiet",
                           "tests": [{"input": "1 2", "output": ""}, {"input": "3 4", "output": "7"}]})
    env = get_env("code/io_predict", seeds=[seed], include_builtin=False)
    assert env.shown_tests(seed) == [1]
    for s in range(4):
        p = env.generate(s, 1)
        assert env.verify(p, env.reference_response(p)).correct


def test_io_predict_takes_an_answer_wrapped_in_a_text_command():
    env = _seed_env("code/io_predict", "palindrome")
    p = env.generate(0, 1)
    assert p.answer in ("YES", "NO")
    other = "NO" if p.answer == "YES" else "YES"
    for wrap in ("\\text{%s}", "\\texttt{%s}", "\\mathrm{%s}", "\\text{\\texttt{%s}}", "%s"):
        assert env.verify(p, "It prints \\boxed{" + wrap % p.answer + "}").correct, wrap
        assert not env.verify(p, "It prints \\boxed{" + wrap % other + "}").correct, wrap
    assert not env.verify(p, "\\boxed{\\text{%s} \\text{x}}" % p.answer).correct


def test_extract_fences_as_models_write_them():
    """Fence lines with more info than the language, fences of four backticks, a block in a numbered list item
    (its code indented to the item's content column, or not), an instruction echoed before the block."""
    assert extract_program("```python title=sol.py\nprint(1)\n```") == ("python", "print(1)\n")
    assert extract_program("```Python 3\nprint(1)\n```") == ("python", "print(1)\n")
    assert extract_program("```cpp file=a.cpp\nint main(){}\n```") == ("cpp", "int main(){}\n")
    assert extract_code("````python\nprint(1)\n````") == "print(1)\n"
    assert extract_code("````python\ns = '''\n```\n'''\nprint(s)\n````") == "s = '''\n```\n'''\nprint(s)\n"
    assert extract_code("````markdown\n```python\nprint(0)\n```\n````") is None  # a block inside another is text
    listed = ("Steps:\n1. Read the input.\n2. ```python\n   import sys\n   for x in sys.stdin:\n       print(x)\n"
              "   ```\n")
    code = extract_code(listed)
    assert code == "import sys\nfor x in sys.stdin:\n    print(x)\n"
    compile(code, "answer.py", "exec")
    flush_left = "1. ```python\ndef f():\n    return 1\nprint(f())\n```"  # the code not indented under the item
    assert extract_code(flush_left) == "def f():\n    return 1\nprint(f())\n"
    assert extract_code("- ```py\n  print(1)\n  ```") == "print(1)\n"
    assert extract_code("I'll put it in a ```python\n\n```python\nprint(1)\n```") == "print(1)\n"
    # prose that mentions a fence is not one: only ```LANG ending the line opens a block after other text
    assert extract_code("Put it in a ```python fenced block.\nprint(0)\n```") is None
    assert extract_code("x\n```python\nprint(1)\n```") == "print(1)\n"
    t = time.process_time()
    for hostile in ("`" * 200000 + "x y`", "1. " * 50000 + "```python", "a ```python\n" + "\n" * 100000):
        extract_code(hostile)
    assert time.process_time() - t < 1.0


def test_only_boxed_tasks_leave_out_tests_with_braces():
    """balanced-brackets: a test holding braces cannot be an answer within \\boxed{} (io_predict, io_propose), but
    it can be an example of a program-writing task."""
    s = BY_ID["balanced-brackets"]
    braces = {i for i, t in enumerate(s.tests) if "{" in t["input"] + t["output"]}
    assert braces
    small = [i for i, t in enumerate(s.tests) if len(t["input"]) < 1000]  # (its 10^5-bracket tests are not shown)
    assert len(small) < len(s.tests)
    for env_id in ("code/solve", "code/arc", "code/falsify"):
        assert get_env(env_id).shown_tests(s) == small, env_id
    for env_id in ("code/io_predict", "code/io_propose"):
        assert not set(get_env(env_id).shown_tests(s)) & braces, env_id
    p = _seed_env("code/solve", "balanced-brackets").generate(0, 2)
    assert "Example 1 input:\n```\n()[]{}\n```" in p.prompt


def test_prepare_fails_early_where_the_sandbox_cannot_run():
    """A machine without bubblewrap: prepare() raises the sandbox's own message (before any training on all-zero
    code rewards); a config that allows a weaker sandbox passes."""
    from envs.code.judge import Judge

    missing = {**sbx.detect_layers(), "namespaces": "bwrap (bubblewrap) is not installed (simulated)"}
    env = get_env("code/solve")
    env._judge = Judge(sbx.Sandbox(sbx.SandboxConfig(), _layers=missing))
    with pytest.raises(sbx.SandboxUnavailable, match="bubblewrap"):
        env.prepare()
    weaker = get_env("code/solve")
    weaker._judge = Judge(sbx.Sandbox(sbx.SandboxConfig(allow_weaker=True), _layers=missing))
    weaker.prepare()
    get_env("code/io_predict").prepare()  # this machine's sandbox runs


def test_a_sandbox_without_namespaces_warns_that_the_hidden_tests_are_readable(caplog, monkeypatch):
    """Allowed to run without bubblewrap (CASCADE_SANDBOX_ALLOW_WEAKER=1), a program sees the host's files,
    envs/code/seeds.py with every hidden test and expected output among them, and printed the expected output
    (reward 1.0): the sandbox said nothing. It warns once per process, naming the hidden tests, and its refusal
    says the same."""
    import logging

    missing = {**sbx.detect_layers(), "namespaces": "bwrap (bubblewrap) is not installed (simulated)"}
    with pytest.raises(sbx.SandboxUnavailable, match="hidden tests of envs/code"):
        sbx.Sandbox(sbx.SandboxConfig(), _layers=missing).check()
    sbx._warn_no_namespaces.cache_clear()
    monkeypatch.setenv(sbx.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="envs.code.sandbox"):
        sbx.Sandbox(sbx.SandboxConfig(allow_weaker=True), _layers=missing).check()
        sbx.Sandbox(sbx.SandboxConfig(), _layers=missing).check()
        sbx.Sandbox(sbx.SandboxConfig(), _layers=sbx.detect_layers()).check()  # bubblewrap: nothing to say
    warned = [r.getMessage() for r in caplog.records if r.name == "envs.code.sandbox"]
    assert len(warned) == 1 and "hidden tests of envs/code" in warned[0] and "never for RL" in warned[0], warned


_NAIVE = {  # programs right on small inputs, too slow (or too deep) at the stated sizes
 "rotate-right": "n, k = map(int, input().split())\na = input().split()\nfor _ in range(k):\n    a.insert(0, a.pop())\nprint(' '.join(a))\n",
 "balanced-brackets": "s = input().strip()\nwhile True:\n    t = s.replace('()', '').replace('[]', '').replace('{}', '')\n    if t == s:\n        break\n    s = t\nprint('YES' if not s else 'NO')\n",
 "kth-smallest": "n, k = map(int, input().split())\na = list(map(int, input().split()))\nfor _ in range(k - 1):\n    a.remove(min(a))\nprint(min(a))\n",
 "bfs-distance": "import sys\nsys.setrecursionlimit(10000)\nt = sys.stdin.read().split()\nn, m = int(t[0]), int(t[1])\ng = [[] for _ in range(n + 1)]\nfor i in range(m):\n    a, b = int(t[2+2*i]), int(t[3+2*i]); g[a].append(b); g[b].append(a)\nbest = [None]\ndef dfs(u, d, seen):\n    if u == n:\n        best[0] = d if best[0] is None else min(best[0], d); return\n    for v in g[u]:\n        if v not in seen:\n            seen.add(v); dfs(v, d + 1, seen); seen.discard(v)\ndfs(1, 0, {1})\nprint(best[0] if best[0] is not None else -1)\n",
 "dijkstra": "import sys\nt = sys.stdin.read().split()\nn, m = int(t[0]), int(t[1])\nE = [(int(t[2+3*i]), int(t[3+3*i]), int(t[4+3*i])) for i in range(m)]\nINF = float('inf')\nd = [INF] * (n + 1); d[1] = 0\nchanged = True\nwhile changed:\n    changed = False\n    for u, v, w in E:\n        if d[u] + w < d[v]: d[v] = d[u] + w; changed = True\n        if d[v] + w < d[u]: d[u] = d[v] + w; changed = True\nprint(d[n] if d[n] < INF else -1)\n",
 "merge-intervals": "n = int(input())\nI = [list(map(int, input().split())) for _ in range(n)]\nchanged = True\nwhile changed:\n    changed = False\n    for i in range(len(I)):\n        for j in range(i + 1, len(I)):\n            if I[i][0] <= I[j][1] and I[j][0] <= I[i][1]:\n                I[i] = [min(I[i][0], I[j][0]), max(I[i][1], I[j][1])]; del I[j]; changed = True; break\n        if changed: break\nI.sort()\nprint(len(I))\nfor l, r in I: print(l, r)\n",
 "coin-change-ways": "import sys\nsys.setrecursionlimit(100000)\nn, A = map(int, input().split())\nc = list(map(int, input().split()))\ndef ways(i, a):\n    if a == 0:\n        return 1\n    if i == n or a < 0:\n        return 0\n    return ways(i, a - c[i]) + ways(i + 1, a)\nprint(ways(0, A) % 1000000007)\n",
 "edit-distance": "import sys\nsys.setrecursionlimit(10000)\na = input().strip()\nb = input().strip()\ndef d(i, j):\n    if i == 0 or j == 0:\n        return i + j\n    if a[i - 1] == b[j - 1]:\n        return d(i - 1, j - 1)\n    return 1 + min(d(i - 1, j), d(i, j - 1), d(i - 1, j - 1))\nprint(d(len(a), len(b)))\n",
 "knapsack": "n, W = map(int, input().split())\nit = [tuple(map(int, input().split())) for _ in range(n)]\ndef best(i, cap):\n    if i == n:\n        return 0\n    w, v = it[i]\n    skip = best(i + 1, cap)\n    return max(skip, v + best(i + 1, cap - w)) if w <= cap else skip\nprint(best(0, W))\n",
 "count-primes": "n = int(input())\nc = 0\nfor k in range(2, n + 1):\n    if all(k % d for d in range(2, int(k ** 0.5) + 1)):\n        c += 1\nprint(c)\n",
 "word-frequency": "w = input().split()\nbest = None\nfor x in w:\n    c = w.count(x)\n    if best is None or c > best[1] or c == best[1] and x < best[0]:\n        best = (x, c)\nprint(best[0], best[1])\n",
 "prefix-sums": "input()\na = list(map(int, input().split()))\nprint(*[sum(a[:i + 1]) for i in range(len(a))])\n",
 "second-largest": "input()\nd = []\nfor x in map(int, input().split()):\n    if x not in d:\n        d.append(x)\nif len(d) < 2:\n    print('NONE')\nelse:\n    d.remove(max(d))\n    print(max(d))\n",
}


def _at_stated_sizes(t: dict) -> bool:
    """A test at its seed's stated sizes: an input of 100 characters and more, or one number of 10^5 and more
    (count-primes' n)."""
    text = t["input"].strip()
    return len(text) >= 100 or (text.isdigit() and int(text) >= 10**5)


def test_naive_programs_that_passed_the_small_tests_fail_at_the_stated_sizes(judge):
    """These seeds had only small tests: an O(n k) rotation (k up to 10^9), deleting matched bracket pairs over and
    over, k rounds of removing the minimum, a recursive search, relaxing every edge until nothing changes, pairwise
    interval merging, a recursion on the last letters (edit distance), list.count of each word, summing each prefix
    anew and collecting the distinct values in a list passed every test (and earned the reward). Each seed now has
    tests at its stated sizes (answers computed in envs/code/seeds.py without its reference) on which they run out of
    time (or stack), and they pass the small ones. (The recursions over the coins and over the items, and trial
    division of each number, already failed the short tests at those sizes that coin-change-ways, knapsack and
    count-primes had; they fail the new ones too.)"""
    def run(sid):
        s = next(x for x in SEEDS if x.id == sid)
        small = [t for t in s.tests if not _at_stated_sizes(t)]
        big = [t for t in s.tests if _at_stated_sizes(t)]
        assert big, f"{sid} has no test at its stated sizes"
        return (sid, judge.judge(_NAIVE[sid], small, time_limit=2.0).accepted,
                judge.judge(_NAIVE[sid], big, stop_on_failure=True, time_limit=1.0).status)

    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(run, _NAIVE))
    assert [(sid, small, big in ("time_limit", "runtime_error")) for sid, small, big in out] == \
        [(sid, True, True) for sid in _NAIVE], out


def test_arc_holds_out_a_test_at_the_stated_sizes():
    """code/arc judges on the tests it does not show: a problem showing every test at the stated sizes would pay a
    naive program. Long ones are never shown; count-primes' (one number each) are four, and arc shows at most
    three tests of a tier-2 seed."""
    env = _seed_env("code/arc", *_NAIVE)
    env.failing_tests = lambda s, wi: [0]  # (the tests a wrong program fails only hold out more)
    seen = set()
    for seed in range(300):
        p = env.generate(seed, 1 + seed % 3)
        s = BY_ID[p.meta["seed_id"]]
        big = {i for i, t in enumerate(s.tests) if _at_stated_sizes(t)}
        assert big & set(p.meta["held_out"]), (s.id, p.meta["shown"])
        assert all(len(s.tests[i]["input"]) <= SHOWN_CHARS for i in p.meta["shown"]), s.id
        seen.add(s.id)
    assert seen == set(_NAIVE)


def test_falsify_generates_in_time_once_prepared():
    """A wrong program that times out on a test used to make the first generate of a process run it under the
    trusted limit (10 s and more), so `cascade envs check` capped code/falsify at tier 2; prepare() now runs every
    seed's wrong programs once, before any clock starts, and generate only reads the result."""
    env = get_env("code/falsify")
    t = time.perf_counter()
    env.prepare()
    prep = time.perf_counter() - t
    t = time.perf_counter()
    p = env.generate(1, 3)
    took = time.perf_counter() - t
    print(f"prepare {prep:.1f}s, generate {took:.2f}s")
    assert p.prompt and took < 10.0, (took, prep)
    arc = get_env("code/arc", seeds=[BY_ID["components"]], include_builtin=False, heldout=0)
    arc.prepare()
    t = time.perf_counter()
    arc.generate(0, 3)
    assert time.perf_counter() - t < 10.0


def test_solve_fraction_counts_only_the_hidden_tests():
    """The prompt says the program is judged on hidden tests, but the fraction reward counted the examples it
    shows: a lookup table of them earned 0.33-0.5. Now the fraction is over the tests not shown (binary still
    needs every test)."""
    for reward in ("fraction", "binary"):
        env = get_env("code/solve", reward=reward)
        for seed in range(4):
            p = env.generate(seed, 1)
            s = env.seed_of(p)
            shown = env.shown_tests(s)[:2]
            assert all(s.tests[i]["input"].rstrip("\n") in _example_inputs(p.prompt) for i in shown)
            table = {s.tests[i]["input"].strip(): s.tests[i]["output"] for i in shown}
            memo = f"import sys\nT = {table!r}\nprint(T.get(sys.stdin.read().strip(), ''))\n"
            sc = env.verify(p, f"```python\n{memo}```")
            assert sc.reward == 0.0 and not sc.correct, (reward, s.id, sc)
            ref = env.verify(p, env.reference_response(p))
            assert ref.reward == 1.0 and ref.correct, (reward, s.id, ref)


def test_cli_compile_time_limit_reaches_the_compile(tmp_path, capsys):
    """``--compile-time-limit`` bounds the C++ compile (default 20 s, where this program compiles)."""
    from envs.code.cli import main

    prog = tmp_path / "p.cpp"
    prog.write_text("#include <iostream>\nint main(){std::cout<<42<<std::endl;}\n")
    assert main(["run", str(prog), "--compile-time-limit", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "compile_error" and out["compile"]["status"] == "time_limit", out
    assert "compile time limit (0.05 s)" in out["stderr"]
    assert main(["run", str(prog)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"].strip() == "42", out


def test_cli_options_reach_the_sandbox_and_the_judge(tmp_path, capsys):
    """--language over the extension, --memory-mb, --time-limit, --stop-on-failure, --float-tol and the layers report
    (each was checked only by its default giving the same verdict)."""
    from envs.code.cli import main

    py_named_cpp = tmp_path / "p.cpp"
    py_named_cpp.write_text("print(6 * 7)\n")
    assert main(["run", str(py_named_cpp), "--language", "python"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"].strip() == "42", out
    hog = tmp_path / "hog.py"
    hog.write_text("x = bytearray(300 * 1024 * 1024)\nprint('held')\n")
    assert main(["run", str(hog), "--memory-mb", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] != "ok" and "held" not in out["stdout"], out
    loop = tmp_path / "loop.py"
    loop.write_text("while True: pass\n")
    t = time.perf_counter()
    assert main(["run", str(loop), "--time-limit", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "time_limit" and time.perf_counter() - t < 4
    third = tmp_path / "third.py"
    third.write_text("print(1 / 3)\n")
    tests = tmp_path / "t.jsonl"
    tests.write_text('{"input": "", "output": "0.3334"}\n{"input": "", "output": "0.3334"}\n')
    assert main(["judge", str(third), "--tests", str(tests), "--stop-on-failure"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in out["results"]] == ["wrong_answer", "skipped"], out
    assert main(["judge", str(third), "--tests", str(tests), "--float-tol", "1e-3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "accepted" and len(out["results"]) == 2, out
    assert main(["layers"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got["missing"]) == {k for k, ok in got["layers"].items() if not ok}
    assert all(isinstance(ok, bool) for ok in got["layers"].values())


def test_cli_refuses_a_program_that_is_not_utf8_in_one_line(tmp_path):
    from envs.code.cli import main

    prog = tmp_path / "p.py"
    prog.write_bytes(b"print('\xff\xfe')\n")
    with pytest.raises(ValueError, match=r"program .*p\.py' is not UTF-8 text"):
        main(["run", str(prog)])
