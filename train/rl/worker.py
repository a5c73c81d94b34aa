"""The trainer role of a distributed RL run: torchrun ranks that consume training batches from the
exchange directory, run the sharded RL update (:mod:`train.parallel.rl_update`) and publish weights.

    torchrun --nproc-per-node N -m train.rl.worker --exchange DIR --model CKPT_DIR --steps S \\
        [--tsp D] [--dp N/D] [--config cfg.json|yaml] [--loss dppo_tv] [--lr 1e-5] ... \\
        [--sync-every K] [--checkpoint-every C] [--tokens-per-micro T] [--dtype float32|bfloat16]

Several nodes: the same command on each node, with ``--nnodes M --rdzv-backend c10d
--rdzv-endpoint HEAD:29500 --rdzv-id RUN`` added, ``--model`` readable on every node and ``DIR`` on
a filesystem all nodes share (rank 0 reads the batches and writes weights and metrics; every rank
writes its checkpoint shards); see scripts/slurm/cascade_rl.sbatch.

gloo on CPU, NCCL on CUDA (``LOCAL_RANK`` picks the GPU). Update ``i`` (0-based) consumes
``read_batch(DIR, i)``: a batch's ``step`` is the number of updates applied before it, so the
weights it is applied to are version ``i`` (version 0 = ``--model``). Rank 0 polls for the file
(every ``--poll`` seconds; the decision is broadcast so all ranks agree), reads it and broadcasts
it. Files written (under ``DIR``):

* ``metrics/step-000012.json``: the metrics of update 12 (``step``, ``version`` = 13, the loss
  metrics, ``grad_norm``, ``lr``, ``entropy``, timings), written atomically by rank 0;
* ``weights/v000013/`` (:func:`train.rl.exchange.publish_version`): every ``--sync-every``
  updates, the full weights (``CausalLM.state_dict()`` names, the training dtype), rank 0;
* ``trainer_ckpt/step-000013/``: every ``--checkpoint-every`` updates, a sharded
  ``torch.distributed.checkpoint`` of every rank's model shards, fp32 master weights, AdamW
  moments, the frozen KL reference's shards (``kl_coef > 0`` without ``kl_reference``) and the
  step, then ``meta.json`` and ``COMPLETE``; the newest complete one is resumed
  from on start (on any mesh: :func:`load_checkpoint` reshards for other TSP and DP degrees; the
  weight versions and metrics written after it are removed), older ones pruned to ``--keep-checkpoints``;
* ``final/``: at the end, an HF checkpoint of the fp32 master weights (tokenizer files copied
  from ``--model``) and ``final/COMPLETE``.

An orchestrator that checkpoints its own state after ``step`` updates writes
:func:`request_path` (``ckpt_requests/step-000013``): the worker then publishes version ``step``
and writes its checkpoint of ``step`` (both complete before the request file disappears), so the
two sides always resume from the same update.

SFT on the mesh: with ``--sft-steps S`` the first ``S`` updates are SFT batches (``meta["kind"]
== "sft"``, see :class:`train.parallel.rl_update.RLUpdater`) and RL update ``k`` is update
``S + k``. Batches, metrics and checkpoints are numbered by the update (``S + k``); weight versions
are the policy versions of RL (``weights/v{k}``: version 0 is the policy after SFT), and the
weights of a checkpoint inside the SFT phase go to ``sft/weights/v{i}``.

It stops after ``--steps`` updates in all (counting those before a resume), or when ``DIR/STOP``
exists. The RL loss and optimizer options come from ``--config`` (JSON or YAML holding the fields
of :class:`RLUpdateConfig`: ``loss``, ``loss_cfg``, ``optim``, ``tokens_per_micro``, ``dtype``,
``pad_id``, ``sft_optim``, ``kl_reference``, ``activation_checkpointing``), overridden by flags; :func:`launch_command` builds
the command line for an orchestrator.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from envs.workers import proc_stat

CKPT_DIR = "trainer_ckpt"
COMPLETE = "COMPLETE"


# --------------------------------------------------------------------------------------- config


def load_config(path: str | Path | None, overrides: dict) -> "RLUpdateConfig":
    """An :class:`RLUpdateConfig` from a JSON/YAML file (or defaults) with flag overrides;
    ``overrides`` keys: top-level fields, or ``optim.<field>`` / ``loss_cfg.<field>``."""
    from train.parallel.rl_update import RLUpdateConfig

    d: dict = {}
    if path:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            d = yaml.safe_load(text) or {}
        else:
            d = json.loads(text)
    fields = {f.name for f in dataclasses.fields(RLUpdateConfig)}
    bad = sorted(set(d) - fields)
    if bad:
        raise ValueError(f"unknown config keys {bad}; valid: {', '.join(sorted(fields))}")
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for k, v in overrides.items():
        if v is None:
            continue
        if "." in k:
            sect, key = k.split(".", 1)
            d.setdefault(sect, {})[key] = v
        else:
            d[k] = v
    return RLUpdateConfig(**d)


def config_dict(cfg) -> dict:
    """A JSON-ready dict of an :class:`RLUpdateConfig` (what ``--config`` reads)."""
    return dataclasses.asdict(cfg)


def launch_command(exchange: str | Path, model: str | Path, nproc: int, steps: int, config: str | Path | None = None,
                   tsp: int = 1, port: int | None = None, extra: list[str] | None = None, nnodes: int = 1,
                   rdzv_endpoint: str | None = None, rdzv_id: str = "cascade") -> list[str]:
    """The argv that starts the worker with ``nproc`` ranks on this machine (for ``subprocess``).

    One node: ``--standalone``, or ``--master-addr 127.0.0.1 --master-port PORT``. Several nodes
    (``nnodes > 1``): the c10d rendezvous at ``rdzv_endpoint`` (``HOST:PORT``, the store is hosted
    by the agent on HOST) under ``rdzv_id``; run the same command on every node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if nnodes > 1 or rdzv_endpoint is not None:
        if rdzv_endpoint is None:
            raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint (HOST:PORT of the rendezvous)")
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    elif port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "train.rl.worker", "--exchange", str(exchange), "--model", str(model), "--steps", str(steps),
            "--tsp", str(tsp)]
    if config is not None:
        cmd += ["--config", str(config)]
    return cmd + list(extra or [])


# ------------------------------------------------------------------------------------- helpers


def _write_json(path: Path, obj: dict) -> None:
    from train.rl.exchange import _atomic_write

    _atomic_write(path, lambda t: t.write_text(json.dumps(obj, indent=1)))


CHECKPOINT = "checkpoint"  # what _poll returns for a checkpoint request
ORPHANED = "orphaned"  # what _poll returns when the orchestrator has died


def request_path(exchange: str | Path, step: int) -> Path:
    """The file an orchestrator writes to ask for a checkpoint (and a weight version) after ``step`` updates."""
    return Path(exchange) / "ckpt_requests" / f"step-{step:06d}"


def process_start(pid: int | str = "self") -> str | None:
    """When process ``pid`` started (clock ticks after boot, field 22 of ``/proc/PID/stat``), None where
    there is no /proc: with the pid, it names one process even after the pid is reused."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def _gone(pid: int | None, host: str | None = None, start: str | None = None) -> bool:
    """Whether the orchestrator process ``pid`` (started at ``start``, :func:`process_start`) on ``host``
    has died (checked only on that host): no such process, a zombie (killed, not yet reaped by its
    parent), or another process that took the pid since."""
    import socket

    if not pid or (host and host != socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    fields = proc_stat(pid)
    if fields is None:
        return False  # no /proc: kill(pid, 0) found it
    return fields[0] == "Z" or (start is not None and fields[19] != start)


def _poll(exchange: Path, step: int, poll_s: float, max_wait_s: float, device, parent: tuple = (None, None, None)):
    """Rank 0 waits for batch ``step``, a checkpoint request for ``step`` updates or STOP; every rank watches
    for the death of the orchestrator ``parent`` (pid, host, start: see :func:`_gone`; only the ranks on its
    host can tell, and rank 0 need not be one of them: torchrun orders the nodes by name). The outcome, the
    same on every rank (the largest code any rank saw): the batch, :data:`CHECKPOINT`, None to stop, or
    :data:`ORPHANED` (STOP outranks it, as when the orchestrator wrote STOP and then died)."""
    from train.rl.exchange import read_batch

    t0 = time.monotonic()
    batch = None
    while True:
        code = torch.zeros((), dtype=torch.int32, device=device)
        if dist.get_rank() == 0 and (exchange / "STOP").exists():
            code.fill_(6)
        elif _gone(*parent):
            code.fill_(5)
        elif dist.get_rank() == 0:
            if request_path(exchange, step).exists():
                code.fill_(4)
            elif (batch := read_batch(exchange, step)) is not None:
                code.fill_(1)
            elif max_wait_s and time.monotonic() - t0 > max_wait_s:
                code.fill_(3)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        code = int(code)
        if code == 3:
            raise TimeoutError(f"no batch for step {step} under {exchange} after {max_wait_s:.0f} s")
        if code == 6:
            return None
        if code == 5:
            return ORPHANED
        if code == 4:
            return CHECKPOINT
        if code == 1:
            box = [batch]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        time.sleep(poll_s)


def complete_checkpoints(exchange: Path) -> list[int]:
    d = exchange / CKPT_DIR
    if not d.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in d.iterdir()
                  if p.name.startswith("step-") and p.name[5:].isdigit() and (p / COMPLETE).exists())


def save_checkpoint(up, exchange: Path, step: int, keep: int) -> Path:
    import torch.distributed.checkpoint as dcp

    path = exchange / CKPT_DIR / f"step-{step:06d}"
    done = [(path / COMPLETE).exists()]  # rank 0's view, for every rank (a shared filesystem may lag)
    dist.broadcast_object_list(done, src=0)
    if done[0]:  # this update is checkpointed (--checkpoint-every, then the learner's request): nothing changed
        return path  # since, and removing it first would leave a crash in the re-save no checkpoint
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)  # a partial one from a crash
    dist.barrier()
    state = dict(up.state_tensors(), step=torch.tensor(step, dtype=torch.int64))
    dcp.save(state, checkpoint_id=str(path))
    layouts: list = [None] * up.tsp
    dist.all_gather_object(layouts, up.layout(), group=up.tsp_group)
    if dist.get_rank() == 0:
        meta = {"step": step, "dp": up.dp, "tsp": up.tsp, "world": dist.get_world_size(), "loss": up.cfg.loss,
                "phase": up.phase, "kl_reference": up.saves_reference, "layout": layouts}
        _write_json(path / "meta.json", meta)
        (path / COMPLETE).write_text("ok\n")
        for old in complete_checkpoints(exchange)[:-keep] if keep > 0 else []:
            shutil.rmtree(exchange / CKPT_DIR / f"step-{old:06d}", ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(up, exchange: Path) -> int:
    """Restore the newest complete checkpoint into ``up``; returns its step (0 when there is none).
    On the checkpoint's mesh and layout every rank loads its own tensors. On another mesh (TSP and/or
    DP degree), or with the parameters in another order in the flat optimizer vector (AdamW's and
    Muon's orders differ), each rank rebuilds its shards and optimizer slice from the checkpoint's
    layout (:class:`_OldMesh`): it reads the old slices that its parameters overlap (host memory: at
    most the whole optimizer state), joins each parameter's old shards, takes its new shard and sets
    the weights from the fp32 master copy."""
    import torch.distributed.checkpoint as dcp

    steps = complete_checkpoints(exchange)
    box = [steps[-1] if steps else None]
    dist.broadcast_object_list(box, src=0)  # every rank resumes from the same one
    if box[0] is None:
        return 0
    path = exchange / CKPT_DIR / f"step-{box[0]:06d}"
    meta = json.loads((path / "meta.json").read_text())
    if up.saves_reference and not meta.get("kl_reference"):
        raise ValueError(f"checkpoint {path} holds no KL reference (written with kl_coef=0 or with kl_reference set), "
                         "but this run keeps a frozen copy as its reference: resume with the checkpoint's KL settings")
    state = dict(up.state_tensors(), step=torch.zeros((), dtype=torch.int64))
    old = None
    # another mesh, or the same one laid out otherwise (AdamW then Muon: another parameter order)
    differs = meta.get("layout") is not None and meta["tsp"] == up.tsp and meta["layout"][up.tsp_rank] != up.layout()
    votes: list = [None] * dist.get_world_size()
    dist.all_gather_object(votes, differs)  # every rank takes the same path
    if (meta["tsp"], meta["dp"]) != (up.tsp, up.dp) or any(votes):
        layouts = meta.get("layout")
        if layouts is None:  # written before checkpoints recorded their layout: the same TSP degree has ours
            if meta["tsp"] != up.tsp:
                raise ValueError(f"checkpoint {path} (tsp={meta['tsp']}) records no parameter layout, so it resumes "
                                 f"only on its TSP degree: set trainer.tsp={meta['tsp']}")
            layouts = [None] * up.tsp
            dist.all_gather_object(layouts, up.layout(), group=up.tsp_group)
        old = _OldMesh(layouts, meta["dp"], meta["tsp"] != up.tsp, path)
        state = {k: v for k, v in state.items() if not k.startswith(("optim.", "model."))}
        if old.tsp_changed:
            state = {k: v for k, v in state.items() if not k.startswith("kl_ref.")}
        state.update(old.requests(up))
    held = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    older = [k for k in state if k.startswith("kl_ref_buffers.") and k not in held]
    for k in older:  # written before the reference kept its own biases: it takes the policy's at this step
        del state[k]
    dcp.load(state, checkpoint_id=str(path))  # one call on every rank (a collective), whatever each asks for
    for k in older:
        up.ref_buffers[k[len("kl_ref_buffers."):]].copy_(up.buffers[k[len("kl_ref_buffers."):]])
    if old is not None:
        old.apply(up, state)
    up.phase = meta.get("phase", "rl")  # the optimizer state loaded is that phase's
    return int(state["step"])


class _OldMesh:
    """A checkpoint's mesh, from its layout (``layouts[t]``: TSP rank ``t``'s :meth:`RLUpdater.layout`)
    and DP degree: where each element of each parameter's state lies among the old slices. The flat
    optimizer vector of old TSP rank ``t`` is cut into ``ceil(total / dp)``-element slices, one per DP
    rank (``optim.tsp{t}.dp{d}.*``); ``model.tsp{t}.*`` and ``kl_ref.tsp{t}.*`` hold its whole shards."""

    STATE = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, layouts: list[list], dp: int, tsp_changed: bool, path: Path):
        self.dp, self.tsp_changed = dp, tsp_changed
        self.at: list[dict[str, tuple[int, tuple, str]]] = []  # [t] {name: (offset, shape, kind)}
        self.total: list[int] = []
        for lay in layouts:
            off, where = 0, {}
            for name, shape, kind in lay:
                where[name] = (off, tuple(shape), kind)
                off += math.prod(shape)
            self.at.append(where)
            self.total.append(off)
        self.path = path

    def _slices(self, t: int, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(d, lo, hi)`` of old TSP rank ``t``'s DP slices that overlap ``[a, b)``."""
        chunk = -(-self.total[t] // self.dp)
        return [(d, d * chunk, min(d * chunk + chunk, self.total[t])) for d in range(self.dp)
                if d * chunk < b and a < min(d * chunk + chunk, self.total[t])]

    def _owners(self, name: str) -> range:
        """The old TSP ranks whose shards of ``name`` make the whole (one when it was replicated)."""
        return range(1 if self.at[0][name][2] == "rep" else len(self.at))

    def _mine(self, up) -> list[tuple[str, int, int]]:
        """``(name, new offset, numel)`` of the parameters that this rank's optimizer slice overlaps."""
        out, off = [], 0
        for name, shape, _ in up.layout():
            n = math.prod(shape)
            if off < up.opt.hi and up.opt.lo < off + n:
                out.append((name, off, n))
            off += n
        return out

    def requests(self, up) -> dict[str, torch.Tensor]:
        """The checkpoint tensors this rank needs, as empty host tensors for ``dcp.load`` to fill."""
        names = set(n for n, _, _ in up.layout())
        if any(set(w) != names for w in self.at):
            raise ValueError(f"checkpoint {self.path} holds other parameters than this policy's (another model?)")
        self.new_shapes = [None] * up.tsp  # every new TSP rank's shard shape of each parameter
        dist.all_gather_object(self.new_shapes, {n: tuple(p.shape) for n, p in up.shards.items()},
                               group=up.tsp_group)
        out = {"optim.tsp0.dp0.steps": torch.zeros((), dtype=torch.int64)}  # equal on every rank
        for name, _, _ in self._mine(up):
            for t in self._owners(name):
                off, shape, _ = self.at[t][name]
                for d, lo, hi in self._slices(t, off, off + math.prod(shape)):
                    for k in self.STATE:
                        out.setdefault(f"optim.tsp{t}.dp{d}.{k}", torch.empty(hi - lo, dtype=torch.float32))
        if self.tsp_changed and up.saves_reference:
            dtype = next(iter(up.ref.values())).dtype
            for name in up.shards:
                for t in self._owners(name):
                    out[f"kl_ref.tsp{t}.{name}"] = torch.empty(self.at[t][name][1], dtype=dtype)
        return out

    def _whole(self, name: str, parts: list[torch.Tensor], up, kind_new: str) -> torch.Tensor:
        """This rank's new shard of a parameter-shaped tensor given the old TSP ranks' shards of it."""
        from train.parallel.shard import ShardedLM

        whole = ShardedLM.assemble([{name: x} for x in parts], {name: self.at[0][name][2]})[name]
        return ShardedLM.take(whole, kind_new, [s[name] for s in self.new_shapes], up.tsp_rank)

    def _flat(self, state: dict, t: int, k: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of old TSP rank ``t``'s flat state vector ``k``, from its loaded slices."""
        out = torch.empty(b - a, dtype=torch.float32)
        for d, lo, hi in self._slices(t, a, b):
            x, y = max(a, lo), min(b, hi)
            out[x - a:y - a] = state[f"optim.tsp{t}.dp{d}.{k}"][x - lo:y - lo]
        return out

    @torch.no_grad()
    def apply(self, up, state: dict) -> None:
        opt = up.opt
        mine = opt.state_tensors()
        mine["steps"].copy_(state["optim.tsp0.dp0.steps"])
        for name, off, n in self._mine(up):
            x, y = max(off, opt.lo), min(off + n, opt.hi)
            for k in self.STATE:
                parts = []
                for t in self._owners(name):
                    o, shape, _ = self.at[t][name]
                    parts.append(self._flat(state, t, k, o, o + math.prod(shape)).view(shape))
                new = self._whole(name, parts, up, up.shard_kind(name)).reshape(-1)
                mine[k][x - opt.lo:y - opt.lo].copy_(new[x - off:y - off])
        master = opt.full_master()  # the compute weights are the master copy in their dtype
        for p in opt.params:
            p.data.copy_(master[id(p)])
        if self.tsp_changed and up.saves_reference:
            for name, ref in up.ref.items():
                parts = [state[f"kl_ref.tsp{t}.{name}"] for t in self._owners(name)]
                ref.copy_(self._whole(name, parts, up, up.shard_kind(name)))


# ----------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train.rl.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--exchange", required=True, help="the run's exchange directory")
    ap.add_argument("--model", required=True, help="HF checkpoint of the initial policy (version 0): a directory or Hub id")
    ap.add_argument("--steps", type=int, required=True, help="stop after this many updates in all")
    ap.add_argument("--tsp", type=int, default=1, help="TSP degree D (1: plain data parallel)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / D)")
    ap.add_argument("--config", help="JSON/YAML file with RLUpdateConfig fields")
    ap.add_argument("--loss")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--grad-clip", type=float)
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--schedule", choices=("constant", "cosine", "linear"))
    ap.add_argument("--total-steps", type=int)
    ap.add_argument("--tokens-per-micro", type=int)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--sync-every", type=int, default=1, help="publish weights every K RL updates")
    ap.add_argument("--sft-steps", type=int, default=0, help="the first S updates are SFT batches")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="sharded checkpoint every C updates (0: never)")
    ap.add_argument("--keep-checkpoints", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between looks for the next batch")
    ap.add_argument("--max-wait", type=float, default=0.0, help="give up waiting for a batch after this (0: never)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--timeout-s", type=float, default=0.0,
                    help="longest a rank waits in a collective, e.g. for rank 0 writing a version or a checkpoint "
                         "(0: the backend's default, 10 min for NCCL)")
    ap.add_argument("--orchestrator-pid", type=int, default=None,
                    help="stop, writing no final/, when this process has died (checked where rank 0 runs, on "
                         "--orchestrator-host)")
    ap.add_argument("--orchestrator-host", default=None, help="host name of --orchestrator-pid (default: any)")
    ap.add_argument("--orchestrator-start", default=None,
                    help="start time of --orchestrator-pid (/proc/PID/stat field 22): a process that took its "
                         "pid later is not it")
    a = ap.parse_args(argv)
    if a.steps < 0 or a.sync_every < 1 or a.checkpoint_every < 0 or a.tsp < 1 or not 0 <= a.sft_steps <= a.steps:
        ap.error("--steps >= 0, --sync-every >= 1, --checkpoint-every >= 0, --tsp >= 1 and "
                 "0 <= --sft-steps <= --steps are required")
    return a


def main(argv=None) -> int:
    from train.model.hf_io import save_pretrained
    from train.parallel.rl_update import DTYPES, RLUpdater
    from train.rl.exchange import clear_after, publish_version, version_dir

    a = parse_args(argv)
    from envs.hub import resolve_model

    a.model = str(resolve_model(a.model))  # a local directory, or a Hub id's snapshot in the HF cache
    cfg = load_config(a.config, {"loss": a.loss, "tokens_per_micro": a.tokens_per_micro, "dtype": a.dtype,
                                 "optim.lr": a.lr, "optim.weight_decay": a.weight_decay,
                                 "optim.grad_clip": a.grad_clip, "optim.warmup_steps": a.warmup_steps,
                                 "optim.schedule": a.schedule, "optim.total_steps": a.total_steps})
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = {"timeout": datetime.timedelta(seconds=a.timeout_s)} if a.timeout_s > 0 else {}
        dist.init_process_group("nccl" if cuda else "gloo", **timeout)
    exchange = Path(a.exchange)
    rank = dist.get_rank()

    def published_at(update: int) -> tuple[Path, int]:
        """(root, version) of the weights after ``update`` updates: RL versions count from the end of SFT."""
        return (exchange, update - a.sft_steps) if update >= a.sft_steps else (exchange / "sft", update)

    def publish(update: int) -> None:
        sd = up.full_state_dict(DTYPES[cfg.dtype], dst=0)  # on rank 0 only
        if rank == 0:
            publish_version(*published_at(update), sd)

    try:
        up = RLUpdater(a.model, cfg, tsp=a.tsp, dp=a.dp, device=device)  # TSP ranks read their slices only
        step = load_checkpoint(up, exchange)
        if rank == 0:
            # what the ranks did past the checkpoint (a run resumed by hand: an orchestrator has cleared it
            # already): its weight versions would pass for this run's, and survive its pruning
            clear_after(exchange, step, a.sft_steps)
            print(json.dumps({"worker": "start", "step": step, "dp": up.dp, "tsp": up.tsp, "device": str(device)}),
                  flush=True)
        while step < a.steps:
            parent = (a.orchestrator_pid, a.orchestrator_host, a.orchestrator_start)
            batch = _poll(exchange, step, a.poll, a.max_wait, device, parent)
            if batch is ORPHANED:  # leave no final/ that a resumed run could mistake
                dist.barrier()
                return 0
            if batch is None:
                break
            if batch is CHECKPOINT:  # the orchestrator checkpoints after `step` updates: state and weights
                box = [(version_dir(*published_at(step)) / COMPLETE).exists()]  # already published by a sync?
                dist.broadcast_object_list(box, src=0)
                if not box[0]:
                    publish(step)
                save_checkpoint(up, exchange, step, a.keep_checkpoints)
                if rank == 0:
                    request_path(exchange, step).unlink(missing_ok=True)
                dist.barrier()
                continue
            m = up.step(batch, step)
            step += 1
            if rank == 0:
                rec = {"step": step - 1, "version": step - a.sft_steps, **m}  # (negative: an SFT step)
                _write_json(exchange / "metrics" / f"step-{step - 1:06d}.json", rec)
                print(json.dumps(rec), flush=True)
            if step >= a.sft_steps and (step - a.sft_steps) % a.sync_every == 0:  # (version 0 at the end of SFT)
                publish(step)
            if a.checkpoint_every and step % a.checkpoint_every == 0:
                save_checkpoint(up, exchange, step, a.keep_checkpoints)
        model = up.to_causal_lm(dst=0)  # on rank 0 only
        if rank == 0:
            final = exchange / "final"
            shutil.rmtree(final, ignore_errors=True)
            save_pretrained(model, final, tokenizer_dir=a.model)
            (final / COMPLETE).write_text(f"{step}\n")
            print(json.dumps({"worker": "done", "step": step, "final": str(final)}), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
