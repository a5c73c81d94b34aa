"""Group-relative advantage estimators (outcome rewards, one scalar per rollout).

Every estimator has the signature ``fn(rewards, groups, eps=1e-6, bonus=None) -> Tensor[N]``:

- ``rewards``: ``Tensor[N]`` (or anything ``torch.as_tensor`` takes), one reward per rollout;
- ``groups``: either an ``int`` G (rollouts of one prompt are contiguous, ``N % G == 0``) or a
  ``Tensor[N]`` of group ids (any integers; groups may have different sizes);
- ``eps``: guards the divisions;
- ``bonus``: optional ``Tensor[N]``, the baseline computed from the raw rewards: added to the numerator
  under maxrl and drgrpo (ZAYA1's length reward: ``A_i = (r_i + dr_i - mean r) / mean r``), added after the
  normalisation under grpo (below).

Estimators (``ADVANTAGES``):

- ``grpo``: ``(r - mean) / (std + eps) + bonus``, std with Bessel's correction (as ``torch.std``),
  for any real rewards. A group whose rewards are all equal (``std <= eps``: all correct, all
  wrong, or one rollout) has no reward scale to normalise by: its advantages are its bonus alone
  (0 without one), the same value maxrl gives an all-correct group. The bonus is not divided by the
  std: a group whose rewards differ by a hair (soft overlong shaping took one of four correct answers to
  0.99976) had its 0.375 length bonus divided by a std of 1e-4 (3,000), and by ``eps`` it became ~4e5. So
  ``|A| <= sqrt(G - 1) + max |bonus|``, continuous in the rewards;
- ``drgrpo``: ``r - mean + bonus`` (Dr.GRPO drops the std); any real rewards;
- ``maxrl``: ``(r - mean + bonus) / mean`` (ZAYA1 / MaxRL). MaxRL is the policy gradient of
  ``log E[r]`` (for 0/1 rewards, the log of the pass rate): ``grad log E[r] = E[(r - E r) grad
  log pi] / E[r]``. That needs rewards >= 0 (for non-binary rewards in ``[0, 1]``, e.g. partial
  credit, the same formula is the gradient of ``log E[r]``, and it does not depend on the
  reward's scale). Negative rewards (``reward=score`` on ``[-1, 1]`` verifier scores, DAPO's
  soft overlong penalty) raise ``ValueError``: the log of a signed mean is undefined and the
  division flips or blows up (``[1, -0.9, 0, 0]`` gave ``[39, -37, -1, -1]``); use
  ``reward=correct``, or grpo/drgrpo for signed rewards. A group with ``mean <= eps`` (all
  rewards 0) gets advantage 0, its bonus included (the length bonus is 0 there anyway: it needs
  ``r_i = 1``); a group of equal positive rewards gets ``bonus / mean``;
- ``rloo``: ``r_i - mean_{j != i} r_j`` (leave-one-out baseline; groups need >= 2 rollouts).

A group of one rollout gets advantage 0 (plus its bonus; divided by its reward under maxrl)
under grpo, drgrpo and maxrl.
:func:`compute_advantages` dispatches by name and optionally whitens over the batch (off by default).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from train.rl import Registry

AdvantageFn = Callable[..., Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

__all__ = ["ADVANTAGES", "get_advantage", "compute_advantages", "group_index", "group_sum", "whiten"]


def get_advantage(name: str) -> AdvantageFn:
    return ADVANTAGES.get(name)


def group_index(groups: int | Tensor, n: int) -> tuple[Tensor, int]:
    """Map ``groups`` (a group size or per-rollout ids) to dense ids ``0..K-1`` and K."""
    if isinstance(groups, int):
        if groups < 1 or n % groups:
            raise ValueError(f"group size {groups} does not divide the {n} rewards")
        return torch.arange(n) // groups, n // groups
    ids = torch.as_tensor(groups)
    if ids.shape != (n,):
        raise ValueError(f"group ids have shape {tuple(ids.shape)}, expected ({n},)")
    uniq, inv = torch.unique(ids, return_inverse=True)
    return inv, len(uniq)


def group_sum(x: Tensor, idx: Tensor, k: int) -> Tensor:
    """Per-rollout sum of ``x`` over the rollout's group."""
    return torch.zeros(k, dtype=x.dtype, device=x.device).index_add_(0, idx, x)[idx]


def _prepare(rewards, groups) -> tuple[Tensor, Tensor, int, Tensor, Tensor]:
    """Rewards as float, dense group ids, number of groups, per-rollout group size and group sum."""
    r = torch.as_tensor(rewards, dtype=torch.float32) if not torch.is_tensor(rewards) else rewards.float()
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(r.shape)}")
    idx, k = group_index(groups, r.numel())
    idx = idx.to(r.device)
    count = group_sum(torch.ones_like(r), idx, k)
    total = group_sum(r, idx, k)
    return r, idx, k, count, total


def _plus(num: Tensor, bonus) -> Tensor:
    return num if bonus is None else num + torch.as_tensor(bonus, dtype=num.dtype, device=num.device)


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards, groups, eps: float = 1e-6, bonus=None) -> Tensor:
    r, idx, k, count, total = _prepare(rewards, groups)
    mean = total / count
    var = group_sum((r - mean) ** 2, idx, k) / (count - 1).clamp(min=1)
    std = var.sqrt()
    # all-equal rewards: no scale to normalise by; the advantage is the bonus alone (see module doc)
    lo = torch.full((k,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amin")[idx]
    hi = torch.full((k,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amax")[idx]
    flat = (std <= eps) | (lo == hi)
    return _plus(torch.where(flat, 0.0, (r - mean) / torch.where(flat, 1.0, std + eps)), bonus)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantage(rewards, groups, eps: float = 1e-6, bonus=None) -> Tensor:
    r, _, _, count, total = _prepare(rewards, groups)
    return _plus(r - total / count, bonus)


@ADVANTAGES.register("maxrl")
def maxrl_advantage(rewards, groups, eps: float = 1e-6, bonus=None) -> Tensor:
    r, _, _, count, total = _prepare(rewards, groups)
    if r.numel() and float(r.min()) < 0:
        raise ValueError(f"maxrl needs rewards >= 0 (it is the gradient of log E[r]); got a reward of "
                         f"{float(r.min()):g}. Use reward=correct (0/1), or advantage=grpo or drgrpo for signed "
                         "rewards (reward=score on [-1, 1], overlong penalties)")
    mean = total / count
    ok = mean > eps
    return torch.where(ok, _plus(r - mean, bonus) / torch.where(ok, mean, 1.0), 0.0)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards, groups, eps: float = 1e-6, bonus=None) -> Tensor:
    r, _, _, count, total = _prepare(rewards, groups)
    if bool((count < 2).any()):
        raise ValueError("rloo needs at least 2 rollouts in every group")
    return _plus(r - (total - r) / (count - 1), bonus)


def whiten(adv: Tensor, eps: float = 1e-6) -> Tensor:
    """Batch whitening: zero mean, unit std over all rollouts (not used by the ZAYA1 recipe)."""
    return (adv - adv.mean()) / (adv.std(unbiased=False) + eps) if adv.numel() > 1 else adv * 0


def compute_advantages(name: str, rewards, groups, *, eps: float = 1e-6, bonus=None,
                       whiten_batch: bool = False) -> Tensor:
    """Advantages by estimator name, optionally whitened over the whole batch."""
    adv = get_advantage(name)(rewards, groups, eps=eps, bonus=bonus)
    return whiten(adv, eps) if whiten_batch else adv
