"""PipelineRL (train/rl/pipeline.py) and the off-policy correction of the RL update.

Reuses the warm-started tiny dense policy of tests/test_rl_loop.py (SFT on toy/max), so groups
have mixed rewards and every update moves the weights.
"""
from __future__ import annotations

import time

import pytest
import torch

from envs.base import Problem, Score
from tests.test_rl_loop import make_trainer, one_thread  # noqa: F401 (fixture)
from train.engine.base import Completion
from train.optim import OptimConfig
from train.rl.pipeline import _GROUPS, Pipeline, RolloutBuffer
from train.rl.trainer import Group, RLConfig, Rollout, group_version, version_lag

SHARED = ("reward_mean", "accuracy", "format_ok", "response_len", "groups_sampled", "groups_dropped",
          "groups_trained", "loss", "entropy", "grad_norm", "mismatch_kl", "version_lag_mean", "version_lag_max",
          "difficulty")


def run_pipeline(rl, steps: int) -> list[dict]:
    pipe = Pipeline(rl)
    try:
        return [pipe.step() for _ in range(steps)]
    finally:
        pipe.close()


def _params(rl):
    return {k: v.detach().clone() for k, v in rl.policy.state_dict().items()}


def test_max_staleness_zero_is_the_synchronous_loop(warm):
    sync = make_trainer(warm, seed=3)
    want = [sync.step() for _ in range(3)]
    rl = make_trainer(warm, seed=3)
    got = run_pipeline(rl, 3)
    for w, g in zip(want, got):
        assert {k: w.get(k) for k in SHARED} == {k: g.get(k) for k in SHARED}
        assert g["groups_dropped_stale"] == 0 and g["version_lag_max"] == 0
    for k, v in _params(sync).items():
        torch.testing.assert_close(_params(rl)[k], v, rtol=0, atol=0)


def test_bounded_staleness_overlaps_and_never_trains_older_groups(warm):
    rl = make_trainer(warm, seed=4, max_staleness=2, min_ready_batches=2, sync_every=1)
    trained = []  # (trainer version, oldest version of each group) at every update
    update = rl.update

    def spy(groups):
        trained.append((rl.step_idx, [group_version(g) for g in groups]))
        return update(groups)

    rl.update = spy
    ms = run_pipeline(rl, 6)
    assert all(v - gv <= 2 for v, gvs in trained for gv in gvs)
    assert all(m["version_lag_max"] <= 2 for m in ms)
    assert max(m["version_lag_max"] for m in ms) >= 1  # the producer ran ahead of the trainer
    assert all(0.0 <= m["buffer_fill"] <= 1.0 for m in ms)
    assert all(len(m["version_lag_hist"]) == m["version_lag_max"] + 1 for m in ms)
    assert rl.step_idx == 6


def test_each_batch_is_sampled_under_its_own_steps_settings_and_none_past_the_last(warm):
    """before_batch(k) runs before the batch the k-th step trains on is sampled (a stage's phase mix and response
    cap: the producer runs ahead, so setting them when the step starts came k steps late), and with ``batches``
    no batch is made that no step trains on (closing then waits for none; the last step does not wait for
    min_ready_batches)."""
    rl = make_trainer(warm, seed=4, max_staleness=2, min_ready_batches=2, sync_every=1)
    seen, caps = [], []

    def before(k):
        seen.append(k)
        rl.cfg.sampling.max_new_tokens = 6 + k  # what the batch's responses are capped at
        return {"mix_phase": k}

    pipe = Pipeline(rl, before_batch=before, batches=4)
    try:
        for _ in range(4):
            m = pipe.step()
            caps.append((m["mix_phase"], m["response_len"]))
        time.sleep(0.3)  # (a fifth batch, were one allowed, would start now)
    finally:
        t = time.perf_counter()
        pipe.close()
    assert seen == [0, 1, 2, 3] and pipe._produced == 4 and time.perf_counter() - t < 1.0
    assert [k for k, _ in caps] == [0, 1, 2, 3] and all(n <= 6 + k for k, n in caps)


def test_every_evicted_group_is_counted_in_some_steps_metrics(warm):
    """A buffer of one batch while the producer runs two ahead: groups are evicted while the trainer
    waits as well as while it updates; the per-step counts add up to the buffer's (they missed the
    first kind). A buffer smaller than a batch is refused."""
    rl = make_trainer(warm, seed=5, max_staleness=2, min_ready_batches=1, sync_every=1, buffer_groups=8)
    pipe = Pipeline(rl)
    try:
        ms = [pipe.step() for _ in range(4)]
        time.sleep(0.5)  # the producer fills (and evicts) before the next step, while nothing is reported
        ms.append(pipe.step())
        with pipe.paused():
            total = pipe.buffer.evicted
    finally:
        pipe.close()
    counted = sum(m["groups_evicted"] for m in ms)
    assert counted == pipe._reported[1] > 0 and total >= counted  # all up to the last step's metrics
    with pytest.raises(ValueError, match="holds less than one batch"):
        RLConfig(prompts_per_step=8, buffer_groups=4)


def test_checkpointed_buffer_resumes_with_the_waiting_groups(warm, tmp_path):
    """A checkpoint taken inside ``paused()`` holds the groups produced and not yet trained on; a
    pipeline started from it (after a torch.save / torch.load round trip, as cascade's checkpoints do)
    trains exactly those groups first, in order, with their versions and rollout metrics."""
    kw = dict(seed=6, max_staleness=2, min_ready_batches=2, sync_every=1)
    rl = make_trainer(warm, **kw)
    pipe = Pipeline(rl)
    try:
        for _ in range(2):
            pipe.step()
        with pipe.paused():
            torch.save({"pipeline": pipe.state(), "rl": rl.state_dict(), "policy": _params(rl)}, tmp_path / "ck.pt")
    finally:
        pipe.close()
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    st = ck["pipeline"]
    assert st["ahead"] >= 1 and len(st["pending"]) == st["ahead"] and len(st["queue"]) >= rl.cfg.prompts_per_step
    waiting = [(v, g.problem.prompt, [r.completion.token_ids for r in g.rollouts])
               for (v, g), b in zip(st["queue"], st["queue_batches"]) if b == 0]  # the next step's batch

    again = make_trainer(warm, **kw)
    again.policy.load_state_dict(ck["policy"])
    again.load_state_dict(ck["rl"])
    again.sync_weights()
    trained = []
    update = again.update

    def spy(groups):
        trained.append([(group_version(g), g.problem.prompt, [r.completion.token_ids for r in g.rollouts])
                        for g in groups])
        return update(groups)

    again.update = spy
    pipe = Pipeline(again, st)
    try:
        m = pipe.step()
    finally:
        pipe.close()
    assert again.step_idx == 3 and m["step"] == 2
    assert trained[0] == waiting and trained[0]  # the oldest batch's groups
    assert m["groups_sampled"] == st["pending"][0]["groups_sampled"]


def test_rollout_and_update_threads_are_split_on_cpu(warm):
    """With the engine and the update in this process, the rollout thread and the update each run on
    their share of torch's intra-op threads (default half each; rl.rollout_threads sets the rollout's),
    restored when the pipeline closes; max_staleness 0 (nothing overlaps) keeps them all."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for overrides, want in (({}, (2, 2)), (dict(rollout_threads=1), (1, 3)), (dict(rollout_threads=4), (4, 4)),
                                (dict(max_staleness=0), (4, 4))):
            kw = {**dict(max_staleness=1, min_ready_batches=1, sync_every=1), **overrides}
            rl = make_trainer(warm, seed=5, **kw)
            seen = {"rollout": set(), "update": set()}
            rl.engine.step_hook = lambda step: seen["rollout"].add(torch.get_num_threads())
            update = rl.update

            def spy(groups, update=update, seen=seen):
                seen["update"].add(torch.get_num_threads())
                return update(groups)

            rl.update = spy
            run_pipeline(rl, 2)
            assert seen["rollout"] == {want[0]}, overrides
            assert seen["update"] and seen["update"] <= {want[1], 4}, overrides  # 4: borrowed (below)
            assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(n)
    with pytest.raises(ValueError, match="rollout_threads"):
        RLConfig(rollout_threads=-1)


def test_update_borrows_the_producers_threads_while_it_waits(warm):
    """While the producer waits (as far ahead as staleness allows), every chunk of the update (forward,
    backward, optimizer step) runs on all of torch's threads; when the producer generates, on the
    update's share."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        rl = make_trainer(warm, seed=5, max_staleness=1, min_ready_batches=1, sync_every=1)
        pipe = Pipeline(rl)
        try:
            seen, lend = [], rl.between_kernels
            rl.between_kernels = lambda: (lend(), seen.append(torch.get_num_threads()))
            t0 = time.monotonic()
            while not pipe._idle.is_set():  # two batches made: it waits for the trainer's first step
                assert time.monotonic() - t0 < 120
                time.sleep(0.01)
            pipe.step()  # the producer cannot start another batch before this step ends
            assert len(seen) >= 3 and set(seen) == {4}, seen
            assert pipe.lent == len(seen)
            with pipe.buffer.cond:  # (the producer marks itself idle only under this lock)
                pipe._idle.clear()
                lend()
                assert torch.get_num_threads() == 2
        finally:
            pipe.close()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(n)


def test_sync_every_must_fit_the_staleness_bound():
    with pytest.raises(ValueError, match="max_staleness"):
        RLConfig(max_staleness=1, sync_every=3)
    with pytest.raises(ValueError, match="ratio_against"):
        RLConfig(ratio_against="nope")


def _group(version: int, tag: int) -> Group:
    p = Problem(prompt=str(tag), answer="0")
    c = Completion([1, 2], "x", [-0.1, -0.2], "stop", versions=[version, version + 1])
    return Group("toy/max", p, [Rollout("toy/max", p, [5], c, Score.zero(""))])


def test_buffer_evicts_oldest_and_drops_stale():
    buf = RolloutBuffer(capacity=3)
    buf.put([_group(v, v) for v in range(5)])  # versions 0..4: 0 and 1 evicted
    assert buf.evicted == 2 and len(buf) == 3
    buf.put([_group(5, "next")], batch=1)  # the next batch's: the oldest (version 2) evicted
    got = buf.take(0, version=5, max_staleness=1)  # version 3 is 2 behind: dropped
    assert [g.problem.prompt for g in got] == ["4"] and buf.dropped_stale == 1
    assert [g.problem.prompt for g in buf.take(1, version=5, max_staleness=1)] == ["next"] and len(buf) == 0


def test_version_lag_histogram():
    m = version_lag([_group(3, 0), _group(4, 1)], 5)  # token versions 3,4,4,5 at trainer version 5
    assert m["version_lag_max"] == 2 and m["version_lag_mean"] == pytest.approx(1.0)
    assert m["version_lag_hist"] == [0.25, 0.5, 0.25]
    old = _group(0, 2)
    old.rollouts[0].keep = False  # overlong-filtered: not trained on, so no lag of the trained tokens
    assert version_lag([_group(3, 0), _group(4, 1), old], 5) == m


def test_a_groups_version_is_its_oldest_token_and_a_batch_without_trained_tokens_has_no_lag():
    """A group is as stale as the oldest token any of its rollouts sampled (a rollout of versions 5, 6 beside one of
    3, 4: version 3, and dropped as stale by a trainer at 6 with max_staleness 2); a batch with no trained token
    reports lag 0 with all of it at lag 0."""
    g = _group(5, 0)
    g.rollouts += _group(3, 1).rollouts
    assert group_version(g) == 3
    buf = RolloutBuffer(4)
    buf.put([g, _group(5, 2)], batch=0)
    assert [x.problem.prompt for x in buf.take(0, version=6, max_staleness=2)] == ["2"] and buf.dropped_stale == 1
    dropped = _group(1, 3)
    dropped.rollouts[0].keep = False
    assert version_lag([dropped], 6) == {"version_lag_mean": 0.0, "version_lag_max": 0, "version_lag_hist": [1.0]}


def test_ratio_is_taken_against_behaviour_logprobs(warm):
    """Rollouts whose recorded log-probs are 0.1 below the trainer's: the ratio is exp(0.1), not 1,
    and the mismatch shows; with ratio_against=recompute the ratio is 1 and tis corrects instead."""
    for mode, want_ratio in (("behaviour", float(torch.tensor(0.1).exp())), ("recompute", 1.0)):
        rl = make_trainer(warm, seed=5, ratio_against=mode, optim=OptimConfig(lr=0.0))
        groups, _ = rl.collect()
        for g in groups:
            for r in g.rollouts:
                r.completion.logprobs = [x - 0.1 for x in r.completion.logprobs]
        m = rl.update(groups)
        assert m["ratio_mean"] == pytest.approx(want_ratio, rel=1e-3)
        assert m["mismatch_kl"] == pytest.approx(float(torch.tensor(0.1).exp() - 1 - 0.1), rel=2e-2)


def test_mismatch_covers_every_mini_batch(warm):
    """With ``updates_per_batch=2`` the behaviour mismatch was taken in the first mini-batch only: rollouts of the
    second half whose recorded log-probs sit 0.3 below the trainer's did not show (mismatch_kl ~0)."""
    from train.rl.trainer import trained

    rl = make_trainer(warm, seed=5, updates_per_batch=2, dynamic_sampling=False, optim=OptimConfig(lr=0.0))
    groups, _ = rl.collect()
    rolls = [r for g in groups for r in g.rollouts]
    half = (len(rolls) + 1) // 2  # the second mini-batch's rollouts (even_slices: the first takes the extra one)
    for r in rolls[half:]:
        r.completion.logprobs = [x - 0.3 for x in r.completion.logprobs]
    m = rl.update(groups)
    d = float(torch.tensor(0.3).exp() - 1 - 0.3)
    tokens = [len(r.completion.token_ids) if trained(r) else 0 for r in rolls]
    assert sum(tokens[half:]) > 0
    assert m["mismatch_kl"] == pytest.approx(d * sum(tokens[half:]) / sum(tokens), rel=2e-2)
    assert m["mismatch_max_abs"] == pytest.approx(0.3, rel=1e-3)


def test_min_ready_batches_above_what_staleness_allows_is_lowered_and_said(warm, caplog):
    rl = make_trainer(warm, seed=6, max_staleness=1, min_ready_batches=3, sync_every=1)
    with caplog.at_level("WARNING", logger="train.rl.pipeline"):
        pipe = Pipeline(rl)
        pipe.close()
    assert pipe.min_ready == 2
    assert "rl.min_ready_batches=3 lowered to 2: with rl.max_staleness=1 and rl.sync_every=1" in caplog.text


@pytest.mark.timeout(300)
def test_batches_without_trainable_groups_do_not_stall_the_pipeline(warm):
    """Steps that train nothing (dynamic sampling dropped every group) still count as finished
    trainer steps, so the producer is not left waiting for a version that never comes."""
    rl = make_trainer(warm, seed=6, max_staleness=1, min_ready_batches=2, sync_every=1)
    collect, calls = rl.collect, [0]

    def first_two_empty():
        groups, m = collect()
        calls[0] += 1
        return ([] if calls[0] <= 2 else groups), m

    rl.collect = first_two_empty
    ms = run_pipeline(rl, 4)
    # the steps of the two empty batches train nothing; the next two train their own batches
    assert [m["groups_trained"] for m in ms][:2] == [0, 0] and all(m["groups_trained"] for m in ms[2:])
    assert rl.step_idx == 2


class _StubRL:
    """Just what Pipeline uses of an RLTrainer: batches of one-rollout groups tagged by batch, no model."""

    def __init__(self, cfg, sizes=None, collect_s: float = 0.0, train_s: float = 0.0):
        import types

        self.cfg, self.learner, self.sizes = cfg, None, sizes
        self.collect_s, self.train_s = collect_s, train_s  # how long a batch's rollouts / an update take
        self.engine = types.SimpleNamespace(supports_inflight_update=True)
        self.policy = types.SimpleNamespace(device="cpu")
        self.curriculum = types.SimpleNamespace(difficulties=lambda: {})
        self.step_idx = self.synced_version = self.made = 0
        self.between_kernels = lambda: None
        self.trained: list[set[str]] = []

    def collect(self):
        time.sleep(self.collect_s)
        b, self.made = self.made, self.made + 1
        n = self.cfg.prompts_per_step if self.sizes is None else self.sizes[b]
        return [_group(self.synced_version, f"{b}.{i}") for i in range(n)], {"batch": b}

    def train_on(self, groups):
        time.sleep(self.train_s)
        self.trained.append({g.problem.prompt.split(".")[0] for g in groups})
        self.step_idx += bool(groups)
        if self.step_idx % self.cfg.sync_every == 0:
            self.synced_version = self.step_idx
        return {}


@pytest.mark.parametrize("sizes,staleness,sync", [(None, 1, 2), ([2, 4, 4, 4], 2, 2)])
def test_each_step_trains_the_groups_of_its_own_batch(sizes, staleness, sync, monkeypatch):
    """A step trains exactly the batch whose metrics it reports: with one batch ahead at most (min_ready 1) a
    step could run between the producer's recording a batch and its putting the groups in the buffer (a step
    with no groups, then an IndexError on an empty deque); a batch dynamic sampling left short took groups
    of the next batch, sampled under the next step's mix and response cap."""
    cfg = RLConfig(prompts_per_step=4, max_staleness=staleness, sync_every=sync, min_ready_batches=2)
    rl = _StubRL(cfg, sizes)
    put = RolloutBuffer.put

    def late_put(self, groups, batch):  # the producer thread preempted just before it puts a batch's groups
        time.sleep(0.05)
        put(self, groups, batch)

    monkeypatch.setattr(RolloutBuffer, "put", late_put)
    pipe = Pipeline(rl, batches=4)
    try:
        ms = [pipe.step() for _ in range(4)]
    finally:
        pipe.close()
    assert [m["batch"] for m in ms] == [0, 1, 2, 3] and rl.trained == [{"0"}, {"1"}, {"2"}, {"3"}]
    assert [m["groups_trained"] for m in ms] == (sizes or [4] * 4) and rl.step_idx == 4


def test_a_generate_that_waited_for_a_weight_load_is_tagged_with_the_loaded_version():
    """Engines that swap weights only between calls: a ``generate`` that waits for a load samples with the new
    weights, and its completions say so (the trainer read the version before the wait: two versions low)."""
    import threading

    from train.rl.pipeline import LockedEngine

    class Engine:
        def generate(self, prompts, params):
            return [Completion([1, 2, 3], "x", [-0.1] * 3, "stop") for _ in prompts]

        def load_weights(self, state_dict, version=None):
            time.sleep(0.3)

    eng = LockedEngine(Engine(), version=4)
    assert eng.generate([[1]], None)[0].versions == [4, 4, 4]
    loading = threading.Thread(target=eng.load_weights, args=({}, 6))
    loading.start()
    time.sleep(0.05)
    assert eng.generate([[1], [2]], None)[1].versions == [6, 6, 6]
    loading.join()


@pytest.mark.parametrize("replay", [True, False])
def test_router_replay_in_the_trainer(tiny_moe_dir, replay):
    """The engine's router differs from the trainer's (perturbed copy): with router replay the
    trainer scores every sampled token with the engine's expert choice, so its log-probs equal the
    behaviour log-probs; without it they differ. Top-1 routing with renormalised weights, where the
    expert choice alone decides the output (with k > 1 the mixing weights would still differ)."""
    import copy
    import dataclasses

    from envs.curriculum import Curriculum
    from train.engine import TorchEngine
    from train.model.hf_io import load_config
    from train.model.modeling import CausalLM
    from train.rl.trainer import RLTrainer, SamplingConfig
    from train.tokenizer import load_tokenizer

    mcfg = dataclasses.replace(load_config(tiny_moe_dir), num_experts_per_tok=1, norm_topk_prob=True)
    policy, tok = CausalLM(mcfg).init_weights(3, std=0.1), load_tokenizer(tiny_moe_dir)
    eng_model = copy.deepcopy(policy)
    with torch.no_grad():
        for name, p in eng_model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    cfg = RLConfig(group_size=4, prompts_per_step=4, chat_template=False, dynamic_sampling=False,
                   sampling=SamplingConfig(max_new_tokens=12), optim=OptimConfig(lr=0.0), router_replay=replay)
    cur = Curriculum(["toy/max"], controller="fixed", controller_kwargs={"difficulty": 1})
    rl = RLTrainer(policy, tok, TorchEngine(eng_model, tok), cur, cfg)
    groups, _ = rl.collect()
    assert all((r.completion.routed_experts is not None) == replay for g in groups for r in g.rollouts)
    m = rl.update(groups)
    if replay:
        assert m["mismatch_max_abs"] < 1e-3
    else:
        assert m["mismatch_max_abs"] > 1e-2


def test_bf16_policy_keeps_fp32_master_weights():
    """AdamW steps of 1e-3 on weights near 1: a bf16 weight (spacing 2^-7) would round each one away;
    with fp32 master weights they accumulate, and a resume restores the masters exactly."""
    from train.optim import MasterWeights, build_optimizer, clip_and_step

    lin = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt, sched = build_optimizer(lin, OptimConfig(lr=1e-3))
    assert isinstance(opt, MasterWeights)
    for _ in range(12):
        lin(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        clip_and_step(lin, opt, sched, 0.0)
    master = opt.master[id(lin.weight)].detach()
    assert float(master.mean()) == pytest.approx(1 - 12e-3, abs=2e-4)
    assert float(lin.weight.detach().float().mean()) < 1.0  # the bf16 copy moved too
    st = opt.state_dict()
    opt2, _ = build_optimizer(lin, OptimConfig(lr=1e-3))
    opt2.load_state_dict(st)
    torch.testing.assert_close(opt2.master[id(lin.weight)], master)


def test_bf16_micro_batch_gradients_add_up_in_fp32():
    """A bf16 policy's micro-batch gradients go into the fp32 masters after each backward (``accumulate_grads``,
    as the trainers call it): their sum is the fp32 sum of each micro-batch's gradient, where adding them
    up in the bf16 ``.grad`` is off by about 1%; the norm clipped is the fp32 one."""
    from train.optim import accumulate_grads, build_optimizer

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16)
    xs = [torch.randn(4, 16).to(torch.bfloat16) for _ in range(32)]
    exact = torch.zeros(16, 16)
    for x in xs:
        lin.weight.grad = None
        (lin(x).float() ** 2).mean().backward()
        exact += lin.weight.grad.float()
    lin.weight.grad = None
    for x in xs:  # the bf16 sum: what the trainers did
        (lin(x).float() ** 2).mean().backward()
    assert ((lin.weight.grad.float() - exact).norm() / exact.norm()) > 1e-3
    lin.weight.grad = None
    opt, _ = build_optimizer(lin, OptimConfig(lr=1e-3))
    for x in xs:
        (lin(x).float() ** 2).mean().backward()
        accumulate_grads(opt)
    (master,) = opt.params_with_grads()
    got = master.grad
    assert got.dtype == torch.float32 and lin.weight.grad is None
    assert ((got - exact).norm() / exact.norm()) < 1e-6


def test_bf16_master_weights_take_up_weights_changed_elsewhere():
    """An SFT phase (another optimizer) or weights loaded from trainer ranks change a bf16 policy
    under the RL optimizer's fp32 masters: after ``after_external_update`` (``resync``) the next
    step starts from the new weights; without it the stale masters are written back."""
    from train.optim import build_optimizer, clip_and_step

    def run(resync: bool) -> float:
        lin = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.fill_(1.0)
        opt, sched = build_optimizer(lin, OptimConfig(lr=1e-3))
        with torch.no_grad():
            lin.weight.fill_(2.0)  # the SFT phase's steps
        if resync:
            opt.resync()
        lin(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        clip_and_step(lin, opt, sched, 0.0)
        return float(lin.weight.detach().float().mean())

    assert run(resync=True) == pytest.approx(2.0, abs=0.02)
    assert run(resync=False) == pytest.approx(1.0, abs=0.02)  # the bug the resync prevents


def test_lending_ceiling_of_the_pipeline_benchmark():
    """benchmarks/pipeline.py's ``overlap_ceiling_lending`` step, by hand: rollout 0.2 s and update 0.55 s
    on one thread each, 0.16 s and 0.42 s on both. Together for 0.2 s (the update 0.2/0.55 done), then the
    update's remaining 0.35/0.55 on both threads: 0.2 + 0.42 * 0.35/0.55 = 0.4673 s; the other way round
    alike; two sides whose share is as fast as all the threads overlap completely."""
    from benchmarks.pipeline import lending_step

    assert lending_step(0.2, 0.55, 0.16, 0.42) == pytest.approx(0.2 + 0.42 * 0.35 / 0.55)
    assert lending_step(0.55, 0.2, 0.42, 0.16) == pytest.approx(0.2 + 0.42 * 0.35 / 0.55)
    assert lending_step(0.3, 0.3, 0.3, 0.3) == pytest.approx(0.3)
    assert lending_step(0.2, 0.5, 0.2, 0.5) == pytest.approx(0.5)


def test_groups_dropped_as_stale_or_evicted_are_not_made_up_from_the_next_batch(caplog):
    """A step trains what is left of its own batch: groups dropped as stale (an engine that lags) or evicted
    (a buffer smaller than the producer's lead) were made up from the next batch's groups, sampled under the
    next step's mix and response cap, and later steps then ran short or trained nothing."""

    class Lagging(_StubRL):
        def collect(self):
            groups, m = super().collect()
            if m["batch"] == 2:  # two groups answered by a server still on old weights
                groups[0] = _group(self.synced_version - 5, "2.0")
                groups[1] = _group(self.synced_version - 5, "2.1")
            return groups, m

    rl = Lagging(RLConfig(prompts_per_step=4, max_staleness=1, sync_every=1, min_ready_batches=2))
    pipe = Pipeline(rl, batches=4)
    try:
        ms = [pipe.step() for _ in range(4)]
    finally:
        pipe.close()
    assert [m["groups_trained"] for m in ms] == [4, 4, 2, 4] and rl.trained == [{"0"}, {"1"}, {"2"}, {"3"}]
    assert [m["groups_dropped_stale"] for m in ms] == [0, 0, 2, 0]

    # slow updates: the producer runs max_staleness + 1 batches ahead, into a one-batch buffer
    rl = _StubRL(RLConfig(prompts_per_step=4, max_staleness=2, sync_every=1, min_ready_batches=1, buffer_groups=4),
                 train_s=0.2)
    with caplog.at_level("WARNING"):
        pipe = Pipeline(rl, batches=5)
    assert "evicted unused" in caplog.text
    try:
        ms = [pipe.step() for _ in range(5)]
    finally:
        pipe.close()
    assert [m["batch"] for m in ms] == list(range(5)) and sum(m["groups_evicted"] for m in ms) > 0
    assert all(t <= {str(m["batch"])} for t, m in zip(rl.trained, [m for m in ms if m["groups_trained"]]))


def test_a_pipeline_whose_rollouts_would_always_be_too_stale_is_refused():
    """max_staleness 0 with sync_every 2: the producer waited forever for weights (the synchronous loop,
    RLTrainer.step, is what runs it)."""
    with pytest.raises(ValueError, match="max_staleness >= sync_every - 1"):
        Pipeline(_StubRL(RLConfig(prompts_per_step=2, max_staleness=0, sync_every=2)))


def test_a_checkpoint_of_before_the_batch_tags_resumes_each_batch_with_its_own_groups():
    """Checkpoints that stored (version, group) pairs and each pending batch's group count still resume."""
    rl = _StubRL(RLConfig(prompts_per_step=2, max_staleness=2, sync_every=1, min_ready_batches=1))
    rl.made = 9  # batches the stub makes from here are "9", "10"
    st = {"queue": [(0, _group(0, "a.0")), (0, _group(0, "b.0")), (0, _group(0, "b.1"))], "ahead": 2,
          "pending": [{"batch": "a", "difficulty": {}, _GROUPS: 1}, {"batch": "b", "difficulty": {}, _GROUPS: 2}], "evicted": 0, "dropped_stale": 0}
    pipe = Pipeline(rl, st, batches=2)
    try:
        ms = [pipe.step() for _ in range(2)]
    finally:
        pipe.close()
    assert [m["batch"] for m in ms] == ["a", "b"] and rl.trained == [{"a"}, {"b"}]
    assert [m["groups_trained"] for m in ms] == [1, 2] and _GROUPS not in ms[0]


@pytest.mark.parametrize("buffer_groups,sync", [(4, 1), (6, 2)])
def test_min_ready_batches_beyond_the_buffer_is_lowered_so_a_fast_trainer_loses_nothing(buffer_groups, sync, caplog):
    """rl.buffer_groups holding fewer batches than rl.min_ready_batches: the trainer waited for batches the buffer
    could not hold, so by the time it took batch b the groups of b were evicted (nearly every step trained
    nothing, with a trainer far faster than the rollouts). min_ready is lowered to the batches the buffer holds."""

    rl = _StubRL(RLConfig(prompts_per_step=4, max_staleness=2, sync_every=sync, min_ready_batches=2,
                          buffer_groups=buffer_groups), collect_s=0.03)
    with caplog.at_level("WARNING", logger="train.rl.pipeline"):
        pipe = Pipeline(rl, batches=6)
    try:
        ms = [pipe.step() for _ in range(6)]
    finally:
        pipe.close()
    assert [m["groups_trained"] for m in ms] == [4] * 6 and rl.trained == [{str(b)} for b in range(6)]
    assert sum(m["groups_evicted"] for m in ms) == 0 and pipe.buffer.evicted == 0
    assert pipe.min_ready == 1
    assert f"rl.min_ready_batches=2 lowered to 1: rl.buffer_groups={buffer_groups} holds 1 batch(es)" in caplog.text


def test_rollout_busy_frac_counts_each_batchs_time_in_the_steps_it_spans():
    """Rollouts and updates of equal length: the producer is busy ~90% of the time, but a batch's whole time was
    counted in the step in which it finished (steps alternated 1.0 and 0.0); now each step counts the part of
    a batch that ran since the previous step's metrics, the one still in progress included."""

    rl = _StubRL(RLConfig(prompts_per_step=4, max_staleness=2, sync_every=1, min_ready_batches=2), collect_s=0.05,
                 train_s=0.05)
    pipe = Pipeline(rl)
    try:
        ms = [pipe.step() for _ in range(8)]
    finally:
        pipe.close()
    busy = [round(m["rollout_busy_frac"], 2) for m in ms]
    assert all(b > 0.7 for b in busy[1:]), busy


def test_evictions_between_the_last_step_and_a_checkpoint_are_reported_after_the_resume():
    """The producer runs ahead (and evicts, in a one-batch buffer) between a step's metrics and the checkpoint;
    the checkpoint keeps what was already reported, so the resumed pipeline's steps report the rest: the
    per-step counts of both pipelines add up to the buffer's counter (the resumed run had lost those)."""

    def Slow(cfg):  # noqa: N802
        return _StubRL(cfg, collect_s=0.01, train_s=0.1)

    cfg = RLConfig(prompts_per_step=4, max_staleness=2, sync_every=1, min_ready_batches=1, buffer_groups=4)
    rl = Slow(cfg)
    pipe = Pipeline(rl, batches=6)
    try:
        ms = [pipe.step() for _ in range(2)]
        time.sleep(0.2)  # logging, evaluation: the producer runs ahead and evicts while nothing is reported
        with pipe.paused():
            st = pipe.state()
    finally:
        pipe.close()
    assert st["evicted"] > sum(m["groups_evicted"] for m in ms)  # evictions not reported yet
    again = Slow(cfg)
    again.step_idx = again.synced_version = rl.step_idx
    again.made = rl.made
    pipe = Pipeline(again, st, batches=4)
    try:
        ms += [pipe.step() for _ in range(4)]
    finally:
        pipe.close()
    assert sum(m["groups_evicted"] for m in ms) == pipe.buffer.evicted > 0
    old = {k: v for k, v in st.items() if k != "reported"}  # a checkpoint of before "reported": still loads
    pipe = Pipeline(Slow(cfg), old, batches=0)
    pipe.close()
    assert pipe._reported == (st["dropped_stale"], st["evicted"])


def _empty_group(version: int, tag: str) -> Group:
    """A group whose completions all stopped at once: no token, so no token versions."""
    p = Problem(prompt=tag, answer="0")
    return Group("toy/max", p, [Rollout("toy/max", p, [5], Completion([], "", [], "stop", versions=[]),
                                        Score.zero("")) for _ in range(2)])


def test_a_group_without_tokens_is_never_stale_and_the_lag_of_tokens_ahead_is_counted():
    """A group whose completions are all empty has no sampling version: it was tagged version 0 and dropped as
    stale once the trainer passed max_staleness (it trains nothing either way, but it was counted as stale).
    Tokens of a version above the trainer's (an engine that reports its own) broke the lag histogram."""
    buf = RolloutBuffer(4)
    buf.put([_group(10, "a"), _empty_group(10, "empty")], batch=0)
    got = buf.take(0, version=10, max_staleness=2)
    assert [g.problem.prompt for g in got] == ["a", "empty"] and buf.dropped_stale == 0
    m = version_lag([_group(6, 0)], 5)  # token versions 6, 7 at trainer version 5
    assert m["version_lag_max"] == -1 and m["version_lag_hist"] == [1.0]


def test_take_counts_an_earlier_batchs_leftover_groups_as_evicted():
    """Groups of a batch older than the one taken (never to be trained) are removed and counted as evicted."""
    buf = RolloutBuffer(8)
    buf.put([_group(3, "0.0"), _group(3, "0.1")], batch=0)
    buf.put([_group(4, "1.0")], batch=1)
    got = buf.take(1, version=4, max_staleness=2)
    assert [g.problem.prompt for g in got] == ["1.0"] and buf.evicted == 2 and buf.dropped_stale == 0
    assert len(buf) == 0


def test_default_buffer_holds_max_staleness_plus_two_batches_and_warns_only_below_the_lead(caplog):
    """rl.buffer_groups=0 sizes the buffer at (max_staleness + 2) batches; the 'evicted unused' warning is given
    only for a buffer smaller than the max_staleness + 1 batches the producer may run ahead."""
    def make(**kw):
        pipe = Pipeline(_StubRL(RLConfig(prompts_per_step=4, max_staleness=1, sync_every=1, **kw)), batches=0)
        pipe.close()
        return pipe

    with caplog.at_level("WARNING", logger="train.rl.pipeline"):
        assert make().buffer.capacity == 12 and make(buffer_groups=8).buffer.capacity == 8
    assert "evicted unused" not in caplog.text  # 8 groups hold the 2 batches the producer may run ahead
    with caplog.at_level("WARNING", logger="train.rl.pipeline"):
        make(buffer_groups=7)
    assert "evicted unused" in caplog.text


def test_a_buffer_holds_at_least_one_group():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        RolloutBuffer(0)
    assert RolloutBuffer(1).capacity == 1


def test_the_producer_never_starts_a_batch_on_weights_too_old_for_the_step_that_trains_it():
    """sync_every=2, max_staleness=1: after the first update the engine still serves version 0, and a batch
    started then would be trained at version 2 (two behind): the producer waits for the sync instead, so no group
    is ever dropped as stale and every step trains its whole batch."""
    rl = _StubRL(RLConfig(prompts_per_step=4, max_staleness=1, sync_every=2, min_ready_batches=1), train_s=0.05)
    pipe = Pipeline(rl, batches=6)
    try:
        ms = [pipe.step() for _ in range(6)]
    finally:
        pipe.close()
    assert [m["groups_dropped_stale"] for m in ms] == [0] * 6 and [m["groups_trained"] for m in ms] == [4] * 6


def test_no_batch_is_made_past_the_last_step_and_buffer_fill_is_a_fraction():
    """batches=3: the producer makes exactly 3 batches (the curriculum is not moved by rollouts never trained on),
    although staleness would let it run ahead; buffer_fill is the buffer's fraction in use when the step began
    (2 batches of 4 in a buffer of 12 before the first step, the trainer waiting for min_ready=2)."""
    rl = _StubRL(RLConfig(prompts_per_step=4, max_staleness=1, sync_every=1, min_ready_batches=2), train_s=0.05)
    pipe = Pipeline(rl, batches=3)
    try:
        ms = [pipe.step() for _ in range(3)]
        time.sleep(0.2)
    finally:
        pipe.close()
    assert rl.made == 3 and [m["batch"] for m in ms] == [0, 1, 2]
    assert ms[0]["buffer_fill"] == pytest.approx(8 / 12) and all(0 <= m["buffer_fill"] <= 1 for m in ms)


def test_a_checkpointed_pipeline_resumes_each_waiting_batch_at_its_own_step():
    """state() tags each buffered group with its batch counted from the next step (0), whatever steps ran
    before; the resumed pipeline trains each waiting batch at its own step, then the new ones."""
    cfg = RLConfig(prompts_per_step=2, max_staleness=2, sync_every=1, min_ready_batches=1)
    rl = _StubRL(cfg, train_s=0.02)
    pipe = Pipeline(rl, batches=6)
    try:
        [pipe.step() for _ in range(2)]
        with pipe.paused():
            st = pipe.state()
    finally:
        pipe.close()
    assert st["ahead"] >= 1 and len(st["queue"]) == 2 * st["ahead"]
    assert st["queue_batches"] == [int(g.problem.prompt.split(".")[0]) - 2 for _, g in st["queue"]]
    again = _StubRL(cfg)
    again.step_idx = again.synced_version = rl.step_idx
    again.made = rl.made
    pipe = Pipeline(again, st, batches=4)
    try:
        [pipe.step() for _ in range(4)]
    finally:
        pipe.close()
    assert again.trained == [{"2"}, {"3"}, {"4"}, {"5"}]
    bad = dict(st, pending=st["pending"][:-1])
    with pytest.raises(ValueError, match="batches of metrics for"):
        Pipeline(_StubRL(cfg), bad, batches=0)


def test_an_engine_without_in_flight_updates_is_locked_during_the_pipeline_only():
    """An engine that cannot swap weights mid-generate is wrapped in a LockedEngine for the pipeline's life and
    given back by close(); completions it tags with versions of its own keep them, untagged ones get the version
    of the weights that sampled them."""
    import types

    from train.rl.pipeline import LockedEngine

    rl = _StubRL(RLConfig(prompts_per_step=2, max_staleness=1, sync_every=1, min_ready_batches=1))
    engine = types.SimpleNamespace(supports_inflight_update=False)
    rl.engine = engine
    pipe = Pipeline(rl, batches=0)
    assert isinstance(rl.engine, LockedEngine)
    pipe.close()
    assert rl.engine is engine

    def generate(*a, **kw):  # one completion the engine tagged itself, one it left untagged
        return [Completion([1, 2], "x", [-0.1, -0.2], "stop", versions=[3, 4]), Completion([7], "y", [-0.3], "stop")]

    eng = LockedEngine(types.SimpleNamespace(generate=generate,
                                             load_weights=lambda sd: None), version=5)
    out = eng.generate([[1]])
    assert out[0].versions == [3, 4] and out[1].versions == [5]
    eng.load_weights({}, version=6)
    assert eng.generate([[1]])[1].versions == [6]


def test_a_rollout_thread_share_of_every_thread_leaves_the_threads_alone():
    """rl.rollout_threads as large as torch's thread count leaves the update none: no split at all."""
    import types

    from train.rl.pipeline import thread_split

    n = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        rl = types.SimpleNamespace(engine=types.SimpleNamespace(computes_here=True), learner=None,
                                   policy=types.SimpleNamespace(device="cpu"),
                                   cfg=RLConfig(max_staleness=1, sync_every=1, rollout_threads=4))
        assert thread_split(rl) is None
        rl.cfg = RLConfig(max_staleness=1, sync_every=1, rollout_threads=3)
        assert thread_split(rl) == (3, 1)
        rl.cfg = RLConfig(max_staleness=1, sync_every=1)
        assert thread_split(rl) == (2, 2)
    finally:
        torch.set_num_threads(n)


def test_closing_stops_the_batch_in_flight_and_the_engine_generates_again(warm):
    """A pipelined run stopped (Ctrl-C, SIGTERM, an error in the trainer) while the producer generates a batch:
    close() stops the batch at the engine's next decoding step instead of waiting for all of it (a run stopped
    inside a recipe-sized batch, 2,048 rollouts, waited minutes), and the engine generates again afterwards."""
    import threading

    from train.engine.base import GenerationInterrupted, SamplingParams

    rl = make_trainer(warm, seed=4, max_staleness=2, min_ready_batches=2, sync_every=1)
    eng = rl.engine
    inside, interrupted, steps = threading.Event(), threading.Event(), []
    real = eng.interrupt

    def spy(on=True):
        real(on)
        if on:
            interrupted.set()

    def hook(step):  # the producer's batch, at its third decoding step, holds until the pipeline is closed
        steps.append(step)
        if step == 2 and not inside.is_set():
            inside.set()
            interrupted.wait(20)

    eng.interrupt, eng.step_hook = spy, hook
    pipe = Pipeline(rl)
    try:
        assert inside.wait(60)
    finally:
        pipe.close()
    assert isinstance(pipe._error, GenerationInterrupted)
    assert steps == [0, 1, 2]  # no decoding step after the close
    eng.step_hook = None
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=0))) == 1
