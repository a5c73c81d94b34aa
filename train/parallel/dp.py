"""Data parallelism with ZeRO-1: parameters replicated, AdamW state sharded over the ranks.

All parameters are viewed as one flat vector (padded to a multiple of D); rank r owns the
contiguous slice r. A step: gradients are all-reduced with SUM and divided by D (never AVG),
each rank runs AdamW on its slice only (so it holds 1/D of the optimizer state), then the updated
slices are all-gathered and copied back into every rank's parameters.

On a 2D mesh (e.g. DP x TSP) pass the data-parallel group and the rank's (TSP-sharded)
parameters; with ``reduce_grads=False`` the gradients are assumed already synchronised.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from train.parallel import comm


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
