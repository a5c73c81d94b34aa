"""Difficulty controllers against hand-worked sequences, and the curriculum's sampling and resume."""
from __future__ import annotations

import json
import math
import random
import re
from collections import Counter

import pytest

from envs import Environment, Score
from envs.curriculum import Curriculum, RLVEWindow, UpDown, count_correct, make_controller


def test_count_correct_accepts_scores_bools_and_rewards():
    assert count_correct([Score(1.0, True, True), Score(0.5, False, True), True, False, 1.0, 0.99, -1]) == (3, 7)


def test_rlve_window_hand_worked():
    c = RLVEWindow(group_size=2, tau_prompts=2, tau_acc=0.75, d_window=2)  # tau_num = 4 rollouts
    assert (c.low, c.high, c.tau_num) == (0, 0, 4)
    c.update(0, [1, 1])                 # 2 counted
    assert (c.high, c.n, c.k) == (0, 2, 2)
    c.update(0, [1, 0])                 # 4 counted, accuracy 3/4 >= 0.75 -> h = 1
    assert (c.low, c.high, c.n, c.k) == (0, 1, 0, 0)
    c.update(0, [1, 1, 1, 1])           # below h: not counted
    assert (c.high, c.n) == (1, 0)
    c.update(1, [1, 1, 0, 0])           # accuracy 1/2: no step, counts reset
    assert (c.low, c.high, c.n, c.k) == (0, 1, 0, 0)
    c.update(1, [1, 1, 1])              # 3 counted ...
    c.update(1, [1])                    # ... 4: accuracy 1 -> h = 2, l = 2 - 2 + 1 = 1
    assert (c.low, c.high) == (1, 2)
    for _ in range(3):
        c.update(c.high, [1, 1, 1, 1])
    assert (c.low, c.high) == (4, 5)
    rng = random.Random(0)
    assert set(c.sample(rng) for _ in range(200)) == {4, 5}


def test_rlve_window_respects_max_difficulty_and_default_tau():
    c = make_controller("rlve", max_difficulty=1, group_size=1, tau_prompts=1)
    for _ in range(5):
        c.update(c.high, [True])
    assert (c.low, c.high) == (0, 1)
    assert RLVEWindow().tau_num == 8 * 16


def test_updown_hand_worked():
    c = UpDown(start=2, max_difficulty=3)
    rng = random.Random(0)
    assert c.sample(rng) == 2
    c.update(2, [1] * 6 + [0] * 2)      # 0.75 > 0.7 -> 3
    assert c.difficulty == 3
    c.update(3, [1] * 8)                # at the cap
    assert c.difficulty == 3
    c.update(3, [0] * 8)                # 0 -> 2
    assert c.difficulty == 2
    c.update(2, [1] * 7 + [0] * 3)      # exactly 0.7: stays
    assert c.difficulty == 2
    c.update(1, [0] * 8)                # not the current difficulty: ignored
    assert c.difficulty == 2
    c.update(2, [0.5] * 8)              # partial rewards are not correct: pass rate 0 -> 1
    c.update(1, [0] * 4)
    c.update(0, [0] * 4)
    assert c.difficulty == 0            # never below 0


def test_updown_calibrates_towards_half_pass_rate():
    """Pass rate sigmoid(-(d - 6) / 1.2): calibration should start near d = 6."""
    rng = random.Random(1)
    c = UpDown(calibration_groups=12, max_difficulty=20)
    seen = []
    while c.calibrating:
        d = c.sample(rng)
        seen.append(d)
        p = 1 / (1 + math.exp((d - 6) / 1.2))
        c.update(d, [rng.random() < p for _ in range(16)])
    assert len(seen) == 12 and len(set(seen)) > 1     # Thompson sampling explores
    assert abs(c.difficulty - 6) <= 1
    assert abs(c.posterior_mu() - 6) < 1.5


def _curriculum(**kw):
    return Curriculum({"math/arith": 1.0, "ifeval": 3.0}, seed=7, **kw)


def test_curriculum_uniform_follows_weights_and_is_deterministic():
    a, b = _curriculum(), _curriculum()
    sa, sb = a.sample(None, 400), b.sample(None, 400)
    assert [(e, p.to_dict()) for e, p in sa] == [(e, p.to_dict()) for e, p in sb]
    share = Counter(e for e, _ in sa)["ifeval"] / 400
    assert 0.68 < share < 0.82
    assert all(p.env_id == e for e, p in sa)
    # an explicit seed gives the same batch whatever the internal state
    assert [p.seed for _, p in a.sample(5, 10)] == [p.seed for _, p in b.sample(5, 10)]


def test_curriculum_least_sampled_balances_exactly():
    c = Curriculum(["math/arith", "ifeval", "math"], mode="least_sampled", seed=0)
    for _ in range(5):
        c.sample(None, 4)
    assert sorted(c.counts.values()) == [6, 7, 7]
    c.counts["math"] = 0
    assert {e for e, _ in c.sample(None, 3)} == {"math"}


def test_curriculum_update_drives_difficulty():
    c = Curriculum(["math/arith"], controller="zaya", controller_kwargs={"start": 0})
    c.update("math/arith", 0, [True] * 8)
    assert c.difficulties() == {"math/arith": 1}
    assert all(p.difficulty == 1 for _, p in c.sample(None, 5))
    with pytest.raises(KeyError):
        c.update("nope", 0, [True])


@pytest.mark.parametrize("controller", ["rlve", "zaya"])
def test_curriculum_resumes_exactly(controller):
    kw = {"group_size": 2, "tau_prompts": 1} if controller == "rlve" else {"calibration_groups": 3}

    def step(c, i):
        batch = c.sample(None, 6)
        rng = random.Random(i)
        for env_id, p in batch:
            c.update(env_id, p.difficulty, [rng.random() < 0.8 for _ in range(2)])
        return [(e, p.to_dict()) for e, p in batch]

    a = _curriculum(controller=controller, controller_kwargs=kw, mode="least_sampled")
    for i in range(4):
        step(a, i)
    saved = json.loads(json.dumps(a.state_dict()))
    rest_a = [step(a, i) for i in range(4, 8)]
    b = _curriculum(controller=controller, controller_kwargs=kw, mode="least_sampled")
    b.load_state_dict(saved)
    rest_b = [step(b, i) for i in range(4, 8)]
    assert rest_a == rest_b
    assert a.state_dict() == b.state_dict()
    assert len({p["difficulty"] for batch in rest_a for _, p in batch}) >= 1


def test_curriculum_errors():
    with pytest.raises(ValueError, match="unknown difficulty controller"):
        Curriculum(["math/arith"], controller="nope")
    with pytest.raises(ValueError, match="unknown sampling mode"):
        Curriculum(["math/arith"], mode="nope")
    with pytest.raises(ValueError, match="weights"):
        Curriculum({"math/arith": -1.0})
    c = _curriculum()
    with pytest.raises(ValueError, match="curriculum state is for"):
        Curriculum(["math/arith"]).load_state_dict(c.state_dict())


class _CapDrops(Environment):
    """A generator too slow from level ``slow_from`` on: as :func:`envs.caps.bound_generate` does at run
    time, a request there makes the problem one level lower and caps ``max_difficulty`` below it."""

    id = "test/cap_drops"

    def __init__(self, slow_from: int | None = None, max_difficulty: int | None = None):
        self.slow_from, self.max_difficulty = slow_from, max_difficulty

    def generate(self, seed, difficulty):
        d = int(difficulty)
        if self.max_difficulty is not None:
            d = min(d, self.max_difficulty)
        if self.slow_from is not None and d >= self.slow_from:
            self.max_difficulty = d = self.slow_from - 1
        return self.problem("q", "1", seed, d)

    def check(self, problem, response):
        return Score(1.0, True, True)


def _cap_curriculum(controller, env, **kw):
    return Curriculum([env.id], controller=controller, environments={env.id: env}, controller_kwargs=kw)


def test_zaya_follows_a_cap_that_drops_mid_run():
    env = _CapDrops(slow_from=2)
    c = _cap_curriculum("zaya", env, start=0)
    seen = []
    for _ in range(4):                  # all correct: 0 -> 1 -> 2, where generate falls back to 1 and caps
        (e, p), = c.sample(None, 1)
        seen.append(p.difficulty)
        c.update(e, p.difficulty, [True] * 4)
    assert env.max_difficulty == 1 and seen == [0, 1, 1, 1]
    assert c.difficulties() == {env.id: 1} and c.controllers[env.id].max_difficulty == 1
    for want in (1, 0, 0):              # all wrong: the groups at the capped level count, so it steps down
        (e, p), = c.sample(None, 1)
        assert p.difficulty == want
        c.update(e, p.difficulty, [False] * 4)
    assert c.difficulties() == {env.id: 0}


def test_rlve_window_stays_within_a_cap_that_drops_mid_run():
    env = _CapDrops()
    c = _cap_curriculum("rlve", env, group_size=1, tau_prompts=1, tau_acc=0.5, d_window=2)
    for h in range(3):
        c.update(env.id, h, [True])
    assert c.difficulties() == {env.id: [2, 3]}
    env.slow_from = 2                   # level 2 turns out too slow: the first draw at 2 or 3 caps at 1
    ds = [p.difficulty for _, p in c.sample(None, 40)]
    assert env.max_difficulty == 1 and max(ds) == 1
    assert c.difficulties() == {env.id: [0, 1]}
    assert set(ds[-20:]) == {0, 1}      # the window, not one level
    ctrl = c.controllers[env.id]
    c.update(env.id, 1, [True])         # counted at the capped high; the window cannot climb past the cap
    assert (ctrl.low, ctrl.high, ctrl.n) == (0, 1, 0)
    c.update(env.id, 1, [False])
    assert (ctrl.low, ctrl.high) == (0, 1)


def test_rlve_window_counts_reset_when_a_cap_lowers_high():
    """follow_cap below ``high`` drops the counts taken at the old ``high`` (they do not judge the capped level)."""
    c = RLVEWindow(group_size=2, tau_prompts=2, tau_acc=0.75, d_window=4)  # tau_num = 4 rollouts
    for h in range(3):
        c.update(h, [1, 1, 1, 1])       # h = 3
    c.update(3, [1, 0])
    assert (c.low, c.high, c.n, c.k) == (0, 3, 2, 1)
    c.follow_cap(2)
    assert (c.low, c.high, c.n, c.k) == (0, 2, 0, 0)


@pytest.mark.parametrize("controller", ["zaya", "rlve", "fixed"])
def test_resume_under_a_lower_cap_than_the_checkpoint(controller):
    kw = {"zaya": {"start": 5}, "rlve": {"group_size": 1, "tau_prompts": 1}, "fixed": {"difficulty": 5}}[controller]
    a = _cap_curriculum(controller, _CapDrops(max_difficulty=6), **kw)
    for h in range(5):
        a.update(_CapDrops.id, h, [True])   # rlve: window [2, 5] (d_window 4)
    assert a.difficulties()[_CapDrops.id] in (5, [2, 5])
    saved = json.loads(json.dumps(a.state_dict()))
    env = _CapDrops(max_difficulty=2)       # e.g. a cap recorded in envs/difficulty_caps.json since
    b = _cap_curriculum(controller, env, **kw)
    b.load_state_dict(saved)
    assert b.controllers[env.id].max_difficulty == 2
    assert b.difficulties()[env.id] in (2, [0, 2])    # rlve: d_window 4
    assert max(p.difficulty for _, p in b.sample(None, 30)) == 2
    # the state still round-trips: a curriculum under the same cap resumes exactly
    again = json.loads(json.dumps(b.state_dict()))
    c = _cap_curriculum(controller, _CapDrops(max_difficulty=2), **kw)
    c.load_state_dict(again)
    assert c.state_dict() == b.state_dict()
    assert [p.to_dict() for _, p in c.sample(None, 10)] == [p.to_dict() for _, p in b.sample(None, 10)]
    # and no cap now: the checkpoint's cap does not stand either
    d = _cap_curriculum(controller, _CapDrops(), **kw)
    d.load_state_dict(saved)
    assert d.controllers[_CapDrops.id].max_difficulty is None


def test_peek_draws_what_sample_would_and_leaves_the_curriculum_as_it_was():
    """The stage draws a teacher's SFT problems with ``peek``: a run resumed from a checkpoint taken after that draw
    (mid-SFT) draws the same problems again and the same counts (``sample`` moved the calibrating zaya controller's
    lazily drawn pool and the counts, so the resumed run drew other problems and counted them twice)."""
    import pickle
    import random

    def build():
        return Curriculum({"toy/add": 1.0, "toy/max": 1.0}, controller="zaya", mode="least_sampled", seed=0,
                          controller_kwargs={"up": 0.7, "calibration_groups": 8})

    def key(picks):
        return [(e, p.seed, p.difficulty) for e, p in picks]

    c = build()
    before = pickle.dumps(c.state_dict())
    first = key(c.peek(random.Random("aggregation_sft"), 6))
    assert pickle.dumps(c.state_dict()) == before
    assert first == key(build().sample(random.Random("aggregation_sft"), 6))  # what sample would have drawn
    resumed = build()
    resumed.load_state_dict(pickle.loads(before))  # the checkpoint taken after the draw
    assert key(resumed.peek(random.Random("aggregation_sft"), 6)) == first
    assert resumed.counts == c.counts == {"toy/add": 0, "toy/max": 0}
    assert key(c.sample(random.Random(1), 4)) == key(build().sample(random.Random(1), 4))  # RL's draws unchanged


def test_resume_keeps_configured_controller_thresholds():
    """A resumed curriculum takes back what its controllers learned (levels, counts, the calibration pool) and
    keeps this run's settings: the checkpoint's ``up``, ``tau_acc``, ``d_window`` and sampling mode replaced the
    configured ones, and a checkpoint of another controller kind replaced the configured controller."""
    a = Curriculum({"toy/max": 1}, controller="zaya", controller_kwargs={"up": 0.7, "start": 0})
    for d in range(3):
        a.update("toy/max", d, [True] * 4)
    saved = json.loads(json.dumps(a.state_dict()))
    b = Curriculum({"toy/max": 1}, controller="zaya", mode="least_sampled", controller_kwargs={"up": 0.95, "start": 0})
    b.load_state_dict(saved)
    ctrl = b.controllers["toy/max"]
    assert (ctrl.up, ctrl.difficulty, b.mode) == (0.95, 3, "least_sampled")
    ctrl.update(3, [True] * 4 + [False])         # 0.8: above the old 0.7, not the configured 0.95
    assert ctrl.difficulty == 3

    kw = {"group_size": 1, "tau_prompts": 1, "tau_acc": 0.5, "d_window": 4}
    a = Curriculum({"toy/max": 1}, controller="rlve", controller_kwargs=kw)
    for h in range(5):
        a.update("toy/max", h, [True])
    a.update("toy/max", 5, [True, False, False])  # tau_num 1: counted and reset; 1/3 < 0.5 holds high
    assert a.difficulties() == {"toy/max": [2, 5]}
    saved = json.loads(json.dumps(a.state_dict()))
    b = Curriculum({"toy/max": 1}, controller="rlve", controller_kwargs=dict(kw, tau_acc=0.3, d_window=2))
    b.load_state_dict(saved)
    assert b.difficulties() == {"toy/max": [4, 5]}   # the configured window over the checkpoint's high
    b.update("toy/max", 5, [True, False, False])      # 1/3 >= the configured 0.3
    assert b.difficulties() == {"toy/max": [5, 6]}

    c = Curriculum({"toy/max": 1}, controller="rlve")
    with pytest.raises(ValueError, match=re.escape("controller=rlve, but the checkpoint's curriculum ran the zaya "
                                                   "difficulty controller")):
        c.load_state_dict(json.loads(json.dumps(
            Curriculum({"toy/max": 1}, controller="zaya", controller_kwargs={"start": 0}).state_dict())))


# -- settings refused, levels clamped, the weights and sampling modes at their edges ------------------

def test_controllers_refuse_settings_they_cannot_run():
    from envs.curriculum import ZayaScheduler

    for kw in ({"d_window": 0}, {"tau_num": 0}, {"group_size": 0}, {"tau_prompts": 0}):
        with pytest.raises(ValueError):
            RLVEWindow(**kw)
    assert RLVEWindow(d_window=1).d_window == 1 and RLVEWindow(tau_num=1).tau_num == 1
    for kw in ({"explore": 0.5}, {"explore": 0.0}, {"epsilon": 1.5}, {"epsilon": -0.1}, {"ess_threshold": 1.5},
               {"recency": 0.0}, {"recency": 1.5}, {"pool_size": 0}, {"prior_s": 0.0},
               {"candidates": []}, {"candidates": [(1.0, 0.0)]}, {"candidates": [(1.0, 1.0), (2.0, -1.0)]}):
        with pytest.raises(ValueError):
            ZayaScheduler(**kw)
    ZayaScheduler(explore=0.49, epsilon=1.0, ess_threshold=1.0, recency=1.0, pool_size=1)  # the edges that are fine


def test_rlve_window_takes_an_explicit_tau_num_over_prompts_times_group():
    c = RLVEWindow(group_size=16, tau_prompts=8, tau_num=3, tau_acc=1.0)
    assert c.tau_num == 3
    c.update(0, [True, True])
    assert (c.high, c.n) == (0, 2)
    c.update(0, [True])                 # the third rollout: 3/3 >= 1.0 -> h = 1 (not after 128)
    assert (c.low, c.high, c.n) == (0, 1, 0)


def test_levels_are_never_negative_nor_above_the_cap_from_the_start():
    from envs.curriculum import Fixed, ZayaScheduler

    rng = random.Random(0)
    assert Fixed(difficulty=-3).sample(rng) == 0
    assert Fixed(difficulty=5, max_difficulty=2).sample(rng) == 2
    assert ZayaScheduler(start=-2).sample(rng) == 0
    c = ZayaScheduler(start=10, max_difficulty=3)   # a configured start above the environment's cap
    assert (c.difficulty, c.sample(rng)) == (3, 3)
    c.update(3, [True] * 4)                         # and the up rule stays at the cap
    assert c.difficulty == 3


def test_a_controller_state_with_unknown_keys_is_refused():
    c = RLVEWindow()
    state = c.state_dict()
    c.load_state_dict(dict(state, high=3))
    assert (c.low, c.high) == (0, 3)
    with pytest.raises(ValueError, match="unknown keys.*bogus"):
        RLVEWindow().load_state_dict(dict(state, bogus=1))


def test_zero_weight_environments_are_never_sampled_and_an_all_zero_or_nan_mix_is_refused():
    for mode in ("uniform", "least_sampled", "weighted_least_sampled"):
        c = Curriculum({"toy/add": 1.0, "toy/max": 0.0}, mode=mode, seed=0)
        assert {e for e, _ in c.sample(None, 20)} == {"toy/add"}, mode
        assert c.probabilities() == {"toy/add": 1.0}, mode
    # (an infinite weight was accepted, then every draw raised "Total of weights must be finite")
    for weights in ({"toy/add": 0.0}, {"toy/add": 0.0, "toy/max": 0.0}, {"toy/add": float("nan")},
                    {"toy/add": 1.0, "toy/max": float("nan")}, {"toy/add": float("inf"), "toy/max": 1.0}):
        with pytest.raises(ValueError, match="weights"):
            Curriculum(weights)


def test_least_sampled_splits_ties_and_follows_the_mixing_weights():
    c = Curriculum(["toy/add", "toy/max"], mode="least_sampled", seed=0)
    assert c.probabilities() == {"toy/add": 0.5, "toy/max": 0.5}
    c.counts["toy/add"] = 1
    assert c.probabilities() == {"toy/add": 0.0, "toy/max": 1.0}
    c = Curriculum({"toy/add": 1.0, "toy/max": 3.0}, mode="least_sampled", seed=0)
    c.sample(None, 8)                    # counts / weight level out: 2 / 1 == 6 / 3
    assert c.counts == {"toy/add": 2, "toy/max": 6}


def test_weighted_sampler_divides_the_lag_by_the_temperature():
    c = Curriculum(["toy/add", "toy/max", "ifeval"], mode="weighted_least_sampled", temperature=2.0)
    c.counts = {"toy/add": 0, "toy/max": 2, "ifeval": 4}
    # N = 6, fair share 2 each: behind by 2, 0, -2, over temperature 2 -> P ~ e^1, 1, e^-1
    z = math.e + 1 + 1 / math.e
    assert c.probabilities() == pytest.approx({"toy/add": math.e / z, "toy/max": 1 / z, "ifeval": 1 / math.e / z})


def test_an_integer_seed_gives_the_same_batch_whatever_was_drawn_before():
    c = Curriculum(["toy/add", "toy/max"], seed=0)
    first = [(e, p.seed, p.difficulty) for e, p in c.sample(5, 4)]
    c.sample(None, 3)
    assert [(e, p.seed, p.difficulty) for e, p in c.sample(5, 4)] == first
    assert [(e, p.seed) for e, p in c.sample(random.Random(5), 4)] == [(e, s) for e, s, _ in first]
