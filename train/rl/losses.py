"""Policy-gradient losses over token tensors, selected by name from ``LOSSES``.

Every loss has the signature::

    loss_fn(logprobs, old_logprobs, rollout_logprobs, advantages, mask, cfg=None, *,
            ref_logprobs=None, denom=None) -> (loss: scalar Tensor, metrics: dict[str, Tensor])

- ``logprobs`` ``[B, T]``: the trainer's log-probabilities of the sampled tokens (with grad);
- ``old_logprobs`` ``[B, T]``: the same under the policy that the ratio is taken against (the
  trainer's recomputation for the weights that generated the batch, or the previous update);
- ``rollout_logprobs`` ``[B, T]`` or ``None``: what the rollout engine reported while sampling.
  ``None`` means "identical to ``old_logprobs``" (no engine/trainer mismatch correction);
- ``advantages`` ``[B]`` (one per rollout, broadcast over tokens) or ``[B, T]``;
- ``mask`` ``[B, T]`` bool/float: 1 on response tokens that count;
- ``ref_logprobs``: reference policy for the optional KL penalty (``cfg.kl_coef > 0``);
- ``denom``: overrides the aggregation denominator (the number of tokens for ``token_mean``, of
  rollouts with at least one unmasked token for the ``seq_*`` modes), for gradient accumulation
  over micro-batches: pass the count over the whole global batch so the micro-batch losses sum to
  the global loss.

Losses (the aggregation in brackets is each loss's default, used when ``cfg.agg`` is None):

- ``ppo`` / ``grpo`` [seq_mean_token_mean]: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``,
  with separate low/high clip (DAPO clip-higher); ``drgrpo`` is the same [seq_mean_token_sum];
  ``dapo`` is the same [token_mean]. Optional dual clip (``clip_ratio_c = c > 1``, verl's name;
  off when None): on tokens with ``A < 0`` the loss is further capped at ``-A c``, i.e.
  ``min(max(-r A, -clip(r) A), -c A)``, so a token whose ratio ran past ``c`` while its
  advantage is negative stops pushing (and gets no gradient);
- ``gspo`` [seq_mean_token_mean]: the sequence ratio ``s = exp(mean_t(logp - old))`` clipped to
  ``[1-gspo_clip_low, 1+gspo_clip_high]``, in the GSPO-token form
  ``s_t = sg(s) * exp(logp_t - sg(logp_t))`` (value ``s``, gradient ``s * grad logp_t``), which
  with a per-rollout advantage and token-mean per rollout equals GSPO's gradient (paper eq. 13-14);
- ``cispo`` [token_mean]: ``-sg(clip(r, 1-cispo_clip_low, 1+cispo_clip_high)) * A * grad logp``
  (MiniMax-M1); every token keeps its gradient, only the IS weight is clipped;
- ``dppo_tv`` [seq_mean_token_sum]: DPPO Binary-TV (arXiv 2602.04879, ZAYA1's trust region).
  With ``mu = exp(rollout_logprobs)`` and ``pi = exp(logprobs)`` a token is masked out if
  ``A > 0 and pi - mu > delta`` or ``A < 0 and pi - mu < -delta`` (probabilities, not
  log-ratios); the other tokens get ``-r A`` with ``r = pi / pi_old`` (optionally truncated at
  ``dppo_ratio_cap`` as in the authors' verl code: value ``min(r, cap) A``, gradient
  ``min(r, cap) A grad logp``).

Loss values are written so that the value is the surrogate objective itself (for CISPO/DPPO the
IS weight ``w`` enters as ``sg(w) * exp(logp - sg(logp))``: value ``w``, gradient ``w grad logp``, also for a token
whose log-ratio is past the ±20 clamp of ratio values).

Common options (:class:`LossConfig`): truncated importance sampling against the engine
(``tis_cap``: token weight ``min(exp(old - rollout), cap)``, stop-gradient, multiplying each
token's loss, GSPO's included), a KL penalty to a
reference policy (``kl_coef``, ``kl_type`` k1/k3; off by default, as in ZAYA1; the
single-process trainer and the sharded one (:mod:`train.parallel.rl_update`) compute
``ref_logprobs`` from ``kl_reference``), and the
aggregation mode (:func:`aggregate`).

Metrics: ``loss``, ``clip_frac`` (share of tokens whose gradient the clip/trust region removes or
whose IS weight was clipped; with dual clip, the dual-clipped tokens too, which
``clip_frac_dual`` counts on their own), ``approx_kl`` (k3 of old vs new), ``ratio_mean``, and when engine
log-probs are given ``mismatch_kl`` (k3 of rollout vs old) and ``mismatch_max_abs``
(max |old - rollout|); ``tis_capped_frac`` and ``kl_ref`` when those options are on; GSPO's ``seq_ratio_mean``.
All but ``loss`` and ``mismatch_max_abs`` are means over the loss tokens (GSPO's per-sequence ratio weighted by
its tokens), so that the trainers' token-weighted sums over micro-batches give the batch's value however the rows
are packed. Each is a detached 0-dim tensor on the inputs' device, not a float: reading one waits for the device, so the
trainers sum them over a step's micro-batches in :class:`MetricSums` and read them all at once at the
end of the step (on a GPU, a ``float()`` per metric per micro-batch would stall the queue of kernels
each time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from train.rl import Registry

__all__ = ["LossConfig", "LOSSES", "get_loss", "aggregate", "seq_count", "loss_count", "AGG_MODES", "kl_estimate",
           "mismatch_metrics", "MetricSums"]

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
# what the ratio is taken against: the engine's behaviour log-probs, or the policy's own before the update (with the
# engine's then in truncated IS): RLConfig.ratio_against and, on trainer ranks, RLUpdateConfig.ratio_against
RATIO_MODES = ("behaviour", "recompute")
KL_TYPES = ("k1", "k3")
LOG_RATIO_CLAMP = 20.0  # |log ratio| is clamped here before exp, for overflow safety


def check_ratio_options(ratio_against: str, loss_cfg: "LossConfig") -> None:
    """Refuse an unknown ``ratio_against``, and ``tis_cap`` where it would not act (the single-process
    trainer's RLConfig and the trainer ranks' RLUpdateConfig both check this)."""
    if ratio_against not in RATIO_MODES:
        raise ValueError(f"unknown ratio_against {ratio_against!r}; choose from {', '.join(RATIO_MODES)}")
    if loss_cfg.tis_cap is not None and ratio_against == "behaviour":
        raise ValueError(f"loss_cfg.tis_cap={loss_cfg.tis_cap} acts only with ratio_against=recompute "
                         "(truncated IS from the policy before the update to the engine's log-probs); with "
                         "behaviour the ratio is already taken against the engine's log-probs: unset tis_cap "
                         "or set ratio_against=recompute")


@dataclass
class LossConfig:
    clip_low: float = 0.2            # PPO/GRPO/DAPO ratio clip: r in [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28          # DAPO clip-higher
    gspo_clip_low: float = 3e-4      # GSPO paper section 5.1
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0      # CISPO IS weight in [1 - low, 1 + high]: no lower bound by default
    cispo_clip_high: float = 3.0     #   and an upper bound of 4 (MiniMax-M1 tunes only the upper bound)
    delta: float = 0.1               # DPPO Binary-TV threshold on |pi - mu| (ZAYA1: 0.1)
    dppo_ratio_cap: float | None = None  # optional truncation of pi/pi_old in DPPO (verl code uses 20)
    agg: str | None = None           # None: the loss's own default mode; else one of AGG_MODES
    norm_len: int | None = None      # seq_mean_token_sum: divide by this constant (Dr.GRPO max length)
    kl_coef: float = 0.0             # KL penalty to ref_logprobs; 0 = off
    kl_type: str = "k3"
    tis_cap: float | None = None     # truncated IS vs the engine: weight min(exp(old - rollout), cap)
    clip_ratio_c: float | None = None  # PPO dual clip (ppo/grpo/drgrpo/dapo): A < 0 tokens capped at -A c; None = off

    def __post_init__(self):
        if self.agg is not None and self.agg not in AGG_MODES:
            raise ValueError(f"unknown loss agg {self.agg!r}; choose one of {', '.join(AGG_MODES)}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"unknown kl_type {self.kl_type!r}; choose one of {', '.join(KL_TYPES)}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}; None turns it off")
        bounds = ("clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high", "cispo_clip_low", "cispo_clip_high",
                  "kl_coef")
        negative = [f"{k}={getattr(self, k)}" for k in bounds if not getattr(self, k) >= 0]
        if negative:
            raise ValueError(f"loss settings must be >= 0, got {', '.join(negative)}")
        nonpositive = [f"{k}={getattr(self, k)}" for k in ("delta", "dppo_ratio_cap", "norm_len")
                       if getattr(self, k) is not None and not getattr(self, k) > 0]
        if nonpositive:
            raise ValueError(f"loss settings must be > 0, got {', '.join(nonpositive)}")


LossFn = Callable[..., tuple[Tensor, dict]]
LOSSES: Registry[LossFn] = Registry("policy loss")


def get_loss(name: str) -> LossFn:
    return LOSSES.get(name)


def effective_agg(name: str, cfg: "LossConfig") -> str:
    """The aggregation mode a loss uses under ``cfg``: ``cfg.agg`` or the loss's own default."""
    return cfg.agg or get_loss(name).default_agg


# ----------------------------------------------------------------------------------------------
# shared pieces


def aggregate(tok: Tensor, mask: Tensor, mode: str, norm_len: int | None = None,
              denom: float | None = None) -> Tensor:
    """Reduce per-token losses ``[B, T]`` to a scalar.

    ``token_mean``: sum over all tokens / number of tokens (DAPO);
    ``seq_mean_token_sum``: sum within each rollout (divided by ``norm_len`` if given), mean over
    rollouts (Dr.GRPO, ZAYA1); ``seq_mean_token_mean``: mean within each rollout, mean over
    rollouts (GRPO). The ``seq_*`` means are over the rollouts that have at least one unmasked
    token: a fully masked rollout (dropped by overlong filtering, ``keep=False``, or empty) adds
    nothing and does not dilute the others (as verl's ``agg_loss``). ``denom`` replaces the token
    or rollout count (see module docstring; :func:`seq_count` counts rollouts the same way).
    """
    m = mask.to(tok.dtype)
    tok = tok * m
    if mode == "token_mean":
        return tok.sum() / (denom if denom is not None else m.sum().clamp(min=1))
    if mode == "seq_mean_token_sum":
        per_seq = tok.sum(-1) / (norm_len if norm_len else 1)
    elif mode == "seq_mean_token_mean":
        per_seq = tok.sum(-1) / m.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss agg {mode!r}; choose one of {', '.join(AGG_MODES)}")
    return per_seq.sum() / (denom if denom is not None else seq_count(m))


def loss_count(completion_lengths: list[int], agg: str) -> float:
    """The aggregation denominator counted on the host from the kept rollouts' completion lengths:
    their tokens (``token_mean``) or those with at least one token (``seq_*``, as :func:`seq_count`
    counts them on a mask), at least 1."""
    if agg == "token_mean":
        return float(max(1, sum(completion_lengths)))
    return float(max(1, sum(1 for n in completion_lengths if n)))


def seq_count(mask: Tensor) -> int:
    """Rollouts (rows of ``mask``) with at least one unmasked token, at least 1: the ``seq_*``
    aggregation denominator."""
    return max(1, int((mask.sum(-1) > 0).sum()))


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimate on samples from pi: k1 = log pi - log ref,
    k3 = exp(log ref - log pi) - (log ref - log pi) - 1 (non-negative, low variance).

    As a loss term, differentiated at the sampled token: k1's own gradient, grad log pi, is zero in
    expectation (it would regularise nothing), so k1 carries the score-function gradient of KL(pi || ref),
    ``(log pi - log ref) grad log pi`` (value unchanged); k3's gradient is, in expectation, that of
    KL(ref || pi), as in GRPO and verl's ``low_var_kl``."""
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return _weighted(-d.detach(), logprobs)
    if kind == "k3":
        return d.exp() - d - 1
    raise ValueError(f"unknown kl_type {kind!r}; choose one of {', '.join(KL_TYPES)}")


def mismatch_metrics(logprobs: Tensor, mu: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the trainer's log-probs are from the behaviour log-probs ``mu`` the rollouts were
    sampled with (stale weights and engine numerics both show here): ``mismatch_kl`` (k3 of
    log(pi/mu), as ``approx_kl``) and ``mismatch_max_abs`` (max |log pi - log mu|) over ``mask``."""
    m = mask.to(logprobs.dtype)
    d = torch.where(m > 0, logprobs.detach() - mu, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"mismatch_kl": _masked_mean(d.exp() - 1 - d, m), "mismatch_max_abs": _abs_max(d)}


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def _abs_max(d: Tensor) -> Tensor:
    return d.detach().abs().max() if d.numel() else d.new_zeros(())


class MetricSums:
    """A step's metrics summed over its micro-batches on the device (adding waits for nothing), read
    with one device-to-host copy by :meth:`floats`: sums (:meth:`add`, :meth:`add_weighted`) and maxima
    (:meth:`max`), accumulated in float64 as the Python floats they replace were."""

    def __init__(self):
        self._sum: dict[str, Tensor] = {}
        self._max: dict[str, Tensor] = {}

    @staticmethod
    def _t(v) -> Tensor:
        return v.detach().to(torch.float64) if isinstance(v, Tensor) else torch.tensor(float(v), dtype=torch.float64)

    def add(self, name: str, value) -> None:
        v = self._t(value)
        self._sum[name] = v if name not in self._sum else self._sum[name] + v

    def add_weighted(self, metrics: dict, weight) -> None:
        """``sum[k] += metrics[k] * weight`` for every metric (token-weighted means: divide by the
        summed weight)."""
        w = self._t(weight)
        for k, v in metrics.items():
            self.add(k, self._t(v) * w)

    def max(self, name: str, value) -> None:
        v = self._t(value)
        self._max[name] = v if name not in self._max else torch.maximum(self._max[name], v)

    def floats(self) -> tuple[dict[str, float], dict[str, float]]:
        """(sums, maxima) as Python floats: one synchronising copy for all of them."""
        vals = [*self._sum.values(), *self._max.values()]
        if not vals:
            return {}, {}
        dev = next((v.device for v in vals if v.device.type != "cpu"), vals[0].device)  # one copy from it
        got, n = torch.stack([v.to(dev) for v in vals]).tolist(), len(self._sum)
        return dict(zip(self._sum, got[:n])), dict(zip(self._max, got[n:]))


def _weighted(weight: Tensor, logprobs: Tensor) -> Tensor:
    """``sg(weight) * exp(lp - sg(lp))``: value ``weight``, gradient ``weight * grad lp`` (the log-probs themselves,
    not the clamped log-ratio: a token past the clamp keeps its gradient)."""
    return weight.detach() * torch.exp(logprobs - logprobs.detach())


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's ``-min(r A, clip(r) A)`` per token and where the clipped branch cuts the gradient."""
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - low, 1 + high) * adv
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


@dataclass
class _Batch:
    """Validated inputs: float mask, [B, T] advantages, masked log-ratio of new vs old."""

    logprobs: Tensor
    old: Tensor
    rollout: Tensor | None
    adv: Tensor
    mask: Tensor
    log_ratio: Tensor  # clamped to +-LOG_RATIO_CLAMP: for ratio values
    lp: Tensor  # the log-probs on loss tokens (0 elsewhere): the gradient of a stop-gradient weight goes through them

    @classmethod
    def make(cls, logprobs, old, rollout, adv, mask) -> "_Batch":
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
        for name, t in (("old_logprobs", old), ("rollout_logprobs", rollout), ("mask", mask)):
            if t is not None and t.shape != logprobs.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)}")
        adv = adv.to(logprobs.dtype)
        if adv.dim() == 1:
            adv = adv[:, None]
        if adv.shape[0] != logprobs.shape[0] or adv.shape[-1] not in (1, logprobs.shape[1]):
            raise ValueError(f"advantages have shape {tuple(adv.shape)}, expected [B] or [B, T] "
                             f"for logprobs {tuple(logprobs.shape)}")
        m = mask.to(logprobs.dtype)
        on = m > 0
        lr = torch.where(on, logprobs - old.detach(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return cls(logprobs, old.detach(), None if rollout is None else rollout.detach(),
                   adv.expand_as(logprobs), m, lr, torch.where(on, logprobs, 0.0))


def _finish(b: _Batch, tok: Tensor, metrics: dict, cfg: LossConfig, default_agg: str,
            ref_logprobs: Tensor | None, denom: float | None) -> tuple[Tensor, dict]:
    """Apply truncated IS and the KL penalty, aggregate, and add the common metrics."""
    on = b.mask > 0
    tok = torch.where(on, tok, 0.0)
    metrics["approx_kl"] = _masked_mean(b.log_ratio.detach().exp() - 1 - b.log_ratio.detach(), b.mask)
    metrics["ratio_mean"] = _masked_mean(b.log_ratio.detach().exp(), b.mask)
    if b.rollout is not None:
        d = torch.where(on, b.old - b.rollout, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics["mismatch_kl"] = _masked_mean(d.exp() - 1 - d, b.mask)
        metrics["mismatch_max_abs"] = _abs_max(d)
        if cfg.tis_cap is not None:
            w = d.exp()
            tok = tok * w.clamp(max=cfg.tis_cap)
            metrics["tis_capped_frac"] = _masked_mean((w > cfg.tis_cap).to(b.mask.dtype), b.mask)
    if cfg.kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        # (the masked positions' log-probs left out first: a -inf there would make k1's gradient NaN)
        kl = torch.where(on, kl_estimate(torch.where(on, b.logprobs, 0.0), torch.where(on, ref_logprobs.detach(), 0.0),
                                         cfg.kl_type), 0.0)
        tok = tok + cfg.kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), b.mask)
    loss = aggregate(tok, b.mask, cfg.agg or default_agg, cfg.norm_len, denom)
    metrics["loss"] = loss.detach()
    return loss, metrics


def _frac(x: Tensor, b: _Batch) -> Tensor:
    return _masked_mean(x.to(b.mask.dtype), b.mask)


# ----------------------------------------------------------------------------------------------
# the losses


def _dual_clip(tok: Tensor, adv: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """PPO dual clip (Ye et al. 2020; verl's ``clip_ratio_c``): where ``A < 0`` the per-token loss
    ``tok`` is capped at ``-A c`` (constant there, so no gradient); returns (loss, where capped)."""
    cap = -adv * c
    dual = (adv < 0) & (tok > cap)
    return torch.where(dual, cap, tok), dual


def _ppo_family(default_agg: str) -> LossFn:
    def loss_fn(logprobs, old_logprobs, rollout_logprobs, advantages, mask, cfg=None, *,
                ref_logprobs=None, denom=None):
        cfg = cfg or LossConfig()
        b = _Batch.make(logprobs, old_logprobs, rollout_logprobs, advantages, mask)
        tok, clipped = _clipped_surrogate(b.log_ratio.exp(), b.adv, cfg.clip_low, cfg.clip_high)
        metrics = {}
        if cfg.clip_ratio_c is not None:
            tok, dual = _dual_clip(tok, b.adv, cfg.clip_ratio_c)
            clipped = clipped | dual
            metrics["clip_frac_dual"] = _frac(dual, b)
        metrics["clip_frac"] = _frac(clipped, b)
        return _finish(b, tok, metrics, cfg, default_agg, ref_logprobs, denom)
    loss_fn.__doc__ = (f"PPO clipped surrogate with low/high clip and optional dual clip; default aggregation "
                       f"{default_agg}.")
    loss_fn.default_agg = default_agg
    return loss_fn


ppo_loss = LOSSES.register("ppo", "grpo")(_ppo_family("seq_mean_token_mean"))
drgrpo_loss = LOSSES.register("drgrpo")(_ppo_family("seq_mean_token_sum"))
dapo_loss = LOSSES.register("dapo")(_ppo_family("token_mean"))


@LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, rollout_logprobs, advantages, mask, cfg=None, *,
              ref_logprobs=None, denom=None):
    """GSPO(-token): clipped sequence-level ratio, gradient routed per token."""
    cfg = cfg or LossConfig()
    b = _Batch.make(logprobs, old_logprobs, rollout_logprobs, advantages, mask)
    seq_lr = b.log_ratio.sum(-1, keepdim=True) / b.mask.sum(-1, keepdim=True).clamp(min=1)
    s_tok = torch.exp(seq_lr.detach() + b.lp - b.lp.detach())
    tok, clipped = _clipped_surrogate(s_tok, b.adv, cfg.gspo_clip_low, cfg.gspo_clip_high)
    seq_ratio = _masked_mean(seq_lr.detach().exp().expand_as(b.mask), b.mask)  # over loss tokens (module docstring)
    metrics = {"clip_frac": _frac(clipped, b), "seq_ratio_mean": seq_ratio}
    return _finish(b, tok, metrics, cfg, "seq_mean_token_mean", ref_logprobs, denom)


gspo_loss.default_agg = "seq_mean_token_mean"


@LOSSES.register("cispo")
def cispo_loss(logprobs, old_logprobs, rollout_logprobs, advantages, mask, cfg=None, *,
               ref_logprobs=None, denom=None):
    """CISPO: clipped, stop-gradient IS weight times the log-prob gradient times A."""
    cfg = cfg or LossConfig()
    b = _Batch.make(logprobs, old_logprobs, rollout_logprobs, advantages, mask)
    ratio = b.log_ratio.detach().exp()
    w = ratio.clamp(1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)
    tok = -_weighted(w, b.lp) * b.adv
    return _finish(b, tok, {"clip_frac": _frac(w != ratio, b)}, cfg, "token_mean", ref_logprobs, denom)


cispo_loss.default_agg = "token_mean"


def dppo_tv_mask(logprobs: Tensor, mu_logprobs: Tensor, adv: Tensor, delta: float) -> Tensor:
    """True where DPPO Binary-TV removes a token: A > 0 and pi - mu > delta, or A < 0 and
    pi - mu < -delta (pi, mu are probabilities of the sampled token)."""
    diff = logprobs.detach().exp() - mu_logprobs.detach().exp()
    return ((adv > 0) & (diff > delta)) | ((adv < 0) & (diff < -delta))


@LOSSES.register("dppo_tv", "dppo")
def dppo_tv_loss(logprobs, old_logprobs, rollout_logprobs, advantages, mask, cfg=None, *,
                 ref_logprobs=None, denom=None):
    """DPPO Binary-TV: ratio-times-advantage objective on the tokens inside the TV trust region."""
    cfg = cfg or LossConfig()
    b = _Batch.make(logprobs, old_logprobs, rollout_logprobs, advantages, mask)
    mu = b.rollout if b.rollout is not None else b.old
    out = dppo_tv_mask(b.logprobs, mu, b.adv, cfg.delta)
    ratio = b.log_ratio.detach().exp()
    w = ratio if cfg.dppo_ratio_cap is None else ratio.clamp(max=cfg.dppo_ratio_cap)
    tok = torch.where(out, 0.0, -_weighted(w, b.lp) * b.adv)
    capped = out if cfg.dppo_ratio_cap is None else out | (ratio > cfg.dppo_ratio_cap)  # masked, or weight cut
    return _finish(b, tok, {"clip_frac": _frac(capped, b)}, cfg, "seq_mean_token_sum", ref_logprobs, denom)


dppo_tv_loss.default_agg = "seq_mean_token_sum"
