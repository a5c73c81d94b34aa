"""Trainer ranks' memory while a weight version is gathered: to rank 0 alone vs to every rank.

The trainer ranks (:class:`train.parallel.rl_update.RLUpdater` on ``--dp`` x ``--tsp`` gloo ranks, one
thread each) hold a dense policy in bf16 with its fp32 master copy sharded (ZeRO-1). Each rank times
and measures ``full_state_dict``:

- ``publish``: a version in the compute dtype (bf16), gathered to rank 0 alone (``dst=0``), as the
  ranks publish one (``train/rl/worker.py``);
- ``final``: the fp32 master gathered to rank 0 alone, as the ranks write ``final/``;
- the reference, side by side (``*_before``): the gather as it was before (commit 3eabeb2, reproduced
  in :func:`gathered_before`): every rank all-gathered the whole fp32 master, then the TSP shards as
  pickled objects, and built the whole dict.

Memory is the kernel's count, outside the code under test: each rank resets its peak resident set
(``/proc/self/clear_refs``) before a call and reads ``VmHWM`` after it; the figure is the peak's rise
over the resident set before the call, in MB. One warm-up call of each kind first, then
``--repeats`` (medians). The ranks start with glibc's mmap threshold fixed at 4 KiB
(``train.parallel.measure.MALLOC_ENV``, set before they are spawned, as ``benchmarks/parallel.py`` does), so
freed tensors leave the resident set and a call's rise does not hide in heap pages an earlier call (an
earlier kind: the kinds run in a fixed order) freed; and after the peak is reset every rank waits at a
``dist.barrier()`` before its clock starts, so a rank that arrives first does not time its wait for the
others. Since this change the figures are measured this way; the ones below were measured with glibc's
adaptive mmap threshold and without the barrier (a rank's seconds could include its wait for the other
rank, and its rise could be absorbed by pages freed earlier, as the closing note says).

Prints ONE JSON line: per kind, the peak rise of rank 0 and of the largest other rank, their seconds,
the model's bytes, and for a published version ``others_mem_ratio`` (the other ranks' peak rise, now
over before: the goal is near 0, they hold nothing of the others' parts) and ``rank0_mem_ratio``;
``same_weights``: rank 0's gathered dicts (bf16 and fp32) equal the reference's, checked outside the timing.

    python benchmarks/publish.py                      # DP 2, 64M parameters
    python benchmarks/publish.py --dp 1 --tsp 2

Measured on this project's 2-core CPU at 7135fcd (2026-12-04), 64M parameters (245 MB fp32), 2 runs per
mesh, 3 warm calls each (medians); peak rises in MB, seconds of the slowest rank:

| mesh | kind | rank 0 now / before | other rank now / before | seconds now / before |
| --- | --- | --- | --- | --- |
| DP 2 | publish (bf16) | 122.4, 122.4 / 612.4, 612.4 | 0.0, 0.0 / 612.5, 612.3 | 0.061, 0.061 / 0.543, 0.515 |
| DP 2 | final (fp32) | 203.5, 351.2 / 367.3, 612.4 | 0.0, 0.0 / 367.3, 612.4 | 0.199, 0.258 / 0.417, 0.437 |
| TSP 2 | publish (bf16) | 124.9, 31.2 / 461.3, 367.5 | 0.0, 0.0 / 473.5, 493.5 | 0.114, 0.063 / 0.784, 0.730 |
| TSP 2 | final (fp32) | 233.0, 187.4 / 572.7, 735.2 | 0.0, 0.0 / 839.4, 612.7 | 0.289, 0.243 / 1.139, 1.120 |

Re-run at dd837b4 (after the master slice is built per parameter, 2e1b4d1), one run per mesh: DP 2 publish rank 0
122.4 / 612.4, other 0.0 / 612.4, 0.063 / 0.565 s; final 255.1 / 612.3, other 0.0 / 367.3, 0.218 / 0.421 s. TSP 2
publish rank 0 124.9 / 428.9, other 0.0 / 285.7, 0.122 / 0.593 s; final 261.1 / 643.8, other 0.0 / 1052.2,
0.287 / 1.262 s. Re-run at 0fbd5d7 (2026-12-05, another machine; the RL step's metrics path only), DP 2, one run:
publish rank 0 122.4 / 612.4, other 0.0 / 612.5, 0.054 / 0.554 s; final 343.1 / 612.4, other 0.0 / 612.3,
0.241 / 0.443 s. Re-run at 6f000cc (RLUpdater's recompute branch, off this path), DP 2, one run: publish rank 0
31.2 / 612.4, other 0.0 / 612.4, 0.030 / 0.455 s; final 187.5 / 612.3, other 0.0 / 367.3, 0.191 / 0.468 s.
Re-run at cc178f2 (2026-12-06; nothing on this path changed since), DP 2, one run: publish rank 0 62.7 / 612.5, other
0.0 / 612.3, 0.037 / 0.572 s; final 364.2 / 612.5, other 0.0 / 612.2, 0.250 / 0.417 s.
Re-run at 69fad46 (2026-12-06, later: a version's files and directory fsynced, COMPLETE written by a rename), DP 2,
one run: publish rank 0 31.2 / 612.5, other 0.0 / 612.6, 0.029 / 0.444 s; final 187.5 / 490.0, other 0.0 / 612.4,
0.175 / 0.376 s.

Re-run at a345f38 (2026-12-06, later: the ranks spawned with parallel.py's malloc settings and a barrier
before each timer, 32a4206), DP 2 defaults, one run: publish 0.051 s against 0.473 s before (rank 0 122.7 MB against
612.4), other rank 0.0 against 612.3 MB; final 0.254 against 0.369 s (rank 0 307.4 against 612.3, other 0.0 against
367.5): ``others_mem_ratio`` 0.0, ``rank0_mem_ratio`` 0.2. Re-run at 3a0a6c1 (2026-12-06, later: a checkpoint request
for an update already checkpointed keeps it; DP 2 defaults, one run): publish 0.049 s against 0.436 s (rank 0 122.7
against 612.4 MB, other 0.0 against 612.4), final 0.241 against 0.377 s; ratios 0.0 and 0.2. Re-run at 131d608
(2026-12-06, later: ``same_weights`` reported since; one run): publish 0.055 s against 0.493 s (rank 0 122.7 against
612.4 MB, other 0.0 against 612.4), final 0.269 against 0.396 s; ratios 0.0 and 0.2; ``same_weights`` true.
Re-run at fc73bd7 (2026-12-07, another machine (AMD EPYC); the served version pinned against pruning, the KL
reference's biases, both off this path; one run): publish 0.099 s against 0.678 s (rank 0 122.7 against 612.4 MB,
other 0.0 against 612.4), final 0.477 against 0.701 s; ratios 0.0 and 0.2; ``same_weights`` true.
Re-run at bb5e338 (2026-12-07, another machine; a relative run directory's versions load, off this path; one run):
publish 0.058 s against 0.559 s (rank 0 122.7 against 612.4 MB, other 0.0 against 612.4), final 0.293 against
0.509 s; ratios 0.0 and 0.2; ``same_weights`` true.

The other rank's rise is 0.0 in every run (it allocates one parameter at a time, which the heap's free
pages absorb). Rank 0's rise is noisy (31-125 MB for a 122 MB version): freed pages from earlier calls
count in the resident set before the call, and a new dict reuses them; it holds the whole version, as it
must to write it. Publishing a bf16 version reads the compute weights, so no fp32 master travels (the
8-9x in time); ``final`` moves the fp32 master point to point.
Re-run at bbe8685 (2026-12-07; alone): a version gathered in 0.054 s against 0.500 s, the other rank's peak rise
0.0 MB against 612 MB; final in 0.295 s against 0.411 s; the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _hwm_kb(field: str = "VmHWM") -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measured(fn):
    """(seconds, peak resident-set rise in MB) of ``fn()`` in this process; every rank calls it together."""
    import gc

    import torch.distributed as dist

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts at the current resident set
    before = _hwm_kb("VmRSS")
    dist.barrier()  # the ranks start together: no rank times its wait for another
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    rise = (_hwm_kb() - before) / 1024
    del out
    return dt, rise


def gathered_before(up, dtype):
    """``RLUpdater.full_state_dict`` at 3eabeb2: every rank gets the whole dict (the reference)."""
    import torch.distributed as dist

    from train.parallel.tsp import TSPCausalLM

    master = up.opt.full_master()
    mine = {n: master[id(p)].to("cpu", dtype, copy=up.tsp > 1) for n, p in up.shards.items()}
    if up.tsp == 1:
        return mine
    parts: list = [None] * up.tsp
    dist.all_gather_object(parts, mine, group=up.tsp_group)
    return TSPCausalLM.assemble(parts, up.net.kinds)


def _rank(rank, world, port, a, q):
    import torch.distributed as dist

    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM
    from train.parallel.rl_update import RLUpdateConfig, RLUpdater

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, head_dim=64,
                          num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 128,
                          intermediate_size=4 * a.hidden)
        up = RLUpdater(CausalLM(cfg).init_weights(0), RLUpdateConfig(dtype="bfloat16"), tsp=a.tsp, dp=a.dp)
        kinds = {"publish": (torch.bfloat16, True), "publish_before": (torch.bfloat16, False),
                 "final": (torch.float32, True), "final_before": (torch.float32, False)}
        res = {}
        for name, (dtype, now) in kinds.items():
            call = (lambda: up.full_state_dict(dtype, dst=0)) if now else (lambda: gathered_before(up, dtype))
            runs = [measured(call) for _ in range(a.repeats + 1)][1:]
            res[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        params = sum(p.numel() for p in CausalLM(cfg).parameters())
        same = True  # (outside the timing) rank 0's gathered weights equal the reference's, tensor for tensor
        for dtype in (torch.bfloat16, torch.float32):
            now, before = up.full_state_dict(dtype, dst=0), gathered_before(up, dtype)
            if rank == 0:
                same = same and set(before) <= set(now) and all(torch.equal(now[k], v) for k, v in before.items())
        q.put((rank, res, params, same))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tsp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from train.parallel.comm import free_port
    from train.parallel.measure import MALLOC_ENV

    os.environ.update(MALLOC_ENV)  # read by glibc when the ranks start (a fixed mmap threshold)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world = a.dp * a.tsp
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, a, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = sorted(q.get() for _ in procs)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    params = got[0][2]
    out = {"dp": a.dp, "tsp": a.tsp, "params": params, "bf16_mb": round(2 * params / 2**20, 1),
           "fp32_mb": round(4 * params / 2**20, 1), "same_weights": got[0][3]}
    for kind in got[0][1]:
        out[f"{kind}_s"] = round(max(r[1][kind][0] for r in got), 3)
        out[f"{kind}_rank0_mb"] = round(got[0][1][kind][1], 1)
        out[f"{kind}_others_mb"] = round(max(r[1][kind][1] for r in got[1:]), 1)
    out["others_mem_ratio"] = round(out["publish_others_mb"] / max(out["publish_before_others_mb"], 1e-9), 3)
    out["rank0_mem_ratio"] = round(out["publish_rank0_mb"] / max(out["publish_before_rank0_mb"], 1e-9), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
