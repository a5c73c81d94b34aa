"""TTC aggregation prompts for RL (Markovian RSA round 1): problems whose prompt shows C tails of
the policy's own earlier rollouts of the same problem, judged by the same verifier."""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import replace

from envs.base import Problem
from ttc.templates import load_template


def _key(env_id: str, p: Problem) -> str:
    return f"{env_id}|{p.seed}|{p.difficulty}"


class AggregationMixer:
    """Remembers the tails of recent rollouts per problem and turns a share of the sampled problems
    into aggregation problems. Hook it into the RL trainer with ``problem_hook=mixer.mix`` and
    ``rollout_hook=mixer.remember``."""

    def __init__(self, tokenizer, fraction: float, tails: int, tail_tokens: int, template: str = "math",
                 buffer: int = 256, seed: int = 0):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"aggregation.fraction must be in [0, 1], got {fraction}")
        self.tok, self.fraction, self.C, self.tau = tokenizer, fraction, tails, tail_tokens
        self.template = load_template(template)
        self.buffer = buffer
        self.rng = random.Random(seed)
        self.pool: OrderedDict[str, tuple[str, dict, list[str]]] = OrderedDict()
        self.made = 0

    def tail_text(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids[-self.tau:], skip_special_tokens=False)

    def remember(self, groups) -> None:
        for g in groups:
            if g.problem.meta.get("aggregation"):
                continue
            tails = [self.tail_text(r.completion.token_ids) for r in g.rollouts]
            if len(tails) >= self.C:
                self.pool[_key(g.env_id, g.problem)] = (g.env_id, g.problem.to_dict(), tails)
                self.pool.move_to_end(_key(g.env_id, g.problem))
        while len(self.pool) > self.buffer:
            self.pool.popitem(last=False)

    def build(self, env_id: str, problem: Problem, tails: list[str]) -> Problem:
        t = self.template
        blocks = "".join(t.candidate.format(tail=x, index=i + 1) for i, x in enumerate(tails))
        prompt = t.aggregate.format(problem=problem.prompt, candidates=blocks, count=len(tails))
        return replace(problem, prompt=prompt, meta={**problem.meta, "aggregation": True, "tails": len(tails)})

    def mix(self, picks: list[tuple[str, Problem]]) -> list[tuple[str, Problem]]:
        if not self.pool or self.fraction <= 0:
            return picks
        out = []
        keys = list(self.pool)
        for env_id, p in picks:
            if self.rng.random() < self.fraction:
                e, pd, tails = self.pool[self.rng.choice(keys)]
                out.append((e, self.build(e, Problem.from_dict(pd), self.rng.sample(tails, self.C))))
                self.made += 1
            else:
                out.append((env_id, p))
        return out

    def state_dict(self) -> dict:
        st = self.rng.getstate()
        return {"pool": [[k, *v] for k, v in self.pool.items()], "rng": [st[0], list(st[1]), st[2]], "made": self.made}

    def load_state_dict(self, st: dict) -> None:
        self.pool = OrderedDict((k, (e, pd, tails)) for k, e, pd, tails in st["pool"])
        v, internal, gauss = st["rng"]
        self.rng.setstate((v, tuple(internal), gauss))
        self.made = int(st["made"])
