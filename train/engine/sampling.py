"""Token sampling shared by engines: temperature, top-k, top-p, min-p, with per-row generators so a
row's samples depend only on its own seed, never on what else is in the batch."""
from __future__ import annotations

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


def shape_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p truncation applied (-inf outside)."""
    x = logits / p.temperature
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
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, _MASK)
    return x


def sample(logits: torch.Tensor, p: SamplingParams, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 ``logits`` [B, V].

    Returns (token ids [B], logprobs [B]); the logprob is that of the chosen token under
    softmax(logits / temperature) (temperature 1 when greedy), before truncation, which is the
    distribution the trainer recomputes.
    """
    if p.greedy:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / p.temperature, dim=-1)
        probs = torch.softmax(shape_logits(logits, p), dim=-1)
        u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators]).to(probs.dtype)
        cdf = probs.cumsum(-1)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        # never pick a token that truncation removed (possible only through rounding at the edges)
        zero = probs.gather(-1, tok[:, None]).squeeze(-1) == 0
        if bool(zero.any()):
            tok = torch.where(zero, probs.argmax(-1), tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
