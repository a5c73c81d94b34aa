"""The single-process RL update (train/rl/trainer.py): KL to a reference policy, the seq-mode
denominator, and the sharded path's denominator and KL config (train/parallel/rl_update.py, cascade/learner.py).

A random tiny-dense policy (no warm-up needed: these tests check the update's arithmetic against an
independent per-rollout computation, not learning). Real rollouts from the torch engine; rewards
are then set by hand.
"""
from __future__ import annotations

import copy

import pytest
import torch

from envs.curriculum import Curriculum
from train.engine import TorchEngine
from train.model.hf_io import load_pretrained, save_pretrained
from train.model.modeling import token_logprobs
from train.optim import OptimConfig
from train.rl.advantages import compute_advantages
from train.rl.losses import LossConfig
from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig
from train.tokenizer import load_tokenizer

ENV = "toy/max"


def make_rl(model_dir, **overrides) -> RLTrainer:
    policy = load_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    kw = dict(group_size=4, prompts_per_step=2, advantage="drgrpo", loss="drgrpo", chat_template=False,
              dynamic_sampling=False, repetition_gate=False, sampling=SamplingConfig(max_new_tokens=6),
              optim=OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=0.0), micro_batch_size=3, seed=0)
    kw.update(overrides)
    cur = Curriculum([ENV], controller="fixed", seed=0, controller_kwargs={"difficulty": 1})
    return RLTrainer(policy, tok, TorchEngine(copy.deepcopy(policy), tok), cur, RLConfig(**kw))


def rollouts(rl: RLTrainer, rewards: list[float]):
    """Two groups of real rollouts with the given rewards (in order)."""
    groups = rl.rollout(2)
    for r, x in zip(rewards, [x for g in groups for x in g.rollouts]):
        x.reward = r
    return groups


def spy_grads(monkeypatch) -> dict:
    """Record the gradients the optimizer steps on (grad_clip=0: no clipping)."""
    import train.rl.trainer as trainer

    grads: dict = {}
    step = trainer.clip_and_step

    def spy(model, *a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(model, *a, **k)

    monkeypatch.setattr(trainer, "clip_and_step", spy)
    return grads


def row_logprobs(model, x, temp: float = 1.0) -> torch.Tensor:
    """Log-probs of one rollout's completion tokens: one unpadded, unpacked forward."""
    ids = torch.tensor([x.prompt_ids + x.completion.token_ids])
    return token_logprobs(model, ids, None, temp)[0, len(x.prompt_ids) - 1:]


def kl_by_hand(policy, ref, groups, coef: float, kind: str):
    """coef * KL aggregated as seq_mean_token_sum (drgrpo), and the token-mean KL, one rollout at a time."""
    per_seq, toks = [], []
    for x in [x for g in groups for x in g.rollouts]:
        if not x.completion.token_ids:
            continue
        lp = row_logprobs(policy, x)
        d = row_logprobs(ref, x).detach() - lp
        # k1: its value, with the score-function gradient of KL(pi || ref), (log pi - log ref) grad log pi
        kl = (-d).detach() * torch.exp(lp - lp.detach()) if kind == "k1" else d.exp() - d - 1
        per_seq.append(kl.sum())
        toks.extend(kl.detach().tolist())
    return coef * sum(per_seq) / len(per_seq), sum(toks) / len(toks)


@pytest.mark.parametrize("kind", ["k3", "k1"])
def test_kl_to_frozen_reference_value_and_gradient(tiny_dense_dir, kind, monkeypatch):
    coef = 0.5
    rl = make_rl(tiny_dense_dir, loss_cfg=LossConfig(kl_coef=coef, kl_type=kind))
    groups = rollouts(rl, [1.0] * 8)  # equal rewards: advantages 0, the loss is the KL term alone
    ref0 = {k: v.clone() for k, v in rl.reference_policy().state_dict().items()}  # frozen copy of the start
    torch.manual_seed(1)
    with torch.no_grad():  # move the policy away from its reference
        for p in rl.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = copy.deepcopy(rl.policy)
    grads = spy_grads(monkeypatch)
    m = rl.update(groups)
    want, kl_tok = kl_by_hand(before, rl.ref_policy, groups, coef, kind)
    assert abs(want.item()) > 1e-4  # the reference really differs from the policy (k1 may be < 0)
    assert m["loss"] == pytest.approx(want.item(), rel=1e-4)
    assert m["kl_ref"] == pytest.approx(kl_tok, rel=1e-4)
    want.backward()
    for n, p in before.named_parameters():
        # float32, packed vs one row at a time: equal up to rounding relative to the tensor's scale
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-4 * float(p.grad.abs().max()))
    # the reference stayed frozen through the update, and the policy moved
    assert all(torch.equal(v, ref0[k]) for k, v in rl.ref_policy.state_dict().items())
    assert not all(p.requires_grad for p in rl.ref_policy.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(rl.policy.parameters(), before.parameters()))


def test_kl_reference_from_a_checkpoint_and_resume(tiny_dense_dir, tmp_path):
    other = load_pretrained(tiny_dense_dir)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_pretrained(other, tmp_path / "ref", tiny_dense_dir)
    rl = make_rl(tiny_dense_dir, loss_cfg=LossConfig(kl_coef=0.2), kl_reference=str(tmp_path / "ref"))
    groups = rollouts(rl, [1.0] * 8)
    before = copy.deepcopy(rl.policy)
    m = rl.update(groups)
    want, _ = kl_by_hand(before, other, groups, 0.2, "k3")
    assert m["loss"] == pytest.approx(want.item(), rel=1e-4) and want.item() > 1e-4
    assert "kl_reference" not in rl.state_dict()  # the checkpoint path is the reference; nothing to save
    # a frozen copy is saved with the trainer state and comes back on resume, not rebuilt from the
    # resumed (trained) weights
    rl2 = make_rl(tiny_dense_dir, loss_cfg=LossConfig(kl_coef=0.2))
    rl2.update(rollouts(rl2, [1.0, 0, 0, 0, 0, 1, 0, 0]))
    st = rl2.state_dict()
    rl3 = make_rl(tiny_dense_dir, loss_cfg=LossConfig(kl_coef=0.2))
    rl3.policy.load_state_dict(rl2.policy.state_dict())
    rl3.load_state_dict(st)
    start = load_pretrained(tiny_dense_dir).state_dict()
    assert all(torch.equal(v, start[k]) for k, v in rl3.reference_policy().state_dict().items())
    assert any(not torch.equal(v, start[k]) for k, v in rl3.policy.state_dict().items())


def test_kl_coef_zero_builds_no_reference(tiny_dense_dir):
    rl = make_rl(tiny_dense_dir)

    def no_extra_forward(*a, **k):
        raise AssertionError("kl_coef=0 (ratio against behaviour) runs no no-grad forward")

    rl._logprobs_no_grad = no_extra_forward
    m = rl.update(rollouts(rl, [1.0, 0, 0, 0, 0, 1, 1, 0]))
    assert rl.ref_policy is None and "kl_ref" not in m and "kl_reference" not in rl.state_dict()
    with pytest.raises(ValueError, match="kl_reference is set but loss_cfg.kl_coef is 0"):
        RLConfig(kl_reference="some/dir")


@pytest.mark.parametrize("loss", ["drgrpo", "dapo"])
def test_seq_denominator_excludes_masked_rollouts(tiny_dense_dir, loss):
    rl = make_rl(tiny_dense_dir, loss=loss)
    rewards = [1.0, 0, 0, 0, 1, 1, 0, 0]
    groups = rollouts(rl, rewards)
    rolls = [x for g in groups for x in g.rollouts]
    for x in rolls:  # behaviour log-probs = the trainer's own: every ratio is 1 (up to rounding)
        with torch.no_grad():
            x.completion.logprobs = row_logprobs(rl.policy, x).tolist()
    rolls[1].keep = rolls[6].keep = False  # e.g. overlong-filtered: out of the loss and its denominator
    adv = compute_advantages("drgrpo", torch.tensor(rewards), 4).tolist()
    # drgrpo, seq_mean_token_sum with ratio 1: -sum_t A_i per kept rollout, over the 6 kept rollouts;
    # dapo, token_mean: the same sum over the kept rollouts' tokens
    kept = [i for i, x in enumerate(rolls) if x.keep and x.completion.token_ids]
    tokens = sum(len(rolls[i].completion.token_ids) for i in kept)
    want = sum(-adv[i] * len(rolls[i].completion.token_ids) for i in kept) / (len(kept) if loss == "drgrpo" else tokens)
    assert abs(want) > 0.05 and len(kept) == 6
    m = rl.update(groups)
    assert m["loss"] == pytest.approx(want, rel=1e-5)


def test_update_metrics_count_only_trained_rollouts(tiny_dense_dir):
    """With two mini-batches and every rollout of the second dropped, grad_norm and loss are the first mini-batch's
    (not halved by a step that had no gradient) and advantage_abs_mean is over the kept rollouts."""
    rewards = [1.0, 0, 0, 0, 1, 1, 0, 0]
    norms = {}
    for ups in (1, 2):
        rl = make_rl(tiny_dense_dir, updates_per_batch=ups)
        groups = rollouts(rl, rewards)
        rolls = [x for g in groups for x in g.rollouts]
        for x in rolls[4:]:
            x.keep = False
        adv = compute_advantages("drgrpo", torch.tensor(rewards), 4).tolist()
        m = rl.update(groups)
        norms[ups] = m["grad_norm"]
        assert m["advantage_abs_mean"] == pytest.approx(sum(abs(a) for a in adv[:4]) / 4)
    # one step over rollouts 0-3 either way (the loss's denominator: the mini-batch's own kept rollouts)
    assert norms[1] > 0 and norms[2] == pytest.approx(norms[1], rel=1e-4)
    losses = {}
    for ups in (1, 2):  # rollouts 0-1 kept (their advantages do not cancel): the same loss
        rl = make_rl(tiny_dense_dir, updates_per_batch=ups, loss="ppo")
        groups = rollouts(rl, rewards)
        for x in [x for g in groups for x in g.rollouts][2:]:
            x.keep = False
        losses[ups] = rl.update(groups)["loss"]
    assert abs(losses[1]) > 0.1 and losses[2] == pytest.approx(losses[1], rel=1e-4)


def test_lr_schedule_counts_rl_steps_whatever_updates_per_batch(tiny_dense_dir):
    """Cosine decay over 4 RL steps with 2 optimizer steps per batch: the metric is the rate each step applied,
    lr_factor(step) as the sharded trainer takes it (the schedule stepped per mini-batch: at its floor by step 2)."""
    from train.optim import lr_factor

    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=0.0, schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    rl = make_rl(tiny_dense_dir, updates_per_batch=2, optim=optim)
    groups = rollouts(rl, [1.0, 0, 0, 0, 1, 1, 0, 0])
    got = [rl.update(groups)["lr"] for _ in range(4)]
    assert got == pytest.approx([1e-3 * lr_factor(i, optim) for i in range(4)])
    assert got[2] > got[3] > 1e-4


def test_host_reads_per_update_do_not_grow_with_micro_batches(tiny_dense_dir):
    """The loss metrics stay on the device until one read after the update (on a GPU each read of a
    value into Python waits for the queue): 8 micro-batches read no more than one does."""
    from tests.test_rl_distributed import host_reads

    reads = {}
    for mbs in (8, 1):
        rl = make_rl(tiny_dense_dir, micro_batch_size=mbs)
        groups = rollouts(rl, [1.0, 0, 0, 0, 1, 1, 0, 0])
        with host_reads() as n:
            m = rl.update(groups)
        reads[mbs] = n[0]
        rolls = [x for g in groups for x in g.rollouts]
        assert m["entropy"] > 0 and len(rl._packs(rolls, range(len(rolls)))) == 8 // mbs
    assert reads[1] == reads[8], reads  # (most of them: torch's AdamW reading each parameter's step count)


def test_sharded_denominator_and_kl_config():
    from train.parallel.rl_update import RLUpdateConfig, loss_denominator
    from train.rl.exchange import TrainSample

    s = [TrainSample([1, 2], [3, 4, 5], [-1.0] * 3, 0.5), TrainSample([1], [3], [-1.0], 0.5, keep=False),
         TrainSample([1, 2], [], [], 0.0), TrainSample([1], [7, 8], [-1.0] * 2, -0.5)]
    assert loss_denominator(s, "seq_mean_token_sum") == 2.0  # was 4: the dropped and the empty rollout counted
    assert loss_denominator(s, "seq_mean_token_mean") == 2.0
    assert loss_denominator(s, "token_mean") == 5.0
    # KL on the sharded trainer (tests/test_rl_distributed.py checks its steps): accepted, with or without
    # a reference checkpoint; a reference without a KL term is a config error
    assert RLUpdateConfig(loss_cfg=LossConfig(kl_coef=0.1)).kl_reference is None
    assert RLUpdateConfig(loss_cfg=LossConfig(kl_coef=0.1), kl_reference="ref/dir").kl_reference == "ref/dir"
    with pytest.raises(ValueError, match="kl_reference is set but loss_cfg.kl_coef is 0"):
        RLUpdateConfig(kl_reference="ref/dir")


def test_maxrl_config_refuses_negative_overlong_rewards():
    from train.rl.shaping import OverlongConfig

    with pytest.raises(ValueError, match="maxrl needs rewards >= 0"):
        RLConfig(advantage="maxrl", overlong=OverlongConfig(mode="soft", max_len=10, buffer_len=4))
    RLConfig(advantage="grpo", overlong=OverlongConfig(mode="soft", max_len=10, buffer_len=4))
    RLConfig(advantage="maxrl", overlong=OverlongConfig(mode="mask"))
    # DAPO's soft punishment past the response limit could never reach its full penalty (or apply at all)
    sampling = SamplingConfig(max_new_tokens=64)
    with pytest.raises(ValueError, match="overlong.max_len=100 is above sampling.max_new_tokens=64"):
        RLConfig(advantage="grpo", sampling=sampling, overlong=OverlongConfig(mode="soft", max_len=100, buffer_len=20))
    RLConfig(advantage="grpo", sampling=sampling, overlong=OverlongConfig(mode="soft", max_len=64, buffer_len=20))
    # the verifier's score is on [-1, 1] (-1: no \\boxed{} answer): refused before any rollout, not at the first batch
    with pytest.raises(ValueError, match="maxrl needs rewards >= 0, but reward=score"):
        RLConfig(advantage="maxrl", reward="score")
    RLConfig(advantage="grpo", reward="score")


def test_trainer_ranks_refuse_a_tis_cap_that_would_not_act():
    """RLUpdateConfig (built by the trainer ranks from a dict) refuses tis_cap under ratio_against=behaviour, as
    RLConfig does: it was accepted and silently ignored."""
    from train.parallel.rl_update import RLUpdateConfig

    with pytest.raises(ValueError, match="tis_cap=2.0 acts only with ratio_against=recompute"):
        RLUpdateConfig(loss="grpo", loss_cfg={"tis_cap": 2.0})
    assert RLUpdateConfig(loss="grpo", loss_cfg={"tis_cap": 2.0}, ratio_against="recompute").loss_cfg.tis_cap == 2.0
    with pytest.raises(ValueError, match="unknown ratio_against 'x'; choose from behaviour, recompute"):
        RLUpdateConfig(ratio_against="x")


def test_cascade_takes_kl_on_trainer_ranks_and_passes_the_reference(tmp_path, monkeypatch):
    """KL with trainer.nproc > 1 is accepted, and the ranks' RLUpdateConfig gets kl_coef and the
    reference directory (absolute: the ranks run in the repository root)."""
    import json
    import subprocess

    from cascade.config import load_run_config
    from cascade.learner import WorkerLearner

    cfg, _ = load_run_config({"stage": "math", "rl.loss_cfg.kl_coef": 0.05, "rl.kl_reference": None})
    assert cfg.stages["math"].rl.loss_cfg.kl_coef == 0.05
    cfg, _ = load_run_config({"stage": "math", "rl.loss_cfg.kl_coef": 0.05, "trainer.nproc": 2})
    assert cfg.trainer.nproc == 2 and cfg.stages["math"].rl.loss_cfg.kl_coef == 0.05

    class NoProcess:  # the command is not run: only the config the ranks would read is checked
        def __init__(self, cmd, **kw):
            self.cmd = cmd

    monkeypatch.setattr(subprocess, "Popen", NoProcess)
    (tmp_path / "ref").mkdir()
    monkeypatch.chdir(tmp_path)
    rl = RLConfig(loss_cfg=LossConfig(kl_coef=0.05, kl_type="k1"), kl_reference="ref")
    learner = WorkerLearner(tmp_path / "ex", tmp_path / "model", cfg.trainer, rl, 3, 0, tmp_path / "logs")
    conf = json.loads((tmp_path / "logs" / "trainer-config.json").read_text())
    assert conf["loss_cfg"]["kl_coef"] == 0.05 and conf["loss_cfg"]["kl_type"] == "k1"
    assert conf["kl_reference"] == str(tmp_path / "ref")
    assert "--config" in learner.proc.cmd


def test_rollouts_of_waiting_verifiers_are_verified_verify_workers_at_a_time(tiny_dense_dir):
    """``rl.verify_workers``: the trainer verifies the rollouts of an environment that waits on other
    processes (``concurrent_verify``) that many at a time (a 2-party barrier inside ``check`` opens
    only then), with the same rewards as one at a time; a negative value is refused."""
    import threading

    from envs import get_env

    base = type(get_env(ENV))

    class Waiting(base):
        concurrent_verify = True
        barrier = threading.Barrier(2, timeout=20)
        threads: set = set()

        def check(self, problem, response):
            Waiting.threads.add(threading.current_thread().name)
            Waiting.barrier.wait()
            return super().check(problem, response)

    rewards = {}
    for workers in (1, 2):
        rl = make_rl(tiny_dense_dir, verify_workers=workers)
        if workers == 2:
            rl.curriculum.envs[ENV] = Waiting()
        rewards[workers] = [(x.completion.token_ids, x.reward) for g in rl.rollout(2) for x in g.rollouts]
    assert rewards[1] == rewards[2] and len(rewards[2]) == 8
    assert Waiting.threads and all(t.startswith("cascade-verify") for t in Waiting.threads)
    with pytest.raises(ValueError, match="verify_workers must be >= 0"):
        RLConfig(verify_workers=-1)


def test_rollouts_are_verified_with_the_thinking_their_prompt_opened(tiny_dense_dir):
    """A chat template that ends the generation prompt with <think> (DeepSeek-R1's, Qwen3-Thinking-2507's): a response
    that never closes its thinking has no answer, whatever it boxed there; one that closes it is judged on the rest.
    Plain prompts (chat_template=false) and the tiny template (thinking not opened) add nothing."""
    from envs import get_env

    rl = make_rl(tiny_dense_dir, chat_template=True)
    assert rl.think_open == ""
    rl.tokenizer.chat_template += "{% if add_generation_prompt %}<think>\n{% endif %}"
    opened = RLTrainer(rl.policy, rl.tokenizer, rl.engine, rl.curriculum, rl.cfg)
    assert opened.think_open == "<think>\n" and make_rl(tiny_dense_dir).think_open == ""
    p = get_env(ENV).generate(3, 1)
    cut, closed = f"so \\boxed{{{p.answer}}} maybe", f"checked</think> \\boxed{{{p.answer}}}"
    assert [s.correct for s in rl.verify([(ENV, p, cut), (ENV, p, closed)])] == [True, True]  # (built before)
    assert [s.correct for s in opened.verify([(ENV, p, cut), (ENV, p, closed)])] == [False, True]


def test_a_step_that_trains_nothing_still_moves_the_length_rewards_schedule(tiny_dense_dir):
    """The c schedule counts the run's RL steps (configs: 632 = the warm-up's 232 + RLVE's 400 steps, c = 1.0 from
    the first math step); a step whose groups were all dropped (equal rewards, stale) left it where it was, so each
    such step moved c's ramp later. The optimizer and the learning rate stay (nothing was trained)."""
    rl = make_rl(tiny_dense_dir, length_reward=True)
    lr = rl.sched.get_last_lr()
    for _ in range(2):
        m = rl.train_on([])
        assert "loss" not in m
    assert rl.length_state.steps == 2 and rl.step_idx == 0 and rl.sched.get_last_lr() == lr
    assert make_rl(tiny_dense_dir).train_on([]) is not None  # (without the length reward: nothing to count)


def test_dynamic_sampling_drops_a_group_none_of_whose_rollouts_is_trained(tiny_dense_dir):
    """overlong.mode=mask: every rollout cut at max_new_tokens is masked out of the loss, but a group of them with
    differing rewards (an answer boxed before the cut is verified) passed dynamic sampling and took a batch slot
    without a loss token. Such groups are dropped like all-equal ones."""
    import itertools

    from train.rl.shaping import OverlongConfig

    from train.rl.trainer import SamplingConfig

    rl = make_rl(tiny_dense_dir, dynamic_sampling=True, max_sampling_rounds=1, sampling=SamplingConfig(max_new_tokens=2),
                 overlong=OverlongConfig(mode="mask"))
    cycle = itertools.cycle([1.0, 0.0, 0.0, 1.0])
    rl.reward_of = lambda score, ids: next(cycle)  # rewards that differ in every group
    seen = []
    rl.rollout_hook = seen.extend
    m = rl.step()
    assert seen and all(not r.keep for g in seen for r in g.rollouts)  # (every rollout truncated)
    assert m["groups_trained"] == 0 and m["groups_dropped"] == m["groups_sampled"] == len(seen)
    assert rl.step_idx == 0 and "loss" not in m
