"""Pass-rate filtering of a prompt pool: keep the prompts the incoming policy solves at most
``max_pass_rate`` of the time (ZAYA1 re-filters the pool between stages), then sample from it."""
from __future__ import annotations

import random

from envs.base import Problem


def filter_by_pass_rate(trainer, picks: list[tuple[str, Problem]], samples: int, max_pass_rate: float,
                        min_pass_rate: float = 0.0, chunk: int = 0,
                        advance=None) -> tuple[list[tuple[str, Problem]], list[float]]:
    """Measure each problem's pass rate with ``samples`` rollouts; keep those within the bounds.
    Problems go to the engine ``chunk`` at a time (0: all at once), ``advance(k)`` called after each
    chunk of k; a prompt too long for the context gets no rollouts and is not kept."""
    size = chunk if chunk > 0 else max(len(picks), 1)
    groups = []
    for i in range(0, len(picks), size):
        part = picks[i:i + size]
        groups += trainer.generate_groups(part, group_size=samples, update_curriculum=False)
        if advance is not None:
            advance(len(part))
    rates = [sum(r.score.correct for r in g.rollouts) / len(g.rollouts) for g in groups]
    kept = [(g.env_id, g.problem) for g, r in zip(groups, rates) if min_pass_rate <= r <= max_pass_rate]
    return kept, rates


class ProblemPool:
    """A fixed list of problems with the curriculum interface the RL trainer uses: an environment is
    drawn by the wrapped curriculum's weights (the stage's mix, or its current phase's) among those
    with problems in the pool, then one of its problems uniformly; with none of the mix's
    environments in the pool, a problem uniformly. Verification and difficulty state stay with the
    wrapped curriculum."""

    def __init__(self, curriculum, problems: list[tuple[str, Problem]]):
        if not problems:
            raise ValueError("the pass-rate filter kept no problems; widen pool.max_pass_rate or grow pool.size")
        self.curriculum = curriculum
        self.problems = list(problems)
        self.envs, self.controllers = curriculum.envs, curriculum.controllers

    def sample(self, rng: random.Random, n: int) -> list[tuple[str, Problem]]:
        by_env: dict[str, list[int]] = {}
        for i, (e, _) in enumerate(self.problems):
            by_env.setdefault(e, []).append(i)
        w = getattr(self.curriculum, "weights", {})
        ids = [e for e in by_env if w.get(e, 0) > 0]
        if not ids:
            return [self.problems[rng.randrange(len(self.problems))] for _ in range(int(n))]
        out = []
        for _ in range(int(n)):
            idx = by_env[rng.choices(ids, weights=[w[e] for e in ids])[0]]
            out.append(self.problems[idx[rng.randrange(len(idx))]])
        return out

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
