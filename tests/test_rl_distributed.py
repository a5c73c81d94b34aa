"""The RL update on the DP x TSP mesh (train/parallel/rl_update.py) against the single-process
reference step, and the torchrun trainer worker (train/rl/worker.py).

One gloo world is spawned per world size (2 and 4); every check runs inside it and the ranks
return their largest deviations to the parent, which asserts. fp32: parameters after two RL steps
(AdamW with weight decay, warm-up, active clipping, several micro-batches, router replay) must
match the reference within 1e-5. A world of 2 checks the KL penalty (k3, k1) against the
single-process step with a reference policy: the starting weights, an HF checkpoint, the post-SFT
weights, and the same reference across a checkpoint and resume.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5

from tests.test_parallel import _cfgs, _model, run_checks, spawn, world_of_one  # noqa: E402 (shared helpers)
from train.parallel.comm import free_port  # noqa: E402
from cascade.learner import kill_tree  # noqa: E402


def make_batch(step: int, cfg, n: int = 8, seed: int = 0, temperature: float = 0.9):
    """``n`` rollouts of different lengths and random advantages, one dropped (keep=False); the
    behaviour log-probs are the initial policy's plus noise (so the trust regions clip some tokens
    and sequences, not all); random router replay ids for MoE configs."""
    from train.model.modeling import token_logprobs
    from train.rl.exchange import TrainBatch, TrainSample, unstack_routing

    g = torch.Generator().manual_seed(1000 * seed + step)
    n_moe = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    policy = _model(cfg)
    samples = []
    for i in range(n):
        P = int(torch.randint(1, 6, (1,), generator=g))
        C = int(torch.randint(1, 10, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size, (P + C,), generator=g)
        routed = None
        if n_moe:
            routed = torch.stack([torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                                               for _ in range(n_moe)]) for _ in range(P + C)]).to(torch.int16)
        with torch.no_grad():
            lp = token_logprobs(policy, ids[None], None, temperature, unstack_routing(routed))[0, P - 1:]
        mu = (lp + 0.3 * torch.randn(C, generator=g)).clamp(max=-1e-3).tolist()
        adv = float(torch.randn((), generator=g))
        samples.append(TrainSample(ids[:P].tolist(), ids[P:].tolist(), mu, adv, keep=(i != 3), routed_experts=routed))
    return TrainBatch(step, samples, temperature=temperature)


def rl_cfg(loss: str, kl: tuple[float, str] | None = None, **kw):
    """The test's RLUpdateConfig; ``kl``: (kl_coef, kl_type) of a KL penalty."""
    from train.optim import OptimConfig
    from train.parallel.rl_update import RLUpdateConfig

    from train.rl.losses import LossConfig

    # eps: Adam divides by |g| + eps, so on elements with a tiny gradient fp32 summation-order noise
    # (~1e-9 here) becomes update noise of about lr * noise / eps; 1e-6 keeps that far below TOL
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.05, warmup_steps=2, eps=1e-6)
    kl_kw = {} if kl is None else {"kl_coef": kl[0], "kl_type": kl[1]}
    if "tis_cap" in kw:
        kl_kw["tis_cap"] = kw.pop("tis_cap")
    loss_cfg = LossConfig(gspo_clip_low=0.1, gspo_clip_high=0.1, **kl_kw)  # a trust region some sequences fall in
    return RLUpdateConfig(loss=loss, loss_cfg=loss_cfg, optim=optim, tokens_per_micro=kw.pop("tokens_per_micro", 20),
                          **kw)


def reference_weights(cfg, rcfg, batches) -> dict[str, torch.Tensor]:
    from train.parallel.rl_update import reference_optimizer, reference_update

    ref = _model(cfg)
    opt = reference_optimizer(ref, rcfg)
    mets = [reference_update(ref, opt, b, rcfg, i) for i, b in enumerate(batches)]
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}, mets


# ------------------------------------------------------------------------------ in-process world


CASES = [("moe", "dppo_tv"), ("dense", "gspo"), ("moe", "gspo"), ("dense", "dapo"), ("dense", "grpo+recompute")]


def _gathered(up, out, key):
    """``up.full_state_dict()`` on every rank, after checking the gather to rank 0 alone: rank 0 gets the
    same weights and receives at most the model's bytes (``out[key + ".recv"]``: received over the
    model's bytes), the other ranks get None and receive nothing (``out[key + ".recv_elsewhere"]``)."""
    from unittest import mock

    import torch.distributed as dist

    got = up.full_state_dict()
    received = []
    real = dist.recv

    def spy(tensor, *a, **k):
        received.append(tensor.numel() * tensor.element_size())
        return real(tensor, *a, **k)

    with mock.patch.object(dist, "recv", spy):
        only = up.full_state_dict(dst=0)
    if dist.get_rank() == 0:
        assert set(only) == set(got) and all(torch.equal(only[k], got[k]) for k in got)
        out[key + ".recv"] = sum(received) / sum(t.numel() * t.element_size() for t in got.values())
    else:
        assert only is None
        out[key + ".recv_elsewhere"] = float(sum(received))
    return got


def _check_updates(world, out):
    from train.parallel.rl_update import RLUpdater

    meshes = {2: [(1, 2), (2, 1)], 4: [(2, 2)]}[world]
    for dp, tsp in meshes:
        for name, loss in CASES:
            cfg = _cfgs()[name]
            # the ratio against the policy before the step, the behaviour log-probs in truncated IS (capped)
            rcfg = rl_cfg(loss.split("+")[0], ratio_against="recompute", tis_cap=1.2) if "+" in loss else rl_cfg(loss)
            batches = [make_batch(s, cfg) for s in range(2)]
            want, ref_m = reference_weights(cfg, rcfg, batches)
            up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
            mets = [up.step(b, i) for i, b in enumerate(batches)]
            key = f"dp{dp}xtsp{tsp}.{name}.{loss}"
            got = _gathered(up, out, key)
            assert set(got) == set(want), (set(got) ^ set(want))
            out[key + ".params"] = max((got[k] - want[k]).abs().max().item() for k in want)
            out[key + ".moved"] = max((want[k] - _model(cfg).state_dict()[k]).abs().max().item() for k in want)
            out[key + ".loss"] = max(abs(m["loss"] - r["loss"]) for m, r in zip(mets, ref_m))
            out[key + ".grad_norm"] = max(abs(m["grad_norm"] - r["grad_norm"]) / r["grad_norm"]
                                          for m, r in zip(mets, ref_m))
            out[key + ".micro"] = max(m["micro_batches_max"] for m in mets)
            out[key + ".clip_frac"] = mets[0]["clip_frac"]
            if "+" in loss:  # the cap did act (the test's mu are the policy's log-probs plus noise)
                out[key + ".tis_capped_frac"] = abs(mets[0]["tis_capped_frac"] - ref_m[0]["tis_capped_frac"])
                out[key + ".tis_capped"] = ref_m[0]["tis_capped_frac"]
            out[key + ".grad_norm_abs"] = mets[0]["grad_norm"]
    if world == 2:  # activation checkpointing on DP ranks: the same step, each decoder layer run twice
        cfg, calls = _cfgs()["moe"], {}
        batches = [make_batch(s, cfg) for s in range(2)]
        got = {}
        for ckpt in (False, True):
            model = _model(cfg)
            calls[ckpt] = 0
            model.model.layers[0].register_forward_pre_hook(lambda *a, c=ckpt: calls.__setitem__(c, calls[c] + 1))
            up = RLUpdater(model, rl_cfg("dppo_tv", activation_checkpointing=ckpt), tsp=1, dp=2)
            for i, b in enumerate(batches):
                up.step(b, i)
            got[ckpt] = up.full_state_dict()
        out["ckpt.weights_err"] = max((got[True][k] - got[False][k]).abs().max().item() for k in got[False])
        out["ckpt.calls_ratio"] = calls[True] / max(1, calls[False])


def _zaya_cfg():
    from train.model.config import ModelConfig

    # a fast balancing rate, so that the second step routes by biases the first step's load moved
    return ModelConfig(architecture="zaya", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
                       router_hidden_size=8, partial_rotary_factor=0.5, router_bias_update_rate=0.05)


def _check_zaya(world, out, tsp=1, replay=False):
    """ZAYA1 on a dp x tsp mesh: two RL steps equal the single-process steps, balancing biases included
    (moved by the load of the whole batch: every rank's tokens, summed over the TSP and DP groups), with the
    policy's own routing or (``replay``) the rollouts' recorded experts pinning it."""
    from train.parallel.rl_update import RLUpdater

    cfg = _zaya_cfg()
    rcfg = rl_cfg("dppo_tv")
    batches = [make_batch(s, cfg) for s in range(2)]
    for b in batches:  # routed by the policy (and its biases) unless replayed; the dropped rollout's tokens not
        for smp in b.samples:  # counted in the load (not forwarded, on either side)
            if not replay:
                smp.routed_experts = None
    want, _ = reference_weights(cfg, rcfg, batches)
    key = f"zaya.tsp{tsp}.dp{world // tsp}"
    up = RLUpdater(_model(cfg), rcfg, tsp=tsp)
    up.step(batches[0], 0)
    # the biases go through a checkpoint: saved after step 1, restored into fresh ranks that take step 2
    import tempfile

    import torch.distributed as dist

    from train.rl.worker import load_checkpoint, save_checkpoint

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    save_checkpoint(up, Path(box[0]), 1, keep=2)
    up = RLUpdater(_model(cfg), rcfg, tsp=tsp)
    out[key + ".resumed_step"] = float(load_checkpoint(up, Path(box[0])))
    up.step(batches[1], 1)
    got = up.full_state_dict()
    biases = [k for k in want if k.endswith("balancing_biases")]
    assert set(got) == set(want) and biases, set(got) ^ set(want)
    out[key + ".params_err"] = max((got[k] - want[k]).abs().max().item() for k in want)
    out[key + ".biases_moved"] = max((want[k] - _model(cfg).state_dict()[k]).abs().max().item() for k in biases)
    out[key + ".biases_err"] = max((got[k] - want[k]).abs().max().item() for k in biases)


def _check_zaya_dp(world, out):
    _check_zaya(world, out)


def _check_zaya_tsp(world, out):
    _check_zaya(world, out, tsp=2, replay=world == 2)
    if world == 4:  # ZAYA1's 2 KV heads on 4 TSP ranks: two ranks share each KV head
        _check_zaya(world, out, tsp=4, replay=True)


def _check_bf16(world, out):
    """bf16 compute copy: fp32 master and moments, and a step close to the fp32 reference."""
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["moe"]
    rcfg = rl_cfg("dppo_tv", dtype="bfloat16")
    batch = make_batch(0, cfg)
    want, ref_m = reference_weights(cfg, rl_cfg("dppo_tv"), [batch])
    start = _model(cfg).state_dict()
    up = RLUpdater(_model(cfg), rcfg, tsp=world if world == 2 else 2)
    # bf16 gradients of two micro-batches add up in fp32 exactly (the accumulator sums in place)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    sent = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in up.opt.params] for _ in range(2)]
    for grads in sent:
        for p, g in zip(up.opt.params, grads):
            p.grad = g.clone()
        up.opt.accumulate()
    want_acc = torch.cat([(a.float() + b.float()).reshape(-1) for a, b in zip(*sent)])
    out["bf16.acc_err"] = (up.opt._acc - want_acc).abs().max().item()
    out["bf16.grads_freed"] = float(all(p.grad is None for p in up.opt.params))
    up.opt._acc = None
    m = up.step(batch, 0)
    got = up.full_state_dict()
    # the fp32 weights are the master copy (sent by the DP ranks that own it), the bf16 ones its rounding
    half = up.full_state_dict(torch.bfloat16, dst=0)
    if half is not None:
        out["bf16.half_is_master_rounded"] = float(all(torch.equal(half[k], got[k].to(torch.bfloat16)) for k in got))
        out["bf16.master_finer"] = float(any(not torch.equal(half[k].float(), got[k]) for k in got))
    st = up.opt.state_tensors()
    out["bf16.dtypes_ok"] = float(all(p.dtype == torch.bfloat16 for p in up.shards.values())
                                  and st["master"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32)
    out["bf16.loss_rel"] = abs(m["loss"] - ref_m[0]["loss"]) / abs(ref_m[0]["loss"])
    # the same update direction as fp32 on most elements that moved
    agree = tot = 0
    for k in want:
        d_ref, d_got = want[k] - start[k], got[k] - start[k]
        moved = d_ref.abs() > 1e-4
        agree += int(((d_ref.sign() == d_got.sign()) & moved).sum())
        tot += int(moved.sum())
    out["bf16.sign_agree"] = agree / max(tot, 1)


def _check_sft_then_rl(world, out):
    """SFT batches on the mesh (meta kind "sft") equal ``SFTTrainer.step``; the RL step after them
    equals a fresh single-process AdamW's step from the SFT'd weights (each phase its own optimizer)."""
    from train.optim import OptimConfig
    from train.parallel.rl_update import RLUpdater, reference_optimizer, reference_update
    from train.rl.exchange import TrainBatch, TrainSample
    from train.sft import SFTConfig, SFTTrainer

    cfg = _cfgs()["moe"]
    sft_optim = OptimConfig(lr=3e-3, weight_decay=0.05, grad_clip=0.5, warmup_steps=1, eps=1e-6, betas=(0.8, 0.95))
    rcfg = rl_cfg("dppo_tv", sft_optim=sft_optim)
    examples = []
    for i, b in enumerate([make_batch(s, cfg, seed=7) for s in range(2)]):
        examples.append([(x.prompt_ids, x.completion_ids) for x in b.samples])
    rl_batch = make_batch(5, cfg)
    ref = _model(cfg)
    sft = SFTTrainer(ref, None, SFTConfig(steps=2, batch_size=8, micro_batch_size=3, optim=sft_optim))
    ref_sft = [sft.step(ex) for ex in examples]
    after_sft = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    reference_update(ref, reference_optimizer(ref, rcfg), rl_batch, rcfg, 0)
    after_rl = ref.state_dict()
    for dp, tsp in ((2, 1), (1, 2)):
        up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
        mets = [up.step(TrainBatch(i, [TrainSample(p, c, [0.0] * len(c), 0.0, True) for p, c in ex], 1.0,
                                   {"kind": "sft", "schedule_step": i}), i) for i, ex in enumerate(examples)]
        got = up.full_state_dict()
        key = f"sft.dp{dp}xtsp{tsp}"
        out[key + ".weights"] = max((got[k] - after_sft[k]).abs().max().item() for k in after_sft)
        out[key + ".loss"] = max(abs(m["sft_loss"] - r["sft_loss"]) for m, r in zip(mets, ref_sft))
        out[key + ".lr"] = max(abs(m["lr"] - r["lr"]) for m, r in zip(mets, ref_sft))
        up.step(TrainBatch(2, rl_batch.samples, rl_batch.temperature, {"kind": "rl", "schedule_step": 0}), 2)
        got = up.full_state_dict()
        out[key + ".rl_params"] = max((got[k] - after_rl[k]).abs().max().item() for k in after_rl)
    out["sft.moved"] = max((after_sft[k] - _model(cfg).state_dict()[k]).abs().max().item() for k in after_sft)


def _check_all_dropped_batch(world, out):
    """A batch whose every rollout is dropped (no loss token) moves nothing on the mesh, as in one process
    (torch's optimizers skip parameters without a gradient): no decay, no moment update, no step counted."""
    import dataclasses

    from train.parallel.rl_update import RLUpdater
    from train.rl.exchange import TrainBatch

    cfg = _cfgs()["dense"]
    up = RLUpdater(_model(cfg), rl_cfg("dppo_tv"), tsp=1, dp=2)
    up.step(make_batch(0, cfg), 0)
    before = up.full_state_dict()
    b = make_batch(1, cfg)
    m = up.step(TrainBatch(1, [dataclasses.replace(x, keep=False) for x in b.samples], b.temperature), 1)
    after = up.full_state_dict()
    out["dropped.moved"] = max((after[k] - before[k]).abs().max().item() for k in before)
    out["dropped.steps"], out["dropped.grad_norm"] = float(up.opt.steps), m["grad_norm"]


def _check_errors(world, out):
    from train.model.config import ModelConfig
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["dense"]
    for key, make in (("err.mesh", lambda: RLUpdater(_model(cfg), rl_cfg("dppo_tv"), tsp=2, dp=2)),
                      ("err.heads", lambda: RLUpdater(_model(ModelConfig(
                          vocab_size=50, hidden_size=24, intermediate_size=16, num_hidden_layers=1, head_dim=8,
                          num_attention_heads=3, num_key_value_heads=1)), rl_cfg("dppo_tv"), tsp=2))):
        try:
            make()
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)


def _check_orphaned_seen_off_rank_0(world, out):
    """The orchestrator died, and rank 0 runs on another host than it (torchrun orders the nodes by name, so
    rank 0 need not be on the orchestrator's): here rank 0 is told the orchestrator's host is another one.
    No batch ever comes; the rank on the orchestrator's host sees it gone, and every rank leaves (before,
    only rank 0 looked, and the ranks waited forever: here until the 5 s ``max_wait_s``)."""
    import socket
    import tempfile

    import torch.distributed as dist

    from train.rl.worker import _poll

    box = [None]
    if dist.get_rank() == 0:
        child = subprocess.Popen(["true"])
        child.wait()  # reaped: its pid names no process
        box = [child.pid]
    dist.broadcast_object_list(box, src=0)
    host = "another-host" if dist.get_rank() == 0 else socket.gethostname()
    with tempfile.TemporaryDirectory() as d:  # an exchange where nothing arrives
        try:
            out["orphan.result"] = _poll(Path(d), 0, 0.01, 5.0, "cpu", (box[0], host, None))
        except TimeoutError as e:
            out["orphan.result"] = f"timeout: {e}"


def _worker(rank, world, port, path):
    run_checks(rank, world, port, path, ([_check_errors, _check_orphaned_seen_off_rank_0, _check_sft_then_rl,
                                          _check_zaya_dp, _check_all_dropped_batch] if world == 2 else [])
               + [_check_updates, _check_bf16, _check_zaya_tsp])


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    world = request.param
    ranks = spawn(world, _worker)
    for r in ranks:
        assert "error" not in r, r.get("trace")
    return world, ranks


def _max(ranks, key):
    return max(r[key] for r in ranks)


@pytest.mark.timeout(400)
def test_sharded_rl_step_equals_reference(results):
    world, ranks = results
    keys = [k for k in ranks[0] if k.endswith(".params")]
    assert len(keys) == len(CASES) * (2 if world == 2 else 1), keys
    for k in keys:
        base = k[:-len(".params")]
        assert _max(ranks, base + ".moved") > 1e-3, k  # the step did something
        assert _max(ranks, k) < TOL, (k, _max(ranks, k))
        assert _max(ranks, base + ".loss") < TOL, (k, _max(ranks, base + ".loss"))
        assert _max(ranks, base + ".grad_norm") < 1e-4, (k, _max(ranks, base + ".grad_norm"))
        assert _max(ranks, base + ".micro") >= 2, k  # the token budget did cut micro-batches
        assert ranks[0][base + ".recv"] <= 1.0, k  # rank 0 receives the other ranks' parts once
        assert max(r[base + ".recv_elsewhere"] for r in ranks[1:]) == 0.0, k  # the others receive nothing
        if "xtsp1." not in base:  # TSP ranks' shards did travel to rank 0
            assert ranks[0][base + ".recv"] > 0.3, k
        if "recompute" in base:
            assert 0 < ranks[0][base + ".tis_capped"] < 1 and _max(ranks, base + ".tis_capped_frac") < 1e-6, k


def test_a_batch_without_loss_tokens_moves_nothing_on_the_mesh(results):
    world, ranks = results
    if world != 2:
        pytest.skip("checked on 2 ranks")
    assert _max(ranks, "dropped.moved") == 0.0 and ranks[0]["dropped.steps"] == 1.0
    assert ranks[0]["dropped.grad_norm"] == 0.0


@pytest.mark.timeout(400)
def test_zaya_rl_steps_on_the_mesh_equal_single_process(results):
    """ZAYA1 on data-parallel ranks (2 ranks), on TSP 2 with router replay (2 ranks), on DP 2 x TSP 2 and on
    TSP 4 (4 ranks, 2 KV heads: two ranks share each)."""
    world, ranks = results
    meshes = ["tsp1.dp2", "tsp2.dp1"] if world == 2 else ["tsp2.dp2", "tsp4.dp1"]
    seen = {".".join(k.split(".")[1:3]) for k in ranks[0] if k.startswith("zaya.")}
    assert sorted(seen) == sorted(meshes), seen
    for m in meshes:
        assert _max(ranks, f"zaya.{m}.biases_moved") >= 0.05, m  # the balancing step ran (rate 0.05)
        assert _max(ranks, f"zaya.{m}.resumed_step") == 1.0, m
        assert _max(ranks, f"zaya.{m}.params_err") < TOL, (m, _max(ranks, f"zaya.{m}.params_err"))
        assert _max(ranks, f"zaya.{m}.biases_err") == 0.0, m


@pytest.mark.timeout(400)
def test_activation_checkpointing_on_dp_ranks(results):
    world, ranks = results
    if world != 2:
        pytest.skip("run on the 2-rank world")
    assert _max(ranks, "ckpt.weights_err") < 1e-6
    assert min(r["ckpt.calls_ratio"] for r in ranks) == 2.0


@pytest.mark.timeout(400)
def test_bf16_compute_copy(results):
    world, ranks = results
    assert _max(ranks, "bf16.dtypes_ok") == 1.0
    assert _max(ranks, "bf16.acc_err") == 0.0 and min(r["bf16.grads_freed"] for r in ranks) == 1.0
    assert ranks[0]["bf16.half_is_master_rounded"] == 1.0 and ranks[0]["bf16.master_finer"] == 1.0
    assert all("bf16.master_finer" not in r for r in ranks[1:])  # the bf16 dict went to rank 0 alone
    assert _max(ranks, "bf16.loss_rel") < 0.05
    assert min(r["bf16.sign_agree"] for r in ranks) > 0.9


@pytest.mark.timeout(400)
def test_sft_steps_on_the_mesh_then_rl(results):
    world, ranks = results
    if world != 2:
        pytest.skip("checked in the world of 2")
    assert _max(ranks, "sft.moved") > 1e-3
    for mesh in ("dp2xtsp1", "dp1xtsp2"):
        for what in ("weights", "loss", "lr", "rl_params"):
            k = f"sft.{mesh}.{what}"
            assert _max(ranks, k) < TOL, (k, _max(ranks, k))


@pytest.mark.timeout(400)
def test_bad_mesh_and_heads_raise_one_line(results):
    world, ranks = results
    if world != 2:
        pytest.skip("checked in the world of 2")
    for r in ranks:
        assert r["err.mesh"].startswith("mesh dp=2 x tsp=2 does not match the world size 2"), r["err.mesh"]
        assert "num_attention_heads (3) divisible by D=2" in r["err.heads"], r["err.heads"]
        assert "\n" not in r["err.mesh"] + r["err.heads"]


def test_an_orchestrator_seen_dead_by_any_rank_stops_every_rank(results):
    world, ranks = results
    if world != 2:
        pytest.skip("checked in the world of 2")
    assert [r["orphan.result"] for r in ranks] == ["orphaned", "orphaned"], [r["orphan.result"] for r in ranks]


# ------------------------------------------------------------------------------ KL to a reference


def _perturbed(cfg, seed: int = 3, scale: float = 0.05):
    model = _model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def _kl_reference_run(model, rcfg, batches, ref_model, first_step: int = 0):
    """The single-process RL steps with KL to ``ref_model`` (a fresh AdamW): final weights and metrics."""
    from train.parallel.rl_update import reference_optimizer, reference_update

    opt = reference_optimizer(model, rcfg)
    mets = [reference_update(model, opt, b, rcfg, first_step + i, ref_model) for i, b in enumerate(batches)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, mets


def _err(got: dict, want: dict) -> float:
    assert set(got) == set(want), set(got) ^ set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


KL_CASES = [("moe", "k3", 20.0), ("dense", "k1", 0.5)]


def _check_kl_fresh(world, out, shared):
    """No SFT: the frozen reference is the starting policy; k3 and k1 on both meshes of 2 ranks equal
    the single-process steps with KL to the starting weights (weights, loss and kl_ref per step)."""
    from train.parallel.rl_update import RLUpdater

    for name, kind, coef in KL_CASES:
        cfg = _cfgs()[name]
        rcfg = rl_cfg("dppo_tv", kl=(coef, kind))
        batches = [make_batch(s, cfg) for s in range(2)]
        want, ref_m = _kl_reference_run(_model(cfg), rcfg, batches, _model(cfg))
        no_kl, _ = _kl_reference_run(_model(cfg), rl_cfg("dppo_tv"), batches, None)
        key = f"kl.fresh.{name}.{kind}"
        out[key + ".kl_effect"] = _err(want, no_kl)  # the KL term changed the update
        out[key + ".kl_ref_step1"] = ref_m[1]["kl_ref"]
        for dp, tsp in ((1, 2), (2, 1)):
            up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
            mets = [up.step(b, i) for i, b in enumerate(batches)]
            k = f"{key}.dp{dp}xtsp{tsp}"
            out[k + ".params"] = _err(up.full_state_dict(), want)
            out[k + ".loss"] = max(abs(m["loss"] - r["loss"]) for m, r in zip(mets, ref_m))
            out[k + ".kl_ref"] = max(abs(m["kl_ref"] - r["kl_ref"]) for m, r in zip(mets, ref_m))
            out[k + ".micro"] = max(m["micro_batches_max"] for m in mets)


def _check_kl_hf_reference(world, out, shared):
    """``kl_reference`` = an HF checkpoint (a perturbed policy), loaded and sharded like the policy on
    each mesh (MoE; dense with tied embeddings); nothing of it goes into the checkpoint state."""
    import torch.distributed as dist

    from train.model.hf_io import save_pretrained
    from train.parallel.rl_update import RLUpdater

    for name in ("moe", "dense"):
        cfg = _cfgs()[name]
        ref_dir = Path(shared) / f"kl_ref_hf_{name}"
        if dist.get_rank() == 0:
            save_pretrained(_perturbed(cfg), ref_dir)
        dist.barrier()
        rcfg = rl_cfg("dppo_tv", kl=(0.5, "k3"), kl_reference=str(ref_dir))
        batches = [make_batch(s, cfg) for s in range(2)]
        want, ref_m = _kl_reference_run(_model(cfg), rcfg, batches, _perturbed(cfg))
        wrong, _ = _kl_reference_run(_model(cfg), rcfg, batches, _model(cfg))  # KL to the starting weights instead
        out[f"kl.hf.{name}.ref_matters"] = _err(want, wrong)
        out[f"kl.hf.{name}.kl_ref_step0"] = ref_m[0]["kl_ref"]
        for dp, tsp in ((1, 2), (2, 1)):
            up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
            k = f"kl.hf.{name}.dp{dp}xtsp{tsp}"
            out[k + ".saved_keys"] = float(sum(x.startswith("kl_ref") for x in up.state_tensors()))
            mets = [up.step(b, i) for i, b in enumerate(batches)]
            out[k + ".params"] = _err(up.full_state_dict(), want)
            out[k + ".kl_ref"] = max(abs(m["kl_ref"] - r["kl_ref"]) for m, r in zip(mets, ref_m))


def _check_kl_after_sft_and_resume(world, out, shared):
    """SFT, then RL with KL: the reference is the post-SFT policy. On dp1 x tsp2 the run is checkpointed
    inside the SFT phase (reference not taken yet) and after the first RL step, each time resumed into a
    fresh updater built from the initial weights; dp2 x tsp1 runs through. Both equal the single-process
    SFT steps followed by RL steps with KL to the post-SFT weights."""
    import copy

    from train.optim import OptimConfig
    from train.parallel.rl_update import RLUpdater, reference_optimizer, reference_update
    from train.rl.exchange import TrainBatch, TrainSample
    from train.rl.worker import load_checkpoint, save_checkpoint
    from train.sft import SFTConfig, SFTTrainer

    cfg = _cfgs()["moe"]
    sft_optim = OptimConfig(lr=3e-3, weight_decay=0.05, grad_clip=0.5, warmup_steps=1, eps=1e-6, betas=(0.8, 0.95))
    rcfg = rl_cfg("dppo_tv", kl=(20.0, "k3"), sft_optim=sft_optim)
    examples = [[(x.prompt_ids, x.completion_ids) for x in make_batch(s, cfg, seed=7).samples] for s in range(2)]
    rl_batches = [make_batch(5 + s, cfg) for s in range(2)]
    ref = _model(cfg)
    sft = SFTTrainer(ref, None, SFTConfig(steps=2, batch_size=8, micro_batch_size=3, optim=sft_optim))
    for ex in examples:
        sft.step(ex)
    after_sft = copy.deepcopy(ref)
    want, ref_m = _kl_reference_run(ref, rcfg, rl_batches, copy.deepcopy(after_sft))
    # what a reference taken at the wrong time would give: the initial weights, or those after RL step 1
    wrong_start, _ = _kl_reference_run(copy.deepcopy(after_sft), rcfg, rl_batches, _model(cfg))
    wrong_mid = copy.deepcopy(after_sft)
    opt = reference_optimizer(wrong_mid, rcfg)
    reference_update(wrong_mid, opt, rl_batches[0], rcfg, 0, after_sft)
    reference_update(wrong_mid, opt, rl_batches[1], rcfg, 1, copy.deepcopy(wrong_mid))  # retaken at the resume
    out["kl.sft.ref_start_matters"] = _err(want, wrong_start)
    out["kl.sft.ref_mid_matters"] = _err(want, {k: v.detach() for k, v in wrong_mid.state_dict().items()})

    def sft_batch(i):
        return TrainBatch(i, [TrainSample(p, c, [0.0] * len(c), 0.0, True) for p, c in examples[i]], 1.0,
                          {"kind": "sft", "schedule_step": i})

    def rl_batch(k):
        b = rl_batches[k]
        return TrainBatch(2 + k, b.samples, b.temperature, {"kind": "rl", "schedule_step": k})

    # dp2 x tsp1: straight through
    up = RLUpdater(_model(cfg), rcfg, tsp=1, dp=2)
    for i in range(2):
        up.step(sft_batch(i), i)
    mets = [up.step(rl_batch(k), 2 + k) for k in range(2)]
    out["kl.sft.dp2xtsp1.params"] = _err(up.full_state_dict(), want)
    out["kl.sft.dp2xtsp1.kl_ref"] = max(abs(m["kl_ref"] - r["kl_ref"]) for m, r in zip(mets, ref_m))
    # dp1 x tsp2: checkpoint in the SFT phase, resume, one RL step, checkpoint, resume, one RL step
    ex = Path(shared) / "kl_ckpt"
    up = RLUpdater(_model(cfg), rcfg, tsp=2, dp=1)
    for i in range(2):
        up.step(sft_batch(i), i)
    save_checkpoint(up, ex, 2, keep=5)
    up = RLUpdater(_model(cfg), rcfg, tsp=2, dp=1)
    out["kl.sft.resume1.step"] = float(load_checkpoint(up, ex))
    out["kl.sft.resume1.taken"] = float(up.ref_taken)  # checkpointed before the RL start: not taken yet
    m0 = up.step(rl_batch(0), 2)
    save_checkpoint(up, ex, 3, keep=5)
    up = RLUpdater(_model(cfg), rcfg, tsp=2, dp=1)
    out["kl.sft.resume2.step"] = float(load_checkpoint(up, ex))
    out["kl.sft.resume2.taken"] = float(up.ref_taken)
    m1 = up.step(rl_batch(1), 3)
    out["kl.sft.dp1xtsp2.params"] = _err(up.full_state_dict(), want)
    out["kl.sft.dp1xtsp2.kl_ref"] = max(abs(m["kl_ref"] - r["kl_ref"]) for m, r in zip((m0, m1), ref_m))


def _check_kl_off(world, out, shared):
    """kl_coef = 0: no reference buffers, no reference forward, no kl_ref metric, nothing saved."""
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["moe"]
    for dp, tsp in ((1, 2), (2, 1)):
        up = RLUpdater(_model(cfg), rl_cfg("dppo_tv"), tsp=tsp, dp=dp)

        def no_reference_forward(*a, **k):
            raise AssertionError("kl_coef=0 runs no reference forward")

        up._ref_logprobs = no_reference_forward
        m = up.step(make_batch(0, cfg), 0)
        k = f"kl.off.dp{dp}xtsp{tsp}"
        out[k + ".ref_none"] = float(up.ref is None and not up.saves_reference)
        out[k + ".keys"] = float(sum(x.startswith("kl_ref") for x in up.state_tensors()))
        out[k + ".metric"] = float("kl_ref" in m)
    # and a KL run allocates its frozen copy's buffers up front (a checkpoint load needs the keys)
    up = RLUpdater(_model(cfg), rl_cfg("dppo_tv", kl=(0.1, "k3")), tsp=2, dp=1)
    st = up.state_tensors()
    out["kl.on.keys"] = float(sum(x.startswith("kl_ref.tsp") for x in st))
    out["kl.on.shards"] = float(len(up.shards))
    out["kl.on.taken"] = float(up.ref_taken)
    # bf16 compute copy: the reference is kept in bf16 too, and the KL moves off 0 after the first step
    up = RLUpdater(_model(cfg), rl_cfg("dppo_tv", kl=(0.5, "k3"), dtype="bfloat16"), tsp=2, dp=1)
    m = [up.step(make_batch(s, cfg), s) for s in range(2)]
    out["kl.bf16.ref_dtypes"] = float(all(v.dtype == torch.bfloat16 for v in up.ref.values()))
    out["kl.bf16.kl_ref"] = m[1]["kl_ref"]


def _check_kl_zaya(world, out, shared):
    """ZAYA1 with the policy's own routing (no replay) and a KL penalty to the starting policy: the frozen reference
    routes with its own balancing biases, as the single-process trainer's deep copy does (it took the policy's
    current biases: kl_ref and the weights differed from one process by 1e-3 once the first step moved them),
    through a checkpoint between the two steps."""
    import tempfile

    import torch.distributed as dist

    from train.parallel.rl_update import RLUpdater
    from train.rl.worker import load_checkpoint, save_checkpoint

    cfg = _zaya_cfg()
    rcfg = rl_cfg("dppo_tv", kl=(0.5, "k3"))
    batches = [make_batch(s, cfg) for s in range(2)]
    for b in batches:
        for smp in b.samples:
            smp.routed_experts = None
    want, ref_m = _kl_reference_run(_model(cfg), rcfg, batches, _model(cfg))
    for dp, tsp in ((2, 1), (1, 2)):
        k = f"kl.zaya.dp{dp}xtsp{tsp}"
        up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
        mets = [up.step(batches[0], 0)]
        box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        save_checkpoint(up, Path(box[0]), 1, keep=2)
        up = RLUpdater(_model(cfg), rcfg, tsp=tsp, dp=dp)
        load_checkpoint(up, Path(box[0]))
        mets.append(up.step(batches[1], 1))
        out[k + ".params"] = _err(up.full_state_dict(), want)
        out[k + ".kl_ref"] = max(abs(m["kl_ref"] - r["kl_ref"]) for m, r in zip(mets, ref_m))
    out["kl.zaya.kl_ref_step1"] = ref_m[1]["kl_ref"]


def _kl_worker(rank, world, port, path, shared):
    import functools

    run_checks(rank, world, port, path, [functools.partial(f, shared=shared) for f in
                                         (_check_kl_off, _check_kl_fresh, _check_kl_hf_reference,
                                          _check_kl_after_sft_and_resume, _check_kl_zaya)])


@pytest.fixture(scope="module")
def kl_results(tmp_path_factory):
    ranks = spawn(2, _kl_worker, str(tmp_path_factory.mktemp("kl")))
    for r in ranks:
        assert "error" not in r, r.get("trace")
    return ranks


@pytest.mark.timeout(400)
def test_kl_sharded_equals_single_process_from_the_start(kl_results):
    ranks = kl_results
    for name, kind, _ in KL_CASES:
        key = f"kl.fresh.{name}.{kind}"
        assert _max(ranks, key + ".kl_effect") > 100 * TOL, key  # the KL term changed the weights
        if kind == "k3":  # the policy moved away from its reference in the first step
            assert _max(ranks, key + ".kl_ref_step1") > 0, key
        for mesh in ("dp1xtsp2", "dp2xtsp1"):
            for what in ("params", "loss", "kl_ref"):
                k = f"{key}.{mesh}.{what}"
                assert _max(ranks, k) < TOL, (k, _max(ranks, k))
        assert _max(ranks, f"{key}.dp2xtsp1.micro") >= 2  # several packed micro-batches


@pytest.mark.timeout(400)
def test_kl_reference_of_a_zaya_policy_routes_with_its_own_biases(kl_results):
    ranks = kl_results
    assert _max(ranks, "kl.zaya.kl_ref_step1") > 1e-4  # (the policy moved from its reference)
    for mesh in ("dp2xtsp1", "dp1xtsp2"):
        for what in ("params", "kl_ref"):
            k = f"kl.zaya.{mesh}.{what}"
            assert _max(ranks, k) < TOL, (k, _max(ranks, k))


@pytest.mark.timeout(400)
def test_kl_reference_checkpoint_sharded_like_the_policy(kl_results):
    ranks = kl_results
    for name in ("moe", "dense"):
        key = f"kl.hf.{name}"
        assert _max(ranks, key + ".ref_matters") > 100 * TOL and _max(ranks, key + ".kl_ref_step0") > 1e-3
        for mesh in ("dp1xtsp2", "dp2xtsp1"):
            for what in ("params", "kl_ref"):
                k = f"{key}.{mesh}.{what}"
                assert _max(ranks, k) < TOL, (k, _max(ranks, k))
            assert _max(ranks, f"{key}.{mesh}.saved_keys") == 0  # the directory is the reference: not checkpointed


@pytest.mark.timeout(400)
def test_kl_reference_is_the_post_sft_policy_and_survives_resume(kl_results):
    ranks = kl_results
    assert _max(ranks, "kl.sft.ref_start_matters") > 100 * TOL
    assert _max(ranks, "kl.sft.ref_mid_matters") > 100 * TOL
    assert [r["kl.sft.resume1.step"] for r in ranks] == [2.0, 2.0]
    assert [r["kl.sft.resume2.step"] for r in ranks] == [3.0, 3.0]
    assert _max(ranks, "kl.sft.resume1.taken") == 0.0 and min(r["kl.sft.resume2.taken"] for r in ranks) == 1.0
    for mesh in ("dp2xtsp1", "dp1xtsp2"):
        for what in ("params", "kl_ref"):
            k = f"kl.sft.{mesh}.{what}"
            assert _max(ranks, k) < TOL, (k, _max(ranks, k))


@pytest.mark.timeout(400)
def test_kl_off_allocates_no_reference(kl_results):
    ranks = kl_results
    for mesh in ("dp1xtsp2", "dp2xtsp1"):
        k = f"kl.off.{mesh}"
        assert min(r[k + ".ref_none"] for r in ranks) == 1.0
        assert _max(ranks, k + ".keys") == 0 and _max(ranks, k + ".metric") == 0
    assert min(r["kl.on.keys"] for r in ranks) == ranks[0]["kl.on.shards"] > 0
    assert _max(ranks, "kl.on.taken") == 0.0
    assert min(r["kl.bf16.ref_dtypes"] for r in ranks) == 1.0 and 0 < _max(ranks, "kl.bf16.kl_ref") < 1


# ------------------------------------------------------------------------------ torchrun worker


def _start_worker(exchange: Path, model_dir: Path, steps: int, tsp: int, dp: int, extra=(), rcfg=None):
    from train.rl.worker import config_dict, launch_command

    cfg_path = exchange.parent / "rl.json"
    cfg_path.write_text(json.dumps(config_dict(rcfg or rl_cfg("dppo_tv"))))
    cmd = launch_command(exchange, model_dir, tsp * dp, steps, cfg_path, tsp=tsp, port=free_port(),
                         extra=["--dp", str(dp), "--sync-every", "1", "--poll", "0.02", "--max-wait", "150",
                                *extra])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = open(exchange.parent / f"worker-{time.time_ns()}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def _finish(proc, log, timeout=200):
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        log.close()
    assert rc == 0, Path(log.name).read_text()[-4000:]


def _wait_for(path: Path, proc, timeout=150):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"worker exited early ({proc.returncode})"
        assert time.time() - t0 < timeout, f"timed out waiting for {path}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def worker_setup(tmp_path_factory):
    """A tiny MoE checkpoint, three batches, and the reference weights after each step."""
    from train.model.hf_io import save_pretrained

    root = tmp_path_factory.mktemp("rlworker")
    cfg = _cfgs()["moe"]
    save_pretrained(_model(cfg), root / "init")
    batches = [make_batch(s, cfg) for s in range(3)]
    refs = [reference_weights(cfg, rl_cfg("dppo_tv"), batches[:k])[0] for k in (1, 3)]
    return root, batches, refs


def _max_err(got: dict, want: dict) -> float:
    assert set(got) == set(want), set(got) ^ set(want)
    return max((got[k].float() - want[k]).abs().max().item() for k in want)


def _final_weights(exchange: Path) -> dict:
    from train.model.hf_io import load_pretrained

    assert (exchange / "final" / "COMPLETE").exists()
    return load_pretrained(exchange / "final").state_dict()


@pytest.mark.timeout(300)
def test_torchrun_worker_consumes_batches_and_publishes(worker_setup):
    """DP 2 x TSP 1: three batches written while the worker runs; versions, metrics and final
    weights equal the single-process reference."""
    from train.rl.exchange import complete_versions, load_version, write_batch

    root, batches, (ref1, ref3) = worker_setup
    ex = root / "run_a" / "exchange"
    ex.mkdir(parents=True)
    proc, log = _start_worker(ex, root / "init", 3, tsp=1, dp=2)
    try:
        for b in batches:
            write_batch(ex, b)
            time.sleep(0.2)
    finally:
        _finish(proc, log)
    assert complete_versions(ex) == [1, 2, 3]
    metrics = [json.loads((ex / "metrics" / f"step-{i:06d}.json").read_text()) for i in range(3)]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["grad_norm"] > 0 and "clip_frac" in m and "entropy" in m for m in metrics)
    assert _max_err(load_version(ex, 1)[1], ref1) < TOL
    assert _max_err(load_version(ex, 3)[1], ref3) < TOL
    assert _max_err(_final_weights(ex), ref3) < TOL


@pytest.mark.timeout(400)
def test_torchrun_worker_resumes_after_kill(worker_setup):
    """TSP 2: killed with SIGKILL after the checkpoint of step 2, restarted, it resumes there and ends
    with the weights of an uninterrupted run (the reference); STOP ends a worker early."""
    from train.rl.exchange import write_batch

    root, batches, (ref1, ref3) = worker_setup
    ex = root / "run_b" / "exchange"
    ex.mkdir(parents=True)
    proc, log = _start_worker(ex, root / "init", 3, tsp=2, dp=1, extra=["--checkpoint-every", "1"])
    try:
        write_batch(ex, batches[0])
        write_batch(ex, batches[1])
        _wait_for(ex / "trainer_ckpt" / "step-000002" / "COMPLETE", proc)
    finally:
        kill_tree(proc.pid)  # the agent and every rank, like a lost node
        proc.wait()
        log.close()
    time.sleep(0.5)  # the killed ranks' processes are reaped
    assert not (ex / "final").exists()
    write_batch(ex, batches[2])
    proc, log = _start_worker(ex, root / "init", 3, tsp=2, dp=1, extra=["--checkpoint-every", "1"])
    _finish(proc, log)
    text = Path(log.name).read_text()
    assert '"worker": "start", "step": 2' in text, text[-3000:]
    assert not (ex / "metrics" / "step-000003.json").exists()
    assert _max_err(_final_weights(ex), ref3) < TOL
    # STOP: a worker asked for more steps than there are batches ends cleanly at once
    (ex / "STOP").write_text("")
    proc, log = _start_worker(ex, root / "init", 10, tsp=2, dp=1)
    _finish(proc, log)
    assert _max_err(_final_weights(ex), ref3) < TOL


@pytest.mark.timeout(500)
def test_torchrun_worker_resumes_on_another_mesh(worker_setup):
    """A run checkpointed on DP 2 x TSP 1 resumes on TSP 2 (with a frozen KL reference, resharded
    too), one checkpointed on TSP 2 resumes on DP 2: each rank rebuilds its shards and optimizer
    slice from the checkpoint's layout, and both end with the uninterrupted reference's weights. A
    checkpoint that records no layout (an older one) is refused on another TSP degree, in one line."""
    from train.rl.worker import CKPT_DIR
    from train.rl.exchange import write_batch

    root, batches, (_, ref3) = worker_setup
    kl = rl_cfg("dppo_tv", kl=(20.0, "k3"))
    cfg = _cfgs()["moe"]
    ref_kl = _kl_reference_run(_model(cfg), kl, batches, _model(cfg))[0]  # KL to the starting policy
    assert _max_err(ref_kl, ref3) > 100 * TOL  # the KL term (so its reference) matters
    for (t0, d0), (t1, d1), rcfg, want in (((1, 2), (2, 1), kl, ref_kl), ((2, 1), (1, 2), None, ref3)):
        ex = root / f"run_tsp{t0}dp{d0}to{t1}dp{d1}" / "exchange"
        ex.mkdir(parents=True)
        for b in batches:
            write_batch(ex, b)
        proc, log = _start_worker(ex, root / "init", 2, tsp=t0, dp=d0, extra=["--checkpoint-every", "1"], rcfg=rcfg)
        _finish(proc, log)
        proc, log = _start_worker(ex, root / "init", 3, tsp=t1, dp=d1, extra=["--checkpoint-every", "1"], rcfg=rcfg)
        _finish(proc, log)
        text = Path(log.name).read_text()
        assert '"worker": "start", "step": 2' in text, text[-3000:]
        assert _max_err(_final_weights(ex), want) < TOL, (t0, d0, t1, d1)
    meta_path = ex / CKPT_DIR / "step-000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert [len(lay) for lay in meta["layout"]] == [len(dict(_model(cfg).named_parameters()))]  # every parameter
    del meta["layout"]
    meta_path.write_text(json.dumps(meta))
    proc, log = _start_worker(ex, root / "init", 4, tsp=2, dp=1)
    assert proc.wait(timeout=300) != 0
    log.close()
    assert "records no parameter layout, so it resumes only on its TSP degree: set trainer.tsp=1" in \
        Path(log.name).read_text()


def _check_reordered_resume(world, out, shared):
    """One rank: a checkpoint written with AdamW resumed by a Muon updater (its flat optimizer vector
    orders the parameters otherwise): every parameter's master weights, moments and weights land
    under its name; the same updater type loads directly."""
    from tests.test_muon import _muon_rl_cfg
    from train.rl.worker import load_checkpoint, save_checkpoint
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["moe"]
    ex = Path(shared) / "reorder"
    adam = RLUpdater(_model(cfg), rl_cfg("dppo_tv"))
    for i in range(2):
        adam.step(make_batch(i, cfg), i)
    save_checkpoint(adam, ex, 2, keep=1)

    def by_name(up):
        out, off = {}, 0
        st = up.opt.state_tensors()
        for name, shape, _ in up.layout():
            n = math.prod(shape)
            out[name] = {k: st[k][off:off + n].clone() for k in ("master", "exp_avg", "exp_avg_sq")}
            out[name]["weight"] = up.shards[name].detach().reshape(-1).float().clone()
            off += n
        return out

    want = by_name(adam)
    for kind, rcfg in (("muon", _muon_rl_cfg(0.9)), ("adamw", rl_cfg("dppo_tv"))):
        up = RLUpdater(_model(cfg), rcfg)
        out[f"reorder.{kind}.differs"] = float(up.layout() != adam.layout())
        out[f"reorder.{kind}.step"] = float(load_checkpoint(up, ex))
        got = by_name(up)
        out[f"reorder.{kind}.err"] = max((got[n][k] - want[n][k]).abs().max().item() for n in want for k in want[n])
        out[f"reorder.{kind}.steps"] = float(up.opt.steps)


@contextmanager
def host_reads():
    """Count the reads of tensor values into Python (``float()``, ``int()``, ``bool()``, ``.item()``,
    ``.tolist()``, ``.numpy()``...) inside the block: on a GPU each waits for the device's queue."""
    names = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy")
    n, orig = [0], {k: getattr(torch.Tensor, k) for k in names}

    def spy(k):
        def read(self, *a, **kw):
            n[0] += 1
            return orig[k](self, *a, **kw)
        return read

    for k in names:
        setattr(torch.Tensor, k, spy(k))
    try:
        yield n
    finally:
        for k in names:
            setattr(torch.Tensor, k, orig[k])


def _check_host_reads(world, out):
    """One rank, a dense policy: an RL step's reads of tensor values into Python do not grow with its
    micro-batches (the loss metrics stay on the device until one read at the end of the step)."""
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["dense"]
    for tpm in (10_000, 12):
        up = RLUpdater(_model(cfg), rl_cfg("dppo_tv", tokens_per_micro=tpm))
        up.step(make_batch(0, cfg), 0)
        batch = make_batch(1, cfg)
        with host_reads() as n:
            m = up.step(batch, 1)
        out[f"reads.{tpm}"], out[f"reads.{tpm}.micro"] = float(n[0]), m["micro_batches_max"]


def _check_mixed_routing(world, out):
    """A batch where one trained sample carries no routed experts: refused before any packing (it was checked per
    micro-batch: refused or not depending on the packing, and on one data-parallel rank but not another)."""
    from train.parallel.rl_update import RLUpdater

    cfg = _cfgs()["moe"]
    up = RLUpdater(_model(cfg), rl_cfg("dppo_tv", tokens_per_micro=1))
    batch = make_batch(0, cfg)
    batch.samples[0].routed_experts = None
    try:
        up.step(batch, 0)
        out["mixed.refused"] = 0.0
    except ValueError as e:
        out["mixed.refused"] = float("replay needs all or none" in str(e))


def _one_rank_worker(rank, world, port, path, shared):
    run_checks(rank, world, port, path, [lambda w, o: _check_reordered_resume(w, o, shared), _check_host_reads,
                                         _check_mixed_routing])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    r = spawn(1, _one_rank_worker, str(tmp_path_factory.mktemp("one_rank")))[0]
    assert "error" not in r, r.get("trace")
    return r


def test_host_reads_per_step_do_not_grow_with_micro_batches(one_rank):
    r = one_rank
    assert r["reads.10000.micro"] == 1 and r["reads.12.micro"] >= 4
    # (the reads left: the optimizer's grad norm and step count, all_gather_object's sizes, the metrics' one copy)
    assert r["reads.12"] == r["reads.10000"], r


def test_a_batch_mixing_replayed_and_unreplayed_samples_is_refused_whatever_the_packing(one_rank):
    assert one_rank["mixed.refused"] == 1.0


def test_resume_with_another_parameter_order(one_rank):
    r = one_rank
    assert r["reorder.muon.differs"] == 1.0 and r["reorder.adamw.differs"] == 0.0
    for kind in ("muon", "adamw"):
        assert r[f"reorder.{kind}.step"] == 2.0 and r[f"reorder.{kind}.steps"] == 2.0
        assert r[f"reorder.{kind}.err"] == 0.0, (kind, r[f"reorder.{kind}.err"])


# ------------------------------------------------------------------------------ plain functions


def test_dp_split_balances_tokens():
    from train.rl.packing import balance_across_ranks

    lengths = [30, 5, 12, 12, 7, 20, 3, 9]
    bins = balance_across_ranks(lengths, 2)
    assert sorted(i for b in bins for i in b) == list(range(8))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths[i] for i in range(8) if lengths[i] <= 12)


def test_worker_config_file_and_command(tmp_path):
    from train.parallel.rl_update import RLUpdateConfig
    from train.rl.worker import config_dict, launch_command, load_config

    path = tmp_path / "rl.json"
    path.write_text(json.dumps(config_dict(RLUpdateConfig(loss="gspo", tokens_per_micro=123))))
    cfg = load_config(path, {"optim.lr": 3e-4, "dtype": "bfloat16", "loss": None})
    assert (cfg.loss, cfg.tokens_per_micro, cfg.optim.lr, cfg.dtype) == ("gspo", 123, 3e-4, "bfloat16")
    yml = tmp_path / "rl.yaml"
    yml.write_text("loss: cispo\nloss_cfg: {cispo_clip_high: 2.0}\noptim: {lr: 1.0e-6, warmup_steps: 3}\n")
    cfg = load_config(yml, {})
    assert (cfg.loss, cfg.loss_cfg.cispo_clip_high, cfg.optim.warmup_steps) == ("cispo", 2.0, 3)
    from train.rl.losses import LossConfig

    path.write_text(json.dumps(config_dict(RLUpdateConfig(loss_cfg=LossConfig(kl_coef=0.1, kl_type="k1"),
                                                          kl_reference="/ref/dir"))))
    cfg = load_config(path, {})
    assert (cfg.loss_cfg.kl_coef, cfg.loss_cfg.kl_type, cfg.kl_reference) == (0.1, "k1", "/ref/dir")
    path.write_text(json.dumps({"los": "gspo"}))
    with pytest.raises(ValueError, match="unknown config keys \\['los'\\]"):
        load_config(path, {})
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; choose one of"):
        load_config(None, {"loss": "nope"})
    cmd = launch_command("EX", "CKPT", 4, 7, path, tsp=2, port=29555, extra=["--dp", "2"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[cmd.index("--master-port") + 1] == "29555"
    tail = cmd[cmd.index("train.rl.worker") + 1:]
    assert tail == ["--exchange", "EX", "--model", "CKPT", "--steps", "7", "--tsp", "2", "--config", str(path),
                    "--dp", "2"]


def test_the_ranks_tell_a_dead_orchestrator_also_as_a_zombie_or_by_a_reused_pid():
    """The ranks stop when the orchestrator has died: no such pid, a zombie (killed, its parent has not
    reaped it yet: kill(pid, 0) still succeeds), or a process that took its pid later (another start
    time). A live orchestrator, or one on another host, is not gone."""
    import signal
    import socket

    from tests.conftest import alive
    from train.rl.worker import _gone, process_start

    me, host = os.getpid(), socket.gethostname()
    assert not _gone(me, host, process_start()) and not _gone(me, "another-host", "0")
    assert _gone(me, host, str(int(process_start()) + 1))  # same pid, another process
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = process_start(child.pid)
        assert start is not None and not _gone(child.pid, host, start)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(child.pid):  # until it is a zombie (not reaped: this test is its parent)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _gone(child.pid, host, start) and _gone(child.pid)  # a zombie
    finally:
        child.wait()
    assert _gone(child.pid, host, start)  # reaped: no such pid


def test_a_second_checkpoint_request_for_a_checkpointed_update_keeps_it(tmp_path, monkeypatch):
    """--checkpoint-every had saved update 2, then the learner asked for update 2 again: the complete checkpoint was
    removed before the re-save, and a crash during it left no checkpoint to resume from (keep=1 had pruned the
    one before)."""
    import torch.distributed.checkpoint as dcp

    from train.parallel.rl_update import RLUpdater
    from train.rl.worker import complete_checkpoints, save_checkpoint

    with world_of_one(tmp_path):
        cfg = _cfgs()["dense"]
        up = RLUpdater(_model(cfg), rl_cfg("dppo_tv"))
        ex = tmp_path / "exchange"
        for step in (1, 2):
            up.step(make_batch(step - 1, cfg), step - 1)
            save_checkpoint(up, ex, step, keep=1)
        monkeypatch.setattr(dcp, "save", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("killed mid-save")))
        save_checkpoint(up, ex, 2, keep=1)
        assert complete_checkpoints(ex) == [2]


def test_updater_metrics_cover_the_trained_rollouts_and_sft_ignores_the_temperature(tmp_path):
    """One rank: ``entropy`` is the token mean over the completion tokens of the trained rollouts (the policy before
    the step, at the batch's temperature) and ``advantage_abs_mean`` the mean |advantage| of those rollouts (the
    dropped one left out); an SFT batch's loss is the mean NLL of the response tokens at temperature 1, whatever
    the batch's temperature, over the batch's tokens (not its sequences, whatever the RL loss aggregates)."""
    import copy

    from train.parallel.rl_update import RLUpdater
    from train.rl.exchange import TrainBatch, TrainSample

    cfg = _cfgs()["dense"]
    batch = make_batch(0, cfg, temperature=0.7)
    batch.samples[5].advantage = 40.0  # (a large |advantage| on a trained rollout, 0 on the dropped one)
    batch.samples[3].advantage = 0.0
    trained = [s for s in batch.samples if s.trained]
    assert len(trained) == len(batch.samples) - 1
    before = _model(cfg)
    ents, nll, count = [], 0.0, 0
    with torch.no_grad():
        for s in trained:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            P, C = len(s.prompt_ids), len(s.completion_ids)
            logits = before(ids)[0, P - 1:P + C - 1]
            lp = torch.log_softmax(logits / 0.7, -1)
            ents += (-(lp.exp() * lp).sum(-1)).tolist()
            lp1 = torch.log_softmax(logits, -1).gather(-1, ids[0, P:, None])
            nll, count = nll - lp1.sum().item(), count + C
    with world_of_one(tmp_path):
        m = RLUpdater(copy.deepcopy(before), rl_cfg("dppo_tv")).step(batch, 0)
        sft = TrainBatch(0, [TrainSample(s.prompt_ids, s.completion_ids, [0.0] * len(s.completion_ids), 0.0)
                             for s in trained], 0.5, {"kind": "sft"})
        m_sft = RLUpdater(copy.deepcopy(before), rl_cfg("gspo")).step(sft, 0)
    assert abs(m["entropy"] - sum(ents) / len(ents)) < 1e-5, (m["entropy"], sum(ents) / len(ents))
    assert abs(m["advantage_abs_mean"] - sum(abs(s.advantage) for s in trained) / len(trained)) < 1e-6
    assert abs(m_sft["sft_loss"] - nll / count) < 1e-5, (m_sft["sft_loss"], nll / count)
    assert m_sft["tokens"] == count


def test_updater_refuses_an_unknown_batch_kind_and_a_gather_to_another_rank(tmp_path):
    from train.parallel.rl_update import RLUpdater
    from train.rl.exchange import TrainBatch

    cfg = _cfgs()["dense"]
    with world_of_one(tmp_path):
        up = RLUpdater(_model(cfg), rl_cfg("dppo_tv"))
        b = make_batch(0, cfg)
        with pytest.raises(ValueError, match="unknown batch kind 'eval'; expected 'rl' or 'sft'"):
            up.step(TrainBatch(0, b.samples, b.temperature, {"kind": "eval"}), 0)
        with pytest.raises(ValueError, match="gathers to rank 0 or to every rank, not to rank 1"):
            up.full_state_dict(dst=1)
        assert up.opt.steps == 0 and set(up.full_state_dict(dst=0)) == set(_model(cfg).state_dict())
