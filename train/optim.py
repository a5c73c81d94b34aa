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
    """AdamW (no decay on norms and biases) and a LambdaLR following :func:`lr_factor`."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched


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
