"""Behavioral RL rewards: a Hugging Face sequence-classification model scores a response, and the
score is zeroed when the binary instruction checker fails (ZAYA1 stage 4)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from envs.base import Environment, Problem, Score, bounded, strip_think


class RewardModel:
    """Any ``AutoModelForSequenceClassification`` with one output (a scalar score): a local directory
    or a Hugging Face Hub id (``org/name``, through the HF cache and its offline rules). It reads the
    answer after any thinking, and a conversation longer than ``max_len`` tokens loses its beginning (the
    prompt's; a leading BOS or [CLS] stays), never the answer's end."""

    def __init__(self, path: str | Path, max_len: int = 2048, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from envs.hub import resolve_model

        p = resolve_model(path, "reward model")  # a local directory, or a Hub id through the HF cache
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"reward model directory {str(p)!r} has no config.json")
        self.tok = AutoTokenizer.from_pretrained(str(p))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(p)).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {str(p)!r} has {self.model.config.num_labels} labels; expected 1")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tok.pad_token_id
        self.max_len, self.device = max_len, device

    @property
    def _add_special(self) -> bool:
        """A chat template writes the special tokens itself (a Llama-3 template its BOS): tokenizing its text
        adds none, else the model reads BOS twice."""
        return not getattr(self.tok, "chat_template", None)

    def text(self, prompt: str, response: str) -> str:
        answer = strip_think(response).lstrip()
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(msgs, tokenize=False)
        return f"{prompt}\n{answer}"

    def ids(self, prompt: str, response: str) -> list[int]:
        """The conversation's token ids, at most ``max_len``: a longer one keeps its end (where the answer is) and
        its leading BOS or [CLS] (a Llama-3 template writes BOS, a BERT-style tokenizer adds [CLS]; cut from the
        left, the model would read none)."""
        ids = self.tok(self.text(prompt, response), add_special_tokens=self._add_special, verbose=False)["input_ids"]
        if len(ids) <= self.max_len:
            return ids
        keep = int(ids[0] in {self.tok.bos_token_id, self.tok.cls_token_id} - {None})  # (BERT-style: [CLS])
        return ids[:keep] + ids[len(ids) - self.max_len + keep:]

    @torch.no_grad()
    def score(self, prompt: str, response: str) -> float:
        ids = torch.tensor([self.ids(prompt, response)], device=self.device)
        return float(self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 0])

    @torch.no_grad()
    def score_many(self, pairs: list[tuple[str, str]], batch_size: int = 16) -> list[float]:
        """:meth:`score` of every (prompt, response), ``batch_size`` sequences per padded forward (the
        model reads each sequence's last non-pad token); one at a time without a pad token, or where the model's
        pad id is not the tokenizer's (it would read a padded sequence's score at a pad position)."""
        if self.tok.pad_token_id is None or self.model.config.pad_token_id != self.tok.pad_token_id:
            return [self.score(p, r) for p, r in pairs]
        seqs = [self.ids(p, r) for p, r in pairs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a batch
        out = [0.0] * len(seqs)
        for k in range(0, len(order), batch_size):
            part = order[k:k + batch_size]
            enc = self.tok.pad({"input_ids": [seqs[i] for i in part]}, return_tensors="pt")
            logits = self.model(**{n: v.to(self.device) for n, v in enc.items()}).logits[:, 0].float().tolist()
            for i, v in zip(part, logits):
                out[i] = v
        return out


class GatedRewardEnv(Environment):
    """Wraps an instruction-following environment: reward = sigmoid(scale * RM score) when every
    instruction is followed, else 0. ``correct`` is the checker's verdict."""

    family = "behavior"

    def __init__(self, base: Environment, rm: RewardModel, scale: float = 1.0):
        self.base, self.rm, self.scale = base, rm, scale
        self.id = base.id
        self.description = f"{base.id} gated reward-model score"

    @property
    def max_difficulty(self) -> int | None:
        """The wrapped environment's cap, read live (run-time caps lower it during a run)."""
        return self.base.max_difficulty

    @max_difficulty.setter
    def max_difficulty(self, value: int | None) -> None:
        self.base.max_difficulty = value

    # the wrapped environment's own settings (the Environment defaults would stand in for them: a code
    # environment's aggregation template, an environment without references counted as one with them)
    instruction = property(lambda self: self.base.instruction)
    aggregation_template = property(lambda self: self.base.aggregation_template)
    verify_time_limit = property(lambda self: self.base.verify_time_limit)
    no_reference_reason = property(lambda self: self.base.no_reference_reason)
    free_form = property(lambda self: self.base.free_form)
    # concurrent_verify stays False: the reward model's forward passes are compute, batched in verify_many

    def prepare(self) -> None:
        self.base.prepare()

    def extract(self, response: str) -> str | None:
        return self.base.extract(response)

    def generate(self, seed: int, difficulty: int) -> Problem:
        return self.base.generate(seed, difficulty)

    def heldout(self, seed: int, difficulty: int) -> Problem:
        return self.base.heldout(seed, difficulty)

    def heldout_texts(self) -> set[str]:
        return self.base.heldout_texts() if hasattr(self.base, "heldout_texts") else set()

    def check(self, problem: Problem, response: str) -> Score:
        s = self.base.verify(problem, response)
        return self._gated(s, self.rm.score(problem.prompt, response) if s.correct else None)

    def verify_many(self, items: list[tuple[Problem, str]]) -> list[Score]:
        """The checker on each response, then one batched reward-model pass over those that follow
        their instructions."""
        base = [self.base.verify(p, r) for p, r in items]
        ok = [i for i, s in enumerate(base) if s.correct]
        raws = dict(zip(ok, self.rm.score_many([(items[i][0].prompt, items[i][1]) for i in ok]))) if ok else {}
        return [bounded(self._gated(s, raws.get(i))) if isinstance(r, str) else self.verify(p, r)
                for i, (s, (p, r)) in enumerate(zip(base, items))]

    def _gated(self, s: Score, raw: float | None) -> Score:
        if not s.correct:
            return Score(0.0, False, s.format_ok, {**s.info, "gate": "instructions not followed"})
        x = self.scale * raw  # a stable sigmoid: exp(-x) overflows for x below about -709
        reward = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
        return Score(reward, True, True, {**s.info, "rm_score": raw})

    def reference_response(self, problem: Problem) -> str:
        return self.base.reference_response(problem)


def build_tiny_reward_model(out: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 sequence-classification model with a Cascade tokenizer (tests, demos)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=2048)
    model = Qwen3ForSequenceClassification(cfg)
    out = Path(out)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
