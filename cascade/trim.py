"""Answer-preserving trimming to a context budget (ZAYA1): keep a sample if it fits; else cut the
tail of the last think block just before the answer; for multi-turn samples first drop earlier
turns' think blocks (keeping their answers); drop the sample only if the answers alone don't fit."""
from __future__ import annotations

import re

_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def _n(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False, verbose=False))


def trim_response(tok, response: str, budget: int) -> str | None:
    """``response`` cut to at most ``budget`` tokens keeping its answer, or None if impossible."""
    if _n(tok, response) <= budget:
        return response
    last = None
    for m in _THINK.finditer(response):
        last = m
    if last is None:
        return None
    head, think, answer = response[:last.start()], last.group(1), response[last.end():]
    shell = head + "<think></think>" + answer
    room = budget - _n(tok, shell)
    if room < 0:
        return None
    ids = tok.encode(think, add_special_tokens=False, verbose=False)[:room]
    while ids:
        cut = head + "<think>" + tok.decode(ids) + "</think>" + answer
        if _n(tok, cut) <= budget:  # re-tokenisation at the seams can differ by a token
            return cut
        ids = ids[:-1]
    return shell


def trim_messages(tok, messages: list[dict], budget: int, render) -> list[dict] | None:
    """Multi-turn trimming; ``render(messages) -> str`` gives the text whose tokens count."""
    if _n(tok, render(messages)) <= budget:
        return messages
    msgs = [dict(m) for m in messages]
    last_asst = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i != last_asst:
            m["content"] = _THINK.sub("", m["content"]).lstrip()
    if _n(tok, render(msgs)) <= budget:
        return msgs
    if last_asst is None:
        return None
    rest = _n(tok, render(msgs[:last_asst] + [dict(msgs[last_asst], content="")]))
    cut = trim_response(tok, msgs[last_asst]["content"], budget - rest)
    if cut is None:
        return None
    msgs[last_asst]["content"] = cut
    return msgs if _n(tok, render(msgs)) <= budget else None


def trim_pairs(tok, pairs: list[tuple[str, str]], budget: int, prompt_len) -> tuple[list[tuple[str, str]], int]:
    """Trim SFT (prompt, response) pairs to ``budget`` tokens in all; returns (kept, dropped)."""
    kept, dropped = [], 0
    for p, r in pairs:
        cut = trim_response(tok, r, budget - prompt_len(p))
        if cut is None:
            dropped += 1
        else:
            kept.append((p, cut))
    return kept, dropped
