"""Shared machinery of the RLVE-Gym environments: a small base class, answer parsers, helpers.

Every gym environment subclasses :class:`GymEnv` and implements ``build(rng, d)`` (returns the
prompt, the reference answer and optional meta) plus, where the answer is not a single value
compared for equality, ``parse`` and ``grade``. Reward convention (RLVE):

* no ``\\boxed{}`` answer, or an answer that does not parse: reward ``-1``, ``format_ok=False``;
* a parsed answer that is structurally invalid (wrong length, not a permutation, illegal move):
  reward ``INVALID`` (-0.5);
* otherwise a score in ``[0, 1]`` (partial credit where natural); ``correct`` iff it is 1.
"""
from __future__ import annotations

import json
import math
import random
import re
from fractions import Fraction
from typing import Any, Sequence

from envs.base import Environment, Problem, Score

MAX_ANSWER_CHARS = 100_000
INVALID = -0.5
MOD = 1_000_000_007


class ParseError(ValueError):
    """The answer text does not have the requested format."""


def boxed(text: Any) -> str:
    return f"\\boxed{{{text}}}"


def grow(base: float, d: int, rate: float = 1.1, step: float = 1.0) -> int:
    """A size that grows without bound in the difficulty: ``int(base * rate**d + step * d)``."""
    return int(base * rate ** d + step * d)


def grow_until(base: float, d: int, knee: int, per_level: float, rate: float = 1.1, step: float = 1.0) -> int:
    """``grow(base, d, rate, step)`` up to difficulty ``knee``, then ``per_level`` more per level: the same sizes as
    ``grow`` at the levels below the knee, and a size that still grows without bound but linearly past it, where an
    exponential size would make the exact solver (or the prompt) blow up."""
    if d <= knee:
        return grow(base, d, rate, step)
    return grow(base, knee, rate, step) + int(per_level * (d - knee))


class GymEnv(Environment):
    """Base of the gym environments: generation from ``build``, parsing and grading in ``check``."""

    family = "misc"
    # sizes grow without bound with the difficulty, and some generators' exact solvers with them (a counting DP
    # takes seconds past difficulty ~40): a generate that takes longer makes the problem one level lower and caps
    # the level for the run (envs/caps.py), as for the third-party adapters
    generate_time_limit = 10.0

    # -- to implement -----------------------------------------------------------------------
    def build(self, rng: random.Random, d: int):
        """Return ``(prompt, answer)`` or ``(prompt, answer, meta)``."""
        raise NotImplementedError

    def parse(self, text: str, problem: Problem) -> Any:
        """Parse the extracted answer text; raise :class:`ParseError` (ValueError) if malformed."""
        return " ".join(text.split())

    def grade(self, problem: Problem, value: Any) -> float | Score:
        """Score a parsed answer: a float in ``[-1, 1]`` (1 = correct) or a full :class:`Score`."""
        return 1.0 if value == self.parse(self.format_answer(problem.answer), problem) else 0.0

    def wrong_answers(self, problem: Problem) -> list[str]:
        """Answer texts (not boxed) that must not verify as correct."""
        return []

    # -- provided -----------------------------------------------------------------------------
    def generate(self, seed: int, difficulty: int) -> Problem:
        d = int(difficulty)
        if d < 0:
            raise ValueError(f"difficulty must be >= 0, got {difficulty}")
        out = self.build(self.rng(seed, d), d)
        prompt, answer, meta = out if len(out) == 3 else (out[0], out[1], {})
        # normalise through JSON so a stored-and-reloaded problem equals (and verifies like) a fresh one
        answer, meta = json.loads(json.dumps([answer, meta]))
        return self.problem(prompt, answer, seed, d, **meta)

    def check(self, problem: Problem, response: str) -> Score:
        text = self.extract(response)
        if text is None:
            return Score(-1.0, False, False, {"reason": "no \\boxed{} answer"})
        if len(text) > MAX_ANSWER_CHARS:
            return Score(-1.0, False, False, {"reason": "answer too long"})
        text = _clean(text)
        try:
            value = self.parse(text, problem)
        except (ValueError, TypeError, ZeroDivisionError, OverflowError, MemoryError, RecursionError) as e:
            return Score(-1.0, False, False, {"reason": f"unparseable answer: {e}"[:300]})
        r = self.grade(problem, value)
        if isinstance(r, Score):
            return r
        r = float(r)
        return Score(r, r >= 1.0, True, {} if r >= 1.0 else {"reason": "wrong answer" if r >= 0 else "invalid answer"})

    def corruptions(self, problem: Problem) -> list[str]:
        return ["", "I don't know.", boxed("no idea"), *(f"Answer: {boxed(w)}" for w in self.wrong_answers(problem))]


_LATEX_NOISE = re.compile(r"\\(?:text|mathrm|texttt|textbf|mathtt|mathbf)\s*\{([^{}]*)\}")
_FRAC_STYLE = re.compile(r"\\[td]frac(?![A-Za-z])")


def _clean(text: str) -> str:
    text = _LATEX_NOISE.sub(lambda m: m.group(1), text)
    text = text.replace("$", "").replace("\\,", "").replace("\\!", "").replace("\\ ", " ")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\{", "{").replace("\\}", "}")
    # LaTeX's thousands separator (3{,}142{,}062 is 3,142,062) and the text/display-style fractions
    text = text.replace("{,}", ",")
    text = _FRAC_STYLE.sub(r"\\frac", text)
    return text.strip()


# --- parsers ---------------------------------------------------------------------------------
_INT = re.compile(r"[+-]?\d+")
_INT_COMMAS = re.compile(r"[+-]?\d{1,3}(,\d{3})+")
_NAMED = re.compile(r"\s*[A-Za-z]\s*=")  # "x = 1569": the prompts ask to "find the integer x" (as envs/toy.py)


def parse_int(text: str) -> int:
    text = text.replace("\u2212", "-")  # the minus sign
    if re.search(r"\d\s+\d", text):
        raise ParseError(f"expected one integer, got {text[:40]!r}")
    m = _NAMED.match(text)
    t = "".join(text[m.end() if m else 0:].split())
    if t.endswith("."):
        t = t[:-1]
    if _INT_COMMAS.fullmatch(t):
        t = t.replace(",", "")
    if not _INT.fullmatch(t) or len(t) > 4000:
        raise ParseError(f"expected an integer, got {text[:40]!r}")
    return int(t)


_LIST_OK = re.compile(r"[\d\s,;()\[\]{}+-]*")


def parse_int_list(text: str, signed: bool = True) -> list[int]:
    """Integers separated by spaces/commas/semicolons, optionally in brackets. ``signed=False``
    treats '-' as a separator (so ``1-2, 2-3`` reads as 1 2 2 3). The minus sign U+2212 reads as '-'."""
    text = text.replace("\u2212", "-").rstrip().removesuffix(".")  # "1, 2, 3." as "42." is 42
    if not _LIST_OK.fullmatch(text):
        raise ParseError(f"expected a list of integers, got {text[:40]!r}")
    if not signed:  # dashes between two numbers separate them; one before a number alone makes it negative
        text = re.sub(r"(?<=\d)\s*(?:-\s*)+(?=\d)", " ", text)  # (``1 -- 2`` too: an undirected edge)
        if re.search(r"-\s*\d", text):
            raise ParseError(f"expected non-negative integers, got {text[:40]!r}")
    toks = re.findall(r"[+-]?\d+" if signed else r"\d+", text)
    if any(len(t.lstrip("+-")) > 1 and t.lstrip("+-")[0] == "0" for t in toks):
        raise ParseError("integers with leading zeros")
    return [int(x) for x in toks]


_ARROWS = re.compile(r"\\to\b|\\rightarrow\b|->|\u2192")


def parse_path(text: str) -> list[int]:
    """A path of vertices (non-negative integers) written with spaces, commas, dashes or arrows (``0 -> 3 -> 2``,
    ``0 \\to 3``, ``0-3-2``). An arrow reads as a comma: a dash after it makes a number negative (``0 -> -3`` is
    refused; read as ``0 3`` before)."""
    return parse_int_list(_ARROWS.sub(",", text), signed=False)


def parse_groups(text: str, k: int, signed: bool = False) -> list[tuple[int, ...]]:
    """A list of k-tuples of integers, e.g. edges ``(1,2), (2,3)`` or ``1-2 2-3``."""
    xs = parse_int_list(text, signed)
    if len(xs) % k:
        raise ParseError(f"expected groups of {k} integers")
    return [tuple(xs[i:i + k]) for i in range(0, len(xs), k)]


_FRAC_TEX = re.compile(r"^([+-]?)\\d?frac\{([^{}]*)\}\{([^{}]*)\}$")


_MIXED = re.compile(r"([+-]?)(\d+)\s+(\d+)\s*/\s*(\d+)")


def parse_fraction(text: str) -> Fraction:
    """A fraction p/q (or \\frac{p}{q}, a decimal, an integer), or a mixed number ``1 1/2`` (3/2): digits apart
    are never joined into one number (``1 1/2`` was read as 11/2)."""
    text = text.replace("\u2212", "-").strip().removesuffix(".")  # "67/36." ends a sentence, as "42." does
    if m := _MIXED.fullmatch(text):
        sign, whole, num, den = m.groups()
        if not 0 < int(num) < int(den):
            raise ParseError(f"not a mixed number: {text[:40]!r}")
        return (-1 if sign == "-" else 1) * (int(whole) + Fraction(int(num), int(den)))
    if re.search(r"\d\s+\d", text):
        raise ParseError(f"expected one fraction, got {text[:40]!r}")
    t = "".join(text.split())
    m = _FRAC_TEX.match(t)
    if m:
        t = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    t = t.replace("(", "").replace(")", "")
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)(?:/([+-]?\d+))?", t) if len(t) <= 2000 else None
    if m is None:
        raise ParseError(f"expected a fraction p/q, got {text[:40]!r}")
    # (a sign on the denominator, "1/-2", or a decimal over one, "1.5/3", as the pattern allows: Fraction() of the
    # whole string refuses both; a zero denominator raises ZeroDivisionError, which check() scores as wrong)
    return Fraction(m.group(1)) / (Fraction(int(m.group(2))) if m.group(2) else 1)


def parse_tokens(text: str) -> list[str]:
    # one final period ends the sentence ("B O O O."), as "42." is 42
    return [x for x in re.split(r"[\s,;]+", text.strip().removesuffix(".").strip().strip("[](){}")) if x]


def parse_grid(text: str, width: int | None = None) -> list[list[int]]:
    """Rows separated by newlines, ';', '/' or LaTeX '\\\\'; cells by spaces/commas, or a row
    of single digits written together (``1234``)."""
    rows = [r for r in re.split(r"\\\\|[;\n/]", text) if r.strip(" ,[](){}")]
    out = []
    for r in rows:
        r = r.strip().strip("[](){}").strip()
        if re.fullmatch(r"\d+", r) and (width is None or len(r) == width) and len(r) > 1:
            out.append([int(c) for c in r])
        else:
            out.append(parse_int_list(r))
    return out


def fmt_grid(grid: Sequence[Sequence[Any]]) -> str:
    return "; ".join(" ".join(str(x) for x in row) for row in grid)


def fmt_list(xs: Sequence[Any], sep: str = " ") -> str:
    return sep.join(str(x) for x in xs)


def frac_str(x: Fraction) -> str:
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


# --- answer-kind mixins ----------------------------------------------------------------------
class IntAnswer(GymEnv):
    """The answer is one integer compared for equality."""

    def parse(self, text, problem):
        return parse_int(text)

    def grade(self, problem, value):
        return 1.0 if value == int(problem.answer) else 0.0

    def wrong_answers(self, problem):
        a = int(problem.answer)
        return [str(a + 1), str(a - 1), str(a + 10), f"{a} or {a + 1}"]


class FracAnswer(GymEnv):
    """The answer is an exact rational number, stored as ``"p/q"``; any equal form is accepted."""

    def parse(self, text, problem):
        return parse_fraction(text)

    def grade(self, problem, value):
        return 1.0 if value == Fraction(problem.answer) else 0.0

    def wrong_answers(self, problem):
        a = Fraction(problem.answer)
        return [frac_str(a + Fraction(1, a.denominator + 1)), frac_str(1 - a) if a != Fraction(1, 2) else "1/3",
                frac_str(a + 2), f"{a.numerator}//{a.denominator}"]


class ListAnswer(GymEnv):
    """The answer is a list of integers. ``partial``: reward (fraction of correct positions)^10,
    ``INVALID`` for a wrong length (RLVE's sorting reward); otherwise exact match."""

    partial = True
    signed = True

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        return parse_int_list(text, self.signed)

    def grade(self, problem, value):
        ref = list(problem.answer)
        if len(value) != len(ref):
            return INVALID
        if not self.partial:
            return 1.0 if value == ref else 0.0
        if not ref:
            return 1.0
        return (sum(a == b for a, b in zip(value, ref)) / len(ref)) ** 10

    def wrong_answers(self, problem):
        ref = list(problem.answer)
        out = [fmt_list(ref + [0]), fmt_list(ref[:-1]) if len(ref) > 1 else "1 2 3 4 5 6 7 8 9"]
        if ref:
            bad = ref[:]
            bad[-1] += 1
            out.append(fmt_list(bad))
            out.append(fmt_list([x + 1 for x in ref]))
        return out


class StrAnswer(GymEnv):
    """The answer is a string compared after whitespace normalisation (case-sensitive unless
    ``fold_case``)."""

    fold_case = False

    def parse(self, text, problem):
        t = " ".join(text.split()).removesuffix(".").rstrip()  # "YES." is YES, as the integer answers take "42."
        t = unquote(t, str(problem.answer))
        if not t:
            raise ParseError("empty answer")
        return t.lower() if self.fold_case else t

    def grade(self, problem, value):
        ref = " ".join(str(problem.answer).split()).removesuffix(".").rstrip()
        return 1.0 if value == (ref.lower() if self.fold_case else ref) else 0.0

    def wrong_answers(self, problem):
        a = str(problem.answer)
        flipped = a[:-1] + ("b" if a[-1:] != "b" else "c") if a else "x"
        return [flipped, a + a[:1] if a else "y", a[::-1] + "z"]


def balanced(rng: random.Random, draw, common, keep: float = 0.25, tries: int = 40):
    """``draw()`` (a ``build``'s output) again while its answer is ``common`` (a predicate on the answer), keeping
    a common one with probability ``keep`` (and the last draw after ``tries``), so that no constant answer earns
    credit on most problems of a level."""
    for _ in range(tries):
        out = draw()
        if not common(out[1]) or rng.random() < keep:
            return out
    return out


def unquote(text: str, ref: str) -> str:
    """``text`` without the quotes around it (``'abc'``, ``"abc"``: the prompts show strings quoted), unless the
    reference answer is itself quoted."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" and ref[:1] != text[0]:
        return text[1:-1].strip()
    return text


def mismatch_fraction(value: Sequence, ref: Sequence) -> float:
    """Fraction of positions where two equal-length sequences agree."""
    return sum(a == b for a, b in zip(value, ref)) / max(1, len(ref))


# --- small math helpers used by several modules -------------------------------------------
def is_prime(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def random_prime(rng: random.Random, lo: int, hi: int) -> int:
    while True:
        p = rng.randint(lo, hi)
        if is_prime(p):
            return p


def factorize(n: int) -> dict[int, int]:
    """Trial division (the gym only factorises numbers it built from small primes)."""
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def lcm(a: int, b: int) -> int:
    return a // math.gcd(a, b) * b


def random_connected_graph(rng: random.Random, n: int, m: int, wmax: int | None = None):
    """Edges ``(u, v[, w])`` of a random connected simple undirected graph on ``0..n-1``."""
    m = max(n - 1, min(m, n * (n - 1) // 2))
    order = list(range(n))
    rng.shuffle(order)
    edges = set()
    for i in range(1, n):
        u, v = order[i], order[rng.randrange(i)]
        edges.add((min(u, v), max(u, v)))
    while len(edges) < m:
        u, v = rng.sample(range(n), 2)
        edges.add((min(u, v), max(u, v)))
    out = sorted(edges)
    rng.shuffle(out)
    if wmax is None:
        return out
    return [(u, v, rng.randint(1, wmax)) for u, v in out]


def random_tree(rng: random.Random, n: int) -> list[tuple[int, int]]:
    order = list(range(n))
    rng.shuffle(order)
    return [(order[rng.randrange(i)], order[i]) for i in range(1, n)]


def fmt_edges(edges, weighted: bool = False) -> str:
    if weighted:
        return "\n".join(f"{u} {v} {w}" for u, v, w in edges)
    return "\n".join(f"{u} {v}" for u, v in edges)
