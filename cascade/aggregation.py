"""TTC aggregation prompts for RL (Markovian RSA round 1): problems whose prompt shows C tails of
earlier rollouts of the same problem, judged by the same verifier.

- self-aggregation: tails of the policy's own earlier rollouts (remembered as the stage runs);
- expert aggregation: tails of rollouts a given checkpoint sampled at the stage's start
  (:meth:`AggregationMixer.remember_expert`), a share ``expert_fraction`` of aggregation prompts;
- PaCoRe continuation prompts (Hu et al. 2026, parallel coordinated reasoning): the problem plus
  compacted messages of earlier rollouts -- a finished rollout's post-``</think>`` answer, else its
  last tau tokens (ZAYA1's PaCoRe-style hybrid) -- to continue from, a share ``pacore_fraction``.

Every prompt is at most ``max_prompt_tokens`` long as the policy sees it (ZAYA1: 20,480): a longer one
has its tails cut from the front to a common length (each keeps its end, where the reasoning
concludes and the answer is: answer-preserving), and one whose problem and template alone do not
fit is not made (the plain problem stays in the stream).

:func:`aggregation_sft_pairs` builds SFT examples for aggregation from a teacher's rollouts."""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Iterable

from envs.base import Problem, verify_all, verify_workers
from train.tokenizer import open_think_of, whole_chars
from ttc.templates import Template, load_template

_MESSAGE = "--- Message {index} ---\n{tail}\n\n"
_PACORE = ("{problem}\n\n"
           "Earlier reasoning on this problem, compacted into {count} messages (a finished attempt's answer, or the "
           "last part of an unfinished one); any of them may be incomplete or wrong.\n\n"
           "{candidates}"
           "Continue from these messages: build on what holds up, check it, and finish the solution. {closing}")


def _stops(tokenizer, stop_ids: Iterable[int]) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(i) for i in stop_ids} | ({int(eos)} if eos is not None else set())


def _key(env_id: str, p: Problem) -> str:
    return f"{env_id}|{p.seed}|{p.difficulty}"


def decode_tail(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    """``ids`` (the end of a trace) decoded, less a leading remnant of a character its cut split (byte-level
    BPE: U+FFFD, which the policy would read, and re-tokenise, as itself)."""
    return whole_chars(decode, ids)[1]


def compact_message(text: str | None, finish_reason: str | None, tail: str,
                    encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], tau: int) -> str:
    """A rollout compacted into a PaCoRe message: a finished rollout's answer after its last
    ``</think>`` (at most ``tau`` tokens, its end kept), else ``tail`` (its last tau tokens)."""
    if text and finish_reason == "stop" and "</think>" in text:
        answer = text.rsplit("</think>", 1)[1].strip()
        if answer:
            ids = encode(answer)
            return answer if len(ids) <= tau else decode_tail(decode, ids[-tau:])
    return tail


class AggregationMixer:
    """Remembers the tails of recent rollouts per problem and turns a share of the sampled problems
    into aggregation problems. Hook it into the RL trainer with ``problem_hook=mixer.mix`` and
    ``rollout_hook=mixer.remember``. ``prompt_len(text)`` counts a prompt's tokens as the policy sees
    it (chat template included); with ``max_prompt_tokens`` > 0 it bounds every prompt made.

    ``template``: a ttc template (name or file) for every environment's prompts, or ``auto``: each
    environment's own ``aggregation_template`` (``env_of(env_id)`` gives the environment; without it
    ``math``), so a program-writing task's prompt asks for a code block and a math task's for ``\\boxed{}``."""

    def __init__(self, tokenizer, fraction: float, tails: int, tail_tokens: int, template: str = "auto",
                 buffer: int = 256, seed: int = 0, max_prompt_tokens: int = 0,
                 prompt_len: Callable[[str], int] | None = None, expert_fraction: float = 0.0,
                 pacore_fraction: float = 0.0, env_of: Callable[[str], object] | None = None,
                 stop_ids: Iterable[int] = ()):
        for name, v in (("fraction", fraction), ("expert_fraction", expert_fraction),
                        ("pacore_fraction", pacore_fraction)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"aggregation.{name} must be in [0, 1], got {v}")
        self.tok, self.fraction, self.C, self.tau = tokenizer, fraction, tails, tail_tokens
        self.stops = _stops(tokenizer, stop_ids)
        self.template = None if template == "auto" else load_template(template)
        self.env_of = env_of
        self._templates: dict[str, Template] = {}
        self.buffer = buffer
        self.rng = random.Random(seed)
        self.cap = int(max_prompt_tokens)
        self.prompt_len = prompt_len or (lambda text: len(self._encode(text)))
        self.expert_fraction, self.pacore_fraction = expert_fraction, pacore_fraction
        # key -> (env_id, problem dict, tails, messages)
        self.pool: OrderedDict[str, tuple[str, dict, list[str], list[str]]] = OrderedDict()
        self.expert: OrderedDict[str, tuple[str, dict, list[str], list[str]]] = OrderedDict()
        self.made = self.made_expert = self.made_pacore = self.trimmed = self.dropped = 0

    def bound(self, max_prompt_tokens: int) -> None:
        """Bound every prompt made by ``max_prompt_tokens`` too (the trainer's: longer prompts it skips)."""
        if max_prompt_tokens > 0:
            self.cap = min(self.cap, int(max_prompt_tokens)) if self.cap > 0 else int(max_prompt_tokens)

    def _encode(self, text: str, tok=None) -> list[int]:
        return (tok or self.tok).encode(text, add_special_tokens=False, verbose=False)

    def _decode(self, ids: list[int], tok=None) -> str:
        return (tok or self.tok).decode(ids, skip_special_tokens=False)

    def tail_text(self, token_ids: list[int], tokenizer=None, stops: set[int] | None = None) -> str:
        """The last tau tokens of a rollout's trace (decoded by ``tokenizer``, the one that sampled it: the
        policy's by default). A final end-of-sequence or stop token (any of ``stops``: the tokenizer's EOS and
        the engine's, e.g. Qwen3's two) is not part of the trace (as in ttc's ``MarkovianRSA.trace_ids``), so
        none lands inside an aggregation prompt; a cut inside a multi-byte character drops its remnant."""
        stops = self.stops if stops is None else stops
        ids = list(token_ids)
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        return decode_tail(lambda i: self._decode(i, tokenizer), ids[-self.tau:])

    def _entry(self, completions, tokenizer=None, stops: set[int] | None = None) -> tuple[list[str], list[str]]:
        tails, messages = [], []
        for c in completions:
            tail = self.tail_text(c.token_ids, tokenizer, stops)
            tails.append(tail)
            messages.append(compact_message(getattr(c, "text", None), getattr(c, "finish_reason", None), tail,
                                            lambda t: self._encode(t, tokenizer), lambda i: self._decode(i, tokenizer),
                                            self.tau))
        return tails, messages

    def _add(self, pool: OrderedDict, env_id: str, problem: Problem, completions, limit: int | None,
             tokenizer=None, stops: set[int] | None = None) -> None:
        tails, messages = self._entry(completions, tokenizer, stops)
        if len(tails) >= self.C:
            k = _key(env_id, problem)
            pool[k] = (env_id, problem.to_dict(), tails, messages)
            pool.move_to_end(k)
        while limit is not None and len(pool) > limit:
            pool.popitem(last=False)

    def remember(self, groups) -> None:
        for g in groups:
            if g.problem.meta.get("aggregation"):
                continue
            self._add(self.pool, g.env_id, g.problem, [r.completion for r in g.rollouts], self.buffer)

    def remember_expert(self, env_id: str, problem: Problem, completions, tokenizer=None,
                        stop_ids: Iterable[int] = ()) -> None:
        """Completions of an expert checkpoint for ``problem``: the tails of expert-aggregation prompts.
        ``tokenizer`` (and ``stop_ids``, its engine's end ids): the expert's, when it is not the policy's."""
        stops = None if tokenizer is None else _stops(tokenizer, stop_ids)
        self._add(self.expert, env_id, problem, completions, None, tokenizer, stops)

    # -- prompts --------------------------------------------------------------------------------
    def template_of(self, env_id: str) -> Template:
        """The template of ``env_id``'s aggregation prompts."""
        if self.template is not None:
            return self.template
        if env_id not in self._templates:
            env = self.env_of(env_id) if self.env_of is not None else None
            self._templates[env_id] = load_template(getattr(env, "aggregation_template", "math"))
        return self._templates[env_id]

    def _render(self, env_id: str, problem: Problem, tails: list[str], pacore: bool) -> str:
        t = self.template_of(env_id)
        if pacore:
            blocks = "".join(_MESSAGE.format(tail=x, index=i + 1) for i, x in enumerate(tails))
            closing = t.solve.format(problem="").strip()
            return _PACORE.format(problem=problem.prompt, candidates=blocks, count=len(tails), closing=closing)
        blocks = "".join(t.candidate.format(tail=x, index=i + 1) for i, x in enumerate(tails))
        return t.aggregate.format(problem=problem.prompt, candidates=blocks, count=len(tails))

    def build(self, env_id: str, problem: Problem, tails: list[str], pacore: bool = False,
              source: str = "self") -> Problem | None:
        """The aggregation (or, with ``pacore``, continuation) problem showing ``tails``; None when it
        cannot fit ``max_prompt_tokens`` even with its tails cut down."""
        prompt = self._render(env_id, problem, tails, pacore)
        if self.cap > 0 and self.prompt_len(prompt) > self.cap:
            prompt = self._fit(env_id, problem, tails, pacore)
            if prompt is None:
                self.dropped += 1
                return None
            self.trimmed += 1
        # "question": the problem's own text, which verifiers read as the question (the prompt shows candidates too)
        meta = {**problem.meta, "aggregation": True, "tails": len(tails), "kind": "pacore" if pacore else "rsa",
                "tail_source": source, "question": problem.meta.get("question", problem.prompt)}
        return replace(problem, prompt=prompt, meta=meta)

    def _fit(self, env_id: str, problem: Problem, tails: list[str], pacore: bool) -> str | None:
        """The prompt with every tail cut from the front to the longest common length that fits."""
        room = self.cap - self.prompt_len(self._render(env_id, problem, [""] * len(tails), pacore))
        ids = [self._encode(x) for x in tails]
        lens = [len(i) for i in ids]
        lo, hi = 0, max(lens)  # the longest common length L whose tails, sum(min(len, L)), fit the room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(min(n, mid) for n in lens) <= room else (lo, mid - 1)
        per = lo
        while per >= 1:
            prompt = self._render(env_id, problem, [decode_tail(self._decode, i[-per:]) for i in ids], pacore)
            if self.prompt_len(prompt) <= self.cap:  # re-tokenisation at the seams can differ a little
                return prompt
            per -= max(1, per // 16)
        return None

    def mix(self, picks: list[tuple[str, Problem]]) -> list[tuple[str, Problem]]:
        if (not self.pool and not self.expert) or self.fraction <= 0:
            return picks
        own, experts = _by_env(self.pool), _by_env(self.expert)
        out = []
        for env_id, p in picks:  # a pick becomes a buffered problem of its own environment: the phase's mix holds
            if self.rng.random() < self.fraction and (env_id in own or env_id in experts):
                # a share expert_fraction shows the expert's tails, the rest the policy's own; a pick whose drawn
                # source has none of its environment yet stays plain (the share holds before any own tails)
                expert = env_id in experts and self.rng.random() < self.expert_fraction
                keys = (experts if expert else own).get(env_id)
                if keys is None:
                    out.append((env_id, p))
                    continue
                pacore = self.rng.random() < self.pacore_fraction
                e, pd, tails, messages = (self.expert if expert else self.pool)[self.rng.choice(keys)]
                shown = self.rng.sample(messages if pacore else tails, self.C)
                agg = self.build(e, Problem.from_dict(pd), shown, pacore, "expert" if expert else "self")
                if agg is not None:
                    out.append((e, agg))
                    self.made += 1
                    self.made_expert += expert
                    self.made_pacore += pacore
                    continue
            out.append((env_id, p))
        return out

    def metrics(self) -> dict[str, int]:
        return {"aggregation_prompts": self.made, "aggregation_expert": self.made_expert,
                "aggregation_pacore": self.made_pacore, "aggregation_trimmed": self.trimmed,
                "aggregation_dropped": self.dropped}

    def state_dict(self) -> dict:
        st = self.rng.getstate()
        return {"pool": [[k, *v] for k, v in self.pool.items()], "expert": [[k, *v] for k, v in self.expert.items()],
                "rng": [st[0], list(st[1]), st[2]], "made": self.made, "counts": self.metrics()}

    def load_state_dict(self, st: dict) -> None:
        def entries(rows):  # rows written before messages were kept carry tails only: messages = tails
            rows = [(r[0], (r[1], r[2], r[3], r[4] if len(r) > 4 else r[3])) for r in rows]
            # a run resumed with more ``tails`` than the saved entries hold: those cannot make a prompt
            return OrderedDict((k, v) for k, v in rows if min(len(v[2]), len(v[3])) >= self.C)

        self.pool = entries(st["pool"])
        self.expert = entries(st.get("expert", []))
        v, internal, gauss = st["rng"]
        self.rng.setstate((v, tuple(internal), gauss))
        self.made = int(st["made"])
        c = st.get("counts", {})
        self.made_expert, self.made_pacore = int(c.get("aggregation_expert", 0)), int(c.get("aggregation_pacore", 0))
        self.trimmed, self.dropped = int(c.get("aggregation_trimmed", 0)), int(c.get("aggregation_dropped", 0))


def _by_env(pool: OrderedDict) -> dict[str, list[str]]:
    """The keys of ``pool``'s entries per environment, oldest first."""
    out: dict[str, list[str]] = {}
    for k, (env_id, *_) in pool.items():
        out.setdefault(env_id, []).append(k)
    return out


def sample_rollouts(engine, tokenizer, picks: list[tuple[str, Problem]], n: int, params, chat: bool = True,
                    system: str | None = None, max_prompt_tokens: int = 0, chunk: int = 0,
                    advance=None) -> list[tuple[str, Problem, list]]:
    """``n`` completions of ``engine`` for each problem (prompts too long for ``max_prompt_tokens``
    skipped), ``chunk`` problems per engine call: [(env_id, problem, completions)]. A seeded ``params``
    gives each call the seed plus the index of its first problem, as :func:`cascade.evaluation.avg_at_k` does."""
    from train.rl.trainer import encode_prompt

    enc = [(e, p, encode_prompt(tokenizer, p.prompt, chat, system)) for e, p in picks]
    enc = [x for x in enc if not max_prompt_tokens or len(x[2]) <= max_prompt_tokens]
    params = replace(params, n=n)
    out = []
    size = chunk if chunk > 0 else max(len(enc), 1)
    for i in range(0, len(enc), size):
        part = enc[i:i + size]
        # each chunk its own streams (engines seed rows by their index in the call: chunks shared them all)
        p = params if params.seed is None else replace(params, seed=params.seed + i)
        comps = engine.generate([x[2] for x in part], p)
        by = [[] for _ in part]
        for c in comps:
            by[c.prompt_index].append(c)
        out += [(e, p, cs) for (e, p, _), cs in zip(part, by)]
        if advance is not None:
            advance(len(part))
    return out


def aggregation_sft_pairs(engine, tokenizer, picks: list[tuple[str, Problem]], env_of, params, *, samples: int,
                          shuffles: int, tails: int, tail_tokens: int, template: str = "auto",
                          max_prompt_tokens: int = 0, prompt_len=None, chat: bool = True,
                          system: str | None = None, seed: int = 0, chunk: int = 0,
                          advance=None, workers: int = 0) -> tuple[list[tuple[str, str]], dict]:
    """SFT examples for aggregation from a teacher (``engine``): its ``samples`` rollouts of each
    problem, reshuffled ``shuffles`` times into aggregation prompts of ``tails`` tails (at most
    ``max_prompt_tokens`` as the policy sees them, by ``prompt_len``), each answered once by the
    teacher; the answers the problem's verifier accepts become (prompt, response) pairs (verified
    ``workers`` at a time where the environment allows: :func:`envs.base.verify_all`), in a seeded random
    order."""
    mixer = AggregationMixer(tokenizer, 1.0, tails, tail_tokens, template, seed=seed,
                             max_prompt_tokens=max_prompt_tokens, prompt_len=prompt_len, env_of=env_of,
                             stop_ids=getattr(engine, "eos_token_ids", ()) or ())
    rolled = sample_rollouts(engine, tokenizer, picks, samples, params, chat, system, chunk=chunk, advance=advance)
    prompts = []
    for e, p, comps in rolled:
        ts, _ = mixer._entry(comps)
        if len(ts) < tails:
            continue
        for _ in range(shuffles):
            agg = mixer.build(e, p, mixer.rng.sample(ts, tails))
            if agg is not None:
                prompts.append((e, agg))
    answered = sample_rollouts(engine, tokenizer, prompts, 1, params, chat, system, chunk=chunk)
    answered = [(e, p, cs[0].text) for e, p, cs in answered if cs]
    think = open_think_of(tokenizer, chat, system)  # the teacher's template may open the thinking in the prompt
    scores = verify_all([(env_of(e), p, think + text) for e, p, text in answered], verify_workers(workers))
    pairs = [(p.prompt, think + text) for (_, p, text), s in zip(answered, scores) if s.correct]  # whole responses
    mixer.rng.shuffle(pairs)  # a caller keeping the first k keeps them across the problems, not the first few's
    stats = {"aggregation_sft_problems": len(rolled), "aggregation_sft_prompts": len(prompts),
             "aggregation_sft_correct": len(pairs), "aggregation_sft_trimmed": mixer.trimmed,
             "aggregation_sft_dropped": mixer.dropped}
    return pairs, stats
