"""Prompt templates for Markovian RSA, rendered straight to token ids.

A template is a set of ``str.format`` strings (double the braces of literal ``{}``, as in
``\\boxed{{}}``):

- ``solve``: the round-0 prompt; field ``{problem}``.
- ``aggregate``: the prompt of an aggregation round; fields ``{problem}``, ``{candidates}`` (the
  rendered ``candidate`` blocks, in order) and ``{count}`` (how many).
- ``candidate``: one forwarded tail; fields ``{tail}`` and ``{index}`` (1-based).
- ``continue``: parallel Delethink's continuation, appended after the assistant header of the
  ``solve`` prompt; field ``{tail}``.
- ``force_answer``: appended to a final-round trace cut at the thinking budget (one with no
  ``</think>`` yet) before the final-answer continuation; no fields (literal braces doubled too).

Rendering encodes each run of text between tails once, as a whole (chat header, template text and problem up
to the first tail; the text between two tails; the text after the last tail and the chat footer), and splices
each tail in verbatim as token ids. A tokenizer whose pre-tokenizer glues punctuation to the newlines after it
(Qwen2's: ``.\n\n`` is one token) then gives a solve prompt the very ids of the chat template's encoding of the
whole text, those the model was trained on. A prompt is at most ``|template| + |q| + sum |tails|`` tokens, where
``|template|`` is its size with the problem and the tails empty (they cut the text in the same places) and
``|q|`` the problem's own encoding: the bound ``|q| + C*tau + |template|`` holds by construction. (A tail's
seams with the text around it stay as they are: the tail's ids are the model's own, and are kept.)

Built-in: ``math``, ``code``, ``generic``. A YAML/JSON file (``--template PATH``) may override any
subset of the keys; the others come from ``base`` in the file (a built-in name, default ``generic``).
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

_FORCE = "\n\nI have to stop thinking here and give my final answer now.\n</think>\n\n"
_CANDIDATE = "--- Candidate {index} (end of its reasoning) ---\n{tail}\n\n"


@dataclass(frozen=True)
class Template:
    name: str
    solve: str
    aggregate: str
    candidate: str = _CANDIDATE
    continue_: str = "{tail}"
    force_answer: str = _FORCE
    answer_format: str = "boxed"  # how answers are extracted: "boxed" (last \boxed{}) or "code" (last code block)
    base: str = ""  # the built-in a template file starts from ("" for a built-in: its name)

    def check(self) -> "Template":
        need = {"solve": {"problem"}, "aggregate": {"problem", "candidates"}, "candidate": {"tail"},
                "continue_": {"tail"}, "force_answer": set()}
        allowed = {"solve": {"problem"}, "aggregate": {"problem", "candidates", "count"},
                   "candidate": {"tail", "index"}, "continue_": {"tail"}, "force_answer": set()}
        for key, req in need.items():
            text = getattr(self, key)
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
            except ValueError as e:
                raise ValueError(f"template {self.name!r}, {key.rstrip('_')}: {e} "
                                 f"(write literal braces as {{{{ }}}})") from None
            names = set(fields)
            # the plan counts each tail once: a payload field written twice would make prompts longer than planned
            twice = sorted(f for f in names & {"candidates", "tail"} if fields.count(f) > 1)
            if twice:
                raise ValueError(f"template {self.name!r}, {key.rstrip('_')}: {{{twice[0]}}} appears "
                                 f"{fields.count(twice[0])} times; it may appear once (the context plan counts it once)")
            if not req <= names or not names <= allowed[key]:
                raise ValueError(f"template {self.name!r}, {key.rstrip('_')}: fields {sorted(names)}; "
                                 f"needs {sorted(req)}, allows {sorted(allowed[key])} "
                                 f"(write literal braces as {{{{ }}}})")
        if self.answer_format not in ("boxed", "code"):
            raise ValueError(f"template {self.name!r}: answer_format must be 'boxed' or 'code', "
                             f"got {self.answer_format!r}")
        return self


MATH = Template(
    name="math",
    solve="{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    aggregate=(
        "{problem}\n\n"
        "Here are {count} candidate solutions to the problem above. Each is shown only by the last part of "
        "its reasoning, and any of them may be incomplete or wrong.\n\n"
        "{candidates}"
        "Aggregate them into one correct solution: keep the ideas that hold up and check the steps that "
        "matter; where the candidates disagree, work out which one is right; if all of them are wrong, solve "
        "the problem another way. Reason step by step, and put your final answer within \\boxed{{}}."),
)

def code_template(language: str = "python") -> Template:
    """The ``code`` template, asking for the program in ``language``: ``python``, ``cpp`` or ``any`` (either)."""
    blocks = {"python": "```python code block", "cpp": "```cpp code block",
              "any": "```python or ```cpp code block"}
    if language not in blocks:
        raise ValueError(f"no code template for language {language!r}; languages: {', '.join(blocks)}")
    block = blocks[language]
    return Template(
        name="code" if language == "python" else f"code-{language}",
        solve=("{problem}\n\nThink the problem through, then write a correct and efficient solution. Give the "
               f"complete program in one {block} at the end."),
        aggregate=(
            "{problem}\n\n"
            "Here are {count} candidate approaches to the task above. Each is shown only by the last part of its "
            "reasoning, and any of them may be incomplete or wrong.\n\n"
            "{candidates}"
            "Combine them into one correct solution: keep the ideas that hold up, check edge cases and "
            "complexity; where they disagree, work out which is right; if all are wrong, use another approach. "
            f"Give the complete program in one {block} at the end."),
        answer_format="code",
    )


CODE = code_template("python")

GENERIC = Template(
    name="generic",
    solve="{problem}\n\nThink step by step, then give your final answer within \\boxed{{}}.",
    aggregate=(
        "{problem}\n\n"
        "Here are {count} candidate responses to the task above. Each is shown only by its last part, and "
        "any of them may be incomplete or wrong.\n\n"
        "{candidates}"
        "Combine them into one correct response: keep what holds up; where they disagree, decide which is "
        "right; if all are wrong, try another way. Think step by step, then give your final answer within "
        "\\boxed{{}}."),
)

BUILTIN = {t.name: t for t in (MATH, CODE, GENERIC)}
_KEYS = {"solve": "solve", "aggregate": "aggregate", "candidate": "candidate", "continue": "continue_",
         "force_answer": "force_answer", "answer_format": "answer_format"}


def load_template(spec: str | Template) -> Template:
    """A built-in template by name, or a YAML/JSON file of overrides."""
    if isinstance(spec, Template):
        return spec.check()
    if spec in BUILTIN:
        return BUILTIN[spec]
    p = Path(spec)
    if not p.is_file():
        raise ValueError(f"unknown template {spec!r}: use one of {', '.join(BUILTIN)} or a YAML/JSON file")
    text = p.read_text()
    import yaml

    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"template file {p} is not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"template file {p}: expected a mapping of {', '.join(_KEYS)}")
    base_name = data.pop("base", "generic")
    if base_name not in BUILTIN:
        raise ValueError(f"template file {p}: base {base_name!r} is not one of {', '.join(BUILTIN)}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(f"template file {p}: unknown key(s) {', '.join(unknown)}; valid: base, {', '.join(_KEYS)}")
    return replace(BUILTIN[base_name], name=str(p), base=base_name,  # null: the empty text (no forced answer)
                   **{_KEYS[k]: "" if v is None else str(v) for k, v in data.items()}).check()


Pieces = list  # text and token ids alternating, text first and last: [str, ids, str, ..., str]


def pieces(fmt: str, fields: dict[str, object], values: dict[str, object] | None = None) -> Pieces:
    """``fmt`` as alternating text and token-id pieces. A field of ``fields`` given as text joins the text around
    it; one given as token ids is a piece of its own (even when empty, so that a prompt's text is cut in the same
    places whatever its tails hold); ``candidates`` is a list of rendered ``candidate`` blocks (pieces), laid end
    to end. Plain ``values`` are formatted into the text."""
    values = values or {}
    out: Pieces = [""]
    for literal, name, spec, _ in string.Formatter().parse(fmt):
        out[-1] += literal
        if name is None:
            continue
        if name not in fields:
            out[-1] += format(values[name], spec or "")
        elif isinstance(fields[name], str):
            out[-1] += fields[name]
        elif name == "candidates":
            for block in fields[name]:
                out = join(out, block)
        else:
            out += [list(fields[name]), ""]
    return out


def join(*parts: Pieces) -> Pieces:
    """Pieces laid end to end: the text at each seam becomes one run."""
    out: Pieces = [""]
    for p in parts:
        out = out[:-1] + [out[-1] + p[0]] + p[1:]
    return out


def encode_pieces(seq: Pieces, encode: Callable[[str], list[int]]) -> list[int]:
    """Token ids of ``seq``: each run of text encoded once, as a whole; token ids as they are."""
    out: list[int] = []
    for k, p in enumerate(seq):
        out += p if k % 2 else (encode(p) if p else [])
    return out


def render(fmt: str, encode: Callable[[str], list[int]], fields: dict[str, object],
           values: dict[str, object] | None = None) -> list[int]:
    """Token ids of ``fmt`` with ``fields`` filled in (see :func:`pieces`)."""
    return encode_pieces(pieces(fmt, fields, values), encode)


@dataclass
class PromptBuilder:
    """Builds RSA prompts as token ids: chat header + template + chat footer.

    The problem is given as text (what :class:`~ttc.rsa.MarkovianRSA` does) or as token ids (the context plan: a
    problem of n tokens). As text it is encoded with the text around it, as the chat template encodes the whole
    prompt, unless that is longer than encoding it on its own (BPE merges across the seam seldom lengthen, but
    may): a prompt then never exceeds the plan's size for a problem of ``len(encode(problem))`` tokens."""

    template: Template
    encode: Callable[[str], list[int]]
    chat: tuple[str, str] = ("", "")

    def __post_init__(self):
        raw = self.encode

        @lru_cache(maxsize=1024)  # literal runs repeat, and a problem's runs repeat in each of its prompts
        def enc(text: str) -> tuple[int, ...]:
            return tuple(raw(text))

        self._enc = lambda text: list(enc(text))

    def _prompt(self, build: Callable[[str | list[int]], Pieces], problem: str | list[int]) -> list[int]:
        ids = encode_pieces(build(problem), self._enc)
        if isinstance(problem, str):
            alone = encode_pieces(build(self._enc(problem)), self._enc)
            if len(alone) < len(ids):
                return alone
        return ids

    def _solve(self, problem: str | list[int]) -> Pieces:
        pre, post = self.chat
        return join([pre], pieces(self.template.solve, {"problem": problem}), [post])

    def solve(self, problem: str | list[int]) -> list[int]:
        return self._prompt(self._solve, problem)

    def aggregate(self, problem: str | list[int], tails: Sequence[list[int]]) -> list[int]:
        pre, post = self.chat
        blocks = [pieces(self.template.candidate, {"tail": t}, {"index": i + 1}) for i, t in enumerate(tails)]
        return self._prompt(lambda p: join([pre], pieces(self.template.aggregate, {"problem": p, "candidates": blocks},
                                                          {"count": len(tails)}), [post]), problem)

    def cont(self, problem: str | list[int], tail: list[int]) -> list[int]:
        """The ``solve`` prompt, then ``continue`` (its text before the tail joins the chat footer's run)."""
        return self._prompt(lambda p: join(self._solve(p), pieces(self.template.continue_, {"tail": tail})), problem)

    def force_answer(self) -> list[int]:
        """Token ids of ``force_answer``, rendered as the other fields are (a ``str.format`` string with no
        fields: ``\\boxed{{`` is sent as ``\\boxed{``), as :meth:`check` reads it and the context plan counts it."""
        return render(self.template.force_answer, self._enc, {}) if self.template.force_answer else []

    def overhead(self, count: int, kind: str = "aggregate") -> int:
        """Template tokens of a prompt with ``count`` tails (everything but the problem and tails)."""
        if kind == "continue":
            return len(self.cont([], []))
        return len(self.aggregate([], [[] for _ in range(count)]))


def template_names() -> list[str]:
    return list(BUILTIN)


__all__ = ["Template", "BUILTIN", "load_template", "render", "PromptBuilder", "template_names"]
