"""Markovian RSA (ZAYA1 §VI; recursive self-aggregation with bounded tails).

Round 0: N independent traces of the problem, each under the thinking budget beta. Rounds 1..T:
each of N new candidates sees the problem plus C tails (the last tau tokens of a trace, cut with
the policy's tokenizer) drawn uniformly without replacement from the previous round only; its own
tail joins the new population. The answer comes from the final round; a final-round trace cut at
beta gets a separate final-answer budget to finish (``force_answer`` then up to ``final_budget``
tokens). Aggregation prompts are at most ``|q| + C*tau + |template|`` tokens.

Variants on the same loop: ``full`` (tau = beta: full-chain RSA), ``pacore`` (a candidate that
finished forwards its post-``</think>`` answer instead of its tail) and ``delethink`` (parallel
Delethink, Aghajohari et al. 2025: each of the N chains reasons in chunks; chunk 1 is the round-0
trace under beta; every later chunk's prompt is the solve prompt followed by the chain's Markovian
state -- its first ``anchor`` tokens (default 0) and its last tau tokens -- and it generates up to
beta - tau - anchor tokens, so each chunk's context stays within |q| + beta + |template|. A chain
that stops (EOS) is frozen: it is carried unchanged into later rounds and graded on its whole trace,
all chunks in order). T = 0 is plain parallel sampling; majority vote and pass@N over the final
population are always reported.

Metrics (``RSAResult.metrics``): ``mean_accuracy`` over the final population (after the
final-answer step), ``round_accuracy`` and ``round_majority_accuracy`` per round (earlier rounds
graded on their traces as they are), ``majority_accuracy`` (answers clustered when the grader
takes them as equal both ways), ``pass_at_n``, the unbiased ``pass_at_k`` (k = 1, 2, 4, ..., N; per round in
``round_pass_at_k``), ``generated_tokens`` (sum of completion lengths), ``prefill_tokens`` (sum of
the prompt lengths of all requests; a prompt sampled n times counts once), ``usage`` as the server
reported it (OpenAI-compatible backends), per-round token counts and wall time.

Seeds: every request's seed and every parent draw depend on (seed, the problem, round,
candidate) -- the problem enters through a hash of its key -- so different problems get
different subsets and samples, and a run is the same whatever the backend's batching, request
order or the other problems in flight. Round 0 samples the solve prompt once with ``n=N``
(parallel sampling).

:meth:`MarkovianRSA.plan` lists the largest request of every stage, and
:meth:`MarkovianRSA.check_plan` refuses (or, with ``clamp``, shrinks the budgets of) a run whose
requests could exceed the model's context, before anything is generated.
"""
from __future__ import annotations

import hashlib
import inspect
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

from envs.base import open_think
from train.tokenizer import whole_chars
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
    repetition_penalty: float = 1.0  # vLLM's penalties (train/engine/base.py's SamplingParams)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    variant: str = "rsa"
    anchor: int = 0           # delethink: tokens kept from the start of each chain in every later chunk

    @property
    def chunk_budget(self) -> int:
        """Delethink: the tokens a chunk after the first generates (beta - tau - anchor), so that
        every chunk's context stays within |q| + beta + |template|."""
        return self.budget - self.tail - self.anchor

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
        if c.rounds and c.tail > c.budget:  # rounds=0 is parallel sampling: no tails, no aggregation
            raise ValueError(f"tail tau={c.tail} exceeds the thinking budget beta={c.budget}; need tau <= beta")
        if c.rounds and c.aggregate > c.population:
            raise ValueError(f"aggregate C={c.aggregate} exceeds the population N={c.population}; "
                             f"tails are drawn without replacement")
        if c.anchor < 0:
            raise ValueError(f"anchor must be >= 0, got {c.anchor}")
        if c.anchor and c.variant != "delethink":
            raise ValueError("anchor applies to the delethink variant only")
        if c.variant == "delethink" and c.rounds and c.chunk_budget < 1:
            raise ValueError(f"delethink: tail tau={c.tail} + anchor={c.anchor} leaves no budget for later chunks "
                             f"(beta={c.budget}); need tau + anchor < beta")
        if c.final_budget is None:
            c.final_budget = c.budget
        if c.final_budget < 0:
            raise ValueError(f"final_budget must be >= 0, got {c.final_budget}")
        c.sampling(1)  # validates
        return c

    def sampling(self, max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, max_tokens=max_tokens, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


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


def _plain(obj) -> dict:
    """A flat dataclass of scalars and (nested) lists of ints as a dict of copies: ``asdict`` without
    its per-element deep copy (which cost ~10 ms per problem and round at 64 x 128 tokens)."""
    return {f.name: _copy_lists(getattr(obj, f.name)) for f in fields(obj)}


def _copy_lists(v):
    return [_copy_lists(x) for x in v] if type(v) is list and v and type(v[0]) is list else (
        list(v) if type(v) is list else v)


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
    history_ids: list[int] = field(default_factory=list)  # delethink: the chain's earlier chunks (traces)
    history_text: str = ""
    frozen: bool = False        # delethink: the chain stopped in an earlier round and is carried as it was

    @property
    def response(self) -> str:
        """What is graded: the whole trace (a Delethink chain's chunks in order), then the final answer."""
        return self.history_text + (self.final_text if self.final_text is not None else self.text)


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


def grader_name(template: Template, grader: str | None) -> str:
    """The grader a run uses: ``grader`` when given, else ``math`` for the math template (and a file based on it),
    ``exact`` for the others (the resume key holds this name, so ``--grader math`` equals the math default)."""
    if grader is not None:
        return grader
    return "math" if (template.base or template.name) == "math" else "exact"


def majority_vote(answers: list[str | None], same: Callable[[str, str], bool]) -> tuple[str | None, int]:
    """The most common answer (clusters of equivalent answers; ties go to the earliest) and its count. An answer
    joins a cluster only when it and the cluster's first are equal both ways: ``same`` may be one-sided (math_equal
    takes 0.333333 for 1/3 as a prediction, not the reverse), and a one-way match would let a stray rounding
    absorb the answers it is near, with a result that depends on their order."""
    clusters: list[list[str]] = []
    for a in answers:
        if a is None or not str(a).strip():
            continue
        for c in clusters:
            if a == c[0] or (same(a, c[0]) and same(c[0], a)):
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
        if not callable(grader):
            grader = grader_name(self.template, grader)  # a file on math too
        self.grader = GRADERS[grader] if isinstance(grader, str) else grader
        parts = backend.chat_parts()
        self.builder = PromptBuilder(self.template, backend.encode, parts)
        self.think_open = open_think(parts[1])  # a template that opens the thinking: answers are read with it in front
        self.think_close = backend.encode("</think>")
        self.think_end = self.think_close[0] if len(self.think_close) == 1 else None
        start = backend.encode("<think>")
        self.think_start = start[0] if len(start) == 1 else None
        self.eos = set(backend.eos_ids)
        try:
            self._takes_usage = "usage" in inspect.signature(backend.generate).parameters
        except (TypeError, ValueError):
            self._takes_usage = False

    # traces and what they forward
    def trace_ids(self, c: Candidate) -> list[int]:
        """The candidate's generated tokens without a final end-of-sequence token."""
        ids = list(c.token_ids)
        if c.finish_reason == "stop" and ids and ids[-1] in self.eos:
            ids = ids[:-1]
        return ids

    def has_think_end(self, ids: list[int]) -> bool:
        return (self.think_end in ids) if self.think_end is not None else "</think>" in self.backend.decode(ids)

    def past_thinking(self, ids: list[int]) -> bool:
        """Whether ``ids`` hold a ``</think>`` with no ``<think>`` after it: a trace that is answering."""
        if self.think_end is None or self.think_start is None:
            text = self.backend.decode(ids)
            return text.rfind("</think>") > text.rfind("<think>")
        for t in reversed(ids):
            if t in (self.think_end, self.think_start):
                return t == self.think_end
        return False

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
                return self.whole_chars(ans[-tau:])
        return self.whole_chars(ids[-tau:])

    def whole_chars(self, ids: list[int], lead: bool = True) -> list[int]:
        """``ids`` (a cut of a trace) less the remnant of a character the cut split, at its start (``lead``) or its
        end, where the backend sends text (``--api chat``): decoded there, the remnant is U+FFFD, which the server
        reads, and re-tokenises, as itself. Token-id backends send the ids as cut."""
        if not getattr(self.backend, "sends_text", False):
            return ids
        return whole_chars(self.backend.decode, ids, lead)[0]

    def parents(self, rnd: int, index: int, pkey: int = 0) -> list[int]:
        cfg = self.config
        if cfg.variant == "delethink":
            return [index]
        return random.Random(derive_seed(cfg.seed, 1, pkey, rnd, index)).sample(range(cfg.population), cfg.aggregate)

    def chain_ids(self, c: Candidate) -> list[int]:
        """Delethink: every token of the chain so far (earlier chunks, then this one's trace)."""
        return list(c.history_ids) + self.trace_ids(c)

    def carry(self, c: Candidate) -> list[int]:
        """Delethink's Markovian state: the chain's first ``anchor`` tokens, then its last ``tail``. Where the chain is
        answering and its last ``</think>`` lies between them, ``</think>`` takes the tail's first tokens (the carry
        stays within ``anchor + tail``): the continuation must read as answering too -- a model would think again,
        and a chat server's reasoning parser takes a continuation with no ``</think>`` before it for thinking."""
        cfg, ids = self.config, self.chain_ids(c)
        head = ids[:cfg.anchor]
        tail = ids[max(len(head), len(ids) - cfg.tail):]
        if len(head) + len(tail) == len(ids):
            return head + tail
        # a gap between them: the tail starts at a cut, and the head ends at one
        past = self.past_thinking(ids[len(head):]) and not self.has_think_end(tail)
        close = self.think_close if past and len(self.think_close) <= len(tail) else []
        tail = self.whole_chars(tail[len(close):])
        head = self.whole_chars(head, lead=False) if head else head
        return head + close + tail

    # the plan: every prompt of every round fits the model's context
    def plan(self, problem_tokens: int) -> list[dict]:
        """The largest request of each stage for a problem of ``problem_tokens`` tokens (``len(encode(problem))``;
        the prompts of :meth:`run`, which hold the problem as text, are never longer: see
        :class:`~ttc.templates.PromptBuilder`): ``{"stage", "round", "prompt", "max_tokens", "total"}``
        (prompt + max_tokens)."""
        cfg, b = self.config, self.builder
        q = [0] * problem_tokens
        steps = [{"stage": "solve", "round": 0, "prompt": len(b.solve(q)), "max_tokens": cfg.budget}]
        if cfg.rounds:
            if cfg.variant == "delethink":
                steps.append({"stage": "continue", "round": 1,
                              "prompt": len(b.cont(q, [])) + cfg.anchor + cfg.tail, "max_tokens": cfg.chunk_budget})
            else:
                steps.append({"stage": "aggregate", "round": 1, "prompt": len(b.aggregate(q, [[]] * cfg.aggregate))
                              + cfg.aggregate * cfg.tail, "max_tokens": cfg.budget})
        if cfg.final_budget:
            last = steps[-1]
            steps.append({"stage": "final", "round": cfg.rounds, "max_tokens": cfg.final_budget,
                          "prompt": last["prompt"] + last["max_tokens"] + len(b.force_answer())})
        for s in steps:
            s["total"] = s["prompt"] + s["max_tokens"]
        return steps

    def check_plan(self, problem_tokens: int, context: int, clamp: bool = False) -> dict | None:
        """Raise a one-line ValueError naming the setting to change when a request of the run could
        exceed ``context`` tokens; with ``clamp``, lower the budgets instead (the config is replaced)
        and return ``{"budget": (old, new), ...}`` of what changed (None when nothing did)."""
        cfg = self.config
        over = [s for s in self.plan(problem_tokens) if s["total"] > context]
        if not over:
            return None
        if not clamp:
            s = over[0]
            hint = {"solve": "--budget", "aggregate": "--budget, --tail or --aggregate",
                    "continue": "--budget, --tail or --anchor", "final": "--final-budget or --budget"}[s["stage"]]
            raise ValueError(f"plan: the {s['stage']} request of round {s['round']} needs up to {s['prompt']} prompt "
                             f"+ {s['max_tokens']} generated = {s['total']} tokens > the model's context {context} "
                             f"(longest problem {problem_tokens} tokens); lower {hint}, or pass --clamp")
        old = replace(cfg)
        steps = {s["stage"]: s for s in self.plan(problem_tokens)}
        room = min(context - steps[k]["prompt"] for k in ("solve", "aggregate") if k in steps)
        if cfg.variant == "full" and "aggregate" in steps:  # the tails are the whole budget: C + 1 budgets must fit
            overhead = steps["aggregate"]["prompt"] - cfg.aggregate * cfg.tail
            room = min(context - steps["solve"]["prompt"], (context - overhead) // (cfg.aggregate + 1))
        budget = min(cfg.budget, room)
        if "continue" in steps:  # a chunk after the first generates budget - tail - anchor tokens
            budget = min(budget, context - steps["continue"]["prompt"] + cfg.tail + cfg.anchor)
        if cfg.final_budget and budget >= 1:
            # the final-answer continuation keeps room too: up to a quarter of what the solve prompt leaves
            reserve = min(cfg.final_budget, (context - steps["solve"]["prompt"]) // 4)

            def fits(b: int) -> bool:
                self.config = replace(cfg, budget=b, tail=b if cfg.variant == "full" else cfg.tail, final_budget=reserve)
                try:
                    return all(s["total"] <= context for s in self.plan(problem_tokens) if s["stage"] == "final")
                finally:
                    self.config = cfg
            lo, hi = 0, budget  # the largest budget that leaves the reserve (fits is monotone in b)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            if lo >= 1 and not (cfg.rounds and cfg.variant != "full" and cfg.tail > lo):
                budget = lo  # (else, where the reserve leaves no budget for the tails, the final gets what is left)
        new = replace(cfg, budget=budget)
        if new.variant == "full":
            new.tail = budget
        # (rounds=0 is parallel sampling: no tails, no chunks)
        if budget < 1 or new.rounds and (new.tail > budget or (new.variant == "delethink" and new.chunk_budget < 1)):
            raise ValueError(f"plan: no thinking budget fits the model's context {context} with tail {cfg.tail}, "
                             f"aggregate {cfg.aggregate} and a {problem_tokens}-token problem; lower --tail "
                             f"or --aggregate")
        self.config = new
        if new.final_budget:
            fin = {s["stage"]: s for s in self.plan(problem_tokens)}["final"]
            new.final_budget = max(0, min(new.final_budget, context - fin["prompt"]))
        changes = {k: (getattr(old, k), getattr(new, k)) for k in ("budget", "tail", "final_budget")
                   if getattr(old, k) != getattr(new, k)}
        return changes or None

    # checkpoints: a problem's state after each round, as plain JSON
    @staticmethod
    def round_record(rnd: list[Candidate], recs: list[PromptRecord], tokens: dict) -> dict:
        return {"population": [_plain(c) for c in rnd], "prompts": [_plain(r) for r in recs], "tokens": tokens}

    # one run
    def run(self, problem: str, gold: str | None = None, problem_key: str | None = None,
            resume: list[dict] | None = None, on_round: Callable[[int, dict], None] | None = None,
            usage: dict | None = None) -> RSAResult:
        """Run one problem. ``problem_key`` (default: a hash of the text) seeds its parent draws and
        requests; ``resume`` holds round records (``on_round``'s second argument) of rounds
        0..k already done, which are taken as they are; ``on_round(t, record)`` is called after each
        round (for checkpoints, traces and progress); ``usage``, when given, accumulates the server's usage
        counts as they come (what a problem that fails later spent)."""
        cfg, be = self.config, self.backend
        t0 = time.perf_counter()
        pkey = problem_seed(problem if problem_key is None else problem_key)
        prompts: list[PromptRecord] = []
        usage = {} if usage is None else usage
        tok = {"gen": 0, "prefill": 0}
        round_tokens = []
        pass_usage = self._takes_usage

        def send(records: list[PromptRecord]) -> tuple[list[Completion], int, int]:
            params = cfg.sampling(records[0].max_tokens, records[0].n)
            kw = {"usage": usage} if pass_usage else {}
            outs = be.generate([r.prompt_ids for r in records], params, seeds=[r.seed for r in records], **kw)
            if len(outs) != sum(r.n for r in records):
                want = sum(r.n for r in records)
                raise RuntimeError(f"backend returned {len(outs)} completions for {want} requested")
            prompts.extend(records)
            g = sum(len(c.token_ids) for c in outs)
            p = sum(len(r.prompt_ids) for r in records)
            tok["gen"] += g
            tok["prefill"] += p
            return outs, g, p

        rounds: list[list[Candidate]] = []
        for rec in resume or []:  # rounds already done (a resumed run)
            rounds.append([Candidate(**c) for c in rec["population"]])
            prompts.extend(PromptRecord(**r) for r in rec["prompts"])
            round_tokens.append({"generated": rec["tokens"]["generated"], "prefill": rec["tokens"]["prefill"]})
            tok["gen"] += rec["tokens"]["generated"]
            tok["prefill"] += rec["tokens"]["prefill"]
            for k, v in (rec["tokens"].get("usage") or {}).items():
                usage[k] = usage.get(k, 0) + v

        def done(t: int, rnd: list[Candidate], recs: list[PromptRecord], g: int, p: int, u0: dict) -> None:
            rounds.append(rnd)
            round_tokens.append({"generated": g, "prefill": p})
            if on_round is not None:
                du = {k: usage.get(k, 0) - u0.get(k, 0) for k in usage}
                on_round(t, self.round_record(rnd, recs, {"generated": g, "prefill": p, "usage": du}))

        # round 0: plain parallel sampling
        if not rounds:
            u0 = dict(usage)
            p0 = self.builder.solve(problem)
            rec0 = PromptRecord("solve", 0, 0, p0, cfg.population, derive_seed(cfg.seed, 0, pkey), cfg.budget)
            outs, g, p = send([rec0])
            done(0, [Candidate(0, i, p0, c.token_ids, c.text, c.finish_reason) for i, c in enumerate(outs)],
                 [rec0], g, p, u0)
        # rounds 1..T: aggregate C tails of the previous round (Delethink: continue each unfinished chain)
        for t in range(len(rounds), cfg.rounds + 1):
            prev, u0 = rounds[-1], dict(usage)
            recs = []
            if cfg.variant == "delethink":
                for c in prev:
                    if c.finish_reason == "length":  # a chain that stopped is frozen
                        ids = self.builder.cont(problem, self.carry(c))
                        recs.append(PromptRecord("continue", t, c.index, ids, 1, derive_seed(cfg.seed, 2, pkey, t,
                                                 c.index), cfg.chunk_budget, [c.index], [self.carry(c)]))
            else:
                tails = [self.forwarded(c) for c in prev]
                for i in range(cfg.population):
                    par = self.parents(t, i, pkey)
                    fw = [tails[j] for j in par]
                    recs.append(PromptRecord("aggregate", t, i, self.builder.aggregate(problem, fw), 1,
                                             derive_seed(cfg.seed, 2, pkey, t, i), cfg.budget, par, fw))
            outs, g, p = send(recs) if recs else ([], 0, 0)
            new = {r.index: Candidate(t, r.index, r.prompt_ids, c.token_ids, c.text, c.finish_reason, r.parents)
                   for r, c in zip(recs, outs)}
            if cfg.variant == "delethink":
                for c in prev:
                    if c.index in new:
                        new[c.index].history_ids = self.chain_ids(c)
                        new[c.index].history_text = c.history_text + c.text
                    else:
                        new[c.index] = replace(c, round=t, frozen=True)
            done(t, [new[i] for i in sorted(new)], recs, g, p, u0)
        # final answers for traces cut at the budget
        final_g = final_p = 0
        cut = [c for c in rounds[-1] if c.finish_reason == "length" and not c.frozen]
        if cut and cfg.final_budget:
            force = self.builder.force_answer()
            recs, extra = [], []
            for c in cut:
                trace = self.trace_ids(c)
                add = [] if self.has_think_end(self.chain_ids(c)) else force
                extra.append(add)
                recs.append(PromptRecord("final", cfg.rounds, c.index, c.prompt_ids + trace + add, 1,
                                         derive_seed(cfg.seed, 3, pkey, cfg.rounds, c.index), cfg.final_budget))
            outs, final_g, final_p = send(recs)
            for c, add, o in zip(cut, extra, outs):
                c.final_text = c.text + (be.decode(add) if add else "") + o.text
        # grading
        fmt = self.template.answer_format
        same = lambda a, b: self.grader(a, b)  # noqa: E731
        for rnd in rounds:
            for c in rnd:
                c.answer = extract_answer(self.think_open + c.response, fmt)  # (cut in its thinking: no answer)
                c.correct = self.grader(c.answer, gold) if gold is not None else None
        final = rounds[-1]
        maj, maj_count = majority_vote([c.answer for c in final], same)
        have_gold = gold is not None
        round_maj = [majority_vote([c.answer for c in rnd], same)[0] for rnd in rounds]
        ks = pass_ks(cfg.population)
        metrics = {
            "mean_accuracy": _mean(c.correct for c in final) if have_gold else None,
            "round_accuracy": [_mean(c.correct for c in rnd) for rnd in rounds] if have_gold else None,
            "majority_accuracy": float(self.grader(maj, gold)) if have_gold else None,
            "round_majority_accuracy": [float(self.grader(m, gold)) for m in round_maj] if have_gold else None,
            "pass_at_n": float(any(c.correct for c in final)) if have_gold else None,
            "pass_at_k": {str(k): pass_at_k(len(final), sum(bool(c.correct) for c in final), k) for k in ks}
            if have_gold else None,
            "round_pass_at_k": [{str(k): pass_at_k(len(rnd), sum(bool(c.correct) for c in rnd), k) for k in ks}
                                for rnd in rounds] if have_gold else None,
            "majority_answer": maj,
            "majority_count": maj_count,
            "answers": [c.answer for c in final],
            "generated_tokens": tok["gen"],
            "prefill_tokens": tok["prefill"],
            "round_tokens": round_tokens,
            "final_answer_tokens": {"generated": final_g, "prefill": final_p},
            "requests": len(prompts),
            "usage": usage or None,
            "wall_s": time.perf_counter() - t0,
        }
        if cfg.variant == "delethink":
            metrics["finished_chains"] = [sum(c.finish_reason == "stop" for c in rnd) for rnd in rounds]
        return RSAResult(cfg, problem, gold, rounds, prompts, metrics)


def problem_seed(key: str) -> int:
    """A 60-bit integer from a problem's key (or text): parent draws and request seeds depend on it."""
    return int(hashlib.sha256(str(key).encode()).hexdigest()[:15], 16)


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) of n samples with c correct."""
    if k > n or n == 0:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_rsa(backend, problem: str, config: RSAConfig, gold: str | None = None, template: str | Template = "math",
            grader=None) -> RSAResult:
    """One problem through Markovian RSA (see :class:`MarkovianRSA`)."""
    return MarkovianRSA(backend, config, template, grader).run(problem, gold)


_ADDED = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # fields added after results files existed


def config_dict(cfg: RSAConfig) -> dict:
    """The config's fields, less those added later while at their defaults: a results file written before
    they existed keeps its resume key (:func:`ttc.cli.run_key`)."""
    defaults = {f.name: f.default for f in fields(RSAConfig)}
    return {k: v for k, v in asdict(cfg).items() if k not in _ADDED or v != defaults[k]}
