"""Math answers: equivalence with ``math-verify`` under a time bound, a dataset environment and a
procedurally generated one.

``math_equal(pred, gold)`` compares two answers (numbers, fractions, LaTeX expressions, intervals,
sets, matrices) with ``math-verify``. math-verify bounds its own time with ``signal.alarm``, which
only works in the main thread; here every comparison runs in a small pool of persistent worker
processes instead (one per concurrent caller), each call under a deadline: a worker that overruns
is killed and the comparison counts as not equal. This works from any thread and never leaves a
sympy computation running in the caller.

Environments:

- ``math``: problems from a jsonl/parquet file with columns ``problem`` and ``answer`` (optional
  ``level``/``difficulty``: numbers or ``"Level 3"``, ranked onto difficulties 0, 1, ...); without a
  path it uses a small built-in sample.
- ``math/arith``: linear equations and fraction arithmetic whose size grows with difficulty, so
  math RL runs without any data file.
"""
from __future__ import annotations

import atexit
import math
import numbers
import os
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

from envs.base import Environment, Problem, Score, register
from envs.workers import Pool, WorkerStartError, serve

__all__ = ["math_equal", "plain_number", "MathDatasetEnv", "ArithmeticEnv", "MathVerifyTimeout"]

DEFAULT_TIMEOUT = 3.0      # seconds per comparison
STARTUP_TIMEOUT = 120.0    # seconds for a fresh worker to import math-verify (slow on busy machines)
MAX_ANSWER_CHARS = 2000    # longer predictions (beyond 20x the gold) are not compared at all


class MathVerifyTimeout(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# worker process side


def _mv_equal(pred: str, gold: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    g = parse(f"${gold}$", extraction_config=cfg, parsing_timeout=None)
    p = parse(f"${pred}$", extraction_config=cfg, parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _compare(request, emit) -> bool:
    try:
        return _mv_equal(*request)
    except Exception:  # noqa: BLE001 - a malformed answer is simply not equal
        return False


def worker_main() -> None:
    """A worker process (:mod:`envs.workers`): one ``[pred, gold]`` per request, ``true``/``false`` back."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import math_verify  # noqa: F401 - import before saying ready

    serve(_compare)


# --------------------------------------------------------------------------------------------
# caller side

_POOL = Pool("envs.math", STARTUP_TIMEOUT)
atexit.register(_POOL.close)


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s


def math_equal(pred: Any, gold: Any, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether answer ``pred`` equals ``gold`` mathematically (math-verify), within ``timeout`` s.

    Safe from any thread. A comparison that does not finish in time counts as not equal. Exact
    matches after trimming whitespace, ``$`` and a final period are equal without a comparison;
    predictions longer than ``max(2000, 20 * len(gold))`` characters are never equal. Digits apart
    by a space are no number but as thousands (``1 0`` is not 10, ``1 000`` is 1000), and a
    decimal prediction is the number it writes (``0.333333`` is not ``\\frac{1}{3}``: math-verify
    rounds to 6 places) unless the gold is a decimal too.
    """
    if pred is None or gold is None:
        return False
    p, g = _clean(str(pred)), _clean(str(gold))
    if not p or not g:
        return False
    if _squeezed(p) == _squeezed(g):
        return True
    if len(p) > max(MAX_ANSWER_CHARS, 20 * len(g)):
        return False
    if _spaced_digits(p) and not _spaced_digits(g):  # math-verify reads "1 0" as 1*0 and "12 5" as 17
        return False
    decimal = _DECIMAL.fullmatch(p)
    if decimal is not None and not _DECIMAL.fullmatch(g):  # compared exactly, as a fraction
        try:
            p = (decimal[1] or "") + _frac_latex(Fraction(decimal[2]))
        except ValueError:  # (over 4,300 digits)
            return False
    shapes = _shape(p), _shape(g)  # math-verify takes (1, 2), \{1, 2\} and "-\infty, 3" for one another
    if set(shapes) == {"set", "interval"} or shapes == ("list", "interval") and "\\infty" in g:
        return False
    # "x = 2 \text{ or } x = 3" answers "2, 3" and "2 \text{ or } 3" (math-verify reads "or"/"and" as a comma)
    several = shapes[1] in ("list", "set") or _alternatives(g)
    if not several and _hedged(p) != _hedged(g):  # "\sqrt{2} \text{ or more}", "\pi \text{ squared}"; and the
        return False  # reverse: "5" is no "5 \text{ or more}" (math-verify reads that gold as the list {5, more})
    if len(_top_level(g)) == 1 and not several:
        # an equation answers with its last side (math-verify's reading) only when every other side names the answer
        # (x = ..., f(2) = ..., a + b = ...) or equals it: "0 = \sqrt{2}" is no answer \sqrt{2}
        parts = _top_level(p, ",")
        for part in parts:
            sides = _top_level(part)
            if len(sides) > 1 and _names(sides[0], g):
                sides = sides[1:]
            if len(sides) > 1 and (len(parts) > 1 or not all(math_equal(x, g, timeout) for x in sides)):
                return False
    elif several and all(len(_top_level(x)) == 1 for x in _answers(g)):  # no gold answer an equation
        for part in _answers(p):  # each named answer as above: "0 = 2, 0 = 3" is no "2, 3"
            sides = _top_level(part)
            if len(sides) > 1 and not (len(sides) == 2 and _names(sides[0], g)):
                return False
    try:
        got = _POOL.call([p, g], [timeout])
    except WorkerStartError as e:
        raise RuntimeError(f"{e} (is math-verify installed?)") from None
    return bool(got and got[0] is True)


def _zero_format() -> Score:
    return Score.zero("no \\boxed{} answer", format_ok=False)


# what may surround a number in an answer: a variable and "=", formatting, units and words in \text{} (a number
# in it is kept), degrees, percent, dollars, LaTeX spacing, thousands separators in braces
_WRAPPED = re.compile(r"\\(?:textbf|mathbf|boldsymbol|text|mathrm|textrm|mbox|operatorname)\s*\{([^{}]*)\}"
                      r"(\s*\^\s*(?:\{\s*\d+\s*\}|\d))?")  # a unit's power (cm^2) goes with the unit
# a name before "=": x, BC, x_1, x_{12}, \theta, \angle ABC, f(2); never a bracket first ("(7) = 5" names nothing)
# (possessive spaces: a command and a long run of spaces without "=" took quadratic time)
_NAME_EQ = r"^\s*+(?!\()(?:\\[A-Za-z]+\s*+)?[A-Za-z]*(?:_(?:\{[^{}]*\}|\w))?(?:\([^()=]*\))?'*\s*=\s*"
_DECORATION = [(re.compile("\u2212"), "-"), (re.compile("\u00b0"), ""), (re.compile(_NAME_EQ), ""),
               (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\%|%|\\\$|\$|\\[,!;: ]|~"), ""),
               (re.compile(r"\{,\}"), ","), (re.compile(r"\\[dt]frac"), r"\\frac"),
               (re.compile(r"\\(?:displaystyle|textstyle)"), ""), (re.compile(r"\s+"), "")]
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_OUTER_PARENS = re.compile(r"^([+-]?)(?:\\left)?\(([^(),]*?)(?:\\right)?\)$")  # one pair around a number (not a tuple)
_SCIENTIFIC = re.compile(r"([+-]?\d+(?:\.\d*)?)(?:\\times|\\cdot)10\^(?:\{([+-]?\d{1,3})\}|(\d))")  # 1.5\times10^{6}
_FRACTION = re.compile(r"([+-]?)(?:\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|\\frac(\d)(\d)|(\d+)/(\d+))")
_MIXED = re.compile(r"([+-]?)(\d+)\\frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))")  # 2\frac{1}{4} = 9/4
# "10 cm", "12 units", "3 m^2" (after a space: the lookbehind, not \s+, keeps the search linear on runs of spaces)
_UNIT_WORD = re.compile(r"(?<=\s)[A-Za-z]{2,}(?:\^\s*(?:\{\s*\d\s*\}|\d))?$")
_SPACING = re.compile(r"\\[,!;: ]|~")
# words that make a number something else ("5 or more", "5 thousand", "5 squared", "5 pi", "7 halves"): never a unit
_HEDGES = frozenset("or nor and to than more less fewer least most not no over under above below about around roughly "
                    "approximately nearly almost maybe perhaps hundred thousand million billion trillion dozen "
                    "squared cubed factorial times plus minus pi half halves third quarter fourth fifth sixth seventh "
                    "eighth ninth tenth hundredth thousandth millionth billionth".split())
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]+")
_ALTERNATIVE = re.compile(r"\\(?:text|mbox|textrm|mathrm)\s*\{\s*(?:or|and)\s*\}|\s(?:or|and)\s")
# digits apart by spaces are one number only as thousands ("12 345 678"); after a subscript, a power or a command
# they are its argument and what follows ("\log_2 8", "\frac 1 2")
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:\s+\d{3})+(?!\d)")
_DIGIT_GAP = re.compile(r"(\\[A-Za-z]+\s*|[_^]\s*)?(?<![\d.])\d+(?:\.\d*)?\s+(?=\d)")
_GAP_OR_SPACE = re.compile(r"(?<=\d)(\s+)(?=\d)|\s+")
_DECIMAL = re.compile(f"({_NAME_EQ[1:]})?" + r"([+-]?(?:\d+\.\d*|\.\d+))")  # "0.25", "x = -1.5"


def _joined(text: str) -> str:
    """``text`` with the spaces of thousands (``12 345``) dropped."""
    return _THOUSANDS.sub(lambda m: re.sub(r"\s+", "", m[0]), text)


def _spaced_digits(text: str) -> bool:
    """Whether ``text`` has digits apart by a space that are no thousands (``1 0``, ``12 5``, ``0.5 1``)."""
    return any(m[1] is None for m in _DIGIT_GAP.finditer(_joined(text)))


def _squeezed(text: str) -> str:
    """``text`` without spaces, but for one between two digits that are no thousands (``1 0`` is no ``10``)."""
    return _GAP_OR_SPACE.sub(lambda m: " " if m[1] else "", _joined(text))


def _alternatives(text: str) -> bool:
    """Whether ``text`` lists answers with "or"/"and" (``2 \\text{ or } 3``, ``x = 1 and x = 2``), each of them
    no hedge word ("5 or more" is one answer)."""
    parts = _ALTERNATIVE.split(text)
    return len(parts) > 1 and all(p.strip() and not _hedged(p) for p in parts)


def _answers(text: str) -> list[str]:
    """The answers ``text`` lists: its parts between top-level commas and "or"/"and" (in a set: inside its braces)."""
    inner = re.fullmatch(r"\s*(?:\\left)?\\\{(.*?)(?:\\right)?\\\}\s*", text, re.DOTALL)
    return [x for part in _top_level(inner[1] if inner else text, ",") for x in _ALTERNATIVE.split(part)]


def _hedged(text: str) -> bool:
    """Whether ``text`` has a word (not a LaTeX command) of :data:`_HEDGES`, plural or not."""
    for m in _WORD.finditer(text):
        w = m[0].lower()
        if w in _HEDGES or (w.endswith("s") and w[:-1] in _HEDGES):
            return True
    return False


def _top_level(text: str, sep: str = "=") -> list[str]:
    """``text`` split at each ``sep`` outside braces, brackets and parentheses (``a = b = c`` -> 3 sides); an ``=``
    of ``<=``, ``>=``, ``!=`` or ``==`` is not split at."""
    sides, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == sep and depth == 0 and text[i - 1:i] not in ("<", ">", "!", "=") and text[i + 1:i + 2] != "=":
            sides.append(text[start:i])
            start = i + 1
    return sides + [text[start:]]


def _unwrapped(key: str) -> str:
    """``key`` without one pair of parentheses or braces around all of it."""
    if len(key) > 1 and (key[0], key[-1]) in (("(", ")"), ("{", "}")):
        depth = 0
        for i, ch in enumerate(key):
            depth += ch in "({"
            depth -= ch in ")}"
            if depth == 0:
                return key[1:-1] if i == len(key) - 1 else key
    return key


_NAME = re.compile(r"\s*+(?:\\[A-Za-z]+\s*+(?:\{[A-Za-z\s]*\}\s*+)?)?[A-Za-z]*(?:_(?:\{[^{}]*\}|\w))?(?:\([^()=]*\))?'*\s*")


def _variables(text: str) -> bool:
    """Whether ``text`` has a letter outside LaTeX commands (``\\pi``, ``\\sqrt``): a variable."""
    return bool(re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", text)))


def _names(side: str, gold: str) -> bool:
    """Whether ``side``, before an ``=``, names the answer ``gold``: nothing (``= 5``); a name (``x``, ``BC``, ``x_1``,
    ``f(2)``, ``\\theta``); where the answer has no variables, any expression with one (``a + b``, ``\\angle ABC``)."""
    if not side.strip() or _NAME.fullmatch(side) and re.search(r"[A-Za-z]", side):
        return True
    return not _variables(gold) and _variables(side)


def _shape(text: str) -> str | None:
    """``set`` for ``\\{a, b\\}``, ``interval`` for ``(a, b)``/``[a, b)`` (or a union of them), ``list`` for ``a, b``
    without brackets; None for anything else."""
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\s+", "", text)
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set"
    if s[:1] in "([" and s[-1:] in ")]" and len(_top_level(s, ",")) == 1 and "," in s:
        return "interval"
    if len(_top_level(s, ",")) > 1:
        return "list"
    return None


_MATH_SPANS = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)


def _latex_key(text: Any) -> str:
    """LaTeX compared as written: without spaces, ``\\left``/``\\right`` and the ``\\dfrac`` spelling."""
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])|\s+|\\[,!;: ]", "", str(text))
    return re.sub(r"\\[dt]frac", r"\\frac", s).strip("$.")


def _question_math(prompt: str) -> set[str]:
    """The mathematics the question writes (its ``$...$``, ``$$...$$``, ``\\(...\\)`` and ``\\[...\\]`` spans)."""
    return {_latex_key(next(g for g in m.groups() if g is not None)) for m in _MATH_SPANS.finditer(prompt or "")}


def plain_number(text: Any) -> Fraction | None:
    """The value of an answer that is one number: an integer, a decimal (``1,000``, ``1{,}000`` and ``1 000`` as
    thousands), ``a/b``, ``\\frac{a}{b}`` or a mixed number ``2\\frac{1}{4}``, signed, in units (``\\text{}`` or a
    word after it), degrees, percent or dollars, after a name and ``=`` (``x =``, ``BC =``, ``x_1 =``); None for
    anything else (a sum, a product, a root, a function, an interval, words before it, ...)."""
    got = _written_number(text)
    return None if got is None else got[0]


def _written_number(text: Any) -> tuple[Fraction, tuple[int, int] | None] | None:
    """:func:`plain_number`'s value, and the numerator and denominator as written when it is a fraction."""
    # words without a digit after the number are units and dropped; before it ("not 5", "at most 5") or between two
    # numbers ("3 or 4") they leave no number; so do digits apart by a space but in thousands ("1 0" is no 10)
    s = _clean(str(text))
    if _hedged(s) or re.search(r"\d,\s+\d", s):  # "5 \text{ or more}", "5 thousand"; "3, 400" is a list
        return None
    s = _WRAPPED.sub(lambda m: m[1] + (m[2] or "") if re.search(r"\d", m[1]) else "\0", s)
    s = _UNIT_WORD.sub("", _SPACING.sub(" ", s).rstrip("\0 \t\n")).rstrip()
    if "\0" in s or _spaced_digits(s):
        return None
    for pat, rep in _DECORATION:
        s = pat.sub(rep, s)
    s = _unwrapped(s) if s[:1] == "{" and "," not in s else s  # "{\frac{8}{3}}" (not a set "{1,234}")
    s = _clean(_OUTER_PARENS.sub(r"\1\2", s))  # "(-5)", "-\left(\frac34\right)", "3/4."
    try:  # (a run of over 4,300 digits is no answer: int() refuses it)
        if _NUMBER.fullmatch(s):
            return Fraction(s.replace(",", "")), None
        m = _SCIENTIFIC.fullmatch(s)
        if m is not None:
            return Fraction(m[1]) * Fraction(10) ** int(m[2] or m[3]), None
        m = _MIXED.fullmatch(s)
        if m is not None:
            num, den = (int(m[3]), int(m[4])) if m[3] is not None else (int(m[5]), int(m[6]))
            if den == 0:
                return None
            value = int(m[2]) + Fraction(num, den)
            return (-value if m[1] == "-" else value), (num, den)
        m = _FRACTION.fullmatch(s)
    except ValueError:
        return None
    if m is None:
        return None
    num, den = next((int(m[i]), int(m[i + 1])) for i in (2, 4, 6) if m[i] is not None)
    if den == 0:
        return None
    return (-Fraction(num, den) if m[1] == "-" else Fraction(num, den)), (num, den)


class _MathBase(Environment):
    family = "math"
    # the comparison deadline, plus the one-time start of a worker process (imports sympy; slow
    # on a busy machine)
    verify_time_limit = DEFAULT_TIMEOUT + 12.0
    timeout: float = DEFAULT_TIMEOUT
    concurrent_verify = True  # math_equal waits on a worker process; each calling thread takes its own

    def check(self, problem: Problem, response: str) -> Score:
        pred = self.extract(response)
        if pred is None or not pred.strip():
            return _zero_format()
        want, written = plain_number(problem.answer), _written_number(pred)
        if want is not None and written is None:
            # a number is asked for: an expression equal to it (the question's own, copied into the box) is no answer
            return Score(0.0, False, True, {"extracted": pred[:200], "reason": "not a number"})
        # a number in final form (an integer, a decimal, a fraction in lowest terms) answers a comparison of the
        # question's own numbers ("which is larger, $\frac12$ or $\frac13$?")
        final = written is not None and (written[1] is None or (math.gcd(*written[1]) == 1 and abs(written[1][1]) > 1))
        # the value stated last ("x = \sqrt{50}", "(\sqrt{50})" stand for "\sqrt{50}")
        stated = _unwrapped(_latex_key(_top_level(pred)[-1]))
        # the question's text: an aggregation prompt's (cascade.aggregation) also shows its candidates' math
        if (not final and stated in _question_math(problem.meta.get("question", problem.prompt))
                and stated != _latex_key(problem.answer)):
            # "Simplify $\sqrt{50}$": its own expression, equal to the answer, answers nothing
            return Score(0.0, False, True, {"extracted": pred[:200], "reason": "the question's own expression"})
        # both plain numbers: compared by value (no math-verify round trip)
        ok = written[0] == want if want is not None else math_equal(pred, problem.answer, timeout=self.timeout)
        return Score(1.0 if ok else 0.0, ok, True, {"extracted": pred[:200]})

    def corruptions(self, problem: Problem) -> list[str]:
        ans = str(problem.answer)
        return ["", "I don't know.", "\\boxed{}", f"\\boxed{{{ans}+1}}", f"\\boxed{{{ans}}}x9 \\boxed{{-98765.4321}}"]


# --------------------------------------------------------------------------------------------
# dataset environment

SAMPLE_PATH = Path(__file__).resolve().parent / "data" / "math_sample.jsonl"
_LEVEL_COLUMNS = ("level", "difficulty")


_WORD_LEVEL = re.compile(r"[A-Za-z][A-Za-z _]*?[\s:]*(\d+(?:\.\d*)?|\.\d+)")  # "Level 3", "difficulty: 4.5"


def _as_level(v: Any) -> int | float | None:
    """A row's difficulty level as a number, or None when it has none.

    A number stands for itself (``3``, ``4.5`` as in DeepMath or Omni-MATH; a whole float such as
    ``3.0`` is the int ``3``). A string is a number (``"3"``, ``"2.5"``, ``"-1"``, ``"1e3"``) or a word
    followed by an unsigned number (``"Level 3"`` as in the MATH dataset, ``"difficulty: 4.5"``).
    Anything else (``"Level ?"``, ``"Level 2-3"``, ``"hard"``, booleans, NaN, infinities) is no level.
    """
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        x = float(v)
    elif isinstance(v, str):
        text = v.strip()
        m = _WORD_LEVEL.fullmatch(text)
        try:
            x = float(m.group(1) if m else text)
        except ValueError:
            return None
    else:
        return None
    if not math.isfinite(x):
        return None
    return int(x) if x.is_integer() else x


def load_math_rows(path: str | os.PathLike, columns: dict | str | None = None, split: str = "train",
                   subset: str | None = None) -> list[dict]:
    """Rows ``{"problem", "answer", "level"}`` of a jsonl/json/parquet/csv file, a local dataset
    directory or a Hugging Face dataset ``org/name`` (``envs.hub``: cache and offline rules), with
    ``columns`` mapping Cascade's names to the data's (``{"problem": "question"}``); the level
    column is ``columns["level"]``, else ``level`` or ``difficulty`` when present."""
    from envs.hub import answer_text, load_table, parse_columns, table_rows

    cols = parse_columns(columns, ("problem", "answer", "level"))
    ds = load_table(path, split=split, subset=subset, what="math dataset")
    if cols["level"] not in ds.column_names and not (isinstance(columns, dict) and "level" in columns) \
            and "level=" not in (columns if isinstance(columns, str) else ""):
        cols["level"] = next((c for c in _LEVEL_COLUMNS if c in ds.column_names), "level")
    rows = table_rows(ds, cols, ["problem", "answer"], path, "math dataset")
    out = [{"problem": str(r["problem"]), "answer": answer_text(r["answer"]), "level": _as_level(r["level"])}
           for r in rows]
    kept = [r for r in out if r["answer"] is not None]
    if len(kept) < len(out):  # a problem no answer is credited on trains nothing
        if not kept:
            raise ValueError(f"math dataset {str(path)!r}: no row has an answer (column {cols['answer']!r})")
        print(f"math dataset {str(path)!r}: {len(out) - len(kept)} of {len(out)} rows have no answer; left out",
              file=sys.stderr)
    return kept


@register("math")
class MathDatasetEnv(_MathBase):
    """Math problems from a file or a Hugging Face dataset (columns problem, answer; optional level),
    graded by math-verify. ``heldout`` (default 0.1) of the problems, chosen by a hash of the problem
    text, are held out: :meth:`generate` (training) never returns them, :meth:`heldout` (evaluation)
    returns only them.

    **Levels.** A row's level is a number (:func:`_as_level`: ``3``, ``4.5``, ``"2.5"``, ``"Level 3"``).
    The distinct levels of the training rows, in increasing order, are difficulties 0, 1, ...,
    ``max_difficulty`` (MATH's levels 1-5 are difficulties 0-4; levels 1, 2.5, 4 are 0, 1, 2), and
    ``generate(seed, d)`` draws a row at the ``d``-th level (clamped to the last). A row without a
    level belongs to every level: a draw at any difficulty is one of those rows with probability
    their share of the training rows (else a row at the level), so under a uniform spread of
    difficulties each row is drawn about equally often. Without any levels every row is drawn
    whatever the difficulty and ``max_difficulty`` is None."""

    description = "math problems from a file or HF dataset (path=..., columns=...), graded with math-verify"

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = DEFAULT_TIMEOUT,
                 columns: dict | str | None = None, split: str = "train", subset: str | None = None,
                 heldout: float = 0.1):
        from envs.hub import split_heldout

        self.path = path if path is not None else SAMPLE_PATH
        self.timeout = float(timeout)
        rows = [{**r, "row": i} for i, r in enumerate(load_math_rows(self.path, columns, split, subset))]
        train, held = split_heldout([r["problem"] for r in rows], float(heldout))
        self.rows = [rows[i] for i in train]
        self.heldout_rows = [rows[i] for i in held]
        by_level: dict[int | float, list[int]] = {}
        for i, r in enumerate(self.rows):
            if r["level"] is not None:
                by_level.setdefault(r["level"], []).append(i)
        self._by_level = dict(sorted(by_level.items()))  # level -> rows, ranked: difficulty d is the d-th
        self._unleveled = [i for i, r in enumerate(self.rows) if r["level"] is None]
        self.max_difficulty = (len(self._by_level) - 1) if self._by_level else None

    def _candidates(self, difficulty: int) -> list[int]:
        """Rows at the difficulty-th distinct level (clamped); all rows when there are no levels."""
        if not self._by_level:
            return list(range(len(self.rows)))
        levels = list(self._by_level)
        return self._by_level[levels[max(0, min(int(difficulty), len(levels) - 1))]]

    def _draw(self, seed: int, difficulty: int) -> int:
        """The training row of ``generate(seed, difficulty)``: an unleveled row with probability their
        share of the rows (only when some rows have levels), else one of :meth:`_candidates`."""
        rng = self.rng(seed, difficulty)
        cand = self._candidates(difficulty)
        if self._by_level and self._unleveled and rng.random() * len(self.rows) < len(self._unleveled):
            cand = self._unleveled
        return cand[rng.randrange(len(cand))]

    def generate(self, seed: int, difficulty: int) -> Problem:
        row = self.rows[self._draw(seed, difficulty)]
        return self.problem(row["problem"], row["answer"], seed, difficulty, row=row["row"], level=row["level"])

    def heldout(self, seed: int, difficulty: int) -> Problem:
        """A held-out problem (any level; ``difficulty`` is recorded only): never one :meth:`generate` gives."""
        if not self.heldout_rows:
            raise ValueError(f"math dataset {str(self.path)!r} has no held-out problems (heldout=0); "
                             f"set env_kwargs.math.heldout > 0 to evaluate on it")
        i = self.rng(seed, -1).randrange(len(self.heldout_rows))
        row = self.heldout_rows[i]
        return self.problem(row["problem"], row["answer"], seed, difficulty, row=row["row"], level=row["level"],
                            heldout=True)

    def heldout_texts(self) -> set[str]:
        """Normalized texts of the held-out problems (to keep them out of SFT data as well)."""
        from envs.hub import normalize_text

        out = set()
        for r in self.heldout_rows:  # the problem, and the prompt made of it
            out |= {normalize_text(r["problem"]), normalize_text(self.problem(r["problem"], "", 0, 0).prompt)}
        return out


# --------------------------------------------------------------------------------------------
# procedurally generated math


def _frac_latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _term(c: int, var: str, first: bool) -> str:
    sign = "-" if c < 0 else ("" if first else "+")
    mag = abs(c)
    body = var if mag == 1 and var else f"{mag}{var}"
    return f"{sign} {body}".strip() if not first else f"{sign}{body}"


@register("math/arith")
class ArithmeticEnv(_MathBase):
    """Linear equations (even difficulty) and fraction arithmetic (odd); numbers grow with difficulty."""

    description = "procedural linear equations and fraction arithmetic; size grows with difficulty"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = float(timeout)

    def generate(self, seed: int, difficulty: int) -> Problem:
        d = max(0, int(difficulty))
        rng = self.rng(seed, d)
        if d % 2 == 0:
            return self._linear(rng, seed, d)
        return self._fractions(rng, seed, d)

    def _linear(self, rng, seed: int, d: int) -> Problem:
        """a*x + b = c*x + e with a rational solution; coefficients up to 5 * (1 + d)."""
        bound = 5 * (1 + d)
        while True:
            a, c = rng.randint(-bound, bound), rng.randint(-bound, bound)
            if a != c and a != 0:
                break
        b, e = rng.randint(-bound * 2, bound * 2), rng.randint(-bound * 2, bound * 2)
        if d == 0:
            c = 0
        x = Fraction(e - b, a - c)
        lhs = _term(a, "x", True) + (f" {_term(b, '', False)}" if b else "")
        rhs = (_term(c, "x", True) + (f" {_term(e, '', False)}" if e else "")) if c else str(e)
        prompt = f"Solve for $x$: ${lhs} = {rhs}$. Give $x$ as an integer or a fraction in lowest terms."
        return self.problem(prompt, _frac_latex(x), seed, d, kind="linear")

    def check(self, problem: Problem, response: str) -> Score:
        """The answer as the prompt asks for it: an integer or a fraction in lowest terms (``a/b``,
        ``\\frac{a}{b}``, after ``x =`` or not), equal to the solution; the expression of the question
        itself, or an unreduced fraction, is not one."""
        pred = self.extract(response)
        if pred is None or not pred.strip():
            return _zero_format()
        written, want = _written_number(pred), plain_number(problem.answer)
        info = {"extracted": pred[:200]}
        if written is None or ("." in _clean(pred) and written[0].denominator != 1):  # a decimal only for a whole number
            return Score(0.0, False, True, {**info, "reason": "not an integer or a fraction"})
        got, frac = written
        reduced = frac is None or (math.gcd(*frac) == 1 and abs(frac[1]) > 1)
        ok = got == want and reduced
        return Score(1.0 if ok else 0.0, ok, True, info if reduced else {**info, "reason": "not in lowest terms"})

    def _fractions(self, rng, seed: int, d: int) -> Problem:
        """A sum/difference/product of 2 + d//2 fractions with denominators up to 4 + 2d."""
        n = 2 + d // 2
        den = 4 + 2 * d
        fr = [Fraction(rng.randint(-3 * den, 3 * den) or 1, rng.randint(2, den)) for _ in range(n)]
        ops = [rng.choice("+-*") for _ in range(n - 1)]
        expr = _frac_latex(fr[0])
        # evaluate with usual precedence: products bind tighter than sums
        terms, signs = [fr[0]], []
        for op, f in zip(ops, fr[1:]):
            tex = _frac_latex(f)
            if f < 0:
                tex = f"\\left({tex}\\right)"
            if op == "*":
                expr += f" \\cdot {tex}"
                terms[-1] *= f
            else:
                expr += f" {op} {tex}"
                signs.append(1 if op == "+" else -1)
                terms.append(f)
        value = terms[0] + sum(s * t for s, t in zip(signs, terms[1:]))
        prompt = f"Compute ${expr}$. Give the result as an integer or a fraction in lowest terms."
        return self.problem(prompt, _frac_latex(value), seed, d, kind="fractions")
