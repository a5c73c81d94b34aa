"""reasoning-core's tasks as Cascade environments ``rc/<task>``.

Every task of reasoning-core's shipped roster (``reasoning_core.list_tasks()``; the package
``reasoning-core``, ``pip install 'cascade-rl[rc]'``) becomes an environment. Difficulty ``d`` is
reasoning-core's own level: ``task.generate_example(level=d)`` sets the task config's level
(``Config.set_level``). reasoning-core draws from the global ``random``/``numpy`` generators (it
takes no seed), so ``generate(seed, d)`` seeds both with ``seed`` around the call and restores the
caller's state afterwards; what its modules (and gramforge's, Faker's) would draw from OS entropy
(``random.seed()``, ``random.Random()``, ``np.random.default_rng()``) is drawn from that seeded stream:
the problem is a function of ``(seed, d)``. Two grammar tasks (``constrained_continuation``,
``parsing_derivation``) still differ between processes for the same ``(seed, d)``: their variation
comes from no generator Cascade can seed (their verification reads the problem's own metadata, so
scores stay right). A generation that
reasoning-core fails is retried with derived seeds, then at the levels below.

``verify`` extracts the answer (the last ``\\boxed{}`` or ``<answer>...</answer>`` after any
thinking, as for ``rg/``) and scores it with the task's own ``score_answer`` through
reasoning-core's dispatcher (``get_score_answer_fn``: the scorer reads only the entry, so a problem
verifies in any process); the entry is rebuilt from the problem (its answer and reasoning-core's
metadata, kept in ``meta["rc_metadata"]``). The score in [0, 1] is the reward; full credit is
``correct``.

Listing and registering do not import reasoning-core: the roster is cached per installed version
(``$CASCADE_CACHE_DIR`` or ``~/.cache/cascade``). Tasks listed in ``EXCLUDED`` are not registered.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections import OrderedDict

from envs.adapted import BoxedOrTagged, cached_catalog, package_version
from envs.base import Environment, Problem, Score, register
from envs.isolated import IsolatedCheck

__all__ = ["ReasoningCoreEnv", "catalog", "EXCLUDED", "available"]

_ENTRY_CACHE = 256

# Tasks not registered, with the reason (found by `cascade envs check 'rc/*'`).
EXCLUDED: dict[str, str] = {
    "game_best_move": "generation imports pyggp, which reasoning-core does not declare (not even in its "
                      "'gen' extra)",
    "game_forced_win": "generation imports pyggp, which reasoning-core does not declare (not even in its "
                       "'gen' extra)",
    "metamath_core_select": "generation downloads the metamath database (set.mm) from the network",
    "metamath_entailment": "generation downloads the metamath database (set.mm) from the network",
}


def available() -> bool:
    try:
        return importlib.util.find_spec("reasoning_core") is not None
    except (ImportError, ValueError):
        return False


def _build_catalog() -> dict[str, dict]:
    import reasoning_core

    rows = {r["name"]: r for r in reasoning_core.task_catalog()}
    return {name: {"description": (rows.get(name, {}).get("summary") or f"reasoning-core {name}")[:160]}
            for name in sorted(reasoning_core.list_tasks())}


def catalog() -> dict[str, dict]:
    """``{task: {"description"}}`` of reasoning-core's roster; {} if not installed."""
    if not available():
        return {}
    return cached_catalog(f"reasoning_core-{package_version('reasoning-core')}.json", _build_catalog)


def _plain(x):
    """JSON-safe copy (reasoning-core's metadata is an EasyDict of JSON values)."""
    return json.loads(json.dumps(x, default=str))


# tasks whose configuration stops changing: the highest level that differs from the one below (measured with
# reasoning-core 0.5.0: ``task.config.set_level(L)``; above it a curriculum would climb on identical problems)
# (belief_tracking's settings stop at level 12 too, but its set_level steps some of them at random: not capped)
LEVEL_TOPS = {"combinatorics_formula": 6, "table_statistics": 11}


class ReasoningCoreEnv(IsolatedCheck, BoxedOrTagged, Environment):
    family = "rc"
    verify_time_limit = 10.0
    generate_time_limit = 10.0  # run-time bound on one generate (envs/caps.py)
    max_difficulty = None  # reasoning-core's levels have no upper end (but LEVEL_TOPS')

    def __init__(self, name: str):
        import reasoning_core

        self.name = reasoning_core.match_task_name(name)
        self.id = f"rc/{self.name}"
        self.max_difficulty = LEVEL_TOPS.get(self.name)
        self.description = catalog().get(self.name, {}).get("description", "")
        self._rc = reasoning_core
        self._task_obj = None
        self._scorer = None
        self._entries: OrderedDict = OrderedDict()

    def _task(self):
        if self._task_obj is None:
            import warnings

            with warnings.catch_warnings():  # "tiktoken unavailable": lengths count words instead
                warnings.simplefilter("ignore")
                self._task_obj = self._rc.get_task(self.name)
        return self._task_obj

    def prepare(self) -> None:
        self._task()  # importing the task's modules takes seconds: outside the generation time bound

    def _generate_at(self, seed: int, level: int):
        import warnings

        from envs.rlve_adapter import _seeded, patch_random

        task = self._task()
        for package in ("reasoning_core", "gramforge"):  # per-thread random streams (see envs/rlve_adapter.py)
            patch_random(package)
        with _seeded(seed):
            # Faker's generators share one random.Random, seeded from OS entropy at import (tables, names, regexes)
            faker = getattr(sys.modules.get("faker.generator"), "random", None)
            faker_state = faker.getstate() if faker is not None else None
            if faker is not None:
                faker.seed(seed)
            try:
                with warnings.catch_warnings():  # off the main thread (envs/caps.py's bound) rc has no alarm
                    warnings.filterwarnings("ignore", message="timeout_retry")
                    return task.generate_example(level=level)
            finally:
                if faker is not None:
                    faker.setstate(faker_state)

    def _item(self, seed: int, difficulty: int):
        """(prompt, answer, metadata, level) for (seed, difficulty), cached."""
        key = (int(seed), max(0, int(difficulty)))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        got, err, fallback = None, None, None
        for level in range(key[1], max(-1, key[1] - 3), -1):
            for attempt in range(3):
                s = key[0] if attempt == 0 else (key[0] * 1_000_003 + attempt) % (2 ** 63)
                try:
                    e = self._generate_at(s, level)
                except Exception as ex:  # noqa: BLE001 - reasoning-core fails on some (seed, level)
                    err = ex
                    continue
                meta = {k: v for k, v in dict(e.metadata).items() if k != "_time"}
                item = (str(e.prompt), e.answer, _plain(meta), level)
                # an item whose own answer its scorer does not credit is drawn again (kept if every draw is such)
                if self.reference_credited(self._problem(item, key[0], key[1]), item[2]):
                    got = item
                    break
                fallback = fallback or item
            got = got or fallback
            if got is not None:
                break
        if got is None:
            raise RuntimeError(f"reasoning-core {self.name} failed to generate at level {key[1]}: "
                               f"{type(err).__name__}: {err}")
        self._entries[key] = got
        if len(self._entries) > _ENTRY_CACHE:
            self._entries.popitem(last=False)
        return got

    # -- environment ---------------------------------------------------------------------------
    def generate(self, seed: int, difficulty: int) -> Problem:
        return self._problem(self._item(seed, difficulty), seed, difficulty)

    def _problem(self, item, seed: int, difficulty: int) -> Problem:
        prompt, answer, meta, level = item
        if not isinstance(answer, (str, int, float)) and answer is not None:
            answer = _plain(answer)
        return self.problem(prompt, answer, seed, difficulty, rc_task=self.name, level=level,
                            rc_metadata=meta)

    def check_context(self, problem: Problem):
        meta = problem.meta.get("rc_metadata")
        if meta is None:  # a problem without its metadata: regenerate it
            _, _, meta, _ = self._item(problem.seed, problem.difficulty)
        return meta

    def check_with(self, problem: Problem, response: str, context) -> Score:
        pred = self.extracted_or_zero(problem, response)
        if isinstance(pred, Score):
            return pred
        from reasoning_core.template import Entry

        entry = Entry(metadata=context, answer=problem.answer)
        entry.prompt = problem.meta.get("question", problem.prompt)  # (an aggregation prompt's own problem)
        if self._scorer is None:
            self._scorer = self._rc.get_score_answer_fn(self.name)
        value = float(self._scorer(pred, entry))
        value = max(0.0, min(1.0, value)) if value == value else 0.0
        return Score(value, value >= 1.0 - 1e-9, True, {"extracted": pred[:200], "rc_score": value})


def _register_all() -> None:
    for name, info in catalog().items():
        if name in EXCLUDED:
            continue
        register(f"rc/{name}", factory=functools.partial(ReasoningCoreEnv, name),
                 family="rc", description=info.get("description", ""))


_register_all()
