"""Small arithmetic environments sized for CPU smoke tests and learning demonstrations."""
from __future__ import annotations

import re

from envs.base import Environment, Problem, Score, register


_INT = re.compile(r"(?:[A-Za-z]\s*=\s*)?([+-]?(?:\d{1,3}(?:,\d{3})+|\d+))")
_BOLD = re.compile(r"\\(?:textbf|mathbf)\{([^{}]*)\}")


def _parse_int(s: str | None) -> int | None:
    """An integer answer: digits, signed, thousands as ``1,000`` only, after ``x =`` or not (``1,4,4`` and
    Python's ``1_4_4`` are not 144); in ``$...$``, bold or ending a sentence (``333.``) as the math environments
    read it."""
    if s is None:
        return None
    s = _BOLD.sub(r"\1", s.strip().strip("$").strip()).strip().strip("$").strip()
    m = _INT.fullmatch(s[:-1].rstrip() if s.endswith(".") else s)
    if m is None or sum(ch.isdigit() for ch in m[1]) > 64:  # digits (not signs or thousands commas)
        return None
    return int(m[1].replace(",", ""))


class _IntAnswerEnv(Environment):
    family = "arithmetic"

    def check(self, problem: Problem, response: str) -> Score:
        got = _parse_int(self.extract(response))
        if got is None:
            return Score.zero("no integer answer in \\boxed{}")
        ok = got == int(problem.answer)
        return Score(1.0 if ok else 0.0, ok, True, {"got": got})

    def corruptions(self, problem: Problem) -> list[str]:
        a = int(problem.answer)
        return ["", f"{a}", f"\\boxed{{{a + 1}}}", f"\\boxed{{{a - 1}}}", "\\boxed{}"]


@register("toy/add")
class AddEnv(_IntAnswerEnv):
    """a + b with operands up to 9, 19, 49, 99, 199, 499, 999, ... (a 1-2-5 series: three levels per
    digit), so that each level is a step a small policy can take (one digit per level was a cliff: a
    tiny policy at 0.3 on single digits scored 0.03 on two)."""

    description = "add two numbers; the operands' bound grows 1-2-5 (9, 19, 49, 99, ...) with difficulty"
    max_difficulty = 188  # the last level whose sums fit the verifier's 64 digits (d = 189: 65-digit sums)

    def generate(self, seed: int, difficulty: int) -> Problem:
        rng = self.rng(seed, difficulty)
        d = int(difficulty)
        hi = (1, 2, 5)[d % 3] * 10 ** (d // 3 + 1) - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return self.problem(f"{a}+{b}=", a + b, seed, difficulty)


@register("toy/max")
class MaxEnv(_IntAnswerEnv):
    """The largest of 2 + d numbers: digits up to d = 3, then one more digit every 4 levels (below 100
    for d = 4..7, below 1000 for d = 8..11, ...), so that answering the top value never gets easier: with
    digits only, ``9`` would be right 1 - 0.9^(2 + d) of the time (52% at d = 5, 91% at d = 21)."""

    description = "the largest of a list of numbers; the list grows with difficulty, the numbers every 4 levels"
    max_difficulty = 255  # the last level whose numbers fit the verifier's 64 digits (d = 256: 65 digits)

    def generate(self, seed: int, difficulty: int) -> Problem:
        rng = self.rng(seed, difficulty)
        d = int(difficulty)
        hi = 10 ** (1 + d // 4) - 1
        xs = [rng.randint(0, hi) for _ in range(2 + d)]
        return self.problem("max " + " ".join(map(str, xs)), max(xs), seed, difficulty)
