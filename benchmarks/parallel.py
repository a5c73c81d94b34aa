"""TSP vs TP vs TP+SP vs DP ZeRO-1: bytes on the wire, peak memory and step time, measured (gloo ranks).

Every figure is measured outside the code under test, next to calc.py's formula:

* Bytes on the wire: the kernel's transmit counter of the loopback interface (/proc/net/dev,
  ``lo`` tx_bytes; gloo runs over TCP on 127.0.0.1, so each byte one rank sends another is counted
  once, with its TCP/IP/link headers and ACKs). Rank 0 reads it just outside each step, the ranks
  synchronising on a shared-memory ``multiprocessing`` barrier (nothing of ours on ``lo`` inside the
  window but the step). An idle window of the same length (a sleep) is measured the same way.
  The counter is the machine's and other developers' processes may talk on ``lo``, so each layout
  reports min over its ``--reps`` step windows minus min over its idle windows.
  ``comm_formula_bytes`` = ``calc.comm_bytes`` (mean bytes sent per rank) x D: all ranks, one step.
* Peak memory per rank, as the process saw it: resident anonymous memory (RssAnon) at the start
  of a warm step above RssAnon before the layout was built (parameters, AdamW state, anything
  else left behind), plus the rise of the RSS high-water mark (VmHWM, reset by writing 5 to
  /proc/self/clear_refs) during the step over the RSS at its start (activations, gradients,
  recompute, communication buffers, every transient). The largest rank, median over the steps.
  glibc's mmap threshold is fixed at 4 KiB in the ranks (train.parallel.measure.MALLOC_ENV) so
  freed tensors leave the RSS, and every layout and policy runs once on a short sequence before
  anything is measured, so one-time costs of the process (torch._dynamo imported by the first
  optimizer, 67 MB RssAnon) are not charged to whichever layout runs first.
* Recompute policy: TSP always recomputes (its weight-streaming functions save only their inputs,
  so each attention and MLP/MoE block is recomputed in backward; norms and residuals are kept).
  The headline memory figures give the single device, TP, TP+SP and DP the SAME policy:
  activation checkpointing of every attention block and every MLP/MoE block (``recompute_blocks``).
  The ``*_no_recompute`` figures are the baselines without checkpointing; the wire bytes are
  measured on these (calc.py models TP/SP/DP without recompute; with it, TP/SP would repeat their
  forward collectives in backward).
* Step seconds: the median over the measured warm steps (one untimed warm step first, after the
  short-sequence pass) of the slowest rank's time, the ranks starting together.
* Calibration: the wire bytes of each collective family at a known size, one-element calls (the
  per-call overhead, all ranks) and one call of 4 MiB per rank (``slope`` = wire bytes / the
  bandwidth-optimal count of comm/calc). ``calibrated`` = sum over families of slope x formula
  bytes + overhead x calls (calls counted by comm.track): the formula corrected for what gloo and
  TCP actually do, which the measurement should match.

Measured (``python benchmarks/parallel.py``: D=4, seq 4096, batch 1, H=128, L=2 (layer 0 dense,
layer 1 MoE 4 experts top-2), V=512, 574,656 params, fp32, reps 3; 4 ranks on 2 CPU cores, so
seconds are oversubscribed; re-measured 2026-12-03 at commit 4aaf4ad (the TSP attention shared with
zaya's as one ``_attend``; the previous figures, commit ff81563 on 2026-12-02, agreed within 0.1% in
bytes and 1.3% in peak memory):

    layout   wire bytes   formula      err     (calibrated count: within 0.30% for every layout)
    tsp       71,877,346   58,421,760  +23.0%
    tp       126,681,584  126,322,104   +0.3%
    sp       190,072,772  126,546,360  +50.2%
    dp        20,728,924   20,687,616   +0.2%

    peak MiB per rank (recompute for all) | no recompute | step s (recompute | none)
    single   69.6   139.2   1.55  1.12
    tsp      21.5    21.5   2.40  2.40
    tp       52.7    68.0   1.48  1.19
    sp       33.1    51.5   1.50  1.27
    dp       67.6   136.5   3.57  2.91

    tsp_mem_ratio 0.3092 (tp 0.758, sp 0.476, dp 0.972) at seq 4096 with equal recompute. Step seconds
    depend on the machine and its load; compare seconds only within one run, and not as a property
    of TSP.

    Re-run at 3a0a6c1 (2026-12-06: calc.py counts biases and q/k norms per family and MeshAdamW's fp32 master
    under fp32 weights; this qwen3 model's comm formulas are the same bytes; one run, alone): measured tsp
    71,875,393 / tp 126,681,196 / sp 190,070,924 / dp 20,729,028 B against the same formulas (+23.0%, +0.3%,
    +50.2%, +0.2%; calibrated within 0.29%); peak MiB single 69.5, tsp 21.2, tp 52.7, sp 33.1, dp 67.7;
    tsp_mem_ratio 0.3052 (tp 0.758, sp 0.477, dp 0.974).

    Re-run at 86b25b7 (2026-12-06, later: the tables on stderr, the JSON line alone on stdout; one run, alone):
    measured tsp 71,876,964 / tp 126,679,388 / sp 190,071,608 / dp 20,728,508 B against the same formulas (+23.0%,
    +0.3%, +50.2%, +0.2%; calibrated within 0.29%); peak MiB single 69.9, tsp 21.3, tp 52.8, sp 33.1, dp 67.6;
    tsp_mem_ratio 0.3046 (tp 0.756, sp 0.474, dp 0.968).

    Re-run at 6f90c2d (2026-12-07, another machine: calc.py's TP q/k-norm all-reduce only with q/k norms (this qwen3
    model has them: the same bytes); one run, alone): measured tsp 71,884,842 / tp 126,682,212 / sp 190,072,628 / dp
    20,729,132 B against the same formulas (+23.0%, +0.3%, +50.2%, +0.2%; calibrated within 0.3%); peak MiB single
    69.7, tsp 21.4, tp 52.6, sp 33.1, dp 67.6; tsp_mem_ratio 0.307 (tp 0.756, sp 0.474, dp 0.970).

On a loaded machine other traffic on ``lo`` was visible (an earlier run: TSP's step windows read
79.1, 71.9 and 74.7 MB, TP's idle windows up to 1.46 MB), hence min over windows; in this run the
windows agreed within 0.003% and idle windows read 0-104 B. At V=512 a rank's full-vocabulary logits
are 2 MiB, so chunking the TSP LM head changes little here (TSP's peak was 21.7 MiB at 4f976af).

Gaps over 10% between measured and formula, all explained by the calibration (the calibrated
count matches within 0.32% for every layout, 0.30% at 4aaf4ad): calc.py counts bandwidth-optimal (NCCL-style ring)
bytes, and gloo does not always move those.

* reduce_scatter: gloo moves 2.00x the optimal bytes (consistent with an all-reduce of the whole
  input, then keeping this rank's block). SP's forward region exits and the backward of its
  gathers are reduce-scatters, half of its formula bytes: +50%. TSP's K/V gradient
  reduce-scatters (``reduce_scatter.bwd``) add to its gap.
* reduce: gloo moves 1.25x = 1 + 1/D the optimal bytes at D=4 (consistent with a reduce-scatter
  then a gather of the blocks to the root; inferred from the bytes, gloo's source not read). TSP's weight-gradient reduces of the attention bundles (``reduce.bwd``).
* Per call (all ranks together): all_reduce ~2.06 KB, all_gather ~8.2 KB, reduce_scatter
  ~8.3 KB, broadcast and reduce ~1.03 KB, one p2p ring step ~1.38 KB: TCP/IP/link headers (66 B
  per segment and per ACK on ``lo``), and (inferred, not traced) gloo's per-message headers
  and control messages, per message (an all-gather over D=4 is 12 messages). TSP makes 109 calls per
  step at this size (36 ring steps, 32 broadcasts, 16 reduces, 16 all-gathers, 8 reduce-scatters,
  1 all-reduce), ~0.3 MB. Large messages: +0.08-0.14% (headers per 64 KiB segment, ACKs).
* Together: TSP +23% = reduce_scatter x2 and reduce x1.25 on its backward K/V and bundle
  gradients plus its per-call overhead. TP and DP (all-reduce and all-gather only) are within 0.3%.
  No barrier traffic is counted (the step windows are delimited by shared-memory barriers) and
  the minimum idle window measured 0-104 bytes.

Not measured here: CUDA (torch.cuda.max_memory_allocated; NCCL) - this benchmark runs gloo on CPU.
DP runs the same one-sequence batch on each rank (per-rank memory as the single device, D x the
tokens per step).

    python benchmarks/parallel.py [--D 4] [--seq 4096] [--hidden 128] [--layers 2] [--vocab 512] [--reps 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from train.model.config import ModelConfig  # noqa: E402
from train.parallel import calc  # noqa: E402
from train.parallel.comm import free_port  # noqa: E402

LAYOUTS = ("tsp", "tp", "sp", "dp")
FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "p2p")


def make_cfg(a) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=a.hidden // 8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=a.hidden, mlp_only_layers=[0], max_position_embeddings=a.seq + 64)


def family(op: str) -> str:
    """Collective family of a :mod:`train.parallel.comm` op name (``ring.bwd`` -> ``p2p``)."""
    base = op.split(".")[0]
    return "p2p" if base in ("ring", "ring_grad") else base


# ------------------------------------------------------------------------------------ layouts


def _ckpt(fn):
    from torch.utils.checkpoint import checkpoint

    return functools.partial(checkpoint, fn, use_reentrant=False)


def recompute_blocks(model) -> None:
    """Activation checkpointing with TSP's granularity: every attention block and every MLP / MoE
    block keeps only its (normed) input and is recomputed in backward; norms and residuals stay
    outside, as in TSP, where ``broadcast_apply`` / ``ring_apply`` save only their inputs."""
    from train.parallel.tp import TPCausalLM

    if isinstance(model, TPCausalLM):
        model._attention, model._mlp = _ckpt(model._attention), _ckpt(model._mlp)
        return
    for layer in model.model.layers:
        layer.self_attn.forward = _ckpt(layer.self_attn.forward)
        layer.mlp.forward = _ckpt(layer.mlp.forward)


def build(layout: str, cfg: ModelConfig, ids: torch.Tensor, recompute: bool):
    """(step, zero_grad) of one layout: ``step()`` is a full training step (forward, backward,
    gradient sync, optimizer)."""
    from train.model.modeling import CausalLM
    from train.parallel.dp import ZeroAdamW
    from train.parallel.tp import TPCausalLM
    from train.parallel.tsp import TSPCausalLM

    ref = CausalLM(cfg).init_weights(0)
    if layout in ("single", "dp"):
        m = ref
        if recompute:
            recompute_blocks(m)

        def loss_fn():
            logits = m(ids)
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))

        params = list({id(p): p for p in m.parameters()}.values())
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False) if layout == "single" else ZeroAdamW(params, lr=1e-3)
        sync = lambda: None  # noqa: E731  (ZeroAdamW.step all-reduces the gradients)
    else:
        if layout == "tsp":
            m = TSPCausalLM(ref)  # recomputes by construction (weight streaming)
        else:
            m = TPCausalLM(ref, sequence_parallel=layout == "sp")
            if recompute:
                recompute_blocks(m)
        del ref
        params = list(m.parameters())
        loss_fn, sync = (lambda: m.sft_loss(ids)), m.sync_grads
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)

    def step():
        loss_fn().backward()
        sync()
        opt.step()

    def zero():
        for p in params:
            p.grad = None

    return step, zero


# ------------------------------------------------------------------------------- calibration


def calibrate(D: int, barrier, reader: bool, reps: int, big: int = 1 << 20, calls: int = 50) -> dict:
    """Wire bytes (all ranks) of each collective family at a known size: ``overhead`` per call from
    ``calls`` one-element calls, ``slope`` = (bytes of one call of ``big`` fp32 elements per rank -
    overhead) / the bandwidth-optimal bytes of :mod:`train.parallel.comm` (what calc.py counts)."""
    import torch.distributed as dist

    from train.parallel import comm
    from train.parallel.measure import wire_windows

    r = dist.get_rank()

    def op(fam, n):
        x = torch.ones(n)
        if fam == "all_reduce":
            return (lambda: dist.all_reduce(x)), 2 * (D - 1) * n * 4
        if fam == "all_gather":
            out = torch.empty(D * n)
            return (lambda: dist.all_gather_into_tensor(out, x)), D * (D - 1) * n * 4
        if fam == "reduce_scatter":
            xs, out = torch.ones(D * n), torch.empty(n)
            return (lambda: dist.reduce_scatter_tensor(out, xs)), D * (D - 1) * n * 4
        if fam == "broadcast":
            return (lambda: dist.broadcast(x, 0)), (D - 1) * n * 4
        if fam == "reduce":
            return (lambda: dist.reduce(x, 0)), (D - 1) * n * 4
        y = torch.empty(n)
        return (lambda: comm.wait(comm.sendrecv(x, (r + 1) % D, y, (r - 1) % D, None, "-", "ring"))), D * n * 4

    idle = min(wire_windows(lambda: None, barrier, reader, reps)[0] or [0])
    out = {"idle": idle}
    for fam in FAMILIES:
        small, f_small = op(fam, 1)
        large, f_big = op(fam, big)
        small(), large()  # warm
        many = wire_windows(lambda: [small() for _ in range(calls)], barrier, reader, reps)[0]
        one = wire_windows(large, barrier, reader, reps)[0]
        if reader:
            over = (min(many) - idle) / calls - f_small
            out[fam] = {"overhead": round(over, 1), "slope": round((min(one) - idle - over) / f_big, 5),
                        "big_measured": min(one) - idle, "big_formula": f_big}
    return out


# ------------------------------------------------------------------------------------ worker


def _worker(rank, world, port, path, barrier, cfg_d, T, B, reps, layouts):
    import torch.distributed as dist

    from train.parallel import comm
    from train.parallel.measure import anon_bytes, rss_peak, wire_windows

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    reader = rank == 0
    cfg = ModelConfig(**cfg_d)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    out = {"calib": calibrate(world, barrier, reader, reps) if world > 1 else {}}
    # one step of every layout and policy on a short sequence first: lazy one-time costs of the
    # process (torch._dynamo imported by the first optimizer, the kernels' first use) are paid
    # here, not charged to whichever layout happens to run first
    tiny = ids[:, :4 * world]
    for lay in layouts:
        for rc in ((False,) if lay == "tsp" else (False, True)):
            step, zero = build(lay, cfg, tiny, rc)
            step()
            del step, zero
    for lay in layouts:
        for rc in ((False,) if lay == "tsp" else (False, True)):
            gc.collect()
            base = anon_bytes()
            step, zero = build(lay, cfg, ids, rc)
            zero()
            step()  # warm: connections, AdamW state, lazy allocations
            rec = []

            def one():
                zero()
                with rss_peak() as box:
                    t0 = time.perf_counter()
                    step()
                    dt = time.perf_counter() - t0
                rec.append({"peak": box["anon"] - base + box["peak"], "resident": box["anon"] - base,
                            "transient": box["peak"], "seconds": dt})

            with comm.track() as t:
                wire = wire_windows(one, barrier, reader, reps)[0]
            med = statistics.median(r["seconds"] for r in rec)
            idle = wire_windows(lambda: time.sleep(med), barrier, reader, reps)[0] if world > 1 else []
            calls: dict[str, int] = {}
            for _, op, _, _ in t.records:
                calls[family(op)] = calls.get(family(op), 0) + 1
            out[(lay, rc)] = {"steps": rec, "wire": wire, "idle": idle, "base": base,
                              "calls": {k: v / reps for k, v in calls.items()}}
            del step, zero
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))
    barrier.wait()
    dist.destroy_process_group()


def spawn(world, cfg, a, layouts):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, free_port(), d, ctx.Barrier(world), dataclasses.asdict(cfg), a.seq, a.batch,
                                a.reps, layouts), nprocs=world)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    from train.parallel.measure import MALLOC_ENV

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="measured warm steps per layout (after one warm-up step)")
    a = ap.parse_args(argv)
    os.environ.update(MALLOC_ENV)  # read by glibc when the ranks start
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cfg = make_cfg(a)
    one = spawn(1, cfg, a, ("single",))[0]
    ranks = spawn(a.D, cfg, a, LAYOUTS)
    calib = ranks[0]["calib"]
    shape = calc.Shape(cfg, a.seq, a.batch, a.D, 4)

    def med_seconds(res):  # per step: the slowest rank (the step ends when every rank is done)
        return statistics.median(max(r["steps"][i]["seconds"] for r in res) for i in range(len(res[0]["steps"])))

    def peak(res, key="peak"):  # the largest rank's median peak over the measured steps
        return max(statistics.median(s[key] for s in r["steps"]) for r in res)

    mem, mem_plain, secs, secs_plain, comm_rows, parts = {}, {}, {}, {}, {}, {}
    rows_single = {k: [one[("single", k)]] for k in (False, True)}
    for lay in ("single",) + LAYOUTS:
        res = rows_single if lay == "single" else {k: [r[(lay, k)] for r in ranks] for k in (False, True)
                                                   if (lay, k) in ranks[0]}
        rc = True if True in res else False
        mem[lay], secs[lay] = peak(res[rc]), med_seconds(res[rc])
        mem_plain[lay], secs_plain[lay] = peak(res[False]), med_seconds(res[False])
        parts[lay] = (peak(res[rc], "resident"), peak(res[rc], "transient"))
        if lay == "single":
            continue
        r0 = res[False][0]
        measured = min(r0["wire"]) - min(r0["idle"])
        formula = sum(calc.comm_bytes(shape, lay).values()) * a.D
        by_fam: dict[str, float] = {}
        for op, v in calc.comm_bytes(shape, lay).items():
            by_fam[family(op)] = by_fam.get(family(op), 0.0) + v * a.D
        calls = r0["calls"]
        predicted = sum(calib[f]["slope"] * by_fam.get(f, 0.0) + calib[f]["overhead"] * calls.get(f, 0)
                        for f in FAMILIES)
        comm_rows[lay] = {"measured": measured, "formula": formula, "rel_err": (measured - formula) / formula,
                          "calibrated": predicted, "calibrated_rel_err": (measured - predicted) / predicted,
                          "calls": calls, "windows": r0["wire"], "idle": r0["idle"]}

    say = lambda *a: print(*a, file=sys.stderr)  # the tables for a reader; stdout holds the one JSON line
    say(f"model {cfg.num_parameters()} params (layer 0 dense, layers 1.. MoE; H={a.hidden}, L={a.layers}, "
        f"V={a.vocab}), seq {a.seq}, batch {a.batch}, D={a.D}, fp32, gloo on 127.0.0.1")
    say("\nloopback wire bytes per collective (all ranks) vs the bandwidth-optimal count of comm/calc:")
    say(f"{'family':15} {'overhead B/call':>16} {'slope (4 MiB/rank)':>19}")
    for f in FAMILIES:
        say(f"{f:15} {calib[f]['overhead']:16.0f} {calib[f]['slope']:19.4f}")
    say("\none training step, all ranks (min over windows - min idle):")
    say(f"{'layout':7} {'measured B':>13} {'formula B':>13} {'err':>8} {'calibrated B':>13} {'err':>8}  calls")
    for lay, c in comm_rows.items():
        say(f"{lay:7} {c['measured']:13.0f} {c['formula']:13.0f} {c['rel_err']:8.2%} {c['calibrated']:13.0f} "
            f"{c['calibrated_rel_err']:8.2%}  {json.dumps({k: round(v) for k, v in c['calls'].items()})}")
    say("\npeak RSS above the pre-build RSS (max over ranks, median over steps; MiB) and step seconds (median):")
    say(f"{'layout':7} {'recompute MiB':>14} {'(resident':>10} {'+ step)':>8} {'no-recompute MiB':>17} "
        f"{'recompute s':>12} {'no-recompute s':>15}")
    for lay in ("single",) + LAYOUTS:
        say(f"{lay:7} {mem[lay] / 2**20:14.1f} {parts[lay][0] / 2**20:10.1f} {parts[lay][1] / 2**20:8.1f} "
            f"{mem_plain[lay] / 2**20:17.1f} {secs[lay]:12.2f} {secs_plain[lay]:15.2f}")
    result = {
        "D": a.D, "seq": a.seq, "hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "reps": a.reps,
        "comm_measured_bytes": {k: int(v["measured"]) for k, v in comm_rows.items()},
        "comm_formula_bytes": {k: int(v["formula"]) for k, v in comm_rows.items()},
        "comm_max_rel_err": round(max(abs(v["rel_err"]) for v in comm_rows.values()), 4),
        "comm_windows_bytes": {k: v["windows"] for k, v in comm_rows.items()},
        "comm_idle_bytes": {k: v["idle"] for k, v in comm_rows.items()},
        "comm_calibrated_max_rel_err": round(max(abs(v["calibrated_rel_err"]) for v in comm_rows.values()), 4),
        "per_call_overhead_bytes": {f: calib[f]["overhead"] for f in FAMILIES},
        "peak_bytes": {k: int(v) for k, v in mem.items()},
        "peak_bytes_no_recompute": {k: int(v) for k, v in mem_plain.items()},
        "tsp_mem_ratio": round(mem["tsp"] / mem["single"], 4),
        "tp_mem_ratio": round(mem["tp"] / mem["single"], 4),
        "sp_mem_ratio": round(mem["sp"] / mem["single"], 4),
        "dp_mem_ratio": round(mem["dp"] / mem["single"], 4),
        "step_seconds": {k: round(v, 3) for k, v in secs.items()},
        "step_seconds_no_recompute": {k: round(v, 3) for k, v in secs_plain.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
