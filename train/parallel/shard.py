"""Shared helpers for the sharded layouts: uneven splits, process-group meshes, RMSNorm as a
function, the expert partial product used by TSP and TP (experts sliced along their
intermediate dim), and the weight sources a sharded model reads its slices from (a full model in
memory, or a checkpoint read slice by slice: :class:`train.model.hf_io.CheckpointSlices`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from train.model.modeling import CausalLM, expert_mlp


def split_sizes(n: int, D: int) -> list[int]:
    """Sizes of D nearly equal parts of n (the first n % D parts are one larger)."""
    return [n // D + (1 if i < n % D else 0) for i in range(D)]


def split_range(n: int, D: int, j: int) -> tuple[int, int]:
    """(offset, size) of part j of n split in D."""
    sizes = split_sizes(n, D)
    return sum(sizes[:j]), sizes[j]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arithmetic as :class:`train.model.modeling.RMSNorm` (fp32 statistics)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def expert_partial(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """The MoE output contributed by one slice of every expert's intermediate dim (the experts' MLP,
    :func:`train.model.modeling.expert_mlp`, on gate_up [E, 2*Ij, H] and down [E, H, Ij]). Summing over
    slices gives the full experts' output, because silu(g) * u is elementwise in the intermediate dim
    and down_proj sums over it."""
    return expert_mlp(x, w, idx, gate_up, down)


FALLBACK_REFUSAL = ("the sharded core (trainer.nproc > 1, TSP, TP) cannot shard a model loaded through the "
                    "transformers fallback ({arch}); use trainer.nproc=1")


class StateDictSource:
    """A full state dict (Cascade's names) as a weight source: ``read(name, *index)`` is
    ``sd[name][index]`` (a view). :class:`train.model.hf_io.CheckpointSlices` reads the same
    slices from a checkpoint without materialising the rest."""

    def __init__(self, config, sd: dict[str, torch.Tensor]):
        self.config, self.sd = config, sd

    def read(self, name: str, *index: slice) -> torch.Tensor:
        return self.sd[name][index]


def weight_source(model_or_source):
    """The weight source of a sharded model's constructor: a :class:`CausalLM` (its weights, read as
    slices of its state dict) or a source already (anything with ``config`` and ``read``)."""
    if isinstance(model_or_source, nn.Module):
        if getattr(model_or_source, "is_transformers_fallback", False):
            arch = getattr(model_or_source.config, "model_type", type(model_or_source).__name__)
            raise ValueError(FALLBACK_REFUSAL.format(arch=arch))
        return StateDictSource(model_or_source.config,
                               {k: v.detach() for k, v in model_or_source.state_dict().items()})
    return model_or_source


def read_expert_slice(src, prefix: str, off: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice [off, off+size) of every expert's intermediate dim of ``prefix + "gate_up_proj"`` (its gate
    rows, then its up rows) and ``"down_proj"``, read from a weight source (only those rows and columns)."""
    inter, every = src.config.moe_intermediate_size, slice(None)
    gate = src.read(prefix + "gate_up_proj", every, slice(off, off + size))
    up = src.read(prefix + "gate_up_proj", every, slice(inter + off, inter + off + size))
    return torch.cat([gate, up], 1), src.read(prefix + "down_proj", every, every, slice(off, off + size))


def join_gate_up(gate_ups: list[torch.Tensor]) -> torch.Tensor:
    """Full stacked ``gate_up_proj`` from the slices made by :func:`read_expert_slice`, in order
    (``down_proj`` slices simply concatenate along dim 2)."""
    gates = [g[:, :g.shape[1] // 2] for g in gate_ups]
    ups = [g[:, g.shape[1] // 2:] for g in gate_ups]
    return torch.cat(gates + ups, 1)


def make_mesh(dp: int, tp: int):
    """Process groups of a dp x tp mesh over the default group (rank = d * tp + t): returns
    (this rank's model-parallel group, this rank's data-parallel group). Every rank creates every
    group, in the same order, as ``new_group`` requires."""
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"mesh {dp} x {tp} does not match world size {world}")
    rank = dist.get_rank()
    mp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([d * tp + t for t in range(tp)])
        if rank // tp == d:
            mp_group = g
    for t in range(tp):
        g = dist.new_group([d * tp + t for d in range(dp)])
        if rank % tp == t:
            dp_group = g
    return mp_group, dp_group


def all_reduce_grads(params, group, divide: int = 1) -> None:
    """SUM all-reduce of the gradients of ``params`` over ``group`` in one flat bucket, then /divide."""
    from train.parallel.comm import all_reduce_raw

    params = [p for p in params if p.grad is not None]
    if not params or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce_raw(flat, group, "all_reduce.grad")
    if divide != 1:
        flat /= divide
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


class ShardedLM(nn.Module):
    """Bookkeeping shared by the sharded layouts: parameters kept under the policy's names with a
    kind that says how the ranks' shards join (``rep``: replicated; ``row``/``col``: concatenated
    along dim 0/1; ``expert_gate_up``/``expert_down``: slices of every expert's intermediate dim;
    ``qk_rows:m``: rows of two parts, each shard's first m rows in the first part (a zaya CCA
    convolution's query channels, then its key channels))."""

    def __init__(self, cfg, group=None, dp_group=None):
        super().__init__()
        self.config, self.group, self.dp_group = cfg, group, dp_group
        self.D, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.kinds: dict[str, str] = {}
        self._p: dict[str, nn.Parameter] = {}

    def _add(self, name: str, value: torch.Tensor, kind: str) -> None:
        p = nn.Parameter(value.detach().clone().contiguous())
        self.register_parameter(name.replace(".", "__"), p)
        self._p[name], self.kinds[name] = p, kind

    def param(self, name: str) -> nn.Parameter:
        return self._p[name]

    def named_shards(self) -> dict[str, nn.Parameter]:
        return dict(self._p)

    def replicated_parameters(self) -> list[nn.Parameter]:
        return [self._p[n] for n, k in self.kinds.items() if k == "rep"]

    def shard_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards (or their gradients) under the policy's parameter names."""
        out = {}
        for n, p in self._p.items():
            t = p.grad if grads else p
            out[n] = (torch.zeros_like(p) if t is None else t).detach().clone()
        return out

    @staticmethod
    def assemble(shards: list[dict[str, torch.Tensor]], kinds: dict[str, str]) -> dict[str, torch.Tensor]:
        """Full parameter tensors (CausalLM state-dict names) from every rank's shards, in rank order."""
        out = {}
        for n, kind in kinds.items():
            parts = [s[n] for s in shards]
            if kind == "rep":
                out[n] = parts[0]
            elif kind == "row":
                out[n] = torch.cat(parts, 0)
            elif kind == "col":
                out[n] = torch.cat(parts, 1)
            elif kind == "expert_gate_up":
                out[n] = join_gate_up(parts)
            elif kind == "expert_down":
                out[n] = torch.cat(parts, 2)
            elif kind.startswith("qk_rows:"):  # each shard: its first m rows in part 1, the rest in part 2
                m = int(kind.split(":")[1])
                out[n] = torch.cat([x[:m] for x in parts] + [x[m:] for x in parts], 0)
            else:
                raise ValueError(f"unknown shard kind {kind!r}")
        return out

    @staticmethod
    def take(full: torch.Tensor, kind: str, shapes: list[tuple], r: int) -> torch.Tensor:
        """Rank ``r``'s shard of the full tensor ``full`` (the inverse of :meth:`assemble`), given the
        shapes of every rank's shard of it, in rank order."""
        if kind == "rep":
            return full
        if kind == "expert_gate_up":  # gate rows then up rows of the rank's intermediate slice
            inter, off, size = full.shape[1] // 2, sum(s[1] // 2 for s in shapes[:r]), shapes[r][1] // 2
            return torch.cat([full[:, off:off + size], full[:, inter + off:inter + off + size]], 1)
        if kind.startswith("qk_rows:"):  # m rows of part 1 (m per shard), then the shard's rows of part 2
            m = int(kind.split(":")[1])
            second = m * len(shapes) + sum(s[0] - m for s in shapes[:r])
            return torch.cat([full[m * r:m * (r + 1)], full[second:second + shapes[r][0] - m]])
        dim = {"row": 0, "col": 1, "expert_down": 2}.get(kind)
        if dim is None:
            raise ValueError(f"unknown shard kind {kind!r}")
        off = sum(s[dim] for s in shapes[:r])
        return full.narrow(dim, off, shapes[r][dim])

    def gather_full(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every rank gets the full tensors (or gradients), on CPU; for tests and checkpoints of small models."""
        shards = [None] * self.D
        # on CPU: all_gather_object unpickles a CUDA tensor onto the device it came from (another rank's GPU)
        mine = {k: v.cpu() for k, v in self.shard_state_dict(grads).items()}
        dist.all_gather_object(shards, mine, group=self.group)
        return self.assemble(shards, self.kinds)

    def to_causal_lm(self) -> "CausalLM":
        """A single-process :class:`CausalLM` holding the gathered weights (collective: every rank calls)."""
        from train.model.hf_io import load_into

        full = self.gather_full()
        buffers = getattr(self, "model_buffers", dict)()  # a zaya policy's balancing biases (the same on every rank)
        full.update({k: v.detach().cpu() for k, v in buffers.items()})
        model = CausalLM(self.config)
        load_into(model, full, hf_names=False)
        return model
