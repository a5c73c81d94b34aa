"""What the adapters of outside environment packages share (``rg/`` reasoning-gym, ``rc/``
reasoning-core, ``rlve/`` RLVE-Gym): the per-version roster cache that lets listing skip the
package's import, and the answer handling of the ``\\boxed{}`` / ``<answer>...</answer>`` adapters.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from envs.base import Problem, Score, last_boxed_span, strip_think

MAX_ANSWER_CHARS = 10_000


def cache_dir() -> Path:
    return Path(os.environ.get("CASCADE_CACHE_DIR") or Path.home() / ".cache" / "cascade")


def package_version(*dists: str) -> str:
    """The installed version of the first of ``dists`` that is installed, else ``"unknown"``."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def cached_catalog(file_name: str, build: Callable[[], dict[str, dict]]) -> dict[str, dict]:
    """The roster in ``cache_dir()/file_name`` when present and readable; otherwise ``build()``,
    written there atomically (a cache that cannot be written is skipped)."""
    path = cache_dir() / file_name
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data:
            return data
    except (OSError, ValueError):
        pass
    data = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
    return data


def balanced(s: str) -> bool:
    """True if ``s``'s braces balance (it can sit inside ``\\boxed{...}``)."""
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


ANSWER_TAG = ("<answer>", "</answer>")


def last_tagged_or_boxed(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` (as written) or ``\\boxed{...}``
    (stripped) in ``text``, whichever comes later; None if there is neither."""
    bpos, boxed = last_boxed_span(text) or (-1, None)
    apos = text.rfind(ANSWER_TAG[0])
    if apos > bpos:
        end = text.find(ANSWER_TAG[1], apos)
        if end >= 0:
            return text[apos + len(ANSWER_TAG[0]):end]
        # an unclosed last <answer>: the last complete one before it, if any (the last opening
        # before the last closing; one search each, however many unclosed openings there are)
        apos = text.rfind(ANSWER_TAG[0], 0, max(0, text.rfind(ANSWER_TAG[1])))
        if apos > bpos:
            return text[apos + len(ANSWER_TAG[0]):text.find(ANSWER_TAG[1], apos)]
    return boxed


class BoxedOrTagged:
    """Answer handling for adapters whose answers go in the last ``\\boxed{}`` or
    ``<answer>...</answer>`` (whichever comes last) after any thinking; mixed into an Environment."""

    def extract(self, response: str) -> str | None:
        got = last_tagged_or_boxed(strip_think(response))
        return None if got is None else got.strip()

    def format_answer(self, answer) -> str:
        return "" if answer is None else str(answer)

    def reference_response(self, problem: Problem) -> str:
        ans = self.format_answer(problem.answer)
        if balanced(ans) and "\\boxed" not in ans:
            return f"The answer is \\boxed{{{ans}}}"
        return f"The answer is <answer>{ans}</answer>"

    def corruptions(self, problem: Problem) -> list[str]:
        # An unrelated answer: several scorers read only a prefix of the answer (a number, the
        # first moves), so a perturbed gold answer may rightly still score 1.
        return ["", "I don't know.", "\\boxed{}", "<answer>qx9 ### zz</answer>", "\\boxed{-98765.4321}"]

    def reference_credited(self, problem: Problem, context) -> bool:
        """Whether the package's scorer credits the problem's own reference answer (in this process). Its
        generators sometimes make a problem it then fails: reasoning-core's inverse_math (8 of 20 at difficulty 2),
        reasoning-gym's jugs ("No solution" to a puzzle it scores unsolved) and string_manipulation (an empty
        answer, which no box holds); the adapters draw such a problem again. True without an oracle answer."""
        if getattr(self, "no_reference_reason", ""):
            return True
        try:
            return bool(self.check_with(problem, self.reference_response(problem), context).correct)
        except Exception:  # noqa: BLE001 - a scorer that fails on its own answer fails it
            return False

    def precheck(self, problem: Problem, response: str) -> Score | None:
        """The zero Score of a response without an answer (or with one too long), found before any scorer runs (an
        isolated scorer's worker is not asked then: envs/isolated.py); None when there is an answer to score."""
        pred = self.extracted_or_zero(problem, response)
        return pred if isinstance(pred, Score) else None

    def extracted_or_zero(self, problem: Problem, response: str) -> str | Score:
        """The extracted answer, or the zero Score of a response without one or with one too long."""
        pred = self.extract(response)
        if pred is None:
            return Score.zero("no \\boxed{} or <answer> answer", format_ok=False)
        limit = max(MAX_ANSWER_CHARS, 50 * len(self.format_answer(problem.answer)))
        if len(pred) > limit:
            return Score.zero("answer too long", format_ok=True, length=len(pred))
        return pred
