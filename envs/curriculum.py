"""Difficulty controllers and the multi-environment curriculum.

Controllers (one per environment) choose the difficulty of the next problem and learn from the
scores of finished rollouts:

- :class:`RLVEWindow`: RLVE's sliding window. The range ``[l, h]`` starts at ``[0, 0]``; ``d`` is
  drawn uniformly from it; only rollouts at ``d == h`` are counted; once ``tau_num`` of them
  (``tau_prompts`` x ``group_size``) are in, ``h += 1`` if their accuracy is at least ``tau_acc``,
  and the counts reset either way; ``l = max(0, h - d_window + 1)``.
- :class:`UpDown`: ZAYA1's rule. ``d += 1`` when a group's pass rate at the current ``d`` exceeds
  ``up`` (0.7), ``d -= 1`` when it is 0. The start is calibrated: during the first
  ``calibration_groups`` updates, Thompson sampling over an item-response curve
  ``p(d) = sigmoid(-(d - mu) / s)`` (a grid posterior over ``mu`` and ``s``) picks the ``d`` whose
  sampled pass rate is closest to 0.5; afterwards ``d`` starts at the posterior's 0.5 point.
- :class:`Fixed`: always the same difficulty.

A rollout counts as correct when its score is ``correct`` (a :class:`Score`), ``True``, or a
number ``>= 1`` (full credit, RLVE's accuracy). All state is plain data: ``state_dict()`` is
JSON-serialisable and ``load_state_dict`` restores it exactly.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Iterable

from envs.base import Environment, Problem, get_env

__all__ = ["Controller", "RLVEWindow", "UpDown", "Fixed", "CONTROLLERS", "make_controller",
           "Curriculum", "count_correct"]


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

    def sample(self, rng: random.Random) -> int:
        raise NotImplementedError

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(self.__dict__)
        if unknown:
            raise ValueError(f"{type(self).__name__}.load_state_dict: unknown keys {sorted(unknown)}")
        for k, v in state.items():
            setattr(self, k, copy.deepcopy(list(v) if isinstance(v, tuple) else v))


class Fixed(Controller):
    name = "fixed"

    def __init__(self, difficulty: int = 0, max_difficulty: int | None = None):
        self.difficulty = _clamp(difficulty, max_difficulty)

    def sample(self, rng: random.Random) -> int:
        return self.difficulty

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        pass


class RLVEWindow(Controller):
    name = "rlve"

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


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class UpDown(Controller):
    name = "zaya"

    def __init__(self, up: float = 0.7, start: int | None = None, calibration_groups: int = 8,
                 max_difficulty: int | None = None, grid_max: int = 20,
                 slopes: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)):
        """``start`` given: no calibration. Otherwise Thompson-sample the first
        ``calibration_groups`` difficulties from the item-response posterior."""
        self.up = float(up)
        self.max_difficulty = max_difficulty
        top = grid_max if max_difficulty is None else min(grid_max, int(max_difficulty))
        self.mus = [i / 2 for i in range(0, 2 * top + 1)]
        self.slopes = [float(s) for s in slopes]
        self.logpost = [0.0] * (len(self.mus) * len(self.slopes))  # uniform prior
        self.calibrating = start is None and calibration_groups > 0
        self.calibration_left = int(calibration_groups) if self.calibrating else 0
        self.difficulty = _clamp(0 if start is None else start, max_difficulty)

    # -- item-response posterior ---------------------------------------------------------------
    def _cell(self, i: int) -> tuple[float, float]:
        return self.mus[i // len(self.slopes)], self.slopes[i % len(self.slopes)]

    def _observe(self, d: int, k: int, n: int) -> None:
        for i in range(len(self.logpost)):
            mu, s = self._cell(i)
            p = min(max(_sigmoid(-(d - mu) / s), 1e-6), 1 - 1e-6)
            self.logpost[i] += k * math.log(p) + (n - k) * math.log(1 - p)
        top = max(self.logpost)
        self.logpost = [v - top for v in self.logpost]  # keep it bounded

    def _weights(self) -> list[float]:
        return [math.exp(v) for v in self.logpost]

    def _target(self, mu: float) -> int:
        """The difficulty whose pass rate under the curve is closest to 0.5."""
        return _clamp(int(math.floor(mu + 0.5)), self.max_difficulty)

    def posterior_mu(self) -> float:
        w = self._weights()
        return sum(wi * self._cell(i)[0] for i, wi in enumerate(w)) / sum(w)

    # -- controller ----------------------------------------------------------------------------
    def sample(self, rng: random.Random) -> int:
        if not self.calibrating:
            return self.difficulty
        i = rng.choices(range(len(self.logpost)), weights=self._weights())[0]
        return self._target(self._cell(i)[0])

    def update(self, difficulty: int, scores: Iterable[Any]) -> None:
        k, n = count_correct(scores)
        if n == 0:
            return
        d = int(difficulty)
        if self.calibrating:
            self._observe(d, k, n)
            self.calibration_left -= 1
            if self.calibration_left <= 0:
                self.calibrating = False
                self.difficulty = self._target(self.posterior_mu())
            return
        if d != self.difficulty:
            return
        rate = k / n
        if rate > self.up:
            self.difficulty = _clamp(self.difficulty + 1, self.max_difficulty)
        elif k == 0:
            self.difficulty = max(0, self.difficulty - 1)


CONTROLLERS: dict[str, type[Controller]] = {c.name: c for c in (RLVEWindow, UpDown, Fixed)}


def make_controller(name: str, max_difficulty: int | None = None, **kwargs) -> Controller:
    if name not in CONTROLLERS:
        raise ValueError(f"unknown difficulty controller {name!r}; choose from {', '.join(CONTROLLERS)}")
    return CONTROLLERS[name](max_difficulty=max_difficulty, **kwargs)


SAMPLING_MODES = ("uniform", "least_sampled")


class Curriculum:
    """Environments with mixing weights and one difficulty controller each.

    ``sample(rng_or_seed, n)`` returns ``n`` pairs ``(env_id, Problem)``. ``mode="uniform"`` picks
    environments at random in proportion to their weights; ``mode="least_sampled"`` picks the one
    sampled least so far relative to its weight (ties broken at random), so under-sampled
    environments catch up. Problem seeds are drawn from the given generator (or the curriculum's
    own, seeded by ``seed``, when ``rng_or_seed`` is None), so samples are deterministic.
    """

    def __init__(self, envs: dict[str, float] | Iterable[str], controller: str = "rlve",
                 mode: str = "uniform", seed: int = 0, controller_kwargs: dict | None = None,
                 env_kwargs: dict[str, dict] | None = None,
                 environments: dict[str, Environment] | None = None):
        weights = dict(envs) if isinstance(envs, dict) else {e: 1.0 for e in envs}
        if not weights:
            raise ValueError("a curriculum needs at least one environment")
        bad = [k for k, w in weights.items() if not (float(w) >= 0)]
        if bad or sum(weights.values()) <= 0:
            raise ValueError(f"environment weights must be >= 0 with a positive sum; got {weights}")
        if mode not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling mode {mode!r}; choose from {', '.join(SAMPLING_MODES)}")
        env_kwargs = env_kwargs or {}
        self.mode = mode
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

    def _pick_env(self, rng: random.Random) -> str:
        ids = [k for k, w in self.weights.items() if w > 0]
        if self.mode == "uniform":
            return rng.choices(ids, weights=[self.weights[k] for k in ids])[0]
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
            d = self.controllers[env_id].sample(rng)
            seed = rng.getrandbits(62)
            self.counts[env_id] += 1
            out.append((env_id, self.envs[env_id].generate(seed, d)))
        return out

    def update(self, env_id: str, difficulty: int, scores: Iterable[Any]) -> None:
        if env_id not in self.controllers:
            raise KeyError(f"environment {env_id!r} is not in this curriculum ({', '.join(self.controllers)})")
        self.controllers[env_id].update(difficulty, list(scores))

    def difficulties(self) -> dict[str, Any]:
        """A readable summary of each controller's state (for logs)."""
        out = {}
        for k, c in self.controllers.items():
            if isinstance(c, RLVEWindow):
                out[k] = [c.low, c.high]
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
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["weights"]) != set(self.weights):
            raise ValueError(f"curriculum state is for environments {sorted(state['weights'])}, "
                             f"this curriculum has {sorted(self.weights)}")
        self.mode = state["mode"]
        self.weights = {k: float(v) for k, v in state["weights"].items()}
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        for k, cs in state["controllers"].items():
            if self.controllers[k].name != cs["name"]:
                self.controllers[k] = CONTROLLERS[cs["name"]]()
            self.controllers[k].load_state_dict(cs["state"])
        v, internal, gauss = state["rng"]
        self._rng.setstate((v, tuple(internal), gauss))
