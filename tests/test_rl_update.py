"""The single-process RL update (train/rl/trainer.py): KL to a reference policy, the seq-mode
denominator, and the sharded path's denominator and KL config (train/parallel/rl_update.py, cascade/learner.py).

A random tiny-dense policy (no warm-up needed: these tests check the update's arithmetic against an
independent per-rollout computation, not learning). Real rollouts from the torch engine; rewards
are then set by hand.
"""
from __future__ import annotations

import copy
import shutil

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


@pytest.mark.parametrize("kw,needle", [
    ({"repetition_threshold": 0.0}, r"repetition_threshold in \(0, 1\) \(got 0.0\)"),
    ({"repetition_threshold": 1.0}, r"repetition_threshold in \(0, 1\) \(got 1.0\)"),
    ({"prompts_per_step": 0}, "prompts_per_step must be >= 1, got prompts_per_step=0"),
    ({"max_sampling_rounds": 0}, "max_sampling_rounds must be >= 1, got max_sampling_rounds=0"),
    ({"tokens_per_micro": 0}, "tokens_per_micro must be >= 1, got tokens_per_micro=0"),
    ({"updates_per_batch": 0}, "updates_per_batch must be >= 1, got updates_per_batch=0"),
    ({"sync_every": 0}, "sync_every and min_ready_batches must be >= 1"),
    ({"min_ready_batches": 0}, "sync_every and min_ready_batches must be >= 1"),
    ({"max_staleness": -1}, "max_staleness >= 0"),
    ({"rollout_threads": -1}, "rollout_threads must be >= 0"),
    ({"advantage": "maxrl", "overlong": {"mode": "reward", "truncated_reward": -0.5}}, "maxrl needs rewards >= 0"),
])
def test_rl_config_refuses_settings_before_any_work(kw, needle):
    from train.rl.shaping import OverlongConfig

    if "overlong" in kw:
        kw = {**kw, "overlong": OverlongConfig(**kw["overlong"])}
    with pytest.raises(ValueError, match=needle):
        RLConfig(**kw)


def test_rl_config_accepts_the_edges_of_its_ranges():
    """The bounds themselves are valid: a truncated reward of 0 keeps maxrl's rewards >= 0, a staleness of
    sync_every - 1 covers the syncs' gap, a buffer of exactly one batch, sampling options checked at once."""
    from train.rl.shaping import OverlongConfig

    RLConfig(advantage="maxrl", overlong=OverlongConfig(mode="reward", truncated_reward=0.0))
    RLConfig(repetition_threshold=0.99, repetition_chunk_tokens=1, max_prompt_tokens=0, verify_workers=0)
    RLConfig(max_staleness=1, sync_every=2)
    RLConfig(prompts_per_step=4, buffer_groups=4)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(top_p=0.0)


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


def test_loss_and_entropy_metrics_of_several_mini_batches(tiny_dense_dir):
    """updates_per_batch=2 with lr 0 (both mini-batches see the same weights) and behaviour log-probs equal to the
    trainer's (every ratio 1): ``loss`` is the mean of the two mini-batches' losses, each -sum_t A_i over its own
    kept rollouts divided by their number (drgrpo), and ``entropy`` the mean over every kept completion token of the
    policy's entropy at that position (one unpacked forward per rollout)."""
    rewards = [1.0, 0, 0, 0, 1, 1, 0, 0]
    rl = make_rl(tiny_dense_dir, updates_per_batch=2, optim=OptimConfig(lr=0.0, warmup_steps=0, grad_clip=0.0))
    groups = rollouts(rl, rewards)
    rolls = [x for g in groups for x in g.rollouts]
    ents = []
    for i, x in enumerate(rolls):
        ids = torch.tensor([x.prompt_ids + x.completion.token_ids])
        with torch.no_grad():
            lp, ent = token_logprobs(rl.policy, ids, None, 1.0, return_entropy=True)
        x.completion.logprobs = lp[0, len(x.prompt_ids) - 1:].tolist()
        if i not in (1, 6):
            ents.extend(ent[0, len(x.prompt_ids) - 1:].tolist())
    rolls[1].keep = rolls[6].keep = False  # the advantages of each mini-batch's kept rollouts do not cancel
    adv = compute_advantages("drgrpo", torch.tensor(rewards), 4).tolist()

    def mini_loss(rows):
        kept = [i for i in rows if rolls[i].keep and rolls[i].completion.token_ids]
        return sum(-adv[i] * len(rolls[i].completion.token_ids) for i in kept) / max(len(kept), 1)

    first, second = mini_loss(range(4)), mini_loss(range(4, 8))  # even_slices(8, 2): rollouts 0-3, then 4-7
    assert abs(first + second) > 0.1 and len(ents) > 8
    m = rl.update(groups)
    assert m["loss"] == pytest.approx((first + second) / 2, rel=1e-4)
    assert m["entropy"] == pytest.approx(sum(ents) / len(ents), rel=1e-4)


def test_the_ranks_command_and_config_carry_the_stage_settings(tmp_path, monkeypatch):
    """What the trainer ranks are started with: the updates in all (SFT then RL), the sync schedule, the start's
    longer timeout in their collectives' bound (startup_timeout_s + 60 s) and ratio_against in their config."""
    import json
    import subprocess

    from cascade.config import Trainer
    from cascade.learner import WorkerLearner

    class NoProcess:  # the command is not run
        def __init__(self, cmd, **kw):
            self.cmd = cmd

    monkeypatch.setattr(subprocess, "Popen", NoProcess)
    rl = RLConfig(sync_every=3, ratio_against="recompute", loss_cfg=LossConfig(tis_cap=2.0))
    learner = WorkerLearner(tmp_path / "ex", tmp_path / "model", Trainer(nproc=2, timeout_s=10.0, startup_timeout_s=100.0),
                            rl, 4, 0, tmp_path / "logs", sft_steps=2)
    cmd = learner.proc.cmd
    arg = lambda k: cmd[cmd.index(k) + 1]  # noqa: E731
    assert (arg("--steps"), arg("--sft-steps"), arg("--sync-every")) == ("6", "2", "3")
    assert learner.startup_timeout == 100.0 and float(arg("--timeout-s")) == 160.0
    conf = json.loads((tmp_path / "logs" / "trainer-config.json").read_text())
    assert conf["ratio_against"] == "recompute" and conf["loss_cfg"]["tis_cap"] == 2.0


def test_learner_numbers_updates_after_the_sft_steps_and_sends_what_is_trained(tmp_path):
    """RL update k goes to the ranks as update sft_steps + k (its schedule step k) with each rollout's advantage and
    keep flag; SFT step sft_steps is refused; the metrics read back leave out step, version and lists; the weights
    of a checkpoint at update sft_steps are RL version 0, those of an earlier update the SFT phase's."""
    from types import SimpleNamespace

    from cascade.learner import WorkerLearner
    from envs.base import Problem, Score
    from train.engine.base import Completion
    from train.rl.exchange import batch_path, publish_version, read_batch
    from train.rl.trainer import Group, Rollout

    learner = object.__new__(WorkerLearner)
    learner.exchange, learner.sft_steps, learner.log = tmp_path, 2, tmp_path / "trainer.log"
    learner.proc, learner._silent, learner._up = SimpleNamespace(poll=lambda: None), False, True
    learner.timeout = learner.startup_timeout = 30
    p = Problem(prompt="q", answer="1")
    rolls = [Rollout("toy/max", p, [5, 6], Completion([7, 8, 9][:n], "", [-0.5] * n, "stop", versions=[0] * n),
                     Score.zero(""), keep=keep) for n, keep in ((3, True), (2, False))]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "step-000005.json").write_text(
        '{"step": 5, "version": 4, "loss": 0.5, "grad_norm": 2.0, "version_lag_hist": [1.0]}')
    seen = []
    learner._wait = lambda what, done: seen.append(read_batch(tmp_path, 5)) if "metrics" in what else None
    m = learner.update([Group("toy/max", p, rolls)], torch.tensor([0.25, -1.0]), 3, 0.7)
    assert m == {"loss": 0.5, "grad_norm": 2.0}
    b = seen[0]
    assert (b.step, b.temperature, b.meta) == (5, 0.7, {"kind": "rl", "schedule_step": 3})
    assert [(s.completion_ids, s.advantage, s.keep) for s in b.samples] == [([7, 8, 9], 0.25, True), ([7, 8], -1.0, False)]
    assert not batch_path(tmp_path, 5).exists()  # consumed
    with pytest.raises(ValueError, match="SFT step 2 is past the 2 SFT steps"):
        learner.sft([([1], [2])], 2)
    publish_version(tmp_path, 0, {"w": torch.full((2,), 1.0)})  # RL version 0: the policy after SFT
    publish_version(tmp_path / "sft", 1, {"w": torch.full((2,), 2.0)})
    learner._wait = lambda what, done: shutil.rmtree(tmp_path / "ckpt_requests", ignore_errors=True)
    assert learner.checkpoint(2)["w"].tolist() == [1.0, 1.0]
    assert learner.checkpoint(1)["w"].tolist() == [2.0, 2.0]


def test_recompute_reports_the_engine_mismatch_of_every_token(tiny_dense_dir):
    """ratio_against=recompute: the ratio is against the trainer's own log-probs (1 here), and the mismatch metrics
    compare those with the engine's: recorded log-probs 0.2 below the trainer's, one token 0.5 below, give
    mismatch_max_abs 0.5 and mismatch_kl the token mean of k3 = e^d - 1 - d."""
    import math

    rl = make_rl(tiny_dense_dir, ratio_against="recompute")
    groups = rollouts(rl, [1.0, 0, 0, 0, 1, 1, 0, 0])
    rolls = [x for g in groups for x in g.rollouts if x.completion.token_ids]
    for x in rolls:
        with torch.no_grad():
            x.completion.logprobs = [v - 0.2 for v in row_logprobs(rl.policy, x).tolist()]
    rolls[-1].completion.logprobs[0] -= 0.3
    n = sum(len(x.completion.token_ids) for x in rolls)
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    m = rl.update(groups)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["mismatch_max_abs"] == pytest.approx(0.5, rel=1e-3)
    assert m["mismatch_kl"] == pytest.approx(((n - 1) * k3(0.2) + k3(0.5)) / n, rel=1e-3)


def test_a_resumed_trainer_takes_the_engine_to_serve_the_checkpoints_version(tiny_dense_dir):
    """After load_state_dict at update 2 the engine starts from the checkpoint's weights (version 2): rollouts of an
    engine that tracks no version are tagged 2 (lag 0, not 2), and sync_final has nothing to send."""
    from train.rl.trainer import version_lag

    class Untracked:  # an engine that reports no weight version
        def __init__(self, inner):
            self.inner, self.loads = inner, 0

        def generate(self, prompts, params):
            out = self.inner.generate(prompts, params)
            for c in out:
                c.versions = None
            return out

        def load_weights(self, sd):
            self.loads += 1

    first = make_rl(tiny_dense_dir)
    for _ in range(2):
        first.train_on(rollouts(first, [1.0, 0, 0, 0, 1, 1, 0, 0]))
    rl = make_rl(tiny_dense_dir)
    rl.engine = Untracked(rl.engine)
    rl.load_state_dict(first.state_dict())
    assert rl.step_idx == 2 and rl.synced_version == 2
    groups = rl.rollout(2)
    assert {v for g in groups for x in g.rollouts for v in x.completion.versions} == {2}
    assert version_lag(groups, rl.step_idx)["version_lag_max"] == 0
    rl.sync_final()
    assert rl.engine.loads == 0


def test_train_on_syncs_every_k_updates_and_reports_the_length_reward(tiny_dense_dir):
    """sync_every=2: the engine gets the weights after updates 2, 4, ... (not 1, 3); each update's metrics carry the
    length reward's coefficient c, which ramps 0.1 -> 1.0 over 4 steps (0.1, 0.325, 0.55)."""
    from train.rl.shaping import LengthRewardConfig

    sched = LengthRewardConfig(t_len=0, coef_start=0.1, coef=1.0, ramp_steps=4)
    rl = make_rl(tiny_dense_dir, sync_every=2, length_reward=True, length_cfg=sched)
    ms = [rl.train_on(rollouts(rl, [1.0, 0, 0, 0, 1, 1, 0, 0])) for _ in range(3)]
    assert ["time_sync_s" in m for m in ms] == [False, True, False]
    assert (rl.step_idx, rl.synced_version) == (3, 2)
    assert [m["length_coef"] for m in ms] == pytest.approx([0.1, 0.325, 0.55])


def test_rollout_metrics_cover_every_group_sampled(tiny_dense_dir):
    """Dynamic sampling over three groups (all right: dropped; 1 of 4 right; 2 of 4 right): reward_mean, accuracy and
    format_ok are over all 12 rollouts sampled, not the 8 trained; prompts_too_long is the run's running count."""
    from envs.base import Score

    right = [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]  # per group, in sampling order
    fmt = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    flat = [(c, f) for g in range(3) for c, f in zip(right[g], fmt[g])]
    rl = make_rl(tiny_dense_dir, dynamic_sampling=True)
    done = [0]

    def verify(items):
        out = [Score(float(c), bool(c), bool(f)) for c, f in flat[done[0]:done[0] + len(items)]]
        done[0] += len(items)
        return out

    rl.verify = verify
    seen = []
    rl.rollout_hook = seen.extend
    rl.prompts_too_long = 3
    groups, m = rl.collect()
    rolls = [x for g in seen for x in g.rollouts]
    assert len(seen) == 3 and len(groups) == 2 and done[0] == 12
    assert (m["groups_sampled"], m["groups_dropped"], m["groups_trained"]) == (3, 1, 2)
    assert m["reward_mean"] == pytest.approx(7 / 12) and m["accuracy"] == pytest.approx(7 / 12)
    assert m["format_ok"] == pytest.approx(8 / 12) and m["prompts_too_long"] == 3
    assert m["response_len"] == pytest.approx(sum(len(x.completion.token_ids) for x in rolls) / 12)
    assert m["truncated_frac"] == pytest.approx(sum(x.completion.finish_reason == "length" for x in rolls) / 12)


def test_a_prompt_of_exactly_max_prompt_tokens_is_sampled_and_evaluated(tiny_dense_dir):
    """A prompt of max_prompt_tokens tokens fits (generated, evaluated greedily); one token more is skipped and
    counted in prompts_too_long, and evaluate() does not send it to the engine."""
    from train.rl.trainer import encode_prompt

    rl = make_rl(tiny_dense_dir)
    pick = rl.curriculum.sample(rl.rng, 1)
    n = len(encode_prompt(rl.tokenizer, pick[0][1].prompt, False, None))
    rl.max_prompt_tokens = n
    assert len(rl.generate_groups(pick)) == 1 and rl.prompts_too_long == 0
    calls = []
    real = rl.engine.generate
    rl.engine.generate = lambda prompts, sp, **kw: calls.append((len(prompts), sp.temperature)) or real(prompts, sp, **kw)
    rl.evaluate(pick)
    assert calls == [(1, 0.0)]  # greedy
    rl.max_prompt_tokens = n - 1
    assert rl.generate_groups(pick) == [] and rl.prompts_too_long == 1
    assert rl.evaluate(pick) == 0.0 and len(calls) == 1


def test_default_prompt_budget_is_the_context_less_the_response_but_at_least_half(tiny_dense_dir):
    """max_prompt_tokens=0: the context less max_new_tokens, but never under half the context."""
    ctx = load_pretrained(tiny_dense_dir).config.max_position_embeddings
    assert ctx >= 16
    assert make_rl(tiny_dense_dir).max_prompt_tokens == ctx - 6
    assert make_rl(tiny_dense_dir, sampling=SamplingConfig(max_new_tokens=ctx - 4)).max_prompt_tokens == ctx // 2
    assert make_rl(tiny_dense_dir, max_prompt_tokens=5).max_prompt_tokens == 5


def test_worker_refuses_inconsistent_step_counts():
    """--sft-steps past --steps, or --sync-every 0, stop the worker at argument parsing."""
    from train.rl.worker import parse_args

    base = ["--exchange", "EX", "--model", "M"]
    assert parse_args(base + ["--steps", "3", "--sft-steps", "3"]).sft_steps == 3
    for bad in (["--steps", "2", "--sft-steps", "3"], ["--steps", "2", "--sync-every", "0"],
                ["--steps", "2", "--checkpoint-every", "-1"], ["--steps", "2", "--tsp", "0"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


def test_worker_resumes_only_from_complete_checkpoints(tmp_path):
    """A checkpoint directory without COMPLETE (a crash mid-save) or with another name is not one to resume from."""
    from train.rl.worker import complete_checkpoints

    for name, done in (("step-000002", True), ("step-000010", True), ("step-000012", False), ("step-x", True)):
        (tmp_path / "trainer_ckpt" / name).mkdir(parents=True)
        if done:
            (tmp_path / "trainer_ckpt" / name / "COMPLETE").write_text("ok\n")
    assert complete_checkpoints(tmp_path) == [2, 10] and complete_checkpoints(tmp_path / "none") == []


def test_greedy_sampling_trains_at_temperature_one(tiny_dense_dir):
    """sampling.temperature=0 (greedy): the engine records log-probs under softmax(logits) (temperature 1), and the
    trainer takes its own at temperature 1 too: with those as the behaviour log-probs every ratio is 1."""
    rl = make_rl(tiny_dense_dir, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0))
    groups = rollouts(rl, [1.0, 0, 0, 0, 1, 1, 0, 0])
    for x in [x for g in groups for x in g.rollouts]:
        with torch.no_grad():
            x.completion.logprobs = row_logprobs(rl.policy, x, 1.0).tolist()
    assert rl.update(groups)["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_sharded_config_mesh_and_batch_refusals():
    """RLUpdateConfig names a bad token budget, dtype or loss in a ValueError (the edges accepted); a mesh whose
    axes are below one is refused even when their product is the world size; a batch with an empty prompt, or
    with routed experts of a shape other than the first sample's, is refused naming the sample."""
    from train.parallel.rl_update import RLUpdateConfig, batch_tensors, check_mesh
    from train.rl.exchange import TrainSample

    for kw, needle in (({"tokens_per_micro": 0}, "tokens_per_micro must be >= 1, got 0"),
                       ({"dtype": "float16"}, "unknown dtype 'float16'; choose one of float32, bfloat16"),
                       ({"loss": "no_such_loss"}, "no_such_loss")):
        with pytest.raises(ValueError, match=needle):
            RLUpdateConfig(**kw)
    assert RLUpdateConfig(tokens_per_micro=1, dtype="bfloat16").tokens_per_micro == 1
    for world, dp, tsp in ((2, -1, -2), (4, -2, -2), (0, 0, 3), (2, 2, 2)):
        with pytest.raises(ValueError, match=f"mesh dp={dp} x tsp={tsp} does not match the world size {world}"):
            check_mesh(world, dp, tsp)
    check_mesh(4, 2, 2)
    check_mesh(3, 3, 1)
    s = [TrainSample([1, 2], [3], [-1.0], 0.5, routed_experts=torch.zeros(3, 2, 2, dtype=torch.int16)),
         TrainSample([1], [3, 4], [-1.0] * 2, 0.5, routed_experts=torch.zeros(3, 2, 1, dtype=torch.int16))]
    with pytest.raises(ValueError, match=r"sample 1: routed_experts has shape \(3, 2, 1\), expected \[3, 2, 2\]"):
        batch_tensors(s, 0, "cpu")
    s[1].routed_experts = torch.zeros(2, 2, 2, dtype=torch.int16)  # one row per token: 3 tokens
    with pytest.raises(ValueError, match=r"sample 1: routed_experts has shape \(2, 2, 2\), expected \[3, 2, 2\]"):
        batch_tensors(s, 0, "cpu")
    s[1].routed_experts = torch.ones(3, 2, 2, dtype=torch.int16)
    t = batch_tensors(s, 0, "cpu")
    assert [r.shape for r in t.routed_experts] == [(2, 3, 2)] * 2 and t.routed_experts[0][1].tolist() == [[1, 1]] * 3
    with pytest.raises(ValueError, match="every sample needs at least one prompt token"):
        batch_tensors([TrainSample([], [3], [-1.0], 0.5)], 0, "cpu")
