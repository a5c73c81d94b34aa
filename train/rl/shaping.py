"""Reward shaping and batch filters applied between verification and the loss.

- DAPO dynamic sampling: :func:`filter_groups` drops groups whose rewards are all equal (their
  group-relative advantages are all zero, so they carry no gradient); :class:`DynamicSampler`
  keeps requesting groups until a batch is full, with a cap on rounds.
- ZAYA1 length reward (eqs. 8-10): :func:`length_bonus` gives ``dr_i`` to add to the advantage
  numerator (``compute_advantages("maxrl", r, G, bonus=dr)``); :class:`LengthRewardState` holds its
  run state (p* per data source, the position of the cross-stage c schedule).
- LZ77 repetition gate (eq. 16) on the rollout's token-id bytes: :func:`chunk_compression_ratios`,
  :func:`is_repetitive`, :func:`repetition_gate` (a positive reward zeroed for looping output).
- Rare-token canary: :func:`rare_token_fractions`.
- Overlong responses: :func:`overlong_shaping` (set the reward, mask out of the loss, or DAPO's
  soft overlong punishment).
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch
from torch import Tensor

from train.rl.advantages import group_index, group_sum

__all__ = [
    "all_equal", "filter_groups", "DynamicSampler", "SampleReport",
    "LengthRewardConfig", "LengthRewardState", "length_bonus", "data_source",
    "ID_BYTES", "SYNC_FLUSH_OVERHEAD", "token_id_bytes", "chunk_compression_ratios", "is_repetitive",
    "repetition_gate", "RARE_TOKEN_PERCENTS", "rare_token_fractions",
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
    """Keep the groups whose rewards differ; return ``(kept, number_dropped)``. As ZAYA1 states it: on the
    rewards, before any length bonus (so an all-solved group, which would get bonuses, is dropped too)."""
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
# ZAYA1 length reward (eqs. 8-10)


@dataclass
class LengthRewardConfig:
    """ZAYA1's length bonus and its coefficient schedule.

    l_max: the constant l_max of eq. 9, in tokens; 0 takes the stage's ``sampling.max_new_tokens``.
        The report says l_max is a constant, not its value: this default is Cascade's choice.
    t_len: T_l in tokens: correct responses within T_l of the shortest correct one get the full 1/2
        (not given in the report; Cascade's choice).
    t_acc: T_acc: the gate opens when the group solve rate p > p* - T_acc (and p > 1/G); not given
        in the report; Cascade's choice.
    coef_start, coef, ramp_steps: the coefficient c follows ONE schedule over the whole run,
        ``coef_start -> coef`` linearly over ``ramp_steps`` RL steps of stages with the length
        reward, counted across stages (:class:`LengthRewardState`), then ``coef``. The report: c
        rises from a small value in the warm-up stage to 1.0 by the math stage; the small value
        and the linear shape are Cascade's; 632 = the warm-up's 232 steps + RLVE's 400, so c = 1.0
        from the first math step.
    """

    l_max: int = 0
    t_len: int = 128
    t_acc: float = 0.25
    coef_start: float = 0.1
    coef: float = 1.0
    ramp_steps: int = 632

    def __post_init__(self):
        if self.l_max < 0 or self.t_len < 0 or self.ramp_steps < 0:
            raise ValueError(f"length_cfg: l_max ({self.l_max}), t_len ({self.t_len}) and ramp_steps "
                             f"({self.ramp_steps}) must be >= 0")
        if not 0.0 <= self.t_acc <= 1.0:
            raise ValueError(f"length_cfg.t_acc must be in [0, 1], got {self.t_acc}")
        if self.coef_start < 0 or self.coef < 0:
            raise ValueError(f"length_cfg: coef_start ({self.coef_start}) and coef ({self.coef}) must be >= 0")

    def coef_at(self, step: int) -> float:
        """c after ``step`` schedule steps: ``coef_start + (coef - coef_start) * min(1, step / ramp_steps)``."""
        if self.ramp_steps <= 0:
            return float(self.coef)
        t = min(1.0, max(step, 0) / self.ramp_steps)
        return float(self.coef_start + (self.coef - self.coef_start) * t)


def length_bonus(rewards, lengths, groups: int | Tensor, cfg: LengthRewardConfig, p_star, coef: float,
                 l_max: float | None = None) -> Tensor:
    """``dr_i = c * p * m_i * lambda_i`` per rollout (ZAYA1 eqs. 8-10), for the advantage numerator.

    ``rewards`` are the rewards AFTER the gates (a correct answer the repetition gate zeroed is not
    solved); ``r_i = 1`` (full credit, ``reward >= 1``) marks a solved rollout. Per group:
    ``p`` = its solve rate, ``l_min`` = its shortest solved response;
    ``lambda_i = 1/2 - clamp((l_i - l_min) / (l_max - l_min), 0, 1)``, or 1/2 if ``l_i <= l_min + T_l``,
    with ``l_max`` the constant ``l_max`` (default ``cfg.l_max``); where ``l_max <= l_min`` every
    response longer than ``l_min + T_l`` is already past ``l_max`` and gets -1/2 (the clamp's limit);
    gate ``m_i = [p > p* - T_acc] [p > 1/G] [r_i = 1]``. ``p_star``: a float, or one value per
    rollout (the running maximum solve rate of the rollout's data source, :class:`LengthRewardState`).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    length = torch.as_tensor(lengths, dtype=torch.float64)
    if not r.shape == length.shape or r.dim() != 1:
        raise ValueError(f"rewards {tuple(r.shape)} and lengths {tuple(length.shape)} must be the same 1-D shape")
    l_max = float(cfg.l_max if l_max is None else l_max)
    if l_max <= 0:
        raise ValueError(f"length reward needs a constant l_max > 0 tokens, got {l_max:g}")
    ps = torch.as_tensor(p_star, dtype=torch.float64)
    ps = ps.expand(r.shape) if ps.dim() == 0 else ps
    if ps.shape != r.shape:
        raise ValueError(f"p_star {tuple(ps.shape)} must be a scalar or one value per rollout {tuple(r.shape)}")
    solved = r >= 1
    idx, k = group_index(groups, r.numel())
    size = group_sum(torch.ones_like(r), idx, k)  # per rollout: its group's size
    p = group_sum(solved.double(), idx, k) / size
    l_min = torch.full((k,), math.inf, dtype=torch.float64).scatter_reduce(
        0, idx, torch.where(solved, length, math.inf), "amin")[idx]
    l_min = torch.where(torch.isfinite(l_min), l_min, 0.0)  # groups with nothing solved: gated off below
    span = l_max - l_min
    frac = torch.where(span > 0, (length - l_min) / span.clamp(min=1e-9), 1.0).clamp(0, 1)
    lam = torch.where(length <= l_min + cfg.t_len, 0.5, 0.5 - frac)
    gate = (p > ps - cfg.t_acc) & (p > 1 / size) & solved
    return torch.where(gate, coef * p * lam, 0.0).float()


@dataclass
class LengthRewardState:
    """Run state of the length reward, checkpointed with the trainer and handed from stage to stage.

    ``p_star``: the running maximum solve rate of each data source (environment id; TTC aggregation
    prompts of an environment are their own source, see :func:`data_source`), where a batch's solve
    rate of a source is the share of its rollouts with ``r_i = 1`` after the gates among the groups
    trained on. ``steps``: the position of the c schedule (RL steps with the length reward so far
    in the whole run, all stages).
    """

    p_star: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def observe(self, sources: Sequence[str], rewards) -> None:
        """Raise each source's p* to this batch's solve rate of that source if it is higher."""
        solved = (torch.as_tensor(rewards, dtype=torch.float64) >= 1).tolist()
        if len(solved) != len(sources):
            raise ValueError(f"{len(sources)} sources for {len(solved)} rewards")
        hits: dict[str, list[int]] = {}
        for s, ok in zip(sources, solved):
            h = hits.setdefault(s, [0, 0])
            h[0], h[1] = h[0] + int(ok), h[1] + 1
        for s, (n_ok, n) in hits.items():
            self.p_star[s] = max(self.p_star.get(s, 0.0), n_ok / n)

    def bonus(self, cfg: LengthRewardConfig, rewards, lengths, groups, sources: Sequence[str],
              l_max: float | None = None) -> tuple[Tensor, dict[str, float]]:
        """One RL step of the length reward: update p* with this batch (so a source's first batch
        sets its p*), compute ``dr`` with c at the schedule's current position, advance the schedule.
        Returns ``(dr, metrics)``."""
        self.observe(sources, rewards)
        c = cfg.coef_at(self.steps)
        ps = torch.tensor([self.p_star[s] for s in sources], dtype=torch.float64)
        dr = length_bonus(rewards, lengths, groups, cfg, ps, c, l_max)
        self.steps += 1
        return dr, {"length_coef": c, "length_bonus_mean": float(dr.mean()) if dr.numel() else 0.0,
                    "length_bonus_frac": float((dr != 0).float().mean()) if dr.numel() else 0.0}

    def state_dict(self) -> dict:
        """Plain JSON-serialisable state."""
        return {"p_star": dict(self.p_star), "steps": int(self.steps)}

    def load_state_dict(self, st: dict) -> None:
        if not isinstance(st, dict) or set(st) != {"p_star", "steps"}:
            raise ValueError(f"length reward state must hold exactly 'p_star' and 'steps', got {st!r}")
        self.p_star = {str(k): float(v) for k, v in st["p_star"].items()}
        self.steps = int(st["steps"])


def data_source(env_id: str, meta: dict | None = None) -> str:
    """The data source a problem counts under for p*: its environment id, with ``+aggregation``
    for TTC aggregation prompts built from the environment's problems (they see candidate answers,
    so their solve rate is not the plain problems')."""
    return env_id + "+aggregation" if meta and meta.get("aggregation") else env_id


# ----------------------------------------------------------------------------------------------
# LZ77 repetition gate (ZAYA1 eq. 16)

ID_BYTES = 4             # token ids as 4-byte little-endian unsigned ints (vocabularies pass 65,536 ids)
SYNC_FLUSH_OVERHEAD = 4  # bytes Z_SYNC_FLUSH appends: the LEN/NLEN (00 00 FF FF) of an empty stored block


def token_id_bytes(token_ids: Sequence[int]) -> bytes:
    """The raw bytes of a token-id sequence: each id as a 4-byte little-endian unsigned int."""
    ids = [int(t) for t in token_ids]
    if ids and (min(ids) < 0 or max(ids) >= 1 << (8 * ID_BYTES)):
        raise ValueError(f"token ids must lie in [0, 2**{8 * ID_BYTES}), got {min(ids)}..{max(ids)}")
    return struct.pack(f"<{len(ids)}I", *ids)


def chunk_compression_ratios(token_ids: Sequence[int], chunk_tokens: int = 512) -> list[float]:
    """Per-chunk LZ77 compression ratio of a rollout's token ids (ZAYA1 eq. 16).

    The ids' raw bytes (:func:`token_id_bytes`) are cut into chunks of ``chunk_tokens`` tokens, a
    final shorter chunk merged into its predecessor (a sequence shorter than one chunk is one
    chunk). One raw-deflate stream (``zlib.compressobj(level=1, wbits=-10)``: fastest level, 1 KiB
    LZ77 window, i.e. 256 tokens) runs over all chunks; after each, ``Z_SYNC_FLUSH`` forces out its
    bytes, so a chunk's output is what it added to the stream (the window reaches back into the
    previous chunk). Ratio = (chunk output - :data:`SYNC_FLUSH_OVERHEAD`) / chunk raw bytes; the
    flush's 3-bit block header and byte padding (under one byte) stay counted.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    data = token_id_bytes(token_ids)
    n = len(data) // ID_BYTES
    if n == 0:
        return []
    step = chunk_tokens * ID_BYTES
    bounds = list(range(0, n // chunk_tokens * step, step)) or [0]
    ends = bounds[1:] + [len(data)]  # the last chunk runs to the end: a short tail joins it
    comp = zlib.compressobj(level=1, wbits=-10)
    ratios = []
    for s, e in zip(bounds, ends):
        raw = data[s:e]
        out = comp.compress(raw) + comp.flush(zlib.Z_SYNC_FLUSH)
        ratios.append((len(out) - SYNC_FLUSH_OVERHEAD) / len(raw))
    return ratios


def is_repetitive(token_ids: Sequence[int], threshold: float = 0.05, chunk_tokens: int = 512) -> bool:
    """True if any chunk's ratio is below ``threshold`` (ZAYA1: 0.05)."""
    return any(r < threshold for r in chunk_compression_ratios(token_ids, chunk_tokens))


def repetition_gate(reward: float, token_ids: Sequence[int], threshold: float = 0.05, chunk_tokens: int = 512) -> float:
    """The reward, or ``min(reward, 0)`` if the rollout is repetitive: the gate zeroes a positive
    reward but never lifts a negative one, so a looping wrong answer never scores above a plain
    wrong one."""
    return min(reward, 0.0) if is_repetitive(token_ids, threshold, chunk_tokens) else reward


# ----------------------------------------------------------------------------------------------
# rare-token canary

RARE_TOKEN_PERCENTS = (10, 5, 2, 1)


def rare_token_fractions(token_seqs: Sequence[Sequence[int]], vocab_size: int,
                         percents: Sequence[int] = RARE_TOKEN_PERCENTS) -> dict[str, float]:
    """ZAYA1's rare-token canary: the share of tokens whose id lies in the top ``pct`` % of the id
    range ``[0, vocab_size)``, i.e. ``id >= ceil(vocab_size * (100 - pct) / 100)``, for each
    ``pct``. Keys ``rare_token_top{pct}``; 0.0 when there are no tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    cuts = {}
    for pct in percents:
        if not 0 < pct <= 100:
            raise ValueError(f"rare-token percents must be in (0, 100], got {pct}")
        cuts[pct] = -(-vocab_size * (100 - pct) // 100)
    ids = torch.tensor([int(t) for s in token_seqs for t in s], dtype=torch.long)
    n = max(ids.numel(), 1)
    return {f"rare_token_top{pct:g}": float((ids >= cut).sum()) / n for pct, cut in cuts.items()}


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
