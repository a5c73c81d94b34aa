"""Advantage estimators and policy losses: hand-computed values and loop-based references."""
import math

import pytest
import torch

from train.rl import ADVANTAGES, LOSSES, LossConfig, Registry, compute_advantages, get_advantage, get_loss
from train.rl.losses import AGG_MODES, MetricSums, aggregate, dppo_tv_mask, kl_estimate, mismatch_metrics, seq_count

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


# ------------------------------------------------------------------------------------------------
# registry and advantages


def test_registry_errors_name_choices():
    reg = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(KeyError, match="unknown thing 'b'; choose one of a"):
        reg.get("b")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)
    assert set(ADVANTAGES.names()) == {"grpo", "drgrpo", "maxrl", "rloo"}
    assert {"ppo", "grpo", "drgrpo", "dapo", "gspo", "cispo", "dppo_tv"} <= set(LOSSES.names())
    with pytest.raises(KeyError, match="policy loss 'nope'"):
        get_loss("nope")


@pytest.mark.parametrize("name, expected", [
    # group 1: rewards [1,0,0,0], mean 0.25, unbiased std 0.5; group 2 all equal -> 0
    ("grpo", [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]),
    ("drgrpo", [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]),
    ("maxrl", [3.0, -1.0, -1.0, -1.0, 0, 0, 0, 0]),
    ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0]),
])
def test_advantages_by_hand(name, expected):
    adv = get_advantage(name)([1.0, 0, 0, 0, 1, 1, 1, 1], 4, eps=1e-12)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32))


def test_drgrpo_adds_the_length_bonus_to_its_advantage():
    """Dr. GRPO's advantage is r - mean + bonus (mean 0.5 here), the bonus not dropped."""
    adv = compute_advantages("drgrpo", [1.0, 0, 1, 0], 4, bonus=[0.25, 0, 0.5, 0])
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.5, 1.0, -0.5]))


def test_maxrl_zero_mean_guard_and_bonus_in_numerator_only():
    adv = get_advantage("maxrl")([0.0, 0, 0, 0, 1, 1, 1, 0], 4, bonus=[0.5, 0, 0, 0, 0.375, 0, 0, 0])
    # group 1: mean 0 -> all 0 (bonus too); group 2: mean 0.75, (1 + 0.375 - 0.75)/0.75 = 0.8333
    torch.testing.assert_close(adv, torch.tensor([0, 0, 0, 0, 0.625 / 0.75, 1 / 3, 1 / 3, -1.0]))


def test_group_ids_of_different_sizes():
    adv = get_advantage("grpo")(torch.tensor([1.0, 0, 1, 1, 0]), torch.tensor([7, 7, 3, 3, 3]), eps=0)
    s2, s3 = math.sqrt(0.5), math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s2, -0.5 / s2, (1 / 3) / s3, (1 / 3) / s3, (-2 / 3) / s3]))
    # a single-rollout group has no baseline to compare with: advantage 0
    assert get_advantage("grpo")([1.0, 1.0, 0.0], torch.tensor([0, 1, 1]))[0] == 0


def test_advantage_errors_and_whitening():
    with pytest.raises(ValueError, match="does not divide"):
        get_advantage("grpo")([1.0, 0, 1], 2)
    with pytest.raises(ValueError, match="at least 2"):
        get_advantage("rloo")([1.0, 0, 1], torch.tensor([0, 0, 1]))
    for size in (0, -2):  # (-2 "divides" 4: the groups were ids 0, -1, -1, -2)
        with pytest.raises(ValueError, match=f"group size {size} does not divide the 4 rewards"):
            get_advantage("drgrpo")([1.0, 0, 1, 0], size)
    with pytest.raises(ValueError, match=r"group ids have shape \(3,\), expected \(4,\)"):
        get_advantage("grpo")([1.0, 0, 1, 0], torch.tensor([0, 0, 1]))
    with pytest.raises(KeyError, match="choose one of drgrpo, grpo, maxrl, rloo"):
        compute_advantages("std", [1.0], 1)
    w = compute_advantages("drgrpo", [1.0, 0, 0, 0], 4, whiten_batch=True)
    torch.testing.assert_close(w, torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]))


# ------------------------------------------------------------------------------------------------
# losses by hand

# two rollouts, old probability 0.5 everywhere; ratios [[1.5, 0.9], [0.7, (masked)]], A = [+1, -2]
OLD = torch.full((2, 2), math.log(0.5), dtype=D)
RATIO = t([[1.5, 0.9], [0.7, 5.0]])
MASK = t([[1, 1], [1, 0]])
ADV = t([1.0, -2.0])
# PPO tokens, clip [0.8, 1.28]: -min(rA, clip(r)A) = [[-1.28 (clipped), -0.9], [1.6 (clipped), -]]
PPO_BY_AGG = {"token_mean": -0.58 / 3, "seq_mean_token_mean": (-1.09 + 1.6) / 2,
              "seq_mean_token_sum": (-2.18 + 1.6) / 2}


def _lp():
    return (OLD + RATIO.log()).clone().requires_grad_(True)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_each_aggregation_by_hand(agg):
    lp = _lp()
    loss, m = get_loss("ppo")(lp, OLD, None, ADV, MASK, LossConfig(agg=agg))
    assert loss.item() == pytest.approx(PPO_BY_AGG[agg])
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # only the unclipped token (0, 1) has a gradient: d(-r A)/d logp = -r A = -0.9, times its agg weight
    weight = {"token_mean": 1 / 3, "seq_mean_token_mean": 1 / 4, "seq_mean_token_sum": 1 / 2}[agg]
    torch.testing.assert_close(lp.grad, t([[0, -0.9 * weight], [0, 0]]))


def test_loss_default_aggregations_and_norm_len():
    for name, agg in (("grpo", "seq_mean_token_mean"), ("drgrpo", "seq_mean_token_sum"), ("dapo", "token_mean")):
        assert get_loss(name)(_lp(), OLD, None, ADV, MASK)[0].item() == pytest.approx(PPO_BY_AGG[agg])
    loss, _ = get_loss("drgrpo")(_lp(), OLD, None, ADV, MASK, LossConfig(norm_len=4))
    assert loss.item() == pytest.approx((-2.18 / 4 + 1.6 / 4) / 2)


def test_cispo_by_hand():
    lp = _lp()
    cfg = LossConfig(cispo_clip_low=0.2, cispo_clip_high=0.28)
    loss, m = get_loss("cispo")(lp, OLD, None, ADV, MASK, cfg)
    # weights clip(r) = [[1.28, 0.9], [0.8]]; tokens -w A = [[-1.28, -0.9], [1.6]]; token mean
    assert loss.item() == pytest.approx(-0.58 / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # every token keeps a gradient -w A (the clipped ones too, unlike PPO)
    torch.testing.assert_close(lp.grad, t([[-1.28, -0.9], [1.6, 0]]) / 3)
    # the default bounds [0, 4] leave these ratios unclipped
    assert get_loss("cispo")(_lp(), OLD, None, ADV, MASK)[1]["clip_frac"] == 0


def test_a_token_past_the_log_ratio_clamp_keeps_its_weighted_gradient():
    """CISPO and DPPO take ``sg(w) A grad logp`` for every token they keep, GSPO ``s A grad logp_t / |y|``; the
    gradient went through the log-ratio clamped at +-20 for overflow safety, so a token past it had none."""
    for name, cfg, gap, adv, want_w in [
            ("cispo", LossConfig(), 21.0, 1.0, 1 + LossConfig().cispo_clip_high),
            ("cispo", LossConfig(), 21.0, -1.0, 1 + LossConfig().cispo_clip_high),
            ("cispo", LossConfig(cispo_clip_low=0.1), -21.0, 1.0, 0.9),
            ("dppo_tv", LossConfig(dppo_ratio_cap=20.0), 21.0, 1.0, 20.0)]:  # pi - mu tiny: inside the region
        mu = torch.tensor([[-25.0 if gap > 0 else -1.0]])
        lp = (mu + gap).requires_grad_(True)
        loss, _ = get_loss(name)(lp, mu, None, torch.tensor([adv]), torch.ones(1, 1), cfg)
        loss.backward()
        assert lp.grad.item() == pytest.approx(-want_w * adv, rel=1e-5), (name, gap, adv)
    # GSPO: one of n tokens at +21, the sequence ratio inside the clip range: every token's gradient is s / n
    n = 100_000
    old = torch.full((1, n), -1.0)
    old[0, 0] = -25.0
    lp = (old + torch.cat([torch.tensor([21.0]), torch.zeros(n - 1)])[None]).requires_grad_(True)
    loss, m = get_loss("gspo")(lp, old, None, torch.tensor([1.0]), torch.ones(1, n), LossConfig())
    loss.backward()
    s = math.exp(20.0 / n)  # the clamped log-ratio is the ratio's value
    assert m["clip_frac"] == 0 and lp.grad[0, 0].item() == pytest.approx(-s / n, rel=1e-4)
    assert lp.grad[0, 1].item() == pytest.approx(-s / n, rel=1e-4)


def test_gspo_by_hand():
    old = torch.zeros(2, 2, dtype=D)
    lp = t([[0.001, -0.0004], [0.002, 0.002]]).requires_grad_(True)
    loss, m = get_loss("gspo")(lp, old, None, t([1.0, 1.0]), torch.ones(2, 2, dtype=D))
    s0, s1 = math.exp(0.0003), math.exp(0.002)  # geometric-mean ratios; s1 > 1 + 4e-4 is clipped
    assert loss.item() == pytest.approx((-s0 - 1.0004) / 2, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["seq_ratio_mean"] == pytest.approx((s0 + s1) / 2)  # (2 tokens each)
    # over loss tokens: a 1-token sequence weighs half a 2-token one; a row without loss tokens not at all
    three = torch.zeros(3, 2, dtype=D)
    m = get_loss("gspo")(three + t([[0.002, 0.002], [0.01, 9.0], [5.0, 5.0]]), three, None, t([1.0, 1.0, 1.0]),
                         t([[1, 1], [1, 0], [0, 0]]))[1]
    assert m["seq_ratio_mean"].item() == pytest.approx((2 * s1 + math.exp(0.01)) / 3)
    loss.backward()
    # d(-s0)/d logp_t = -s0 / 2 (mean over 2 tokens), / 2 rollouts
    torch.testing.assert_close(lp.grad, t([[-s0 / 4, -s0 / 4], [0, 0]]))


# DPPO Binary-TV, delta 0.1: row 0 A=+1, row 1 A=-2; mu = old here
DPPO_PI = t([[0.65, 0.55, 0.30, 0.05], [0.35, 0.80, 0.45, 0.5]])
DPPO_MU = t([[0.50, 0.50, 0.50, 0.01], [0.50, 0.50, 0.50, 0.5]])
DPPO_MASK = t([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_dppo_tv_mask_cases():
    adv = t([1.0, -2.0])[:, None].expand(2, 4)
    out = dppo_tv_mask(DPPO_PI.log(), DPPO_MU.log(), adv, 0.1)
    # A>0: pi-mu = 0.15 > delta masked; 0.05 kept; -0.2 kept (only increases are limited);
    # 0.05->0.01 kept although the ratio is 5 (PPO would clip it)
    # A<0: pi-mu = -0.15 masked; +0.3 kept; -0.05 kept
    assert out.tolist() == [[True, False, False, False], [True, False, False, False]]
    # equality with the threshold is inside the trust region; A = 0 is never masked
    at_threshold = dppo_tv_mask(t([[0.75, 0.25]]).log(), t([[0.5, 0.5]]).log(), t([[1.0, -1.0]]), 0.25)
    assert at_threshold.tolist() == [[False, False]]
    assert dppo_tv_mask(t([[0.9, 0.1]]).log(), t([[0.5, 0.5]]).log(), t([[0.0, 0.0]]), 0.1).tolist() == [[False, False]]


def test_dppo_tv_by_hand():
    lp = DPPO_PI.log().requires_grad_(True)
    loss, m = get_loss("dppo_tv")(lp, DPPO_MU.log(), None, t([1.0, -2.0]), DPPO_MASK)
    # kept tokens: -ratio A; row 0: -1.1 - 0.6 - 5 = -6.7; row 1: 2 * (1.6 + 0.9) = 5.0; seq_mean_token_sum
    assert loss.item() == pytest.approx((-6.7 + 5.0) / 2)
    assert m["clip_frac"] == pytest.approx(2 / 7)
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[0, -1.1, -0.6, -5.0], [0, 3.2, 1.8, 0]]) / 2)
    # the truncation cap bounds the weight of the 0.01 -> 0.05 token: value 2 A, gradient 2 A
    lp2 = DPPO_PI.log().requires_grad_(True)
    loss2, _ = get_loss("dppo_tv")(lp2, DPPO_MU.log(), None, t([1.0, -2.0]), DPPO_MASK, LossConfig(dppo_ratio_cap=2.0))
    assert loss2.item() == pytest.approx((-3.7 + 5.0) / 2)
    loss2.backward()
    assert lp2.grad[0, 3].item() == pytest.approx(-1.0)
    # clip_frac counts the token whose weight the cap cut (5 -> 2) besides the two the trust region masks
    assert get_loss("dppo_tv")(DPPO_PI.log(), DPPO_MU.log(), None, t([1.0, -2.0]), DPPO_MASK,
                               LossConfig(dppo_ratio_cap=2.0))[1]["clip_frac"] == pytest.approx(3 / 7)


def test_dppo_mask_uses_rollout_probs_and_ratio_uses_old():
    pi, old, mu = t([[0.65, 0.55, 0.45]]), t([[0.6, 0.6, 0.5]]), t([[0.5, 0.4, 0.5]])
    loss, m = get_loss("dppo_tv")(pi.log(), old.log(), mu.log(), t([1.0]), torch.ones(1, 3, dtype=D))
    # vs mu: +0.15 masked, +0.15 masked, -0.05 kept with ratio 0.45/0.5 = 0.9
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(-0.9)


def test_truncated_importance_sampling_and_mismatch_metrics():
    lp = _lp()
    rollout = OLD - t([[math.log(3), math.log(0.5)], [0.0, 9.0]])  # exp(old - rollout) = [[3, .5], [1, -]]
    loss, m = get_loss("dapo")(lp, OLD, rollout, ADV, MASK, LossConfig(tis_cap=2.0))
    # token losses [[-1.28, -0.9], [1.6]] times weights [[2 (capped), 0.5], [1]]
    assert loss.item() == pytest.approx((-2.56 - 0.45 + 1.6) / 3)
    assert m["tis_capped_frac"] == pytest.approx(1 / 3)
    assert m["mismatch_max_abs"] == pytest.approx(math.log(3))  # the masked token is ignored
    d = [math.log(3), math.log(0.5), 0.0]
    assert m["mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    r = [1.5, 0.9, 0.7]
    assert m["ratio_mean"] == pytest.approx(sum(r) / 3)
    assert m["approx_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3)
    # without tis_cap the engine log-probs only feed the metrics
    assert get_loss("dapo")(_lp(), OLD, rollout, ADV, MASK)[0].item() == pytest.approx(PPO_BY_AGG["token_mean"])


def test_mismatch_metrics_ignore_padding():
    """A masked position (mu 0 against log-prob -5) enters neither mismatch metric: only d = 0.2 counts."""
    m = mismatch_metrics(t([[-1.0, -5.0]]), t([[-1.2, 0.0]]), t([[1, 0]]))
    assert float(m["mismatch_max_abs"]) == pytest.approx(0.2)
    assert float(m["mismatch_kl"]) == pytest.approx(math.exp(0.2) - 1.2)


def test_metric_sums_max_keeps_the_largest_micro_batch_value():
    """MetricSums.max is the max over micro-batches, not the last one."""
    acc = MetricSums()
    for v in (0.5, 3.0, 1.0):
        acc.max("mismatch_max_abs", torch.tensor(v))
    assert acc.floats() == ({}, {"mismatch_max_abs": 3.0})


def test_kl_penalty_k1_k3():
    lp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(0.5) * -1 - 1)
    base = get_loss("dapo")(_lp(), OLD, None, ADV, MASK)[0].item()
    ref = OLD - math.log(2)  # ref prob = old / 2
    for kind in ("k1", "k3"):
        loss, m = get_loss("dapo")(_lp(), OLD, None, ADV, MASK, LossConfig(kl_coef=0.1, kl_type=kind), ref_logprobs=ref)
        kls = [kl_estimate(torch.log(0.5 * r), ref[0, 0], kind).item() for r in RATIO.flatten()[:3]]
        assert m["kl_ref"] == pytest.approx(sum(kls) / 3)
        assert loss.item() == pytest.approx(base + 0.1 * sum(kls) / 3)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        get_loss("ppo")(_lp(), OLD, None, ADV, MASK, LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_penalty_gradient_in_expectation(kind):
    """The penalty's gradient, taken at each token of a 4-token policy and averaged over pi exactly: k1's is
    that of KL(pi || ref) (its own gradient, grad log pi, averages to zero: it regularised nothing), k3's that
    of KL(ref || pi), as GRPO's and verl's low_var_kl."""
    theta = torch.tensor([1.0, 0.2, -0.5, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.3, -1.0], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    total = 0.0
    for y in range(4):  # E_{y ~ pi} of the loss at y, y a fixed sample as the trainer has it
        lp = logp[y].view(1, 1)
        loss, _ = get_loss("grpo")(lp, lp.detach(), None, torch.zeros(1, dtype=torch.float64),
                                   torch.ones(1, 1, dtype=torch.float64), LossConfig(kl_coef=1.0, kl_type=kind),
                                   ref_logprobs=ref[y].view(1, 1))
        total = total + logp[y].detach().exp() * loss
    got = torch.autograd.grad(total, theta)[0]
    p = torch.log_softmax(theta, -1)
    kl = (p.exp() * (p - ref)).sum() if kind == "k1" else (ref.exp() * (ref - p)).sum()
    torch.testing.assert_close(got, torch.autograd.grad(kl, theta)[0], rtol=1e-9, atol=1e-12)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown loss agg 'mean'"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match="unknown kl_type"):
        LossConfig(kl_type="k2")
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        get_loss("ppo")(_lp(), OLD[:, :1], None, ADV, MASK)
    with pytest.raises(ValueError, match="advantages have shape"):
        get_loss("ppo")(_lp(), OLD, None, t([1.0, 2, 3]), MASK)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_denom_makes_micro_batches_sum_to_the_full_batch(agg):
    g = torch.Generator().manual_seed(0)
    tok = torch.randn(4, 5, generator=g, dtype=D)
    mask = (torch.rand(4, 5, generator=g) > 0.3).to(D)
    full = aggregate(tok, mask, agg)
    denom = mask.sum().item() if agg == "token_mean" else 4
    parts = aggregate(tok[:1], mask[:1], agg, denom=denom) + aggregate(tok[1:], mask[1:], agg, denom=denom)
    torch.testing.assert_close(parts, full)


# ------------------------------------------------------------------------------------------------
# gradients against an independent loop-based reference


def _ref_aggregate(vals, mask, mode, norm_len=None):
    B, T = mask.shape
    if mode == "token_mean":
        terms = [vals[b][i] for b in range(B) for i in range(T) if mask[b, i] > 0]
        return sum(terms) / len(terms)
    rows = []
    for b in range(B):
        terms = [vals[b][i] for i in range(T) if mask[b, i] > 0]
        s = sum(terms) if terms else torch.zeros((), dtype=D)
        if mode == "seq_mean_token_mean":
            s = s / max(len(terms), 1)
        elif norm_len:
            s = s / norm_len
        rows.append(s)
    live = sum(1 for b in range(B) if mask[b].sum() > 0)  # fully masked rollouts do not count
    return sum(rows) / max(live, 1)


def _reference(name, lp, old, rollout, adv, mask, cfg):
    """Loop-based (value, grad_surrogate) per token; they differ only where the loss is written with
    a stop-gradient IS weight (CISPO, capped DPPO): there the value is w A and the gradient comes from
    the textbook surrogate sg(w) A log pi."""
    B, T = lp.shape
    vals, grads = [[None] * T for _ in range(B)], [[None] * T for _ in range(B)]
    for b in range(B):
        n = int(mask[b].sum())
        seq_lr = sum(lp[b, i] - old[b, i] for i in range(T) if mask[b, i] > 0) / max(n, 1)
        for i in range(T):
            a, r = adv[b], torch.exp(lp[b, i] - old[b, i])
            if name in ("ppo", "grpo", "drgrpo", "dapo", "gspo"):
                lo, hi = (cfg.gspo_clip_low, cfg.gspo_clip_high) if name == "gspo" else (cfg.clip_low, cfg.clip_high)
                s = torch.exp(seq_lr) if name == "gspo" else r
                if name == "gspo" and rollout is not None and cfg.tis_cap is not None:
                    # per-token TIS weights differ within a rollout: the gradient is then that of the
                    # GSPO-token objective (paper eq. 16), s_t = sg(s) pi_t / sg(pi_t)
                    s = s.detach() * torch.exp(lp[b, i] - lp[b, i].detach())
                v = -torch.min(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a)
                if name != "gspo" and cfg.clip_ratio_c is not None and a < 0 and v > -a * cfg.clip_ratio_c:
                    v = (-a * cfg.clip_ratio_c).detach()  # dual clip: constant cap
                g = v
            elif name == "cispo":
                w = float(r.detach().clamp(1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high))
                v, g = torch.tensor(-w * float(a), dtype=D), -w * a * lp[b, i]
            else:  # dppo_tv
                mu = math.exp(float((rollout if rollout is not None else old)[b, i]))
                diff = math.exp(float(lp[b, i].detach())) - mu
                if (a > 0 and diff > cfg.delta) or (a < 0 and diff < -cfg.delta):
                    v = g = torch.zeros((), dtype=D)
                else:
                    v = g = -r * a
            if rollout is not None and cfg.tis_cap is not None:
                w = min(math.exp(float(old[b, i] - rollout[b, i])), cfg.tis_cap)
                v, g = v * w, g * w
            vals[b][i], grads[b][i] = v, g
    default = {"ppo": "seq_mean_token_mean", "grpo": "seq_mean_token_mean", "drgrpo": "seq_mean_token_sum",
               "dapo": "token_mean", "gspo": "seq_mean_token_mean", "cispo": "token_mean",
               "dppo_tv": "seq_mean_token_sum"}[name]
    mode = cfg.agg or default
    return _ref_aggregate(vals, mask, mode, cfg.norm_len), _ref_aggregate(grads, mask, mode, cfg.norm_len)


def _random_batch(seed, scale):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    old = torch.log(torch.rand(B, T, generator=g, dtype=D) * 0.9 + 0.05)
    lp = old + scale * torch.randn(B, T, generator=g, dtype=D)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    lengths = torch.tensor([6, 4, 1, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(D)
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0], dtype=D)
    return lp, old, rollout, adv, mask


@pytest.mark.parametrize("name", ["ppo", "drgrpo", "dapo", "gspo", "cispo", "dppo_tv"])
@pytest.mark.parametrize("agg", [None, *AGG_MODES])
@pytest.mark.parametrize("tis", [None, 1.2])
def test_loss_and_grad_match_loop_reference(name, agg, tis):
    scale = 1e-3 if name == "gspo" else 0.3
    cfg = LossConfig(agg=agg, tis_cap=tis, norm_len=8, cispo_clip_low=0.1, cispo_clip_high=0.2)
    for seed in range(3):
        lp, old, rollout, adv, mask = _random_batch(seed, scale)
        x = lp.clone().requires_grad_(True)
        loss, metrics = get_loss(name)(x, old, rollout if tis else None, adv, mask, cfg)
        loss.backward()
        y = lp.clone().requires_grad_(True)
        ref_val, ref_surrogate = _reference(name, y, old, rollout if tis else None, adv, mask, cfg)
        ref_surrogate.backward()
        assert loss.item() == pytest.approx(float(ref_val.detach()), rel=1e-9, abs=1e-12)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
        assert 0 <= metrics["clip_frac"] <= 1


def test_reference_cases_exercise_clipping():
    """The random batches above hit both sides of every clip/trust-region decision."""
    cfg = LossConfig(cispo_clip_low=0.1, cispo_clip_high=0.2)
    for name, scale in (("ppo", 0.3), ("gspo", 1e-3), ("cispo", 0.3), ("dppo_tv", 0.3)):
        fracs = [get_loss(name)(*_random_batch(s, scale), cfg)[1]["clip_frac"] for s in range(3)]
        assert 0 < sum(fracs) / 3 < 1, (name, fracs)


# ------------------------------------------------------------------------------------------------
# breakages of issue 16: all-equal groups, signed rewards, fully masked rollouts, dual clip


def test_grpo_all_equal_group_carries_its_bonus_undivided():
    # group 1 all correct (std 0): the advantage is the length bonus alone, not bonus / eps (~4e5);
    # group 2: mean 0.25, std 0.5, the bonus added after the normalisation: (1 - 0.25) / 0.5 + 0.5 = 2.0
    bonus = [0.375, 0.25, 0.0, -0.375, 0.5, 0, 0, 0]
    adv = get_advantage("grpo")([1.0, 1, 1, 1, 1, 0, 0, 0], 4, eps=1e-12, bonus=bonus)
    torch.testing.assert_close(adv, torch.tensor([0.375, 0.25, 0.0, -0.375, 2.0, -0.5, -0.5, -0.5]))
    # rewards that differ by a hair (soft overlong shaping: one of four correct answers 1 token into the buffer):
    # the bonus was divided by their std (186,209 for a 2e-6 difference); now continuous in the rewards
    near = get_advantage("grpo")([1.0, 1, 1, 1 - 2e-6], 4, bonus=[0.375, 0.375, 0.375, 0.0])
    assert near.abs().max().item() <= 3 ** 0.5 + 0.375
    # equal non-binary rewards, with eps = 0 too (0.3 * 4 / 4 is not exactly 0.3 in float), and a
    # group of one rollout: no scale, the bonus (or 0) alone
    adv = get_advantage("grpo")([0.3, 0.3, 0.3, 0.7], torch.tensor([0, 0, 0, 1]), eps=0.0, bonus=[0.1, 0, 0, 0.2])
    torch.testing.assert_close(adv, torch.tensor([0.1, 0.0, 0.0, 0.2]))
    assert get_advantage("grpo")([0.3, 0.3, 0.3], 3, eps=0.0).tolist() == [0.0, 0.0, 0.0]
    # seven rewards of 0.1: in float32 their mean is off by a hair, the std ~1e-8 > eps = 0; equal rewards stay flat
    assert get_advantage("grpo")([0.1] * 7, 7, eps=0.0).tolist() == [0.0] * 7


def test_grpo_group_with_std_at_most_eps_is_flat_though_not_bit_equal():
    """A group whose std (5e-7) is <= eps gets its bonus alone, though its rewards differ by a hair."""
    r = [1.0, 1.0, 1.0, 1.0 - 1e-6]
    assert get_advantage("grpo")(r, 4).tolist() == [0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(get_advantage("grpo")(r, 4, bonus=[0.1, 0, 0, 0]), torch.tensor([0.1, 0, 0, 0]))


def test_maxrl_refuses_negative_rewards():
    # reward=score on [-1, 1]: the mean 0.025 made this [39, -37, -1, -1]
    with pytest.raises(ValueError, match=r"maxrl needs rewards >= 0.*-0.9.*reward=correct"):
        get_advantage("maxrl")([1.0, -0.9, 0.0, 0.0], 4)
    with pytest.raises(ValueError, match="maxrl needs rewards >= 0"):
        compute_advantages("maxrl", [0.5, 0.5, -0.25, 1.0], 2)


def test_maxrl_non_binary_and_all_equal_rewards_by_hand():
    # partial credit in [0, 1]: mean 0.5 -> (r - 0.5) / 0.5; scale-free: x10 rewards give the same
    expected = torch.tensor([1.0, 0.0, -1.0, 0.0])
    torch.testing.assert_close(get_advantage("maxrl")([1.0, 0.5, 0.0, 0.5], 4), expected)
    torch.testing.assert_close(get_advantage("maxrl")([10.0, 5.0, 0.0, 5.0], 4), expected)
    # equal positive rewards: only the bonus, over the mean: 0.1 / 0.2; all zero: 0, bonus included
    adv = get_advantage("maxrl")([0.2, 0.2, 0.2, 0.2, 0, 0, 0, 0], 4, bonus=[0.1, 0, 0, 0, 0.3, 0, 0, 0])
    torch.testing.assert_close(adv, torch.tensor([0.5, 0, 0, 0, 0, 0, 0, 0]))


def test_seq_aggregation_excludes_fully_masked_rollouts():
    tok = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = t([[1, 1], [0, 0], [1, 0]])  # rollout 1 is fully masked (keep=False / overlong filtered)
    assert aggregate(tok, mask, "seq_mean_token_sum").item() == pytest.approx((3.0 + 5.0) / 2)
    assert aggregate(tok, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 5.0) / 2)
    assert aggregate(tok, mask, "token_mean").item() == pytest.approx(8.0 / 3)
    assert aggregate(tok, torch.zeros_like(mask), "seq_mean_token_sum").item() == 0.0
    assert seq_count(mask) == 2 and seq_count(torch.zeros_like(mask)) == 1
    # through a loss: appending a fully masked rollout changes nothing (it used to scale by 2/3)
    lp = _lp()
    base = get_loss("drgrpo")(lp, OLD, None, ADV, MASK)[0]
    pad = lambda x, v: torch.cat([x, torch.full((1, 2), v, dtype=D)])  # noqa: E731
    lp3 = pad(_lp().detach(), math.log(0.5)).requires_grad_(True)
    loss3, _ = get_loss("drgrpo")(lp3, pad(OLD, math.log(0.5)), None, t([1.0, -2.0, 5.0]), pad(MASK, 0.0))
    assert loss3.item() == pytest.approx(base.item())


# dual clip, clip [0.8, 1.28], c = 3: row 0 A = -1 with ratios [4, 2, 0.5]; row 1 A = +1 with ratio 4
DUAL_LP = t([[math.log(4.0), math.log(2.0), math.log(0.5)], [math.log(4.0), 0.0, 0.0]])
DUAL_MASK = t([[1, 1, 1], [1, 0, 0]])


def test_dual_clip_by_hand():
    old = torch.zeros(2, 3, dtype=D)
    adv = t([-1.0, 1.0])
    lp = DUAL_LP.clone().requires_grad_(True)
    loss, m = get_loss("dapo")(lp, old, None, adv, DUAL_MASK, LossConfig(clip_ratio_c=3.0))
    # PPO tokens max(-rA, -clip(r)A): [4, 2, 0.8 (clipped)], [-1.28 (clipped)]; the dual clip caps the
    # A < 0 token at -A c = 3: [3, 2, 0.8], [-1.28]; token mean over 4
    assert loss.item() == pytest.approx((3 + 2 + 0.8 - 1.28) / 4)
    assert m["clip_frac_dual"] == pytest.approx(1 / 4)
    assert m["clip_frac"] == pytest.approx(3 / 4)  # no gradient: the dual-clipped and the two clipped tokens
    loss.backward()
    # only the ratio-2 token keeps a gradient: d(-r A)/d logp = -r A = 2, over 4 tokens
    torch.testing.assert_close(lp.grad, t([[0, 0.5, 0], [0, 0, 0]]))
    # off by default (None): the ratio-4 token keeps loss 4 and its gradient
    loss0, m0 = get_loss("dapo")(DUAL_LP, old, None, adv, DUAL_MASK)
    assert loss0.item() == pytest.approx((4 + 2 + 0.8 - 1.28) / 4)
    assert m0["clip_frac"] == pytest.approx(2 / 4) and "clip_frac_dual" not in m0
    with pytest.raises(ValueError, match="clip_ratio_c .* must be > 1"):
        LossConfig(clip_ratio_c=1.0)


@pytest.mark.parametrize("name", ["ppo", "drgrpo", "dapo"])
def test_dual_clip_matches_loop_reference(name):
    cfg = LossConfig(clip_ratio_c=1.5)
    duals = []
    for seed in range(3):
        lp, old, _, adv, mask = _random_batch(seed, 0.6)
        x = lp.clone().requires_grad_(True)
        loss, metrics = get_loss(name)(x, old, None, adv, mask, cfg)
        loss.backward()
        y = lp.clone().requires_grad_(True)
        ref_val, ref_surrogate = _reference(name, y, old, None, adv, mask, cfg)
        ref_surrogate.backward()
        assert loss.item() == pytest.approx(float(ref_val.detach()), rel=1e-9, abs=1e-12)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
        duals.append(metrics["clip_frac_dual"])
    assert 0 < sum(duals) / 3 < 1, duals  # the random batches hit the dual clip and miss it
