"""Grading of the code environments as a user sees it: which outputs and values are credited (tolerances,
sets, dicts), the fraction reward, the per-seed time limit and float tolerance, what io_propose and falsify
credit (the validator, a crashing reference, a crashing candidate), and the refusals of malformed tests and
seeds."""
from __future__ import annotations

import math

import pytest

from envs.base import get_env
from envs.code import sandbox as sbx
from envs.code import judge as jdg
from envs.code.judge import Judge, compare_output, compare_values, load_tests
from envs.code.seeds import Seed, load_seeds, seeds_from_dicts

needs_bwrap = pytest.mark.skipif(sbx.detect_layers()["namespaces"] is not None,
                                 reason="the code sandbox needs bubblewrap")


# ------------------------------------------------------------------------------------------------
# comparison (no sandbox)
# ------------------------------------------------------------------------------------------------
def test_output_tolerance_is_absolute_near_zero_and_relative_beyond_one():
    # |0.0005 - 0| = 5e-4 <= 1e-3 * max(1, 0): absolute near zero
    assert compare_output("0.0005", "0", float_tol=1e-3)
    assert not compare_output("0.002", "0", float_tol=1e-3)
    # |1000.5 - 1000| = 0.5 <= 1e-3 * 1000 = 1.0: relative at magnitude 1000
    assert compare_output("1000.5", "1000", float_tol=1e-3)
    assert not compare_output("1002", "1000", float_tol=1e-3)
    # the bound itself is within (|1.5 - 1| = 0.5 = 0.5 * 1, exact in binary)
    assert compare_output("1.5", "1", float_tol=0.5)
    assert not compare_output("1.75", "1", float_tol=0.5)
    # tokens that are not finite numbers must match exactly, whatever the tolerance
    assert not compare_output("Infinity", "inf", float_tol=1e-6)
    assert not compare_output("1e999", "inf", float_tol=1e-6)
    # only decimal numbers as programs print them are numbers: Python's float() also reads "1_000" and
    # Arabic-Indic digits, and "1_000" was credited for 1000 under a tolerance
    for odd, value in (("1_000", "1000"), ("\u0661\u0660", "10"), ("\uff15", "5")):
        assert not compare_output(odd, value, float_tol=1e-6), odd
    for plain, value in (("1e3", "1000"), ("-.5", "-0.5"), ("5.", "5"), ("+5", "5"), ("2.5E-1", "0.25")):
        assert compare_output(plain, value, float_tol=1e-9), plain


def test_values_tolerance_applies_between_an_int_and_a_float():
    assert compare_values(2, 2.0000001, float_tol=1e-6)
    assert compare_values(2.0000001, 2, float_tol=1e-6)
    assert not compare_values(2, 2.1, float_tol=1e-6)
    assert not compare_values(2, 2.0000001)  # no tolerance: exact


def test_expected_sets_keep_bools_apart_and_match_each_element_once():
    assert not compare_values([1], {True}) and not compare_values([True], {1})
    assert compare_values([True], {True})
    # within a tolerance every expected element is matched by a distinct returned one
    assert not compare_values([1.0, 1.0], {1.0, 2.0}, float_tol=1e-6)
    assert compare_values([2.0000001, 1.0], {1.0, 2.0}, float_tol=1e-6)


def test_expected_dicts_need_exactly_their_keys():
    assert not compare_values({"a": 1}, {"a": 1, "b": 2})
    assert not compare_values({"a": 1, "b": 2}, {"a": 1})
    assert compare_values({"Infinity": 1, "-Infinity": 2}, {math.inf: 1, -math.inf: 2})
    assert not compare_values({"Infinity": 2, "-Infinity": 1}, {math.inf: 1, -math.inf: 2})


# ------------------------------------------------------------------------------------------------
# malformed tests and judgements without tests (no sandbox run)
# ------------------------------------------------------------------------------------------------
def test_malformed_tests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no 'expected'"):
        jdg.TestCase.from_dict({"fn": "f", "args": [1]})
    with pytest.raises(ValueError, match="must be a dict"):
        jdg.TestCase.from_dict("output")
    with pytest.raises(ValueError, match="cannot tell the kind"):
        jdg.TestCase.from_dict({"input": "1"})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no tests"):
        load_tests(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1", "output": "2"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        load_tests(str(bad))
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"input": "1", "output": "2"}\n\n{"fn": "f", "expected": 3}\n')
    assert [t.kind for t in load_tests(str(ok))] == ["stdio", "call"]


def test_no_tests_is_never_accepted_and_cpp_takes_stdio_tests_only():
    j = Judge(sbx.default_sandbox(sbx.SandboxConfig())).judge("print(1)", [])
    assert not j.accepted and j.status != "accepted" and j.fraction == 0.0
    with pytest.raises(ValueError, match="stdin/stdout tests only"):
        Judge(sbx.default_sandbox(sbx.SandboxConfig())).judge("int main(){}", [{"fn": "f", "expected": 1}],
                                                             language="cpp")


# ------------------------------------------------------------------------------------------------
# seeds (no sandbox)
# ------------------------------------------------------------------------------------------------
ROW = {"id": "triple", "statement": "Print 3 times n.", "input_spec": "One integer n.", "output_spec": "3n.",
       "reference": "print(3 * int(input()))\n", "wrong": ["print(3 + int(input()))\n"],
       "tests": [{"input": "1\n", "output": "3"}, {"input": "2\n", "output": "6"},
                 {"input": "5\n", "output": "15"}, {"input": "7\n", "output": "21"}]}


def test_seed_schema_defaults_and_refusals(tmp_path):
    s = Seed.from_dict({**ROW, "wrong": "print(0)\n", "source": "hand", "float_tol": "1e-4"})
    assert s.wrong == ["print(0)\n"] and s.time_limit == 2.0 and s.float_tol == 1e-4 and s.difficulty == 1
    assert s.to_dict()["source"] == "hand" and Seed.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="'tests' must be a non-empty list"):
        Seed.from_dict({**ROW, "tests": []})
    with pytest.raises(ValueError, match="'wrong' must hold"):
        Seed.from_dict({**ROW, "wrong": ["   "]})
    with pytest.raises(ValueError, match="duplicate seed id"):
        seeds_from_dicts([ROW, ROW])
    empty = tmp_path / "none.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no seeds"):
        load_seeds(str(empty))


def test_unknown_reward_mode_is_refused():
    with pytest.raises(ValueError, match="reward must be"):
        get_env("code/solve", reward="partial")


# ------------------------------------------------------------------------------------------------
# judging in the sandbox
# ------------------------------------------------------------------------------------------------
def _env(env_id: str, reward: str = "binary", **row):
    """``env_id`` over one seed (ROW with ``row`` over it), never held out."""
    return get_env(env_id, seeds=[Seed.from_dict({**ROW, **row})], include_builtin=False, heldout=0, reward=reward)


def _boxed(text: str) -> str:
    return "\\boxed{" + text + "}"


@needs_bwrap
def test_the_judges_own_time_limit_applies_and_details_say_why():
    judge = Judge(sbx.default_sandbox(sbx.SandboxConfig(time_limit=5.0)), time_limit=0.3)
    j = judge.judge("import time\ntime.sleep(1.0)\nprint(1)\n", [{"input": "", "output": "1"}])
    assert j.status == "time_limit", j.results
    j = judge.judge("print(2)\n", [{"input": "", "output": "1"}, {"input": "", "output": "2"}], stop_on_failure=True)
    assert [r.status for r in j.results] == ["wrong_answer", "skipped"]
    assert j.results[0].detail == "output differs" and j.results[1].detail == "stopped after a failure"


@needs_bwrap
def test_solve_fraction_counts_hidden_tests_after_a_failing_one():
    """Shown: inputs 1 and 2. Hidden: 5 and 7. A program wrong on 5 but right on 7 earns 1/2 (every hidden test is
    run, not only those up to the first failure)."""
    env = _env("code/solve", reward="fraction")
    p = env.generate(0, 1)
    s = env.verify(p, "```python\nn = int(input())\nprint(0 if n == 5 else 3 * n)\n```")
    assert not s.correct and s.reward == pytest.approx(0.5), s.info


@needs_bwrap
def test_solve_uses_the_seeds_time_limit():
    env = _env("code/solve", time_limit=0.3)
    p = env.generate(0, 1)
    s = env.verify(p, "```python\nimport time\ntime.sleep(1.0)\nprint(3 * int(input()))\n```")
    assert not s.correct and s.info["status"] == "time_limit", s.info


THIRD = {"id": "third", "reference": "n = int(input())\nprint(n / 3)\n",
         "wrong": ["n = int(input())\nprint(round(n / 3, 6) if n < 100 else 0)\n"], "float_tol": 1e-4,
         "tests": [{"input": "1\n", "output": "0.33333"}, {"input": "2\n", "output": "0.66667"},
                   {"input": "4\n", "output": "1.33333"}, {"input": "300\n", "output": "100"}]}


@needs_bwrap
def test_a_seeds_float_tolerance_is_used_by_every_task():
    solve = _env("code/solve", **THIRD)
    p = solve.generate(0, 1)
    assert solve.verify(p, solve.reference_response(p)).correct  # prints 0.3333333333333333 for 0.33333
    predict = _env("code/io_predict", **THIRD)
    p = predict.generate(0, 1)
    assert predict.verify(p, _boxed(f"{float(p.answer):.5f}0")).correct, p.answer
    assert not predict.verify(p, _boxed(f"{float(p.answer) + 0.01:.5f}")).correct
    propose = _env("code/io_propose", **THIRD)
    p = propose.generate(0, 1)
    assert propose.verify(p, _boxed(p.answer.strip())).correct, p.meta["target"]
    falsify = _env("code/falsify", **THIRD)
    p = falsify.generate(0, 1)
    assert not falsify.verify(p, _boxed("1")).correct  # 0.333333 is 0.3333333333333333 within 1e-4
    assert falsify.verify(p, _boxed("300")).correct


LEADING_ZERO_VALIDATOR = "s = input().strip()\nassert s == str(int(s)) and 1 <= int(s) <= 10\n"


@needs_bwrap
def test_io_propose_credits_only_valid_inputs_on_which_the_program_runs_cleanly():
    env = _env("code/io_propose", validator=LEADING_ZERO_VALIDATOR)
    p = env.generate(0, 1)
    n = p.answer.strip()
    assert env.verify(p, _boxed(n)).correct
    s = env.verify(p, _boxed("0" + n))  # the reference prints the target, but the validator refuses it
    assert not s.correct and s.format_ok and "validator" in s.info["reason"], s
    crash = {"reference": "t = input().split()\nprint(3 * int(t[0]))\nassert len(t) == 1\n"}
    env = _env("code/io_propose", **crash)
    p = env.generate(0, 1)
    n = p.answer.strip()
    assert env.verify(p, _boxed(n)).correct
    s = env.verify(p, _boxed(n + " x"))  # prints the target, then fails
    assert not s.correct and "fails" in s.info["reason"], s
    s = env.verify(p, _boxed(n + "\n" + "y" * 20001))  # too long: refused unrun
    assert not s.correct and "longer than" in s.info["reason"], s


@needs_bwrap
def test_falsify_credits_a_crash_and_refuses_invalid_inputs():
    crashes = _env("code/falsify", wrong=["n = int(input())\nprint(3 * n)\nassert n != 2\n"])
    p = crashes.generate(0, 1)
    s = crashes.verify(p, _boxed("2"))  # right output, then a crash: a counterexample
    assert s.correct and s.info["candidate"] == "runtime_error", s
    assert not crashes.verify(p, _boxed("3")).correct
    checked = _env("code/falsify", wrong=["n = int(input())\nprint(3 * n if n != 7 else 0)\n"],
                   validator=LEADING_ZERO_VALIDATOR)
    p = checked.generate(0, 1)
    assert checked.verify(p, _boxed("7")).correct
    s = checked.verify(p, _boxed("07"))  # the candidate is wrong there, but the input is not valid
    assert not s.correct and "validator" in s.info["reason"], s
    unchecked = _env("code/falsify", wrong=["n = int(input())\nprint(3 * n if n != 7 else 0)\n"])
    s = unchecked.verify(unchecked.generate(0, 1), _boxed("abc"))  # both crash: the reference failing is no test
    assert not s.correct and "reference fails" in s.info["reason"], s


def test_boxed_tasks_never_ask_about_a_blank_input():
    row = {**ROW, "tests": [{"input": "", "output": "0"}] + ROW["tests"]}
    assert _env("code/io_propose", **row).shown_tests(Seed.from_dict(row)) == [1, 2, 3, 4]
    assert _env("code/io_predict", **row).shown_tests(Seed.from_dict(row)) == [1, 2, 3, 4]
    assert _env("code/solve", **row).shown_tests(Seed.from_dict(row)) == [0, 1, 2, 3, 4]


def test_fences_that_commonmark_does_not_open_or_close():
    from envs.code.envs import extract_code

    # a backtick in the info string: not an opening fence (the lone ``` after it opens an unclosed block)
    assert extract_code("```python `x`\nprint(0)\n```") is None
    # a code line ending in more backticks than the fence does not close it
    assert extract_code("```python\nprint(1)  # ````\nprint(2)\n```") == "print(1)  # ````\nprint(2)\n"
