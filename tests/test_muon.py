"""Muon (train/optim.py) and its sharded form (train/parallel/dp.py MeshMuon).

Single process: Newton-Schulz against a loop written here, one Muon step against a hand-computed
one (per expert matrix, gate and up apart), momentum 0 / EMA / Nesterov, parameter grouping,
bf16 master weights, state_dict round trip, and torch.optim.Muon where torch has it. Sharded: a
gloo world of 2 ranks runs RLUpdater with Muon on dp2 x tsp1 and dp1 x tsp2 meshes and compares
the weights after two steps with the single-process reference step; on dp1 x tsp2 each matrix is
orthogonalised once per step, by one of the two ranks.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from train.optim import (Muon, MasterWeights, OptimConfig, build_optimizer, clip_and_step, load_training_state,
                         muon_row_blocks, newton_schulz, training_state)

A, B, C = 3.4445, -4.7750, 2.0315
TOL = 1e-5


def ns_loop(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Reference quintic Newton-Schulz for ONE matrix, element by element as Keller Jordan writes it."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(float(torch.linalg.matrix_norm(X)), 1e-7)
    for _ in range(steps):
        Gram = X @ X.T
        poly = B * Gram + C * Gram @ Gram
        X = A * X + poly @ X
    return (X.T if tall else X).float()


def tiny_moe():
    from tests.test_parallel import _cfgs, _model

    return _model(_cfgs()["moe"])


def fill_grads(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        out[n] = p.grad.detach().float().clone()
    return out


def matrices_of(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The matrices Muon must orthogonalise one by one, split by hand."""
    if t.ndim == 2:
        return [t]
    if name.endswith("gate_up_proj"):
        I = t.shape[1] // 2
        return [m for e in range(t.shape[0]) for m in (t[e, :I], t[e, I:])]
    return [t[e] for e in range(t.shape[0])]


def join_like(name: str, mats: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if like.ndim == 2:
        return mats[0]
    if name.endswith("gate_up_proj"):
        return torch.stack([torch.cat(mats[2 * e:2 * e + 2], 0) for e in range(like.shape[0])])
    return torch.stack(mats)


# ------------------------------------------------------------------------------ Newton-Schulz


@pytest.mark.parametrize("shape", [(8, 8), (5, 12), (12, 5), (64, 32)])
def test_newton_schulz_matches_loop_and_orthogonalises(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = newton_schulz(G)
    assert got.dtype == torch.float32 and got.shape == G.shape
    assert (got - ns_loop(G)).abs().max() < 1e-5
    s = torch.linalg.svdvals(got)
    assert 0.6 < float(s.min()) and float(s.max()) < 1.25, s  # roughly orthogonal: U S' V^T, S' near 1
    # invariant to the scale of G, and the same direction: <got, G> > 0
    assert (newton_schulz(1e3 * G) - got).abs().max() < 1e-4
    assert float((got * G).sum()) > 0
    # batched = one by one; bf16 close to fp32
    batch = torch.randn((3,) + shape, generator=torch.Generator().manual_seed(1))
    nb = newton_schulz(batch)
    for i in range(3):
        assert (nb[i] - ns_loop(batch[i])).abs().max() < 1e-5
    assert (newton_schulz(G, dtype=torch.bfloat16) - got).abs().max() < 0.1


def test_tall_expert_blocks_are_orthogonalised_block_by_block():
    """Experts wider than the hidden size (moe_intermediate_size > hidden_size): each [I, H] block of gate_up
    is tall, comes back from Newton-Schulz transposed (not contiguous), and the step failed on reshaping it."""
    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM
    from train.optim import muon_direction

    u = torch.randn(4, 2 * 48, 32)
    loop = torch.stack([torch.cat([newton_schulz(u[e, :48]), newton_schulz(u[e, 48:])]) for e in range(4)])
    assert torch.allclose(muon_direction(u, 2, 5, "float32"), loop, atol=1e-6)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    m = CausalLM(cfg).init_weights(0)
    opt, sched = build_optimizer(m, OptimConfig(name="muon", lr=1e-3))
    before = copy.deepcopy(m.state_dict())
    m(torch.randint(0, 64, (2, 8))).logsumexp(-1).mean().backward()
    clip_and_step(m, opt, sched, 1.0)
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items() if "experts" in k)


# ------------------------------------------------------------------------------ grouping and config


def test_parameter_grouping():
    model = tiny_moe()
    names = {n: muon_row_blocks(n, p) for n, p in model.named_parameters()}
    assert names["model.layers.0.self_attn.q_proj.weight"] == 1
    assert names["model.layers.0.mlp.down_proj.weight"] == 1
    assert names["model.layers.1.mlp.gate.weight"] == 1  # the router is a hidden matrix
    assert names["model.layers.1.mlp.experts.gate_up_proj"] == 2  # per expert, gate and up apart
    assert names["model.layers.1.mlp.experts.down_proj"] == 1
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert names[n] is None, n
    opt, _ = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, weight_decay=0.1))
    assert isinstance(opt, Muon)
    byid = {id(p): n for n, p in model.named_parameters()}
    muon = {byid[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adam = {byid[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {n for n, k in names.items() if k is not None}
    assert adam == {n for n, k in names.items() if k is None}
    decayed = {byid[id(p)] for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed == muon | {"model.embed_tokens.weight", "lm_head.weight"}
    # AdamW is still the default and builds torch's AdamW
    assert isinstance(build_optimizer(model, OptimConfig())[0], torch.optim.AdamW)


def test_config_errors_name_the_choices():
    with pytest.raises(ValueError, match="unknown optimizer name 'sgd'; choose from adamw, muon"):
        OptimConfig(name="sgd")
    with pytest.raises(ValueError, match="match_rms_adamw, original, none"):
        OptimConfig(name="muon", muon_lr_scale="moonlight")
    with pytest.raises(ValueError, match="float32, bfloat16"):
        OptimConfig(name="muon", muon_ns_dtype="fp8")
    with pytest.raises(ValueError, match="muon_nesterov=true needs muon_momentum > 0"):
        OptimConfig(name="muon", muon_nesterov=True)
    with pytest.raises(ValueError, match=r"muon_momentum must be in \[0, 1\)"):
        OptimConfig(name="muon", muon_momentum=1.0)


# ------------------------------------------------------------------------------ one step by hand


def _hand_adamw(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, betas, eps) -> torch.Tensor:
    p = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
def test_muon_steps_match_hand_computation(scale):
    lr, wd = 1e-2, 0.1
    cfg = OptimConfig(name="muon", lr=lr, weight_decay=wd, eps=1e-8, muon_lr_scale=scale)
    model = tiny_moe()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, _ = build_optimizer(model, cfg)
    grads = []
    for s in range(2):
        grads.append(fill_grads(model, s))
        opt.step()
    assert all("momentum_buffer" not in st for st in opt.state.values())  # momentum 0 keeps no buffer
    for n, p in model.named_parameters():
        k = muon_row_blocks(n, p)
        if k is None:
            wd_n = wd if p.ndim >= 2 else 0.0
            want = _hand_adamw(start[n], [g[n] for g in grads], lr, wd_n, cfg.betas, cfg.eps)
        else:
            want = start[n].clone()
            for g in grads:
                mats = [ns_loop(m) for m in matrices_of(n, g[n])]
                rows, cols = mats[0].shape
                mult = 0.2 * math.sqrt(max(rows, cols)) if scale == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
                want = want * (1 - lr * wd) - lr * mult * join_like(n, mats, g[n])
        assert (p.detach() - want).abs().max() < TOL, n
        assert (p.detach() - start[n]).abs().max() > 1e-3, n  # and it moved


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum(nesterov):
    mom, lr = 0.9, 1e-2
    W0 = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    G = [torch.randn(6, 10, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    w = W0.clone().requires_grad_(True)
    opt = Muon([{"params": [w], "muon": True}], lr=lr, momentum=mom, nesterov=nesterov)
    buf, want = torch.zeros_like(W0), W0.clone()
    for g in G:
        w.grad = g.clone()
        opt.step()
        buf = mom * buf + (1 - mom) * g
        u = (1 - mom) * g + mom * buf if nesterov else buf
        want = want - lr * 0.2 * math.sqrt(10) * ns_loop(u)
    assert (w.detach() - want).abs().max() < TOL
    # momentum 0 differs from momentum 0.9 after the first step (the first steps coincide: NS is
    # scale-free and buf_1 = 0.1 g_1)
    w0 = W0.clone().requires_grad_(True)
    opt0 = Muon([{"params": [w0], "muon": True}], lr=lr)
    for g in G:
        w0.grad = g.clone()
        opt0.step()
    assert (w0.detach() - w.detach()).abs().max() > 1e-3


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without torch.optim.Muon")
@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
def test_same_arithmetic_as_torch_muon(scale):
    """torch.optim.Muon (bf16 Newton-Schulz, momentum 0.95, Nesterov) on 2-D weights: ours in bf16
    gives the same steps (the same fused multiply-adds: bit-identical on CPU here; an unfused bf16
    iteration differs by ~3% of the step, fp32 by ~1%)."""
    g = torch.Generator().manual_seed(5)
    W0 = [torch.randn(s, generator=g) for s in [(16, 24), (24, 16), (20, 20)]]
    grads = [[torch.randn(w.shape, generator=g) for w in W0] for _ in range(3)]
    ours = [w.clone().requires_grad_(True) for w in W0]
    theirs = [w.clone().requires_grad_(True) for w in W0]
    o1 = Muon([{"params": ours, "muon": True}], lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True,
              lr_scale=scale, ns_dtype="bfloat16")
    o2 = torch.optim.Muon(theirs, lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=scale)
    for gs in grads:
        for a, b, gr in zip(ours, theirs, gs):
            a.grad, b.grad = gr.clone(), gr.clone()
        o1.step()
        o2.step()
    for a, b, w in zip(ours, theirs, W0):
        moved = (b.detach() - w).abs().max()
        assert moved > 1e-2
        assert (a.detach() - b.detach()).abs().max() < 1e-3 * moved


# ------------------------------------------------------------------------------ bf16 and resume


def test_bf16_master_weights():
    """A bf16 policy: Muon steps fp32 masters (the same step as on an fp32 copy of the bf16
    weights) and writes them back rounded; updates below bf16's spacing accumulate in the masters."""
    cfg = OptimConfig(name="muon", lr=1e-4, weight_decay=0.1)
    m16 = tiny_moe().to(torch.bfloat16)
    m32 = copy.deepcopy(m16).float()
    o16, _ = build_optimizer(m16, cfg)
    o32, _ = build_optimizer(m32, cfg)
    assert isinstance(o16, MasterWeights) and isinstance(o16.opt, Muon)
    for s in range(3):
        fill_grads(m16, s)
        for p16, p32 in zip(m16.parameters(), m32.parameters()):
            p32.grad = p16.grad.float()
        o16.step()
        o32.step()
    p16 = dict(m16.named_parameters())
    for n, p in m32.named_parameters():
        master = o16.master[id(p16[n])]
        assert master.dtype == torch.float32
        assert (master - p.detach()).abs().max() < 1e-6, n
        assert torch.equal(p16[n].detach(), master.to(torch.bfloat16)), n
    q = "model.layers.0.self_attn.q_proj.weight"  # lr 1e-4: each step is below bf16 spacing for most elements
    start = tiny_moe().to(torch.bfloat16).state_dict()[q].float()
    assert (o16.master[id(p16[q])] - start).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(dtype):
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.05, muon_momentum=0.9, muon_nesterov=True, warmup_steps=3)
    model = tiny_moe().to(dtype)
    opt, sched = build_optimizer(model, cfg)
    rng = random.Random(0)
    for s in range(2):
        fill_grads(model, s)
        clip_and_step(model, opt, sched, 1.0)
    state = copy.deepcopy(training_state(2, opt, sched, rng))
    weights = copy.deepcopy(model.state_dict())
    fresh = tiny_moe().to(dtype)
    fresh.load_state_dict(weights)
    opt2, sched2 = build_optimizer(fresh, cfg)
    assert load_training_state(state, opt2, sched2, random.Random(1)) == 2
    inner = opt.opt if isinstance(opt, MasterWeights) else opt
    assert any("momentum_buffer" in st for st in inner.state.values())
    for m, o, sc in ((model, opt, sched), (fresh, opt2, sched2)):
        fill_grads(m, 7)
        clip_and_step(m, o, sc, 1.0)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    # a resume without the optimizer state (momentum lost) takes a different step
    lost = tiny_moe().to(dtype)
    lost.load_state_dict(weights)
    o3, s3 = build_optimizer(lost, cfg)
    fill_grads(lost, 7)
    clip_and_step(lost, o3, s3, 1.0)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), lost.parameters()))


# ------------------------------------------------------------------------------ sharded == single process


def _muon_rl_cfg(momentum: float):
    from tests.test_rl_distributed import rl_cfg

    rcfg = rl_cfg("dppo_tv")
    o = rcfg.optim
    rcfg.optim = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip, warmup_steps=o.warmup_steps,
                             eps=o.eps, name="muon", muon_momentum=momentum, muon_nesterov=momentum > 0)
    return rcfg


def _check_sharded(world, out):
    from tests.test_parallel import _cfgs, _model
    from tests.test_rl_distributed import make_batch, reference_weights, rl_cfg
    from train.parallel.dp import MeshMuon
    from train.parallel.rl_update import RLUpdater

    for dp, tsp in [(2, 1), (1, 2)]:
        # zaya at tsp 2: each rank's value rows lie in one of the two value projections (an empty shard of the other)
        for name, momentum in [("moe", 0.0), ("dense", 0.9), ("moe", 0.9), ("zaya", 0.9)]:
            cfg = _cfgs()[name]
            rcfg = _muon_rl_cfg(momentum)
            batches = [make_batch(s, cfg) for s in range(3)]
            if name == "zaya":  # every rollout trained on: a dropped one's tokens count in the reference's router load
                for b in batches:
                    for smp in b.samples:
                        smp.keep = True
            want, _ = reference_weights(cfg, rcfg, batches)
            up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
            assert isinstance(up.opt, MeshMuon)
            for i, b in enumerate(batches):
                up.step(b, i)
            got = up.full_state_dict()
            start = _model(cfg).state_dict()
            key = f"dp{dp}xtsp{tsp}.{name}.m{momentum}"
            out[key + ".params"] = max((got[k] - want[k]).abs().max().item() for k in want)
            out[key + ".moved"] = min((want[k] - start[k]).abs().max().item() for k in want
                                      if "norm" not in k and "balancing" not in k)
    # the AdamW reference run on the same batches differs (Muon is not AdamW in disguise)
    cfg = _cfgs()["moe"]
    batches = [make_batch(s, cfg) for s in range(3)]
    adam, _ = reference_weights(cfg, rl_cfg("dppo_tv"), batches)
    muon, _ = reference_weights(cfg, _muon_rl_cfg(0.0), batches)
    out["adam_vs_muon"] = max((adam[k] - muon[k]).abs().max().item() for k in adam)


def _check_phases_and_resume(world, out):
    """SFT batches with AdamW, then RL with Muon on the same mesh optimizer: equal to the
    single-process SFTTrainer then a fresh Muon; then a resume (state tensors copied into a new
    updater, as torch.distributed.checkpoint does) continues with the same steps."""
    from tests.test_parallel import _cfgs, _model
    from tests.test_rl_distributed import make_batch
    from train.parallel.rl_update import RLUpdater, reference_optimizer, reference_update
    from train.rl.exchange import TrainBatch, TrainSample
    from train.sft import SFTConfig, SFTTrainer

    cfg = _cfgs()["moe"]
    sft_optim = OptimConfig(lr=3e-3, weight_decay=0.05, grad_clip=0.5, warmup_steps=1, eps=1e-6)
    rcfg = _muon_rl_cfg(0.9)
    rcfg.sft_optim = sft_optim
    examples = [[(x.prompt_ids, x.completion_ids) for x in make_batch(s, cfg, seed=7).samples] for s in range(2)]
    rl = [make_batch(5 + s, cfg) for s in range(3)]
    ref = _model(cfg)
    sft = SFTTrainer(ref, None, SFTConfig(steps=2, batch_size=8, micro_batch_size=3, optim=sft_optim))
    for ex in examples:
        sft.step(ex)
    opt = reference_optimizer(ref, rcfg)
    for i, b in enumerate(rl):
        reference_update(ref, opt, b, rcfg, i)
    want = ref.state_dict()
    for dp, tsp in ((2, 1), (1, 2)):
        up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
        for i, ex in enumerate(examples):
            up.step(TrainBatch(i, [TrainSample(p, c, [0.0] * len(c), 0.0, True) for p, c in ex], 1.0,
                               {"kind": "sft", "schedule_step": i}), i)
        for i, b in enumerate(rl[:2]):
            up.step(TrainBatch(2 + i, b.samples, b.temperature, {"kind": "rl", "schedule_step": i}), 2 + i)
        # resume: a new updater gets this one's state tensors and phase, then both take the last step
        again = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
        for k, v in again.state_tensors().items():
            v.copy_(up.state_tensors()[k])
        again.phase = up.phase
        for u in (up, again):
            u.step(TrainBatch(4, rl[2].samples, rl[2].temperature, {"kind": "rl", "schedule_step": 2}), 4)
        got, resumed = up.full_state_dict(), again.full_state_dict()
        key = f"phases.dp{dp}xtsp{tsp}"
        out[key + ".params"] = max((got[k] - want[k]).abs().max().item() for k in want)
        out[key + ".resumed"] = max((got[k] - resumed[k]).abs().max().item() for k in want)


def _worker(rank, world, port, path):
    from tests.test_parallel import run_checks

    run_checks(rank, world, port, path, [_check_sharded, _check_phases_and_resume])


def _muon_runs(cases):
    """For each ``(cfg, dp, tsp, momentum)``: Muon on that mesh for two steps, counting this rank's
    ``muon_direction`` calls (a wrapper in train.parallel.dp) and tracking the collectives; yields
    (updater, calls per step, largest distance to the single-process reference, collectives by tag/op)."""
    import train.parallel.dp as dp_mod
    from tests.test_parallel import _model
    from tests.test_rl_distributed import make_batch, reference_weights
    from train.parallel import comm
    from train.parallel.rl_update import RLUpdater

    real, calls = dp_mod.muon_direction, []

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    dp_mod.muon_direction = counting
    try:
        for cfg, dp, tsp, momentum in cases:
            rcfg = _muon_rl_cfg(momentum)
            batches = [make_batch(s, cfg) for s in range(2)]
            want, _ = reference_weights(cfg, rcfg, batches)
            up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
            calls.clear()
            with comm.track() as t:
                for i, b in enumerate(batches):
                    up.step(b, i)
            got = up.full_state_dict()
            yield (up, len(calls) / len(batches), max((got[k] - want[k]).abs().max().item() for k in want),
                   t.by("tag/op"))
    finally:
        dp_mod.muon_direction = real


def _check_owners(world, out):
    """dp1 x tsp2, moe (momentum 0) and dense (0.9): calls, matrices, distance to the reference and
    the collectives of the Muon exchange."""
    from tests.test_parallel import _cfgs

    cases = [(_cfgs()["moe"], 1, 2, 0.0), (_cfgs()["dense"], 1, 2, 0.9)]
    for name, (up, calls, err, ops) in zip(("moe", "dense"), _muon_runs(cases)):
        key = f"owners.{name}"
        out[key + ".calls"], out[key + ".matrices"], out[key + ".params"] = calls, len(up.opt.matrices), err
        out[key + ".all_to_all"] = ops.get("muon.matrices/all_to_all.muon", [0, 0, 0])[2]
        out[key + ".all_gather"] = ops.get("muon.matrices/all_gather.muon", [0, 0, 0])[2]


def _check_owners_4(world, out):
    """Four ranks: dp2 x tsp2 with an intermediate size that gives the TSP ranks unequal slices, and
    dp1 x tsp4 (moe): distance to the reference, calls, and the matrices the rank's TSP group needs."""
    import dataclasses

    from tests.test_parallel import _cfgs

    odd = dataclasses.replace(_cfgs()["dense"], intermediate_size=43)
    cases = [(odd, 2, 2, 0.9), (_cfgs()["moe"], 1, 4, 0.0)]
    for key, (up, calls, err, _) in zip(("owners4.odd.dp2xtsp2", "owners4.moe.dp1xtsp4"), _muon_runs(cases)):
        out[key + ".params"], out[key + ".calls"], out[key + ".dp_rank"] = err, calls, up.dp_rank
        out[key + ".group_matrices"] = len(up.opt.owner)  # those some rank of its TSP group needs


def _checks_worker(rank, world, port, path, check):
    from tests.test_parallel import run_checks

    run_checks(rank, world, port, path, [check])


@pytest.mark.timeout(300)
def test_sharded_muon_orthogonalises_each_matrix_once():
    """On dp1 x tsp2 each whole matrix is orthogonalised by one TSP rank (its owner) per step, the
    work split between the ranks, and the weights still equal the single-process reference."""
    from tests.test_parallel import spawn

    ranks = spawn(2, _checks_worker, _check_owners)
    for r in ranks:
        assert "error" not in r, r.get("trace")
    for name in ("moe", "dense"):
        key = f"owners.{name}"
        n = ranks[0][key + ".matrices"]
        assert n > 2 and all(r[key + ".matrices"] == n for r in ranks)
        calls = [r[key + ".calls"] for r in ranks]
        assert sum(calls) == n, (name, calls, n)  # every matrix exactly once per step
        assert all(0 < c < n for c in calls), (name, calls)  # each rank only some of them
        for r in ranks:
            assert r[key + ".params"] < TOL, (name, r[key + ".params"])
            assert r[key + ".all_to_all"] == 2 * 2  # 2 steps x (U shards to the owners, O back)
            assert r[key + ".all_gather"] == 0


@pytest.mark.timeout(300)
def test_sharded_muon_owners_on_four_ranks():
    """dp2 x tsp2 (unequal slices across the TSP ranks) and dp1 x tsp4: equal to the single-process
    reference, and in each TSP group every matrix that the group needs is orthogonalised once."""
    from tests.test_parallel import spawn

    ranks = spawn(4, _checks_worker, _check_owners_4)
    for r in ranks:
        assert "error" not in r, r.get("trace")
    for key in ("owners4.odd.dp2xtsp2", "owners4.moe.dp1xtsp4"):
        assert max(r[key + ".params"] for r in ranks) < TOL, key
        for d in {r[key + ".dp_rank"] for r in ranks}:
            group = [r for r in ranks if r[key + ".dp_rank"] == d]
            assert sum(r[key + ".calls"] for r in group) == group[0][key + ".group_matrices"] > 0, (key, d)
            assert all(r[key + ".calls"] < r[key + ".group_matrices"] for r in group), (key, d)


@pytest.mark.timeout(600)
def test_sharded_muon_equals_single_process():
    from tests.test_parallel import spawn

    ranks = spawn(2, _worker)
    for r in ranks:
        assert "error" not in r, r.get("trace")
    keys = [k for k in ranks[0] if k.endswith(".params") and not k.startswith("phases.")]
    assert len(keys) == 8
    for k in keys:
        err = max(r[k] for r in ranks)
        moved = min(r[k.replace(".params", ".moved")] for r in ranks)
        assert moved > 1e-4, (k, moved)
        assert err < TOL, (k, err)
    assert ranks[0]["adam_vs_muon"] > 1e-3
    for mesh in ("dp2xtsp1", "dp1xtsp2"):
        for what in ("params", "resumed"):
            k = f"phases.{mesh}.{what}"
            assert max(r[k] for r in ranks) < TOL, (k, max(r[k] for r in ranks))


# ------------------------------------------------------------------------------ schedule and config checks


def test_lr_schedule_warmup_then_decay_by_hand():
    """Warm-up: step s (0-based) of w runs at (s + 1) / w of the peak, the last warm-up step at the peak; then
    linear or cosine decay from the peak to min_lr_ratio over total_steps - warmup_steps steps, held at the floor
    afterwards. Values computed by hand; the optimizer's own LambdaLR reproduces them step by step."""
    from train.optim import lr_factor

    const = OptimConfig(warmup_steps=4)
    assert [lr_factor(s, const) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    lin = OptimConfig(warmup_steps=2, schedule="linear", total_steps=12, min_lr_ratio=0.1)
    # decay over 10 steps from step 2: 1 - 0.9 * (s - 2) / 10
    assert [lr_factor(s, lin) for s in (0, 1, 2, 7, 11, 12, 30)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.19, 0.1, 0.1])
    cos = OptimConfig(schedule="cosine", total_steps=10, min_lr_ratio=0.2)
    # 0.2 + 0.8 * (1 + cos(pi * s / 10)) / 2: cos(pi/2) = 0 at s = 5, cos(pi) = -1 at s = 10, held there
    assert [lr_factor(s, cos) for s in (0, 5, 10, 15, 40)] == pytest.approx([1.0, 0.6, 0.2, 0.2, 0.2])
    # no room to decay (total_steps <= warmup_steps): the peak after warm-up
    short = OptimConfig(warmup_steps=3, schedule="linear", total_steps=3, min_lr_ratio=0.0)
    assert [lr_factor(s, short) for s in range(6)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0])
    # the scheduler the trainers step
    lin_model = torch.nn.Linear(3, 2)
    opt, sched = build_optimizer(lin_model, OptimConfig(lr=0.5, warmup_steps=2, schedule="linear", total_steps=12,
                                                        min_lr_ratio=0.1))
    seen = []
    for _ in range(13):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:3] == pytest.approx([0.25, 0.5, 0.5]) and seen[7] == pytest.approx(0.275)
    assert seen[12] == pytest.approx(0.05)


def test_over_gives_a_decaying_schedule_its_length():
    """``over(steps)``: a decaying schedule without total_steps runs over ``steps``; a constant one, or one that
    names its total_steps, is kept as it is."""
    assert OptimConfig(schedule="cosine").over(50).total_steps == 50
    assert OptimConfig(schedule="linear", total_steps=7).over(50).total_steps == 7
    assert OptimConfig().over(50).total_steps == 0


@pytest.mark.parametrize("kw, msg", [({"eps": 0.0}, "eps must be > 0"),
                                     ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\]"),
                                     ({"min_lr_ratio": -0.1}, r"min_lr_ratio must be in \[0, 1\]"),
                                     ({"lr": -1e-3}, "lr must be >= 0"),
                                     ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
                                     ({"name": "muon", "muon_ns_steps": 0}, "muon_ns_steps must be >= 1"),
                                     ({"schedule": "step"}, "unknown lr schedule 'step'")])
def test_config_refuses_values_outside_their_range(kw, msg):
    with pytest.raises(ValueError, match=msg):
        OptimConfig(**kw)


def test_muon_refuses_vectors_in_a_matrix_group():
    with pytest.raises(ValueError, match="Muon groups take matrices"):
        Muon([{"params": [torch.zeros(4, requires_grad=True)], "muon": True}])


def test_fp16_parameters_get_fp32_master_weights():
    """fp16 like bf16: steps below the dtype's spacing accumulate in fp32 masters instead of rounding away. AdamW at
    lr 1e-4 with a constant gradient moves each weight by ~1e-4 a step (under fp16's spacing of ~5e-4 at 0.5-1):
    ten steps move the fp16 weights by ~1e-3."""
    from train.optim import MasterWeights

    lin = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.linspace(0.5, 0.9, 16).reshape(4, 4))
    lin = lin.half()
    w0 = lin.weight.detach().float().clone()
    opt, sched = build_optimizer(lin, OptimConfig(lr=1e-4))
    assert isinstance(opt, MasterWeights) and opt.master[id(lin.weight)].dtype == torch.float32
    for _ in range(10):
        lin.weight.grad = torch.ones(4, 4, dtype=torch.float16)
        opt.step()
    assert lin.weight.dtype == torch.float16
    assert torch.allclose(lin.weight.detach().float() - w0, torch.full((4, 4), -1e-3), atol=3e-4)


def test_a_zero_gradient_leaves_a_muon_matrix_alone():
    """An MoE expert that no token reached has a zero gradient: Newton-Schulz of 0 is 0 (the norm clamped at eps,
    not 0 / 0), so its matrices stay as they are (no NaN), the other experts still move."""
    from train.optim import newton_schulz

    assert torch.equal(newton_schulz(torch.zeros(2, 3, 5)), torch.zeros(2, 3, 5))
    w0 = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    w = w0.clone().requires_grad_(True)
    opt = Muon([{"params": [w], "muon": True}], lr=0.1)
    w.grad = torch.stack([torch.zeros(6, 4), torch.ones(6, 4)])
    opt.step()
    assert torch.equal(w.detach()[0], w0[0]) and not torch.equal(w.detach()[1], w0[1])
