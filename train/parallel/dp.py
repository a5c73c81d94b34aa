"""Data parallelism with ZeRO-1: parameters replicated, AdamW state sharded over the ranks.

All parameters are viewed as one flat vector (padded to a multiple of D); rank r owns the
contiguous slice r. A step: gradients are all-reduced with SUM and divided by D (never AVG),
each rank runs AdamW on its slice only (so it holds 1/D of the optimizer state), then the updated
slices are all-gathered and copied back into every rank's parameters.

On a 2D mesh (e.g. DP x TSP) pass the data-parallel group and the rank's (TSP-sharded)
parameters; with ``reduce_grads=False`` the gradients are assumed already synchronised.

:class:`MeshAdamW` is the fuller variant the RL update uses (:mod:`train.parallel.rl_update`):
gradients reduce-scattered instead of all-reduced, replicated-parameter gradients summed over the
model-parallel group, global-norm clipping, per-parameter weight decay, a learning rate per step,
fp32 master weights under a low-precision compute copy, and state tensors for checkpoints.
:class:`MeshMuon` adds Muon for the hidden weight matrices, each orthogonalised as the whole matrix,
once per model-parallel group, by the rank that owns it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from train.optim import adamw_step_, as_matrices, momentum_update, muon_direction, muon_lr_scale
from train.parallel import comm
from train.parallel.shard import ShardedLM


class ZeroAdamW:
    def __init__(self, params, group=None, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, reduce_grads: bool = True):
        seen, self.params = set(), []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("ZeroAdamW got no parameters")
        self.group, self.reduce_grads = group, reduce_grads
        self.D, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.total = sum(p.numel() for p in self.params)
        self.chunk = -(-self.total // self.D)
        lo = min(self.rank * self.chunk, self.total)
        hi = min(lo + self.chunk, self.total)
        self.lo, self.hi = lo, hi
        with torch.no_grad():
            self.shard = self._flat(False)[lo:hi].clone()
        self.opt = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     foreach=False)

    def _flat(self, grads: bool) -> torch.Tensor:
        ts = []
        for p in self.params:
            t = p.grad if grads else p.detach()
            ts.append((torch.zeros_like(p) if t is None else t).reshape(-1))
        return torch.cat(ts)

    @torch.no_grad()
    def step(self) -> None:
        g = self._flat(True)
        if self.reduce_grads:
            with comm.tag("zero1.grads"):
                comm.all_reduce_raw(g, self.group, "all_reduce.grad")
            g /= self.D
        self.shard.grad = g[self.lo:self.hi].clone()
        self.opt.step()
        buf = torch.zeros(self.chunk, dtype=self.shard.dtype, device=self.shard.device)
        buf[:self.hi - self.lo] = self.shard
        with comm.tag("zero1.params"):
            flat = comm.all_gather_raw(buf, self.group, "all_gather.params")[:self.total]
        off = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[off:off + n].view_as(p))
            off += n

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW moments of its slice)."""
        return sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)


class MeshAdamW:
    """ZeRO-1 AdamW for a policy on a DP x model-parallel mesh (e.g. DP x TSP), with fp32 master
    weights, per-parameter weight decay, global-norm clipping and a learning rate given per step.

    ``params``: ``(parameter, replicated, decay)`` for this rank's (model-parallel) shards;
    ``replicated`` marks parameters every model-parallel rank holds in full (norms, routers): each
    rank's gradient of them covers only its own tokens. The parameters are laid out in one flat
    vector (replicated ones first); data-parallel rank d owns the contiguous slice d of it and
    holds the fp32 master copy and both AdamW moments of that slice only. The parameters
    themselves may be a lower-precision compute copy (bf16): gradients are then accumulated in
    fp32 by :meth:`accumulate` after each micro-batch.

    ``mp_group`` and ``dp_group`` are both required (``None`` is torch's whole world: passing it for both would
    count the norm's squares twice); a group of one rank where there is no such parallelism.

    :meth:`step`:
    1. the replicated prefix of the flat gradient is SUM all-reduced over ``mp_group``;
    2. the flat gradient is SUM reduce-scattered over ``dp_group`` (gradients are SUMMED, not
       averaged: losses are normalised by global counts);
    3. the global norm: squares of sharded elements from every rank, of replicated elements from
       model-parallel rank 0 only, SUM all-reduced over both groups; clip like
       ``torch.nn.utils.clip_grad_norm_`` (``coef = min(1, max_norm / (norm + 1e-6))``);
    4. AdamW on the slice, the same arithmetic as ``torch.optim.AdamW`` (single-tensor path);
    5. the updated slices are all-gathered over ``dp_group`` (in the parameters' dtype) and copied
       into the parameters.
    """

    def __init__(self, params, mp_group, dp_group, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        items, seen = [], set()
        for p, rep, decay in params:
            if id(p) not in seen:
                seen.add(id(p))
                items.append((p, bool(rep), bool(decay)))
        if not items:
            raise ValueError("MeshAdamW got no parameters")
        items.sort(key=lambda t: not t[1])  # replicated first (stable)
        self.params = [p for p, _, _ in items]
        self.mp_group, self.dp_group = mp_group, dp_group
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.mp_rank = dist.get_rank(mp_group)
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.n_rep = sum(p.numel() for p, rep, _ in items if rep)
        self.total = sum(p.numel() for p in self.params)
        self.chunk = -(-self.total // self.dp_size)
        self.lo = min(self.dp_rank * self.chunk, self.total)
        self.hi = min(self.lo + self.chunk, self.total)
        self.decay_ranges: list[tuple[int, int]] = []  # in slice coordinates
        self.offsets: dict[int, int] = {}  # id(param) -> its offset in the flat vector
        dev = self.params[0].device
        self.master = torch.empty(self.hi - self.lo, dtype=torch.float32, device=dev)  # this rank's slice only
        off = 0
        for p, _, decay in items:
            self.offsets[id(p)] = off
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                with torch.no_grad():
                    self.master[a - self.lo:b - self.lo] = p.detach().reshape(-1)[a - off:b - off]
            if decay and a < b:
                if self.decay_ranges and self.decay_ranges[-1][1] == a - self.lo:
                    self.decay_ranges[-1] = (self.decay_ranges[-1][0], b - self.lo)
                else:
                    self.decay_ranges.append((a - self.lo, b - self.lo))
            off += p.numel()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps = torch.zeros((), dtype=torch.int64, device=dev)
        self._acc: torch.Tensor | None = None

    def configure(self, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        """Set the hyper-parameters of the next steps (the state is kept)."""
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay

    @torch.no_grad()
    def restart(self, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        """A fresh AdamW (zero moments, step count 0) with these settings on the current master
        weights, as when a new phase (SFT, then RL) builds its own optimizer on the same policy."""
        MeshAdamW.configure(self, betas, eps, weight_decay)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.steps.zero_()
        self._acc = None

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad.reshape(-1).float() if p.grad is not None else
                           torch.zeros(p.numel(), dtype=torch.float32, device=p.device)) for p in self.params])

    @torch.no_grad()
    def accumulate(self) -> None:
        """Move the parameters' gradients into an fp32 accumulator (call after each backward when the
        parameters are a low-precision compute copy; a no-op for fp32 parameters)."""
        if self.params[0].dtype == torch.float32:
            return
        if self._acc is None:
            self._acc = torch.zeros(self.total, dtype=torch.float32, device=self.params[0].device)
        off = 0
        for p in self.params:  # in place, parameter by parameter (no second flat fp32 copy of the gradients)
            if p.grad is not None:
                self._acc[off:off + p.numel()].add_(p.grad.reshape(-1))
            off += p.numel()
        self.zero_grad()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float, max_norm: float = 0.0) -> float:
        """Synchronise, clip (``max_norm`` > 0) and apply one AdamW step; returns the pre-clip norm."""
        g = self._acc if self._acc is not None else self._flat_grads()
        self._acc = None
        self.zero_grad()
        if self.n_rep and dist.get_world_size(self.mp_group) > 1:
            comm.all_reduce_raw(g[:self.n_rep], self.mp_group, "all_reduce.grad")
        if self.dp_size > 1:
            g = torch.nn.functional.pad(g, (0, self.dp_size * self.chunk - self.total))
            with comm.tag("zero1.grads"):
                g = comm.reduce_scatter_raw(g, self.dp_group, "reduce_scatter.grad")
        g = g[:self.hi - self.lo]
        n_rep_here = min(max(self.n_rep - self.lo, 0), self.hi - self.lo)
        sq = g[n_rep_here:].square().sum()
        if self.mp_rank == 0:
            sq = sq + g[:n_rep_here].square().sum()
        comm.all_reduce_raw(sq, self.mp_group, "all_reduce.norm")
        comm.all_reduce_raw(sq, self.dp_group, "all_reduce.norm")
        norm = sq.sqrt()
        if max_norm > 0:
            g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        self._update(g, lr)
        buf = torch.zeros(self.chunk, dtype=self.params[0].dtype, device=g.device)
        buf[:self.hi - self.lo] = self.master
        with comm.tag("zero1.params"):
            flat = comm.all_gather_raw(buf, self.dp_group, "all_gather.params")[:self.total]
        off = 0
        for p in self.params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        return float(norm)

    def _update(self, g: torch.Tensor, lr: float) -> None:
        """Apply the step to the master slice given its synchronised, clipped gradient ``g``."""
        self._adamw(g, lr)

    def _adamw(self, g: torch.Tensor, lr: float) -> None:
        """``torch.optim.AdamW``'s single-tensor arithmetic on the master slice."""
        self.steps += 1
        self._decay(lr)
        adamw_step_(self.master, g, self.exp_avg, self.exp_avg_sq, int(self.steps), lr, self.betas, self.eps)

    def _decay(self, lr: float) -> None:
        """Decoupled weight decay of the decaying elements of the master slice."""
        if self.weight_decay:
            for a, b in self.decay_ranges:
                self.master[a:b].mul_(1 - lr * self.weight_decay)

    @torch.no_grad()
    def full_master(self) -> dict[int, torch.Tensor]:
        """This model-parallel rank's fp32 master parameters, ``{id(param): tensor}`` (all-gather over
        the data-parallel group: every rank of it calls)."""
        buf = torch.zeros(self.chunk, dtype=torch.float32, device=self.master.device)
        buf[:self.hi - self.lo] = self.master
        flat = comm.all_gather_raw(buf, self.dp_group, "all_gather.params")[:self.total]
        out, off = {}, 0
        for p in self.params:
            out[id(p)] = flat[off:off + p.numel()].view(p.shape)
            off += p.numel()
        return out

    @torch.no_grad()
    def master_of(self, p: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """The fp32 master copy of parameter ``p`` (one of :attr:`params`), shaped as ``p``, on its
        device, on data-parallel rank ``dst`` only (None on the others). The ranks whose slices hold a
        part of it send that part point to point, so no rank holds more than this one parameter beyond
        its own slice (where :meth:`full_master` gives every rank all of them). Collective over the
        data-parallel group (every rank calls, for the same parameter)."""
        off, n = self.offsets[id(p)], p.numel()
        out = torch.empty(n, dtype=torch.float32, device=self.master.device) if self.dp_rank == dst else None
        group = self.dp_group if self.dp_group is not None else dist.group.WORLD
        for r in range(self.dp_size):
            lo = min(r * self.chunk, self.total)
            a, b = max(off, lo), min(off + n, lo + self.chunk, self.total)
            if a >= b:
                continue
            if r == self.dp_rank == dst:
                out[a - off:b - off] = self.master[a - self.lo:b - self.lo]
            elif r == self.dp_rank:
                dist.send(self.master[a - self.lo:b - self.lo], dist.get_global_rank(group, dst), group=group)
            elif self.dp_rank == dst:
                dist.recv(out[a - off:b - off], dist.get_global_rank(group, r), group=group)
        return None if out is None else out.view(p.shape)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer state of this rank (for checkpoints; load by copying into these tensors)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}


class MeshMuon(MeshAdamW):
    """:class:`MeshAdamW` with Muon for the hidden weight matrices: :class:`train.optim.Muon` on a
    DP x model-parallel mesh, equal to the single-process step up to float rounding.

    ``params``: ``(parameter, kind, decay, row_blocks)``. ``kind`` says how the model-parallel
    ranks' shards of the parameter join (:meth:`ShardedLM.assemble`'s kinds; ``rep``: every
    model-parallel rank holds it whole, as every parameter with model-parallel degree 1);
    ``row_blocks`` is :func:`train.optim.muon_row_blocks` of the parameter, None for AdamW.
    ``muon``: :meth:`train.optim.OptimConfig.muon_settings` (None: AdamW on every element, for a
    phase whose optimizer is AdamW).

    Layout: the flat vector is [replicated Muon | replicated AdamW | sharded AdamW | sharded Muon],
    so the replicated prefix stays contiguous and the AdamW elements of any data-parallel slice are
    one range. The state tensors are :class:`MeshAdamW`'s, whatever the phase (a checkpoint's
    shapes do not depend on it): on Muon elements ``exp_avg`` is the momentum buffer (used only
    with momentum > 0) and ``exp_avg_sq`` is unused.

    A step, after :class:`MeshAdamW`'s gradient synchronisation (SUM) and global-norm clipping:
    1. decoupled weight decay on decaying elements; AdamW on the slice's AdamW range;
    2. U = :func:`train.optim.momentum_update` of the slice's Muon elements (the gradient itself
       with momentum 0);
    3. U is all-gathered over ``dp_group``: each rank then has its model-parallel shard's full U;
    4. each whole matrix has one owner in ``mp_group``, fixed at construction: the matrices that some
       rank of the group needs (those overlapping its data-parallel slice; the ranks' slices and
       shard shapes are exchanged once with ``all_gather_object``) go, largest Newton-Schulz cost
       first (blocks * rows * cols * min(rows, cols)), to the least loaded rank; every rank sends
       its U shard of each sharded matrix to the matrix's owner (one ``all_to_all`` over
       ``mp_group``; a replicated matrix's owner has its whole U already);
    5. the owner joins the shards (:meth:`ShardedLM.assemble`) and orthogonalises the whole matrix
       once (:func:`train.optim.muon_direction`); a second ``all_to_all`` gives each rank the part
       of O it needs: the range of its shard (:meth:`ShardedLM.take`; all of O for a replicated
       matrix) that its data-parallel slice holds;
    6. each rank adds ``-lr * muon_lr_scale(m, n) * O`` to its master slice.
    With ``mp_group`` of size 1 steps 4-5 exchange nothing: each rank orthogonalises the matrices
    its slice overlaps.
    Cost: U crosses DP once more (an fp32 all-gather: with the reduce-scatter, what an all-reduce
    moves). Over MP (degree D, W elements of sharded matrices, balanced owners) a rank sends about
    (D-1)/D^2 W of U shards to the owners and as much O back (less with DP > 1: only the ranges
    the slices hold), 2(D-1)/D^2 W in all against an all-gather's (D-1)/D W: the same at D = 2,
    half at D = 4. Each matrix's Newton-Schulz runs once per model-parallel group, the matrices
    split among its ranks by cost, so a rank does about 1/D of it (it is still repeated on each
    data-parallel rank whose slice the matrix overlaps).
    """

    def __init__(self, params, mp_group, dp_group, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, muon: dict | None = None):
        items, seen = [], set()
        for p, kind, decay, rb in params:
            if id(p) not in seen:
                seen.add(id(p))
                items.append((p, kind, bool(decay), rb))
        rank_of = lambda t: (0 if t[3] is not None else 1) if t[1] == "rep" else (2 if t[3] is None else 3)  # noqa: E731
        items.sort(key=rank_of)  # stable; MeshAdamW's own (stable) sort keeps this order
        super().__init__([(p, kind == "rep", decay) for p, kind, decay, _ in items], mp_group, dp_group,
                         betas, eps, weight_decay)
        self.muon = muon
        counts = [0, 0, 0, 0]
        for t in items:
            counts[rank_of(t)] += t[0].numel()
        clip = lambda x: min(max(x - self.lo, 0), self.hi - self.lo)  # noqa: E731
        self.adam_range = (clip(counts[0]), clip(counts[0] + counts[1] + counts[2]))
        self.matrices: list[tuple[torch.nn.Parameter, int, int, str]] = []  # (param, flat offset, row_blocks, kind)
        off = 0
        for p, kind, _, rb in items:
            if rb is not None:
                self.matrices.append((p, off, rb, kind))
            off += p.numel()
        self.mp_size = dist.get_world_size(mp_group)
        self._plan()

    def _plan(self) -> None:
        """Who orthogonalises which matrix, and what the two exchanges of a step move (fixed at
        construction; every rank of ``mp_group`` computes the same plan from the same gathered
        facts: each rank's slice and, per matrix, its shard's shape and flat offset)."""
        D, me = self.mp_size, self.mp_rank
        mine = (self.lo, self.hi, [(tuple(p.shape), off) for p, off, _, _ in self.matrices])
        metas = [mine] * D  # D > 1 without matrices: nothing to plan
        if D > 1 and self.matrices:
            metas = [None] * D
            dist.all_gather_object(metas, mine, group=self.mp_group)
            if any(len(m[2]) != len(self.matrices) for m in metas):
                raise ValueError("MeshMuon: the model-parallel ranks hold different numbers of Muon matrices")
        self.shapes = [[metas[r][2][i][0] for r in range(D)] for i in range(len(self.matrices))]  # [i][r]
        # rng[r][i]: the range [x, y) of rank r's shard of matrix i (flattened) that r's data-parallel
        # slice holds (None: none); lo, hi and the offsets are r's own (shard sizes may differ)
        rng: list[list[tuple[int, int] | None]] = []
        for lo, hi, mats in metas:
            row = []
            for shape, off in mats:
                x, y = max(off, lo), min(off + math.prod(shape), hi)
                row.append((x - off, y - off) if x < y else None)
            rng.append(row)
        self.dims, cost = [], []  # (rows, cols) of each whole matrix's blocks; Newton-Schulz cost
        for i, (_, _, rb, kind) in enumerate(self.matrices):
            if kind == "rep" or D == 1:
                whole = self.shapes[i][me]
            else:
                whole = ShardedLM.assemble([{"w": torch.empty(sh, device="meta")} for sh in self.shapes[i]],
                                           {"w": kind})["w"].shape
            blocks, rows, cols = as_matrices(torch.empty(whole, device="meta"), rb).shape
            self.dims.append((rows, cols))
            cost.append(blocks * rows * cols * min(rows, cols))
        needed = [i for i in range(len(self.matrices)) if any(rng[r][i] for r in range(D))]
        # owners: largest cost first (ties by index) to the least loaded rank, preferring one that
        # needs the matrix, then the lowest rank
        load, self.owner = [0] * D, {}
        for i in sorted(needed, key=lambda i: (-cost[i], i)):
            d = min(range(D), key=lambda r: (load[r], rng[r][i] is None, r))
            self.owner[i] = d
            load[d] += cost[i]
        self.own = [i for i in needed if self.owner[i] == me]  # the matrices this rank orthogonalises
        self.need = {i: rng[me][i] for i in needed if rng[me][i] is not None}  # what this rank applies
        rep = lambda i: self.matrices[i][3] == "rep" or D == 1  # noqa: E731  # the owner has the whole U
        # exchange 1: each rank's U shard of a sharded matrix to its owner; 2: each rank's range of O
        self.send_u = [[i for i in needed if self.owner[i] == d and d != me and not rep(i)] for d in range(D)]
        self.recv_u = [[i for i in self.own if r != me and not rep(i)] for r in range(D)]
        self.send_o = [[i for i in self.own if r != me and rng[r][i] is not None] for r in range(D)]
        self.recv_o = [[i for i in self.need if self.owner[i] == d and d != me] for d in range(D)]
        numel = lambda i, r: math.prod(self.shapes[i][r])  # noqa: E731
        span = lambda i, r: rng[r][i][1] - rng[r][i][0]  # noqa: E731
        self.split_u = ([sum(numel(i, me) for i in ms) for ms in self.send_u],
                        [sum(numel(i, r) for i in ms) for r, ms in enumerate(self.recv_u)])
        self.split_o = ([sum(span(i, r) for i in ms) for r, ms in enumerate(self.send_o)],
                        [sum(span(i, me) for i in ms) for ms in self.recv_o])
        self.rng = rng
        # whether anything crosses at all: the same answer on every rank (a function of the gathered facts)
        self.exchange_u = any(self.owner[i] != r and not rep(i) for i in needed for r in range(D))
        self.exchange_o = any(self.owner[i] != r and rng[r][i] is not None for i in needed for r in range(D))

    def configure(self, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                  muon: dict | None = None) -> None:
        super().configure(betas, eps, weight_decay)
        self.muon = muon

    def _update(self, g: torch.Tensor, lr: float) -> None:
        s = self.muon
        if s is None:  # an AdamW phase
            return self._adamw(g, lr)
        self.steps += 1
        t, n = int(self.steps), self.hi - self.lo
        self._decay(lr)
        a, b = self.adam_range
        if b > a:
            adamw_step_(self.master[a:b], g[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], t, lr, self.betas, self.eps)
        buf = torch.zeros(self.chunk, dtype=torch.float32, device=g.device)
        for x, y in ((0, a), (b, n)):  # the slice's Muon elements
            if y > x:
                buf[x:y] = momentum_update(g[x:y], self.exp_avg[x:y], s["momentum"], s["nesterov"])
        with comm.tag("muon.update"):
            full = comm.all_gather_raw(buf, self.dp_group, "all_gather.muon")[:self.total]
        D, me, dev = self.mp_size, self.mp_rank, g.device
        U_of = lambda i: full[self.matrices[i][1]:self.matrices[i][1] + self.matrices[i][0].numel()]  # noqa: E731
        cat = lambda ts: torch.cat(ts) if ts else torch.zeros(0, dtype=torch.float32, device=dev)  # noqa: E731
        got = None
        if self.exchange_u:  # every rank's U shards to the owners of their matrices
            with comm.tag("muon.matrices"):
                got = comm.all_to_all_raw(cat([U_of(i) for ms in self.send_u for i in ms]), *self.split_u,
                                          self.mp_group, "all_to_all.muon")
        pos = [sum(self.split_u[1][:r]) for r in range(D)]
        O_of = {}
        for i in self.own:  # orthogonalise each owned matrix once
            p, _, rb, kind = self.matrices[i]
            U = U_of(i).view(p.shape)
            if kind != "rep" and D > 1:
                parts = []
                for r in range(D):
                    if r == me:
                        parts.append(U)
                    else:
                        k = math.prod(self.shapes[i][r])
                        parts.append(got[pos[r]:pos[r] + k].view(self.shapes[i][r]))
                        pos[r] += k
                U = ShardedLM.assemble([{"w": x} for x in parts], {"w": kind})["w"]
            O_of[i] = muon_direction(U, rb, s["ns_steps"], s["ns_dtype"])

        def piece(i: int, r: int) -> torch.Tensor:  # rank r's part of O: its shard's range in r's slice
            x, y = self.rng[r][i]
            return ShardedLM.take(O_of[i], self.matrices[i][3], self.shapes[i], r).reshape(-1)[x:y]

        back = None
        if self.exchange_o:  # each rank its part of the orthogonalised matrices
            with comm.tag("muon.matrices"):
                back = comm.all_to_all_raw(cat([piece(i, r) for r, ms in enumerate(self.send_o) for i in ms]),
                                           *self.split_o, self.mp_group, "all_to_all.muon")
        pos = [sum(self.split_o[1][:r]) for r in range(D)]
        for i, (x, y) in self.need.items():
            d = self.owner[i]
            if d == me:
                o = piece(i, me)
            else:
                o = back[pos[d]:pos[d] + y - x]
                pos[d] += y - x
            off = self.matrices[i][1]
            rows, cols = self.dims[i]
            self.master[off + x - self.lo:off + y - self.lo].add_(o, alpha=-lr * muon_lr_scale(rows, cols, s["lr_scale"]))
