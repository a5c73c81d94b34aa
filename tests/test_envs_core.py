"""Environment library core: math equivalence, math environments, reasoning-gym adapter, self-check,
`cascade envs` CLI, plug-ins, and the self-check of every registered environment."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from envs import Environment, Score, get_env, list_envs
from envs.check import self_check
from envs.cli import main as envs_main, parse_range
from envs.math import ArithmeticEnv, MathDatasetEnv, math_equal

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


# -- math equivalence ------------------------------------------------------------------------
@pytest.mark.parametrize("pred,gold", [
    ("42", "42"), ("42.0", "42"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac12"), ("-7/3", "-\\frac{7}{3}"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("x^2+2x+1", "(x+1)^2"), ("[1,2)", "[1, 2)"), ("(3, \\infty)", "(3,\\infty)"),
    ("\\{3,-3\\}", "\\{-3, 3\\}"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
    # a decimal equal to the answer exactly; thousands apart by spaces; a subscript or a command's argument
    ("0.25", "\\frac{1}{4}"), ("-1.5", "-\\frac{3}{2}"), ("x = 0.25", "\\frac14"), ("2.5", "\\frac{\\sqrt{25}}{2}"),
    ("0.25", "25\\%"), ("1 000", "1000"), ("12 345 678", "12345678"), ("\\log_2 8", "3"), ("\\frac 1 2", "0.5"),
])
def test_math_equal_accepts_equivalent_forms(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize("pred,gold", [
    ("41", "42"), ("1/3", "0.333"), ("(1,2)", "[1,2)"), ("\\{1,2\\}", "\\{1,2,3\\}"), ("x^2+1", "(x+1)^2"),
    ("\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
    ("", "1"), ("3x9", "3"), ("hello", "5"),
    # a decimal is the number it writes: math-verify's 6-place rounding took these for the exact values
    ("0.333333", "\\frac{1}{3}"), ("1.414214", "\\sqrt{2}"), ("3.141593", "\\pi"), ("x = 1.414214", "\\sqrt{2}"),
    ("-0.142857", "-\\frac{1}{7}"),
    # digits apart by a space are no number (math-verify reads "1 0" as 1*0 and "12 5" as 17)
    ("1 0", "10"), ("12 5", "125"), ("1 0", "0"), ("12 5", "17"), ("3\\ 4", "34"),
])
def test_math_equal_rejects_different_answers(pred, gold):
    assert not math_equal(pred, gold)


def test_math_equal_in_a_thread_with_a_time_bound():
    out = {}

    def work():
        out["easy"] = math_equal("\\frac{6}{4}", "1.5")
        t = time.perf_counter()
        out["hard"] = math_equal("9^{9^{9^{9}}}", "1", timeout=1.0)
        out["hard_s"] = time.perf_counter() - t
        out["after"] = math_equal("2+2", "4")  # the pool recovers after killing a worker

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert not th.is_alive()
    assert out["easy"] is True and out["hard"] is False and out["after"] is True
    assert out["hard_s"] < 1.0 + 30  # the deadline, plus starting a fresh worker on a busy machine


def test_math_equal_never_compares_huge_predictions():
    t = time.perf_counter()
    assert not math_equal("1" * 1_000_000, "1")
    assert time.perf_counter() - t < 1.0


# -- math environments -------------------------------------------------------------------------
def test_math_scoring_rules():
    env = ArithmeticEnv()
    p = env.generate(3, 2)
    ok = env.verify(p, f"so \\boxed{{{p.answer}}}")
    assert (ok.reward, ok.correct, ok.format_ok) == (1.0, True, True)
    wrong = env.verify(p, "\\boxed{123456789}")
    assert (wrong.reward, wrong.correct, wrong.format_ok) == (0.0, False, True)
    none = env.verify(p, "the answer is 5")
    assert (none.reward, none.correct, none.format_ok) == (0.0, False, False)
    # the last boxed answer counts, after any thinking
    assert env.verify(p, f"<think>\\boxed{{0}}</think> \\boxed{{999}} then \\boxed{{{p.answer}}}").correct
    # a response cut inside its thinking has no answer, whatever its thinking boxed (IFEval's checks too)
    cut = env.verify(p, f"<think> so it is \\boxed{{{p.answer}}}, let me check")
    assert (cut.reward, cut.correct, cut.format_ok) == (0.0, False, False)
    assert not env.verify(p, f"<THINK> \\boxed{{{p.answer}}}").correct
    # thinking opened again after the last </think> and never closed: its box is no answer either
    assert not env.verify(p, f"<think>a</think> so \\boxed{{999}}. <think> wait, \\boxed{{{p.answer}}}").correct
    assert env.verify(p, f"<think>a</think> so \\boxed{{{p.answer}}}. <think> wait, \\boxed{{999}}").correct
    import dataclasses

    from envs.ifeval.env import IFEvalEnv

    ie = IFEvalEnv()
    q = dataclasses.replace(ie.generate(0, 0), answer={"instructions": [{"type": "punctuation:no_comma"}]})
    assert not ie.verify(q, "<think>I should write something without commas").correct
    assert ie.verify(q, "<think>a, b</think>Something without commas").correct
    from ttc.rsa import extract_answer

    assert extract_answer("<think>\\boxed{5}") is None and extract_answer("\\boxed{5}") == "5"


@pytest.mark.parametrize("gold,pred,ok", [
    ("12", "BC = 12", True), ("30^\\circ", "\\theta = 30^\\circ", True), ("5", "x_1 = 5", True),
    ("-3", "x_{12} = -3", True), ("7", "f(2) = 7", True), ("10", "10\\ \\text{units}", True), ("10", "10 cm", True),
    ("\\frac{9}{4}", "2\\frac{1}{4}", True), ("2\\frac{1}{4}", "\\frac{9}{4}", True), ("-\\frac{9}{4}", "-2\\frac14", True),
    # hedged or bounded statements are not the number; a unit-less letter is a product
    ("5", "\\text{not } 5", False), ("5", "\\text{at most } 5", False), ("5", "5x", False), ("5", "5 = 5", False),
    ("5", "1" * 5000, False),  # (past int()'s 4,300 digits: a wrong answer, not a verifier error)
])
def test_a_number_answer_with_a_name_unit_or_mixed_fraction(gold, pred, ok):
    """Where the answer is a number, the prediction must be one: named (``BC =``, ``x_1 =``, ``\\theta =``), with a
    unit (``\\text{}`` or a bare word after it), or a mixed number, as math-verify reads them; words before it are
    not dropped (``\\text{not } 5`` scored 1.0)."""
    math = MathDatasetEnv(heldout=0.0)
    s = math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}")
    assert s.correct == ok and "error" not in s.info, (gold, pred, s)


@pytest.mark.timeout(30)
def test_number_parsing_stays_linear_on_runs_of_spaces():
    """The unit-word rule looks behind for one space: a pattern starting with \\s+ backtracked quadratically on a
    long run of spaces (20,000 took 2 s; this 200,000-space answer would take minutes)."""
    from envs.math import plain_number

    assert plain_number("5" + " " * 200_000 + "x1") is None and plain_number("5" + " " * 200_000 + "cm") == 5
    # a command or nothing before a run of spaces and no "=": the name rule's two runs of spaces split it every way
    # (200,000 spaces took 83 s)
    for text in ("\\a" + " " * 200_000 + "x", " " * 200_000 + "x", "\\alpha" + " " * 100_000 + "{a}" + " " * 100_000):
        assert plain_number(text) is None
    assert plain_number("\\theta = 3") == 3 and plain_number("   = 7") == 7


def test_copying_the_question_or_an_unreduced_fraction_earns_nothing():
    """An expression equal to the answer is no answer: math/arith takes an integer or a fraction in lowest
    terms (the question's own expression, copied into the box, was judged correct by value); the dataset
    environment takes a number where the answer is one, and not the question's own expression."""
    env = ArithmeticEnv()
    for seed in range(6):
        p = env.generate(seed, 3)  # fractions: "Compute $...$"
        expr = re.search(r"\$(.+)\$", p.prompt).group(1)
        assert not env.verify(p, f"\\boxed{{{expr}}}").correct, p.prompt
        assert env.verify(p, env.reference_response(p)).correct
        v = Fraction(p.answer.replace("\\frac{", "").replace("}{", "/").replace("}", "")) if "frac" in p.answer \
            else Fraction(p.answer)
        assert env.verify(p, f"\\boxed{{{v.numerator}/{v.denominator}}}").correct == (v.denominator > 1)
        s = env.verify(p, f"\\boxed{{{2 * v.numerator}/{2 * v.denominator}}}")  # the same value, unreduced
        assert not s.correct and s.info["reason"] == "not in lowest terms"
    p = env.generate(1, 0)
    assert env.verify(p, f"\\boxed{{x = {p.answer}}}").correct
    math = MathDatasetEnv(heldout=0.0)
    rows = {r["problem"]: r for r in math.rows}
    for q, echo in [("What is $17 + 25$?", "17 + 25"), ("Simplify $\\sqrt{50}$.", "\\sqrt{50}"),
                    ("Expand $(x + 2)^2$.", "(x + 2)^2"), ("Evaluate $\\log_2 64$.", "\\log_2 64")]:
        p = math.problem(q, rows[q]["answer"], 0, 0)
        assert not math.verify(p, f"\\boxed{{{echo}}}").correct, q
        assert math.verify(p, math.reference_response(p)).correct, q
    p = math.problem("What is $17 + 25$?", "42", 0, 0)
    for ok in ("42", "42.0", "x = 42", "42 \\text{ apples}", "\\textbf{42}", "42^\\circ"):
        assert math.verify(p, f"\\boxed{{{ok}}}").correct, ok
    # a comparison of the question's own numbers is answered by one of them, in final form; an unreduced
    # fraction copied from the question is not simplified
    p = math.problem("Which is larger: $\\frac{1}{2}$ or $\\frac{1}{3}$?", "\\frac12", 0, 0)
    assert math.verify(p, "\\boxed{\\frac{1}{2}}").correct and math.verify(p, "\\boxed{0.5}").correct
    p = math.problem("Simplify $\\frac{6}{8}$.", "\\frac34", 0, 0)
    assert not math.verify(p, "\\boxed{\\frac{6}{8}}").correct and math.verify(p, "\\boxed{\\frac{3}{4}}").correct
    # the instruction echoed after the answer ("... within \\boxed{}") leaves the answer the last box
    p = math.problem("What is $17 + 25$?", "42", 0, 0)
    assert math.verify(p, "\\boxed{42}. Remember: put the final answer within \\boxed{}.").correct
    assert not math.verify(p, "\\boxed{4\\text{ or }2}").correct
    # the question's expression under a name or in brackets is a copy too; the work shown before the answer is not
    p = math.problem("Simplify $\\sqrt{50}$.", "5\\sqrt{2}", 0, 0)
    for copy in ("x = \\sqrt{50}", "(\\sqrt{50})", "{\\sqrt{50}}", "\\left(\\sqrt{50}\\right)"):
        assert not math.verify(p, f"\\boxed{{{copy}}}").correct, copy
    assert math.verify(p, "\\boxed{\\sqrt{50} = 5\\sqrt{2}}").correct
    p = math.problem("Expand $(x + 2)^2$.", "x^2 + 4x + 4", 0, 0)
    assert not math.verify(p, "\\boxed{y = (x+2)^2}").correct and math.verify(p, "\\boxed{y = x^2+4x+4}").correct


def test_hedged_answers_false_equations_and_sets_for_intervals_earn_nothing():
    """Words after a number that change it ("or more", "thousand", "squared") are no unit; an equation answers with
    its last side only when the others name it or equal it (math-verify reads the right side alone); a set is no
    interval (math-verify takes (1, 2) and \\{1, 2\\} for one another); a list of numbers is no thousands number."""
    from envs.math import math_equal, plain_number

    for hedged in ("5 \\text{ or more}", "5 \\text{ at least}", "5 \\text{ million}", "5 thousand", "5 \\text{ squared}",
                   "5 or more", "5 \\text{ dozens}"):
        assert plain_number(hedged) is None, hedged
    for unit in ("5 \\text{ cm}", "5 cm^2", "5 \\text{ square units}", "\\$5", "5\\%", "x = 5"):
        assert plain_number(unit) == 5, unit
    assert plain_number("3, 400") is None and plain_number("3,400") == 3400 and plain_number("3{,}400") == 3400
    arith = ArithmeticEnv()
    p = next(q for q in (arith.generate(s, 3) for s in range(50)) if "frac" in q.answer)
    assert not arith.verify(p, f"\\boxed{{{p.answer} \\text{{ or more}}}}").correct
    assert arith.verify(p, f"\\boxed{{{p.answer}}}").correct
    wrong = [("0 = \\sqrt{2}", "\\sqrt{2}"), ("\\frac{\\pi}{3} = \\frac{\\pi}{4}", "\\frac{\\pi}{4}"), ("x^2 = x^2+1", "x^2+1"),
             ("\\sqrt{2} \\text{ or more}", "\\sqrt{2}"), ("\\{1, 2\\}", "(1, 2)"), ("(1, 2)", "\\{1,2\\}"),
             ("-\\infty, 3", "(-\\infty, 3)"), ("\\sqrt{3} = \\sqrt{2}", "\\sqrt{2}"), ("0 = 3, y = 4", "(3, 4)"),
             ("5", "5 \\text{ or more}"), ("5", "5 or more")]  # (a hedged gold: math-verify read it as {5, more})
    right = [("x = \\sqrt{2}", "\\sqrt{2}"), ("f(x) = x^2+4x+4", "x^2+4x+4"), ("\\overline{AB} = 2\\sqrt3", "2\\sqrt{3}"),
             ("a_n = 2^n", "2^n"), ("\\theta = \\frac{\\pi}{4}", "\\frac{\\pi}{4}"), ("1, 2", "\\{1, 2\\}"),
             ("(-\\infty,3)", "(-\\infty, 3)"), ("y=2x+3", "y = 2x + 3"), ("2\\pi \\text{ cm}", "2\\pi"),
             # (named values, alternatives for a list of answers, an expression naming a number: as before)
             ("x = 3, y = 4", "(3, 4)"), ("x=2 \\text{ or } x=3", "2, 3"), ("a = 1, b = 2", "1, 2"), ("a+b = 7", "7")]
    assert [math_equal(pred, gold) for pred, gold in wrong] == [False] * len(wrong)
    assert [math_equal(pred, gold) for pred, gold in right] == [True] * len(right)


def test_value_words_and_spaced_digits_make_no_number():
    """A word after a number that changes its value ("5 pi", "7 halves", "5 thousandths") is no unit; digits apart by
    a space are one number only as thousands ("12 345"): "1 0" was read as 10 and "12 5" as 125."""
    from envs.math import plain_number

    for text in ("5 pi", "5 \\text{ pi}", "7 \\text{ halves}", "5 \\text{ thousandths}", "3 \\text{ quarters}",
                 "1 \\text{ half}", "2 thirds", "3 \\text{ fourths}", "9 \\text{ tenths}", "4 hundredths", "2 millionths",
                 "1 0", "12 5", "3\\ 4", "3~4", "1\\,0", "0.5 1", "3 1/2", "\\text{1 0}", "1 0000", "1234 567"):
        assert plain_number(text) is None, text
    for text, value in [("7\\text{th}", 7), ("5 \\text{ seconds}", 5), ("1 000", 1000), ("12 345 678", 12345678),
                        ("1\\,000", 1000), ("1~000 \\text{ cm}", 1000), ("-1 000.5", Fraction(-2001, 2)),
                        ("\\frac 1 2", Fraction(1, 2)), ("2 \\frac{1}{4}", Fraction(9, 4))]:
        assert plain_number(text) == value, text
    math = MathDatasetEnv(heldout=0.0)
    for gold, pred in [("5", "5 pi"), ("5", "5 \\text{ pi}"), ("7", "7 \\text{ halves}"), ("5", "5 \\text{ thousandths}"),
                       ("3", "3 \\text{ quarters}"), ("10", "1 0"), ("125", "12 5"), ("34", "3\\ 4"),
                       ("\\sqrt{2}", "1.414214"), ("\\frac{\\pi}{3}", "1.047198")]:
        s = math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}")
        assert not s.correct and "error" not in s.info, (gold, pred, s)
    for gold, pred in [("7", "7\\text{th}"), ("1000", "1 000"), ("12345678", "12 345 678"), ("\\frac{1}{4}", "0.25")]:
        assert math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}").correct, (gold, pred)
    arith = ArithmeticEnv()
    p = next(q for q in (arith.generate(s, 0) for s in range(50)) if len(q.answer.lstrip("-")) > 1 and "frac" not in q.answer)
    assert not arith.verify(p, f"\\boxed{{{' '.join(p.answer)}}}").correct and arith.verify(p, f"\\boxed{{{p.answer}}}").correct


def test_plain_numbers_and_toy_integers():
    from envs.math import plain_number

    for text, value in [("42", 42), ("-3", -3), ("1,000", 1000), ("1{,}000", 1000), ("1\\,000", 1000), ("0.5", 0.5),
                        ("\\frac{1}{2}", 0.5), ("-\\dfrac{7}{2}", -3.5), ("\\frac12", 0.5), ("7/2", 3.5), ("x = 3", 3),
                        ("10\\%", 10), ("\\$5", 5), ("42 \\text{ cm}", 42),
                        # units with a power, unicode minus and degree, a final period, one pair of parentheses,
                        # scientific notation
                        ("25 \\text{ cm}^2", 25), ("6 \\mathrm{~cm}^{2}", 6), ("\u22125", -5), ("30\u00b0", 30),
                        ("\\frac{3}{4}.", 0.75), ("3/4.", 0.75), ("(-5)", -5), ("\\left(-\\frac34\\right)", -0.75),
                        ("1.5\\times10^{6}", 1500000), ("2 \\cdot 10^3", 2000)]:
        assert plain_number(text) == Fraction(value), text
    for text in ("17 + 25", "\\frac{7}{2} - \\frac{5}{2}", "\\sqrt{50}", "2^{10}", "\\gcd(84,126)", "\\infty", "nan",
                 "1,4,4", "(3, 4)", "3\\text{ or }4", "(1,2)"):  # words between numbers leave no number
        assert plain_number(text) is None, text
    toy = get_env("toy/add")
    p = toy.generate(0, 1)
    digits = ",".join(str(p.answer))
    assert toy.verify(p, f"\\boxed{{x = {p.answer}}}").correct
    if len(str(p.answer)) > 1:  # 144 is not "1,4,4", nor Python's 1_4_4
        assert not toy.verify(p, f"\\boxed{{{digits}}}").correct
        assert not toy.verify(p, f"\\boxed{{{digits.replace(',', '_')}}}").correct


def _solve_linear(prompt: str) -> Fraction:
    """Independent solution of the 'a x + b = c x + e' prompts of math/arith."""
    eq = re.search(r"\$([^$]*=[^$]*)\$", prompt).group(1).replace(" ", "")

    def side(s):
        coef, const = Fraction(0), Fraction(0)
        for sign, num, var in re.findall(r"([+-]?)(\d*)(x?)", s):
            if not num and not var:
                continue
            v = Fraction(int(num) if num else 1) * (-1 if sign == "-" else 1)
            if var:
                coef += v
            else:
                const += v
        return coef, const

    (a, b), (c, e) = side(eq.split("=")[0]), side(eq.split("=")[1])
    return (e - b) / (a - c)


def test_arith_linear_answers_match_an_independent_solver():
    env = ArithmeticEnv()
    for seed in range(8):
        for d in (0, 2, 4):
            p = env.generate(seed, d)
            x = _solve_linear(p.prompt)
            pred = str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"
            assert env.verify(p, f"\\boxed{{{pred}}}").correct, (p.prompt, p.answer, pred)


def test_arith_numbers_grow_with_difficulty():
    env = ArithmeticEnv()

    def biggest(d):
        return max(max(map(int, re.findall(r"\d+", env.generate(s, d).prompt.split("Give")[0])))
                   for s in range(20))

    assert biggest(0) < biggest(4) < biggest(10)


def test_math_dataset_env_jsonl_and_parquet(tmp_path):
    rows = [{"problem": f"What is {i}+{i}?", "answer": str(2 * i), "level": f"Level {1 + i % 3}"} for i in range(9)]
    jl = tmp_path / "m.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pqf = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pqf)
    for path in (jl, pqf):
        env = get_env("math", path=str(path))
        assert env.max_difficulty == 2
        for d in range(3):
            for seed in range(5):
                p = env.generate(seed, d)
                assert rows[p.meta["row"]]["level"] == f"Level {d + 1}"
                assert p.prompt.startswith(rows[p.meta["row"]]["problem"])
                assert env.verify(p, f"\\boxed{{{p.answer}}}").correct
        assert env.generate(4, 1).to_dict() == env.generate(4, 1).to_dict()


def test_math_dataset_env_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) problem, answer"):
        MathDatasetEnv(path=bad)
    with pytest.raises(FileNotFoundError):
        MathDatasetEnv(path=tmp_path / "missing.jsonl")
    txt = tmp_path / "m.txt"
    txt.write_text("problem,answer\n1+1?,2\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        MathDatasetEnv(path=txt)


def test_math_dataset_without_levels_ignores_difficulty(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(5)))
    env = MathDatasetEnv(path=f)
    assert env.max_difficulty is None
    assert len(env.rows) + len(env.heldout_rows) == 5 and env.heldout_rows  # a held-out split, even of 5
    assert {env.generate(s, 0).meta["row"] for s in range(40)} == {r["row"] for r in env.rows}


@pytest.mark.parametrize("raw,level", [
    ("Level 3", 3), ("3", 3), (3, 3), (3.0, 3), (4.5, 4.5), ("2.5", 2.5), (" 4.5 ", 4.5), ("-1", -1), ("1e3", 1000),
    ("difficulty: 4.5", 4.5), ("Level 10", 10), ("Level ?", None), ("Level 2-3", None), ("level-3", None),
    ("hard", None), ("", None), (True, None), (None, None), (float("nan"), None), ("inf", None), ([3], None),
])
def test_math_levels_parse_as_numbers(raw, level):
    from envs.math import _as_level

    got = _as_level(raw)
    assert got == level and type(got) is type(level)  # a whole number is an int, as MATH's levels were


def test_math_dataset_ranks_float_and_string_levels(tmp_path):
    """DeepMath/Omni-MATH-style float levels and numeric strings: the distinct levels in order are
    difficulties 0..N-1."""
    levels = [1.0, "2.5", 3, 4.5, "Level 6"]
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i), "difficulty": levels[i % 5]})
                           for i in range(50)))
    env = MathDatasetEnv(path=f, heldout=0)
    assert list(env._by_level) == [1, 2.5, 3, 4.5, 6] and env.max_difficulty == 4
    for d, want in enumerate([1, 2.5, 3, 4.5, 6]):
        got = {env.generate(s, d).meta["level"] for s in range(30)}
        assert got == {want}
        assert {env.rows[env.generate(s, d).meta["row"]]["row"] % 5 for s in range(30)} == {d}
    assert env.generate(0, 9).meta["level"] == 6  # beyond the last level: the last


def test_math_dataset_rows_without_a_level_are_drawn_at_every_level(tmp_path):
    """Rows without a level belong to every level, drawn with their share of the data (here 2/5)."""
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i), "level": [1, 2, 3, None, ""][i % 5]})
                           for i in range(100)))
    env = MathDatasetEnv(path=f, heldout=0)
    assert env.max_difficulty == 2 and len(env._unleveled) == 40
    drawn = set()
    for d in range(3):
        picks = [env.generate(s, d) for s in range(500)]
        drawn |= {p.meta["row"] for p in picks}
        assert {p.meta["level"] for p in picks} == {d + 1, None}
        share = sum(p.meta["level"] is None for p in picks) / len(picks)
        assert 0.33 < share < 0.47, share
    assert drawn == set(range(100))  # every row, leveled or not, is drawn


# -- reasoning-gym adapter -----------------------------------------------------------------------
rg = pytest.importorskip("reasoning_gym")


def test_rg_environment_generates_and_scores():
    env = get_env("rg/basic_arithmetic")
    assert env.family == "rg" and env.max_difficulty > 0
    p = env.generate(0, 0)
    assert p.prompt.endswith("Put your final answer within \\boxed{}.")
    assert env.verify(p, f"\\boxed{{{p.answer}}}").correct
    assert env.verify(p, f"<answer>{p.answer}</answer>").correct
    assert not env.verify(p, "\\boxed{not a number}").correct
    assert env.generate(5, 3).to_dict() == env.generate(5, 3).to_dict()
    # difficulty maps onto the dataset's curriculum levels
    assert env.config(0)[0] != env.config(env.max_difficulty)[0]
    # the top level is harder than the one below (reasoning-gym's last range level repeats the one below's)
    for name in ("rg/base_conversion", "rg/countdown", "rg/letter_counting", "rg/basic_arithmetic"):
        e = get_env(name)
        assert e.config(e.max_difficulty)[0] != e.config(e.max_difficulty - 1)[0], name


def test_rg_problem_verified_after_a_run_time_cap_is_the_problem_generated():
    """envs/caps.py lowers max_difficulty at run time (a slow level): a problem of a higher level generated before,
    whose cache entry is gone, was rebuilt at the lowered level for its verification and graded against another
    item (the reference answer scored 0.05)."""
    from envs.caps import _lower_cap

    e = get_env("rg/countdown")
    p = e.generate(11, 2)  # (level 3 takes 5 s of CPU to generate, twice here)
    ref = e.reference_response(p)
    assert e.verify(p, ref).correct
    _lower_cap(e, 1)
    e._entries.clear()  # evicted from the adapter's cache (a batch of more than 256 problems of it)
    s = e.verify(p, ref)
    assert s.correct and s.reward == 1.0, s.info


def test_the_commands_generate_the_same_problem_in_every_run():
    """reasoning-gym's ransom_note iterates over a set of strings: under Python's per-process hash seed the same
    (seed, difficulty) was another problem in each run; the cascade command runs itself with PYTHONHASHSEED=0."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    outs = {subprocess.run([PY, "-m", "cascade", "envs", "show", "rg/ransom_note", "--seed", "5"], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=120).stdout for _ in range(3)}
    assert len(outs) == 1 and "ransom" in outs.pop().lower()


def test_rg_no_oracle_datasets_are_documented():
    env = get_env("rg/graph_color")
    assert "no gold answer" in env.no_reference_reason
    assert self_check(env, [0], [0]) == []  # every other requirement still holds


def test_listing_does_not_import_reasoning_gym():
    list_envs()  # makes sure the catalogue cache exists
    code = ("import sys; from envs import list_envs; ids = list_envs(); "
            "assert any(i.startswith('rg/') for i in ids); print('reasoning_gym' in sys.modules)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- self-check and CLI ----------------------------------------------------------------------------
class _Broken(Environment):
    """Nondeterministic generation, a reference that fails, a corruption that passes."""

    id = "test/broken"
    calls = 0

    def generate(self, seed, difficulty):
        _Broken.calls += 1
        return self.problem("say 1", "1", seed, difficulty, n=_Broken.calls)

    def check(self, problem, response):
        ok = "x9" in response
        return Score(1.0 if ok else 0.0, ok, True)


def test_self_check_finds_broken_environments():
    fails = self_check(_Broken(), [0], [0])
    text = "\n".join(fails)
    assert "not deterministic" in text
    assert "reference response not correct" in text
    assert "corruption 2 judged correct" in text
    assert self_check(ArithmeticEnv(), [0, 1], [0]) == []


def test_parse_range():
    assert parse_range("0-5") == [0, 1, 2, 3, 4, 5]
    assert parse_range("0,2,4") == [0, 2, 4]
    assert parse_range("3") == [3]
    for bad in ("a", "5-2", "", "-1"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_cli_list_show_check(capsys):
    assert envs_main(["list", "math*"]) == 0
    out = capsys.readouterr().out
    assert "math/arith" in out and "ifeval" not in out
    assert envs_main(["list", "--family", "ifeval"]) == 0
    assert "ifeval" in capsys.readouterr().out
    assert envs_main(["show", "math/arith", "--difficulty", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "## prompt" in out and "## reference response" in out and "correct=True" in out
    assert envs_main(["check", "math*", "ifeval", "--difficulties", "0-2", "--seeds", "2"]) == 0
    assert "3/3 environments pass" in capsys.readouterr().out
    assert envs_main(["check", "tests.test_envs_core:_Broken", "--difficulties", "0", "--seeds", "1"]) == 1
    with pytest.raises(KeyError, match="no environment matches"):
        envs_main(["check", "nothing/*"])


def test_cascade_cli_reports_unknown_env_in_one_line():
    out = subprocess.run([PY, "-m", "cascade", "envs", "show", "math/arth"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "did you mean math/arith" in out.stderr


# -- plug-ins --------------------------------------------------------------------------------------
def test_plugin_package_registers_through_entry_points(tmp_path):
    target = tmp_path / "site"
    pip = subprocess.run([PY, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(ROOT / "tests" / "plugin_example")],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    listed = subprocess.run([PY, "-m", "cascade", "envs", "list", "example/*"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "example/reverse" in listed.stdout
    code = (
        "from envs import get_env; from envs.check import self_check\n"
        "for name in ('example/reverse', 'cascade_plugin_example.reverse:ReverseEnv'):\n"
        "    e = get_env(name); p = e.generate(1, 2)\n"
        "    assert e.verify(p, '\\\\boxed{' + p.answer + '}').correct, p\n"
        "    assert self_check(e, [0, 3], [0, 1]) == [], self_check(e, [0, 3], [0, 1])\n"
        "print(get_env('example/reverse').id)\n"
    )
    used = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert used.returncode == 0, used.stderr
    assert used.stdout.strip() == "example/reverse"
    checked = subprocess.run([PY, "-m", "cascade", "envs", "check", "example/reverse"], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_broken_plugin_is_left_out_and_the_others_load(monkeypatch):
    """A plug-in whose module fails to import (a missing dependency) is warned about and left out; the built-ins
    and the plug-ins listed after it load (it failed the process's first get_env, and those after it for good)."""
    import importlib.metadata

    import envs.base as base

    class EP:
        def __init__(self, name, load):
            self.name, self.value, self.load = name, f"{name}:Env", load

    def missing():
        raise ModuleNotFoundError("No module named 'absent_dependency'")

    class Good(base.Environment):
        id = "plugtest/good"

        def generate(self, seed, difficulty):
            return base.Problem(prompt="say 1", answer="1")

        def check(self, problem, response):
            return base.Score(1.0, True, True)

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [EP("plugtest/bad", missing), EP("plugtest/good", lambda: Good)])
    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr(base, "PLUGIN_ERRORS", {})
    try:
        with pytest.warns(UserWarning, match="plug-in 'plugtest/bad'.*absent_dependency"):
            assert type(get_env("toy/add")).__name__ == "AddEnv"
        assert get_env("plugtest/good").verify(Good().generate(0, 0), "1").correct
        assert "absent_dependency" in base.PLUGIN_ERRORS["plugtest/bad"]
    finally:
        base._REGISTRY.pop("plugtest/good", None)


# -- every registered environment ------------------------------------------------------------------
def _self_check_grid(env_id: str) -> list[str]:
    """One environment's points (see the test below): the failures."""
    from envs.check import check_one

    _, fails, dt = check_one(env_id, [0], [0])
    # (the code environments' difficulties 1-3 at seeds 0 and 1: tests/test_code_envs.py::test_self_check; a point
    # of code/arc or code/falsify is seconds of sandboxed programs)
    if fails or env_id.startswith(("rg/", "code/")):
        return fails
    if dt > 0.5:
        return check_one(env_id, [3], [1])[1]
    if env_id.startswith(("rc/", "rlve/")):  # the packages' own generators: the middle and the top of the range
        return check_one(env_id, [3, 5], [0])[1]
    _, fails, dt = check_one(env_id, list(range(1, 6)), [0])
    if not fails and dt < 0.3:
        fails += check_one(env_id, list(range(6)), [1, 2])[1]
    return fails


def test_every_registered_environment_passes_the_self_check():
    """`cascade envs check` over the whole registry: every difficulty 0-5 at seed 0, then seeds 1 and 2
    too where those six points took under 0.3 s; where one point already takes seconds (reasoning-gym,
    sandboxed code, whose other points tests/test_code_envs.py checks) fewer points, and the adapters of
    reasoning-core and RLVE-Gym (whose own generators tests/test_envs_adapters.py checks) difficulties 0, 3
    and 5. (The 18-point grid for every environment
    took ~100 s of this suite, half of it reasoning-core's, whose points get slower with difficulty; in one
    process, 94 s with every difficulty for those adapters, reasoning-core 48 s and RLVE 31 s of it, 55 s
    with these points.) Two worker processes share the environments (this suite's machines have two
    cores)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from envs.check import expand_ids

    ids = expand_ids(None)
    assert {"math", "math/arith", "ifeval"} <= set(ids)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as ex:
        fresh = set(ex.submit(expand_ids, None).result())  # environments other tests registered here: in this process
        failures = [f for fails in ex.map(_self_check_grid, [i for i in ids if i in fresh], chunksize=4) for f in fails]
    failures += [f for i in ids if i not in fresh for f in _self_check_grid(i)]
    assert not failures, "\n".join(failures[:40])


def _last_boxed_by_scanning(text):
    """The reference: from the last ``\\boxed`` backwards, the first whose braces close (depth count) around
    something other than spaces."""
    idx = text.rfind("\\boxed")
    while idx >= 0:
        j = idx + len("\\boxed")
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            depth, k = 0, j
            while k < len(text):
                if text[k] == "\\":  # an escaped character (\{, \}, \\) is no brace
                    k += 2
                    continue
                depth += (text[k] == "{") - (text[k] == "}")
                if depth == 0:
                    if text[j + 1:k].strip():
                        return idx, text[j + 1:k].strip()
                    break
                k += 1
        idx = text.rfind("\\boxed", 0, idx)
    return None


def test_last_boxed_agrees_with_a_brace_scan_and_stays_linear():
    import random

    from envs.base import last_boxed, last_boxed_span

    rng = random.Random(0)
    parts = ["\\boxed", "\\boxed ", "{", "}", " ", "x", "12", "\\box", "ed{", "\\{", "\\}", "\\\\", "\\"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
        span = last_boxed_span(text)
        assert span == _last_boxed_by_scanning(text), text
        assert last_boxed(text) == (None if span is None else span[1])
    assert last_boxed("a \\boxed{1} b \\boxed{ {2} } c \\boxed{3") == "{2}"
    assert last_boxed_span("}} \\boxed  {x}") == (3, "x") and last_boxed(None) is None
    # a degenerate output of unclosed \boxed{ (a collapsed policy): the scan above is quadratic in
    # them (28 KB took 10 s); one pass over the braces is not
    t = time.perf_counter()
    assert last_boxed("\\boxed{" * 40_000) is None and last_boxed("\\boxed{" * 40_000 + "}") is None
    assert last_boxed("\\boxed{" * 40_000 + "x}") == "x"
    assert time.perf_counter() - t < 5


def test_last_boxed_takes_escaped_braces_as_characters():
    r"""LaTeX's literal braces \{ and \} group nothing: a piecewise answer (\left\{ ... \right.) was no box at all, so
    a retracted earlier box was graded instead; \boxed{5\}} gave "5\"."""
    from envs.base import last_boxed

    piecewise = "f(x)=\\left\\{\\begin{array}{ll} x & x>0 \\\\ 0 & x\\le 0\\end{array}\\right."
    assert last_boxed(f"\\boxed{{{piecewise}}}") == piecewise
    assert last_boxed(f"At first \\boxed{{2}}, but no: \\boxed{{{piecewise}}}") == piecewise
    assert last_boxed("\\boxed{5\\}}") == "5\\}" and last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed{x \\in [0, 1\\}}") == "x \\in [0, 1\\}"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}" and last_boxed("\\boxed{a \\\\{b}}") == "a \\\\{b}"
    assert last_boxed("a \\\\{b} \\boxed{3}") == "3" and last_boxed("\\boxed{2} \\boxed{\\\\}") == "\\\\"
    assert last_boxed("\\boxed{1} \\boxed{2\\}") == "1"  # (its brace escaped, the last box never closes)
    math = MathDatasetEnv(heldout=0.0)
    p = math.problem("Find it.", "2", 0, 0)
    assert not math.verify(p, f"At first I guessed \\boxed{{2}}, but the answer is \\boxed{{{piecewise}}}").correct


def test_a_box_of_only_spaces_is_no_answer_and_an_earlier_box_counts():
    """A box holding only whitespace is skipped like an empty one (the last non-empty box is the answer)."""
    from envs.base import last_boxed

    assert last_boxed("\\boxed{5} then \\boxed{ }") == "5" and last_boxed("\\boxed{  \n }") is None


def test_toy_integers_take_thousands_commas_only_between_groups_of_three():
    """``1,44`` is not 144 (nor ``14,4``); ``1,440`` is 1440."""
    from envs.base import Problem

    toy = get_env("toy/add")
    p, q = Problem("?", 144, "toy/add"), Problem("?", 1440, "toy/add")
    assert not toy.verify(p, "\\boxed{1,44}").correct and not toy.verify(p, "\\boxed{14,4}").correct
    assert toy.verify(q, "\\boxed{1,440}").correct and toy.verify(p, "\\boxed{144}").correct


def test_answer_tags_and_boxes_take_whichever_complete_one_comes_last():
    from envs.adapted import BoxedOrTagged, last_tagged_or_boxed

    cases = {
        "<answer>1</answer> \\boxed{2}": "2",
        "\\boxed{2} <answer>1</answer>": "1",
        "\\boxed{2} <answer>1</answer> \\boxed{3": "1",  # the last \boxed is unclosed: the tag is later
        "<answer>1</answer> \\boxed{2} <answer>3": "2",
        "\\boxed{2} <answer>1</answer> <answer>3": "1",
        "<answer>" * 50_000: None,
    }
    for text, want in cases.items():
        assert BoxedOrTagged().extract(text) == want, text[:80]
        assert last_tagged_or_boxed(" " + text + " ") == want


# -- verifying many responses at once ---------------------------------------------------------
class _Waiting(Environment):
    """A verifier that waits on something else (as the sandbox and the math workers do): each check
    meets ``barrier``, which opens only when ``parties`` checks are inside it at the same time."""

    concurrent_verify = True

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=20)
        self.threads: set[str] = set()

    def generate(self, seed, difficulty):
        return self.problem(f"{seed}?", str(seed), seed, difficulty)

    def check(self, problem, response):
        self.threads.add(threading.current_thread().name)
        self.barrier.wait()
        ok = response == problem.answer
        return Score(float(ok), ok, True)


class _Plain(_Waiting):
    concurrent_verify = False

    def check(self, problem, response):
        self.threads.add(threading.current_thread().name)
        ok = response == problem.answer
        return Score(float(ok), ok, True)


def test_verify_all_runs_waiting_verifiers_workers_at_a_time_and_keeps_the_order():
    from envs import verify_all, verify_workers

    wait, plain = _Waiting(4), _Plain(1)
    items = [(wait if i % 3 else plain, wait.generate(i, 0), str(i) if i % 2 else "no") for i in range(13)]
    scores = verify_all(items, workers=4)  # 8 waiting checks pass a 4-party barrier twice: 4 at a time
    assert [s.correct for s in scores] == [bool(i % 2) for i in range(13)]
    assert wait.barrier.n_waiting == 0 and not wait.barrier.broken
    assert len(wait.threads) == 4 and all(t.startswith("cascade-verify") for t in wait.threads)
    assert plain.threads == {threading.current_thread().name}  # the others run here, one after another
    one = _Waiting(1)  # workers=1: every check here (a barrier of 2 would time out)
    assert [s.correct for s in verify_all([(one, one.generate(i, 0), str(i)) for i in range(3)], 1)] == [True] * 3
    assert one.threads == {threading.current_thread().name}
    assert verify_workers(3) == 3 and 1 <= verify_workers(0) <= 8
    assert {type(get_env(e)).concurrent_verify for e in ("code/solve", "code/arc", "math/arith")} == {True}
    assert not get_env("toy/add").concurrent_verify and not get_env("ifeval").concurrent_verify


def test_verify_all_hands_each_environment_its_responses_at_once_and_survives_a_failing_override():
    from envs import verify_all

    class Batched(_Plain):
        calls: list = []

        def verify_many(self, items):
            Batched.calls.append(len(items))
            return [self.verify(p, r) for p, r in items]

    class Broken(_Plain):
        def verify_many(self, items):
            raise RuntimeError("batched scoring failed")

    a, b, c = Batched(1), Broken(1), _Plain(1)
    items = [(env, env.generate(i, 0), str(i) if i % 2 else "no") for i in range(9) for env in (a, b, c)]
    scores = verify_all(items)
    assert [s.correct for s in scores] == [bool(i % 2) for i in range(9) for _ in range(3)]
    assert Batched.calls == [9]  # one call with all of its nine responses, in order


def test_a_check_that_returns_no_score_is_a_verifier_error_not_a_crash():
    class Wrong(Environment):
        def generate(self, seed, difficulty):
            return self.problem(f"Q{seed}", "a", seed, difficulty)

        def check(self, problem, response):
            return 1.0

    w = Wrong()
    s = w.verify(w.generate(1, 0), "\\boxed{a}")
    assert s.reward == 0.0 and not s.correct and "returned float, not a Score" in s.info["error"]


def test_registering_a_taken_id_fails_at_the_decorator_and_dotted_paths_get_their_name(tmp_path, monkeypatch):
    from envs import register

    class Clash(Environment):
        pass

    with pytest.raises(ValueError, match="cannot register .*Clash as 'gym/sudoku': the id is taken by"):
        register("gym/sudoku")(Clash)
    assert get_env("toy/add").id == "toy/add"  # the registry is intact
    (tmp_path / "unregistered_env_mod.py").write_text(
        "from envs import Environment\n"
        "class Parity(Environment):\n"
        "    def generate(self, seed, difficulty):\n"
        "        return self.problem(str(self.rng(seed, difficulty).random()), 'yes', seed, difficulty)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = get_env("unregistered_env_mod:Parity")
    assert env.id == "unregistered_env_mod:Parity" and env.generate(0, 0).env_id == env.id


def test_toy_environments_stop_where_the_verifier_reads_their_answers():
    """toy/add and toy/max had no cap: from d = 189 (add) and 256 (max) the answers outgrew the verifier's 64
    digits, so the reference response scored 0 (and past ~12,900 generation itself failed); a thousands-separated
    answer counted its commas. Their top levels verify now, and the cap is where 64 digits stop."""
    from envs.base import get_env

    for env_id, top in (("toy/add", 188), ("toy/max", 255)):
        env = get_env(env_id)
        assert env.max_difficulty == top
        for d in (top - 1, top):
            for seed in range(6):
                p = env.generate(seed, d)
                assert env.verify(p, env.reference_response(p)).correct, (env_id, d, seed)
        beyond = [env.generate(seed, top + 1) for seed in range(6)]  # (what the cap keeps a curriculum from)
        assert not all(env.verify(p, env.reference_response(p)).correct for p in beyond)
    p = get_env("toy/add").generate(0, 140)
    assert get_env("toy/add").verify(p, f"\\boxed{{{int(p.answer):,}}}").correct  # 47 digits with 15 commas


def test_toy_max_lists_two_plus_d_numbers_with_one_more_digit_every_4_levels():
    """toy/max at difficulty d: 2 + d numbers, each below 10 ** (1 + d // 4), the answer their maximum."""
    from envs.base import get_env

    env = get_env("toy/max")
    for d, bound in ((0, 10), (3, 10), (4, 100), (7, 100), (8, 1000)):
        for seed in range(5):
            p = env.generate(seed, d)
            word, *xs = p.prompt.split("\n")[0].split()  # (the instruction follows the list)
            assert word == "max" and len(xs) == 2 + d and all(0 <= int(x) < bound for x in xs)
            assert int(p.answer) == max(map(int, xs))


def test_a_taken_id_refuses_a_factory_and_a_reward_that_is_no_number_scores_0():
    """register(id, factory=...) for a taken id was accepted silently (never used, or every later lookup
    failed); a check returning Score(None, ...) made verify raise, and verify_all with it."""
    from envs.base import Environment, Problem, Score, register, verify_all

    list_envs()
    with pytest.raises(ValueError, match="cannot register factory .* as 'toy/add': the id is taken"):
        register("toy/add", factory=lambda: None)

    class NoNumber(Environment):
        def check(self, problem, response):
            return Score(None, False, True)

    p = Problem("q", 1, "x", 0, 0, {})
    s = NoNumber().verify(p, "r")
    assert (s.reward, s.info["reason"]) == (0.0, "verifier error") and "not a number" in s.info["error"]
    assert [x.reward for x in verify_all([(NoNumber(), p, "r")] * 2)] == [0.0, 0.0]


def test_cli_refuses_a_negative_difficulty_and_a_time_limit_below_0():
    for argv, msg in ((["show", "toy/add", "-d", "-3"], "--difficulty must be >= 0"),
                      (["check", "toy/add", "--env-limit", "-1"], "--env-limit must be > 0 seconds")):
        with pytest.raises(ValueError, match=msg):
            envs_main(argv)


def test_answers_in_common_latex_and_sentence_forms_are_read():
    """math/arith refused a right fraction written ``\\displaystyle\\frac{8}{3}``, ``{\\frac{8}{3}}`` or
    ``-\\left(\\frac{6}{7}\\right)`` ("not an integer or a fraction"); toy's integer answers refused ``333.``, ``$333$``
    and ``\\textbf{333}``. Wrong values, tuples and sets stay refused."""
    from envs.math import plain_number

    arith = get_env("math/arith")
    p = arith.generate(0, 0)
    assert p.answer == "\\frac{8}{3}"
    for r in ("\\displaystyle\\frac{8}{3}", "{\\frac{8}{3}}", "\\displaystyle{\\frac{8}{3}}"):
        assert arith.verify(p, f"\\boxed{{{r}}}").correct, r
    q = arith.generate(0, 2)
    assert q.answer == "-\\frac{6}{7}"
    for r, ok in (("-\\left(\\frac{6}{7}\\right)", True), ("-(6/7)", True), ("(6/7)", False), ("-(-6/7)", False)):
        assert arith.verify(q, f"\\boxed{{{r}}}").correct is ok, r
    assert plain_number("{1,234}") is None and plain_number("(1,234)") is None
    add = get_env("toy/add")
    t = add.generate(3, 5)
    for r, ok in ((f"{t.answer}.", True), (f"${t.answer}$", True), (f"\\textbf{{{t.answer}}}", True),
                  (f"{int(t.answer) + 1}.", False), (f"{t.answer}..", False)):
        assert add.verify(t, f"\\boxed{{{r}}}").correct is ok, r


# -- the self-check's other rules, and the base contract's edges ------------------------------------
class _Flawed(Environment):
    """One flaw per switch: a blank prompt, an answer JSON cannot hold, a slow verify, a corruption-blind check,
    a reference that fails (exempt with a ``no_reference_reason``), problems handed out in turn (seed ignored)."""

    id = "test/flawed"

    def __init__(self, flaw=""):
        self.flaw, self.turn = flaw, 0

    def generate(self, seed, difficulty):
        from envs import Problem

        if self.flaw == "blank":
            return Problem("  \n ", "1", self.id, seed, difficulty)
        if self.flaw == "set":
            return self.problem("say 1", {1}, seed, difficulty)
        if self.flaw == "in_turn":              # a shared cycle of 3 problems: regenerating in order looks fine
            self.turn += 1
            return self.problem(f"say {self.turn % 3}", str(self.turn % 3), seed, difficulty)
        return self.problem(f"say {seed}", str(seed), seed, difficulty)

    def check(self, problem, response):
        if self.flaw == "slow":
            time.sleep(0.05)
        if self.flaw in ("no_ref", "exempt"):
            return Score(0.0, False, True)
        ok = self.extract(response) == problem.answer or self.flaw == "lenient"
        return Score(float(ok), ok, True)


def test_self_check_finds_each_flaw_and_passes_a_sound_environment():
    assert self_check(_Flawed(), [0, 1], [0, 1]) == []
    assert any("non-empty prompt" in f for f in self_check(_Flawed("blank"), [0], [0]))
    assert any("not JSON-serialisable" in f for f in self_check(_Flawed("set"), [0], [0]))
    assert any("verify took" in f for f in self_check(_Flawed("slow"), [0], [0], time_limit=0.01))
    assert self_check(_Flawed("slow"), [0], [0], time_limit=1.0) == []

    class SlowByDefault(_Flawed):
        verify_time_limit = 0.01            # the environment's own limit when none is given

    assert any("verify took" in f for f in self_check(SlowByDefault("slow"), [0], [0]))
    assert any("corruption 0 judged correct" in f for f in self_check(_Flawed("lenient"), [0], [0]))
    assert any("reference response not correct" in f for f in self_check(_Flawed("no_ref"), [0], [0]))

    class Exempt(_Flawed):
        no_reference_reason = "graded by validity only"

    assert self_check(Exempt("exempt"), [0], [0]) == []
    fails = self_check(_Flawed("in_turn"), [0], [0, 1, 2])   # the second pass runs in the other order
    assert any("not deterministic" in f for f in fails)


def test_verify_bounds_rewards_and_refuses_non_string_responses():
    from envs import Problem

    class Says(Environment):
        def __init__(self, reward):
            self.reward = reward

        def check(self, problem, response):
            return Score(self.reward, False, True)

    p = Problem("q", 1, "x", 0, 0, {})
    assert [Says(r).verify(p, "r").reward for r in (float("nan"), -5.0, 7.0, -0.25)] == [0.0, -1.0, 1.0, -0.25]
    s = Says(1.0).verify(p, None)
    assert (s.reward, s.correct, s.info["reason"]) == (0.0, False, "response is not a string")


def test_strip_think_and_open_think():
    from envs.base import after_open_think, open_think, strip_think

    assert strip_think("plain \\boxed{1}") == "plain \\boxed{1}"
    assert strip_think("<think>a \\boxed{1}</think> answer \\boxed{2}") == " answer \\boxed{2}"
    assert strip_think("<think>cut inside \\boxed{1}") == ""                 # never closed: no answer yet
    assert strip_think("<think>a</think> b <think>again \\boxed{3}") == " b "  # a thinking opened again
    assert open_think("<|im_start|>assistant\n<think>\n") == "<think>\n"
    assert open_think("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""
    assert open_think("<|im_start|>assistant\n") == ""
    assert after_open_think("<think>\nx</think>y", "<think>\n") == "x</think>y"
    assert after_open_think("<think>\n\nx</think>y", "<think>\n") == "\nx</think>y"
    assert after_open_think("<think>x</think>y", "<think>\n") == "x</think>y"
    assert after_open_think("<think>\nx</think>y", "<think>\n\n") == "x</think>y"  # the tag, then its newline
    assert after_open_think("y", "<think>\n") == "</think>\n\ny"
    assert after_open_think("y", "") == "y"


def test_problem_seeds_are_the_environments_own_and_the_instruction_is_optional():
    from envs import Problem

    class A(Environment):
        id = "test/a"

    class B(Environment):
        id = "test/b"
        instruction = ""

    assert A().rng(3, 1).random() == A().rng(3, 1).random() != B().rng(3, 1).random()
    assert A().rng(3, 1).random() != A().rng(3, 2).random()
    assert A().problem("Q", 1, 0, 0).prompt == "Q\n\nPut your final answer within \\boxed{}."
    assert B().problem("Q", 1, 0, 0).prompt == "Q"
    assert A().corruptions(Problem("q", 7, "x", 0, 0, {})) == ["", "I don't know.", "\\boxed{7x9}"]


def test_verify_workers_caps_auto_at_8(monkeypatch):
    from envs import verify_workers

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert (verify_workers(0), verify_workers(-1), verify_workers(12)) == (8, 8, 12)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert verify_workers(0) == 1


def test_registry_edges(monkeypatch):
    import functools

    import envs.base as base
    from envs.base import env_info, register

    list_envs()
    for name in ("_REGISTRY", "_FACTORIES", "_FACTORY_INFO"):  # registrations here stay in this test
        monkeypatch.setattr(base, name, dict(getattr(base, name)))
    register("test/same_factory", factory=functools.partial(ArithmeticEnv))
    register("test/same_factory", factory=functools.partial(ArithmeticEnv))  # the same factory again: fine
    with pytest.raises(ValueError, match="cannot register factory .* the id is taken"):
        register("test/same_factory", factory=lambda: ArithmeticEnv())

    class Clash(Environment):
        pass

    with pytest.raises(ValueError, match="cannot register .*Clash as 'test/same_factory'"):
        register("test/same_factory")(Clash)
    assert env_info("test/same_factory") == {"id": "test/same_factory", "family": "misc", "description": ""}

    @register("test/documented")
    class Documented(Environment):
        """First line of the docstring.

        More."""

    assert env_info("test/documented")["description"] == "First line of the docstring."


# -- behaviour pinned by mutation testing ----------------------------------------------------------
def _evaluate_fraction_prompt(prompt: str) -> Fraction:
    """Independent value of a math/arith 'Compute $...$' prompt: Python's own precedence over Fractions."""
    expr = re.search(r"\$(.+)\$", prompt).group(1)
    py = expr.replace("\\left(", "(").replace("\\right)", ")").replace("\\cdot", "*")
    py = re.sub(r"\\frac\{(\d+)\}\{(\d+)\}", r"Fraction(\1, \2)", py)
    assert re.fullmatch(r"[\sFraction(),\d*+-]+", py), py
    return eval(py, {"Fraction": Fraction})  # noqa: S307 - the generator's own arithmetic text


def test_arith_fraction_answers_match_an_independent_evaluator():
    """The fraction problems' answers (odd difficulties) are the value of the printed expression, products before
    sums and differences subtracted: checked against Python's evaluation of the same text."""
    from envs.math import plain_number

    env = ArithmeticEnv()
    kinds = set()
    for seed in range(12):
        for d in (1, 3, 5, 7):
            p = env.generate(seed, d)
            want = _evaluate_fraction_prompt(p.prompt)
            kinds |= {op for op in ("+", " - ", "\\cdot") if op in p.prompt.split("Give")[0]}
            assert plain_number(p.answer) == want, (p.prompt, p.answer, want)
            pred = str(want.numerator) if want.denominator == 1 else f"{want.numerator}/{want.denominator}"
            assert env.verify(p, f"\\boxed{{{pred}}}").correct, (p.prompt, pred)
    assert kinds == {"+", " - ", "\\cdot"}  # every operator was exercised


def test_arith_takes_a_fraction_not_its_decimal_and_no_denominator_of_one():
    """math/arith asks for an integer or a fraction in lowest terms: 3.4 is no answer to 17/5 (a decimal only for a
    whole number: 1.0 answers 1), and 1/1 or \\frac{1}{1} is no integer in lowest terms."""
    env = ArithmeticEnv()
    p = env.generate(2, 0)
    assert p.answer == "\\frac{17}{5}"
    for r, ok in (("17/5", True), ("\\frac{17}{5}", True), ("3.4", False), ("x = 3.4", False), ("3.40", False)):
        assert env.verify(p, f"\\boxed{{{r}}}").correct is ok, r
    q = env.generate(0, 1)
    assert q.answer == "1"
    for r, ok in (("1", True), ("1.0", True), ("1/1", False), ("\\frac{1}{1}", False), ("2/2", False)):
        assert env.verify(q, f"\\boxed{{{r}}}").correct is ok, r


def test_math_equal_edges_of_missing_and_long_answers():
    """No answer (None) equals nothing, not even the text "None"; a long right answer (past 20 times the gold's
    length but under 2,000 characters) is still compared."""
    assert not math_equal(None, "None") and not math_equal("None", None) and not math_equal(None, None)
    long_right = "\\frac{" + "+".join(["1"] * 14) + "}{2}"  # 37 characters for a 1-character gold
    assert len(long_right) > 20 and math_equal(long_right, "7") and not math_equal(long_right, "8")


def test_plain_number_negative_powers_of_ten_single_letters_and_short_digit_groups():
    """1.5 x 10^{-3} is 0.0015 (not 1500); a single letter after a number is a variable, no unit ("5 x" is 5x); only
    groups of three digits are thousands ("1 00" and "12 34" are no numbers); a zero denominator is no number."""
    from envs.math import plain_number

    assert plain_number("1.5\\times10^{-3}") == Fraction(3, 2000) and plain_number("2\\cdot 10^{-2}") == Fraction(1, 50)
    assert plain_number("5 cm") == 5 and plain_number("5 x") is None and plain_number("5 m") is None
    for text in ("1 00", "12 34", "1 00 000", "2\\frac{1}{0}", "1/0", "\\frac{1}{0}"):
        assert plain_number(text) is None, text
    math = MathDatasetEnv(heldout=0.0)
    for gold, pred in (("1500", "1.5\\times10^{3}"), ("0.0015", "1.5\\times10^{-3}")):
        assert math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}").correct, (gold, pred)
    for gold, pred in (("1500", "1.5\\times10^{-3}"), ("5", "5 x"), ("100", "1 00")):
        s = math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}")
        assert not s.correct and "error" not in s.info, (gold, pred, s)


def test_answers_that_are_equations_or_alternatives_compare_whole():
    """Where the answer itself is an equation, an equivalent equation answers it (its sides need not name the answer);
    where the answer itself has words ("2 or 3"), a prediction with words is compared, not refused as hedged."""
    for pred, gold in (("2x + 3 = y", "y = 2x + 3"), ("y - 2x = 3", "y = 2x + 3"), ("y^2 + x^2 = 4", "x^2+y^2=4"),
                       ("3 \\text{ or } 2", "2 \\text{ or } 3"),
                       ("x \\geq 5 \\text{ or } x \\le 1", "x \\le 1 \\text{ or } x \\ge 5")):
        assert math_equal(pred, gold), (pred, gold)
    for pred, gold in (("2x + 4 = y", "y = 2x + 3"), ("3 \\text{ or } 4", "2 \\text{ or } 3")):
        assert not math_equal(pred, gold), (pred, gold)


def test_a_gold_listing_answers_with_or_takes_named_answers_not_false_equations():
    """A gold written with "or"/"and" ("2 \\text{ or } 3") is a list of answers, as "2, 3" is: named answers
    ("x = 2 \\text{ or } x = 3") are right (they were refused); in any list, an answer under a false equation
    ("0 = 2, 0 = 3") is wrong (it was credited), as it is for a single answer."""
    right = [("x = 2 \\text{ or } x = 3", "2 \\text{ or } 3"), ("x = 2 or x = 3", "2 or 3"), ("3 \\text{ and } 2", "2, 3"),
             ("x_1 = 2, x_2 = 3", "2, 3"), ("\\{x = 2, x = 3\\}", "\\{2, 3\\}"), ("y = 2, x = 1", "x = 1, y = 2")]
    wrong = [("x = 2 \\text{ or } x = 4", "2 \\text{ or } 3"), ("2", "2 \\text{ or } 3"), ("0 = 2, 0 = 3", "2, 3"),
             ("0 = 2 \\text{ or } 0 = 3", "2 \\text{ or } 3"), ("\\{0 = 2, 0 = 3\\}", "\\{2, 3\\}"), ("x = 2 = 2, 3", "2, 3")]
    assert [math_equal(pred, gold) for pred, gold in right] == [True] * len(right)
    assert [math_equal(pred, gold) for pred, gold in wrong] == [False] * len(wrong)
    math = MathDatasetEnv(heldout=0.0)
    assert math.verify(math.problem("Solve $x^2 - 5x + 6 = 0$.", "2 \\text{ or } 3", 0, 0),
                       "\\boxed{x = 2 \\text{ or } x = 3}").correct


def test_arith_linear_equations_never_have_a_zero_coefficient_on_x():
    """a x + b = c x + e always has a ≠ 0 (at difficulty 0, where c is 0, a = 0 would leave no x to solve for)."""
    env = ArithmeticEnv()
    for seed in range(150):
        for d in (0, 2):
            p = env.generate(seed, d)
            eq = re.search(r"\$([^$]*=[^$]*)\$", p.prompt).group(1)
            assert re.search(r"x", eq.split("=")[0]) and not re.search(r"(?<![\d.])0x", eq), p.prompt


def test_a_copied_product_of_brackets_and_a_bracketed_number_before_equals_earn_nothing():
    """The question's own expression is a copy also when it opens and closes with brackets that are not one pair
    ("(x+1)(x-1)"); a bracketed number before "=" names nothing ("(1) = \\sqrt{2}" is a false equation, "f(1) = ..."
    names the answer)."""
    math = MathDatasetEnv(heldout=0.0)
    p = math.problem("Expand $(x+1)(x-1)$.", "x^2 - 1", 0, 0)
    assert not math.verify(p, "\\boxed{(x+1)(x-1)}").correct and math.verify(p, "\\boxed{x^2-1}").correct
    assert not math_equal("(1) = \\sqrt{2}", "\\sqrt{2}") and math_equal("f(1) = \\sqrt{2}", "\\sqrt{2}")


def test_a_bracketed_number_before_equals_is_no_name_for_a_plain_number():
    """``(7) = 5`` is a false equation, not ``name = 5``: the plain-number path took the bracket for a name (as in
    ``f(2) = 5``) and credited it for gold 5, while ``0 = 5`` was refused."""
    from envs.math import plain_number

    math = MathDatasetEnv(heldout=0.0)
    p = math.problem("Find it.", "5", 0, 0)
    assert plain_number("(7) = 5") is None and not math.verify(p, "\\boxed{(7) = 5}").correct
    for named in ("x = 5", "f(2) = 5", "\\theta = 5", "x_{1} = 5"):
        assert plain_number(named) == 5 and math.verify(p, f"\\boxed{{{named}}}").correct, named


def test_a_number_answer_keeps_its_sign_and_a_choice_among_the_questions_expressions_counts():
    """The dataset environment compares plain numbers by value, sign included; the question's own expression is a
    copy unless it is the answer as written (a choice between the question's expressions); an aggregation problem's
    copies are read from its question (``meta["question"]``), not from the candidates its prompt shows."""
    import dataclasses

    math = MathDatasetEnv(heldout=0.0)
    for gold, pred, ok in (("-3", "3", False), ("3", "-3", False), ("-\\frac{9}{4}", "\\frac{9}{4}", False),
                           ("-3", "x = -3", True), ("-\\frac{9}{4}", "-2.25", True)):
        s = math.verify(math.problem("Find it.", gold, 0, 0), f"\\boxed{{{pred}}}")
        assert s.correct is ok, (gold, pred)
    p = math.problem("Which is larger: $\\sqrt{2}$ or $\\sqrt[3]{3}$?", "\\sqrt[3]{3}", 0, 0)
    assert math.verify(p, "\\boxed{\\sqrt[3]{3}}").correct and not math.verify(p, "\\boxed{\\sqrt{2}}").correct
    q = math.problem("Simplify $\\sqrt{50}$.", "5\\sqrt{2}", 0, 0)
    agg = dataclasses.replace(q, prompt=q.prompt + "\n\nCandidate 1: so it is $\\sqrt{2} \\cdot 5$.",
                              meta={**q.meta, "question": q.prompt})
    assert math.verify(agg, "\\boxed{\\sqrt{2} \\cdot 5}").correct and not math.verify(agg, "\\boxed{\\sqrt{50}}").correct


# -- `cascade envs` arguments and the adapters' shared answer handling (mutation-found gaps) --------
def test_parse_range_single_point_ranges_spaces_and_empty_parts():
    assert parse_range("3-3") == [3]
    assert parse_range("2-4,0") == [2, 3, 4, 0]
    assert parse_range(" 0 , 2 ") == [0, 2]
    assert parse_range("1,,2") == [1, 2]  # an empty part is skipped, not an error


def test_arg_values_are_json_where_they_parse_and_need_a_key():
    from envs.cli import _parse_args_kv

    assert _parse_args_kv(["n=5", "name=abc", "xs=[1, 2]", "flag=true", "s=\"5\""]) == \
        {"n": 5, "name": "abc", "xs": [1, 2], "flag": True, "s": "5"}
    assert _parse_args_kv(None) == {}
    for bad in ("=5", "novalue"):
        with pytest.raises(ValueError, match="--arg expects KEY=VALUE"):
            _parse_args_kv([bad])


def test_cli_show_prints_the_problem_of_the_seed_and_difficulty_given(capsys):
    env = get_env("math/arith")
    want = env.generate(1, 3)
    assert want.prompt != env.generate(3, 1).prompt  # (the two orders give different problems)
    assert envs_main(["show", "math/arith", "--difficulty", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert want.prompt in out and env.format_answer(want.answer) in out
    assert envs_main(["show", "toy/add"]) == 0  # difficulty 0, the default, is allowed
    assert "correct=True" in capsys.readouterr().out


def test_cli_check_refuses_no_seeds_and_no_jobs():
    for argv, msg in ((["check", "toy/add", "--seeds", "0"], "--seeds must be >= 1"),
                      (["check", "toy/add", "--jobs", "0"], "--jobs must be >= 1")):
        with pytest.raises(ValueError, match=msg):
            envs_main(argv)


def test_cli_check_quiet_still_shows_failures_and_counts_them(capsys):
    assert envs_main(["check", "tests.test_envs_core:_Broken", "toy/add", "--difficulties", "0", "--seeds", "1",
                      "-q", "--no-record"]) == 1
    out = capsys.readouterr().out
    assert "FAIL tests.test_envs_core:_Broken" in out and "not deterministic" in out
    assert "ok   toy/add" not in out  # quiet: passing environments are not listed
    assert "1/2 environments pass the self-check" in out


def test_cli_check_lists_at_most_ten_failures_of_an_environment(capsys):
    fails = self_check(_Broken(), [0, 1, 2, 3], [0, 1, 2])
    assert len(fails) > 10
    assert envs_main(["check", "tests.test_envs_core:_Broken", "--difficulties", "0-3", "--seeds", "3",
                      "--no-record"]) == 1
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("FAIL tests.test_envs_core:_Broken"))
    assert all(x.startswith("     ") for x in lines[i + 1:i + 12])
    assert lines[i + 11].startswith("     ... and ") and lines[i + 11].endswith(" more")
    assert not lines[i + 12].startswith("     ")


def test_cli_check_names_only_the_left_out_environments_its_patterns_match(capsys):
    from envs.cli import _excluded

    left_out = _excluded()
    if not left_out:
        pytest.skip("no adapter package leaves an environment out here")
    assert envs_main(["check", "toy/add", "--difficulties", "0", "--seeds", "1", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "left out by their adapters" not in out and not any(k in out for k in left_out)


def test_balanced_braces():
    from envs.adapted import balanced

    for s, want in (("", True), ("{a}{b}", True), ("{{}}", True), ("{", False), ("}", False), ("}{", False),
                    ("a}b{c", False), ("{{}", False)):
        assert balanced(s) is want, s


def test_answer_tag_or_box_absent_is_none_and_the_answer_is_stripped():
    from envs.adapted import BoxedOrTagged, last_tagged_or_boxed

    for text in ("no answer here", "", "x </answer>", "<answer>open only"):
        assert last_tagged_or_boxed(text) is None, text
        assert BoxedOrTagged().extract(text) is None, text
    assert BoxedOrTagged().extract("<answer>  5 \n</answer>") == "5"
    assert BoxedOrTagged().extract("<think>\\boxed{1}</think> \\boxed{ 7 }") == "7"


def test_an_unbalanced_or_boxed_reference_answer_is_given_in_tags():
    from envs import Problem
    from envs.adapted import BoxedOrTagged

    e = BoxedOrTagged()
    for ans in ("a}b", "{x", "}{"):
        ref = e.reference_response(Problem("q", ans, "x"))
        assert ref == f"The answer is <answer>{ans}</answer>" and e.extract(ref) == ans, ans
    assert e.reference_response(Problem("q", "\\boxed{3}", "x")) == "The answer is <answer>\\boxed{3}</answer>"
    assert e.reference_response(Problem("q", "{1, 2}", "x")) == "The answer is \\boxed{{1, 2}}"
    assert e.reference_response(Problem("q", None, "x")) == "The answer is \\boxed{}"


def test_reference_credited_is_false_when_the_scorer_fails_on_its_own_answer():
    from envs import Problem
    from envs.adapted import BoxedOrTagged

    class Failing(BoxedOrTagged):
        def check_with(self, problem, response, context):
            raise RuntimeError("scorer broke")

    class Crediting(BoxedOrTagged):
        def check_with(self, problem, response, context):
            return Score(1.0, self.extract(response) == problem.answer, True)

    p = Problem("q", "7", "x")
    assert Failing().reference_credited(p, None) is False
    assert Crediting().reference_credited(p, None) is True
    no_oracle = Failing()
    no_oracle.no_reference_reason = "no gold answer"
    assert no_oracle.reference_credited(p, None) is True


def test_answer_length_limit_and_the_zero_score_of_no_answer():
    from envs import Problem
    from envs.adapted import MAX_ANSWER_CHARS, BoxedOrTagged

    e = BoxedOrTagged()
    short = Problem("q", "7", "x")
    assert e.extracted_or_zero(short, f"<answer>{'9' * MAX_ANSWER_CHARS}</answer>") == "9" * MAX_ANSWER_CHARS
    s = e.extracted_or_zero(short, f"<answer>{'9' * (MAX_ANSWER_CHARS + 1)}</answer>")
    assert isinstance(s, Score) and s.reward == 0.0 and s.format_ok and s.info["reason"] == "answer too long"
    long_gold = Problem("q", "1" * 300, "x")  # a long answer allows 50 times its length
    assert e.extracted_or_zero(long_gold, f"<answer>{'1' * 15_000}</answer>") == "1" * 15_000
    assert isinstance(e.extracted_or_zero(long_gold, f"<answer>{'1' * 15_001}</answer>"), Score)
    none = e.precheck(short, "I don't know")
    assert isinstance(none, Score) and none.reward == 0.0 and not none.correct and not none.format_ok
    assert e.precheck(short, "\\boxed{7}") is None


def test_cached_catalog_rebuilds_an_empty_or_broken_cache_and_writes_it(tmp_path, monkeypatch):
    from envs.adapted import cached_catalog

    monkeypatch.setenv("CASCADE_CACHE_DIR", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return {"a": {"x": 1}}

    assert cached_catalog("roster.json", build) == {"a": {"x": 1}} and len(calls) == 1
    assert json.loads((tmp_path / "roster.json").read_text()) == {"a": {"x": 1}}
    assert cached_catalog("roster.json", build) == {"a": {"x": 1}} and len(calls) == 1  # read from the cache
    for broken in ("{}", "not json", "[1]"):
        (tmp_path / "roster.json").write_text(broken)
        assert cached_catalog("roster.json", build) == {"a": {"x": 1}}, broken
    assert len(calls) == 4


def test_package_version_takes_the_first_installed_distribution():
    from importlib.metadata import version

    from envs.adapted import package_version

    assert package_version("no-such-dist-cascade-xyz", "pytest") == version("pytest")
    assert package_version("no-such-dist-cascade-xyz") == "unknown"
