"""ZAYA1's difficulty scheduler (eqs. 11-14) and the least-sampled-first weighted environment sampler:
hand-computed posterior updates, ESS and resampling, the up/down rule, convergence of the start
calibration on a simulated policy, state round trips."""
from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter

import pytest

from envs.curriculum import Curriculum, ZayaScheduler, make_controller


def _pass(d, mu, s=1.0):
    return 1.0 / (1.0 + math.exp((d - mu) / s))


def _binom(k, n, p):
    return math.comb(n, k) * p ** k * (1 - p) ** (n - k)


# -- eq. 12-13: Binomial posterior update and ESS ------------------------------------------------

def test_posterior_update_hand_computed():
    c = ZayaScheduler(candidates=[(0, 1), (2, 1), (4, 1)], ess_threshold=0.0, jitter=0.0)
    assert c.weights() == pytest.approx([1 / 3] * 3) and c.ess() == pytest.approx(3.0)
    c.update(2, [1, 1, 1, 0])         # k = 3 of G = 4 at d = 2
    # pass_m(2) = sigmoid(-(2 - mu)): 0.11920, 0.5, 0.88080; w_m ~ Binomial(3; 4, pass_m(2))
    # = 0.0059676, 0.25, 0.32582 -> normalised:
    assert c.weights() == pytest.approx([0.0102573, 0.4297119, 0.5600308], abs=1e-6)
    assert c.ess() == pytest.approx(1 / (0.0102573 ** 2 + 0.4297119 ** 2 + 0.5600308 ** 2), rel=1e-5)
    assert c.ess() == pytest.approx(2.00645, abs=1e-5)
    assert c.history == [[2, 3, 4]] and c.resamples == 0
    c.update(2, [1, 1, 1, 0])         # a second identical group multiplies the same factors in again
    lik = [_binom(3, 4, _pass(2, mu)) ** 2 for mu in (0, 2, 4)]
    assert c.weights() == pytest.approx([v / sum(lik) for v in lik], rel=1e-9)


def _two_groups(threshold):
    c = ZayaScheduler(candidates=[(0, 1), (2, 1), (4, 1), (6, 1)], ess_threshold=threshold, jitter=0.0,
                      recency=0.5, seed=3)
    c.update(2, [1, 1, 1, 0])
    first = (c.ess(), c.resamples)
    c.update(3, [1, 1, 1, 1])
    return c, first


def test_ess_resampling_triggers_below_threshold():
    mus = (0, 2, 4, 6)
    # after the first group the ESS is 2.4369 >= 0.5 * 4: no resampling
    w1 = [_binom(3, 4, _pass(2, mu)) for mu in mus]
    ess1 = sum(w1) ** 2 / sum(v * v for v in w1)
    assert ess1 == pytest.approx(2.43686, abs=1e-5)
    # after the second (4 of 4 at d = 3) it is 1.9172 < 2 (w ~ 0, 0.00869, 0.61850, 0.37281)
    w2 = [a * _binom(4, 4, _pass(3, mu)) for a, mu in zip(w1, mus)]
    ess2 = sum(w2) ** 2 / sum(v * v for v in w2)
    assert ess2 == pytest.approx(1.91718, abs=1e-5)

    c, first = _two_groups(threshold=0.45)          # threshold 1.8: never triggers
    assert first[0] == pytest.approx(ess1) and first[1] == 0
    assert c.resamples == 0 and c.ess() == pytest.approx(ess2)
    assert c.history == [[2, 3, 4], [3, 4, 4]] and c.folded == []

    c, first = _two_groups(threshold=0.5)           # threshold 2: the second group triggers it
    assert first == (pytest.approx(ess1), 0)
    assert c.resamples == 1 and c.history == []
    # resampled with replacement from the old pool (no jitter): only old candidates, weighted ones
    assert all(cand in ([0.0, 1.0], [2.0, 1.0], [4.0, 1.0], [6.0, 1.0]) for cand in c.candidates)
    assert len(c.candidates) == 4
    # the history folded with recency 0.5: the older group counts half
    assert c.folded == [[2, 1.5, 0.5], [3, 4.0, 0.0]]
    # likelihoods re-initialised from the folded sums: w_m ~ p(2)^1.5 (1-p(2))^0.5 p(3)^4
    lik = [_pass(2, mu) ** 1.5 * (1 - _pass(2, mu)) ** 0.5 * _pass(3, mu) ** 4 for mu, _ in c.candidates]
    assert c.weights() == pytest.approx([v / sum(lik) for v in lik], rel=1e-9)


def test_fold_discounts_by_groups_since():
    c = ZayaScheduler(candidates=[(1, 1)], recency=0.5, ess_threshold=0.0)
    c.folded = [[1, 8.0, 4.0]]
    c.history = [[1, 2, 4], [5, 1, 1], [1, 0, 4]]
    c.fold()
    # old sums discounted 0.5^3; the groups by age 2, 1, 0
    assert c.folded == [[1, 8 / 8 + 0.25 * 2 + 0, 4 / 8 + 0.25 * 2 + 4], [5, 0.5, 0.0]]
    assert c.history == []


# -- eq. 11: probes and epsilon-greedy targets ----------------------------------------------------

def test_probe_levels_for_the_three_targets():
    c = ZayaScheduler(candidates=[(3.0, 2.0)], max_difficulty=4)
    assert c.probe(0, 0.5) == 3
    assert c.probe(0, 0.25) == 4          # 3 + 2 ln 3 = 5.20 -> 5, capped at 4
    assert c.probe(0, 0.75) == 1          # 3 - 2 ln 3 = 0.80 -> 1
    c = ZayaScheduler(candidates=[(3.0, 2.0)])
    assert c.probe(0, 0.25) == 5


def test_sample_is_thompson_with_epsilon_greedy_targets():
    # candidates with well-separated 0.5-points; the weights pick them
    c = ZayaScheduler(candidates=[(2, 0.5), (8, 0.5)], epsilon=0.0, ess_threshold=0.0)
    c.logw = [math.log(0.25), math.log(0.75)]
    rng = random.Random(0)
    got = Counter(c.sample(rng) for _ in range(4000))
    assert set(got) == {2, 8}
    assert got[8] / 4000 == pytest.approx(0.75, abs=0.03)
    # epsilon = 1: always 0.5 -/+ 0.25, half each: 8 +- 0.5 ln 3 = 8.55 / 7.45 -> 9 / 7
    c = ZayaScheduler(candidates=[(8, 0.5)], epsilon=1.0)
    got = Counter(c.sample(rng) for _ in range(4000))
    assert set(got) == {7, 9} and got[9] / 4000 == pytest.approx(0.5, abs=0.03)
    c = ZayaScheduler(candidates=[(8, 0.5)], epsilon=0.2)
    got = Counter(c.sample(rng) for _ in range(4000))
    assert got[8] / 4000 == pytest.approx(0.8, abs=0.03) and got[7] > 0 and got[9] > 0


def test_pool_is_drawn_from_one_gaussian_prior():
    c = ZayaScheduler(pool_size=4000, prior_mu=5.0, prior_mu_sd=2.0, prior_s=1.5, prior_log_s_sd=0.3, seed=1)
    mus = [m for m, _ in c.candidates]
    logs = [math.log(s) for _, s in c.candidates]
    assert statistics.mean(mus) == pytest.approx(5.0, abs=0.1)
    assert statistics.stdev(mus) == pytest.approx(2.0, abs=0.1)
    assert statistics.mean(logs) == pytest.approx(math.log(1.5), abs=0.02)
    assert statistics.stdev(logs) == pytest.approx(0.3, abs=0.02)
    # drawn lazily from the curriculum's generator otherwise: different per environment, reproducible
    a, b = ZayaScheduler(), ZayaScheduler()
    assert a.candidates == []
    a.sample(random.Random(1))
    b.sample(random.Random(2))
    assert a.candidates and a.candidates != b.candidates
    a2 = ZayaScheduler()
    a2.sample(random.Random(1))
    assert a2.candidates == a.candidates


# -- eq. 14: the up/down rule with the group-difficulty check ---------------------------------------

def test_up_down_after_calibration():
    c = ZayaScheduler(candidates=[(3.0, 1.0), (3.4, 1.0)], calibration_groups=1, ess_threshold=0.0, epsilon=0.0)
    assert c.calibrating and c.sample(random.Random(0)) == 3
    c.update(3, [1] * 4 + [0] * 4)        # the calibration's last group: start at round(E[mu])
    assert not c.calibrating
    assert c.difficulty == round(c.posterior_mu()) == 3
    c.update(3, [1] * 11 + [0] * 5)       # 0.6875: not > 0.7
    assert c.difficulty == 3
    c.update(2, [1] * 16)                 # a group from another level: the check ignores it
    assert c.difficulty == 3
    c.update(3, [1] * 12 + [0] * 4)       # 0.75 at the current level: up
    assert c.difficulty == 4
    c.update(3, [0] * 16)                 # a stale group from level 3 failing: ignored
    assert c.difficulty == 4
    c.update(4, [0] * 16)                 # pass rate 0 at the current level: down
    assert c.difficulty == 3
    c.update(3, [1] + [0] * 15)           # some passes, not many: stays
    assert c.difficulty == 3
    assert all(c.sample(random.Random(i)) == 3 for i in range(5))


def test_calibration_ends_at_the_level_nearest_the_posterior_mean():
    """The calibrated start rounds E[mu] to the nearest level (2.7 -> 3, 2.4 -> 2), not down."""
    for mu, want in ((2.7, 3), (2.4, 2)):
        c = ZayaScheduler(candidates=[(mu, 1.0)], calibration_groups=1)  # one candidate: E[mu] = mu
        c.update(3, [1, 0])
        assert not c.calibrating and c.posterior_mu() == mu and c.difficulty == want


# -- calibration converges to the half-solved level --------------------------------------------------

def _calibrate(d50, seed, group=16, **kw):
    rng = random.Random(seed)
    c = ZayaScheduler(**kw)
    probes = []
    while c.calibrating:
        d = c.sample(rng)
        probes.append(d)
        c.update(d, [rng.random() < 1 / (1 + math.exp(d - d50)) for _ in range(group)])
    return c, probes


def test_calibration_converges_to_the_half_pass_level():
    """pass(d) = 1 / (1 + exp(d - d50)): the calibrated start is within one level of d50, over
    four pass curves x five seeds, with the default settings (8 groups of 16)."""
    errors, resamples = [], 0
    for d50 in (0, 2, 5, 8):
        for seed in range(5):
            c, probes = _calibrate(d50, seed)
            assert len(probes) == 8
            errors.append(abs(c.difficulty - d50))
            resamples += c.resamples
    print(f"calibration |d - d50|: median {statistics.median(errors)}, worst {max(errors)}, "
          f"resamplings {resamples} in {len(errors)} runs")
    assert max(errors) <= 1
    assert statistics.median(errors) == 0
    assert resamples > 0                 # the ESS resampling is exercised on the way


# -- the least-sampled-first weighted environment sampler --------------------------------------------

def test_weighted_sampler_probabilities_hand_computed():
    c = Curriculum(["math/arith", "ifeval", "math"], mode="weighted_least_sampled", seed=0)
    c.counts = {"math/arith": 0, "ifeval": 2, "math": 4}
    # N = 6, fair share 2 each: behind by 2, 0, -2 -> P ~ e^2, 1, e^-2
    z = math.exp(2) + 1 + math.exp(-2)
    p = c.probabilities()
    assert p == pytest.approx({"math/arith": math.exp(2) / z, "ifeval": 1 / z, "math": math.exp(-2) / z})
    # mixing weights scale the fair share and the weight: w = (1, 3), counts (1, 1): N = 2,
    # shares 0.25 / 0.75 -> behind -0.5 / 0.5 -> P ~ 1 e^-0.5, 3 e^0.5
    c = Curriculum({"math/arith": 1.0, "ifeval": 3.0}, mode="weighted_least_sampled", temperature=1.0)
    c.counts = {"math/arith": 1, "ifeval": 1}
    a, b = math.exp(-0.5), 3 * math.exp(0.5)
    assert c.probabilities() == pytest.approx({"math/arith": a / (a + b), "ifeval": b / (a + b)})
    with pytest.raises(ValueError, match="temperature"):
        Curriculum(["math/arith"], mode="weighted_least_sampled", temperature=0)


def test_weighted_sampler_favours_least_sampled_but_samples_all():
    ids = ["math/arith", "ifeval", "math", "toy/add"]
    c = Curriculum(ids, mode="weighted_least_sampled", seed=0, temperature=2.0)
    c.counts = dict(zip(ids, (0, 3, 6, 9)))
    rng = random.Random(5)
    n = 20000
    freq = Counter(c._pick_env(rng) for _ in range(n))
    p = c.probabilities()
    for k in ids:                          # the drawn frequencies follow P (4 binomial sd)
        assert abs(freq[k] / n - p[k]) < 4 * math.sqrt(p[k] * (1 - p[k]) / n)
    assert freq["math/arith"] > freq["ifeval"] > freq["math"] > freq["toy/add"] > 0
    # over a run: every environment keeps being sampled, not only the argmin (as least_sampled
    # does), and the counts catch up with the shares
    picks = [e for e, _ in c.sample(rng, 600)]
    not_argmin = 0
    counts = dict(zip(ids, (0, 3, 6, 9)))
    for e in picks:
        not_argmin += counts[e] > min(counts.values())
        counts[e] += 1
    assert set(picks) == set(ids)
    assert not_argmin > 100
    assert max(c.counts.values()) - min(c.counts.values()) <= 8
    argmin = Curriculum(ids, mode="least_sampled", seed=0)
    argmin.counts = dict(zip(ids, (0, 3, 6, 9)))
    assert {e for e, _ in argmin.sample(rng, 3)} == {"math/arith"}


# -- state round trips ---------------------------------------------------------------------------

def test_scheduler_state_round_trip_mid_calibration():
    rng = random.Random(0)
    a = ZayaScheduler(calibration_groups=10, ess_threshold=0.9)   # resamples often
    for _ in range(5):
        d = a.sample(rng)
        a.update(d, [rng.random() < _pass(d, 4) for _ in range(16)])
    assert a.resamples > 0 and a.calibrating
    saved = json.loads(json.dumps(a.state_dict()))
    b = ZayaScheduler(calibration_groups=10, ess_threshold=0.9)  # (settings come from the config, state from the checkpoint)
    b.load_state_dict(saved)
    assert b.state_dict() == a.state_dict()
    ra, rb, policy = random.Random(9), random.Random(9), random.Random(10)
    for _ in range(8):
        da, db = a.sample(ra), b.sample(rb)
        assert da == db
        scores = [policy.random() < _pass(da, 4) for _ in range(16)]
        a.update(da, scores)
        b.update(db, scores)
    assert a.state_dict() == b.state_dict()
    assert not a.calibrating


def test_curriculum_with_zaya_and_weighted_sampler_resumes_exactly():
    kw = dict(controller="zaya", mode="weighted_least_sampled", controller_kwargs={"calibration_groups": 3})

    def step(c, i):
        batch = c.sample(None, 6)
        rng = random.Random(i)
        for env_id, p in batch:
            c.update(env_id, p.difficulty, [rng.random() < 0.6 for _ in range(4)])
        return [(e, p.to_dict()) for e, p in batch]

    a = Curriculum({"math/arith": 1.0, "ifeval": 3.0}, seed=7, **kw)
    for i in range(3):
        step(a, i)
    saved = json.loads(json.dumps(a.state_dict()))
    rest_a = [step(a, i) for i in range(3, 7)]
    b = Curriculum({"math/arith": 1.0, "ifeval": 3.0}, seed=7, **kw)
    b.load_state_dict(saved)
    assert [step(b, i) for i in range(3, 7)] == rest_a
    assert a.state_dict() == b.state_dict()


def test_rlve_stage_uses_zaya_by_default_and_rlve_by_name():
    from cascade.config import load_run_config, parse_overrides

    for profile in ([], ["profile=tiny"]):
        cfg, _ = load_run_config(parse_overrides(["stage=rlve"] + profile))
        s = cfg.stages["rlve"]
        assert (s.controller, s.sampling_mode) == ("zaya", "weighted_least_sampled")
        cur = Curriculum(["math/arith"], controller=s.controller, mode=s.sampling_mode,
                         controller_kwargs=s.controller_kwargs)
        assert isinstance(cur.controllers["math/arith"], ZayaScheduler)
    cfg, _ = load_run_config(parse_overrides(["stage=rlve", "profile=tiny", "controller=rlve",
                                              "controller_kwargs={tau_acc: 0.9, d_window: 4}"]))
    s = cfg.stages["rlve"]
    c = make_controller(s.controller, **s.controller_kwargs)
    assert (c.name, c.tau_acc, c.d_window) == ("rlve", 0.9, 4)


# -- edges: no calibration, empty groups, the cap at the calibrated start, resampling details -------

def test_no_calibration_groups_starts_at_0_without_a_pool():
    c = ZayaScheduler(calibration_groups=0)
    assert not c.calibrating and c.sample(random.Random(0)) == 0 and c.candidates == []
    c.update(0, [1] * 8)
    assert c.difficulty == 1


def test_an_empty_group_changes_nothing():
    c = ZayaScheduler(candidates=[(3.0, 1.0), (5.0, 1.0)], calibration_groups=2)
    before = json.dumps(c.state_dict())
    c.update(3, [])
    assert json.dumps(c.state_dict()) == before and c.calibrating and c.calibration_left == 2
    c = ZayaScheduler(start=2)
    c.update(2, [])
    assert c.difficulty == 2


def test_calibrated_start_is_clamped_to_the_cap():
    c = ZayaScheduler(candidates=[(10.0, 1.0)], calibration_groups=1, max_difficulty=3)  # E[mu] = 10
    c.update(3, [1, 1])
    assert not c.calibrating and c.difficulty == 3


def test_explicit_candidates_without_a_seed_can_resample():
    c = ZayaScheduler(candidates=[(0, 1), (2, 1), (4, 1), (6, 1)], ess_threshold=1.0, jitter=0.0)
    c.update(2, [1, 1, 1, 0])             # ESS 2.44 < 4: resampled with the default seed 0
    assert c.resamples == 1 and len(c.candidates) == 4 and c.history == []
    d = ZayaScheduler(candidates=[(0, 1), (2, 1), (4, 1), (6, 1)], ess_threshold=1.0, jitter=0.0)
    d.update(2, [1, 1, 1, 0])
    assert d.candidates == c.candidates   # deterministic


def test_resampling_happens_only_when_the_ess_falls_below_the_threshold():
    c = ZayaScheduler(candidates=[(3.0, 1.0), (3.0, 1.0)], ess_threshold=1.0)  # identical: ESS stays exactly 2
    c.update(3, [1, 0, 1, 0])
    assert c.ess() == 2.0 and c.resamples == 0 and c.history == [[3, 2, 4]]


def test_resampling_jitters_mu_and_log_s_of_each_copy():
    old = [(0.0, 1.0), (2.0, 1.0), (4.0, 1.0), (6.0, 1.0)]
    c = ZayaScheduler(candidates=old, ess_threshold=0.5, jitter=0.2, recency=0.5, seed=3)
    c.update(2, [1, 1, 1, 0])
    c.update(3, [1, 1, 1, 1])             # ESS 1.92 < 2: resampled (see test_ess_resampling_triggers_below_threshold)
    assert c.resamples == 1
    mus, ss = [m for m, _ in c.candidates], [s for _, s in c.candidates]
    assert all(m not in (0.0, 2.0, 4.0, 6.0) for m in mus)   # every copy moved on mu ...
    assert all(s != 1.0 for s in ss)                        # ... and on s
    assert all(min(abs(m - o) for o, _ in old) < 1.0 for m in mus)   # by N(0, 0.2): near where it was
    assert all(abs(math.log(s)) < 1.0 for s in ss)


def test_a_loaded_pool_keeps_its_size_over_the_configured_one():
    a = ZayaScheduler(pool_size=8, seed=1)
    saved = json.loads(json.dumps(a.state_dict()))
    b = ZayaScheduler(pool_size=64)
    b.load_state_dict(saved)
    assert b.pool_size == 8 and len(b.weights()) == 8
    b.sample(random.Random(0))            # draws among the loaded pool's 8 candidates
    b.update(3, [1, 0, 1, 0])
    assert len(b.candidates) == 8
