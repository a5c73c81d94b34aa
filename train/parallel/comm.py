"""Collectives as autograd Functions, and a byte tracker.

Every Function's docstring names its backward dual. Two families matter and must not be mixed up:

* Partitioned data (TSP, sequence parallel): each rank's downstream computation is different
  (other tokens), so the backward of a gather SUMS the ranks' contributions (reduce-scatter).
* Replicated data (Megatron TP regions): every rank computes the same thing from the same
  tensor, so the backward of a gather only takes this rank's slice (``gather_from_tp``), and the
  backward of an all-reduce is the identity (``reduce_from_tp``).

Weight streaming (TSP): ``ring_apply`` and ``broadcast_apply`` run a function on weight shards
that travel between ranks. They save only their inputs (never the received shards) and recompute
each shard's partial result in backward, where the shards travel again and the gradient of each
shard is delivered to its owner.

Byte accounting (:class:`CommTracker`) uses the bandwidth-optimal algorithm for each collective
(what NCCL's ring/chain implementations move), per rank, whatever gloo does underneath:
all-gather of ``n`` bytes per rank: (D-1)n sent and received; reduce-scatter of ``N`` bytes:
(D-1)/D N; all-reduce: 2(D-1)/D N; broadcast of ``N`` (a chain starting at src): src sends N,
the chain's last rank (src-1 mod D) receives N, the others send and receive N; reduce is the
reverse chain; point-to-point and all-to-all: what is sent to and received from the other ranks
(a rank's block for itself is not counted). All reductions use SUM (never AVG).
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------- tracking


@dataclass
class CommTracker:
    """Records ``(tag, op, bytes_sent, bytes_received)`` for every collective this rank runs."""

    records: list[tuple[str, str, int, int]] = field(default_factory=list)

    def add(self, op: str, sent: float, recv: float, tag: str | None = None) -> None:
        self.records.append((tag if tag is not None else current_tag(), op, int(round(sent)), int(round(recv))))

    def by(self, key: str = "op") -> dict[str, list[int]]:
        """Totals ``{key: [sent, received, calls]}`` grouped by ``op``, ``tag`` or ``tag/op``."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for tag, op, s, r in self.records:
            k = {"op": op, "tag": tag, "tag/op": f"{tag}/{op}"}[key]
            out[k][0] += s
            out[k][1] += r
            out[k][2] += 1
        return dict(out)

    @property
    def sent(self) -> int:
        return sum(r[2] for r in self.records)

    @property
    def received(self) -> int:
        return sum(r[3] for r in self.records)


# Trackers are process-wide: on CUDA, autograd runs backward on its own device thread, so a
# thread-local list would miss every backward collective. Tags stay per thread (backward carries the
# tag its forward had in ``ctx.tag``).
_trackers: list[CommTracker] = []
_trackers_lock = threading.Lock()
_state = threading.local()


def _tags() -> list[str]:
    if not hasattr(_state, "tags"):
        _state.tags = []
    return _state.tags


def current_tag() -> str:
    tags = _tags()
    return "/".join(tags) if tags else "-"


@contextlib.contextmanager
def track():
    """``with track() as t:`` records every collective run inside (forward and backward, whichever
    thread autograd runs the backward on)."""
    t = CommTracker()
    with _trackers_lock:
        _trackers.append(t)
    try:
        yield t
    finally:
        with _trackers_lock:
            _trackers.remove(t)


@contextlib.contextmanager
def tag(name: str):
    """Label the collectives issued inside (e.g. ``layer3.attn``); a backward pass is labelled with
    the tag its forward had, plus ``.bwd`` on the op."""
    _tags().append(name)
    try:
        yield
    finally:
        _tags().pop()


def _record(op: str, sent: float, recv: float, tag_: str | None = None) -> None:
    with _trackers_lock:
        active = list(_trackers)
    for t in active:
        t.add(op, sent, recv, tag_)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def _chain_bytes(n: int, me: int, src: int, D: int) -> tuple[int, int]:
    """(sent, received) of a chain broadcast from src (reduce to src is the same chain reversed)."""
    if D == 1:
        return 0, 0
    last = (src - 1) % D
    return (0 if me == last else n), (0 if me == src else n)


# ----------------------------------------------------------------------------- raw collectives


def all_gather_raw(x: torch.Tensor, group, op_tag: str = "all_gather", tag_: str | None = None) -> torch.Tensor:
    """[D * x.shape[0], ...]: every rank's ``x`` stacked along dim 0 in rank order."""
    D = _size(group)
    x = x.contiguous()
    out = torch.empty((D * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if D == 1:
        return out.copy_(x)
    dist.all_gather_into_tensor(out, x, group=group)
    _record(op_tag, (D - 1) * nbytes(x), (D - 1) * nbytes(x), tag_)
    return out


def reduce_scatter_raw(x: torch.Tensor, group, op_tag: str = "reduce_scatter", tag_: str | None = None) -> torch.Tensor:
    """SUM over ranks of ``x`` [D * m, ...], then this rank's block [m, ...]."""
    D = _size(group)
    x = x.contiguous()
    if D == 1:
        return x.clone()
    out = torch.empty((x.shape[0] // D,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    _record(op_tag, (D - 1) * nbytes(out), (D - 1) * nbytes(out), tag_)
    return out


def all_reduce_raw(x: torch.Tensor, group, op_tag: str = "all_reduce", tag_: str | None = None,
                   op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place SUM (or ``op``) all-reduce of ``x``; returns ``x``."""
    D = _size(group)
    if D == 1:
        return x
    dist.all_reduce(x, op=op, group=group)
    _record(op_tag, 2 * (D - 1) / D * nbytes(x), 2 * (D - 1) / D * nbytes(x), tag_)
    return x


def broadcast_raw(x: torch.Tensor, src: int, group, op_tag: str = "broadcast", tag_: str | None = None) -> torch.Tensor:
    """In-place broadcast from group rank ``src``; returns ``x``."""
    D = _size(group)
    if D == 1:
        return x
    dist.broadcast(x, src=_global(group, src), group=group)
    s, r = _chain_bytes(nbytes(x), _rank(group), src, D)
    _record(op_tag, s, r, tag_)
    return x


def reduce_raw(x: torch.Tensor, dst: int, group, op_tag: str = "reduce", tag_: str | None = None) -> torch.Tensor:
    """In-place SUM reduce to group rank ``dst`` (only ``dst``'s result is meaningful)."""
    D = _size(group)
    if D == 1:
        return x
    dist.reduce(x, dst=_global(group, dst), op=dist.ReduceOp.SUM, group=group)
    r, s = _chain_bytes(nbytes(x), _rank(group), dst, D)  # the broadcast chain, reversed
    _record(op_tag, s, r, tag_)
    return x


def all_to_all_raw(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group,
                   op_tag: str = "all_to_all", tag_: str | None = None) -> torch.Tensor:
    """All-to-all of flat ``x``: its consecutive blocks of ``send_splits[j]`` elements go to group
    rank j; returns the blocks received, ``recv_splits[j]`` elements from rank j, in rank order."""
    D, r = _size(group), _rank(group)
    x = x.contiguous()
    out = torch.empty((sum(recv_splits),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if D == 1:
        return out.copy_(x)
    dist.all_to_all_single(out, x, list(recv_splits), list(send_splits), group=group)
    per = x.element_size()
    for d in x.shape[1:]:
        per *= d
    _record(op_tag, (sum(send_splits) - send_splits[r]) * per, (sum(recv_splits) - recv_splits[r]) * per, tag_)
    return out


def sendrecv(send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int, group, tag_: str,
             op_tag: str, p2p_tag: int = 0) -> list:
    """Post a send of ``send`` to group rank ``to`` and a receive into ``recv`` from ``frm``
    (either may be None); returns the requests to ``wait`` on."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), _global(group, to), group, p2p_tag))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, _global(group, frm), group, p2p_tag))
    if not ops:
        return []
    _record(op_tag, nbytes(send) if send is not None else 0, nbytes(recv) if recv is not None else 0, tag_)
    return dist.batch_isend_irecv(ops)


def wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


# ------------------------------------------------------------------------ autograd collectives


class AllGatherSeq(torch.autograd.Function):
    """Forward: all-gather along dim 0 (partitioned data: every rank's block, in rank order).
    Backward dual: reduce-scatter (SUM) - each rank receives the summed gradient of its block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.tag = group, current_tag()
        return all_gather_raw(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_raw(g, ctx.group, "reduce_scatter.bwd", ctx.tag), None


class ReduceScatterSeq(torch.autograd.Function):
    """Forward: SUM reduce-scatter along dim 0 (partial sums -> this rank's block).
    Backward dual: all-gather of the blocks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.tag = group, current_tag()
        return reduce_scatter_raw(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_raw(g, ctx.group, "all_gather.bwd", ctx.tag), None


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``. Forward: identity (a replicated tensor enters a tensor-parallel region).
    Backward dual: all-reduce (SUM) of the partial input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.tag = group, current_tag()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_raw(g.clone(), ctx.group, "all_reduce.bwd", ctx.tag), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``. Forward: all-reduce (SUM) of partial results into a replicated tensor.
    Backward dual: identity (every rank holds the full, identical gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_raw(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromTP(torch.autograd.Function):
    """Forward: all-gather of shards along the LAST dim into a replicated tensor (e.g. logits).
    Backward dual: split - keep this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, list(sizes)
        D, r = _size(group), _rank(group)
        width = max(sizes)
        pad = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        full = all_gather_raw(pad.movedim(-1, 0), group)  # [D*width, ...]
        parts = [full[i * width:i * width + sizes[i]] for i in range(D)]
        ctx.r = r
        return torch.cat(parts, 0).movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, g):
        off = sum(ctx.sizes[:ctx.r])
        return g[..., off:off + ctx.sizes[ctx.r]].contiguous(), None, None


class AllGatherRep(torch.autograd.Function):
    """Forward: all-gather along dim 0 into a tensor that every rank then uses IDENTICALLY (e.g.
    the per-token log-probs of a sequence split over TSP ranks, fed to a loss that every rank
    computes in full). Backward dual: no communication - this rank's block of the gradient
    (every rank holds the full, identical gradient, so a reduce-scatter would count it D times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.r, ctx.n = _rank(group), x.shape[0]
        return all_gather_raw(x, group, "all_gather.rep")

    @staticmethod
    def backward(ctx, g):
        return g[ctx.r * ctx.n:(ctx.r + 1) * ctx.n].contiguous(), None


class Broadcast(torch.autograd.Function):
    """Forward: broadcast from ``src`` (``x`` is the source tensor on src, a buffer of the same
    shape elsewhere). Backward dual: reduce (SUM) of every rank's gradient to ``src``."""

    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group, ctx.tag = src, group, current_tag()
        return broadcast_raw(x.clone(), src, group)

    @staticmethod
    def backward(ctx, g):
        g = reduce_raw(g.clone(), ctx.src, ctx.group, "reduce.bwd", ctx.tag)
        return (g if _rank(ctx.group) == ctx.src else torch.zeros_like(g)), None, None


def all_gather_seq(x, group):
    return AllGatherSeq.apply(x, group)


def reduce_scatter_seq(x, group):
    return ReduceScatterSeq.apply(x, group)


def all_gather_replicated(x, group):
    return AllGatherRep.apply(x, group)


def copy_to_tp(x, group):
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return ReduceFromTP.apply(x, group)


def gather_from_tp(x, group, sizes):
    return GatherFromTP.apply(x, group, sizes)


# --------------------------------------------------------------------------- weight streaming


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding ``tensors`` (one message per shard)."""
    if not tensors:
        raise ValueError("nothing to pack: a weight shard bundle holds at least one tensor")
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: Sequence[tuple]) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(flat[off:off + n].view(s))
        off += n
    return out


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _numel(shapes) -> int:
    n = 0
    for s in shapes:
        k = 1
        for d in s:
            k *= d
        n += k
    return n


class RingApply(torch.autograd.Function):
    """``y = sum_j fn(*inputs, j, *W_j)`` (or the concatenation along the last dim, shard order)
    where each rank owns shard ``W_rank`` and the shards travel around the ring rank -> rank+1.

    Forward: D steps; at step s rank r holds W_{r-s}; the transfer of that shard to the next rank
    is posted (``batch_isend_irecv``) BEFORE computing on it (double buffering: one shard being
    used, one in flight). Only the inputs are saved.

    Backward dual: the reverse ring (rank -> rank-1). At step s rank r holds W_{r+s}, recomputes
    its partial with autograd, and adds its weight gradient to the accumulator of that shard,
    which arrived from rank r+1 and goes on to rank r-1 together with the shard; the last hop
    delivers it to the owner, which adds its own contribution. Input gradients accumulate
    locally. Each of W and its accumulator makes D-1 hops.
    """

    @staticmethod
    def forward(ctx, fn, group, shapes_of, concat, n_in, *args):
        inputs, own = args[:n_in], args[n_in:]
        D, r = _size(group), _rank(group)
        tag_ = current_tag()
        cur, j = pack(own).detach(), r
        parts: dict[int, torch.Tensor] = {}
        for s in range(D):
            reqs, nxt = [], None
            if s < D - 1:
                nxt = torch.empty(_numel(shapes_of((j - 1) % D)), dtype=cur.dtype, device=cur.device)
                reqs = sendrecv(cur, (r + 1) % D, nxt, (r - 1) % D, group, tag_, "ring", p2p_tag=s)
            with torch.no_grad():
                parts[j] = fn(*inputs, j, *unpack(cur, shapes_of(j)))
            wait(reqs)
            cur, j = nxt, (j - 1) % D
        ctx.fn, ctx.group, ctx.shapes_of, ctx.concat, ctx.n_in, ctx.tag = fn, group, shapes_of, concat, n_in, tag_
        ctx.save_for_backward(*args)
        if concat:
            return torch.cat([parts[i] for i in range(D)], -1)
        out = parts[r]
        for i in range(D):
            if i != r:
                out = out + parts[i]
        return out

    @staticmethod
    def backward(ctx, dy):
        args = ctx.saved_tensors
        inputs, own = args[:ctx.n_in], args[ctx.n_in:]
        group, fn, shapes_of = ctx.group, ctx.fn, ctx.shapes_of
        D, r = _size(group), _rank(group)
        if ctx.concat:
            widths = [shapes_of(i)[0][0] for i in range(D)]  # concat mode: first shape's dim 0 is the width
            offs = [sum(widths[:i]) for i in range(D)]
        need = [ctx.needs_input_grad[5 + i] and _is_float(inputs[i]) for i in range(ctx.n_in)]
        in_grads = [None] * ctx.n_in
        cur, j = pack(own).detach(), r
        own_grad, acc_in, acc_reqs = None, None, []
        for s in range(D):
            reqs, nxt = [], None
            if s < D - 1:
                nxt = torch.empty(_numel(shapes_of((j + 1) % D)), dtype=cur.dtype, device=cur.device)
                reqs = sendrecv(cur, (r - 1) % D, nxt, (r + 1) % D, group, ctx.tag, "ring.bwd", p2p_tag=1000 + s)
            ws = [w.detach().requires_grad_() for w in unpack(cur, shapes_of(j))]
            xs = [x.detach().requires_grad_() if n else x for x, n in zip(inputs, need)]
            with torch.enable_grad():
                y = fn(*xs, j, *ws)
            g_out = dy[..., offs[j]:offs[j] + widths[j]] if ctx.concat else dy
            wanted = [x for x, n in zip(xs, need) if n] + ws
            grads = torch.autograd.grad(y, wanted, g_out, allow_unused=True)
            k = 0
            for i, n in enumerate(need):
                if n:
                    g = grads[k] if grads[k] is not None else torch.zeros_like(xs[i])
                    in_grads[i] = g if in_grads[i] is None else in_grads[i] + g
                    k += 1
            dw = pack([g if g is not None else torch.zeros_like(w) for g, w in zip(grads[k:], ws)])
            if s == 0:
                own_grad = dw
            else:
                if acc_in is not None:
                    wait(acc_reqs)
                    dw = dw + acc_in
                acc_in = torch.empty(_numel(shapes_of(r)) if s == D - 1 else _numel(shapes_of((j + 1) % D)),
                                     dtype=dw.dtype, device=dw.device)
                acc_reqs = sendrecv(dw, (r - 1) % D, acc_in, (r + 1) % D, group, ctx.tag, "ring_grad.bwd",
                                    p2p_tag=2000 + s)
            wait(reqs)
            cur, j = nxt, (j + 1) % D
        if D > 1:
            wait(acc_reqs)
            own_grad = own_grad + acc_in
        w_grads = unpack(own_grad, [tuple(o.shape) for o in own])
        return (None, None, None, None, None, *in_grads, *w_grads)


def ring_apply(fn: Callable, inputs: Sequence, own: Sequence[torch.Tensor], group,
               shapes_of: Callable[[int], list[tuple]], concat: bool = False) -> torch.Tensor:
    """Run ``fn(*inputs, j, *W_j)`` over every rank's weight shard ``W_j`` (see :class:`RingApply`).

    ``shapes_of(j)`` gives the shapes of rank j's shard tensors (shards may be uneven). With
    ``concat`` the partial results are concatenated along the last dim in shard order (their
    widths must equal ``shapes_of(j)[0][0]``), else summed."""
    return RingApply.apply(fn, group, shapes_of, concat, len(inputs), *inputs, *own)


class BroadcastApply(torch.autograd.Function):
    """``y = fn(*inputs, *B_1, ..., *B_m)`` where each weight bundle ``B_i`` belongs to group
    rank ``srcs[i]`` and is broadcast from there (a chain) to every rank.

    Only the inputs are saved (not the received weights). Backward dual: the bundles are
    broadcast again, ``fn`` is recomputed with autograd (collectives inside ``fn`` run their own
    duals), and each bundle's gradient is reduced (SUM) to its owner.
    """

    @staticmethod
    def forward(ctx, fn, group, srcs, shapes, n_in, n_own, *args):
        inputs, own = args[:n_in], args[n_in:]
        ctx.fn, ctx.group, ctx.srcs, ctx.shapes, ctx.n_in, ctx.n_own = fn, group, srcs, shapes, n_in, n_own
        ctx.tag = current_tag()
        bufs = BroadcastApply._bundles(group, srcs, shapes, n_own, own, inputs, "broadcast", ctx.tag)
        with torch.no_grad():
            y = fn(*inputs, *[w for b in bufs for w in b])
        ctx.save_for_backward(*args)
        return y

    @staticmethod
    def _bundles(group, srcs, shapes, n_own, own, inputs, op, tag_):
        r = _rank(group)
        ref = next(t for t in list(own) + list(inputs) if _is_float(t))
        out, k = [], 0
        for src, shp, n in zip(srcs, shapes, n_own):
            mine = own[k:k + n]
            k += n
            if src == r:
                flat = pack(mine).detach().clone()
            else:
                flat = torch.empty(_numel(shp), dtype=ref.dtype, device=ref.device)
            broadcast_raw(flat, src, group, op, tag_)
            out.append(unpack(flat, shp))
        return out

    @staticmethod
    def backward(ctx, dy):
        args = ctx.saved_tensors
        inputs, own = args[:ctx.n_in], args[ctx.n_in:]
        group, r = ctx.group, _rank(ctx.group)
        bufs = BroadcastApply._bundles(group, ctx.srcs, ctx.shapes, ctx.n_own, own, inputs, "broadcast.bwd", ctx.tag)
        need = [ctx.needs_input_grad[6 + i] and _is_float(inputs[i]) for i in range(ctx.n_in)]
        xs = [x.detach().requires_grad_() if n else x for x, n in zip(inputs, need)]
        ws = [w.detach().requires_grad_() for b in bufs for w in b]
        with tag(ctx.tag), torch.enable_grad():
            y = ctx.fn(*xs, *ws)
            wanted = [x for x, n in zip(xs, need) if n] + ws
            grads = list(torch.autograd.grad(y, wanted, dy, allow_unused=True))
        in_grads, k = [], 0
        for x, n in zip(xs, need):
            if n:
                in_grads.append(grads[k] if grads[k] is not None else torch.zeros_like(x))
                k += 1
            else:
                in_grads.append(None)
        w_grads, i = [], k
        for src, shp, n in zip(ctx.srcs, ctx.shapes, ctx.n_own):
            gs = [g if g is not None else torch.zeros(s, dtype=ws[0].dtype, device=ws[0].device)
                  for g, s in zip(grads[i:i + len(shp)], shp)]
            i += len(shp)
            flat = reduce_raw(pack(gs).contiguous(), src, group, "reduce.bwd", ctx.tag)
            if src == r:
                w_grads.extend(unpack(flat, shp))
        return (None, None, None, None, None, None, *in_grads, *w_grads)


def broadcast_apply(fn: Callable, inputs: Sequence, bundles: Sequence[tuple[int, list[tuple], Sequence[torch.Tensor]]],
                    group) -> torch.Tensor:
    """``fn(*inputs, *weights of bundle 1, ..., *weights of bundle m)`` with bundle ``(src, shapes,
    own tensors)`` broadcast from group rank ``src`` (``own`` is empty on the other ranks)."""
    srcs = tuple(b[0] for b in bundles)
    shapes = tuple(tuple(tuple(s) for s in b[1]) for b in bundles)
    own = [t for b in bundles for t in b[2]]
    n_own = tuple(len(b[2]) for b in bundles)
    return BroadcastApply.apply(fn, group, srcs, shapes, len(inputs), n_own, *inputs, *own)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a rendezvous or a server started next)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
