"""The 25 IFEval instruction types: how each is phrased in a prompt and how it is checked.

An instruction is a plain dict ``{"type": TYPE, **params}`` (JSON-serialisable, stored in the
problem). ``describe(spec)`` gives its sentence for the prompt, ``check(spec, response)`` the
strict verdict, ``check_loose`` IFEval's loose verdict: the instruction holds for any of the
response, the response without its first line, without its last line, without both, and each of
these with markdown ``*`` removed.

Counting conventions (shared by the checker and the reference-response builder; they follow
official IFEval): words are ``\\w+`` runs; sentences come from ``split_sentences``, the rule-based
splitter IFEval ships (``split_into_sentences``; its ``count_sentences`` uses NLTK's Punkt model, whose
data would be a download): line breaks are spaces, so a line without
``.``/``!``/``?`` does not end a sentence; a sentence ends at ``.``, ``!`` or ``?`` (closing quotes
may follow) before a space or the end, except the periods of Mr./Mrs./Ms./Dr./St., web suffixes
(.com), decimals (3.5), Ph.D., single letters (``a.``, ``p.m.``), and of Inc./Ltd./Jr./Sr./Co. and
acronyms (U.S.A.) unless a typical sentence starter (He, They, This, ...) follows; ``...`` ends a
sentence; a piece counts only if it has a word character. Keyword existence and frequency are
case-insensitive substring matches (``lanterns`` contains ``lantern``); forbidden words match whole
words only. The ``******`` of two responses may also open or close the response (an empty first
or last part). Paragraphs for "paragraph N starts with word W" are split on ``\\n\\n`` exactly,
and the first word is the paragraph's first whitespace token, minus leading quotes, up to the
first ``.``, ``,``, ``?``, ``!`` or quote (``Today's`` -> ``today``, ``**Today**`` stays
``**today**``). "less than N" means ``count < N`` and "at least N" means ``count >= N``.
"""
from __future__ import annotations

import json
import re
from typing import Callable

from envs.ifeval.lang import LANGUAGE_NAMES, detect_language

__all__ = ["INSTRUCTIONS", "describe", "check", "check_loose", "count_words", "count_sentences",
           "split_sentences", "count_keyword", "count_whole_word", "count_capital_words",
           "count_placeholders", "count_highlights", "count_bullets", "RELATIONS"]

RELATIONS = ("less than", "at least")

# -- counters ----------------------------------------------------------------------------------
_WORD_RE = re.compile(r"\w+")

# Sentence splitting, after the rules of IFEval's ``split_into_sentences``. A period that does not
# end a sentence becomes _KEEP, a forced break is _BREAK; both are private-use characters removed
# from the input first.
_KEEP, _BREAK = "\ue000", "\ue001"
_STARTER = (r"(?:Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s"
            r"|However\s|That\s|This\s|Wherever)")
_TITLE_RE = re.compile(r"\b(Mrs|Mr|Ms|Dr|St)\.")
_WEB_RE = re.compile(r"\.(?=(?:com|net|org|io|gov|edu|me)\b)")
_DECIMAL_RE = re.compile(r"(?<=\d)\.(?=\d)")
_DOTS_RE = re.compile(r"\.{2,}")
# a lone letter's period ends no sentence ("plan B. then"), but the pronoun I's does ("so did I. We left")
_LONE_LETTER_SPACE_RE = re.compile(r"(?<=\s[A-HJ-Za-z])\.(?= )")
_LONE_LETTER_RE = re.compile(r"(?<=\s[A-HJ-Za-z])\.")  # after the acronyms: " U.S." stays one
_ACRONYM_END_RE = re.compile(r"\b([A-Z]\.[A-Z]\.(?:[A-Z]\.)?)(?= " + _STARTER + ")")
_DOTTED_RE = re.compile(r"(?<![A-Za-z])([A-Za-z])\.([A-Za-z])\.(?:([A-Za-z])\.)?")
_SUFFIX_END_RE = re.compile(r"(?<= )(Inc|Ltd|Jr|Sr|Co)\.(?= " + _STARTER + ")")
_SUFFIX_RE = re.compile(r"(?<= )(Inc|Ltd|Jr|Sr|Co)\.")
# a run of . ! ? and closing quotes before whitespace or the end; taken whole from the run's start
# (an atomic group via lookahead + backreference), so a long "!!!...x" stays linear
_SENT_END_RE = re.compile(r"(?<![.!?])(?=([.!?]+[\"\u201d\u2019')\]]*))\1(?=\s|$)|" + _BREAK)


def _keep_dots(m: re.Match) -> str:
    return m.group(0).replace(".", _KEEP)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (IFEval's rule-based splitter; see the module docstring).

    One deliberate difference: a ``.``/``!``/``?`` ends a sentence only before whitespace or the
    end (as in the Punkt tokenizer that IFEval's ``count_sentences`` uses), so ``a.b.c`` or
    ``config.yaml`` is not several sentences.
    """
    t = " " + re.sub("[\ue000\ue001]", " ", text).replace("\n", " ") + " "
    t = _TITLE_RE.sub(_keep_dots, t)
    t = _WEB_RE.sub(_KEEP, t)
    t = _DECIMAL_RE.sub(_KEEP, t)
    t = _DOTS_RE.sub(lambda m: _KEEP * len(m.group(0)) + _BREAK, t)
    t = t.replace("Ph.D.", f"Ph{_KEEP}D{_KEEP}")
    t = _LONE_LETTER_SPACE_RE.sub(_KEEP, t)
    t = _ACRONYM_END_RE.sub(lambda m: m.group(1) + _BREAK, t)
    t = _DOTTED_RE.sub(_keep_dots, t)
    t = _SUFFIX_END_RE.sub(lambda m: m.group(1) + _KEEP + _BREAK, t)
    t = _SUFFIX_RE.sub(_keep_dots, t)
    t = _LONE_LETTER_RE.sub(_KEEP, t)
    sentences, start = [], 0
    for m in _SENT_END_RE.finditer(t):
        sentences.append(t[start:m.end()])
        start = m.end()
    sentences.append(t[start:])
    out = [p.replace(_BREAK, "").replace(_KEEP, ".").strip() for p in sentences]
    return [p for p in out if _WORD_RE.search(p)]


def count_words(text: str) -> int:
    return sum(1 for _ in _WORD_RE.finditer(text))


def count_sentences(text: str) -> int:
    return len(split_sentences(text))


def count_keyword(text: str, word: str) -> int:
    """Occurrences of ``word`` anywhere, case-insensitively (IFEval: ``re.findall(keyword, ...)``)."""
    return len(re.findall(re.escape(word), text, flags=re.IGNORECASE))


def count_whole_word(text: str, word: str) -> int:
    """Occurrences of ``word`` as a whole word, case-insensitively (IFEval's forbidden words)."""
    return len(re.findall(r"\b" + re.escape(word) + r"\b", text, flags=re.IGNORECASE))


_TOKEN_RE = re.compile(r"\w+(?:[-.]\w+)*")  # nltk.word_tokenize's words: WELL-KNOWN and U.S.A are one each


def count_capital_words(text: str) -> int:
    """Words in capitals as the IFEval reference counts them (``word.isupper()`` over nltk's word tokens: hyphenated
    and dotted words are one; a contraction, DON'T, is two, as \\w+ splits it)."""
    return sum(1 for w in _TOKEN_RE.findall(text) if w.isupper())


def count_placeholders(text: str) -> int:
    return len(re.findall(r"\[[^\[\]\n]*?\]", text))


def count_highlights(text: str) -> int:
    n = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    n += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.strip("*").strip())
    return n


def count_bullets(text: str) -> int:
    # IFEval's patterns use ``^\s*``; horizontal space only keeps them linear on huge inputs
    star = re.findall(r"^[ \t]*\*[^\*\n]", text, flags=re.MULTILINE)
    dash = re.findall(r"^[ \t]*-", text, flags=re.MULTILINE)
    return len(star) + len(dash)


def divider_paragraphs(text: str) -> int | None:
    """Paragraphs separated by ``***`` (IFEval's rule: an empty one inside is invalid -> None)."""
    parts = re.split(r"\s?\*\*\*\s?", text)
    n = len(parts)
    for i, p in enumerate(parts):
        if not p.strip():
            if i in (0, len(parts) - 1):
                n -= 1
            else:
                return None
    return n


def blank_line_paragraphs(text: str) -> list[str]:
    """The pieces between ``\\n\\n`` (IFEval splits on exactly that), empty ones included."""
    return text.split("\n\n")


def _compare(count: int, relation: str, n: int) -> bool:
    return count < n if relation == "less than" else count >= n


def _first_word(paragraph: str) -> str:
    """IFEval's first word: the first whitespace token without leading ' then \", cut at the
    first . , ? ! ' or \" and lowercased (so ``Today's`` -> ``today``, ``**Today**`` unchanged)."""
    words = paragraph.split()
    if not words:
        return ""
    word = words[0].lstrip("'").lstrip('"')
    return re.split(r"[.,?!'\"]", word, maxsplit=1)[0].lower()


# -- instruction types: (describe, check) ------------------------------------------------------
def _keywords_existence(s):
    words = ", ".join(s["keywords"])
    return (f"Include the keywords {words} in the response.",
            lambda r: all(count_keyword(r, k) > 0 for k in s["keywords"]))


def _keyword_frequency(s):
    return (f"In your response, the word {s['keyword']} should appear {s['relation']} {s['n']} times.",
            lambda r: _compare(count_keyword(r, s["keyword"]), s["relation"], s["n"]))


def _forbidden_words(s):
    return (f"Do not include the keywords {', '.join(s['words'])} in the response.",
            lambda r: not any(count_whole_word(r, w) for w in s["words"]))


def _letter_frequency(s):
    return (f"In your response, the letter {s['letter']} should appear {s['relation']} {s['n']} times.",
            lambda r: _compare(r.lower().count(s["letter"].lower()), s["relation"], s["n"]))


def _response_language(s):
    name = LANGUAGE_NAMES.get(s["language"], s["language"])
    return (f"Your ENTIRE response should be in {name} language, no other language is allowed.",
            lambda r: detect_language(r) == s["language"])


def _number_sentences(s):
    return (f"Your response should contain {s['relation']} {s['n']} sentences.",
            lambda r: _compare(count_sentences(r), s["relation"], s["n"]))


def _number_paragraphs(s):
    return (f"There should be {s['n']} paragraphs. Paragraphs are separated with the markdown divider: ***",
            lambda r: divider_paragraphs(r) == s["n"])


def _number_words(s):
    return (f"Answer with {s['relation']} {s['n']} words.",
            lambda r: _compare(count_words(r), s["relation"], s["n"]))


def _nth_paragraph_first_word(s):
    def ok(r):
        # IFEval: the count skips empty pieces but the nth piece is taken from the raw split
        pieces = blank_line_paragraphs(r)
        n_paras = sum(1 for p in pieces if p.strip())
        if not 1 <= s["nth"] <= n_paras or not pieces[s["nth"] - 1].strip():
            return False
        return n_paras == s["n"] and _first_word(pieces[s["nth"] - 1]) == s["word"].lower()
    return (f"There should be {s['n']} paragraphs. Paragraphs and only paragraphs are separated with each other "
            f"by two new lines as if it was '\\n\\n' in python. Paragraph {s['nth']} must start with word {s['word']}.", ok)


def _number_placeholders(s):
    return (f"The response must contain at least {s['n']} placeholders represented by square brackets, such as [address].",
            lambda r: count_placeholders(r) >= s["n"])


def _postscript(s):
    marker = s["marker"]
    # IFEval: re.findall(r"\s*p\.\s?s\..*$", ...) is non-empty iff the core pattern occurs
    pat = re.compile(r"p\.\s?p\.\s?s" if marker == "P.P.S" else r"p\.\s?s\.")
    return (f"At the end of your response, please explicitly add a postscript starting with {marker}",
            lambda r: pat.search(r.lower()) is not None)


def _number_bullet_lists(s):
    return (f"Your answer must contain exactly {s['n']} bullet points. Use the markdown bullet points such as:\n"
            f"* This is point 1.\n* This is point 2",
            lambda r: count_bullets(r) == s["n"])


CONSTRAINED_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _constrained_response(s):
    return (f"Answer with one of the following options: {', '.join(repr(o) for o in CONSTRAINED_OPTIONS)}",
            lambda r: any(o in r.strip() for o in CONSTRAINED_OPTIONS))


def _number_highlighted_sections(s):
    return (f"Highlight at least {s['n']} sections in your answer with markdown, i.e. *highlighted section*.",
            lambda r: count_highlights(r) >= s["n"])


def _multiple_sections(s):
    sp = s["splitter"]
    return (f"Your response must have {s['n']} sections. Mark the beginning of each section with {sp} X, such as:\n"
            f"{sp} 1\n[content of section 1]\n{sp} 2\n[content of section 2]",
            lambda r: len(re.split(r"\s?" + re.escape(sp) + r"\s?\d+\s?", r)) - 1 >= s["n"])


def _json_format(s):
    def ok(r):
        v = r.strip()
        for fence in ("```json", "```Json", "```JSON", "```"):
            if v.startswith(fence):
                v = v[len(fence):]
                break
        v = v.strip()
        if v.endswith("```"):
            v = v[:-3]
        try:
            json.loads(v)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            return False
        return True
    return ("Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.", ok)


def has_title(text: str) -> bool:
    """The IFEval reference's title check (``re.findall(r"<<[^\\n]+>>")``, a match with text once its ``<`` and
    ``>`` are stripped) without the regex's quadratic backtracking: on a line, the greedy match runs from the
    first ``<<`` to the last ``>>``."""
    for line in text.split("\n"):
        i, j = line.find("<<"), line.rfind(">>")
        if i >= 0 and j >= i + 3 and line[i:j + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def _title(s):
    return ("Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
            has_title)


def _two_responses(s):
    def ok(r):
        # IFEval: an empty part is allowed only first or last; exactly two non-empty, different parts
        parts = r.split("******")
        answers = []
        for i, p in enumerate(parts):
            if p.strip():
                answers.append(p.strip())
            elif 0 < i < len(parts) - 1:
                return False
        return len(answers) == 2 and answers[0] != answers[1]
    return ("Give two different responses. Responses and only responses should be separated by 6 asterisk "
            "symbols: ******.", ok)


def _repeat_prompt(s):
    # the request to repeat is named: the whole prompt (IFEval's reading) carries the other instructions' words
    # (forbidden words, commas, bullets, "***"), which a verbatim repeat would then break
    return (f"First repeat the request \"{s['prompt_to_repeat']}\" word for word without change, then give your "
            "answer (do not say any words or characters before repeating the request).",
            lambda r: r.strip().lower().startswith(s["prompt_to_repeat"].strip().lower()))


def _end_checker(s):
    return (f"Finish your response with this exact phrase {s['end_phrase']}. No other words should follow this phrase.",
            lambda r: r.strip().strip('"').lower().endswith(s["end_phrase"].strip().lower()))


def _capital_word_frequency(s):
    return (f"In your response, words with all capital letters should appear {s['relation']} {s['n']} times.",
            lambda r: _compare(count_capital_words(r), s["relation"], s["n"]))


def _english_capital(s):
    return ("Your entire response should be in English, and in all capital letters.",
            lambda r: r.isupper() and detect_language(r) == "en")


def _english_lowercase(s):
    return ("Your entire response should be in English, and in all lowercase letters. No capital letters are allowed.",
            lambda r: r.islower() and detect_language(r) == "en")


def _no_comma(s):
    return ("In your entire response, refrain from the use of any commas.", lambda r: "," not in r)


def _quotation(s):
    return ("Wrap your entire response with double quotation marks.",
            lambda r: len(r.strip()) > 1 and r.strip()[0] == '"' and r.strip()[-1] == '"')


INSTRUCTIONS: dict[str, Callable[[dict], tuple[str, Callable[[str], bool]]]] = {
    "keywords:existence": _keywords_existence,
    "keywords:frequency": _keyword_frequency,
    "keywords:forbidden_words": _forbidden_words,
    "keywords:letter_frequency": _letter_frequency,
    "language:response_language": _response_language,
    "length_constraints:number_sentences": _number_sentences,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:number_words": _number_words,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_content:number_placeholders": _number_placeholders,
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _number_bullet_lists,
    "detectable_format:constrained_response": _constrained_response,
    "detectable_format:number_highlighted_sections": _number_highlighted_sections,
    "detectable_format:multiple_sections": _multiple_sections,
    "detectable_format:json_format": _json_format,
    "detectable_format:title": _title,
    "combination:two_responses": _two_responses,
    "combination:repeat_prompt": _repeat_prompt,
    "startend:end_checker": _end_checker,
    "change_case:capital_word_frequency": _capital_word_frequency,
    "change_case:english_capital": _english_capital,
    "change_case:english_lowercase": _english_lowercase,
    "punctuation:no_comma": _no_comma,
    "startend:quotation": _quotation,
}


def _get(spec: dict):
    t = spec.get("type")
    if t not in INSTRUCTIONS:
        raise ValueError(f"unknown IFEval instruction type {t!r}; choose from {', '.join(INSTRUCTIONS)}")
    return INSTRUCTIONS[t](spec)


def describe(spec: dict) -> str:
    return _get(spec)[0]


def check(spec: dict, response: str) -> bool:
    """Strict verdict: the instruction holds for the response as given."""
    if not isinstance(response, str) or not response.strip():
        return False
    return bool(_get(spec)[1](response))


def loose_variants(response: str) -> list[str]:
    lines = response.split("\n")
    base = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return base + [v.replace("*", "") for v in base]


def check_loose(spec: dict, response: str) -> bool:
    """Loose verdict (IFEval): the instruction holds for some variant of the response."""
    if not isinstance(response, str) or not response.strip():
        return False
    fn = _get(spec)[1]
    return any(v.strip() and fn(v) for v in loose_variants(response))
