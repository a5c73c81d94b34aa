"""The code environments of ZAYA1 stage 3, built from competitive-programming seeds.

- ``code/solve``: write a program; judged on the problem's tests (reward: all-or-nothing by
  default, or with ``reward="fraction"`` the fraction passed of the hidden tests, those the prompt
  does not show as examples; correct = every test passes, the shown ones included).
- ``code/io_predict`` (CodeI/O): predict the exact output of the reference program on an input.
- ``code/io_propose`` (CodeI/O, inverse): propose an input on which the reference program prints
  a given output; checked by the input validator and by running the reference.
- ``code/arc`` (CodeARC): the statement is hidden; infer the program from the input format and a
  few examples; judged on held-out tests only.
- ``code/falsify``: find a valid input on which a given wrong program's output differs from the
  reference's; checked by the validator and by running both.

Answers: programs in a fenced code block; its fence names the language: ```python (also ```py,
```python3) is judged as Python 3, ```cpp (also ```c++, ```cxx, ```cc) as C++17, compiled by g++
inside the sandbox (a compile error scores 0). ``language=`` picks what the prompts of
``code/solve`` and ``code/arc`` ask for (``"python"``, the default; ``"cpp"``; ``"any"``: either),
and ``languages=`` which fences are accepted (both by default; it must accept the language asked for,
and with ``"any"`` both). The last block in the prompt's
language is graded (with ``"any"``, or when there is none, the last accepted block); problems carry
``meta["language"]`` and the score's info the language judged. The seeds' reference programs are
Python: with ``language="cpp"`` there is no reference answer in the prompt's language
(``no_reference_reason``). Inputs and outputs inside
``\\boxed{...}`` (line breaks kept; whitespace is not graded). Every program runs in the sandbox
(:mod:`envs.code.sandbox`), which refuses to run without its isolation layers unless the config
allows a weaker one.

Seeds: the built-in set (:mod:`envs.code.seeds`) plus any JSONL file of the same schema
(``get_env("code/solve", seeds_path="more.jsonl")``; ``include_builtin=False`` to use only the
file). ``generate(seed, difficulty)`` picks deterministically among the training seeds of tier
``clamp(difficulty, 1, 3)``; for the I/O tasks a higher difficulty also picks larger inputs.

Held out: ``heldout`` (default 0.2) of the seeds of each tier, chosen by a hash of the seed id (with
:func:`envs.hub.split_heldout`, so at least one of a tier of two or more; the built-in seeds, the
``seeds=`` list and the ``seeds_path`` file are split each on its own, so a seed is on the same side
in all five environments whatever else they load), are :meth:`CodeEnv.heldout`'s only: ``generate``
(training, SFT reference traces) never draws them, so no training prompt shows their statement,
reference program, tests or wrong programs. ``heldout=0`` turns the split off (``heldout()`` then
raises).
"""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from envs.base import Environment, Problem, Score, register, strip_think
from envs.code.judge import Judge, compare_output
from envs.code.sandbox import LANGUAGES, SandboxConfig, default_sandbox
from envs.code.seeds import MAX_SEED_DIFFICULTY, Seed, builtin_seeds, load_seeds

__all__ = ["CodeEnv", "SolveEnv", "IOPredictEnv", "IOProposeEnv", "ARCEnv", "FalsifyEnv", "extract_code",
           "extract_program", "FENCE_LANGUAGES"]

# a fenced block opens with a run of three or more backticks and an info string whose first word names the
# language: at the start of a line (after an indent, a quote's ``>`` or a list item's marker), with any info
# string (```python title=sol.py, ```Python 3) or none (a block that is not graded); after other text on the
# line only as ```LANG ending it, LANG one of FENCE_LANGUAGES. It closes with a line that is only a run of at
# least as many backticks (CommonMark; so ``` inside a string literal does not end it) or a code line that
# ends in exactly that many; the opening line's indent (a list item's content column, a quote's ``>``) comes
# off the code's lines; Windows line ends are taken
_INFO = re.compile(r"[ \t]*(\S*)(.*)")
_INDENT = re.compile(r"[ \t>]*")
_LIST_ITEM = re.compile(r"[ \t>]*(?:[-*+]|\d{1,9}[.)])[ \t]+")
FENCE_LANGUAGES = {"python": "python", "python3": "python", "py": "python",
                   "cpp": "cpp", "c++": "cpp", "cxx": "cpp", "cc": "cpp"}
CODE_INSTRUCTION = ("Write a complete Python 3 program (standard library only) that reads standard input and "
                    "writes standard output. Put the program in a ```python fenced code block; the last "
                    "such block in your answer is graded.")
CODE_INSTRUCTIONS = {
    "python": CODE_INSTRUCTION,
    "cpp": ("Write a complete C++17 program (standard library only) that reads standard input and writes "
            "standard output. Put the program in a ```cpp fenced code block; the last such block in your "
            "answer is graded."),
    "any": ("Write a complete program in Python 3 or C++17 (standard library only) that reads standard input "
            "and writes standard output. Put it in a ```python or a ```cpp fenced code block; the last such "
            "block in your answer is graded, in the language its fence names."),
}
MAX_ANSWER_CHARS = 20000   # proposed inputs longer than this are rejected unrun
SHOWN_CHARS = 400          # tests longer than this are never shown in a prompt
# the held-out split's hash salt, the same in every code environment (fixed; chosen among code-seeds-0..39 as one
# that holds out near 20% of every tier of the built-in seeds: 3 of 16, 2 of 9, 2 of 8)
HELDOUT_SALT = "code-seeds-20"


def extract_program(text: str, languages=LANGUAGES) -> tuple[str, str] | None:
    """``(language, code)`` of the last fenced program after any thinking whose fence names one of
    ``languages`` (```python/```py/```python3 -> python, ```cpp/```c++/```cxx/```cc -> cpp), or None."""
    if not isinstance(text, str):
        return None
    for lang, code in reversed(fenced_blocks(strip_think(text))):
        lang = FENCE_LANGUAGES.get(lang.lower())
        if lang in languages:
            return lang, code
    return None


def _opening(line: str) -> tuple[str, int, str, bool, int] | None:
    """``(info, fence length, indent, at line start, list marker's width)`` when ``line`` opens a fenced block,
    else None (the fence: the line's last run of three or more backticks, with none after it; linear in the
    line's length)."""
    end = line.rfind("```")
    if end < 0:
        return None
    start, stop = end, end + 3
    while start and line[start - 1] == "`":
        start -= 1
    while stop < len(line) and line[stop] == "`":
        stop += 1
    if "`" in line[stop:]:
        return None
    m = _INFO.fullmatch(line, stop)
    head, info, rest = line[:start], m[1], m[2].strip()
    if _INDENT.fullmatch(head):
        return info, stop - start, head, True, 0
    if _LIST_ITEM.fullmatch(head):  # "1. ```python": the code is indented to the item's content column (or less)
        lead = _INDENT.match(head)[0]
        return info, stop - start, lead, True, len(head) - len(lead)
    if info.lower() in FENCE_LANGUAGES and not rest:
        return info, stop - start, "", False, 0
    return None


def _block_code(lines: list[str], indent: str, width: int) -> str:
    """The code of a block's lines: the opening line's indent off each; in a list item, also the item's content
    indent (its marker's width), or the common indent of the code's lines where that is less."""
    lines = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip(" \t>") for ln in lines]
    if width:
        width = min([width] + [len(ln) - len(ln.lstrip(" ")) for ln in lines if ln.strip()])
        lines = [ln[width:] for ln in lines]
    return "".join(ln + "\n" for ln in lines)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string's first word, code)`` of every closed fenced block of ``text``, in order, in one pass
    over its lines (time linear in the text's length, whatever it holds)."""
    out: list[tuple[str, str]] = []
    info, fence, indent, at_start, width, blank, lines = None, 3, "", True, 0, True, []
    for line in text.split("\n"):
        line = line[:-1] if line.endswith("\r") else line
        if info is None:
            got = _opening(line)
            if got:
                (info, fence, indent, at_start, width), blank, lines = got, True, []
            continue
        if not at_start and blank:
            # "put it in a ```python" (prose), then the block itself on a line of its own: that one opens it
            got = _opening(line)
            if got and got[3] and got[0]:
                (info, fence, indent, at_start, width), blank, lines = got, True, []
                continue
            blank = not line.strip()
        body = line.rstrip(" \t")
        head = body.rstrip("`")
        run = len(body) - len(head)
        if run == fence or (run > fence and _INDENT.fullmatch(head)):
            if head and not _INDENT.fullmatch(head):  # code, then the closing fence on its line
                lines.append(head)
            out.append((info, _block_code(lines, indent, width)))
            info = None
        else:
            lines.append(line)
    return out


def extract_code(text: str) -> str | None:
    """The last ```python fenced block after any thinking, or None (Python only: see
    :func:`extract_program` for the language-aware form)."""
    got = extract_program(text, ("python",))
    return got[1] if got else None


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def trusted_limit(s: Seed) -> float:
    """Time limit for trusted programs (reference, validator, and the candidate in falsify)."""
    return max(10.0, 4 * s.time_limit)


def _as_input(text: str) -> str:
    return text.strip("\n") + "\n"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_TEXT_WRAP = re.compile(r"\\(?:text|texttt|textrm|textsf|textbf|mathrm|mathtt|mathsf|mathbf)[ \t]*\{(.*)\}", re.DOTALL)


def unwrap_text(answer: str) -> str:
    """``answer`` without the LaTeX text commands wrapped around the whole of it (``\\text{YES}`` -> ``YES``,
    ``\\texttt{\\text{7}}`` -> ``7``; at most three deep)."""
    for _ in range(3):
        m = _TEXT_WRAP.fullmatch(answer.strip())
        if not m:
            break
        depth = 0
        for c in m[1]:
            depth += (c == "{") - (c == "}")
            if depth < 0:  # "\text{A} \text{B}": the braces of two commands, not one around it all
                return answer
        if depth:
            return answer
        answer = m[1]
    return answer


def split_seeds(groups: list[list[Seed]], fraction: float) -> set[str]:
    """Ids of the held-out seeds: ``fraction`` of each tier of each group, by :func:`envs.hub.split_heldout` of
    the seed ids under :data:`HELDOUT_SALT` (so at least one of a tier of two or more, and never all of it);
    the lone seed of a tier trains."""
    from envs.hub import split_heldout

    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"heldout must be in [0, 1), not {fraction!r}")
    held: set[str] = set()
    for group in groups:
        tiers: dict[int, list[str]] = {}
        for s in group:
            tiers.setdefault(s.difficulty, []).append(s.id)
        for tier, ids in sorted(tiers.items()):
            if fraction == 0 or len(ids) < 2:
                continue
            try:
                _train, out = split_heldout(ids, fraction, HELDOUT_SALT)
            except ValueError as e:
                raise ValueError(f"code seeds of difficulty {tier}: {e}") from None
            held |= {ids[i] for i in out}
    return held


class CodeEnv(Environment):
    """Shared machinery: seeds, deterministic picking, the judge. Subclasses set the task."""

    family = "code"
    max_difficulty = 3
    verify_time_limit = 60.0
    concurrent_verify = True  # the judge waits on a sandbox start; `_failing` is locked
    instruction = ""
    writes_program: ClassVar[bool] = False  # the answer is a program (graded in the sandbox), not \boxed{}
    reads_failing_tests: ClassVar[bool] = False  # _generate uses failing_tests(): prepare() runs the wrong programs

    def __init__(self, seeds_path: str | None = None, *, include_builtin: bool = True,
                 seeds: list[Seed] | None = None, sandbox: SandboxConfig | None = None,
                 reward: str = "binary", language: str = "python",
                 languages: tuple[str, ...] | list[str] = LANGUAGES, heldout: float = 0.2):
        if reward not in ("binary", "fraction"):
            raise ValueError(f"reward must be 'binary' or 'fraction', not {reward!r}")
        if language not in CODE_INSTRUCTIONS:
            raise ValueError(f"language must be one of {', '.join(CODE_INSTRUCTIONS)}, not {language!r}")
        bad = [x for x in languages if x not in LANGUAGES]
        if bad or not languages:
            raise ValueError(f"languages must be a non-empty subset of {LANGUAGES}, not {languages!r}")
        if language != "any" and language not in languages:
            raise ValueError(f"the prompts ask for {language!r}, which languages={tuple(languages)} refuses")
        if language == "any" and set(languages) != set(LANGUAGES):  # the prompt offers every language
            only = dict.fromkeys(languages)
            raise ValueError(f"language='any' asks for any of {LANGUAGES}, but languages={tuple(languages)} accepts "
                             f"only {' or '.join(map(repr, only))}: pass "
                             f"{' or '.join(f'language={x!r}' for x in only)} instead")
        self.language = language
        self.languages = tuple(languages)
        if self.writes_program and language == "cpp":
            self.no_reference_reason = ("the seeds' reference programs are Python and the prompts ask for C++: "
                                        "no reference answer in the prompt's language")
        groups: list[list[Seed]] = []
        if include_builtin or (not seeds_path and not seeds):
            groups.append(builtin_seeds())
        if seeds:
            groups.append(list(seeds))
        if seeds_path:
            groups.append(load_seeds(seeds_path))
        pool = [s for g in groups for s in g]
        ids = [s.id for s in pool]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate seed id(s) {dup} (a loaded seed clashes with a built-in one?)")
        bad = sorted(s.id for s in pool if not 1 <= s.difficulty <= MAX_SEED_DIFFICULTY)
        if bad:
            raise ValueError(f"seed(s) {bad}: difficulty outside 1-{MAX_SEED_DIFFICULTY}, the tiers the code "
                             f"environments draw from (such a seed would never be drawn)")
        self.seeds = sorted(pool, key=lambda s: s.id)
        self.by_id = {s.id: s for s in self.seeds}
        self.heldout_fraction = float(heldout)
        held = split_seeds(groups, self.heldout_fraction)
        self.train_seeds = [s for s in self.seeds if s.id not in held]
        self.heldout_seeds = [s for s in self.seeds if s.id in held]
        self.sandbox_config = sandbox or SandboxConfig(time_limit=2.0, memory_mb=512)
        self.reward_mode = reward
        self._judge: Judge | None = None
        self._lock = threading.Lock()
        self._failing: dict[tuple[str, int], list[int]] = {}

    # -- problems: training and held out ------------------------------------------------------
    def generate(self, seed: int, difficulty: int) -> Problem:
        """A training problem: from the training seeds only."""
        return self._generate(seed, difficulty, False)

    def heldout(self, seed: int, difficulty: int) -> Problem:
        """A held-out problem: from the held-out seeds only (never a seed :meth:`generate` draws)."""
        if not self.heldout_seeds:
            raise ValueError(f"{self.id}: no held-out seed problems (heldout={self.heldout_fraction:g}, or no tier "
                             f"of two or more seeds); set env_kwargs.{self.id}.heldout > 0 to evaluate on it")
        p = self._generate(seed, difficulty, True)
        p.meta["heldout"] = True
        return p

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        """The task's problem of ``(seed, difficulty)`` from the held-out seeds (``held``) or the training ones."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Fail early, with the sandbox's own message, where the sandbox cannot run (no bubblewrap, say, and no
        weaker sandbox allowed): every answer of these tasks is judged by running a program. Then, for a task that
        ``reads_failing_tests`` in ``_generate``, which tests each seed's wrong programs fail."""
        if not getattr(self, "_sandbox_checked", False):
            self.judge.sandbox.check()
            self._sandbox_checked = True
        if self.reads_failing_tests:
            self._prepare_failing()

    # -- shared helpers -----------------------------------------------------------------------
    @property
    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = Judge(default_sandbox(self.sandbox_config))
        return self._judge

    def tier(self, difficulty: int) -> int:
        top = max(s.difficulty for s in self.seeds)
        return min(max(int(difficulty), 1), top)

    def pick(self, seed: int, difficulty: int, usable=None, held: bool = False) -> tuple[Seed, Any]:
        """A seed of tier ``difficulty`` (else of a lower tier, else any) among the held-out seeds (``held``) or
        the training ones, that ``usable`` accepts; and the problem's random generator."""
        rng = self.rng(seed, difficulty)
        side = self.heldout_seeds if held else self.train_seeds
        cands = [s for s in side if usable is None or usable(s)]
        if not cands:
            raise ValueError(f"{self.id}: no {'held-out' if held else 'training'} seed problem is usable for "
                             f"this task")
        t = self.tier(difficulty)
        pool = [s for s in cands if s.difficulty == t] or [s for s in cands if s.difficulty <= t] or cands
        return rng.choice(pool), rng

    def seed_of(self, problem: Problem) -> Seed:
        sid = problem.meta.get("seed_id")
        if sid not in self.by_id:
            raise KeyError(f"problem refers to seed {sid!r}, which this environment does not hold")
        return self.by_id[sid]

    boxes_tests: ClassVar[bool] = False  # the answer is a test's input or output, given within \boxed{}

    def shown_tests(self, seed: Seed) -> list[int]:
        """Indices of tests small enough to show in a prompt or to ask about (where a test's text is the answer
        within ``\\boxed{}``, only those without braces, and not blank: an empty ``\\boxed{}`` is no answer)."""
        return [i for i, t in enumerate(seed.tests)
                if len(t["input"]) <= SHOWN_CHARS and len(t["output"]) <= SHOWN_CHARS
                and not (self.boxes_tests and (any(c in t["output"] + t["input"] for c in "{}")
                                               or not t["output"].strip() or not t["input"].strip()))]

    def statement(self, s: Seed, examples: list[int]) -> str:
        parts = [f"# {s.title}", s.statement]
        if s.input_spec:
            parts.append(f"Input: {s.input_spec}")
        if s.output_spec:
            parts.append(f"Output: {s.output_spec}")
        for k, i in enumerate(examples, 1):
            parts.append(f"Example {k} input:\n{_fence(s.tests[i]['input'])}\nExample {k} output:\n"
                         f"{_fence(s.tests[i]['output'])}")
        return "\n\n".join(parts)

    @property
    def code_instruction(self) -> str:
        return CODE_INSTRUCTIONS[self.language]

    @property
    def aggregation_template(self):
        """Program-writing tasks aggregate into a program in the task's language; the others (predicting an
        output, proposing an input) answer within ``\\boxed{}`` as math does."""
        if not self.writes_program:
            return "math"
        from ttc.templates import code_template

        return code_template(self.language)

    def extract_program(self, response: str) -> tuple[str, str] | None:
        """The program graded: the last block in the prompt's language (as the prompt says), or where the prompt
        names none (``language="any"``) or the response has none, the last block of an accepted language."""
        if self.language != "any":
            got = extract_program(response, (self.language,))
            if got is not None:
                return got
        return extract_program(response, self.languages)

    def _grade_program(self, program: tuple[str, str] | None, s: Seed, test_ids: list[int],
                       scored: list[int] | None = None) -> Score:
        """Judge ``program`` on ``s``'s tests ``test_ids``: correct when it passes them all; the fraction reward
        counts only those of them in ``scored`` (default: all)."""
        if program is None:
            return Score.zero("no " + " or ".join(f"```{x}" for x in self.languages) + " code block")
        language, code = program
        tests = [s.tests[i] for i in test_ids]
        binary = self.reward_mode == "binary"
        judge = self.judge
        if s.float_tol != judge.float_tol:
            judge = Judge(judge.sandbox, float_tol=s.float_tol)
        j = judge.judge(code, tests, stop_on_failure=binary, time_limit=s.time_limit,
                        total_timeout=self.verify_time_limit * 0.8, language=language)
        ok = j.accepted
        if ok or binary:
            reward = 1.0 if ok else 0.0
        else:
            keep = set(test_ids if scored is None else scored)
            counted = [r for r, i in zip(j.results, test_ids) if i in keep]
            reward = sum(r.passed for r in counted) / len(counted) if counted else 0.0
        info = {"status": j.status, "passed": j.passed, "total": j.total, "language": language,
                "statuses": [r.status for r in j.results]}
        if j.status == "compile_error":
            info["compile_error"] = next((r.detail for r in j.results if r.status == "compile_error"), "")[:500]
        return Score(reward, ok, True, info)

    def failing_tests(self, s: Seed, wi: int) -> list[int]:
        """Indices of the tests that wrong program ``wi`` of ``s`` fails (run once, then cached). Under the
        trusted programs' generous limit: a test it passes in time on an idle machine must not count as failed
        on a busy one (the problems built from these sets would differ from process to process)."""
        key = (s.id, wi)
        with self._lock:
            if key in self._failing:
                return self._failing[key]
        j = self.judge.judge(s.wrong[wi], s.tests, time_limit=trusted_limit(s))
        bad = [r.index for r in j.results if not r.passed]
        with self._lock:
            self._failing[key] = bad
        return bad

    def _prepare_failing(self) -> None:
        """Fill :meth:`failing_tests`' cache for every seed's every wrong program, four at a time: a wrong program
        that runs out of time costs the trusted limit (10 s and more), one-time work that belongs in
        :meth:`prepare`, not in the first ``generate`` (it would be taken for a slow generator and capped)."""
        keys = [(s, wi) for s in self.seeds for wi in range(len(s.wrong))]
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda k: self.failing_tests(*k), keys))

    def _run_reference_on(self, s: Seed, text: str, program: str | None = None):
        # trusted programs get a generous limit: a slow machine must not fail the reference
        return self.judge.sandbox.run(program or s.reference, _as_input(text), time_limit=trusted_limit(s))

    def _input_valid(self, s: Seed, text: str) -> tuple[bool, str]:
        if len(text) > MAX_ANSWER_CHARS:
            return False, f"input longer than {MAX_ANSWER_CHARS} characters"
        if s.validator is None:
            return True, ""
        v = self.judge.sandbox.run(s.validator, _as_input(text), time_limit=trusted_limit(s))
        return v.status == "ok", ("" if v.status == "ok" else f"input rejected by the validator ({v.status}: {v.stderr.strip()[-120:]})")


# ------------------------------------------------------------------------------------------------
@register("code/solve")
class SolveEnv(CodeEnv):
    """Write a program for a competitive-programming problem; judged on its tests."""

    description = "write a program, judged on hidden tests (sandboxed)"
    writes_program = True

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        s, _rng = self.pick(seed, difficulty, held=held)
        shown = self.shown_tests(s)[:2]
        prompt = (f"{self.statement(s, shown)}\n\nTime limit: {s.time_limit:g} s per test. "
                  f"Your program is judged on hidden tests.\n\n{self.code_instruction}")
        return self.problem(prompt, s.reference, seed, difficulty, seed_id=s.id, shown=shown,
                            language=self.language)

    def check(self, problem: Problem, response: str) -> Score:
        s = self.seed_of(problem)
        # correct: every test passes, the examples shown included; the fraction reward counts only the hidden
        # tests, as the prompt says (a table of the examples' outputs earns nothing)
        shown = set(problem.meta.get("shown", self.shown_tests(s)[:2]))
        hidden = [i for i in range(len(s.tests)) if i not in shown] or None
        return self._grade_program(self.extract_program(response), s, list(range(len(s.tests))), hidden)

    def reference_response(self, problem: Problem) -> str:
        return f"Here is my solution.\n\n{_fence(problem.answer, 'python')}\n"

    def corruptions(self, problem: Problem) -> list[str]:
        s = self.seed_of(problem)
        out = [f"Solution:\n{_fence(w, 'python')}" for w in s.wrong]
        out.append(_fence("def solve(:\n    pass", "python"))                     # syntax error
        out.append(f"My solution (forgot the fence):\n{problem.answer}")          # no code block
        out.append(f"{_fence(problem.answer, 'python')}\nActually, final version:\n{_fence('print(0)', 'python')}")
        if problem.seed % 3 == 0:                                                 # costs a time limit
            out.append(_fence("while True:\n    pass", "python"))
        if "cpp" in self.languages and problem.seed % 3 == 0:                     # does not compile
            out.append(_fence("int main() { return undeclared; }", "cpp"))
        return out


# ------------------------------------------------------------------------------------------------
class _IOTask(CodeEnv):
    boxes_tests = True

    def pick_test(self, s: Seed, rng, difficulty: int) -> int:
        shown = sorted(self.shown_tests(s), key=lambda i: (len(s.tests[i]["input"]), i))
        # higher difficulty: the larger inputs of the seed
        lo = min(len(shown) - 1, (len(shown) * (self.tier(difficulty) - 1)) // 3)
        return shown[rng.randrange(lo, len(shown))]

    def usable(self, s: Seed) -> bool:
        return bool(self.shown_tests(s))


@register("code/io_predict")
class IOPredictEnv(_IOTask):
    """CodeI/O: predict what a program prints for a given input."""

    description = "predict a program's exact output on an input"

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        s, rng = self.pick(seed, difficulty, self.usable, held)
        i = self.pick_test(s, rng, difficulty)
        t = s.tests[i]
        prompt = (f"What does this Python program print when it is given the input below?\n\n"
                  f"{_fence(s.reference, 'python')}\n\nInput:\n{_fence(t['input'])}\n\n"
                  "Reason it through, then give the complete output within \\boxed{}, line breaks as "
                  "the program prints them (spacing is not graded).")
        return self.problem(prompt, t["output"], seed, difficulty, seed_id=s.id, test=i)

    def check(self, problem: Problem, response: str) -> Score:
        got = self.extract(response)
        if got is None:
            return Score.zero("no \\boxed{} answer")
        tol = self.seed_of(problem).float_tol
        ok = compare_output(got, problem.answer, tol) or compare_output(unwrap_text(got), problem.answer, tol)
        return Score(1.0 if ok else 0.0, ok, True)

    def reference_response(self, problem: Problem) -> str:
        return f"The program prints\n\\boxed{{{problem.answer}}}"

    def corruptions(self, problem: Problem) -> list[str]:
        s = self.seed_of(problem)
        others = {s.tests[i]["output"] for i in self.shown_tests(s)} - {problem.answer}
        out = ["", "\\boxed{}", f"\\boxed{{{problem.answer} 0}}"]
        out += [f"\\boxed{{{o}}}" for o in sorted(others)[:1] if not compare_output(o, problem.answer)]
        return out


@register("code/io_propose")
class IOProposeEnv(_IOTask):
    """CodeI/O inverse: propose an input on which a program prints a given output."""

    description = "propose an input that makes a program print a given output"

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        s, rng = self.pick(seed, difficulty, self.usable, held)
        i = self.pick_test(s, rng, difficulty)
        t = s.tests[i]
        spec = f"\n\nThe input must follow this format: {s.input_spec}" if s.input_spec else ""
        prompt = (f"Here is a Python program:\n\n{_fence(s.reference, 'python')}{spec}\n\n"
                  f"Find an input on which the program prints exactly:\n{_fence(t['output'])}\n\n"
                  "Give the complete input within \\boxed{}, with its line breaks (it is fed to the "
                  "program's standard input).")
        return self.problem(prompt, t["input"], seed, difficulty, seed_id=s.id, test=i,
                            target=t["output"])

    def check(self, problem: Problem, response: str) -> Score:
        got = self.extract(response)
        if got is None:
            return Score.zero("no \\boxed{} answer")
        s = self.seed_of(problem)
        ok, why = self._input_valid(s, got)
        if not ok:
            return Score.zero(why, format_ok=True)
        v = self._run_reference_on(s, got)
        if v.status != "ok":
            return Score.zero(f"the program fails on this input ({v.status})", format_ok=True)
        hit = compare_output(v.stdout, problem.meta["target"], s.float_tol)
        return Score(1.0 if hit else 0.0, hit, True, {"printed": v.stdout[:200]})

    def reference_response(self, problem: Problem) -> str:
        return f"This input works:\n\\boxed{{{problem.answer.rstrip()}}}"

    def corruptions(self, problem: Problem) -> list[str]:
        s = self.seed_of(problem)
        target = problem.meta["target"]
        other = [s.tests[i]["input"] for i in self.shown_tests(s)
                 if not compare_output(s.tests[i]["output"], target)]
        out = ["no idea", "\\boxed{ }", "\\boxed{???\n!!!}"]
        out += [f"\\boxed{{{o.rstrip()}}}" for o in other[:1]]
        return out


# ------------------------------------------------------------------------------------------------
@register("code/arc")
class ARCEnv(CodeEnv):
    """CodeARC: infer a program from the input format and examples; judged on held-out tests."""

    description = "write a program from an input spec and examples, judged on held-out tests"
    writes_program = True
    reads_failing_tests = True

    def usable(self, s: Seed) -> bool:
        return len(s.tests) >= 2 and len(self.shown_tests(s)) >= 1

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        s, rng = self.pick(seed, difficulty, self.usable, held)
        # held out: at least one test that each known wrong program fails (the smallest such)
        must = set()
        for wi in range(len(s.wrong)):
            bad = self.failing_tests(s, wi)
            if bad:
                must.add(min(bad, key=lambda i: (len(s.tests[i]["input"]), i)))
        shown_ok = [i for i in self.shown_tests(s) if i not in must] or self.shown_tests(s)[:1]
        # easier: more examples, but never more than half the tests: at least half are held out
        n_show = max(1, min(len(shown_ok), len(s.tests) // 2, 5 - self.tier(difficulty)))
        order = list(shown_ok)
        rng.shuffle(order)
        # and the held-out outputs are not all the same where the seed's are not (no constant program passes)
        need = min(2, len({_words(t["output"]) for t in s.tests}))
        shown: list[int] = []
        for i in order:
            if len(shown) == n_show:
                break
            rest = {_words(t["output"]) for j, t in enumerate(s.tests) if j != i and j not in shown}
            if len(rest) >= need:
                shown.append(i)
        shown = sorted(shown or order[:1])
        held_out = [i for i in range(len(s.tests)) if i not in shown]
        ex = "\n\n".join(f"Example {k} input:\n{_fence(s.tests[i]['input'])}\nExample {k} output:\n"
                         f"{_fence(s.tests[i]['output'])}" for k, i in enumerate(shown, 1))
        spec = f"Input format: {s.input_spec}\n\n" if s.input_spec else ""
        prompt = ("A hidden program transforms its standard input into its standard output. Work out what it "
                  f"computes from the examples, then write a program that does the same.\n\n{spec}{ex}\n\n"
                  f"Your program is judged on other, unseen inputs of the same format (time limit "
                  f"{s.time_limit:g} s each).\n\n{self.code_instruction}")
        return self.problem(prompt, s.reference, seed, difficulty, seed_id=s.id, shown=shown, held_out=held_out,
                            language=self.language)

    def check(self, problem: Problem, response: str) -> Score:
        s = self.seed_of(problem)
        return self._grade_program(self.extract_program(response), s, list(problem.meta["held_out"]))

    def reference_response(self, problem: Problem) -> str:
        return _fence(problem.answer, "python")

    def corruptions(self, problem: Problem) -> list[str]:
        s = self.seed_of(problem)
        # printing the shown examples' outputs back does not generalise
        shown = problem.meta["shown"]
        table = {s.tests[i]["input"]: s.tests[i]["output"] for i in shown}
        memo = f"import sys\nT = {table!r}\nprint(T.get(sys.stdin.read(), ''))\n"
        return [_fence(w, "python") for w in s.wrong] + [_fence(memo, "python"), "print(1)"]


# ------------------------------------------------------------------------------------------------
@register("code/falsify")
class FalsifyEnv(CodeEnv):
    """Find a valid input on which a candidate program is wrong."""

    description = "find a valid input on which a wrong program's output differs from the reference"
    reads_failing_tests = True

    def _examples(self, s: Seed, wi: int) -> tuple[str | None, str | None]:
        """(the smallest input the wrong program fails on, the smallest it gets right)."""
        bad = set(self.failing_tests(s, wi))
        order = sorted((i for i in range(len(s.tests)) if len(s.tests[i]["input"]) <= MAX_ANSWER_CHARS),
                       key=lambda i: (len(s.tests[i]["input"]), i))
        first_bad = next((s.tests[i]["input"] for i in order if i in bad), None)
        first_good = next((s.tests[i]["input"] for i in order if i not in bad), None)
        return first_bad, first_good

    def _generate(self, seed: int, difficulty: int, held: bool) -> Problem:
        s, rng = self.pick(seed, difficulty, held=held)
        wi = rng.randrange(len(s.wrong))
        bad, _good = self._examples(s, wi)
        if bad is None:
            raise ValueError(f"seed {s.id!r}: wrong program {wi} passes every test; it cannot be falsified here")
        # the example shown: one the candidate gets right (an example it fails would be the answer), or none
        failing = set(self.failing_tests(s, wi))
        example = [i for i in self.shown_tests(s) if i not in failing][:1]
        prompt = (f"{self.statement(s, example)}\n\nA candidate solution:\n\n"
                  f"{_fence(s.wrong[wi], 'python')}\n\nThis program is not correct. Find a valid input (it must "
                  "follow the input format exactly) on which its output differs from a correct solution's, or on "
                  "which it crashes or runs out of time. Give the complete input within \\boxed{}, with its line breaks.")
        return self.problem(prompt, bad, seed, difficulty, seed_id=s.id, wrong=wi)

    def check(self, problem: Problem, response: str) -> Score:
        got = self.extract(response)
        if got is None:
            return Score.zero("no \\boxed{} answer")
        s = self.seed_of(problem)
        if len(got) > MAX_ANSWER_CHARS:
            return Score.zero(f"input longer than {MAX_ANSWER_CHARS} characters", format_ok=True)
        # validator, reference and candidate at once (the candidate gets the same generous limit)
        with ThreadPoolExecutor(3) as ex:
            valid = ex.submit(self._input_valid, s, got)
            ref_f = ex.submit(self._run_reference_on, s, got)
            cand_f = ex.submit(self._run_reference_on, s, got, s.wrong[problem.meta["wrong"]])
            (ok, why), ref, cand = valid.result(), ref_f.result(), cand_f.result()
        if not ok:
            return Score.zero(why, format_ok=True)
        if ref.status != "ok":
            return Score.zero(f"the reference fails on this input ({ref.status}); not a valid test", format_ok=True)
        differs = cand.status != "ok" or not compare_output(cand.stdout, ref.stdout, s.float_tol)
        return Score(1.0 if differs else 0.0, differs, True,
                     {"candidate": cand.status, "expected": ref.stdout[:200], "candidate_output": cand.stdout[:200]})

    def reference_response(self, problem: Problem) -> str:
        return f"Counterexample:\n\\boxed{{{problem.answer.rstrip()}}}"

    def corruptions(self, problem: Problem) -> list[str]:
        s = self.seed_of(problem)
        _bad, good = self._examples(s, problem.meta["wrong"])
        out = ["", "\\boxed{}", "\\boxed{?-?}"]   # the last one: invalid for any format
        if good is not None:
            out.append(f"\\boxed{{{good.rstrip()}}}")   # valid, but the candidate gets it right
        return out
