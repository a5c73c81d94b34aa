"""Reward shaping and batch filters applied between verification and the loss.

- DAPO dynamic sampling: :func:`filter_groups` drops groups whose rewards are all equal (their
  group-relative advantages are all zero, so they carry no gradient); :class:`DynamicSampler`
  keeps requesting groups until a batch is full, with a cap on rounds.
- ZAYA1 length reward: :func:`length_bonus` gives ``dr_i`` to add to the advantage numerator
  (``compute_advantages("maxrl", r, G, bonus=dr)``); :func:`linear_ramp` ramps its coefficient.
- LZ77 repetition gate: :func:`chunk_compression_ratios`, :func:`is_repetitive`,
  :func:`repetition_gate` (reward zeroed for degenerate, looping text).
- Overlong responses: :func:`overlong_shaping` (set the reward, mask out of the loss, or DAPO's
  soft overlong punishment).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch
from torch import Tensor

from train.rl.advantages import group_index, group_sum

__all__ = [
    "all_equal", "filter_groups", "DynamicSampler", "SampleReport",
    "LengthRewardConfig", "length_bonus", "linear_ramp",
    "chunk_compression_ratios", "is_repetitive", "repetition_gate",
    "OverlongConfig", "overlong_shaping", "OVERLONG_MODES",
]

G = TypeVar("G")

# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling


def _rewards_of(group: Any) -> Sequence[float]:
    """A group's rewards: its ``rewards`` attribute, or the group itself if it is a sequence."""
    rewards = getattr(group, "rewards", group)
    return rewards.tolist() if torch.is_tensor(rewards) else list(rewards)


def all_equal(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True if every reward equals the first (within ``tol``); an empty group counts as equal."""
    rewards = list(rewards)
    return all(abs(r - rewards[0]) <= tol for r in rewards)


def filter_groups(groups: Sequence[G], rewards_of: Callable[[G], Sequence[float]] = _rewards_of
                  ) -> tuple[list[G], int]:
    """Keep the groups whose rewards differ; return ``(kept, number_dropped)``."""
    kept = [g for g in groups if not all_equal(rewards_of(g))]
    return kept, len(groups) - len(kept)


@dataclass
class SampleReport(Generic[G]):
    groups: list[G]         # exactly ``batch_groups`` groups when ``full``
    dropped: int            # groups dropped for carrying no signal
    surplus: int            # informative groups sampled beyond the batch and discarded
    rounds: int             # calls made to the sampling function
    requested: int          # groups requested in total
    full: bool


@dataclass
class DynamicSampler(Generic[G]):
    """Fill a batch of ``batch_groups`` informative groups (DAPO dynamic sampling).

    ``sample(n)`` returns about ``n`` new groups (each with rewards, see :func:`filter_groups`).
    Each round requests ``ceil(missing * oversample)`` groups; after ``max_rounds`` rounds the
    report says ``full=False`` and holds what was found (the caller decides to train on a short
    batch or to stop). Totals over the sampler's life are kept in ``total_dropped`` and
    ``total_requested``.
    """

    sample: Callable[[int], Sequence[G]]
    batch_groups: int
    max_rounds: int = 8
    oversample: float = 1.0
    rewards_of: Callable[[G], Sequence[float]] = _rewards_of
    total_dropped: int = field(default=0, init=False)
    total_requested: int = field(default=0, init=False)

    def __post_init__(self):
        if self.batch_groups < 1 or self.max_rounds < 1 or self.oversample < 1:
            raise ValueError("DynamicSampler needs batch_groups >= 1, max_rounds >= 1, oversample >= 1")

    def fill(self) -> SampleReport:
        kept: list[G] = []
        dropped = requested = rounds = 0
        while len(kept) < self.batch_groups and rounds < self.max_rounds:
            ask = math.ceil((self.batch_groups - len(kept)) * self.oversample)
            good, bad = filter_groups(self.sample(ask), self.rewards_of)
            kept += good
            dropped, requested, rounds = dropped + bad, requested + ask, rounds + 1
        self.total_dropped += dropped
        self.total_requested += requested
        surplus = max(0, len(kept) - self.batch_groups)
        return SampleReport(kept[:self.batch_groups], dropped, surplus, rounds, requested,
                            full=len(kept) >= self.batch_groups)


# ----------------------------------------------------------------------------------------------
# ZAYA1 length reward


@dataclass
class LengthRewardConfig:
    """ZAYA1's length bonus. ``t_len`` and ``t_acc`` are not given in the source; defaults are ours.

    coef: c, ramped to 1 over training (:func:`linear_ramp`);
    target_pass: p*, the pass rate the gate is centred on;
    t_acc: T_acc, the gate opens when the group pass rate p > p* - T_acc (and p > 1/G);
    t_len: T_l in tokens; correct responses within T_l of the shortest correct one get the full 1/2.
    """

    coef: float = 1.0
    target_pass: float = 0.75
    t_acc: float = 0.25
    t_len: int = 128


def length_bonus(rewards, lengths, groups: int | Tensor, cfg: LengthRewardConfig | None = None,
                 correct=None, coef: float | None = None) -> Tensor:
    """``dr_i = c * p * m_i * lambda_i`` per rollout (ZAYA1), to add to the advantage numerator.

    ``lambda_i = 1/2 - clamp((l_i - l_min) / (l_max - l_min), 0, 1)``, or 1/2 if
    ``l_i <= l_min + T_l``, with ``l_min``/``l_max`` over the group's correct responses;
    gate ``m_i = [p > p* - T_acc] [p > 1/G] [r_i = 1]`` with p the group's pass rate.
    ``correct`` defaults to ``rewards >= 1``; ``coef`` overrides ``cfg.coef`` (for a ramp).
    """
    cfg = cfg or LengthRewardConfig()
    r = torch.as_tensor(rewards, dtype=torch.float32)
    length = torch.as_tensor(lengths, dtype=torch.float32)
    ok = (r >= 1) if correct is None else torch.as_tensor(correct, dtype=torch.bool)
    if not (r.shape == length.shape == ok.shape) or r.dim() != 1:
        raise ValueError(f"rewards {tuple(r.shape)}, lengths {tuple(length.shape)} and correct "
                         f"{tuple(ok.shape)} must be the same 1-D shape")
    idx, k = group_index(groups, r.numel())
    size = group_sum(torch.ones_like(r), idx, k)
    p = group_sum(ok.float(), idx, k) / size
    inf = torch.tensor(math.inf)
    l_min = torch.full((k,), math.inf).scatter_reduce(0, idx, torch.where(ok, length, inf), "amin")[idx]
    l_max = torch.full((k,), -math.inf).scatter_reduce(0, idx, torch.where(ok, length, -inf), "amax")[idx]
    span = torch.where(ok, l_max - l_min, 0.0)
    frac = torch.where(span > 0, (torch.where(ok, length - l_min, 0.0)) / span.clamp(min=1e-9), 0.0)
    lam = torch.where(length <= l_min + cfg.t_len, 0.5, 0.5 - frac.clamp(0, 1))
    gate = (p > cfg.target_pass - cfg.t_acc) & (p > 1 / size) & ok
    c = cfg.coef if coef is None else coef
    return torch.where(gate, c * p * lam, 0.0)


def linear_ramp(step: int, ramp_steps: int, final: float = 1.0) -> float:
    """``final * min(1, step / ramp_steps)``; ``final`` at once if ``ramp_steps <= 0``."""
    return final if ramp_steps <= 0 else final * min(1.0, max(step, 0) / ramp_steps)


# ----------------------------------------------------------------------------------------------
# LZ77 repetition gate


def chunk_compression_ratios(text: str | bytes, chunk_size: int = 2048) -> list[float]:
    """Compressed/raw byte ratio of each ``chunk_size``-byte chunk of ``text`` (UTF-8).

    One raw-deflate stream (``zlib.compressobj(level=1, wbits=-10)``: fastest level, 1 KiB LZ77
    window) runs over the whole text; after each chunk ``Z_SYNC_FLUSH`` forces out its bytes, so a
    chunk's compressed size is what that chunk added to the stream (the window still reaches back
    into the previous chunk). Natural text stays around 0.4-0.7; a loop repeating a short span
    drops towards 0.01-0.03. Each flush costs about 5 bytes, so chunks much under ~200 bytes
    cannot fall below 0.05.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    comp = zlib.compressobj(level=1, wbits=-10)
    ratios = []
    for start in range(0, len(data), chunk_size):
        raw = data[start:start + chunk_size]
        out = comp.compress(raw) + comp.flush(zlib.Z_SYNC_FLUSH)
        ratios.append(len(out) / len(raw))
    return ratios


def is_repetitive(text: str | bytes, threshold: float = 0.05, chunk_size: int = 2048) -> bool:
    """True if any chunk compresses below ``threshold`` (ZAYA1: 0.05)."""
    return any(r < threshold for r in chunk_compression_ratios(text, chunk_size))


def repetition_gate(reward: float, text: str | bytes, threshold: float = 0.05,
                    chunk_size: int = 2048) -> float:
    """The reward, or 0.0 if the response is repetitive."""
    return 0.0 if is_repetitive(text, threshold, chunk_size) else reward


# ----------------------------------------------------------------------------------------------
# overlong responses

OVERLONG_MODES = ("none", "reward", "mask", "soft")


@dataclass
class OverlongConfig:
    """What to do with responses cut at the length limit.

    none: nothing; reward: a truncated response's reward becomes ``truncated_reward``;
    mask: truncated responses are removed from the loss (keep = False; DAPO overlong filtering);
    soft: DAPO's soft overlong punishment added to every reward: 0 up to ``max_len - buffer_len``
    tokens, then falling linearly to ``-penalty`` at ``max_len``, and ``-penalty`` beyond.
    """

    mode: str = "none"
    truncated_reward: float = 0.0
    max_len: int = 0
    buffer_len: int = 0
    penalty: float = 1.0

    def __post_init__(self):
        if self.mode not in OVERLONG_MODES:
            raise ValueError(f"unknown overlong mode {self.mode!r}; choose one of {', '.join(OVERLONG_MODES)}")
        if self.mode == "soft" and not 0 < self.buffer_len <= self.max_len:
            raise ValueError("overlong mode 'soft' needs 0 < buffer_len <= max_len")


def overlong_shaping(rewards, lengths, truncated, cfg: OverlongConfig) -> tuple[Tensor, Tensor]:
    """Return ``(rewards, keep)``: shaped rewards and a bool per rollout, False to drop it from the loss."""
    r = torch.as_tensor(rewards, dtype=torch.float32).clone()
    cut = torch.as_tensor(truncated, dtype=torch.bool)
    keep = torch.ones_like(cut)
    if cfg.mode == "reward":
        r = torch.where(cut, cfg.truncated_reward, r)
    elif cfg.mode == "mask":
        keep = ~cut
    elif cfg.mode == "soft":
        length = torch.as_tensor(lengths, dtype=torch.float32)
        start = cfg.max_len - cfg.buffer_len
        r = r - cfg.penalty * ((length - start) / cfg.buffer_len).clamp(0, 1)
    return r, keep
