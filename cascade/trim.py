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
        text = tok.decode(ids)
        if text.endswith("\ufffd"):  # a cut inside a character's bytes (byte-level BPE): not a character to learn
            ids = ids[:-1]
            continue
        cut = head + "<think>" + text + "</think>" + answer
        if _n(tok, cut) <= budget:  # re-tokenisation at the seams can differ by a token
            return cut
        ids = ids[:-1]
    return shell


def trim_messages(tok, messages: list[dict], budget: int, render) -> list[dict] | None:
    """Multi-turn trimming; ``render(messages) -> str`` gives the text whose tokens count."""
    if _n(tok, render(messages)) <= budget:
        return messages
    last_asst = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    end = last_asst if last_asst is not None else len(messages)  # the earlier turns lose their thinking first
    msgs = drop_thinking(messages[:end]) + [dict(m) for m in messages[end:]]
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


def drop_thinking(messages: list[dict]) -> list[dict]:
    """The messages with their assistant turns' think blocks dropped (their answers kept)."""
    return [dict(m, content=_THINK.sub("", m["content"]).lstrip()) if m["role"] == "assistant" else dict(m)
            for m in messages]


def trim_pairs(tok, pairs: list[tuple[str, str]], budget: int, prompt_len,
               think_open: str = "") -> tuple[list[tuple[str, str]], int]:
    """Trim SFT (prompt, response) pairs to ``budget`` tokens in all; returns (kept, dropped). A chat context (a
    list of messages: multi-turn) too long with its response loses its earlier turns' think blocks first. Under a
    template that opens the thinking in the prompt (``think_open``), a response counts as it will be trained:
    :func:`envs.base.after_open_think` of it (a bare answer gains a closed empty thinking block)."""
    from envs.base import after_open_think

    def size(r: str) -> int:
        return _n(tok, after_open_think(r, think_open))

    kept, dropped = [], 0
    for p, r in pairs:
        if isinstance(p, list) and prompt_len(p) + size(r) > budget:
            p = drop_thinking(p)
        room = limit = budget - prompt_len(p)
        cut = trim_response(tok, r, limit)
        while cut is not None and size(cut) > room:  # what the template adds: cut that much more (limit falls)
            limit -= size(cut) - room
            cut = trim_response(tok, r, limit)
        if cut is None:
            dropped += 1
        else:
            kept.append((p, cut))
    return kept, dropped
