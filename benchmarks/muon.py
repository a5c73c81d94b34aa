"""Muon on the TSP mesh: does splitting the Newton-Schulz work among the TSP ranks pay?

One optimizer step (Muon on the hidden matrices, AdamW on the rest, momentum 0, fp32 Newton-Schulz,
5 iterations) of a dense Qwen3-style policy (``--hidden``, ``--layers``), timed two ways on the same
gradients:

- ``single``: the single-process optimizer (:func:`train.parallel.rl_update.reference_optimizer`)
  on the whole model, with all ``--threads`` threads: the reference;
- ``tsp``: :class:`train.parallel.dp.MeshMuon` inside :class:`train.parallel.rl_update.RLUpdater`
  on dp1 x tsp``--tsp`` (gloo ranks, ``--threads / --tsp`` threads each): each whole matrix is
  orthogonalised by its owner rank only, the shards travel in two all-to-alls.

Wall clock around ``step()`` (the sharded one: the slowest rank's), medians over ``--steps`` warm
steps after one warm-up step; the Newton-Schulz time is taken by a wrapper around
``muon_direction`` (outside the code under test). The two paths must compute the same step:
``max_param_diff`` is the largest difference between the single-process model's parameters and the
sharded ones gathered whole to rank 0 (``RLUpdater.full_state_dict(dst=0)``), both after the warm-up and
the timed steps (taken after the timing, before the wire steps below). Prints ONE JSON line: ``single_step_s``,
``tsp_step_s``, ``step_speedup`` (single / tsp), ``single_ns_s`` and ``tsp_ns_s`` (per rank: its
owned matrices), ``ns_split`` (single / the slowest rank's), and the Muon bytes per rank per step
over the TSP group three ways:

- ``muon_wire_bytes_per_rank``: measured on the wire, outside the code under test, as
  ``benchmarks/parallel.py`` does: after the timed steps, ``--wire-reps`` more steps in which each of
  MeshMuon's two ``all_to_all.muon`` exchanges runs inside a :func:`train.parallel.measure.wire_windows`
  window (the loopback interface's transmit counter, /proc/net/dev ``lo`` tx_bytes, read by rank 0
  just outside shared-memory ``multiprocessing`` barriers, so no barrier traffic is counted; gloo is
  put on ``lo``). A step's bytes are the sum of its two windows; min over the steps minus min over
  idle windows of the same length (a sleep), divided by D: the mean rank's (the counter sees every
  rank's bytes; TCP/IP headers, ACKs and gloo's own messages included). ``muon_wire_bytes_all_ranks``,
  ``muon_wire_windows_bytes`` and ``muon_wire_idle_bytes`` are the raw figures. These steps are
  not timed;
- ``muon_sent_bytes_per_rank``: counted by ``comm.track`` (not a measurement): the code under
  test's own record of its split sizes, a unit-test check of the plan;
- ``formula_bytes``: 2 (D-1)/D^2 x the whole sharded matrices' fp32 bytes, when the owners balance
  the bytes exactly.

    python benchmarks/muon.py                  # hidden 512, 4 layers (12.1M parameters), tsp 2, 2 threads
    python benchmarks/muon.py --threads 1      # the reference on one thread, each rank on one
    python benchmarks/muon.py --hidden 128 --layers 1 --vocab 128 --steps 1 --wire-reps 1   # a smoke test

Measured on this project's 2-core CPU (2026-12-02, quiet machine, 6 warm steps per run; 28 Muon
matrices). "before": the same script with ``train/parallel/dp.py`` of commit 1f698fb (every TSP rank
orthogonalised every matrix), runs interleaved with the current code's (commit 3905a0f's dp.py):

| dp.py | threads | runs | step_speedup (single / tsp) | tsp_step_s | Newton-Schulz s per rank | single_ns_s | matrices per rank |
| --- | --- | --- | --- | --- | --- | --- | --- |
| before | 2 | 3 | 0.48, 0.61, 0.51 | 1.49, 1.50, 1.47 | 1.20-1.32 | 0.69-0.89 | 28, 28 |
| current | 2 | 3 | 0.79, 0.81, 0.84 | 0.91, 0.93, 0.88 | 0.66-0.71 | 0.70-0.73 | 14, 14 |
| current | 1 | 2 | 1.47, 1.77 | 0.86, 0.85 | 0.66-0.67 | 1.23, 1.46 | 14, 14 |
| 4aaf4ad (2026-12-03, another machine) | 2 | 2 | 0.95, 0.87 | 1.17, 1.12 | 0.91-0.98 | 1.09, 0.96 | 14, 14 |
| 5e45654 (2026-12-03, this session's machine) | 2 | 1 | 0.87 | 1.54 | 1.11-1.30 | 1.31 | 14, 14 |
| dd837b4 (2026-12-04: the master slice built per parameter, construction only) | 2 | 1 | 1.01 | 0.89 | 0.74-0.75 | 0.89 | 14, 14 |
| 0fbd5d7 (2026-12-05, another machine: the RL step's metrics path) | 2 | 1 | 0.84 | 0.64 | 0.51 | 0.53 | 14, 14 |
| 6f000cc (2026-12-05, later: RLUpdater's recompute branch, off this path) | 2 | 1 | 0.83 | 0.64 | 0.50-0.51 | 0.52 | 14, 14 |
| cc178f2 (2026-12-06: nothing on this path changed) | 2 | 1 | 0.85 | 0.64 | 0.51 | 0.53 | 14, 14 |

Muon bytes sent per rank per step over the TSP group: 23.05 MB counted by ``comm.track`` (recorded
here as "measured" at the time; it is the code's own record of its split sizes, not a measurement),
23.05 MB by the formula, in every run (at D = 2 the two all-to-alls move what the former all-gather
did; at D = 4 half). Since 32a4206 ``muon_wire_bytes_per_rank`` gives the bytes on the wire (see
above). First run with it, at a345f38 (2026-12-06, defaults): 23.07 MB per rank on the wire (46.15 MB both ranks;
the three windows 46.8, 46.1, 50.2 MB, idle windows 0) against 23.05 MB by the formula (+0.09%: TCP/IP headers
and gloo's own messages); steps 0.477 s one process, 0.581 s sharded (0.82x), ``ns_split`` 1.03. Re-run at c9a84d9
(2026-12-06, later: the trainer ranks' config check shared, nothing on this path): 23.14 MB per rank on the wire against
23.05 MB by the formula (+0.37%); steps 0.452 s one process, 0.554 s sharded (0.82x). Re-run at 486a354 (2026-12-06,
later: the model config's RoPE checks, off this path; one run, alone; a first run beside another benchmark gave 0.53x
and is not counted): 23.07 MB per rank against 23.05 MB (+0.09%); steps 0.479 s one process, 0.596 s sharded (0.80x).
Splitting the matrices makes the sharded step 1.6x faster than before (0.88-0.93 s against
1.47-1.50 s). Against one process on both cores it is 0.79-1.01x across the runs above (0.84 at 0fbd5d7): each rank
orthogonalises its half on one thread, about 1.7-2x slower per matrix than on two (``single_ns_s`` 0.70-0.73 s on
two threads, 1.23-1.46 s on one), so ``ns_split`` is 1.0-1.1 where D = 2 devices would give about 2. With a core per rank and the reference on one core (the
``--threads 1`` rows, a flattering regime on this machine but the shape of D GPUs, each its own
device) the split gives 1.8-2.2x on Newton-Schulz and 1.5-1.8x on the step.
Re-run at bbe8685 (2026-12-07; alone): step 0.90x one process (0.870 s against 0.783 s), 23.07 MB on the wire per
rank per step against 23.05 MB by the formula, parameters equal to the single process's (max diff 0.0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _config(a):
    from train.model.config import ModelConfig

    heads = a.hidden // 64
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3 // 2 * 2,
                       num_hidden_layers=a.layers, head_dim=64, num_attention_heads=heads,
                       num_key_value_heads=max(heads // 2, 1))


def _rl_config():
    from train.optim import OptimConfig
    from train.parallel.rl_update import RLUpdateConfig

    return RLUpdateConfig(loss="dppo_tv", optim=OptimConfig(lr=1e-3, weight_decay=0.1, name="muon", muon_momentum=0.0))


def _model(a):
    from train.model.modeling import CausalLM

    torch.manual_seed(0)
    return CausalLM(_config(a))


def _whole_grad(name: str, shape, step: int) -> torch.Tensor:
    """The gradient of a whole parameter at ``step``: the same in every process (seeded by name and step)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(tuple(shape), generator=g) * 1e-2


class _NSTimer:
    """Wraps ``muon_direction`` in ``module``: seconds spent in it since the last ``reset``."""

    def __init__(self, module):
        self.module, self.real, self.s = module, module.muon_direction, 0.0

        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = self.real(*args, **kw)
            self.s += time.perf_counter() - t0
            return out

        module.muon_direction = timed


def single(a) -> dict:
    import train.optim as optim_mod
    from train.parallel.rl_update import reference_optimizer

    torch.set_num_threads(a.threads)
    model = _model(a)
    opt = reference_optimizer(model, _rl_config())
    ns = _NSTimer(optim_mod)
    times, ns_times = [], []
    params = dict(model.named_parameters())
    for step in range(a.steps + 1):
        for n, p in params.items():
            p.grad = _whole_grad(n, p.shape, step)
        ns.s = 0.0
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        ns_times.append(ns.s)
    return {"step_s": statistics.median(times[1:]), "ns_s": statistics.median(ns_times[1:]),
            "params": sum(p.numel() for p in model.parameters()),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}  # after the timed steps


class _WireTimer:
    """While ``on``, runs each ``all_to_all.muon`` call of ``comm.all_to_all_raw`` inside one
    :func:`train.parallel.measure.wire_windows` window (all ranks make the same calls, so the
    shared-memory barriers pair up); ``deltas`` (rank 0 only) and ``secs`` per call."""

    def __init__(self, comm, barrier, reader: bool):
        from train.parallel.measure import wire_windows

        self.comm, self.real, self.on = comm, comm.all_to_all_raw, False
        self.deltas: list[int] = []
        self.secs: list[float] = []

        def wrapped(*args, **kw):
            op_tag = args[4] if len(args) > 4 else kw.get("op_tag", "all_to_all")
            if not self.on or op_tag != "all_to_all.muon":
                return self.real(*args, **kw)
            box = []
            d, t = wire_windows(lambda: box.append(self.real(*args, **kw)), barrier, reader, 1)
            self.deltas += d
            self.secs += t
            return box[0]

        comm.all_to_all_raw = wrapped


def _rank(rank: int, world: int, port: int, out_dir: str, barrier, a) -> None:
    import torch.distributed as dist

    import train.parallel.dp as dp_mod
    from train.parallel import comm
    from train.parallel.measure import wire_windows
    from train.parallel.rl_update import RLUpdater

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(a.threads // world, 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    up = RLUpdater(_model(a), _rl_config(), tsp=world, dp=1)
    ns = _NSTimer(dp_mod)
    times, ns_times, sent = [], [], []
    for step in range(a.steps + 1):
        _shard_grads(up, step, world)
        ns.s = 0.0
        dist.barrier()
        with comm.track() as t:
            t0 = time.perf_counter()
            up.opt.step(1e-3, 0.0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        ns_times.append(ns.s)
        sent.append(sum(v[0] for k, v in t.by("tag/op").items() if k.startswith("muon.matrices/")))
    # the weights after the timed steps, whole on rank 0, against single()'s (collective; not timed)
    state = up.full_state_dict(dst=0)
    # bytes on the wire: untimed steps with each Muon all-to-all in its own counter window
    reader = rank == 0
    wire = _WireTimer(comm, barrier, reader)
    windows, window_s = [], []
    for step in range(a.steps + 1, a.steps + 1 + a.wire_reps):
        _shard_grads(up, step, world)
        n0, s0 = len(wire.deltas), len(wire.secs)
        wire.on = True
        up.opt.step(1e-3, 0.0)
        wire.on = False
        windows.append(sum(wire.deltas[n0:]))
        window_s.append(sum(wire.secs[s0:]))
    comm.all_to_all_raw = wire.real
    nap = statistics.median(window_s) if window_s else 0.0
    idle = wire_windows(lambda: time.sleep(nap), barrier, reader, a.wire_reps)[0]
    sharded = sum(p.numel() for p, _, _, kind in up.opt.matrices if kind != "rep") * 4  # this rank's shards
    torch.save({"step_s": times[1:], "ns_s": statistics.median(ns_times[1:]), "sent": statistics.median(sent[1:]),
                "sharded_bytes": sharded, "own": len(getattr(up.opt, "own", up.opt.matrices)), "matrices": len(up.opt.matrices),
                "wire": windows if reader else [], "idle": idle, "calls": len(wire.secs), "state": state},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _shard_grads(up, step: int, world: int) -> None:
    """Each rank's shard of the same whole gradients as :func:`single` uses (replicated parameters:
    1/world of it on each rank, as the TSP all-reduce SUMs them)."""
    import torch.distributed as dist

    from train.parallel.shard import ShardedLM

    shapes: list = [None] * world
    dist.all_gather_object(shapes, {n: tuple(p.shape) for n, p in up.shards.items()})
    for n, p in up.shards.items():
        kind, every = up.shard_kind(n), [s[n] for s in shapes]
        whole_shape = ShardedLM.assemble([{n: torch.empty(s, device="meta")} for s in every], {n: kind})[n].shape
        whole = _whole_grad(n, whole_shape, step)
        p.grad = whole / world if kind == "rep" else ShardedLM.take(whole, kind, every, up.tsp_rank).clone()


def sharded(a) -> dict:
    import torch.multiprocessing as mp

    from train.parallel.comm import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback interface, whose counter is read
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(a.tsp, free_port(), d, ctx.Barrier(a.tsp), a), nprocs=a.tsp, join=True)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(a.tsp)]
    D = a.tsp
    r0 = ranks[0]
    wire = (min(r0["wire"]) - min(r0["idle"] or [0])) if r0["wire"] else None  # all ranks, one step
    return {"step_s": statistics.median(max(x) for x in zip(*(r["step_s"] for r in ranks))),
            "ns_s": [round(r["ns_s"], 4) for r in ranks], "sent": [r["sent"] for r in ranks],
            "formula": 2 * (D - 1) / D ** 2 * D * ranks[0]["sharded_bytes"],  # W = D x a rank's shards
            "wire": wire, "wire_windows": r0["wire"], "wire_idle": r0["idle"],
            "own": [r["own"] for r in ranks], "matrices": ranks[0]["matrices"], "state": r0["state"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tsp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--wire-reps", type=int, default=3,
                    help="untimed steps after the timed ones whose Muon all-to-alls are measured on the wire")
    a = ap.parse_args(argv)
    s = single(a)
    t = sharded(a)
    if set(s["state"]) != set(t["state"]):
        raise SystemExit(f"the two paths' parameter names differ: {sorted(set(s['state']) ^ set(t['state']))}")
    print(json.dumps({
        "single_step_s": round(s["step_s"], 4), "tsp_step_s": round(t["step_s"], 4),
        "step_speedup": round(s["step_s"] / t["step_s"], 3),
        "single_ns_s": round(s["ns_s"], 4), "tsp_ns_s": t["ns_s"], "ns_split": round(s["ns_s"] / max(t["ns_s"]), 3),
        "muon_wire_bytes_per_rank": None if t["wire"] is None else round(t["wire"] / a.tsp),
        "muon_wire_bytes_all_ranks": t["wire"], "muon_wire_windows_bytes": t["wire_windows"],
        "muon_wire_idle_bytes": t["wire_idle"],
        "muon_sent_bytes_per_rank": t["sent"], "formula_bytes": round(t["formula"]),
        "owned_matrices": t["own"], "matrices": t["matrices"], "params": s["params"], "hidden": a.hidden,
        "layers": a.layers, "tsp": a.tsp, "threads": a.threads, "steps": a.steps, "wire_reps": a.wire_reps,
        # the two paths' weights after the same steps (the same arithmetic up to threading and summation order)
        "max_param_diff": float(f"{max((v - t['state'][k]).abs().max().item() for k, v in s['state'].items()):.3g}"),
    }))


if __name__ == "__main__":
    main()
