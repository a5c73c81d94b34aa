"""TSP vs TP vs TP+SP vs DP ZeRO-1 on the same model and sequence length (spawned gloo ranks).

Measures, per layout, bytes sent per collective (mean over ranks) for one training step and the
per-rank memory of parameters, gradients, AdamW state and saved activations, prints them next to
the formulas of :mod:`train.parallel.calc`, and ends with one JSON line.

    python benchmarks/parallel.py [--D 4] [--seq 510] [--hidden 128] [--layers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from train.model.config import ModelConfig  # noqa: E402
from train.parallel import calc  # noqa: E402

LAYOUTS = ("tsp", "tp", "sp", "dp")


def make_cfg(a) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=a.hidden // 8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=a.hidden, mlp_only_layers=[0], max_position_embeddings=4096)


def one_step(model, loss_fn, opt, sync, params):
    """One training step; returns (comm records, saved-activation bytes)."""
    from train.parallel import comm
    from train.parallel.measure import saved_activations

    with comm.track() as t:
        with saved_activations(params) as box:
            loss = loss_fn()
        loss.backward()
        sync()
        opt.step()
    return t.by("op"), box["bytes"]


def run_layout(layout, cfg, ids, group=None):
    from train.model.modeling import CausalLM
    from train.parallel.measure import optimizer_bytes, tensor_bytes
    from train.parallel.tp import TPCausalLM
    from train.parallel.tsp import TSPCausalLM

    ref = CausalLM(cfg).init_weights(0)
    if layout == "tsp":
        m = TSPCausalLM(ref, group)
        loss_fn, sync = (lambda: m.sft_loss(ids)), m.sync_grads
    elif layout in ("tp", "sp"):
        m = TPCausalLM(ref, group, sequence_parallel=layout == "sp")
        loss_fn, sync = (lambda: m.sft_loss(ids)), m.sync_grads
    else:
        raise ValueError(f"unknown layout {layout!r}")
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    ops, act = one_step(m, loss_fn, opt, sync, params)
    return {"ops": ops, "act": act, "params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": optimizer_bytes(opt)}


def run_dp(cfg, ids, single=False):
    from train.model.modeling import CausalLM
    from train.parallel.dp import ZeroAdamW
    from train.parallel.measure import optimizer_bytes, tensor_bytes

    m = CausalLM(cfg).init_weights(0)

    def loss_fn():
        logits = m(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    params = list({id(p): p for p in m.parameters()}.values())
    if single:
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    else:
        opt = ZeroAdamW(params, lr=1e-3)
    ops, act = one_step(m, loss_fn, opt, lambda: None, params)
    ob = optimizer_bytes(opt) if single else opt.state_bytes()
    return {"ops": ops, "act": act, "params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": ob}


def _worker(rank, world, port, path, cfg_d, T, B):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = ModelConfig(**cfg_d)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    out = {}
    for lay in LAYOUTS:
        dist.barrier()
        t0 = time.perf_counter()
        out[lay] = run_dp(cfg, ids) if lay == "dp" else run_layout(lay, cfg, ids)
        out[lay]["seconds"] = time.perf_counter() - t0
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    import dataclasses

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, default=4)
    ap.add_argument("--seq", type=int, default=510)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args(argv)
    cfg = make_cfg(a)
    torch.set_num_threads(1)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    single = run_dp(cfg, ids, single=True)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(a.D, _free_port(), d, dataclasses.asdict(cfg), a.seq, a.batch), nprocs=a.D)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(a.D)]
    shape = calc.Shape(cfg, a.seq, a.batch, a.D, 4)
    s1 = calc.Shape(cfg, a.seq, a.batch, 1, 4)
    print(f"model {cfg.num_parameters()} params (layer 0 dense, layer 1.. MoE), seq {a.seq}, batch {a.batch}, D={a.D}, fp32")
    print(f"{'layout':7} {'what':12} {'measured':>12} {'formula':>12}")
    errs, act_errs = {}, {}
    rows = {"single": (single, calc.memory(s1, "single"))}
    for lay in LAYOUTS:
        rows[lay] = (ranks[0][lay], calc.memory(shape, lay))
    for lay, (meas, form) in rows.items():
        for k, mk in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "act")):
            print(f"{lay:7} {k:12} {meas[mk]:12d} {int(form[k]):12d}")
        act_errs[lay] = abs(meas["act"] - form["activations"]) / form["activations"]
    for lay in LAYOUTS:
        ops = sorted({k for r in ranks for k in r[lay]["ops"]} | set(calc.comm_bytes(shape, lay)))
        want = calc.comm_bytes(shape, lay)
        for op in ops:
            got = sum(r[lay]["ops"].get(op, [0, 0, 0])[0] for r in ranks) / a.D
            w = want.get(op, 0.0)
            errs[f"{lay}/{op}"] = abs(got - w) / max(w, 1.0)
            print(f"{lay:7} {'comm ' + op:28} {got:14.0f} {w:14.0f}")
    def pa(lay):
        m = rows[lay][0]
        return m["params"] + m["act"]
    result = {
        "D": a.D, "seq": a.seq, "hidden": a.hidden, "layers": a.layers,
        "tsp_mem_ratio": round(pa("tsp") / pa("single"), 4),
        "tp_mem_ratio": round(pa("tp") / pa("single"), 4),
        "sp_mem_ratio": round(pa("sp") / pa("single"), 4),
        "dp_mem_ratio": round(pa("dp") / pa("single"), 4),
        "comm_max_rel_err": round(max(errs.values()), 6),
        "act_formula_rel_err": {k: round(v, 3) for k, v in act_errs.items()},
        "comm_bytes_per_rank": {lay: round(sum(r[lay]["ops"].get(op, [0])[0] for r in ranks for op in r[lay]["ops"]) / a.D)
                                for lay in LAYOUTS},
        "seconds": {lay: round(max(r[lay]["seconds"] for r in ranks), 2) for lay in LAYOUTS},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
