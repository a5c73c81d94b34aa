"""The environment contract: problems, scores, environments and their registry.

Pure Python; importing this module never imports torch.

An environment generates a problem deterministically from ``(seed, difficulty)`` and verifies a
model response against it. ``verify`` never raises: any exception inside an environment's
``check`` becomes a zero-credit :class:`Score` whose ``info["error"]`` says what happened.
"""
from __future__ import annotations

import importlib
import os
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Iterable

__all__ = [
    "Problem", "Score", "Environment", "register", "get_env", "get_env_class", "list_envs",
    "load_entry_points", "last_boxed", "last_boxed_span", "UnknownEnvironmentError", "env_info",
    "verify_all", "verify_workers", "bounded",
]


@dataclass
class Problem:
    """One generated problem. ``answer`` is the reference answer (JSON-serialisable)."""

    prompt: str
    answer: Any
    env_id: str = ""
    seed: int = 0
    difficulty: int = 0
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Problem":
        return cls(**d)


@dataclass
class Score:
    """Outcome of verifying a response. ``reward`` in [-1, 1]; ``correct`` means full credit."""

    reward: float
    correct: bool
    format_ok: bool
    info: dict = field(default_factory=dict)

    @classmethod
    def zero(cls, reason: str, format_ok: bool = False, **info) -> "Score":
        return cls(0.0, False, format_ok, {"reason": reason, **info})


_BOXED = "\\boxed"
_BRACE = re.compile(r"\\.|[{}]", re.S)  # a brace, or an escaped character: \{ \} (and \\) group nothing
_SPACES = re.compile(r" *")


def last_boxed_span(text: str) -> tuple[int, str] | None:
    """``(start, content)`` of the last non-empty ``\\boxed{...}`` in ``text`` whose braces balance, or None.

    LaTeX's literal braces ``\\{`` and ``\\}`` (a set, ``\\left\\{`` of a piecewise function) are characters, not
    braces. Linear in the length of the text (one pass pairs every brace after the first ``\\boxed``, so an
    output of thousands of unclosed ``\\boxed{`` costs no more than its length); never raises."""
    if not isinstance(text, str):
        return None
    first = text.find(_BOXED)
    if first < 0:
        return None
    close: dict[int, int] = {}  # position of each "{" -> its matching "}"
    opened: list[int] = []
    for m in _BRACE.finditer(text, first):  # (it starts on a backslash: escapes pair as from 0)
        if m.group() == "{":
            opened.append(m.start())
        elif m.group() == "}" and opened:
            close[opened.pop()] = m.start()
    idx = text.rfind(_BOXED)
    while idx >= 0:
        j = _SPACES.match(text, idx + len(_BOXED)).end()
        k = close.get(j)
        if k is not None and text[j + 1:k].strip():  # an empty box (the instruction echoed) answers nothing
            return idx, text[j + 1:k].strip()
        idx = text.rfind(_BOXED, 0, idx)
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or None (see
    :func:`last_boxed_span`)."""
    span = last_boxed_span(text)
    return None if span is None else span[1]


_THINK_END = re.compile(r"</think>", re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)


def strip_think(text: str) -> str:
    """The part of a response after the last ``</think>``, up to a ``<think>`` opened again there: the whole text
    when it has no thinking, and ``""`` when a ``<think>`` is never closed (a response cut inside its thinking has
    no answer yet; a ``\\boxed{}`` in the thinking is not one)."""
    parts = _THINK_END.split(text)
    after = parts[-1] if len(parts) > 1 else text
    return _THINK_OPEN.split(after, maxsplit=1)[0] if len(parts) > 1 else ("" if _THINK_OPEN.search(text) else text)


def open_think(prompt_tail: str) -> str:
    """The thinking block the end of a generation prompt (``prompt_tail``: what a chat template adds after the
    user's message) opens and leaves open: ``"<think>\\n"`` for DeepSeek-R1's or Qwen3-Thinking-2507's templates,
    ``""`` where it opens none or closes it (``<think></think>``, thinking off). A response to such a prompt starts
    inside its thinking without writing ``<think>``: what is verified is this block plus the response, so that one
    cut before ``</think>`` has no answer here too."""
    i = prompt_tail.rfind("<think>")
    return "" if i < 0 or "</think>" in prompt_tail[i:] else prompt_tail[i:]


def after_open_think(response: str, think_open: str) -> str:
    """What follows a prompt that opened thinking (``think_open``, :func:`open_think`) in a complete ``response``
    (``<think>...</think>answer``, or a bare answer): its opening dropped, or an empty thinking block closed in
    front of a bare answer. The inverse of verifying ``think_open + response``."""
    if not think_open:
        return response
    body = response.lstrip()
    if body.startswith(think_open):
        return body[len(think_open):]
    tag = think_open.strip()
    if body.startswith(tag):
        return body[len(tag):].lstrip("\n")
    return "</think>\n\n" + response


class Environment:
    """Base class of every environment.

    Subclasses set ``id`` (via :func:`register`) and implement ``generate`` and ``check``.
    ``check(problem, response)`` may raise on malformed input: ``verify`` turns any exception into
    a zero score. ``reference_response`` renders the reference answer the way a model should
    answer; ``corruptions`` gives responses that must not verify as correct (self-check).
    """

    id: ClassVar[str] = ""
    family: ClassVar[str] = "misc"
    description: ClassVar[str] = ""
    max_difficulty: ClassVar[int | None] = None  # None: grows without bound
    instruction: ClassVar[str] = "Put your final answer within \\boxed{}."
    # the ttc template (a name, or a ttc.templates.Template) of the aggregation prompts built from this
    # environment's problems (cascade/aggregation.py, ``aggregation.template=auto``): it asks for the answer
    # in the form the environment grades (``math``: within \boxed{}; program-writing tasks: a code block)
    aggregation_template: ClassVar[Any] = "math"
    verify_time_limit: ClassVar[float] = 5.0  # seconds one verify may take (self-check, fuzz tests)
    # Non-empty when no reference response can be produced (e.g. a task graded only by validity,
    # with no oracle answer): the self-check then skips "reference verifies" and reports this reason.
    no_reference_reason: ClassVar[str] = ""
    # True when arbitrary text can legitimately earn credit (no answer marker; e.g. instruction
    # following, where "no commas" holds for any comma-free text). Fuzz tests then require only
    # valid, bounded scores and zero credit for an empty response.
    free_form: ClassVar[bool] = False
    # True when ``check`` spends its time waiting on other processes (a sandbox, a pool of worker
    # processes) and is safe to call from several threads at once: :func:`verify_all` then verifies
    # several of this environment's responses at a time.
    concurrent_verify: ClassVar[bool] = False

    # -- to implement -------------------------------------------------------------------------
    def generate(self, seed: int, difficulty: int) -> Problem:
        raise NotImplementedError

    def check(self, problem: Problem, response: str) -> Score:
        raise NotImplementedError

    # -- provided -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """One-time work before the first ``generate`` (e.g. importing a third-party task's modules).
        Idempotent. The generation time bounds (:mod:`envs.caps`, the self-check) call it before
        their clock starts, so a slow first import is not taken for a slow generator."""

    def heldout(self, seed: int, difficulty: int) -> Problem:
        """A problem for held-out evaluation. Procedural environments give ``generate``'s (the stage
        evaluates on seeds training does not draw); environments over a fixed set of problems (the
        ``math`` dataset) override it to draw only from a held-out split that ``generate`` never uses."""
        return self.generate(seed, difficulty)

    def verify(self, problem: Problem, response: str) -> Score:
        """Score ``response``; never raises."""
        if not isinstance(response, str):
            return Score.zero("response is not a string")
        try:
            s = self.check(problem, response)
        except Exception as e:  # noqa: BLE001 - a verifier must never crash on model output
            return Score.zero("verifier error", error=f"{type(e).__name__}: {e}"[:500])
        if not isinstance(s, Score):
            return Score.zero("verifier error", error=f"{type(self).__name__}.check returned {type(s).__name__}, "
                                                      f"not a Score")
        try:
            return bounded(s)
        except (TypeError, ValueError) as e:  # a reward that is not a number (a plug-in passing a scorer's None)
            return Score.zero("verifier error", error=f"reward is not a number ({type(e).__name__}: {e})"[:500])

    def verify_many(self, items: list[tuple[Problem, str]]) -> list[Score]:
        """``verify`` of every ``(problem, response)``, in order. Environments that can score many
        responses at once (one batched forward of a reward model) override it; the scores must be
        ``verify``'s. :func:`verify_all` falls back to ``verify`` one by one if an override raises."""
        return [self.verify(p, r) for p, r in items]

    def extract(self, response: str) -> str | None:
        """The answer part of a response: the last ``\\boxed{}`` after any thinking."""
        return last_boxed(strip_think(response))

    def format_answer(self, answer: Any) -> str:
        return str(answer)

    def reference_response(self, problem: Problem) -> str:
        return f"The answer is \\boxed{{{self.format_answer(problem.answer)}}}."

    def corruptions(self, problem: Problem) -> list[str]:
        """Responses that must not be judged correct: no answer, and a perturbed answer."""
        ref = self.format_answer(problem.answer)
        out = ["", "I don't know.", f"\\boxed{{{ref}x9}}"]
        return out

    def rng(self, seed: int, difficulty: int) -> random.Random:
        """A generator deterministic in (environment id, seed, difficulty)."""
        return random.Random(f"{self.id}|{int(seed)}|{int(difficulty)}")

    def problem(self, prompt: str, answer: Any, seed: int, difficulty: int, **meta) -> Problem:
        """Build a Problem of this environment, appending the answer instruction."""
        text = prompt if not self.instruction else f"{prompt}\n\n{self.instruction}"
        return Problem(text, answer, self.id, int(seed), int(difficulty), meta)


def bounded(s: Score) -> Score:
    """``s`` with its reward in [-1, 1] (NaN -> 0), as ``verify`` returns it."""
    reward = float(s.reward)
    s.reward = 0.0 if reward != reward else max(-1.0, min(1.0, reward))
    return s


def verify_all(items: Iterable[tuple[Environment, Problem, str]], workers: int = 1) -> list[Score]:
    """``env.verify(problem, response)`` of every ``(env, problem, response)``, in order.

    Those of environments with ``concurrent_verify`` run ``workers`` at a time in threads; the others
    run here, each environment's together through its ``verify_many`` (one batch for a reward
    model). With ``workers <= 1`` (or fewer than two concurrent items) all run here. The scores are
    the same either way: ``verify`` depends only on its arguments."""
    items = list(items)
    conc = [i for i, (env, _, _) in enumerate(items) if env.concurrent_verify] if workers > 1 else []
    conc = conc if len(conc) >= 2 else []
    out: list[Score | None] = [None] * len(items)
    with ThreadPoolExecutor(max(1, min(workers, len(conc))), thread_name_prefix="cascade-verify") as ex:
        futs = {i: ex.submit(items[i][0].verify, items[i][1], items[i][2]) for i in conc}
        here: dict[int, list[int]] = {}
        for i, (env, _, _) in enumerate(items):
            if i not in futs:
                here.setdefault(id(env), []).append(i)
        for idx in here.values():
            env, pairs = items[idx[0]][0], [(items[i][1], items[i][2]) for i in idx]
            try:
                scores = env.verify_many(pairs)
                if len(scores) != len(pairs):
                    raise ValueError(f"verify_many gave {len(scores)} scores for {len(pairs)} responses")
            except Exception:  # noqa: BLE001 - an override that fails: verify one by one (never raises)
                scores = [env.verify(p, r) for p, r in pairs]
            for i, s in zip(idx, scores):
                out[i] = s
        for i, f in futs.items():
            out[i] = f.result()
    return out


def verify_workers(n: int) -> int:
    """Threads for :func:`verify_all` from a config value: ``n`` itself when positive, else (0: auto)
    one per core, at most 8 (each may hold a sandboxed program or a math worker process)."""
    return n if n > 0 else max(1, min(8, os.cpu_count() or 1))


class UnknownEnvironmentError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


_REGISTRY: dict[str, type[Environment]] = {}
_FACTORIES: dict[str, Callable[[], Environment]] = {}
_FACTORY_INFO: dict[str, dict] = {}  # id -> {"family", "description"} given at registration
_ENTRY_POINTS_LOADED = False
ENTRY_POINT_GROUP = "cascade.envs"


def _spec(factory) -> tuple:
    """What a factory builds (a ``functools.partial`` of the same class and arguments is the same factory)."""
    return (getattr(factory, "func", factory), getattr(factory, "args", ()), getattr(factory, "keywords", {}))


def register(env_id: str, *, factory: Callable[[], Environment] | None = None,
             family: str | None = None, description: str | None = None):
    """Class decorator registering an environment under ``env_id``.

    ``register("x", factory=f)`` (not as a decorator) registers a zero-argument factory instead,
    which is how adapters add many environments of one class (e.g. one per dataset). ``family``
    and ``description`` let listings show a factory's environment without building it.
    """
    if factory is not None:
        _load_builtin()  # (mid-import of the built-ins, the partly loaded module: no recursion)
        held = _FACTORIES.get(env_id)
        if env_id in _REGISTRY or (held is not None and _spec(held) != _spec(factory)):
            raise ValueError(f"cannot register factory {factory!r} as {env_id!r}: the id is taken by "
                             f"{_REGISTRY.get(env_id) or held!r}; choose another id")
        _FACTORIES[env_id] = factory
        _FACTORY_INFO[env_id] = {"family": family or "misc", "description": description or ""}
        return factory

    def deco(cls: type[Environment]) -> type[Environment]:
        _load_builtin()  # the built-in ids load lazily: a clash with one shows here, not at the next lookup
        if (env_id in _REGISTRY and _REGISTRY[env_id] is not cls) or env_id in _FACTORIES:
            raise ValueError(f"cannot register {cls.__module__}.{cls.__qualname__} as {env_id!r}: the id is taken by "
                             f"{_REGISTRY.get(env_id) or _FACTORIES[env_id]!r}; choose another id")
        cls.id = env_id
        _REGISTRY[env_id] = cls
        return cls

    return deco


def fixed_hash_seed() -> None:
    """Run this command again with ``PYTHONHASHSEED=0`` when it is unset (then return only in the new process):
    some packages' generators iterate over sets of strings (reasoning-gym's polynomial_multiplication, ransom_note,
    isomorphic_strings, word_ladder), so without it the same (seed, difficulty) gave other problems in another run,
    another worker or after a resume. The worker processes this one starts inherit it. The ``cascade`` and ``ttc``
    commands call it first thing."""
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, list(sys.orig_argv))


PLUGIN_ERRORS: dict[str, str] = {}  # entry-point name -> why its plug-in could not be loaded


def load_entry_points() -> None:
    """Import the modules of installed plug-ins (entry-point group ``cascade.envs``). A plug-in that fails
    (a missing dependency, a name taken) is warned about and left out (``PLUGIN_ERRORS``): the built-in
    environments and the other plug-ins still load (one broken plug-in failed every ``get_env`` of a process
    once, and the plug-ins after it for good)."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    import warnings
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, type) and issubclass(obj, Environment) and obj.id not in _REGISTRY:
                register(ep.name)(obj)
        except Exception as e:  # noqa: BLE001 - a third party's module: anything can fail
            PLUGIN_ERRORS[ep.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"environment plug-in {ep.name!r} ({ep.value}) is left out: {PLUGIN_ERRORS[ep.name]}",
                          stacklevel=2)


def _load_builtin() -> None:
    importlib.import_module("envs.builtin")


def list_envs() -> list[str]:
    _load_builtin()
    load_entry_points()
    return sorted(set(_REGISTRY) | set(_FACTORIES))


def env_info(env_id: str) -> dict:
    """``{"id", "family", "description"}`` of a registered environment, without instantiating it."""
    _load_builtin()
    load_entry_points()
    if env_id in _REGISTRY:
        cls = _REGISTRY[env_id]
        doc = (cls.__doc__ or "").strip().splitlines()
        return {"id": env_id, "family": cls.family,
                "description": cls.description or (doc[0] if doc else "")}
    if env_id in _FACTORIES:
        return {"id": env_id, **_FACTORY_INFO.get(env_id, {"family": "misc", "description": ""})}
    raise UnknownEnvironmentError(f"unknown environment {env_id!r}")


def get_env_class(name: str) -> type[Environment]:
    env = get_env(name)
    return type(env)


def _dotted(name: str):
    """The object a ``pkg.module:attr`` environment name points at."""
    mod, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownEnvironmentError(f"cannot load environment {name!r}: {e}") from None


def check_env_kwargs(name: str, kwargs: dict) -> None:
    """A one-line ``TypeError`` when ``get_env(name, **kwargs)`` would pass a setting the environment does not
    take, naming the ones it does (checked on its constructor's signature: nothing is built)."""
    import inspect

    if ":" in name:
        make = _dotted(name)
    else:
        _load_builtin()
        load_entry_points()
        make = _REGISTRY.get(name) or _FACTORIES.get(name)
        if make is None:
            raise UnknownEnvironmentError(f"unknown environment {name!r}")
    try:
        sig = inspect.signature(make)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    try:
        sig.bind_partial(**kwargs)
    except TypeError:
        takes = [k for k, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        bad = sorted(set(kwargs) - set(takes)) or sorted(kwargs)
        raise TypeError(f"{name} takes no setting {', '.join(bad)}; "
                        + (f"it takes: {', '.join(takes)}" if takes else "it takes none")) from None


def get_env(name: str, **kwargs) -> Environment:
    """An environment instance by registered id or dotted path ``pkg.module:Class``."""
    if ":" in name:
        obj = _dotted(name)
        env = obj(**kwargs) if isinstance(obj, type) else obj
        if not getattr(env, "id", ""):
            env.id = name  # an unregistered class: its problems name it, and its seeds are its own
        return env
    _load_builtin()
    load_entry_points()
    if name in _REGISTRY or name in _FACTORIES:
        env = _REGISTRY[name](**kwargs) if name in _REGISTRY else _FACTORIES[name](**kwargs)
        from envs.caps import apply  # recorded difficulty caps and the generation time bound

        apply(name, env)
        return env
    import difflib

    close = difflib.get_close_matches(name, list(_REGISTRY) + list(_FACTORIES), n=5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `cascade envs list` shows them all"
    raise UnknownEnvironmentError(f"unknown environment {name!r}{hint}")
