"""Difficulty controllers and the multi-environment curriculum.

Controllers (one per environment) choose the difficulty of the next problem and learn from the
scores of finished rollouts:

- :class:`RLVEWindow`: RLVE's sliding window. The range ``[l, h]`` starts at ``[0, 0]``; ``d`` is
  drawn uniformly from it; only rollouts at ``d == h`` are counted; once ``tau_num`` of them
  (``tau_prompts`` x ``group_size``) are in, ``h += 1`` if their accuracy is at least ``tau_acc``,
  and the counts reset either way; ``l = max(0, h - d_window + 1)``.
- :class:`ZayaScheduler` (``zaya``; also importable as ``UpDown``): ZAYA1's scheduler (eqs. 11-14).
  ``d += 1`` when a group at the current ``d`` passes more than ``up`` (0.7), ``d -= 1`` when it
  passes none. The start is calibrated by Thompson sampling over a pool of item-response curves
  ``pass(d) = sigmoid(-(d - mu) / s)`` drawn from one Gaussian prior, with Binomial likelihood
  updates, epsilon-greedy targets 0.5 +- 0.25 and resampling on low effective sample size.
- :class:`Fixed`: always the same difficulty.

A rollout counts as correct when its score is ``correct`` (a :class:`Score`), ``True``, or a
number ``>= 1`` (full credit, RLVE's accuracy). All state is plain data: ``state_dict()`` is
JSON-serialisable and ``load_state_dict`` restores what a controller learned (its ``state_keys``: levels,
counts, the calibration pool), exactly; its settings (``up``, ``tau_acc``, ...) stay the ones it was built with,
so a run resumed with other settings follows them.

**Caps.** An environment's ``max_difficulty`` can fall during a run (a time-bounded ``generate``,
``envs/caps.py``, makes the problem one level lower and caps the level) and differ between runs (a
cap recorded in ``envs/difficulty_caps.json`` since a checkpoint). The :class:`Curriculum` hands each
controller its environment's current cap before every sample and update (:meth:`Controller.follow_cap`)
and after loading a checkpoint, whose own ``max_difficulty`` never overrides it; a controller clamps
its level to the cap, so the level it schedules is the level its groups come back at.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, Iterable

from envs.base import Environment, Problem, get_env

__all__ = ["Controller", "RLVEWindow", "ZayaScheduler", "UpDown", "Fixed", "CONTROLLERS", "make_controller",
           "SAMPLING_MODES", "Curriculum", "count_correct"]


def count_correct(scores: Iterable[Any]) -> tuple[int, int]:
    """(number correct, number of rollouts) of a list of Scores, bools or rewards."""
    k = n = 0
    for s in scores:
        n += 1
        if hasattr(s, "correct"):
            k += bool(s.correct)
        elif isinstance(s, bool):
            k += s
        else:
            k += float(s) >= 1.0 - 1e-9
    return k, n


def _clamp(d: int, hi: int | None) -> int:
    d = max(0, int(d))
    return d if hi is None else min(d, int(hi))


class Controller:
    """Base: ``sample(rng) -> difficulty``, ``update(difficulty, scores)``, state round-trip."""

    name = ""
    state_keys: tuple[str, ...] = ()  # what the controller learned; its other attributes are its settings

    def sample(self, rng: random.Random) -> int:
        raise NotImplementedError

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        raise NotImplementedError

    def follow_cap(self, max_difficulty: int | None) -> None:
        """Take the environment's current ``max_difficulty`` (None: no cap) as this controller's cap;
        subclasses also clamp their level to it."""
        self.max_difficulty = None if max_difficulty is None else int(max_difficulty)

    def state_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        """Restore the ``state_keys`` of ``state``; the settings it also holds (the checkpoint's) give way to
        this controller's (a resumed run's configuration), and its cap to the one :meth:`follow_cap` hands over."""
        unknown = set(state) - set(self.__dict__) - {"max_difficulty"}  # follow_cap may have set it
        if unknown:
            raise ValueError(f"{type(self).__name__}.load_state_dict: unknown keys {sorted(unknown)}")
        for k in self.state_keys:
            v = state[k]
            setattr(self, k, copy.deepcopy(list(v) if isinstance(v, tuple) else v))


class Fixed(Controller):
    """Always ``difficulty``, clamped to the current ``max_difficulty`` as it is sampled (a cap
    raised again, e.g. on resume, gives the configured level back)."""

    name = "fixed"

    def __init__(self, difficulty: int = 0, max_difficulty: int | None = None):
        self.difficulty = _clamp(difficulty, None)
        self.max_difficulty = max_difficulty

    def sample(self, rng: random.Random) -> int:
        return _clamp(self.difficulty, self.max_difficulty)

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        pass


class RLVEWindow(Controller):
    name = "rlve"
    state_keys = ("high", "n", "k")  # (``low`` follows ``high`` and the configured ``d_window``)

    def __init__(self, group_size: int = 16, tau_prompts: int = 8, tau_acc: float = 0.9,
                 d_window: int = 4, max_difficulty: int | None = None, tau_num: int | None = None):
        if d_window < 1:
            raise ValueError(f"d_window must be >= 1, got {d_window}")
        self.tau_num = int(tau_num) if tau_num is not None else int(tau_prompts) * int(group_size)
        if self.tau_num < 1:
            raise ValueError(f"tau_num must be >= 1, got {self.tau_num}")
        self.tau_acc = float(tau_acc)
        self.d_window = int(d_window)
        self.max_difficulty = max_difficulty
        self.low = 0
        self.high = 0
        self.n = 0        # rollouts counted at d == high since the last reset
        self.k = 0        # of which correct

    def follow_cap(self, max_difficulty: int | None) -> None:
        """A cap below ``high`` lowers ``high`` to it (``low`` follows; the counts, taken at the old
        ``high``, reset), so the window stays within the cap."""
        super().follow_cap(max_difficulty)
        high = _clamp(self.high, self.max_difficulty)
        if high != self.high:
            self.high = high
            self.low = max(0, high - self.d_window + 1)
            self.n = self.k = 0

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.low = max(0, self.high - self.d_window + 1)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        if int(difficulty) != self.high:
            return
        k, n = count_correct(scores)
        self.k += k
        self.n += n
        if self.n >= self.tau_num:
            if self.k / self.n >= self.tau_acc:
                self.high = _clamp(self.high + 1, self.max_difficulty)
            self.n = self.k = 0
            self.low = max(0, self.high - self.d_window + 1)


def _softplus(x: float) -> float:
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _log_pass(d: float, mu: float, s: float) -> tuple[float, float]:
    """(log pass(d), log(1 - pass(d))) for pass(d) = sigmoid(-(d - mu) / s), computed stably."""
    z = (d - mu) / s
    return -_softplus(z), -_softplus(-z)


def _log_binom(k: int, n: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


class ZayaScheduler(Controller):
    """ZAYA1's difficulty scheduler (eqs. 11-14): an up/down rule after a calibrated start.

    **Up/down.** ``d += 1`` when a group's pass rate exceeds ``up`` (0.7) *and* the group was
    generated at the current ``d`` (the group-difficulty check: groups still in flight from an earlier
    level never move ``d``); ``d -= 1`` when a group at the current ``d`` has pass rate 0; never
    below 0 or above ``max_difficulty``. A cap that falls below ``d`` (:meth:`follow_cap`) lowers
    ``d`` to it, so the groups generated at the capped level count.

    **Start calibration** (the first ``calibration_groups`` groups, unless ``start`` is given):

    - a pool of ``pool_size`` candidates ``(mu_m, s_m)`` drawn from one Gaussian prior over
      ``(mu, log s)`` (mean ``(prior_mu, log prior_s)``, sd ``(prior_mu_sd, prior_log_s_sd)``), each an
      item-response curve ``pass_m(d) = sigmoid(-(d - mu_m) / s_m)``;
    - probing (Thompson sampling): ``j ~ Categorical(w)``, a target pass rate ``p_t = 0.5``, or with
      probability ``epsilon`` one of ``0.5 -/+ explore`` (0.25, 0.75), and the probe
      ``d_j = mu_j + s_j * log((1 - p_t) / p_t)`` rounded to a level;
    - a group of ``G`` rollouts at ``d`` with ``k`` passes updates every candidate,
      ``w_m *= Binomial(k; G, pass_m(d))``, renormalised;
    - when the effective sample size ``1 / sum(w_m^2)`` falls below ``ess_threshold * pool_size``
      the pool is resampled with replacement (each copy moved by ``N(0, jitter)`` on ``mu`` and on
      ``log s``), the observations since the last resampling are folded into per-level
      recency-weighted success/failure sums (each older group discounted by ``recency``), and the
      likelihoods are re-initialised from those sums:
      ``log w_m = sum_d S_d log pass_m(d) + F_d log(1 - pass_m(d))``;
    - calibration ends at the level nearest the posterior mean of ``mu`` (the level the policy
      solves half the time).

    The report gives the rule, the 0.7 threshold and the targets 0.5 +- 0.25; the prior, pool size,
    ``epsilon``, ESS threshold, recency factor, jitter and calibration length are Cascade's choices.
    The pool is drawn at the first ``sample`` from the curriculum's generator (so each environment
    gets its own), or at construction from ``seed`` or explicit ``candidates``.
    """

    name = "zaya"
    # (``start`` and ``calibration_groups`` set where a new controller begins; a resumed one goes on from its state)
    state_keys = ("difficulty", "calibrating", "calibration_left", "seed", "candidates", "logw", "history", "folded",
                  "resamples")

    def __init__(self, up: float = 0.7, start: int | None = None, calibration_groups: int = 8,
                 max_difficulty: int | None = None, pool_size: int = 64, prior_mu: float = 3.0,
                 prior_mu_sd: float = 3.0, prior_s: float = 1.0, prior_log_s_sd: float = 0.5,
                 epsilon: float = 0.2, explore: float = 0.25, ess_threshold: float = 0.5,
                 recency: float = 0.9, jitter: float = 0.2, seed: int | None = None,
                 candidates: Iterable[tuple[float, float]] | None = None):
        if not 0.0 < explore < 0.5:
            raise ValueError(f"explore must be in (0, 0.5), got {explore}")
        if not 0.0 <= epsilon <= 1.0 or not 0.0 <= ess_threshold <= 1.0 or not 0.0 < recency <= 1.0:
            raise ValueError("epsilon and ess_threshold must be in [0, 1], recency in (0, 1]")
        if int(pool_size) < 1 or prior_s <= 0:
            raise ValueError("pool_size must be >= 1 and prior_s > 0")
        self.up = float(up)
        self.max_difficulty = max_difficulty
        self.difficulty = _clamp(0 if start is None else start, max_difficulty)
        self.calibrating = start is None and calibration_groups > 0
        self.calibration_left = int(calibration_groups) if self.calibrating else 0
        self.pool_size = int(pool_size)
        self.prior = [float(prior_mu), float(prior_mu_sd), math.log(float(prior_s)), float(prior_log_s_sd)]
        self.epsilon, self.explore = float(epsilon), float(explore)
        self.ess_threshold, self.recency, self.jitter = float(ess_threshold), float(recency), float(jitter)
        self.seed = None if seed is None else int(seed)
        self.candidates: list[list[float]] = []   # [mu, s] per candidate
        self.logw: list[float] = []               # log-likelihood per candidate (max subtracted)
        self.history: list[list[int]] = []        # [d, k, n] since the last resampling
        self.folded: list[list[float]] = []       # [d, S_d, F_d]: recency-weighted sums, by level
        self.resamples = 0
        if candidates is not None:
            self.candidates = [[float(mu), float(s)] for mu, s in candidates]
            if not self.candidates or any(s <= 0 for _, s in self.candidates):
                raise ValueError("candidates must be a non-empty list of (mu, s) with s > 0")
            self.pool_size = len(self.candidates)
            self.logw = [0.0] * self.pool_size
            if self.seed is None:
                self.seed = 0
        elif self.seed is not None and self.calibrating:
            self._draw_pool()

    # -- the candidate pool ---------------------------------------------------------------------
    def _draw_pool(self) -> None:
        r = random.Random(self.seed)
        mu0, mu_sd, ls0, ls_sd = self.prior
        self.candidates = [[r.gauss(mu0, mu_sd), math.exp(r.gauss(ls0, ls_sd))] for _ in range(self.pool_size)]
        self.logw = [0.0] * self.pool_size

    def _ensure_pool(self, rng: random.Random | None) -> None:
        if self.candidates:
            return
        if self.seed is None:
            self.seed = rng.getrandbits(32) if rng is not None else 0
        self._draw_pool()

    def weights(self) -> list[float]:
        """The candidates' normalised weights."""
        top = max(self.logw)
        w = [math.exp(v - top) for v in self.logw]
        z = sum(w)
        return [v / z for v in w]

    def ess(self) -> float:
        """Effective sample size of the pool, ``1 / sum(w_m^2)`` with normalised weights."""
        return 1.0 / sum(v * v for v in self.weights())

    def posterior_mu(self) -> float:
        return sum(w * c[0] for w, c in zip(self.weights(), self.candidates))

    def probe(self, j: int, p_t: float) -> int:
        """The level at which candidate ``j`` predicts pass rate ``p_t``."""
        mu, s = self.candidates[j]
        return _clamp(int(math.floor(mu + s * math.log((1 - p_t) / p_t) + 0.5)), self.max_difficulty)

    def observe(self, d: int, k: int, n: int) -> None:
        """Bayes update of every candidate on ``k`` passes of ``n`` at level ``d``; resample on low ESS."""
        self._ensure_pool(None)
        c = _log_binom(k, n)
        for m, (mu, s) in enumerate(self.candidates):
            lp, lq = _log_pass(d, mu, s)
            self.logw[m] += c + k * lp + (n - k) * lq
        top = max(self.logw)
        self.logw = [v - top for v in self.logw]
        self.history.append([int(d), int(k), int(n)])
        if self.ess() < self.ess_threshold * self.pool_size:
            self.resample()

    def fold(self) -> None:
        """Fold the history into the recency-weighted sums: each group is discounted by ``recency``
        per group observed after it (the newest counts 1)."""
        sums = {int(d): [S, F] for d, S, F in self.folded}
        decay = self.recency ** len(self.history)
        for v in sums.values():
            v[0] *= decay
            v[1] *= decay
        for age, (d, k, n) in enumerate(reversed(self.history)):
            g = self.recency ** age
            v = sums.setdefault(int(d), [0.0, 0.0])
            v[0] += g * k
            v[1] += g * (n - k)
        self.folded = [[d, S, F] for d, (S, F) in sorted(sums.items())]
        self.history = []

    def resample(self) -> None:
        r = random.Random(self.seed * 1_000_003 + self.resamples + 1)
        self.resamples += 1
        picks = r.choices(range(self.pool_size), weights=self.weights(), k=self.pool_size)
        new = []
        for j in picks:
            mu, s = self.candidates[j]
            if self.jitter > 0:
                mu, s = mu + r.gauss(0.0, self.jitter), s * math.exp(r.gauss(0.0, self.jitter))
            new.append([mu, s])
        self.candidates = new
        self.fold()
        logw = []
        for mu, s in self.candidates:
            total = 0.0
            for d, S, F in self.folded:
                lp, lq = _log_pass(d, mu, s)
                total += S * lp + F * lq
            logw.append(total)
        top = max(logw)
        self.logw = [v - top for v in logw]

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.candidates:  # a drawn pool keeps its size (pool_size sets the size of one not drawn yet)
            self.pool_size = len(self.candidates)

    # -- controller -----------------------------------------------------------------------------
    def follow_cap(self, max_difficulty: int | None) -> None:
        """Take the cap and lower ``d`` to it (calibration probes are clamped to it as they are drawn)."""
        super().follow_cap(max_difficulty)
        self.difficulty = _clamp(self.difficulty, self.max_difficulty)

    def sample(self, rng: random.Random) -> int:
        if not self.calibrating:
            return self.difficulty
        self._ensure_pool(rng)
        j = rng.choices(range(self.pool_size), weights=self.weights())[0]
        p_t = 0.5
        if rng.random() < self.epsilon:
            p_t = 0.5 + (self.explore if rng.random() < 0.5 else -self.explore)
        return self.probe(j, p_t)

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        k, n = count_correct(scores)
        if n == 0:
            return
        d = int(difficulty)
        if self.calibrating:
            self.observe(d, k, n)
            self.calibration_left -= 1
            if self.calibration_left <= 0:
                self.calibrating = False
                self.difficulty = _clamp(int(math.floor(self.posterior_mu() + 0.5)), self.max_difficulty)
            return
        if d != self.difficulty:                  # the group-difficulty check
            return
        if k / n > self.up:
            self.difficulty = _clamp(self.difficulty + 1, self.max_difficulty)
        elif k == 0:
            self.difficulty = max(0, self.difficulty - 1)


UpDown = ZayaScheduler  # the name earlier versions used


CONTROLLERS: dict[str, type[Controller]] = {c.name: c for c in (RLVEWindow, ZayaScheduler, Fixed)}


def make_controller(name: str, max_difficulty: int | None = None, **kwargs) -> Controller:
    if name not in CONTROLLERS:
        raise ValueError(f"unknown difficulty controller {name!r}; choose from {', '.join(CONTROLLERS)}")
    return CONTROLLERS[name](max_difficulty=max_difficulty, **kwargs)


SAMPLING_MODES = ("uniform", "least_sampled", "weighted_least_sampled")
HELDOUT_REDRAWS = 16  # draws of other seeds for a problem whose prompt is held out


def draw_avoiding(make: Callable[[int], Problem], rng: random.Random, exclude: set[str],
                  first: int | None = None) -> tuple[Problem, int, bool]:
    """``make(seed)`` with a seed from ``rng`` (or ``first``), drawn again with others while the problem's
    normalized prompt is in ``exclude`` (held out), up to ``HELDOUT_REDRAWS`` times -> (problem, redraws,
    whether it is held out all the same: a level with that few distinct problems)."""
    p = make(rng.getrandbits(62) if first is None else first)
    if not exclude:
        return p, 0, False
    from envs.hub import normalize_text

    redraws = 0
    while normalize_text(p.prompt) in exclude and redraws < HELDOUT_REDRAWS:
        redraws += 1
        p = make(rng.getrandbits(62))
    return p, redraws, normalize_text(p.prompt) in exclude


def valid_weights(weights: dict[str, float]) -> bool:
    """Whether a mix's weights can be sampled from: every one finite and >= 0 (no NaN, no inf), with a positive
    sum."""
    return all(0 <= float(w) < math.inf for w in weights.values()) and sum(float(w) for w in weights.values()) > 0


class Curriculum:
    """Environments with mixing weights and one difficulty controller each.

    ``sample(rng_or_seed, n)`` returns ``n`` pairs ``(env_id, Problem)``. ``mode="uniform"`` picks
    environments at random in proportion to their weights; ``mode="least_sampled"`` picks the one
    sampled least so far relative to its weight (ties broken at random), so under-sampled
    environments catch up. ``mode="weighted_least_sampled"`` (ZAYA1's environment sampler) draws
    at random with weights that favour the least-sampled environments without excluding the others:
    ``P(e) ~ w_e * exp((share_e * N - n_e) / temperature)``, where ``share_e`` is ``e``'s share of the
    mixing weights, ``n_e`` its count and ``N`` all counts, so an environment ``temperature`` samples
    behind its share is ``e`` times likelier (the form and ``temperature`` = 1 are Cascade's
    choices; the report says only that the least-sampled environments get the highest weight).
    Problem seeds are drawn from the given generator (or the curriculum's own, seeded by ``seed``,
    when ``rng_or_seed`` is None), so samples are deterministic.

    Each controller follows its environment's current ``max_difficulty``: it is handed over before
    every sample and update, in :meth:`difficulties`, and after :meth:`load_state_dict` (the
    checkpoint's cap never overrides the environment's). :meth:`load_state_dict` takes back the mix weights,
    counts, generator and what the controllers learned; the sampling mode and the controllers' settings stay
    this curriculum's (a resume follows changed ones), and a checkpoint of another controller kind is refused.
    """

    def __init__(self, envs: dict[str, float] | Iterable[str], controller: str = "rlve",
                 mode: str = "uniform", seed: int = 0, controller_kwargs: dict | None = None,
                 env_kwargs: dict[str, dict] | None = None,
                 environments: dict[str, Environment] | None = None, temperature: float = 1.0):
        weights = dict(envs) if isinstance(envs, dict) else {e: 1.0 for e in envs}
        if not weights:
            raise ValueError("a curriculum needs at least one environment")
        if not valid_weights(weights):
            raise ValueError(f"environment weights must be finite and >= 0 with a positive sum; got {weights}")
        if mode not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling mode {mode!r}; choose from {', '.join(SAMPLING_MODES)}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        env_kwargs = env_kwargs or {}
        self.mode = mode
        self.temperature = float(temperature)
        self.weights = {k: float(w) for k, w in weights.items()}
        self.envs: dict[str, Environment] = dict(environments or {})
        for k in self.weights:
            if k not in self.envs:
                self.envs[k] = get_env(k, **env_kwargs.get(k, {}))
        self.controllers = {
            k: make_controller(controller, max_difficulty=getattr(self.envs[k], "max_difficulty", None),
                               **(controller_kwargs or {}))
            for k in self.weights
        }
        self.counts = {k: 0 for k in self.weights}
        self._rng = random.Random(seed)
        # normalized prompts held out for evaluation (envs.hub.normalize_text): a draw of one is drawn again
        self.exclude: set[str] = set()
        self.heldout_redraws = self.heldout_overlap = 0  # draws drawn again; held-out problems drawn anyway

    def generate(self, env_id: str, d: int, rng: random.Random) -> Problem:
        """A problem of ``env_id`` at level ``d`` with a seed from ``rng``, drawn again (up to
        ``HELDOUT_REDRAWS`` times) while its prompt is one held out; a level with so few distinct problems that
        every draw is held out keeps the last (counted in ``heldout_overlap``)."""
        p, redraws, held = draw_avoiding(lambda seed: self.envs[env_id].generate(seed, d), rng, self.exclude)
        self.heldout_redraws += redraws
        self.heldout_overlap += held
        return p

    def _follow_cap(self, env_id: str) -> Controller:
        """``env_id``'s controller, given the environment's current cap."""
        c = self.controllers[env_id]
        c.follow_cap(getattr(self.envs[env_id], "max_difficulty", None))
        return c

    def probabilities(self) -> dict[str, float]:
        """The chance of each environment being picked next (``least_sampled``: 1/ties at the argmin)."""
        ids = [k for k, w in self.weights.items() if w > 0]
        if self.mode == "least_sampled":
            load = {k: self.counts[k] / self.weights[k] for k in ids}
            low = [k for k in ids if load[k] == min(load.values())]
            return {k: (1.0 / len(low) if k in low else 0.0) for k in ids}
        total_w = sum(self.weights[k] for k in ids)
        if self.mode == "uniform":
            return {k: self.weights[k] / total_w for k in ids}
        n = sum(self.counts[k] for k in ids)
        behind = {k: (self.weights[k] / total_w * n - self.counts[k]) / self.temperature for k in ids}
        top = max(behind.values())
        raw = {k: self.weights[k] * math.exp(behind[k] - top) for k in ids}
        z = sum(raw.values())
        return {k: v / z for k, v in raw.items()}

    def _pick_env(self, rng: random.Random) -> str:
        ids = [k for k, w in self.weights.items() if w > 0]
        if self.mode == "uniform":
            return rng.choices(ids, weights=[self.weights[k] for k in ids])[0]
        if self.mode == "weighted_least_sampled":
            p = self.probabilities()
            return rng.choices(ids, weights=[p[k] for k in ids])[0]
        load = {k: self.counts[k] / self.weights[k] for k in ids}
        low = min(load.values())
        return rng.choice([k for k in ids if load[k] == low])

    def sample(self, rng_or_seed: random.Random | int | None = None, n: int = 1) -> list[tuple[str, Problem]]:
        if rng_or_seed is None:
            rng = self._rng
        elif isinstance(rng_or_seed, random.Random):
            rng = rng_or_seed
        else:
            rng = random.Random(int(rng_or_seed))
        out = []
        for _ in range(int(n)):
            env_id = self._pick_env(rng)
            d = self._follow_cap(env_id).sample(rng)
            self.counts[env_id] += 1
            out.append((env_id, self.generate(env_id, d, rng)))
        return out

    def peek(self, rng: random.Random, n: int = 1) -> list[tuple[str, Problem]]:
        """``n`` problems drawn as :meth:`sample` draws them, leaving the curriculum as it was (counts, the
        controllers' lazily drawn state): problems for data other than RL's (a teacher's SFT examples), which a
        run resumed from a checkpoint taken after the draw draws again, the same."""
        state = copy.deepcopy(self.state_dict())
        try:
            return self.sample(rng, n)
        finally:
            self.load_state_dict(state)

    def update(self, env_id: str, difficulty: int, scores: Iterable[Any]) -> None:
        if env_id not in self.controllers:
            raise KeyError(f"environment {env_id!r} is not in this curriculum ({', '.join(self.controllers)})")
        self._follow_cap(env_id).update(difficulty, list(scores))

    def difficulties(self) -> dict[str, Any]:
        """A readable summary of each controller's state (for logs), under the environments' current caps."""
        out = {}
        for k in self.controllers:
            c = self._follow_cap(k)
            if isinstance(c, RLVEWindow):
                out[k] = [c.low, c.high]
            elif isinstance(c, Fixed):
                out[k] = _clamp(c.difficulty, c.max_difficulty)
            else:
                out[k] = getattr(c, "difficulty", None)
        return out

    def state_dict(self) -> dict:
        st = self._rng.getstate()
        return {
            "mode": self.mode,
            "weights": dict(self.weights),
            "counts": dict(self.counts),
            "controllers": {k: {"name": c.name, "state": c.state_dict()} for k, c in self.controllers.items()},
            "rng": [st[0], list(st[1]), st[2]],
            "heldout": [self.heldout_redraws, self.heldout_overlap],
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["weights"]) != set(self.weights):
            raise ValueError(f"curriculum state is for environments {sorted(state['weights'])}, "
                             f"this curriculum has {sorted(self.weights)}")
        self.weights = {k: float(v) for k, v in state["weights"].items()}
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        for k, cs in state["controllers"].items():
            if self.controllers[k].name != cs["name"]:  # a level of one kind is no state of the other
                raise ValueError(f"controller={self.controllers[k].name}, but the checkpoint's curriculum ran the "
                                 f"{cs['name']} difficulty controller ({k}): resume with controller={cs['name']}, or "
                                 f"start the stage afresh")
            self.controllers[k].load_state_dict(cs["state"])
            self._follow_cap(k)  # the environment's cap now, not the checkpoint's
        v, internal, gauss = state["rng"]
        self._rng.setstate((v, tuple(internal), gauss))
        self.heldout_redraws, self.heldout_overlap = state.get("heldout", (0, 0))
