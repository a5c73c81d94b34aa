"""RLVE-Gym's environments as Cascade environments ``rlve/<Name>``.

Every environment in RLVE-Gym's ``Gym.environments.identifier2environment`` (the ``rlve-gym``
package: ``pip install 'cascade-rl[rlve]'``) becomes an environment under its RLVE identifier.

Difficulty follows RLVE's own parameter controller exactly as RLVE's trainer uses it: difficulty
``d`` is ``identifier2controller[Name]()`` stepped ``d`` times with ``update()``; its
``get_parameter_list()`` at that point is the list of generator parameters of level ``d``, and one
of them is chosen (deterministically in ``(seed, d)``; RLVE's trainer picks at random).
``generate(seed, d)`` then runs RLVE's generator as ``VerifiableEnvironment.generator`` does (seed
the global ``random`` and ``numpy`` generators, deep-copy the parameter, ``_generate()``) without
its thread "timeout" (a thread cannot be stopped; Cascade bounds generation by process, see
:mod:`envs.check`) and without reseeding torch, and restores the caller's random state afterwards.
RLVE seeds numpy, so the generator seed is ``seed mod 2**32``. A parameter on which RLVE's generator
fails is retried with derived seeds, as RLVE's trainer simply draws another problem.

Answers: the prompt is RLVE's prompt followed by Cascade's answer instruction, which asks for the
answer between ``<answer>`` and ``</answer>`` (RLVE's own markers; RLVE's answers are lines of
numbers or text that may contain braces, which ``\\boxed{}`` cannot carry). ``verify`` takes the
last ``<answer>...</answer>`` or ``\\boxed{...}`` after any thinking, hands it to RLVE's
``verifier`` with RLVE's markers, and maps its result onto :class:`Score`: ``reward`` = RLVE's
reward in [-1, 1] (partial credit and format penalties as RLVE defines them), ``correct`` = RLVE's
``accuracy`` (reward at or above the environment's passing threshold), ``format_ok`` = RLVE's
``format_score``. The reference answer is RLVE's ``reference_answer``; the environments that keep
only an optimal objective value (``gold_answer``) have no reference response.

Importing this module, listing and registering never import ``Gym`` (which imports torch): the
catalogue of names is read from RLVE-Gym's source files (cached per installed version).
"""
from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import json
import random
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from envs.adapted import ANSWER_TAG, MAX_ANSWER_CHARS, cached_catalog, last_tagged_or_boxed, package_version
from envs.base import Environment, Problem, Score, register, strip_think
from envs.isolated import IsolatedCheck

__all__ = ["RLVEEnv", "catalog", "EXCLUDED", "available", "INSTRUCTION"]

INSTRUCTION = "Give your final answer between <answer> and </answer>."
_ENTRY_CACHE = 256
_MARKERS = ANSWER_TAG  # ("<answer>", "</answer>"): the tag RLVE's processors read

# Environments not registered, with the reason (found by `cascade envs check 'rlve/*'`).
EXCLUDED: dict[str, str] = {
    "PolyaModel": "RLVE's scorer parses the whole output with _process() instead of processor(), so an "
                  "answer inside the markers never parses: every response scores wrong_format (-1)",
    "Cornfield": "its generator often makes a problem whose optimum needs no operation: the empty answer earns full "
                 "reward on 25 of 40 problems at difficulty 0 (16 of 40 at 3), a constant answer a policy would learn",
}


def available() -> bool:
    """True when RLVE-Gym (the ``Gym`` module of ``rlve-gym``) is installed."""
    try:  # without importing Gym (find_spec of "Gym.environments" would)
        root = _gym_dir()
    except (ImportError, ValueError):
        return False
    return root is not None and (root / "environments" / "__init__.py").is_file()


def _gym_dir() -> Path | None:
    spec = importlib.util.find_spec("Gym")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _describe(module_dir: Path, class_name: str) -> tuple[str, bool]:
    """(first line of the class's prompt template, whether it sets a ``reference_answer``)."""
    desc, has_ref = "", False
    for path in sorted(module_dir.glob("*.py")):
        try:
            src = path.read_text()
        except OSError:
            continue
        has_ref = has_ref or "reference_answer" in src
        if desc:
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name == class_name):
                continue
            for item in node.body:
                if (isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "prompt_template"
                                                         for t in item.targets)
                        and isinstance(item.value, ast.Constant) and isinstance(item.value.value, str)):
                    first = item.value.value.strip().splitlines()
                    desc = first[0].strip()[:160] if first else ""
    return desc, has_ref


def _build_catalog() -> dict[str, dict]:
    """``{Name: {"class", "module", "description", "reference"}}`` read from the source (no import)."""
    root = _gym_dir()
    if root is None:
        return {}
    init = root / "environments" / "__init__.py"
    tree = ast.parse(init.read_text())
    modules = {}  # class name -> module directory
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("Gym.environments."):
            for alias in node.names:
                modules[alias.asname or alias.name] = node.module.rsplit(".", 1)[1]
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "identifier2environment"
                                                for t in node.targets) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Name):
                    names[str(k.value)] = v.id
    out = {}
    for name, cls in sorted(names.items()):
        mod = modules.get(cls, "")
        desc, has_ref = _describe(root / "environments" / mod, cls) if mod else ("", False)
        out[name] = {"class": cls, "module": mod, "description": desc or f"RLVE-Gym {name}",
                     "reference": has_ref}
    return out


def catalog() -> dict[str, dict]:
    """RLVE-Gym's environments (``{}`` if not installed), cached per installed version."""
    if not available():
        return {}
    return cached_catalog(f"rlve_gym-{package_version('rlve-gym')}-{_stable_hash(str(_gym_dir()))}.json",
                          _build_catalog)


def _stable_hash(text: str) -> str:
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()[:10]


_LOCAL = threading.local()


class _ThreadRandom:
    """Stands in for the ``random`` module inside the adapted package's modules: while a generation
    runs in a thread, their ``random.x`` calls draw from that thread's own ``random.Random(seed)``
    (the same stream ``random.seed(seed)`` gives), elsewhere from the global generator. So a
    generation abandoned by the time bound (envs/caps.py) cannot disturb later ones. Within a
    generation what would draw on OS entropy draws on that stream instead, so the problem stays a
    function of the seed: ``random.seed(None)`` (gramforge, under reasoning-core's grammar tasks, calls
    it with its default seed) is a no-op and ``random.Random()`` is seeded from the stream."""

    def __getattr__(self, name):
        rng = getattr(_LOCAL, "rng", None)
        if rng is not None and name == "seed":
            return lambda a=None, *args, **kw: None if a is None else rng.seed(a, *args, **kw)
        if rng is not None and name == "Random":
            return lambda x=None: random.Random(rng.getrandbits(64) if x is None else x)
        if rng is not None and not name.startswith("_"):
            attr = getattr(rng, name, None)
            if attr is not None:
                return attr
        return getattr(random, name)


_PROXY = _ThreadRandom()


class _ThreadNumpy:
    """Stands in for ``numpy`` (``np``) inside the adapted package's modules: within a generation
    ``np.random.default_rng()`` without a seed (OS entropy) is seeded from the thread's stream;
    everything else is numpy's own."""

    def __getattr__(self, name):
        if name == "random" and getattr(_LOCAL, "rng", None) is not None:
            return _NUMPY_RANDOM
        return getattr(sys.modules["numpy"], name)


class _ThreadNumpyRandom:
    """``np.random`` inside the adapted package's modules: while a generation runs in a thread, its legacy
    functions (``choice``, ``randint``, ``shuffle``, ...) are that thread's own ``RandomState`` (the stream
    ``np.random.seed(seed)`` gives): a generation abandoned by the time bound drew from numpy's global one, which
    the next generation had seeded, and restored the global state it saved when it finished (the same seed made
    another problem after an abandoned generation: 5-30 of 30 ``rc/table_qa`` problems)."""

    def __getattr__(self, name):
        rng = getattr(_LOCAL, "rng", None)
        numpy_random = sys.modules["numpy"].random
        if name == "default_rng" and rng is not None:
            return lambda seed=None: numpy_random.default_rng(rng.getrandbits(64) if seed is None else seed)
        own = getattr(_LOCAL, "np_rng", None)
        if own is not None and not name.startswith("_") and name[:1].islower() and hasattr(own, name):
            return getattr(own, name)
        return getattr(numpy_random, name)


_NUMPY, _NUMPY_RANDOM = _ThreadNumpy(), _ThreadNumpyRandom()


def patch_random(prefix: str) -> None:
    """Point the ``random`` (and ``np``/``numpy``) globals of every loaded module under ``prefix`` at the
    per-thread proxies."""
    numpy = sys.modules.get("numpy")
    for name, mod in list(sys.modules.items()):
        if name == prefix or name.startswith(prefix + "."):
            if getattr(mod, "random", None) is random:
                mod.random = _PROXY
            for alias in ("np", "numpy"):
                if numpy is not None and getattr(mod, alias, None) is numpy:
                    setattr(mod, alias, _NUMPY)


@contextmanager
def _seeded(seed: int):
    """Seed ``random`` (per thread, see :class:`_ThreadRandom`, and the global one) and ``numpy`` as
    RLVE's ``manual_seed`` does (not torch: no RLVE generator uses it); restore the caller's states. (numpy takes
    the seed modulo 2^32: reasoning-core's derived seeds reach 2^63.)"""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    prev, prev_np = getattr(_LOCAL, "rng", None), getattr(_LOCAL, "np_rng", None)
    _LOCAL.rng, _LOCAL.np_rng = random.Random(seed), np.random.RandomState(seed % 2**32)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        _LOCAL.rng, _LOCAL.np_rng = prev, prev_np
        random.setstate(py_state)
        np.random.set_state(np_state)


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return json.loads(json.dumps(x, default=repr))


class RLVEEnv(IsolatedCheck, Environment):
    family = "rlve"
    instruction = INSTRUCTION
    verify_time_limit = 10.0
    generate_time_limit = 10.0  # run-time bound on one generate (envs/caps.py)
    max_difficulty = None  # RLVE's controllers step without end (some saturate); see envs/check.py caps

    def __init__(self, name: str):
        from Gym.environments import identifier2environment
        from Gym.parameter_controllers import identifier2controller

        if name not in identifier2environment:
            raise KeyError(f"RLVE-Gym has no environment {name!r}")
        self.name = name
        self.id = f"rlve/{name}"
        info = catalog().get(name, {})
        self.description = info.get("description", "")
        self.no_reference_reason = "" if info.get("reference", True) else (
            "no reference answer: RLVE keeps only the optimal objective value (gold_answer) and scores "
            "a proposed solution against it")
        self._env_cls = identifier2environment[name]
        patch_random("Gym.environments")
        self._controller_cls = identifier2controller[name]
        self._controller = None
        self._levels: list[list[dict]] = []
        self._entries: OrderedDict = OrderedDict()

    # -- RLVE's parameter controller -----------------------------------------------------------
    def parameter_list(self, difficulty: int) -> list[dict]:
        """``get_parameter_list()`` of RLVE's controller stepped ``difficulty`` times."""
        d = max(0, int(difficulty))
        if self._controller is None:
            self._controller = self._controller_cls()
            self._levels = [copy.deepcopy(self._controller.get_parameter_list())]
        while len(self._levels) <= d:
            self._controller.update()
            self._levels.append(copy.deepcopy(self._controller.get_parameter_list()))
        return self._levels[d]

    def _instance(self):
        return self._env_cls(answer_markers=_MARKERS)

    def _run(self, seed: int, parameter: dict):
        """RLVE's ``generator`` (seed, copy the parameter, ``_generate``) and its prompt; None on failure."""
        inst = self._instance()
        s = int(seed) % (2 ** 32)
        with _seeded(s):
            try:
                inst.seed = s
                inst.parameter = copy.deepcopy(parameter)
                inst._generate()
                if inst.parameter is None:
                    return None
                prompt = inst.prompt_generator()
            except Exception:  # noqa: BLE001 - RLVE's generator reports any failure as False
                return None
        return inst, prompt

    def _item(self, seed: int, difficulty: int):
        """(RLVE instance, prompt, chosen parameter, generator seed) for (seed, difficulty), cached."""
        key = (int(seed), max(0, int(difficulty)))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        plist = self.parameter_list(key[1])
        if not plist:
            raise RuntimeError(f"RLVE-Gym {self.name}: the controller gives no parameters at level {key[1]}")
        rng = random.Random(f"{self.id}|{key[0]}|{key[1]}")
        got = None
        for attempt in range(8):
            parameter = plist[rng.randrange(len(plist))]
            s = key[0] if attempt == 0 else (key[0] * 1_000_003 + attempt) % (2 ** 63)
            run = self._run(s, parameter)
            if run is not None:
                got = (run[0], run[1], parameter, s % (2 ** 32))
                break
        if got is None:
            raise RuntimeError(f"RLVE-Gym {self.name} failed to generate at level {key[1]} "
                               f"(parameters {str(plist)[:200]})")
        self._entries[key] = got
        if len(self._entries) > _ENTRY_CACHE:
            self._entries.popitem(last=False)
        return got

    # -- environment ---------------------------------------------------------------------------
    def generate(self, seed: int, difficulty: int) -> Problem:
        inst, prompt, parameter, s = self._item(seed, difficulty)
        ref = inst.parameter.get("reference_answer")
        answer = None if ref is None else (ref if isinstance(ref, (str, int, float)) else _jsonable(ref))
        return self.problem(prompt, answer, seed, difficulty, rlve=self.name,
                            parameter=_jsonable(parameter), rlve_seed=s)

    def format_answer(self, answer) -> str:
        return "" if answer is None else str(answer)

    def extract(self, response: str) -> str | None:
        return last_tagged_or_boxed(strip_think(response))

    def reference_response(self, problem: Problem) -> str:
        return f"{_MARKERS[0]}{self.format_answer(problem.answer)}{_MARKERS[1]}"

    def corruptions(self, problem: Problem) -> list[str]:
        return ["", "I don't know.", "<answer>qx9 ### zz</answer>",
                "\\boxed{-98765.4321}"]

    def check_context(self, problem: Problem):
        inst, prompt, _, _ = self._item(problem.seed, problem.difficulty)
        return inst, prompt

    def check_with(self, problem: Problem, response: str, context) -> Score:
        text = strip_think(response)
        pred = last_tagged_or_boxed(text)
        if pred is not None:
            limit = max(MAX_ANSWER_CHARS, 50 * len(self.format_answer(problem.answer)))
            if len(pred) > limit:
                return Score(-1.0, False, False, {"reason": "answer too long", "length": len(pred)})
        inst, prompt = context
        # RLVE's processor reads the last <answer>...</answer> of the output
        output = f"{_MARKERS[0]}{pred}{_MARKERS[1]}" if pred is not None else text[-MAX_ANSWER_CHARS:]
        res = inst.verifier(output)
        reward = float(res["reward"])
        info = {"rlve_reward": reward, "accuracy": int(res["accuracy"])}
        if pred is not None:
            info["extracted"] = pred[:200]
        if not problem.prompt.startswith(prompt):
            info["warning"] = "regenerated problem differs from the given one"
        return Score(reward, bool(res["accuracy"]), bool(res["format_score"]) and pred is not None, info)


def _register_all() -> None:
    for name, info in catalog().items():
        if name in EXCLUDED:
            continue
        register(f"rlve/{name}", factory=functools.partial(RLVEEnv, name),
                 family="rlve", description=info.get("description", ""))


_register_all()
