"""Reverse a word: a complete Cascade environment in a third-party package.

The entry point ``example/reverse`` in pyproject.toml registers :class:`ReverseEnv`; the id comes
from the entry point's name, so the class needs no ``@register`` decorator.
"""
from envs import Environment, Problem, Score

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ReverseEnv(Environment):
    family = "example"
    description = "reverse a random word (example plug-in); length 3 + difficulty"

    def generate(self, seed: int, difficulty: int) -> Problem:
        rng = self.rng(seed, difficulty)
        word = "".join(rng.choice(_LETTERS) for _ in range(3 + max(0, int(difficulty))))
        return self.problem(f"Write the word '{word}' backwards.", word[::-1], seed, difficulty)

    def check(self, problem: Problem, response: str) -> Score:
        answer = self.extract(response)
        if answer is None:
            return Score.zero("no \\boxed{} answer")
        ok = answer.strip().lower() == problem.answer
        return Score(1.0 if ok else 0.0, ok, True)
