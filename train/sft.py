"""Supervised fine-tuning on (prompt, response) pairs, the loss on response tokens only.

Pairs come from environment reference solutions rendered as reasoning traces
(:func:`reference_pairs`) or from a file or Hugging Face dataset with ``prompt`` and ``response``
columns or chat-format ``messages`` (:func:`load_pairs`).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from train.model.modeling import CausalLM
from train.optim import (OptimConfig, accumulate_grads, build_optimizer, clip_and_step, load_training_state,
                         training_state)


@dataclass
class SFTConfig:
    steps: int = 100
    batch_size: int = 32
    micro_batch_size: int = 32       # at most this many examples in one packed micro-batch
    tokens_per_micro: int = 16384    # token budget of a packed micro-batch (examples back to back)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10))
    max_len: int = 1024
    chat_template: bool = True
    system_prompt: str | None = None
    seed: int = 0


def render_trace(reasoning: str, answer_text: str) -> str:
    """A reasoning trace in the policy's format: a think block, then the answer."""
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{answer_text.strip()}"


def reference_pairs(env_ids: list[str], n: int, seed: int = 0, difficulties=(0,), think: bool = True,
                    env_kwargs: dict | None = None, advance=None, weights: list[float] | None = None,
                    exclude: set[str] | None = None) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs from the environments' reference solutions, each from an
    environment drawn uniformly or in proportion to ``weights`` (``advance(1)`` after each, for a
    progress bar); a problem whose normalized prompt is in ``exclude`` (held out for evaluation) is drawn
    again, as :meth:`envs.curriculum.Curriculum.generate` does."""
    from envs.base import get_env
    from envs.curriculum import draw_avoiding

    if weights is not None and (len(weights) != len(env_ids) or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"sft environment weights must be >= 0, one per environment, not all 0; got {weights}")
    rng = random.Random(seed)
    envs = {e: get_env(e, **((env_kwargs or {}).get(e, {}))) for e in env_ids}
    none = {e: env.no_reference_reason for e, env in envs.items() if getattr(env, "no_reference_reason", "")}
    if none:  # its reference_response is no answer to its prompts (e.g. C++ prompts of a Python-only reference)
        raise ValueError("SFT from reference solutions: " + "; ".join(f"{e} has no reference answer ({why})"
                                                                     for e, why in none.items()))
    out = []
    for _ in range(n):
        env_id = rng.choice(env_ids) if weights is None else rng.choices(env_ids, weights)[0]
        env = envs[env_id]
        first = rng.getrandbits(62)
        d = rng.choice(list(difficulties))
        prob = draw_avoiding(lambda seed: env.generate(seed, d), rng, exclude or set(), first=first)[0]
        ref = env.reference_response(prob)
        reasoning = prob.meta.get("reasoning") if isinstance(prob.meta, dict) else None
        out.append((prob.prompt, render_trace(reasoning or "I solve the problem and check the answer.", ref)
                    if think else ref))
        if advance is not None:
            advance(1)
    return out


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
          "system": "system", "tool": "tool"}


def _messages(value, where: str) -> tuple[list[dict], str]:
    """A chat-format example (``[{"role", "content"}, ...]``; ShareGPT's ``from``/``value`` too) ->
    (the context: every message before the last, the last, assistant, message's content)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: messages is a string, not a JSON list of {{role, content}}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    msgs = []
    for m in value:
        if not isinstance(m, dict):
            raise ValueError(f"{where}: each message must be a mapping with role and content, got {m!r:.80}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in _ROLES or not isinstance(content, str):
            raise ValueError(f"{where}: a message needs a role ({', '.join(sorted(set(_ROLES.values())))}) and "
                             f"string content, got {m!r:.80}")
        msgs.append({"role": _ROLES[role], "content": content})
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise ValueError(f"{where}: messages must end with an assistant message after at least one other "
                         f"(the loss is on that last assistant message)")
    return msgs[:-1], msgs[-1]["content"]


def load_pairs(path: str | Path, columns: dict | str | None = None, split: str = "train",
               subset: str | None = None) -> list[tuple[str | list[dict], str]]:
    """SFT examples from a jsonl/json/parquet/csv file, a dataset directory or a Hugging Face dataset
    ``org/name`` (``envs.hub``: the HF cache and offline rules), as (prompt, response) pairs.

    Either ``prompt`` and ``response`` columns (a prompt is one user turn), or a ``messages`` column
    in chat format (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``): the last
    message is the assistant's response the loss is on, the messages before it (a list) the prompt.
    ``columns`` maps these names to the data's (``{"prompt": "question", "response": "answer"}`` or
    ``{"messages": "conversations"}``). Data with both kinds gives its messages, unless ``columns`` maps
    prompt or response (and not messages): then those columns."""
    from envs.hub import load_table, parse_columns, table_rows

    p = Path(path)
    if not p.exists() and (p.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv")
                           or str(path).startswith((".", "/"))):
        raise FileNotFoundError(f"SFT data file {str(p)!r} does not exist")
    cols = parse_columns(columns, ("prompt", "response", "messages"))
    # the keys that columns maps (parse_columns checked them)
    given = columns if isinstance(columns, dict) else [kv.partition("=")[0] for kv in (columns or "").split(",")]
    mapped = {str(k).strip() for k in given} - {""}
    ds = load_table(path, split=split, subset=subset, what="SFT data")
    if cols["messages"] in ds.column_names and ("messages" in mapped or not mapped & {"prompt", "response"}):
        rows = table_rows(ds, {"messages": cols["messages"]}, ["messages"], path, "SFT data")
        return [_messages(r["messages"], f"SFT data {str(path)!r} row {i}") for i, r in enumerate(rows)]
    if not {cols["prompt"], cols["response"]} <= set(ds.column_names):
        raise ValueError(f"SFT data {str(path)!r} needs columns 'prompt' and 'response', or 'messages' (chat format); "
                         f"found {', '.join(ds.column_names)}; map them with columns.prompt=COLUMN,"
                         f" columns.response=COLUMN or columns.messages=COLUMN")
    rows = table_rows(ds, {"prompt": cols["prompt"], "response": cols["response"]}, ["prompt", "response"], path,
                      "SFT data")
    return [_pair(r["prompt"], r["response"], f"SFT data {str(path)!r} row {i}") for i, r in enumerate(rows)]


def _pair(prompt, response, where: str) -> tuple[str | list[dict], str]:
    """A (prompt, response) row: strings, or TRL's conversational prompt-completion form (the prompt a list of
    messages, the completion one assistant message); anything else (a null, a number) is an error naming the row,
    not a target text such as ``"None"``."""
    if isinstance(prompt, (list, tuple)) or isinstance(response, (list, tuple)):
        resp = list(response) if isinstance(response, (list, tuple)) else [{"role": "assistant", "content": response}]
        ctx = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        return _messages(ctx + resp, where)
    for name, v in (("prompt", prompt), ("response", response)):
        if not isinstance(v, str):
            raise ValueError(f"{where}: {name} must be a string (or, for chat, a list of messages), "
                             f"got {type(v).__name__} {v!r:.40}")
    return prompt, response


def prompt_ids(tokenizer, prompt: str | list[dict], chat: bool, system: str | None) -> list[int]:
    """Token ids of an SFT prompt: one user turn (a string), or a chat context (a list of messages,
    ``system`` added when it has no system message), ending with the assistant header."""
    from train.rl.trainer import encode_prompt

    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, chat, system)
    if not chat:
        raise ValueError("SFT examples in chat format (messages) need the chat template (rl.chat_template=true)")
    msgs = list(prompt)
    if system and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system}] + msgs
    from train.tokenizer import chat_ids

    return chat_ids(tokenizer, msgs)


def prompt_text(prompt: str | list[dict]) -> str:
    """The user's text of an SFT prompt (the last user message of a chat context)."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else ""


def encode_pair(tokenizer, prompt: str | list[dict], response: str, chat: bool,
                system: str | None, think_open: str = "") -> tuple[list[int], list[int]]:
    """Prompt and response token ids; the response ends with the end-of-sequence token, with or without
    a chat template (as TRL's SFT appends it), so that the policy learns to stop after its answer. Where the
    template opens the thinking in the prompt (``think_open``), the response goes on from there
    (:func:`envs.base.after_open_think`: a second ``<think>`` would be learned)."""
    from envs.base import after_open_think

    p = prompt_ids(tokenizer, prompt, chat, system)
    r = tokenizer.encode(after_open_think(response, think_open), add_special_tokens=False, verbose=False)
    if tokenizer.eos_token_id is not None and (not r or r[-1] != tokenizer.eos_token_id):
        r = r + [tokenizer.eos_token_id]
    return p, r


class SFTTrainer:
    def __init__(self, policy: CausalLM, tokenizer, cfg: SFTConfig):
        self.policy, self.tokenizer, self.cfg = policy, tokenizer, cfg
        self.opt, self.sched = build_optimizer(policy, cfg.optim.over(cfg.steps))
        self.rng = random.Random(cfg.seed)
        self.step_idx = 0
        from train.tokenizer import open_think_of

        # responses are whole (<think>...</think>answer); a template that opens the thinking has its part
        self.think_open = open_think_of(tokenizer, cfg.chat_template, cfg.system_prompt)

    def encode(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        out = []
        for pr, rs in pairs:
            p, r = encode_pair(self.tokenizer, pr, rs, self.cfg.chat_template, self.cfg.system_prompt,
                               self.think_open)
            if not p:
                raise ValueError(f"an SFT example's prompt encodes to no tokens ({str(pr)[:60]!r}): its first response "
                                 "token would have nothing to be predicted from")
            if len(p) + len(r) > self.cfg.max_len:
                raise ValueError(f"an SFT example has {len(p) + len(r)} tokens > max_len {self.cfg.max_len}; "
                                 f"trim the data (cascade.trim) or raise max_len")
            out.append((p, r))
        return out

    def step(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimizer step on encoded (prompt ids, response ids) examples; mean token NLL.

        Examples are packed back to back into micro-batches of at most ``tokens_per_micro`` tokens and
        ``micro_batch_size`` examples (:mod:`train.rl.packing`, as the RL trainer and the trainer ranks
        pack): no compute goes to padding, and the LM head runs on the response positions only."""
        from train.rl.packing import Pair, pack_micro_batches, packed_token_logprobs

        t0 = time.perf_counter()
        total = max(1, sum(len(r) for _, r in examples))
        self.policy.train()
        loss_sum = 0.0
        for rows in pack_micro_batches([len(p) + len(r) for p, r in examples], self.cfg.tokens_per_micro,
                                       self.cfg.micro_batch_size):
            lps = packed_token_logprobs(self.policy, [Pair(*examples[i]) for i in rows], return_entropy=False)
            loss = -torch.cat(lps).sum() / total
            loss.backward()
            accumulate_grads(self.opt)
            loss_sum += float(loss.detach())
        lr = self.sched.get_last_lr()[0]  # the rate this step applies (the schedule moves on in clip_and_step)
        gn = clip_and_step(self.policy, self.opt, self.sched, self.cfg.optim.grad_clip)
        self.policy.eval()
        self.step_idx += 1
        return {"step": self.step_idx - 1, "sft_loss": loss_sum, "grad_norm": gn, "lr": lr,
                "tokens": total, "time_step_s": time.perf_counter() - t0}

    def sample_batch(self, encoded: list) -> list:
        return [encoded[self.rng.randrange(len(encoded))] for _ in range(self.cfg.batch_size)]

    def state_dict(self) -> dict:
        return training_state(self.step_idx, self.opt, self.sched, self.rng)

    def load_state_dict(self, st: dict) -> None:
        self.step_idx = load_training_state(st, self.opt, self.sched, self.rng)
