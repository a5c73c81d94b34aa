"""Markovian RSA (ZAYA1 §VI; recursive self-aggregation with bounded tails).

Round 0: N independent traces of the problem, each under the thinking budget beta. Rounds 1..T:
each of N new candidates sees the problem plus C tails (the last tau tokens of a trace, cut with
the policy's tokenizer) drawn uniformly without replacement from the previous round only; its own
tail joins the new population. The answer comes from the final round; a final-round trace cut at
beta gets a separate final-answer budget to finish (``force_answer`` then up to ``final_budget``
tokens). Aggregation prompts are at most ``|q| + C*tau + |template|`` tokens.

Variants on the same loop: ``full`` (tau = beta: full-chain RSA), ``delethink`` (C = 1, each chain
continues its own tail after the assistant header: parallel Delethink), ``pacore`` (a candidate
that finished forwards its post-``</think>`` answer instead of its tail). T = 0 is plain parallel
sampling; majority vote and pass@N over the final population are always reported.

Metrics (``RSAResult.metrics``): ``mean_accuracy`` over the final population (after the
final-answer step), ``round_accuracy`` per round (earlier rounds graded on their traces as they
are), ``majority_accuracy`` (equivalent answers clustered with the grader), ``pass_at_n``,
``generated_tokens`` (sum of completion lengths), ``prefill_tokens`` (sum of the prompt lengths of
all requests; a prompt sampled n times counts once), per-round token counts and wall time.

Seeds: round 0 samples the solve prompt with ``n=N, seed=seed`` (exactly parallel sampling); an
aggregation request's seed and its parents depend only on (seed, round, candidate), so a run is
the same whatever the backend's batching or request order.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from train.engine.base import Completion, SamplingParams
from ttc.templates import PromptBuilder, Template, load_template

VARIANTS = ("rsa", "full", "delethink", "pacore")
_M64 = 2**64 - 1


def derive_seed(seed: int, *keys: int) -> int:
    """A 31-bit seed from ``seed`` and integer keys (SplitMix64 mixing); fits any server's seed field."""
    x = seed & _M64
    for k in keys:
        x = (x + 0x9E3779B97F4A7C15 + (k & _M64) * 0xD1B54A32D192ED03) & _M64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    return x & (2**31 - 1)


@dataclass
class RSAConfig:
    population: int = 16      # N
    aggregate: int = 4        # C, tails per aggregation prompt
    rounds: int = 2           # T, aggregation rounds after round 0
    budget: int = 40000       # beta, max tokens per candidate per round
    tail: int = 4096          # tau, tokens of each trace forwarded
    final_budget: int | None = None  # tokens to finish a final-round trace cut at beta; None = beta, 0 = off
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    variant: str = "rsa"

    def resolved(self) -> "RSAConfig":
        """The config with the variant applied, validated (one-line ValueErrors)."""
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose from {', '.join(VARIANTS)}")
        for name in ("population", "aggregate", "budget", "tail"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        c = replace(self)
        if c.variant == "full":
            c.tail = c.budget
        if c.variant == "delethink":
            c.aggregate = 1
        if c.tail > c.budget:
            raise ValueError(f"tail tau={c.tail} exceeds the thinking budget beta={c.budget}; need tau <= beta")
        if c.aggregate > c.population:
            raise ValueError(f"aggregate C={c.aggregate} exceeds the population N={c.population}; "
                             f"tails are drawn without replacement")
        if c.final_budget is None:
            c.final_budget = c.budget
        if c.final_budget < 0:
            raise ValueError(f"final_budget must be >= 0, got {c.final_budget}")
        SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p)  # validates
        return c

    def sampling(self, max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, max_tokens=max_tokens)


@dataclass
class PromptRecord:
    """One request sent to the backend."""

    stage: str                 # "solve" | "aggregate" | "continue" | "final"
    round: int
    index: int                 # candidate index (0 for the round-0 solve request, which has n=N)
    prompt_ids: list[int]
    n: int
    seed: int
    max_tokens: int
    parents: list[int] = field(default_factory=list)          # indices into the previous round
    forwarded: list[list[int]] = field(default_factory=list)  # the tails as placed in the prompt


@dataclass
class Candidate:
    round: int
    index: int
    prompt_ids: list[int]
    token_ids: list[int]        # generated tokens, as the backend returned them
    text: str
    finish_reason: str
    parents: list[int] = field(default_factory=list)
    final_text: str | None = None   # text after the final-answer continuation (final round only)
    answer: str | None = None
    correct: bool | None = None

    @property
    def response(self) -> str:
        return self.final_text if self.final_text is not None else self.text


@dataclass
class RSAResult:
    config: RSAConfig
    problem: str
    gold: str | None
    rounds: list[list[Candidate]]
    prompts: list[PromptRecord]
    metrics: dict

    @property
    def final(self) -> list[Candidate]:
        return self.rounds[-1]


# -- answers and metrics ------------------------------------------------------------------------

_CODE_BLOCK = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)


def extract_answer(text: str, answer_format: str = "boxed") -> str | None:
    """The answer of a response: the last ``\\boxed{}`` after ``</think>`` (whole text without
    one), or the last fenced code block."""
    from envs.base import last_boxed, strip_think

    body = strip_think(text)
    if answer_format == "code":
        blocks = _CODE_BLOCK.findall(body)
        return blocks[-1].strip() if blocks else None
    return last_boxed(body)


def math_grader(pred: str | None, gold: str | None) -> bool:
    from envs.math import math_equal

    return pred is not None and gold is not None and math_equal(pred, gold)


def exact_grader(pred: str | None, gold: str | None) -> bool:
    norm = lambda s: " ".join(str(s).split()).strip().rstrip(".").lower()  # noqa: E731
    return pred is not None and gold is not None and norm(pred) == norm(gold)


GRADERS = {"math": math_grader, "exact": exact_grader}


def majority_vote(answers: list[str | None], same: Callable[[str, str], bool]) -> tuple[str | None, int]:
    """The most common answer (clusters of equivalent answers; ties go to the earliest) and its count."""
    clusters: list[list[str]] = []
    for a in answers:
        if a is None or not str(a).strip():
            continue
        for c in clusters:
            if a == c[0] or same(a, c[0]):
                c.append(a)
                break
        else:
            clusters.append([a])
    if not clusters:
        return None, 0
    best = max(clusters, key=len)  # max keeps the first of equal lengths
    return best[0], len(best)


def _mean(xs):
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# -- the algorithm -----------------------------------------------------------------------------


class MarkovianRSA:
    """Run Markovian RSA over a :class:`~ttc.backends.Backend`."""

    def __init__(self, backend, config: RSAConfig, template: str | Template = "math",
                 grader: str | Callable[[str | None, str | None], bool] | None = None):
        self.backend = backend
        self.config = config.resolved()
        self.template = load_template(template)
        if grader is None:
            grader = "math" if self.template.name == "math" else "exact"
        self.grader = GRADERS[grader] if isinstance(grader, str) else grader
        self.builder = PromptBuilder(self.template, backend.encode, backend.chat_parts())
        think = backend.encode("</think>")
        self.think_end = think[0] if len(think) == 1 else None
        self.eos = set(backend.eos_ids)

    # traces and what they forward
    def trace_ids(self, c: Candidate) -> list[int]:
        """The candidate's generated tokens without a final end-of-sequence token."""
        ids = list(c.token_ids)
        if c.finish_reason == "stop" and ids and ids[-1] in self.eos:
            ids = ids[:-1]
        return ids

    def has_think_end(self, ids: list[int]) -> bool:
        return (self.think_end in ids) if self.think_end is not None else "</think>" in self.backend.decode(ids)

    def forwarded(self, c: Candidate) -> list[int]:
        """What a candidate passes on: the last tau tokens of its trace; under ``pacore`` a finished
        candidate's post-``</think>`` answer (also at most tau tokens)."""
        tau = self.config.tail
        ids = self.trace_ids(c)
        if self.config.variant == "pacore" and (c.finish_reason == "stop" or self.has_think_end(ids)):
            if self.think_end is not None and self.think_end in ids:
                ans = ids[len(ids) - ids[::-1].index(self.think_end):]
            elif self.think_end is None and "</think>" in (text := self.backend.decode(ids)):
                ans = self.backend.encode(text.rsplit("</think>", 1)[1])
            else:
                ans = ids
            if ans:
                return ans[-tau:]
        return ids[-tau:]

    def parents(self, rnd: int, index: int) -> list[int]:
        cfg = self.config
        if cfg.variant == "delethink":
            return [index]
        return random.Random(derive_seed(cfg.seed, 1, rnd, index)).sample(range(cfg.population), cfg.aggregate)

    # one run
    def run(self, problem: str, gold: str | None = None) -> RSAResult:
        cfg, be = self.config, self.backend
        t0 = time.perf_counter()
        q = be.encode(problem)
        prompts: list[PromptRecord] = []
        gen_tok = prefill_tok = 0
        round_tokens = []

        def send(records: list[PromptRecord]) -> tuple[list[Completion], int, int]:
            nonlocal gen_tok, prefill_tok
            params = cfg.sampling(records[0].max_tokens, records[0].n)
            outs = be.generate([r.prompt_ids for r in records], params, seeds=[r.seed for r in records])
            if len(outs) != sum(r.n for r in records):
                want = sum(r.n for r in records)
                raise RuntimeError(f"backend returned {len(outs)} completions for {want} requested")
            prompts.extend(records)
            g = sum(len(c.token_ids) for c in outs)
            p = sum(len(r.prompt_ids) for r in records)
            gen_tok += g
            prefill_tok += p
            return outs, g, p

        # round 0: plain parallel sampling
        p0 = self.builder.solve(q)
        outs, g, p = send([PromptRecord("solve", 0, 0, p0, cfg.population, cfg.seed, cfg.budget)])
        rounds = [[Candidate(0, i, p0, c.token_ids, c.text, c.finish_reason) for i, c in enumerate(outs)]]
        round_tokens.append({"generated": g, "prefill": p})
        # rounds 1..T: aggregate C tails of the previous round
        for t in range(1, cfg.rounds + 1):
            prev = rounds[-1]
            tails = [self.forwarded(c) for c in prev]
            recs = []
            for i in range(cfg.population):
                par = self.parents(t, i)
                fw = [tails[j] for j in par]
                if cfg.variant == "delethink":
                    ids, stage = self.builder.cont(q, fw[0]), "continue"
                else:
                    ids, stage = self.builder.aggregate(q, fw), "aggregate"
                recs.append(PromptRecord(stage, t, i, ids, 1, derive_seed(cfg.seed, 2, t, i), cfg.budget, par, fw))
            outs, g, p = send(recs)
            rounds.append([Candidate(t, i, r.prompt_ids, c.token_ids, c.text, c.finish_reason, r.parents)
                           for i, (r, c) in enumerate(zip(recs, outs))])
            round_tokens.append({"generated": g, "prefill": p})
        # final answers for traces cut at the budget
        final_g = final_p = 0
        cut = [c for c in rounds[-1] if c.finish_reason == "length"]
        if cut and cfg.final_budget:
            force = self.builder.force_answer()
            recs, extra = [], []
            for c in cut:
                trace = self.trace_ids(c)
                add = [] if self.has_think_end(trace) else force
                extra.append(add)
                recs.append(PromptRecord("final", cfg.rounds, c.index, c.prompt_ids + trace + add, 1,
                                         derive_seed(cfg.seed, 3, cfg.rounds, c.index), cfg.final_budget))
            outs, final_g, final_p = send(recs)
            for c, add, o in zip(cut, extra, outs):
                c.final_text = c.text + (be.decode(add) if add else "") + o.text
        # grading
        fmt = self.template.answer_format
        for rnd in rounds:
            for c in rnd:
                c.answer = extract_answer(c.response, fmt)
                c.correct = self.grader(c.answer, gold) if gold is not None else None
        final = rounds[-1]
        maj, maj_count = majority_vote([c.answer for c in final], lambda a, b: self.grader(a, b))
        have_gold = gold is not None
        metrics = {
            "mean_accuracy": _mean(c.correct for c in final) if have_gold else None,
            "round_accuracy": [_mean(c.correct for c in rnd) for rnd in rounds] if have_gold else None,
            "majority_accuracy": float(self.grader(maj, gold)) if have_gold else None,
            "pass_at_n": float(any(c.correct for c in final)) if have_gold else None,
            "majority_answer": maj,
            "majority_count": maj_count,
            "answers": [c.answer for c in final],
            "generated_tokens": gen_tok,
            "prefill_tokens": prefill_tok,
            "round_tokens": round_tokens,
            "final_answer_tokens": {"generated": final_g, "prefill": final_p},
            "requests": len(prompts),
            "wall_s": time.perf_counter() - t0,
        }
        return RSAResult(cfg, problem, gold, rounds, prompts, metrics)


def run_rsa(backend, problem: str, config: RSAConfig, gold: str | None = None, template: str | Template = "math",
            grader=None) -> RSAResult:
    """One problem through Markovian RSA (see :class:`MarkovianRSA`)."""
    return MarkovianRSA(backend, config, template, grader).run(problem, gold)


def config_dict(cfg: RSAConfig) -> dict:
    return asdict(cfg)
