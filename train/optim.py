"""Optimizer and learning-rate schedule for the trainers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear
    total_steps: int = 0  # for cosine/linear decay
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"unknown lr schedule {self.schedule!r}; choose from constant, cosine, linear")
        self.betas = tuple(self.betas)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the base LR at ``step`` (0-based): linear warm-up, then the schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - cfg.min_lr_ratio) * frac
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    """AdamW (no decay on norms and biases) and a LambdaLR following :func:`lr_factor`. Parameters
    in a low-precision dtype (bf16/fp16) get fp32 master weights and fp32 optimizer state
    (:class:`MasterWeights`), so updates smaller than the dtype's spacing accumulate instead of
    rounding away."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in decay + no_decay)
    masters = MasterWeights(decay + no_decay) if low else None
    pick = (lambda ps: [masters.master[id(p)] for p in ps]) if low else (lambda ps: ps)
    opt = torch.optim.AdamW([{"params": pick(decay), "weight_decay": cfg.weight_decay},
                             {"params": pick(no_decay), "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    if low:
        masters.attach(opt)
        return masters, sched
    return opt, sched


class MasterWeights:
    """An optimizer over fp32 master copies of low-precision model parameters: ``step()`` hands the
    model's gradients (as fp32) to the inner AdamW, steps it on the masters and writes them back in
    the model's dtype. ``state_dict()`` holds the inner state and the masters (a resume keeps the
    low bits). Quacks like the ``torch.optim`` optimizer it wraps (``param_groups``, ``zero_grad``)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.master = {id(p): p.detach().float().clone().requires_grad_(True) for p in params}
        self.opt: torch.optim.Optimizer | None = None

    def attach(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    @property
    def param_groups(self):
        return self.opt.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            self.master[id(p)].grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p in self.params:
            p.copy_(self.master[id(p)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def resync(self) -> None:
        """Take up parameter values written from outside (another trainer's steps, loaded weights):
        each master element the model no longer matches becomes the model's value (the others keep
        their low bits). Without this the next ``step`` would write the stale masters back."""
        for p in self.params:
            m = self.master[id(p)]
            m.copy_(torch.where(p == m.to(p.dtype), m, p.float()))

    def state_dict(self) -> dict:
        return {"inner": self.opt.state_dict(), "master": [self.master[id(p)].detach().clone() for p in self.params]}

    @torch.no_grad()
    def load_state_dict(self, st: dict) -> None:
        self.opt.load_state_dict(st["inner"])
        for p, m in zip(self.params, st["master"]):
            self.master[id(p)].copy_(m)
            p.copy_(m)


def clip_and_step(model, opt, sched, grad_clip: float) -> float:
    """Clip gradients (if ``grad_clip`` > 0), step, zero; returns the pre-clip gradient norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def training_state(step: int, opt, sched, rng) -> dict:
    """What a trainer needs to resume: step, optimizer, scheduler and its Python RNG."""
    return {"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng.getstate()}


def load_training_state(st: dict, opt, sched, rng) -> int:
    """Restore what :func:`training_state` saved; returns the step."""
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    v, internal, gauss = st["rng"]
    rng.setstate((v, tuple(internal), gauss))
    return int(st["step"])
