"""Optimizers and learning-rate schedule for the trainers: AdamW, or Muon for the hidden weight
matrices with AdamW for the rest (ZAYA1's RL optimizer: Muon with momentum 0)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OPTIMIZERS = ("adamw", "muon")
MUON_LR_SCALES = ("match_rms_adamw", "original", "none")
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (also torch.optim.Muon's)
NS_EPS = 1e-7


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
    name: str = "adamw"   # adamw | muon (Muon on hidden matrices, AdamW on embeddings, LM head, norms, biases)
    muon_momentum: float = 0.0          # ZAYA1: 0 (the update is the orthogonalised gradient itself)
    muon_nesterov: bool = False         # only with muon_momentum > 0
    muon_lr_scale: str = "match_rms_adamw"  # match_rms_adamw: 0.2*sqrt(max(m,n)) (Moonlight; reuse AdamW's lr)
    muon_ns_steps: int = 5              # | original: sqrt(max(1, m/n)) (Keller Jordan) | none
    muon_ns_dtype: str = "float32"      # float32 | bfloat16: the Newton-Schulz arithmetic

    def __post_init__(self):
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"unknown lr schedule {self.schedule!r}; choose from constant, cosine, linear")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        for k, ok in (("lr", self.lr >= 0), ("eps", self.eps > 0), ("weight_decay", self.weight_decay >= 0),
                      ("grad_clip", self.grad_clip >= 0), ("warmup_steps", self.warmup_steps >= 0),
                      ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1)):
            if not ok or not math.isfinite(getattr(self, k)):  # (NaN fails the comparison too)
                want = {"eps": "> 0", "min_lr_ratio": "in [0, 1]"}.get(k, ">= 0")
                raise ValueError(f"{k} must be {want}, got {getattr(self, k)}")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer name {self.name!r}; choose from {', '.join(OPTIMIZERS)}")
        if self.muon_lr_scale not in MUON_LR_SCALES:
            raise ValueError(f"unknown muon_lr_scale {self.muon_lr_scale!r}; choose from {', '.join(MUON_LR_SCALES)}")
        if self.muon_ns_dtype not in NS_DTYPES:
            raise ValueError(f"unknown muon_ns_dtype {self.muon_ns_dtype!r}; choose from {', '.join(NS_DTYPES)}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_nesterov and self.muon_momentum == 0:
            raise ValueError("muon_nesterov=true needs muon_momentum > 0")
        if self.muon_ns_steps < 1:
            raise ValueError(f"muon_ns_steps must be >= 1, got {self.muon_ns_steps}")

    def over(self, steps: int) -> "OptimConfig":
        """This config, a decaying schedule given no ``total_steps`` running over ``steps`` (it stayed at peak)."""
        from dataclasses import replace

        return replace(self, total_steps=steps) if self.schedule != "constant" and not self.total_steps else self

    def muon_settings(self) -> dict | None:
        """The Muon hyper-parameters (the keyword arguments of :class:`Muon`'s matrix groups), or
        None when the optimizer is AdamW."""
        if self.name != "muon":
            return None
        return {"momentum": self.muon_momentum, "nesterov": self.muon_nesterov, "lr_scale": self.muon_lr_scale,
                "ns_steps": self.muon_ns_steps, "ns_dtype": self.muon_ns_dtype}


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


# ------------------------------------------------------------------------------------------ Muon


def muon_row_blocks(name: str, p: torch.Tensor) -> int | None:
    """How Muon sees parameter ``name``: None (it goes to AdamW), or k: the last two dims form a
    matrix, the leading dims index matrices, and each matrix's rows are k matrices of their own.

    Muon: the 2-D hidden weights (attention and MLP projections, MoE routers) and the MoE experts'
    stacked 3-D weights, one matrix per expert (``gate_up_proj`` [E, 2I, H] holds each expert's
    gate and up projections, two [I, H] matrices, as a Hugging Face checkpoint stores them; k = 2).
    AdamW: embeddings, the LM head, norms, biases and any other 1-D parameter."""
    if "embed_tokens" in name or "lm_head" in name:
        return None
    if p.ndim == 2:
        return 1
    if p.ndim == 3 and ".experts." in name:
        return 2 if name.endswith("gate_up_proj") else 1
    return None


def as_matrices(t: torch.Tensor, row_blocks: int) -> torch.Tensor:
    """``t`` [..., R, C] viewed as a batch of matrices [B, R / row_blocks, C]."""
    R, C = t.shape[-2:]
    return t.reshape(-1, R // row_blocks, C)


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised ``G`` (one matrix [m, n] or a batch [B, m, n]) by the quintic
    Newton-Schulz iteration of Keller Jordan's Muon (the same arithmetic as ``torch.optim.Muon``, in
    ``dtype``): X = G / max(||G||_F, eps), transposed so that m <= n; then ``steps`` times
    A = X X^T, X = a X + (b A + c A A) X. For G = U S V^T the result is U S' V^T: each singular
    value s with s / ||G||_F >= 1.5e-3 lands in [0.68, 1.21] (5 steps; smaller ones stay small, as
    the scalar map shows); returned in fp32."""
    a, b, c = coefficients
    X = G.to(dtype).reshape((-1,) + tuple(G.shape[-2:]))
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):  # fused multiply-adds, as torch.optim.Muon's addmm (one rounding each in bf16)
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(G.shape).float()


def muon_lr_scale(m: int, n: int, convention: str) -> float:
    """Per-matrix multiplier of the learning rate for a Muon update of an [m, n] matrix (m: rows,
    the output dim of a linear layer). ``match_rms_adamw`` (Moonlight, arXiv 2502.16982):
    0.2 * sqrt(max(m, n)), which gives the update the RMS of a typical AdamW update (~0.2), so the
    AdamW learning rate (and weight decay) are reused as they are; ``original`` (Keller Jordan):
    sqrt(max(1, m / n)), with a Muon learning rate of its own; ``none``: 1."""
    if convention == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if convention == "original":
        return math.sqrt(max(1.0, m / n))
    if convention == "none":
        return 1.0
    raise ValueError(f"unknown muon_lr_scale {convention!r}; choose from {', '.join(MUON_LR_SCALES)}")


def muon_direction(u: torch.Tensor, row_blocks: int, ns_steps: int, ns_dtype: str) -> torch.Tensor:
    """``u`` orthogonalised matrix by matrix (:func:`as_matrices`), in ``u``'s shape, fp32 (the
    caller applies the learning rate and :func:`muon_lr_scale`): the one place both the
    single-process and the sharded Muon orthogonalise."""
    # (reshape: a tall block comes back transposed, not contiguous)
    return newton_schulz(as_matrices(u, row_blocks), ns_steps, NS_DTYPES[ns_dtype]).reshape(u.shape)


def adamw_step_(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                lr: float, betas, eps: float) -> None:
    """``torch.optim.AdamW``'s single-tensor arithmetic, decoupled weight decay excluded."""
    b1, b2 = betas
    exp_avg.lerp_(g, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bc1)


def momentum_update(g: torch.Tensor, buf: torch.Tensor | None, momentum: float, nesterov: bool) -> torch.Tensor:
    """The tensor Muon orthogonalises: ``g`` itself with momentum 0; else the momentum buffer
    (EMA form, as ``torch.optim.Muon`` and Keller Jordan's code: buf = lerp(buf, g, 1 - momentum))
    or, with Nesterov, lerp(g, buf, momentum). Updates ``buf`` in place."""
    if momentum == 0:
        return g
    buf.lerp_(g, 1 - momentum)
    return g.lerp(buf, momentum) if nesterov else buf.clone()


class Muon(torch.optim.Optimizer):
    """Muon for the hidden weight matrices, AdamW for everything else, in one ``torch.optim``
    optimizer (so ``LambdaLR``, :class:`MasterWeights`, ``state_dict`` and checkpoints work as for
    AdamW). A param group with ``muon=True`` is stepped by Muon, the others by AdamW
    (``torch.optim.AdamW``'s arithmetic).

    Muon step of a matrix parameter W with gradient G (``lr`` the group's learning rate):
    U = G (momentum 0, the default and ZAYA1's choice; else the momentum buffer, Nesterov optional,
    see :func:`momentum_update`); O = :func:`newton_schulz` (U) per matrix (``row_blocks`` from
    :func:`muon_row_blocks`: experts' stacked weights are one matrix per expert, gate and up apart);
    W <- W * (1 - lr * weight_decay) - lr * :func:`muon_lr_scale` (m, n) * O.
    The default scale (``match_rms_adamw``, Moonlight's 0.2 * sqrt(max(m, n))) lets Muon matrices
    and AdamW parameters share one learning rate. Newton-Schulz runs in fp32 by default
    (``ns_dtype``), bf16 optionally (as ``torch.optim.Muon`` always does).

    Why not ``torch.optim.Muon`` (torch >= 2.9): it rejects 3-D parameters (the MoE experts'
    stacked weights), always orthogonalises in bf16, and its Newton-Schulz is private, while the
    sharded core (:class:`train.parallel.dp.MeshMuon`) must run the very same function on gathered
    matrices; pyproject also allows torch 2.6. The arithmetic is the same as torch's (tests check
    this Muon against ``torch.optim.Muon`` and against a Newton-Schulz loop written in the test)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, nesterov: bool = False, lr_scale: str = "match_rms_adamw", ns_steps: int = 5,
                 ns_dtype: str = "float32"):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, muon=False, row_blocks=1,
                        momentum=momentum, nesterov=nesterov, lr_scale=lr_scale, ns_steps=ns_steps, ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for g in self.param_groups:
            if g["muon"] and any(p.ndim < 2 for p in g["params"]):
                raise ValueError("Muon groups take matrices (2-D, or stacked 3-D) only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            lr, wd = g["lr"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] = st.get("step", 0) + 1
                if wd:
                    p.mul_(1 - lr * wd)
                if g["muon"]:
                    buf = None
                    if g["momentum"]:
                        buf = st.get("momentum_buffer")
                        if buf is None:
                            buf = st["momentum_buffer"] = torch.zeros_like(p)
                    u = momentum_update(p.grad, buf, g["momentum"], g["nesterov"])
                    o = muon_direction(u, g["row_blocks"], g["ns_steps"], g["ns_dtype"])
                    m, n = as_matrices(p, g["row_blocks"]).shape[-2:]
                    p.add_(o.to(p.dtype), alpha=-lr * muon_lr_scale(m, n, g["lr_scale"]))
                else:
                    if "exp_avg" not in st:
                        st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    adamw_step_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], lr, g["betas"], g["eps"])
        return loss


# ------------------------------------------------------------------------------------ building


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    """The optimizer ``cfg.name`` names and a LambdaLR following :func:`lr_factor`: AdamW (no decay
    on norms and biases), or :class:`Muon` (Muon on the matrices :func:`muon_row_blocks` picks, with
    weight decay; AdamW on the rest as above). Parameters in a low-precision dtype (bf16/fp16) get
    fp32 master weights and fp32 optimizer state (:class:`MasterWeights`), so updates smaller than
    the dtype's spacing accumulate instead of rounding away."""
    decay, no_decay, matrices = [], [], {}
    muon = cfg.muon_settings()
    # embeddings and the LM head by module, whatever their names (GPT-2's wte and wpe under the fallback)
    head = getattr(model, "lm_head", None)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | (
        {id(head.weight)} if getattr(head, "weight", None) is not None else set())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        k = muon_row_blocks(name, p) if muon and id(p) not in embeddings else None
        if k is not None:
            matrices.setdefault(k, []).append(p)
        else:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    everything = decay + no_decay + [p for ps in matrices.values() for p in ps]
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in everything)
    masters = MasterWeights(everything) if low else None
    pick = (lambda ps: [masters.master[id(p)] for p in ps]) if low else (lambda ps: ps)
    groups = [{"params": pick(decay), "weight_decay": cfg.weight_decay},
              {"params": pick(no_decay), "weight_decay": 0.0}]
    if muon is None:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    else:
        groups += [{"params": pick(ps), "weight_decay": cfg.weight_decay, "muon": True, "row_blocks": k}
                   for k, ps in sorted(matrices.items())]
        opt = Muon([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **muon)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    if low:
        masters.attach(opt)
        return masters, sched
    return opt, sched


class MasterWeights:
    """An optimizer over fp32 master copies of low-precision model parameters: :meth:`accumulate` (after
    each micro-batch's backward) adds the model's gradients into the masters' fp32 gradients (summed in
    bf16 across micro-batches they lose about 1% of their value), ``step()`` takes what is left, steps
    the inner optimizer on the masters and writes them back in the model's dtype. ``state_dict()`` holds
    the inner state and the masters (a resume keeps the low bits). Quacks like the ``torch.optim``
    optimizer it wraps (``param_groups``, ``zero_grad``)."""

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
    def accumulate(self) -> None:
        """Move the model's gradients into the masters' (fp32, added to what earlier micro-batches left)."""
        for p in self.params:
            if p.grad is not None:
                m = self.master[id(p)]
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def params_with_grads(self) -> list[torch.Tensor]:
        """The fp32 masters that hold gradients for the next step (the model's accumulated into them)."""
        self.accumulate()
        return [m for m in self.master.values() if m.grad is not None]

    @torch.no_grad()
    def step(self) -> None:
        self.accumulate()
        self.opt.step()
        for m in self.master.values():  # taken: the next step's gradients start from zero, as the model's did
            m.grad = None
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


def accumulate_grads(opt) -> None:
    """After a micro-batch's backward: a low-precision model's gradients go into its fp32 masters (a no-op for
    other optimizers, which keep summing into the parameters' own gradients)."""
    if isinstance(opt, MasterWeights):
        opt.accumulate()


def clip_and_step(model, opt, sched, grad_clip: float) -> float:
    """Clip gradients (if ``grad_clip`` > 0), step (and the LR schedule ``sched``, unless None), zero (and a
    zaya model's balancing-bias update); returns the pre-clip gradient norm (of the fp32 gradients, for a
    low-precision model's :class:`MasterWeights`)."""
    if isinstance(opt, MasterWeights):
        params = opt.params_with_grads()
    else:
        params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    from train.model.zaya import balance_router_biases

    balance_router_biases(model)  # ZAYA1: balancing biases towards load 1/E (a no-op for other models)
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
