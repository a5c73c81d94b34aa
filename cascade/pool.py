"""Pass-rate filtering of a prompt pool: keep the prompts the incoming policy solves at most
``max_pass_rate`` of the time (ZAYA1 re-filters the pool between stages), then sample from it."""
from __future__ import annotations

import random

from envs.base import Problem


def filter_by_pass_rate(trainer, picks: list[tuple[str, Problem]], samples: int, max_pass_rate: float,
                        min_pass_rate: float = 0.0) -> tuple[list[tuple[str, Problem]], list[float]]:
    """Measure each problem's pass rate with ``samples`` rollouts; keep those within the bounds."""
    groups = trainer.generate_groups(picks, group_size=samples, update_curriculum=False)
    rates = [sum(r.score.correct for r in g.rollouts) / len(g.rollouts) for g in groups]
    kept = [pk for pk, r in zip(picks, rates) if min_pass_rate <= r <= max_pass_rate]
    return kept, rates


class ProblemPool:
    """A fixed list of problems with the curriculum interface the RL trainer uses (sampling is
    uniform over the pool; verification and difficulty state stay with the wrapped curriculum)."""

    def __init__(self, curriculum, problems: list[tuple[str, Problem]]):
        if not problems:
            raise ValueError("the pass-rate filter kept no problems; widen pool.max_pass_rate or grow pool.size")
        self.curriculum = curriculum
        self.problems = list(problems)
        self.envs, self.controllers = curriculum.envs, curriculum.controllers

    def sample(self, rng: random.Random, n: int) -> list[tuple[str, Problem]]:
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(int(n))]

    def update(self, env_id: str, difficulty: int, scores) -> None:
        self.curriculum.update(env_id, difficulty, scores)

    def difficulties(self) -> dict:
        return self.curriculum.difficulties()

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(),
                "problems": [[e, p.to_dict()] for e, p in self.problems]}

    def load_state_dict(self, st: dict) -> None:
        self.curriculum.load_state_dict(st["curriculum"])
        self.problems = [(e, Problem.from_dict(p)) for e, p in st["problems"]]
