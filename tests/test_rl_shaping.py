"""Dynamic sampling, ZAYA1 length reward (eqs. 8-10), LZ77 repetition gate (eq. 16), rare-token canary and
overlong handling, with values worked out by hand from the equations."""
import json
import zlib
from dataclasses import dataclass

import pytest
import torch

from train.rl import compute_advantages
from train.rl.shaping import (
    DynamicSampler, LengthRewardConfig, LengthRewardState, OverlongConfig, all_equal, chunk_compression_ratios,
    data_source, filter_groups, is_repetitive, length_bonus, overlong_shaping, rare_token_fractions, repetition_gate,
    token_id_bytes,
)


@dataclass
class Group:
    prompt: str
    rewards: list


# ------------------------------------------------------------------------------------------------
# dynamic sampling


def test_filter_groups_drops_constant_reward_groups():
    groups = [[1, 1, 1], [0, 1, 0], [0.0, 0.0], torch.tensor([0.5, 0.5]), Group("p", [1, 0])]
    kept, dropped = filter_groups(groups)
    assert dropped == 3
    assert kept[0] == [0, 1, 0] and kept[1].prompt == "p"
    assert all_equal([]) and all_equal([2.0, 2.0 + 1e-12]) and not all_equal([1.0, 0.9])
    kept, dropped = filter_groups([("a", [1, 1]), ("b", [0, 1])], rewards_of=lambda g: g[1])
    assert kept == [("b", [0, 1])] and dropped == 1


def _source(pattern):
    """sample(n) returns the next n groups; pattern[i] is True for an informative group."""
    calls, counter = [], iter(range(10**6))

    def sample(n):
        calls.append(n)
        out = []
        for _ in range(n):
            i = next(counter)
            out.append(Group(str(i), [1, 0] if pattern[i % len(pattern)] else [1, 1]))
        return out
    return sample, calls


def test_dynamic_sampler_refills_until_full():
    sample, calls = _source([True, False, True, False, True])
    sampler = DynamicSampler(sample, batch_groups=3)
    rep = sampler.fill()
    # round 1 asks 3 -> groups 0,1,2 (1 dropped); round 2 asks 1 -> group 3 (dropped); round 3 -> group 4
    assert calls == [3, 1, 1]
    assert [g.prompt for g in rep.groups] == ["0", "2", "4"]
    assert (rep.dropped, rep.surplus, rep.rounds, rep.requested, rep.full) == (2, 0, 3, 5, True)
    sampler.fill()
    assert sampler.total_requested > 5 and sampler.total_dropped >= 2


def test_dynamic_sampler_oversamples_trims_and_caps_rounds():
    sample, calls = _source([True, False])
    rep = DynamicSampler(sample, batch_groups=2, oversample=2.0).fill()
    # asks 4 -> 2 informative groups; full in one round
    assert calls == [4] and rep.full and len(rep.groups) == 2 and rep.dropped == 2
    sample, calls = _source([True, True, True])
    rep = DynamicSampler(sample, batch_groups=2, oversample=2.0).fill()
    assert rep.surplus == 2 and [g.prompt for g in rep.groups] == ["0", "1"]
    sample, calls = _source([False])
    rep = DynamicSampler(sample, batch_groups=2, max_rounds=3).fill()
    assert not rep.full and rep.groups == [] and rep.rounds == 3 and rep.dropped == 6 and calls == [2, 2, 2]
    with pytest.raises(ValueError, match="batch_groups >= 1"):
        DynamicSampler(sample, batch_groups=0)
    with pytest.raises(ValueError, match="oversample >= 1"):
        DynamicSampler(sample, batch_groups=2, oversample=0.5)
    # 3 missing x 1.5 = 4.5 -> asks 5 (rounded up, not down to 4)
    sample, calls = _source([True])
    DynamicSampler(sample, batch_groups=3, oversample=1.5).fill()
    assert calls == [5]


# ------------------------------------------------------------------------------------------------
# length reward (ZAYA1 eqs. 8-10): dr_i = c * p * m_i * lambda_i,
#   lambda_i = 1/2 - clamp((l_i - l_min) / (l_max - l_min), 0, 1), or 1/2 if l_i <= l_min + T_l,
#   m_i = [p > p* - T_acc] [p > 1/G] [r_i = 1], l_max a constant


def test_length_bonus_gated_correct_answer_is_not_solved():
    """The issue's case: rewards [1, 1, 0 (a correct answer the repetition gate zeroed), 0]."""
    cfg = LengthRewardConfig(l_max=1000, t_len=0, t_acc=0.25)
    r, lengths = [1.0, 1.0, 0.0, 0.0], [10, 12, 900, 30]
    # p = 2/4 = 0.5 (the gated rollout is not solved); p* - T_acc = 0.75 - 0.25 = 0.5; 0.5 > 0.5 is false
    assert length_bonus(r, lengths, 4, cfg, p_star=0.75, coef=1.0).tolist() == [0.0, 0.0, 0.0, 0.0]
    # with p* = 0.6 the gate opens (0.5 > 0.35 and 0.5 > 1/4) for the two solved rollouts only:
    # l_min = 10; rollout 0: l = 10 <= 10 + 0 -> lambda = 1/2 -> dr = 1 * 0.5 * 0.5 = 0.25
    # rollout 1: lambda = 1/2 - (12 - 10) / (1000 - 10) = 0.5 - 2/990 -> dr = 0.5 * (0.5 - 2/990) = 0.25 - 1/990
    dr = length_bonus(r, lengths, 4, cfg, p_star=0.6, coef=1.0)
    torch.testing.assert_close(dr, torch.tensor([0.25, 0.25 - 1 / 990, 0.0, 0.0]))


def test_length_bonus_l_max_is_the_constant_not_the_longest():
    cfg = LengthRewardConfig(l_max=500, t_len=50, t_acc=0.25)
    r, lengths = [1, 1, 1, 0], [100, 300, 500, 50]
    # p = 3/4 > p* - T_acc = 0.5 and > 1/4; l_min = 100
    # lambda = [1/2 (100 <= 100 + 50), 1/2 - 200/400 = 0, 1/2 - 400/400 = -1/2, (unsolved)]; dr = p * lambda
    torch.testing.assert_close(length_bonus(r, lengths, 4, cfg, 0.75, 1.0), torch.tensor([0.375, 0.0, -0.375, 0.0]))
    # l_max = 900 (the group's longest is still 500): lambda = [1/2, 1/2 - 200/800 = 1/4, 1/2 - 400/800 = 0]
    torch.testing.assert_close(length_bonus(r, lengths, 4, cfg, 0.75, 1.0, l_max=900),
                               torch.tensor([0.375, 0.75 * 0.25, 0.0, 0.0]))
    # l_max = 300: 500 is past l_max, the clamp holds lambda at 1/2 - 1 = -1/2; 300: 1/2 - 200/200 = -1/2
    torch.testing.assert_close(length_bonus(r, lengths, 4, cfg, 0.75, 1.0, l_max=300),
                               torch.tensor([0.375, -0.375, -0.375, 0.0]))
    # c scales the bonus: c = 0.5, l_max = 900 -> 0.5 * 0.75 * [1/2, 1/4, 0, 0]
    torch.testing.assert_close(length_bonus(r, lengths, 4, cfg, 0.75, 0.5, l_max=900),
                               torch.tensor([0.1875, 0.09375, 0.0, 0.0]))


def test_length_bonus_gates_and_edges():
    cfg = LengthRewardConfig(l_max=110, t_len=0, t_acc=0.25)
    # [p > 1/G]: one solved of four, p = 1/4 is not > 1/4, even with p* = 0
    assert length_bonus([1, 0, 0, 0], [10, 20, 30, 40], 4, cfg, 0.0, 1.0).abs().sum() == 0
    # two groups of 2: A all solved, p = 1 > 1 - 0.25 and > 1/2; l_min = 10:
    # lambda = [1/2, 1/2 - (20 - 10)/(110 - 10) = 0.4] -> dr = [0.5, 0.4]; B: p = 1/2 is not > 1/2 -> 0
    dr = length_bonus([1, 1, 1, 0], [10, 20, 5, 9], 2, cfg, torch.tensor([1.0, 1.0, 0.0, 0.0]), 1.0)
    torch.testing.assert_close(dr, torch.tensor([0.5, 0.4, 0.0, 0.0]))
    # partial and negative rewards are not r_i = 1: p = 2/4, only the two 1.0s can get a bonus
    # l_min = 30 (the shortest SOLVED), l = 50 -> lambda = 1/2 - 20/80 = 1/4; dr = 0.5 * [1/2, 1/4]
    dr = length_bonus([0.9, 1.0, 1.0, -1.0], [10, 30, 50, 5], 4, cfg, 0.0, 1.0)
    torch.testing.assert_close(dr, torch.tensor([0.0, 0.25, 0.125, 0.0]))
    # l_max <= l_min: the shortest gets 1/2, anything longer than l_min + T_l -1/2 (clamp's limit); p = 1/2
    dr = length_bonus([1, 1, 0, 0], [600, 700, 5, 5], 4, LengthRewardConfig(l_max=500, t_len=0), 0.0, 1.0)
    torch.testing.assert_close(dr, torch.tensor([0.25, -0.25, 0.0, 0.0]))
    # equal lengths: everyone within T_l of l_min gets 1/2; p = 1 -> dr = 1/2
    torch.testing.assert_close(length_bonus([1, 1, 1, 1], [7, 7, 7, 7], 4, cfg, 1.0, 1.0), torch.full((4,), 0.5))
    with pytest.raises(ValueError, match="same 1-D shape"):
        length_bonus([1, 1], [1, 2, 3], 2, cfg, 0.0, 1.0)
    with pytest.raises(ValueError, match="constant l_max > 0"):
        length_bonus([1, 1], [1, 2], 2, LengthRewardConfig(), 0.0, 1.0)
    with pytest.raises(ValueError, match="p_star"):
        length_bonus([1, 1], [1, 2], 2, cfg, [0.0, 0.0, 0.0], 1.0)
    for bad in (dict(t_acc=1.5), dict(l_max=-1), dict(coef=-0.1), dict(ramp_steps=-2)):
        with pytest.raises(ValueError, match="length_cfg"):
            LengthRewardConfig(**bad)


def test_length_bonus_enters_maxrl_numerator():
    r = torch.tensor([1.0, 1, 1, 0])
    dr = length_bonus(r, [100, 300, 500, 50], 4, LengthRewardConfig(l_max=500, t_len=50), 0.75, 1.0)
    # dr = [0.375, 0, -0.375, 0]; mean r = 0.75; A = (r + dr - 0.75) / 0.75
    adv = compute_advantages("maxrl", r, 4, bonus=dr)
    torch.testing.assert_close(adv, torch.tensor([(1.375 - 0.75) / 0.75, 0.25 / 0.75, (0.625 - 0.75) / 0.75, -1.0]))


def test_p_star_is_the_running_max_per_source_and_survives_a_round_trip():
    st = LengthRewardState()
    # step 1: a solves 2/4, b 1/4 (the gated 0 of a correct answer does not count)
    st.observe(["a"] * 4 + ["b"] * 4, [1, 1, 0, 0, 1, 0, 0, 0])
    assert st.p_star == {"a": 0.5, "b": 0.25}
    # step 2: a 1/4 (below its max: kept at 0.5), b 3/4 (raised); c new: 1/2
    st.observe(["a"] * 4 + ["b"] * 4 + ["c"] * 2, [1, 0, 0, 0, 1, 1, 1, 0, 1, -1])
    assert st.p_star == {"a": 0.5, "b": 0.75, "c": 0.5}
    back = LengthRewardState()
    back.load_state_dict(json.loads(json.dumps(st.state_dict())))
    assert back.p_star == st.p_star and back.steps == st.steps
    # step 3 after the round trip: a 3/4 -> 0.75, b 2/4 -> stays 0.75
    back.observe(["a"] * 4 + ["b"] * 4, [1, 1, 1, 0, 1, 1, 0, 0])
    assert back.p_star == {"a": 0.75, "b": 0.75, "c": 0.5}
    with pytest.raises(ValueError, match="exactly 'p_star' and 'steps'"):
        back.load_state_dict({"p_star": {}})
    assert data_source("math/arith", {}) == "math/arith"
    assert data_source("math/arith", {"aggregation": True}) == "math/arith+aggregation"


def test_length_state_bonus_updates_p_star_first_and_advances_c():
    cfg = LengthRewardConfig(l_max=500, t_len=50, t_acc=0.25, coef_start=0.5, coef=1.0, ramp_steps=2)
    st = LengthRewardState(p_star={"a": 1.0})
    r, lengths = [1, 1, 1, 0], [100, 300, 500, 50]
    # p* stays 1.0 (this batch solves 3/4); 3/4 > 1.0 - 0.25 is false: no bonus; c(0) = 0.5
    dr, m = st.bonus(cfg, r, lengths, 4, ["a"] * 4)
    assert dr.tolist() == [0.0] * 4 and m["length_coef"] == 0.5 and st.steps == 1
    # a new source: its first batch sets p* = 3/4 -> 3/4 > 0.5 opens the gate;
    # c(1) = 0.5 + 0.5 * 1/2 = 0.75; dr = 0.75 * 0.75 * [1/2, 0, -1/2, 0]
    dr, m = st.bonus(cfg, r, lengths, 4, ["b"] * 4)
    torch.testing.assert_close(dr, torch.tensor([0.28125, 0.0, -0.28125, 0.0]))
    assert m["length_coef"] == 0.75 and m["length_bonus_frac"] == 0.5 and st.p_star["b"] == 0.75
    assert cfg.coef_at(2) == cfg.coef_at(50) == 1.0 and LengthRewardConfig(ramp_steps=0, coef=0.7).coef_at(0) == 0.7


def test_c_schedule_runs_on_across_two_stages(tmp_path):
    """c: 0.1 -> 1.0 over 4 steps, c(s) = 0.1 + 0.9 * min(1, s/4) = 0.1, 0.325, 0.55, 0.775, 1.0, 1.0.
    Stage 1 takes 3 steps and hands its state over in final/run_state.json (cascade/stage.py);
    stage 2 continues at s = 3 rather than starting again at 0.1."""
    from cascade.stage import handed_over

    cfg = LengthRewardConfig(l_max=100, coef_start=0.1, coef=1.0, ramp_steps=4)
    r, lengths = [1, 0], [5, 5]
    one = LengthRewardState()
    cs = [one.bonus(cfg, r, lengths, 2, ["a", "a"])[1]["length_coef"] for _ in range(3)]
    final = tmp_path / "0-warmup" / "final"
    final.mkdir(parents=True)
    (final / "run_state.json").write_text(json.dumps({"stage": "warmup", "length_reward": one.state_dict()}))
    two = LengthRewardState()
    two.load_state_dict(handed_over(final, "length_reward"))
    cs += [two.bonus(cfg, r, lengths, 2, ["a", "a"])[1]["length_coef"] for _ in range(3)]
    assert cs == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0, 1.0])
    assert two.steps == 6 and two.p_star == {"a": 0.5}
    assert handed_over(tmp_path, "length_reward") is None  # a plain model directory: nothing handed over


def test_a_final_checkpoint_without_length_reward_state_hands_nothing_over(tmp_path):
    """A ``final/`` whose run_state.json lacks the key (written before the length reward had run state) hands
    nothing over: the next stage's length reward starts fresh rather than loading an empty state."""
    from cascade.stage import handed_over

    (tmp_path / "run_state.json").write_text(json.dumps({"stage": "warmup", "steps": 3}))
    assert handed_over(tmp_path, "length_reward") is None
    assert handed_over(tmp_path, "steps") == 3


# ------------------------------------------------------------------------------------------------
# the trainer's wiring: gates before advantages, length state in state_dict, the canary


def _trainer(tmp_path, **kw):
    from envs.curriculum import Curriculum
    from train.engine import TorchEngine
    from train.presets import init_model
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig

    model, tok = init_model("tiny-dense", tmp_path / "m", seed=0)
    cfg = RLConfig(**{"group_size": 4, "prompts_per_step": 1, "chat_template": False, "dynamic_sampling": False,
                      "sampling": SamplingConfig(max_new_tokens=6), **kw})
    cur = Curriculum(["toy/max"], controller="fixed", seed=0, controller_kwargs={"difficulty": 0})
    return RLTrainer(model, tok, TorchEngine(model, tok), cur, cfg)


def _group(env_id, rewards, lengths, meta=None):
    from envs.base import Problem, Score
    from train.engine.base import Completion
    from train.rl.trainer import Group, Rollout

    prob = Problem("q", "1", env_id, meta=meta or {})
    rolls = [Rollout(env_id, prob, [1, 2], Completion([3] * n, "", [0.0] * n, "stop"), Score(r, r >= 1, True), r)
             for r, n in zip(rewards, lengths)]
    return Group(env_id, prob, rolls)


def test_trainer_applies_the_length_reward_with_run_state(tmp_path):
    cfg = LengthRewardConfig(l_max=1000, t_len=0, t_acc=0.25, coef_start=1.0, coef=1.0)
    rl = _trainer(tmp_path, length_reward=True, length_cfg=cfg, advantage="maxrl")
    rl.length_state.p_star["toy/max"] = 0.75
    # the batch: p = 1/2 is not > 0.75 - 0.25 -> no bonus; maxrl: (r - 0.5) / 0.5 = [1, 1, -1, -1]
    adv = rl._advantages([_group("toy/max", [1.0, 1.0, 0.0, 0.0], [10, 12, 900, 30])])
    assert adv.tolist() == [1.0, 1.0, -1.0, -1.0] and rl.length_metrics["length_bonus_frac"] == 0.0
    # an aggregation group is its own source: p* = its first solve rate 1/2 -> gate open; l_max = 1000:
    # dr = 0.5 * [1/2, 1/2 - 2/990, 0, 0]; mean r = 1/2 -> A = (r + dr - 0.5) / 0.5
    adv = rl._advantages([_group("toy/max", [1.0, 1.0, 0.0, 0.0], [10, 12, 900, 30], {"aggregation": True})])
    torch.testing.assert_close(adv, torch.tensor([1.5, 1.5 - 2 / 990, -1.0, -1.0]))
    assert rl.length_state.p_star == {"toy/max": 0.75, "toy/max+aggregation": 0.5} and rl.length_state.steps == 2
    sd = rl.state_dict()
    again = _trainer(tmp_path / "b", length_reward=True, length_cfg=cfg)
    again.load_state_dict(sd)
    assert again.length_state.state_dict() == rl.length_state.state_dict()
    # stage 2 after a hand-off: the trainer of the next stage takes the state written to final/run_state.json
    # (as cascade/stage.py does) and its c continues: with coef_start 0.1 -> 1.0 over 4 steps, stage 1's
    # 2 updates used c(0) = 0.1 and c(1) = 0.325, stage 2's next one uses c(2) = 0.55, not 0.1 again
    from cascade.stage import handed_over

    sched = LengthRewardConfig(l_max=1000, t_len=0, coef_start=0.1, coef=1.0, ramp_steps=4)
    one = _trainer(tmp_path / "s1", length_reward=True, length_cfg=sched)
    cs = []
    for _ in range(2):
        one._advantages([_group("toy/max", [1.0, 0.0], [4, 4])])
        cs.append(one.length_metrics["length_coef"])
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "run_state.json").write_text(json.dumps({"length_reward": one.length_state.state_dict()}))
    two = _trainer(tmp_path / "s2", length_reward=True, length_cfg=sched)
    two.length_state.load_state_dict(handed_over(tmp_path / "final", "length_reward"))
    two._advantages([_group("toy/max", [1.0, 0.0], [4, 4])])
    assert cs + [two.length_metrics["length_coef"]] == pytest.approx([0.1, 0.325, 0.55])
    # l_max 0: the stage's max_new_tokens (6); shortest solved 2 -> lambda(4) = 1/2 - 2/4 = 0; p = 1/2
    rl0 = _trainer(tmp_path / "c", length_reward=True, length_cfg=LengthRewardConfig(t_len=0, coef_start=1.0))
    rl0._advantages([_group("toy/max", [1.0, 1.0, 0.0, 0.0], [2, 4, 1, 1])])
    assert rl0.length_metrics["length_bonus_mean"] == pytest.approx((0.5 * 0.5 + 0.0) / 4)


def test_trainer_repetition_gate_and_canary(tmp_path):
    from envs.base import Score

    rl = _trainer(tmp_path, reward="score", advantage="grpo", repetition_chunk_tokens=64)
    loop = [11, 22, 33, 44, 55, 66, 77] * 40  # 280 tokens: chunks 64, 64, 64, 88 (tail of 24 merged)
    plain = [(i * 7919) % 1000 for i in range(280)]
    assert rl.reward_of(Score(1.0, True, True), plain) == 1.0
    assert rl.reward_of(Score(1.0, True, True), loop) == 0.0
    assert rl.reward_of(Score(-1.0, False, True), loop) == -1.0  # a looping wrong answer stays wrong
    assert rl.reward_of(Score(-0.5, False, True), plain) == -0.5
    groups, m = rl.collect()
    ids = [r.completion.token_ids for g in groups for r in g.rollouts]
    want = rare_token_fractions(ids, rl.policy.config.vocab_size)
    assert {k: m[k] for k in want} == want and set(want) == {f"rare_token_top{p}" for p in (10, 5, 2, 1)}
    with pytest.raises(ValueError, match="repetition_chunk_tokens"):
        _trainer(tmp_path / "x", repetition_chunk_tokens=0)


# ------------------------------------------------------------------------------------------------
# LZ77 repetition gate (ZAYA1 eq. 16) on token-id bytes


def _reference_ratios(ids, C):
    """Eq. 16 written out independently: 4-byte little-endian ids, chunks of C tokens with the short
    tail merged, one stateful raw-deflate stream (level 1, 1 KiB window), sync flush per chunk."""
    raw = b"".join(i.to_bytes(4, "little") for i in ids)
    n = len(ids)
    starts = [k * C for k in range(max(1, n // C))]
    comp = zlib.compressobj(level=1, wbits=-10)
    out = []
    for j, s in enumerate(starts):
        e = starts[j + 1] if j + 1 < len(starts) else n
        piece = comp.compress(raw[4 * s:4 * e]) + comp.flush(zlib.Z_SYNC_FLUSH)
        assert piece.endswith(b"\x00\x00\xff\xff")  # the 4 bytes of flush overhead
        out.append(((len(piece) - 4) / (4 * (e - s)), e - s))
    return out


def test_token_id_bytes_and_chunking():
    # 4-byte little-endian: 1 -> 01 00 00 00; 258 = 0x0102 -> 02 01 00 00
    assert token_id_bytes([1, 258]) == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    with pytest.raises(ValueError, match="token ids"):
        token_id_bytes([-1])
    assert token_id_bytes([2 ** 32 - 1]) == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*32\)"):
        token_id_bytes([2 ** 32])
    # 10 tokens, C = 4: chunks of 4 and 4 + 2 = 6 tokens (the tail of 2 joins its predecessor)
    ids = list(range(100, 110))
    ref = _reference_ratios(ids, 4)
    assert [n for _, n in ref] == [4, 6]
    assert chunk_compression_ratios(ids, 4) == [r for r, _ in ref]
    # shorter than one chunk: one chunk; empty: none
    assert len(chunk_compression_ratios(ids, 64)) == 1 and chunk_compression_ratios([], 4) == []
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_compression_ratios(ids, 0)


def test_repetition_gate_repetitive_vs_not():
    # not repetitive: ids 7919 * i mod 151936 never repeat within 2000 tokens -> ratios well above 0.05
    plain = [(7919 * i) % 151936 for i in range(2000)]
    ratios = chunk_compression_ratios(plain, 512)
    assert len(ratios) == 3  # 512, 512, 976 (the tail of 464 joins the third chunk)
    assert ratios == [r for r, _ in _reference_ratios(plain, 512)] and min(ratios) > 0.3
    assert not is_repetitive(plain) and repetition_gate(1.0, plain) == 1.0
    # a loop with a period of 7 tokens (28 bytes, inside the 1 KiB window): after the first 28 bytes
    # every chunk is back-references of up to 258 bytes: 2048 bytes -> ~8 matches of a few bits each
    loop = [101, 2202, 30303, 404, 5, 66, 7777] * 300
    ratios = chunk_compression_ratios(loop, 512)
    assert ratios == [r for r, _ in _reference_ratios(loop, 512)] and max(ratios) < 0.05
    assert repetition_gate(1.0, loop) == 0.0 and repetition_gate(0.5, loop) == 0.0
    assert repetition_gate(-1.0, loop) == -1.0 and repetition_gate(-0.3, loop) == -0.3  # never lifted to 0
    # a response that starts well and falls into a loop: its late chunks catch it
    mixed = plain[:600] + loop[:1500]
    ratios = chunk_compression_ratios(mixed, 512)
    assert ratios[0] > 0.3 and ratios[-1] < 0.05 and is_repetitive(mixed)
    # the same loop in chunks too small to amortise the block bits stays above the threshold
    assert min(chunk_compression_ratios(loop[:14], 7)) > 0.05


def test_rare_token_canary():
    # vocab 100: top 10% = ids >= 90, 5% >= 95, 2% >= 98, 1% >= 99
    ids = [[0, 89, 90, 94, 95], [97, 98, 99, 50, 10]]
    # >= 90: 90, 94, 95, 97, 98, 99 (6 of 10); >= 95: 95, 97, 98, 99 (4); >= 98: 98, 99 (2); >= 99: 1
    assert rare_token_fractions(ids, 100) == {"rare_token_top10": 0.6, "rare_token_top5": 0.4,
                                              "rare_token_top2": 0.2, "rare_token_top1": 0.1}
    # vocab 151936: top 10% starts at ceil(151936 * 0.9) = ceil(136742.4) = 136743
    assert rare_token_fractions([[136742, 136743]], 151936, (10,)) == {"rare_token_top10": 0.5}
    assert rare_token_fractions([], 100)["rare_token_top1"] == 0.0
    with pytest.raises(ValueError, match="percents"):
        rare_token_fractions([[1]], 100, (0,))
    assert rare_token_fractions([[0, 5]], 10, (100,)) == {"rare_token_top100": 1.0}  # every id
    with pytest.raises(ValueError, match=r"percents must be in \(0, 100\], got 101"):
        rare_token_fractions([[1]], 100, (101,))
    with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
        rare_token_fractions([[1]], 0)


# ------------------------------------------------------------------------------------------------
# overlong


def test_overlong_modes():
    rewards, lengths, cut = [1.0, 0.5, 1.0, 0.0], [10, 90, 100, 100], [False, False, True, True]
    r, keep = overlong_shaping(rewards, lengths, cut, OverlongConfig())
    assert r.tolist() == rewards and keep.all()
    r, keep = overlong_shaping(rewards, lengths, cut, OverlongConfig(mode="reward", truncated_reward=-1.0))
    assert r.tolist() == [1.0, 0.5, -1.0, -1.0] and keep.all()
    r, keep = overlong_shaping(rewards, lengths, cut, OverlongConfig(mode="mask"))
    assert r.tolist() == rewards and keep.tolist() == [True, True, False, False]
    # DAPO soft punishment: L_max 100, cache 20: 0 up to 80, -(l - 80)/20 up to 100, -1 beyond
    soft = OverlongConfig(mode="soft", max_len=100, buffer_len=20)
    r, _ = overlong_shaping([1.0, 1.0, 1.0, 1.0, 1.0], [80, 85, 100, 130, 10], [False] * 5, soft)
    torch.testing.assert_close(r, torch.tensor([1.0, 0.75, 0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="unknown overlong mode 'drop'"):
        OverlongConfig(mode="drop")
    with pytest.raises(ValueError, match="buffer_len"):
        OverlongConfig(mode="soft", max_len=10)


def test_soft_overlong_refuses_a_buffer_longer_than_max_len():
    """Soft overlong needs buffer_len <= max_len (max_len left at its default 0 too)."""
    for max_len, buffer_len in ((100, 200), (0, 64)):
        with pytest.raises(ValueError, match="buffer_len <= max_len"):
            OverlongConfig(mode="soft", max_len=max_len, buffer_len=buffer_len)


def test_length_reward_settings_and_inputs_are_checked():
    for bad, match in (({"t_len": -1}, "t_len"), ({"coef_start": -0.1}, "coef_start"), ({"coef": -1.0}, "coef")):
        with pytest.raises(ValueError, match=match):
            LengthRewardConfig(**bad)
    # c before the schedule starts (a negative step) is coef_start, not extrapolated below it
    cfg = LengthRewardConfig(coef_start=0.2, coef=1.0, ramp_steps=4)
    assert cfg.coef_at(-2) == pytest.approx(0.2) and cfg.coef_at(2) == pytest.approx(0.6) and cfg.coef_at(9) == 1.0
    with pytest.raises(ValueError, match="2 sources for 3 rewards"):
        LengthRewardState().observe(["a", "b"], [1.0, 0.0, 1.0])
