"""Small arithmetic environments sized for CPU smoke tests and learning demonstrations."""
from __future__ import annotations

from envs.base import Environment, Problem, Score, register


def _parse_int(s: str | None) -> int | None:
    if s is None:
        return None
    s = s.strip().replace(",", "")
    if len(s) > 64:
        return None
    try:
        return int(s)
    except ValueError:
        return None


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
    """a + b with operands of up to d + 1 digits."""

    description = "add two numbers; operands grow one digit per difficulty level"

    def generate(self, seed: int, difficulty: int) -> Problem:
        rng = self.rng(seed, difficulty)
        hi = 10 ** (int(difficulty) + 1) - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return self.problem(f"{a}+{b}=", a + b, seed, difficulty)


@register("toy/max")
class MaxEnv(_IntAnswerEnv):
    """The largest of 2 + d numbers below 10."""

    description = "the largest of a list of digits; the list grows with difficulty"

    def generate(self, seed: int, difficulty: int) -> Problem:
        rng = self.rng(seed, difficulty)
        xs = [rng.randint(0, 9) for _ in range(2 + int(difficulty))]
        return self.problem("max " + " ".join(map(str, xs)), max(xs), seed, difficulty)
