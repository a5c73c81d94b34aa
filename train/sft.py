"""Supervised fine-tuning on (prompt, response) pairs, the loss on response tokens only.

Pairs come from environment reference solutions rendered as reasoning traces
(:func:`reference_pairs`) or from a jsonl file with ``prompt`` and ``response`` columns
(:func:`load_pairs`).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from train.batching import index_batch, make_batch, micro_batches
from train.model.modeling import CausalLM, token_logprobs
from train.optim import OptimConfig, build_optimizer, clip_and_step, load_training_state, training_state


@dataclass
class SFTConfig:
    steps: int = 100
    batch_size: int = 32
    micro_batch_size: int = 32
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10))
    max_len: int = 1024
    chat_template: bool = True
    system_prompt: str | None = None
    seed: int = 0


def render_trace(reasoning: str, answer_text: str) -> str:
    """A reasoning trace in the policy's format: a think block, then the answer."""
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{answer_text.strip()}"


def reference_pairs(env_ids: list[str], n: int, seed: int = 0, difficulties=(0,), think: bool = True,
                    env_kwargs: dict | None = None) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs from the environments' reference solutions."""
    from envs.base import get_env

    rng = random.Random(seed)
    envs = {e: get_env(e, **((env_kwargs or {}).get(e, {}))) for e in env_ids}
    out = []
    for _ in range(n):
        env_id = rng.choice(env_ids)
        env = envs[env_id]
        prob = env.generate(rng.getrandbits(62), rng.choice(list(difficulties)))
        ref = env.reference_response(prob)
        reasoning = prob.meta.get("reasoning") if isinstance(prob.meta, dict) else None
        out.append((prob.prompt, render_trace(reasoning or "I solve the problem and check the answer.", ref)
                    if think else ref))
    return out


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, response) pairs from a jsonl file (or anything ``datasets`` reads) with those columns."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"SFT data file {str(p)!r} does not exist")
    if p.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        from datasets import load_dataset

        rows = list(load_dataset(p.suffix.lstrip("."), data_files=str(p), split="train"))
    if rows and not {"prompt", "response"} <= set(rows[0]):
        raise ValueError(f"SFT data {str(p)!r} needs columns 'prompt' and 'response'; found {sorted(rows[0])}")
    return [(r["prompt"], r["response"]) for r in rows]


def encode_pair(tokenizer, prompt: str, response: str, chat: bool, system: str | None) -> tuple[list[int], list[int]]:
    from train.rl.trainer import encode_prompt

    p = encode_prompt(tokenizer, prompt, chat, system)
    r = tokenizer.encode(response, add_special_tokens=False, verbose=False)
    if chat and tokenizer.eos_token_id is not None:
        r = r + [tokenizer.eos_token_id]
    return p, r


class SFTTrainer:
    def __init__(self, policy: CausalLM, tokenizer, cfg: SFTConfig):
        self.policy, self.tokenizer, self.cfg = policy, tokenizer, cfg
        self.opt, self.sched = build_optimizer(policy, cfg.optim)
        self.rng = random.Random(cfg.seed)
        self.step_idx = 0

    def encode(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        out = []
        for pr, rs in pairs:
            p, r = encode_pair(self.tokenizer, pr, rs, self.cfg.chat_template, self.cfg.system_prompt)
            if len(p) + len(r) > self.cfg.max_len:
                raise ValueError(f"an SFT example has {len(p) + len(r)} tokens > max_len {self.cfg.max_len}; "
                                 f"trim the data (cascade.trim) or raise max_len")
            out.append((p, r))
        return out

    def step(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimizer step on encoded (prompt ids, response ids) examples; mean token NLL."""
        t0 = time.perf_counter()
        pad = int(self.policy.config.pad_token_id or 0)
        batch = make_batch([p for p, _ in examples], [r for _, r in examples], pad).to(self.policy.device)
        total = float(batch.loss_mask.sum().clamp(min=1))
        self.policy.train()
        loss_sum = 0.0
        for s in micro_batches(len(examples), self.cfg.micro_batch_size):
            b = index_batch(batch, s)
            lp = token_logprobs(self.policy, b.input_ids, b.attention_mask)
            loss = -(lp * b.loss_mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        gn = clip_and_step(self.policy, self.opt, self.sched, self.cfg.optim.grad_clip)
        self.policy.eval()
        self.step_idx += 1
        return {"step": self.step_idx - 1, "sft_loss": loss_sum, "grad_norm": gn, "lr": self.sched.get_last_lr()[0],
                "tokens": int(total), "time_step_s": time.perf_counter() - t0}

    def sample_batch(self, encoded: list) -> list:
        return [encoded[self.rng.randrange(len(encoded))] for _ in range(self.cfg.batch_size)]

    def state_dict(self) -> dict:
        return training_state(self.step_idx, self.opt, self.sched, self.rng)

    def load_state_dict(self, st: dict) -> None:
        self.step_idx = load_training_state(st, self.opt, self.sched, self.rng)
