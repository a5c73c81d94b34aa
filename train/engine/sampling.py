"""Token sampling shared by engines: logit bias, min_tokens, repetition/presence/frequency penalties,
temperature, top-k, top-p, min-p, with counter-based per-row random numbers so a row's samples depend only
on its own seed and step, never on what else is in the batch."""
from __future__ import annotations

import numpy as np
import torch

from train.engine.base import SamplingParams

_MASK = float("-inf")


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one completion, derived from the request seed (SplitMix64 steps)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & (2**64 - 1)
    for _ in range(2):
        x ^= x >> 31
        x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return x & (2**63 - 1)


_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def uniforms(seeds: np.ndarray, step: int) -> np.ndarray:
    """One uniform in [0, 1) per row: SplitMix64 of (row seed, step), counter-based (no generator
    state), so row r's number at step t is the same whatever else is in the batch. ``seeds`` uint64."""
    with np.errstate(over="ignore"):
        z = seeds + np.uint64(step + 1) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class LogitsProcessors:
    """vLLM's logits processors for the rows of one batch (train/engine/base.py's ``SamplingParams``), in vLLM's
    order: ``logit_bias`` added, the stop tokens masked while fewer than ``min_tokens`` are out (every row of a batch
    has sampled as many tokens as the step's index), then the penalties, from which tokens each row's prompt holds
    (repetition penalty) and how often each row has sampled each token so far; rows follow the batch as it shrinks
    (:meth:`keep`). Built only for a request that asks for one of them (dense [rows, vocab] counts for penalties)."""

    def __init__(self, p: SamplingParams, prompts: list[list[int]], vocab: int, device, stop_ids=()):
        self.p = p
        rows = len(prompts)
        self.bias = None
        if p.logit_bias:
            p.check_vocab(vocab)
            self.bias = torch.zeros(vocab, device=device)
            self.bias[torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)] = torch.tensor(
                list(p.logit_bias.values()), device=device)
        self.stop_ids = torch.tensor(sorted(t for t in stop_ids if t < vocab), dtype=torch.long, device=device)
        self.counts = self.in_prompt = None
        if p.penalized:
            self.counts = torch.zeros(rows, vocab, device=device)
        if p.repetition_penalty != 1:
            self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            for r, ids in enumerate(prompts):
                self.in_prompt[r, torch.tensor(ids, dtype=torch.long, device=device)] = True

    def apply(self, logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        """The processed logits for the token at index ``step`` (a new tensor; ``logits`` [rows, vocab] fp32
        untouched)."""
        p, x = self.p, logits.clone()
        if self.bias is not None:
            x += self.bias
        if step < p.min_tokens and len(self.stop_ids):
            x[:, self.stop_ids] = _MASK
        if self.counts is None:
            return x
        seen = self.counts > 0
        if self.in_prompt is not None:
            hit = seen | self.in_prompt
            x = torch.where(hit, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.frequency_penalty:
            x -= p.frequency_penalty * self.counts
        if p.presence_penalty:
            x -= p.presence_penalty * seen.to(x.dtype)
        return x

    def add(self, tok: torch.Tensor) -> None:
        """Count each row's sampled token (``tok`` [rows])."""
        if self.counts is not None:
            self.counts[torch.arange(len(tok), device=tok.device), tok] += 1

    def keep(self, sel: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts = self.counts.index_select(0, sel)
        if self.in_prompt is not None:
            self.in_prompt = self.in_prompt.index_select(0, sel)


def shape_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with min-p, then top-k, then top-p truncation applied (-inf outside), in vLLM
    v1's order (its sampler: temperature, min-p, top-k/top-p), so a vLLM server and this engine sample one
    distribution."""
    x = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, _MASK)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, _MASK)
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, _MASK)
    return x


def truncates(p: SamplingParams) -> bool:
    return bool(p.top_k) or p.top_p < 1.0 or p.min_p > 0.0


def sample(logits: torch.Tensor, p: SamplingParams, seeds: np.ndarray | None = None,
           step: int = 0, native: bool = False,
           processors: LogitsProcessors | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 ``logits`` [B, V]; ``seeds`` (uint64 [B], one per row, unused
    when greedy) with ``step`` (the index of the token being sampled) fix the random numbers.

    Returns (token ids [B], logprobs [B]); the logprob is that of the chosen token under
    softmax(logits / temperature) (temperature 1 when greedy), before truncation, which is the
    distribution the trainer recomputes. ``processors`` (for params that ask for penalties, ``logit_bias`` or
    ``min_tokens``): the token is chosen from the processed logits (greedy too, as vLLM), its logprob still taken
    before them (vLLM's default ``raw_logprobs`` likewise); the caller counts the tokens
    (:meth:`LogitsProcessors.add`).

    ``native``: untruncated sampling of fp32 CPU logits runs as one fused op of the native decode
    extension (the caller checked :func:`train.engine.native.usable`); same random numbers and the
    same inverse-transform rule, so the same tokens except where a draw falls within rounding of a
    token boundary.
    """
    if processors is not None:
        tok, _ = sample(processors.apply(logits, step), p, seeds, step, native)
        scale = 1.0 if p.greedy else p.temperature
        return tok, torch.log_softmax(logits / scale, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    if native and not p.greedy and not truncates(p):
        return torch.ops.cascade_native.sample_rows(logits, p.temperature, torch.from_numpy(uniforms(seeds, step)))
    if p.greedy:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / p.temperature, dim=-1)
        probs = torch.softmax(shape_logits(logits, p), dim=-1) if truncates(p) else logp.exp()
        u = torch.from_numpy(uniforms(seeds, step)).to(device=probs.device, dtype=torch.float64)
        # the running sum in float64, as the native op keeps it: in fp32, near 1 it cannot grow by a probability
        # under ~3e-8, so such tokens were never drawn and their mass went to a few others (up to 1000x too often)
        cdf = probs.double().cumsum(-1)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        # never pick a token that truncation removed (possible only through rounding at the edges; no host sync)
        zero = probs.gather(-1, tok[:, None]).squeeze(-1) == 0
        tok = torch.where(zero, probs.argmax(-1), tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
