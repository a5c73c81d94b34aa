"""Third-party verifiers run apart: in worker processes under a deadline, with ``eval`` made safe.

The adapters' scorers (``rg/`` reasoning-gym, ``rc/`` reasoning-core, ``rlve/`` RLVE-Gym) are other
people's code run on model output. Some never return on an answer like ``10**10**10`` (sympy, or an
``eval`` of it), and some ``eval`` the answer as Python (reasoning-gym's ``string_insertion``,
``spiral_matrix``, ``binary_matrix``, ``n_queens``; several reasoning-core tasks), which would run whatever
a policy writes. An environment with :class:`IsolatedCheck` therefore verifies in a worker process
(:mod:`envs.workers`), in two stages, each with its own deadline:

1. the environment's context for the problem (``check_context``: the adapter's item for the problem's seed
   and level, the package's own code on its own data): made in the calling process, where the item is
   cached from generation, and sent pickled (up to ``SHIP_CONTEXT_BYTES``; else, or when it does not pickle,
   the worker regenerates it), within ``context_timeout`` (it includes the worker's first import of the
   package);
2. the score (``check_with``), within ``verify_time_limit``, where the packages' own calls of the builtin
   ``eval`` get :func:`safe_eval`, which evaluates literals and arithmetic only (no names but data
   constants, never the scorer's own variables, no calls, no attributes, no ``%``-formatting of strings;
   integers of bounded size, and values of bounded weight: elements, characters and digits, an object held in
   several places counted in each, so that no answer of a few characters renders as gigabytes of text; no
   operation that could make a far larger value runs before its size is checked), and the code
   sympy's parser makes of a text (``sympify``, ``parse_expr``: Python, evaluated with every builtin in
   scope) must pass :func:`check_sympy_code` (calls of sympy's mathematics only) before it is evaluated.

A worker that misses a deadline is killed, and the response scores zero (``reason``: the verifier did not
finish); an exception in the scorer is a zero score with the error, as in-process. A worker's private memory is
limited (``WORKER_DATA_BYTES``: ``verify_workers`` of them must not exhaust the host's): a scorer past it gets a
``MemoryError`` (or its process dies: a zero score as well). Where bubblewrap is
installed the workers run confined as well (:func:`confinement`: a read-only filesystem, no network, no
capabilities), in case some other way in remains (a worker serves many answers: code one ran could rewrite
the scorer for the next); without bwrap (or with ``CASCADE_VERIFY_UNCONFINED=1``) they run as this user, with a warning
when bwrap is there but fails. ``isolate = False`` on the class checks in this process instead (for
debugging a scorer).
"""
from __future__ import annotations

import ast
import atexit
import base64
import builtins
import math
import operator
import os
import pickle
import shutil
import sys
import threading
import types
from contextlib import contextmanager
from typing import Any, ClassVar

from envs.base import Problem, Score
from envs.workers import Pool, WorkerStartError, serve

MAX_INT_BITS = 1 << 14     # a safe_eval integer (2**16384 is about 4,900 digits)
MAX_ITEMS = 1 << 17        # the weight of a safe_eval value: its elements, characters and digits (see _weight)
STARTUP_TIMEOUT = 120.0    # a fresh worker imports envs.base
SHIP_CONTEXT_BYTES = 1 << 16  # a larger context is made again in the worker (cached there per problem)
WORKER_DATA_BYTES = 4 << 30   # a worker's private memory (RLIMIT_DATA; a worker checking every adapter uses ~0.5 GB)

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
        ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: operator.is_, ast.IsNot: operator.is_not}
_DATA = (int, float, complex, str, bytes, bool, type(None))
_NAMES = {"True": True, "False": False, "None": None, "nan": math.nan, "inf": math.inf}


def _weight(v: Any) -> int:
    """What rendering ``v`` as text costs: its elements at every depth, its strings' and bytes' characters and its
    integers' digits (``bit_length // 3``), an object held in several places counted in each (``[s] * 9`` weighs
    ``9 * (1 + len(s))``: a scorer's ``str`` of it writes ``s`` 9 times). Counting stops past ``MAX_ITEMS``."""
    total, todo = 0, [v]
    while todo and total <= MAX_ITEMS:
        x = todo.pop()
        if isinstance(x, int):
            total += x.bit_length() // 3
        elif isinstance(x, (str, bytes)):
            total += len(x)
        elif isinstance(x, (list, tuple, set, frozenset, dict)):
            total += len(x)
            if total <= MAX_ITEMS:
                todo.extend(x)
                if isinstance(x, dict):
                    todo.extend(x.values())
    return total


def _size(v: Any, weight: int) -> tuple[Any, int]:
    """``(v, weight)``, refused past the bounds (see :func:`_weight`)."""
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise ValueError(f"safe_eval: an integer of more than {MAX_INT_BITS} bits")
    if weight > MAX_ITEMS:
        raise ValueError(f"safe_eval: a value of more than {MAX_ITEMS} items (elements, characters and digits, "
                         f"each time they appear)")
    return v, weight


def _data(v: Any) -> bool:
    if isinstance(v, _DATA):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_data(x) for x in v)
    return isinstance(v, dict) and all(_data(k) and _data(x) for k, x in v.items())


def _binop(op: type, a: tuple[Any, int], b: tuple[Any, int]) -> tuple[Any, int]:
    """``a op b`` of ``(value, weight)`` pairs; what could grow past the bounds is refused before it runs."""
    (a, wa), (b, wb) = a, b
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0 \
            and b * a.bit_length() > MAX_INT_BITS:
        raise ValueError(f"safe_eval: a power of more than {MAX_INT_BITS} bits")
    if op is ast.LShift and isinstance(b, int) and b > MAX_INT_BITS:
        raise ValueError(f"safe_eval: a shift by more than {MAX_INT_BITS} bits")
    if op is ast.Mod and isinstance(a, (str, bytes)):
        # printf-style formatting: its width and precision ("%*d" % (1 << 34, 7), "%999999999d" % 1)
        # would make the value before its size could be checked
        raise ValueError("safe_eval: %-formatting of a string is not allowed (its size is not bounded)")
    if op is ast.Mult:
        for seq, w, k in ((a, wa, b), (b, wb, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(k, int):
                _size(None, w * k)  # (refused before it is made)
                return seq * k, w * max(k, 0)
    v = _BIN[op](a, b)
    # a sequence, set or dict holds at most both operands' parts (+, |, &, -, ^); a number is weighed itself
    return _size(v, wa + wb if isinstance(v, (str, bytes, list, tuple, set, frozenset, dict)) else _weight(v))


def safe_eval(source: Any, globals: dict | None = None, locals: dict | None = None) -> Any:  # noqa: A002
    """``eval`` of literals and arithmetic only: numbers, strings, lists, tuples, dicts and sets of them, unary, binary
    (``**``, ``<<`` and sequence repetition bounded before they run; ``%``-formatting of a string refused; a value
    of more than ``MAX_ITEMS`` elements, characters and digits in all, a repeated object counted each time, refused:
    see :func:`_weight`), boolean and comparison operators, subscripts, and names that hold data
    (``True``/``False``/``None``/``nan``/``inf``, or data values of the scopes given). Never the caller's scope: a
    scorer's ``eval(answer)`` would resolve an answer naming its local that holds the reference (reasoning-gym's
    ``oracle_answer``, ``entry``) to that reference. Anything else (a call, an attribute, a lambda, a comprehension,
    a code object) is a ``ValueError``."""
    if not isinstance(source, (str, bytes)):
        raise ValueError("safe_eval: only expression strings")
    scopes = [s for s in (locals, globals) if s is not None]
    tree = ast.parse(source.strip() if isinstance(source, str) else source.decode().strip(), mode="eval")

    def ev(n: ast.AST) -> tuple[Any, int]:  # (value, weight)
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return _size(n.value, _weight(n.value))
        if isinstance(n, (ast.List, ast.Tuple, ast.Set)):
            items = [ev(x) for x in n.elts]
            return _size({ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(n)](v for v, _ in items),
                         len(items) + sum(w for _, w in items))
        if isinstance(n, ast.Dict) and None not in n.keys:
            pairs = [(ev(k), ev(v)) for k, v in zip(n.keys, n.values)]
            return _size({k: v for (k, _), (v, _) in pairs}, len(pairs) + sum(wk + wv for (_, wk), (_, wv) in pairs))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _UNARY:
            v = _UNARY[type(n.op)](ev(n.operand)[0])
            return _size(v, _weight(v))
        if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
            return _binop(type(n.op), ev(n.left), ev(n.right))
        if isinstance(n, ast.BoolOp):
            v = ev(n.values[0])
            for x in n.values[1:]:
                if (not v[0]) if isinstance(n.op, ast.And) else v[0]:
                    break
                v = ev(x)
            return v
        if isinstance(n, ast.Compare) and all(type(o) in _CMP for o in n.ops):
            left = ev(n.left)[0]
            for o, c in zip(n.ops, n.comparators):
                right = ev(c)[0]
                if not _CMP[type(o)](left, right):
                    return False, 0
                left = right
            return True, 0
        if isinstance(n, ast.Subscript):
            v = ev(n.value)[0][ev(n.slice)[0]]
            return _size(v, _weight(v))
        if isinstance(n, ast.Slice):
            return slice(*(None if x is None else ev(x)[0] for x in (n.lower, n.upper, n.step))), 0
        if isinstance(n, ast.Name):
            for s in scopes:
                if n.id in s and _data(s[n.id]):
                    return s[n.id], _weight(s[n.id])
            if n.id in _NAMES:
                return _NAMES[n.id], 0
            raise ValueError(f"safe_eval: name {n.id!r} is not a data value")
        raise ValueError(f"safe_eval: {type(n).__name__} is not allowed")

    return ev(tree)[0]


SCORER_PACKAGES = frozenset({"reasoning_gym", "reasoning_core", "Gym"})  # whose eval calls get safe_eval
_REAL_EVAL = builtins.eval
# sympy's parser (``parse_expr``, ``sympify`` of a string) turns the text into Python and evals it with every
# builtin function in scope (``__import__``, ``exec``, ``open``): the code it made from an answer may name only
# mathematics (see :func:`check_sympy_code`)
_SYMPY_OFF_LIMITS = ("sympy.utilities", "sympy.printing", "sympy.plotting", "sympy.interactive", "sympy.parsing",
                     "sympy.external")  # lambdify execs, preview runs LaTeX, init_session execs, ...
_PLAIN_BUILTINS = frozenset({"abs", "min", "max", "round", "pow", "int", "float", "complex", "bool", "range", "len",
                             "sum", "divmod", "True", "False", "None"})
_EXPR_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Name, ast.Constant,
               ast.Tuple, ast.List, ast.Set, ast.Dict, ast.keyword, ast.Subscript, ast.Slice, ast.operator,
               ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context)
_sympy_names: frozenset | None = None


def _mathematics_of_sympy() -> frozenset:
    global _sympy_names
    if _sympy_names is None:
        import sympy

        ok = set()
        for name in sympy.__all__:
            obj = getattr(sympy, name, None)
            where = getattr(obj, "__module__", None) or type(obj).__module__
            if name != "var" and not isinstance(obj, (types.ModuleType, dict, str)) and \
                    str(where).startswith("sympy.") and not str(where).startswith(_SYMPY_OFF_LIMITS):
                ok.add(name)
        _sympy_names = frozenset(ok)
    return _sympy_names


def check_sympy_code(source: Any, local_names=()) -> None:
    """Raise ``ValueError`` unless ``source`` (the Python sympy's parser made of a text) is an expression of
    numbers, strings, operators, subscripts and calls of names (or of their calls' results) that are sympy's
    mathematics (not its printers, code generators, ``lambdify``, plotting or sessions), a few plain builtins
    (``abs``, ``min``, ...), or the caller's own names (``local_names``): no attribute, no dunder, no lambda or comprehension. A code object
    (``parse_expr(..., evaluate=False)`` compiles the expression it made: reasoning-core's scorers parse so) passes
    when every name it uses is such a name and it holds no code of its own (no lambda or comprehension)."""
    allowed = _mathematics_of_sympy()

    def check_name(name: str) -> None:
        if "__" in name or not (name in allowed or name in _PLAIN_BUILTINS or name in local_names):
            raise ValueError(f"sympy eval: {name!r} is not a mathematical name")
    if isinstance(source, types.CodeType):
        if any(isinstance(c, types.CodeType) for c in source.co_consts):
            raise ValueError("sympy eval: a lambda or comprehension is not allowed in an answer")
        for name in source.co_names:
            check_name(name)
        return
    if not isinstance(source, (str, bytes)):
        raise ValueError("sympy eval: only expression strings")
    try:
        tree = ast.parse(source if isinstance(source, str) else source.decode(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"sympy eval: {e.msg}") from None
    for n in ast.walk(tree):
        if not isinstance(n, _EXPR_NODES):
            raise ValueError(f"sympy eval: {type(n).__name__} is not allowed in an answer")
        # a call of a name, or of what a call of one made (``Function('y')(Symbol('x'))``: a problem's ODE, which
        # reasoning-core's inverse_math parses to score an answer; refused, 8 of 20 right answers scored 0)
        if isinstance(n, ast.Call) and not isinstance(n.func, (ast.Name, ast.Call)):
            raise ValueError("sympy eval: only calls of names are allowed in an answer")
        if isinstance(n, ast.Name):
            check_name(n.id)


def _guarded_eval(source: Any, globals: dict | None = None, locals: dict | None = None) -> Any:  # noqa: A002
    """The builtin ``eval`` while a score is computed: :func:`safe_eval` for code of the scorer packages,
    :func:`check_sympy_code` before the real one for sympy's parser, the real one (in the caller's scope, as ``eval``
    without arguments) for everyone else."""
    frame = sys._getframe(1)
    caller = str(frame.f_globals.get("__name__", ""))
    if caller.split(".")[0] in SCORER_PACKAGES:
        return safe_eval(source, globals, locals)
    if caller.startswith("sympy.parsing"):  # (sympy's own evals, while it imports, are its code)
        own = {k for k, v in (locals or {}).items() if not isinstance(v, type(sys))}
        check_sympy_code(source, own)
    if globals is None:
        globals, locals = frame.f_globals, frame.f_locals if locals is None else locals
    return _REAL_EVAL(source, globals, locals)


@contextmanager
def eval_made_safe():
    """The builtin ``eval`` is :func:`_guarded_eval` meanwhile (one thread: the worker's)."""
    builtins.eval = _guarded_eval
    try:
        yield
    finally:
        builtins.eval = _REAL_EVAL


# --------------------------------------------------------------------------------------------
# worker side

_IN_WORKER = False
_ENVS: dict[str, Any] = {}


def _check(request: dict, emit) -> dict:
    from envs.base import get_env

    env = _ENVS.get(request["env"])
    if env is None:
        env = _ENVS[request["env"]] = get_env(request["env"])
    problem = Problem.from_dict(request["problem"])
    shipped = request.get("context")
    ctx = pickle.loads(base64.b64decode(shipped)) if shipped else env.check_context(problem)
    emit("context")
    with eval_made_safe():
        s = env.check_with(problem, request["response"], ctx)
    return {"reward": float(s.reward), "correct": bool(s.correct), "format_ok": bool(s.format_ok), "info": s.info}


def worker_main() -> None:
    """A worker process (:mod:`envs.workers`): ``{"env", "problem", "response"}`` per request; the line
    ``"context"`` once the environment has its context, then the score's fields."""
    global _IN_WORKER
    _IN_WORKER = True
    import logging
    import resource
    import warnings

    # RLIMIT_DATA, not RLIMIT_AS: the address space counts what torch (rlve-gym's scorers import it) and the
    # shared libraries map without using; the data limit counts private writable memory only
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    cap = WORKER_DATA_BYTES if soft == resource.RLIM_INFINITY else min(soft, WORKER_DATA_BYTES)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    serve(_check)


# --------------------------------------------------------------------------------------------
# caller side

def confinement() -> list[str]:
    """bubblewrap around a worker, when installed: the whole filesystem read-only (``TMPDIR`` a private
    tmpfs), no network, its own process, IPC, UTS, cgroup and session namespaces, no capabilities (as root it
    could remount ``/`` read-write otherwise), killed with its parent."""
    bwrap = shutil.which("bwrap")
    if not bwrap or os.environ.get("CASCADE_VERIFY_UNCONFINED"):
        return []
    return [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net", "--unshare-ipc",
            "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--setenv", "TMPDIR", "/dev/shm", "--"]


_POOL = Pool("envs.isolated", STARTUP_TIMEOUT, wrap=confinement)
atexit.register(_POOL.close)


class IsolatedCheck:
    """Mixin for an :class:`envs.base.Environment` whose scorer is someone else's code: ``check`` runs in a
    worker process (see the module docstring). Implement ``check_context(problem)`` (what scoring needs, from
    trusted code: made here, one call at a time, and sent along, or made in the worker) and
    ``check_with(problem, response, context)`` (run in the worker); the environment must be one
    :func:`envs.base.get_env` builds from its ``id`` alone. A ``precheck(problem, response)`` method, where the
    class has one, may give the score here without the worker (a response without an answer)."""

    concurrent_verify: ClassVar[bool] = True  # check waits on a worker process; each calling thread has its own
    isolate: ClassVar[bool] = True
    context_timeout: ClassVar[float] = 120.0

    def check_context(self, problem: Problem) -> Any:
        return None

    def check_with(self, problem: Problem, response: str, context: Any) -> Score:
        raise NotImplementedError

    def _shipped_context(self, problem: Problem) -> str | None:
        """The context made here (where the problem was generated, its item cached: regenerating it in the worker
        cost a slow generator its time again, 0.23 s a verify for rg/countdown), pickled for the worker; None when
        it cannot be (a lambda in it) or is larger than ``SHIP_CONTEXT_BYTES``: the worker makes it then."""
        # verify_all calls this from several threads; an adapter's item cache is not made for that
        lock = self.__dict__.setdefault("_context_lock", threading.Lock())
        try:
            with lock:
                raw = pickle.dumps(self.check_context(problem))
        except Exception:  # noqa: BLE001 - unpicklable, or it fails here: the worker tries (and reports)
            return None
        return base64.b64encode(raw).decode() if len(raw) <= SHIP_CONTEXT_BYTES else None

    def check(self, problem: Problem, response: str) -> Score:
        if not self.isolate or _IN_WORKER:
            return self.check_with(problem, response, self.check_context(problem))
        precheck = getattr(self, "precheck", None)  # (e.g. no answer to score: no worker needed)
        early = precheck(problem, response) if precheck is not None else None
        if early is not None:
            return early
        limit = float(getattr(self, "verify_time_limit", 10.0))
        try:
            got = _POOL.call({"env": self.id, "problem": problem.to_dict(), "response": response,
                              "context": self._shipped_context(problem)}, [self.context_timeout, limit])
        except WorkerStartError as e:
            raise RuntimeError(str(e)) from None
        if got is None:
            if _POOL.failure() == "died":  # a crash, the memory limit: not a deadline
                return Score.zero("the verifier's process died (a crash or the memory limit)")
            return Score.zero("the verifier did not finish in time and was stopped",
                              limits_s=[self.context_timeout, limit])
        last = got[-1]
        if not isinstance(last, dict) or "error" in last:
            raise RuntimeError(last["error"] if isinstance(last, dict) else f"the verifier answered {last!r}")
        return Score(last["reward"], last["correct"], last["format_ok"], dict(last.get("info") or {}))
