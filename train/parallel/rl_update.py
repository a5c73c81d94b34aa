"""The RL policy update on Cascade's sharded training core: a DP x TSP mesh under torchrun.

One :class:`RLUpdater` step takes a :class:`train.rl.exchange.TrainBatch` and does what the
single-process :func:`reference_update` does, within float rounding:

* the loss is ``get_loss(cfg.loss)`` called with ``old_logprobs = rollout_logprobs = mu`` (the
  behaviour log-probs recorded by the engine: the ratio is taken against the behaviour policy),
  ``mask`` = completion tokens of kept rollouts, and ``denom`` the GLOBAL count over the whole
  batch (tokens for ``token_mean``, rollouts for the ``seq_*`` modes, as ``RLTrainer.update``
  counts them), so the micro-batch losses of all ranks sum to the loss of the whole batch;
* DP: the rollouts are dealt to the data-parallel ranks balanced by token count (longest first,
  each to the least loaded rank); each rank packs its rollouts back to back into micro-batches
  of at most ``tokens_per_micro`` tokens (:mod:`train.rl.packing`), one row per micro-batch with
  positions restarting per rollout and no attention across rollouts, on TSP ranks too (the packed
  row is what the TSP group partitions). Rollouts with ``keep=False`` or no completion
  contribute nothing, are not computed and do not count in the ``seq_*`` denominators (as verl);
* TSP (degree D > 1): each rank computes the log-probs of its own tokens of the packed row
  (:meth:`TSPCausalLM.token_logprobs`, temperature and router replay included); an
  all-gather whose backward just takes this rank's slice (:func:`comm.all_gather_replicated`)
  reassembles the whole row's on every rank, and every rank computes the identical,
  replicated loss. Whole sequences are present, so sequence-level losses (GSPO, per-rollout
  means) are exact. D = 1 is plain data parallelism on the unsharded :class:`CausalLM`;
* the optimizer is :class:`train.parallel.dp.MeshAdamW`: replicated-parameter gradients SUMMED
  over TSP, all gradients SUMMED (reduce-scatter) over DP, clipping by the global norm, AdamW
  with ``train.optim``'s parameter groups (no decay on norms and 1-D tensors) and its LR schedule
  (:func:`train.optim.lr_factor` at the given step), fp32 master weights and moments sharded
  ZeRO-1 style over DP; with ``optim.name == "muon"`` (or ``sft_optim``'s) it is
  :class:`train.parallel.dp.MeshMuon`: Muon on the matrices ``train.optim`` picks, each
  orthogonalised as the whole matrix (its update gathered over DP, its TSP shards sent to the one
  TSP rank that owns it, which orthogonalises it once and sends each rank its part), AdamW on the rest;
* ``dtype="bfloat16"``: the model computes in bf16 (compute copy), gradients are accumulated in
  fp32, the master weights and AdamW state stay fp32.

SFT steps run on the same mesh: a batch with ``meta["kind"] == "sft"`` holds (prompt, response)
pairs as samples; its loss is the mean NLL of the response tokens over the whole batch (what
``train.sft.SFTTrainer.step`` computes), at temperature 1, with ``cfg.sft_optim``'s settings and
schedule. Each phase has its own AdamW, as in the single-process stage (the SFT trainer's, then
the RL trainer's): when the kind of batch changes, the optimizer's moments restart on the
current master weights. ``meta["schedule_step"]`` is the step within the phase (default: the
``step`` argument).

KL to a reference policy (``loss_cfg.kl_coef > 0``; ZAYA1 uses none), as ``RLTrainer.update`` does it:
every rank keeps a frozen copy of its own parameter shards (same layout and dtype as the policy's).
With ``cfg.kl_reference`` (an HF checkpoint directory) it is loaded and sharded like the policy when
the updater is built; otherwise it is a copy of the policy's shards as the first RL batch finds them
(after any SFT phase: the RL start). The reference log-probs of each micro-batch come from a no-grad
forward with the reference tensors swapped into the parameters (pointer swaps, no copies): same
packing, temperature and router replay as the policy's; they go to the loss as ``ref_logprobs`` and
the ``kl_ref`` metric is reported. The frozen copy is part of :meth:`RLUpdater.state_tensors`, so a
resumed run keeps the reference it started its penalty from (an HF reference is reloaded instead).
``kl_coef = 0`` allocates no reference and runs no extra forward.

ZAYA1 (``zaya``) trains on any mesh (see :mod:`train.parallel.tsp` for CCA's head units and halo): after
each optimizer step every rank moves its router balancing biases by the load of the whole batch (the
counts of every rank's real tokens all-reduced over TSP and DP,
:func:`train.model.zaya.balance_router_biases`), as the single-process trainers do after theirs; the
biases are checkpointed (``buffers.*``) and published with the weights. A KL reference's forward routes
with the reference's own biases (the frozen copy's, as the single-process trainer's deep copy; an HF reference's
from its checkpoint), checkpointed as ``kl_ref_buffers.*``.

Metrics are those of ``RLTrainer.update``: the loss function's metrics weighted by each
micro-batch's token count, ``loss`` (the global loss), ``entropy`` (token mean), ``grad_norm``
(before clipping), ``lr`` (the one applied in this step), ``advantage_abs_mean``; reduced over
all ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from train.model.modeling import CausalLM, token_logprobs
from train.model.zaya import balance_router_biases
from train.optim import OptimConfig, build_optimizer, lr_factor, muon_row_blocks
from train.parallel import comm
from train.parallel.dp import MeshAdamW, MeshMuon
from train.parallel.shard import make_mesh
from train.parallel.tsp import TSPCausalLM, check_tsp_config, zigzag_index
from train.rl.exchange import TrainBatch, TrainSample
from train.rl.packing import balance_across_ranks, pack_by_tokens, pack_row, packed_token_logprobs, scatter_rows
from train.rl.losses import (LossConfig, MetricSums, check_ratio_options, effective_agg, get_loss, loss_count,
                             mismatch_metrics)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RLUpdateConfig:
    loss: str = "dppo_tv"
    loss_cfg: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tokens_per_micro: int = 4096   # tokens per packed micro-batch (a longer rollout gets one of its own)
    dtype: str = "float32"         # float32 | bfloat16 (compute copy; fp32 master and optimizer state)
    pad_id: int = 0
    sft_optim: OptimConfig | None = None  # the optimizer of SFT batches (meta kind "sft"); None: optim's
    # KL reference with loss_cfg.kl_coef > 0: an HF checkpoint dir, or None: a frozen copy of the policy
    # as the first RL batch finds it (after any SFT phase), kept in the checkpoints
    kl_reference: str | None = None
    # tsp 1: recompute each decoder layer in backward (the TSP layout always recomputes its blocks)
    activation_checkpointing: bool = False
    # the ratio against the behaviour log-probs (mu), or against the policy's own before the step (recompute: one
    # optimizer step per batch, so they are this forward's, detached; mu then enters truncated IS, loss_cfg.tis_cap)
    ratio_against: str = "behaviour"

    def __post_init__(self):
        try:
            get_loss(self.loss)
        except KeyError as e:  # a config error: say which loss and the choices
            raise ValueError(e.args[0]) from None
        if isinstance(self.loss_cfg, dict):
            self.loss_cfg = LossConfig(**self.loss_cfg)
        check_ratio_options(self.ratio_against, self.loss_cfg)
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if isinstance(self.sft_optim, dict):
            self.sft_optim = OptimConfig(**self.sft_optim)
        if self.kl_reference and not self.loss_cfg.kl_coef:
            raise ValueError("kl_reference is set but loss_cfg.kl_coef is 0: set kl_coef > 0 or drop kl_reference")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.tokens_per_micro < 1:
            raise ValueError(f"tokens_per_micro must be >= 1, got {self.tokens_per_micro}")


# ------------------------------------------------------------------------------------ batches


@dataclass
class RLTensors:
    input_ids: torch.Tensor                  # [B, T]
    attention_mask: torch.Tensor | None      # [B, T] bool, None when no row is padded
    mask: torch.Tensor                       # [B, T-1] float: completion tokens of kept rollouts
    mu: torch.Tensor                         # [B, T-1] behaviour log-probs at the loss positions
    advantages: torch.Tensor                 # [B]
    routed_experts: list[torch.Tensor] | None  # per MoE layer [B, T, k] (router replay)


def batch_tensors(samples: list[TrainSample], pad_id: int, device, routing: bool = True) -> RLTensors:
    """Right-padded training tensors of ``samples`` (prompts of at least one token); ``routing=False``
    leaves out the padded routed experts (the packed forward takes them from the samples)."""
    from train.batching import make_batch

    if any(not s.prompt_ids for s in samples):
        raise ValueError("every sample needs at least one prompt token")
    b = make_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id)
    keep = torch.tensor([bool(s.keep) for s in samples], dtype=b.loss_mask.dtype)
    mu = b.scatter_completion([s.logprobs for s in samples])
    routed = None
    have = [s.routed_experts is not None for s in samples]
    if routing and any(have):
        if not all(have):
            raise ValueError("routed_experts must be given for every sample of a batch or for none")
        B, T = b.input_ids.shape
        first = samples[0].routed_experts
        full = torch.zeros((B, T) + tuple(first.shape[1:]), dtype=torch.long)
        for i, s in enumerate(samples):
            if s.routed_experts.shape[0] != s.num_tokens or s.routed_experts.shape[1:] != first.shape[1:]:
                raise ValueError(f"sample {i}: routed_experts has shape {tuple(s.routed_experts.shape)}, expected "
                                 f"[{s.num_tokens}, {', '.join(map(str, first.shape[1:]))}]")
            full[i, :s.num_tokens] = s.routed_experts.long()
        routed = [full[:, :, j].to(device) for j in range(full.shape[2])]
    att = b.attention_mask
    padded = len({s.num_tokens for s in samples}) > 1  # (from the lengths: no read of a tensor)
    return RLTensors(b.input_ids.to(device), att.to(device) if padded else None,
                     (b.loss_mask * keep[:, None]).to(device), mu.to(device),
                     torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32).to(device), routed)


def loss_denominator(samples: list[TrainSample], agg: str) -> float:
    """The global aggregation count: completion tokens of kept rollouts (``token_mean``) or kept
    rollouts with at least one completion token (``seq_*``; fully masked ones are excluded, as in
    :func:`train.rl.losses.seq_count` and verl), as ``RLTrainer.update`` counts them."""
    return loss_count([len(s.completion_ids) for s in samples if s.keep], agg)


def gather_tokens(local: torch.Tensor, T: int, group) -> torch.Tensor:
    """Full ``[B, T-1, ...]`` from every TSP rank's ``[B, n_local, ...]`` (zigzag slots). Backward:
    this rank's slots of the (replicated) gradient - every rank must compute the same loss from it."""
    D = dist.get_world_size(group)
    full = comm.all_gather_replicated(local.transpose(0, 1).contiguous(), group)  # rank-block order
    order = torch.argsort(torch.cat([zigzag_index(T, D, j)[1] for j in range(D)])).to(local.device)
    return full[order[:T - 1]].transpose(0, 1)


# ------------------------------------------------------------------------------------ updater


def check_mesh(world: int, dp: int, tsp: int) -> None:
    if dp < 1 or tsp < 1 or dp * tsp != world:
        raise ValueError(f"mesh dp={dp} x tsp={tsp} does not match the world size {world}")


class RLUpdater:
    """RL optimizer steps of ``model`` on a ``dp x tsp`` mesh over the default process group
    (rank = d * tsp + t). ``model`` is the full fp32 policy on this rank's device, identical on
    every rank (with ``tsp == 1`` it is trained in place, else its TSP shards are copied), or the
    path of an HF checkpoint, loaded on ``device``: whole with ``tsp == 1``, else only this rank's
    TSP slices are read (:class:`train.model.hf_io.CheckpointSlices`; the full model is never built).
    Every rank calls every method (they are collective)."""

    def __init__(self, model: CausalLM | str | Path, cfg: RLUpdateConfig, tsp: int = 1, dp: int | None = None,
                 device: str | torch.device | None = None):
        if isinstance(model, (str, Path)):
            from train.model.hf_io import CheckpointSlices, load_pretrained

            dev = torch.device(device or "cpu")
            model = CheckpointSlices(model, device=dev) if tsp > 1 else load_pretrained(model, device=dev)
        world = dist.get_world_size()
        dp = world // tsp if dp is None else dp
        check_mesh(world, dp, tsp)
        if tsp > 1:
            check_tsp_config(model.config, tsp)
        self.cfg, self.tsp, self.dp = cfg, tsp, dp
        self.loss_fn, self.agg = get_loss(cfg.loss), effective_agg(cfg.loss, cfg.loss_cfg)
        self.config = model.config
        self.tsp_group, self.dp_group = make_mesh(dp, tsp)
        self.tsp_rank, self.dp_rank = dist.get_rank(self.tsp_group), dist.get_rank(self.dp_group)
        self.device = model.device
        if tsp > 1:
            self.net = TSPCausalLM(model, self.tsp_group)
            if hasattr(model, "read"):  # a CheckpointSlices reader: every shard is read now
                model.close()
            self.shards = self.net.named_shards()
            rep = {n for n, k in self.net.kinds.items() if k == "rep"}
        else:
            self.net = model
            self.shards = dict(model.named_parameters())  # tied weights appear once
            rep = set()
        # state that is not a parameter (a zaya policy's balancing biases, fp32, moved after each step
        # from the global load): checkpointed and published with the weights (see :attr:`buffers`; the TSP
        # model names its own, TSPCausalLM.model_buffers)
        params = {n for n, _ in self.net.named_parameters(remove_duplicate=False)}
        self._buffer_names = set(self.net.state_dict()) - params if tsp == 1 else set()
        o = cfg.optim
        decay = lambda n, p: not (p.ndim < 2 or "norm" in n)  # noqa: E731 (train.optim's groups)
        if any(x is not None and x.name == "muon" for x in (o, cfg.sft_optim)):  # Muon: whole matrices
            self.opt = MeshMuon([(p, self.shard_kind(n), decay(n, p), muon_row_blocks(n, p))
                                 for n, p in self.shards.items()], self.tsp_group, self.dp_group,
                                betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, muon=o.muon_settings())
        else:
            self.opt = MeshAdamW([(p, n in rep, decay(n, p)) for n, p in self.shards.items()],
                                 self.tsp_group, self.dp_group, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.phase: str | None = None  # the kind of the last batch ("rl" | "sft"); checkpointed
        self.net.to(DTYPES[cfg.dtype])
        # KL reference (kl_coef > 0 only): this rank's frozen shards, laid out and typed as self.shards.
        # The frozen copy's buffers exist from the start (a checkpoint load fills them in place);
        # ref_taken says whether they hold the copy yet (checkpointed with them).
        self.ref: dict[str, torch.Tensor] | None = None
        self.ref_buffers: dict[str, torch.Tensor] = {}  # the reference's buffers (a zaya router's biases)
        self.ref_taken = torch.zeros((), dtype=torch.int64, device=self.device)
        if cfg.loss_cfg.kl_coef:
            if cfg.kl_reference:
                self.ref, self.ref_buffers = self._load_reference(cfg.kl_reference)
                self.ref_taken.fill_(1)
            else:
                self.ref = {n: torch.zeros_like(p.data) for n, p in self.shards.items()}
                self.ref_buffers = {n: b.detach().clone() for n, b in self.buffers.items()}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's state that is not a parameter (a zaya policy's balancing biases), the live tensors
        (looked up each time: moving the model to another dtype replaces them)."""
        if self.tsp > 1:
            return self.net.model_buffers()
        return {n: t for n, t in self.net.state_dict(keep_vars=True).items() if n in self._buffer_names}

    def _load_reference(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """This rank's shards of the HF checkpoint at ``path``, sharded exactly as the policy, and its buffers."""
        from envs.hub import resolve_model
        from train.model.hf_io import CheckpointSlices, load_pretrained

        path = resolve_model(path, "KL reference")  # a directory, or a Hub id's snapshot in the HF cache
        dtype = DTYPES[self.cfg.dtype]  # the compute dtype
        if self.tsp > 1:  # only this rank's slices are read
            with CheckpointSlices(path, dtype=dtype, device=self.device) as src:
                net = TSPCausalLM(src, self.tsp_group)
                shards = {n: p.data for n, p in net.named_shards().items()}
                bufs = net.model_buffers()
        else:
            net = load_pretrained(path, dtype=dtype, device=self.device)
            shards = {n: p.data for n, p in net.named_parameters()}
            bufs = {n: t for n, t in net.state_dict().items() if n in self._buffer_names}
        if set(shards) != set(self.shards) or any(shards[n].shape != p.shape for n, p in self.shards.items()) \
                or set(bufs) != set(self.buffers):
            raise ValueError(f"kl_reference {path} does not have the policy's architecture (parameter names or "
                             "shapes differ)")
        live = self.buffers
        return ({n: shards[n].to(p.dtype) for n, p in self.shards.items()},  # (the loaded model is dropped)
                {n: bufs[n].detach().to(live[n].dtype).clone() for n in live})

    @torch.no_grad()
    def _take_reference(self) -> None:
        for n, p in self.shards.items():
            self.ref[n].copy_(p.data)
        for n, b in self.buffers.items():
            self.ref_buffers[n].copy_(b)
        self.ref_taken.fill_(1)

    @torch.no_grad()
    def _swap_reference(self) -> None:
        """Swap the reference tensors and the parameters' data, and the buffers' values (call twice to undo)."""
        for n, p in self.shards.items():
            p.data, self.ref[n] = self.ref[n], p.data
        for n, b in self.buffers.items():
            held = b.clone()
            b.copy_(self.ref_buffers[n])
            self.ref_buffers[n].copy_(held)

    def optim_config(self, kind: str) -> OptimConfig:
        return (self.cfg.sft_optim or self.cfg.optim) if kind == "sft" else self.cfg.optim

    def _enter(self, kind: str) -> None:
        """A new phase gets a fresh optimizer with its own settings on the current master weights;
        the phase's settings are (re)applied every step (also after a resume inside a phase)."""
        if kind not in ("rl", "sft"):
            raise ValueError(f"unknown batch kind {kind!r}; expected 'rl' or 'sft'")
        o = self.optim_config(kind)
        if kind != self.phase:
            self.opt.restart(o.betas, o.eps, o.weight_decay)
            self.phase = kind
        if kind == "rl" and self.ref is not None and not int(self.ref_taken):
            self._take_reference()  # the first RL batch: the frozen copy of the RL start
        extra = {"muon": o.muon_settings()} if isinstance(self.opt, MeshMuon) else {}
        self.opt.configure(o.betas, o.eps, o.weight_decay, **extra)

    # -- one step -------------------------------------------------------------------------------
    def _packed(self, samples: list[TrainSample], temperature: float, entropy: bool):
        """Per-sample completion log-probs (and entropies) from one packed forward of the rows: the
        unsharded model's (train/rl/packing.py) or the TSP group's, every TSP rank getting all of them."""
        if self.tsp == 1:
            return packed_token_logprobs(self.net, samples, temperature, return_entropy=entropy,
                                         checkpoint_layers=self.cfg.activation_checkpointing)
        row = pack_row(samples, self.device)
        N = row.input_ids.numel()
        scored = torch.zeros(N, dtype=torch.bool).index_fill_(0, row.scored_host, True)  # (host: no device wait)
        out = self.net.token_logprobs(row.input_ids[None], None, temperature, row.routed_experts,
                                      return_entropy=entropy, cu_seqlens=row.cu_seqlens, scored=scored[None])
        local = torch.stack([out[0], out[2].to(out[0].dtype)], -1) if entropy else out[0]
        full = gather_tokens(local, N, self.tsp_group)[0].index_select(0, row.scored)
        if not entropy:
            return list(torch.split(full, row.counts))
        return list(torch.split(full[:, 0], row.counts)), list(torch.split(full[:, 1].detach(), row.counts))

    def _logprobs(self, t: RLTensors, temperature: float, samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, T-1] with grad, entropy [B, T-1]) of the rows, the same on every TSP rank,
        computed packed (the padded ``t`` gives only the layout)."""
        lps, ents = self._packed(samples, temperature, True)
        starts, W = [len(s.prompt_ids) - 1 for s in samples], t.input_ids.shape[1] - 1
        return scatter_rows(lps, starts, W), scatter_rows(ents, starts, W)

    @torch.no_grad()
    def _ref_logprobs(self, t: RLTensors, temperature: float, samples: list[TrainSample]) -> torch.Tensor:
        """The reference policy's log-probs [B, T-1] of the rows (no grad): the policy's forward with the
        reference tensors swapped into its parameters, then swapped back."""
        self._swap_reference()
        try:
            lps = self._packed(samples, temperature, False)
            return scatter_rows(lps, [len(s.prompt_ids) - 1 for s in samples], t.input_ids.shape[1] - 1)
        finally:
            self._swap_reference()

    def step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """One optimizer step on ``batch``; ``step`` (0-based) sets the LR schedule's position
        (``batch.meta["schedule_step"]`` overrides it)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        kind = batch.meta.get("kind", "rl")
        self._enter(kind)
        sft, optim = kind == "sft", self.optim_config(kind)
        step = int(batch.meta.get("schedule_step", step))
        samples = batch.samples
        routed = [s.routed_experts is not None for s in samples if s.trained]
        if any(routed) and not all(routed):  # (every rank sees the whole batch: all of them stop here, together)
            raise ValueError("some samples of the batch carry routed experts and some do not; replay needs all or none")
        denom = loss_denominator(samples, "token_mean" if sft else self.agg)
        live = [i for i, s in enumerate(samples) if s.trained]
        lengths = [s.num_tokens for s in samples]
        mine = [live[i] for i in balance_across_ranks([lengths[i] for i in live], self.dp)[self.dp_rank]]
        micro = [[mine[j] for j in mb] for mb in pack_by_tokens([lengths[i] for i in mine], cfg.tokens_per_micro)]
        temp = 1.0 if sft else (batch.temperature or 1.0)
        acc = MetricSums()  # read once after the loop: no device sync per micro-batch
        self.net.train()
        for rows in micro:
            t = batch_tensors([samples[i] for i in rows], cfg.pad_id, self.device, routing=False)
            ref = None
            if not sft and self.ref is not None:  # the KL reference's log-probs, before the policy's forward
                ref = self._ref_logprobs(t, temp, [samples[i] for i in rows])
            lp, ent = self._logprobs(t, temp, [samples[i] for i in rows])
            if sft:  # mean NLL of the response tokens of the whole batch
                loss, mets = -(lp * t.mask).sum() / denom, {}
            elif cfg.ratio_against == "recompute":  # one step per batch: the policy before it is this forward's
                loss, mets = self.loss_fn(lp, lp.detach(), t.mu, t.advantages, t.mask, cfg.loss_cfg, ref_logprobs=ref,
                                          denom=denom)  # (mismatch metrics: the loss's own, old vs mu)
            else:
                loss, mets = self.loss_fn(lp, t.mu, None, t.advantages, t.mask, cfg.loss_cfg, ref_logprobs=ref,
                                          denom=denom)
                mets.update(mismatch_metrics(lp, t.mu, t.mask))  # this policy (before the step) vs the behaviour one
            loss.backward()
            self.opt.accumulate()
            mets.pop("loss", None)
            if "mismatch_max_abs" in mets:
                acc.max("mismatch_max_abs", mets.pop("mismatch_max_abs"))
            w = t.mask.sum()
            acc.add_weighted(mets, w)
            acc.add("loss_total", loss)  # not a loss metric's name (those are token-weighted)
            acc.add("loss_tokens", w)
            acc.add("entropy_sum", (ent.float() * t.mask).sum())
        self.net.eval()
        lr = optim.lr * lr_factor(step, optim)
        # a batch without a loss token (every rollout dropped) moves nothing, as torch's optimizers skip parameters
        # without a gradient: no decay, no moment update, no step counted (every rank has the same ``live``)
        grad_norm = self.opt.step(lr, optim.grad_clip) if live else 0.0
        # ZAYA1: every rank moves its balancing biases by the load of the whole batch (all TSP and DP ranks)
        balance_router_biases(self.net, (self.tsp_group, self.dp_group) if self.tsp > 1 else self.dp_group)
        sums, maxes = acc.floats()
        weight, loss_total, ent_sum = (sums.pop(k, 0.0) for k in ("loss_tokens", "loss_total", "entropy_sum"))
        adv_abs = [abs(samples[i].advantage) for i in live]  # of the rollouts trained on
        mismatch = maxes.get("mismatch_max_abs", 0.0)
        # every TSP rank computed the same metrics: count TSP rank 0 of each DP replica
        mine_m = (sums, weight, loss_total, ent_sum, mismatch, len(micro)) if self.tsp_rank == 0 else None
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine_m)
        parts = [p for p in parts if p is not None]
        weight = sum(p[1] for p in parts)
        keys = sorted({k for p in parts for k in p[0]})
        out = {k: sum(p[0].get(k, 0.0) for p in parts) / max(weight, 1.0) for k in keys}
        out.update(loss=sum(p[2] for p in parts), entropy=sum(p[3] for p in parts) / max(weight, 1.0),
                   mismatch_max_abs=max(p[4] for p in parts), grad_norm=grad_norm, lr=lr,
                   advantage_abs_mean=sum(adv_abs) / max(1, len(adv_abs)),
                   tokens=float(batch.num_tokens), loss_tokens=weight, rollouts=float(len(samples)),
                   micro_batches_max=float(max(p[5] for p in parts)), time_s=time.perf_counter() - t0)
        if sft:  # SFTTrainer.step's names
            out = {"sft_loss": out["loss"], "grad_norm": grad_norm, "lr": lr, "tokens": out["loss_tokens"],
                   "entropy": out["entropy"], "time_s": out["time_s"]}
        return out

    # -- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype = torch.float32, dst: int | None = None
                        ) -> dict[str, torch.Tensor] | None:
        """The full policy weights in ``dtype``, on CPU, under ``CausalLM.state_dict()`` names
        (``lm_head.weight`` included when tied): the compute weights where they have that dtype (or
        are fp32: then they are the master copy), else the fp32 master copy cast. Collective: every
        rank calls. One parameter at a time, point to point: the DP ranks send their parts of its
        master to DP rank 0 (if the master is needed), then the TSP ranks of the first replica send
        their shards to rank 0, which assembles it. ``dst=0``: only rank 0 gets the dict, the others
        return None (no rank holds more than one parameter beyond its own shards: what publishing a
        large policy needs); ``dst=None``: every rank gets it (rank 0 broadcasts it as one object:
        for tests and modest models)."""
        if dst not in (0, None):
            raise ValueError(f"full_state_dict gathers to rank 0 or to every rank, not to rank {dst}")
        lead = self.dp_rank == 0  # the first DP replica: global ranks 0 .. tsp-1 (rank = d * tsp + t)
        if self.tsp > 1 and lead and not hasattr(self, "_tsp_shapes"):
            self._tsp_shapes = [None] * self.tsp  # every TSP rank's shard shapes (they may differ)
            dist.all_gather_object(self._tsp_shapes, {n: tuple(p.shape) for n, p in self.shards.items()},
                                   group=self.tsp_group)
        full: dict[str, torch.Tensor] = {}
        for n, p in self.shards.items():  # the same order on every rank
            if p.dtype in (dtype, torch.float32):
                t = p.data if lead else None  # every DP replica holds the same compute weights
            else:
                t = self.opt.master_of(p)
            if not lead:
                continue
            t = t.to(dtype)
            if self.tsp == 1:
                full[n] = t.to("cpu", copy=True)
            elif self.tsp_rank > 0:
                dist.send(t.contiguous(), dist.get_global_rank(self.tsp_group, 0), group=self.tsp_group)
            else:
                parts = [t]
                for r in range(1, self.tsp):
                    parts.append(torch.empty(self._tsp_shapes[r][n], dtype=dtype, device=t.device))
                    dist.recv(parts[-1], dist.get_global_rank(self.tsp_group, r), group=self.tsp_group)
                kind = {n: self.net.kinds[n]}
                full[n] = TSPCausalLM.assemble([{n: x} for x in parts], kind)[n].to("cpu", copy=True)
        if dist.get_rank() == 0:
            if self.config.tie_word_embeddings:
                full["lm_head.weight"] = full["model.embed_tokens.weight"]
            full.update({n: b.detach().to("cpu").clone() for n, b in self.buffers.items()})  # (kept in their dtype)
        else:
            full = None
        if dst is None:
            box = [full]
            dist.broadcast_object_list(box, src=0)
            full = box[0]
        return full

    def to_causal_lm(self, dst: int | None = None) -> CausalLM | None:
        """A single-process fp32 :class:`CausalLM` with the trained weights (collective; ``dst=0``: on
        rank 0 only, None on the others, see :meth:`full_state_dict`)."""
        from train.model.hf_io import load_into

        sd = self.full_state_dict(dst=dst)
        if sd is None:
            return None
        model = CausalLM(self.config)
        load_into(model, sd, hf_names=False)
        return model

    # -- checkpoints -----------------------------------------------------------------------------
    @property
    def saves_reference(self) -> bool:
        """Whether the checkpoints hold a KL reference: the frozen copy (kl_coef > 0 without kl_reference)."""
        return self.ref is not None and not self.cfg.kl_reference

    def shard_kind(self, name: str) -> str:
        """How the TSP ranks' shards of parameter ``name`` join (:meth:`ShardedLM.assemble`'s kinds;
        ``rep`` for every parameter when ``tsp == 1``)."""
        return self.net.kinds[name] if self.tsp > 1 else "rep"

    def layout(self) -> list[list]:
        """This rank's flat optimizer vector, in order: ``[name, shard shape, kind]`` per parameter
        (recorded in checkpoints, so that a run on another mesh can find every element)."""
        name_of = {id(p): n for n, p in self.shards.items()}
        return [[name_of[id(p)], list(p.shape), self.shard_kind(name_of[id(p)])] for p in self.opt.params]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's model shards and optimizer state under keys that are unique to what the rank
        holds (model keys are shared by the DP replicas of the same TSP rank, which hold the same
        values), for ``torch.distributed.checkpoint`` (:func:`train.rl.worker.load_checkpoint`
        reshards them for another mesh from the checkpoint's :meth:`layout`). With a frozen
        KL reference, its shards (``kl_ref.tsp{r}.*``), its buffers (``kl_ref_buffers.*``) and whether it was
        taken yet (``kl_ref_taken``).
        A zaya policy's balancing biases (``buffers.*``) are the same on every rank."""
        out = {f"model.tsp{self.tsp_rank}.{n}": p.data for n, p in self.shards.items()}
        out.update({f"buffers.{n}": b for n, b in self.buffers.items()})
        for k, v in self.opt.state_tensors().items():
            out[f"optim.tsp{self.tsp_rank}.dp{self.dp_rank}.{k}"] = v
        if self.saves_reference:
            out.update({f"kl_ref.tsp{self.tsp_rank}.{n}": v for n, v in self.ref.items()})
            out.update({f"kl_ref_buffers.{n}": v for n, v in self.ref_buffers.items()})  # (the same on every rank)
            out["kl_ref_taken"] = self.ref_taken
        return out


# ---------------------------------------------------------------------------------- reference


def reference_optimizer(model: CausalLM, cfg: RLUpdateConfig) -> torch.optim.Optimizer:
    """``train.optim.build_optimizer``'s optimizer: AdamW (no decay on norms and 1-D tensors), or
    Muon on the matrices with AdamW on the rest when ``cfg.optim.name == "muon"``."""
    return build_optimizer(model, cfg.optim)[0]


def reference_update(model: CausalLM, opt: torch.optim.Optimizer, batch: TrainBatch, cfg: RLUpdateConfig,
                     step: int, ref_model: CausalLM | None = None) -> dict[str, float]:
    """The single-process RL step that :class:`RLUpdater` reproduces: the batch's samples that have a loss
    token (``keep`` and a completion; a zaya router counts no others) in one padded forward
    (``modeling.token_logprobs``), the loss with the ratio against ``mu`` (``ratio_against=recompute``: against
    a no-grad forward of the policy before the step, with ``mu`` for truncated IS), with ``kl_coef > 0`` the KL
    to ``ref_model``'s log-probs (a no-grad forward of the same batch),
    clipping by the norm of all gradients, AdamW at ``lr * lr_factor(step)``. Returns (loss,
    grad_norm, lr, and kl_ref with KL)."""
    lr = cfg.optim.lr * lr_factor(step, cfg.optim)
    for g in opt.param_groups:
        g["lr"] = lr
    agg = effective_agg(cfg.loss, cfg.loss_cfg)
    t = batch_tensors([s for s in batch.samples if s.trained], cfg.pad_id, model.device)
    temp = batch.temperature or 1.0
    ref = None
    if cfg.loss_cfg.kl_coef:
        if ref_model is None:
            raise ValueError("kl_coef > 0 needs ref_model")
        with torch.no_grad():
            ref = token_logprobs(ref_model, t.input_ids, t.attention_mask, temp, t.routed_experts)
    old, mu = t.mu, None
    if cfg.ratio_against == "recompute":
        with torch.no_grad():
            old, mu = token_logprobs(model, t.input_ids, t.attention_mask, temp, t.routed_experts), t.mu
    lp = token_logprobs(model, t.input_ids, t.attention_mask, temp, t.routed_experts)
    loss, mets = get_loss(cfg.loss)(lp, old, mu, t.advantages, t.mask, cfg.loss_cfg, ref_logprobs=ref,
                                    denom=loss_denominator(batch.samples, agg))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    clip = cfg.optim.grad_clip
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                          clip if clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    balance_router_biases(model)  # ZAYA1's balancing biases, as train.optim.clip_and_step
    out = {"loss": float(loss.detach()), "grad_norm": float(norm), "lr": lr}
    for k in ("kl_ref", "tis_capped_frac"):
        if k in mets:
            out[k] = float(mets[k])
    return out
