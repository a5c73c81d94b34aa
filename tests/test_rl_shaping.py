"""Dynamic sampling, ZAYA1 length reward, LZ77 repetition gate and overlong handling."""
import argparse
import collections
import json
import logging
import subprocess
import zlib
from dataclasses import dataclass

import pytest
import torch

from train.rl import compute_advantages
from train.rl.shaping import (
    DynamicSampler, LengthRewardConfig, OverlongConfig, all_equal, chunk_compression_ratios, filter_groups,
    is_repetitive, length_bonus, linear_ramp, overlong_shaping, repetition_gate,
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


# ------------------------------------------------------------------------------------------------
# length reward


def test_length_bonus_worked_example():
    cfg = LengthRewardConfig(coef=1.0, target_pass=0.75, t_acc=0.25, t_len=50)
    dr = length_bonus([1, 1, 1, 0], [100, 300, 500, 50], 4, cfg)
    # p = 0.75 > 0.5 and > 1/4; correct lengths 100..500; lambda = [1/2 (within T_l), 0, -1/2]; dr = p * lambda
    torch.testing.assert_close(dr, torch.tensor([0.375, 0.0, -0.375, 0.0]))
    # partial position: l = 200 -> lambda = 1/2 - 100/400 = 1/4; coef override 0.5
    dr = length_bonus([1, 1, 1, 0], [100, 200, 500, 50], 4, cfg, coef=0.5)
    torch.testing.assert_close(dr, torch.tensor([0.5 * 0.75 * 0.5, 0.5 * 0.75 * 0.25, -0.5 * 0.75 * 0.5, 0.0]))


def test_length_bonus_gates():
    cfg = LengthRewardConfig(target_pass=0.75, t_acc=0.25, t_len=0)
    # p = 0.5 is not > p* - T_acc = 0.5: no bonus
    assert length_bonus([1, 1, 0, 0], [10, 20, 30, 40], 4, cfg).abs().sum() == 0
    # p > p* - T_acc but p = 1/G: the gate [p > 1/G] closes it
    low = LengthRewardConfig(target_pass=0.2, t_acc=0.1, t_len=0)
    assert length_bonus([1, 0, 0, 0], [10, 20, 30, 40], 4, low).abs().sum() == 0
    # with two of four correct the gate opens; incorrect responses never get a bonus
    torch.testing.assert_close(length_bonus([1, 0, 1, 0], [10, 5, 30, 1], 4, low),
                               torch.tensor([0.5 * 0.5, 0.0, 0.5 * -0.5, 0.0]))
    # all correct answers of one length: everyone gets 1/2 (no division by zero)
    torch.testing.assert_close(length_bonus([1, 1, 1, 1], [7, 7, 7, 7], 4, cfg), torch.full((4,), 0.5))
    # explicit correctness flags instead of reward == 1; group ids instead of a size
    dr = length_bonus([0.9, 0.9, 0.9, 0.0], [10, 20, 30, 40], torch.tensor([5, 5, 5, 5]), cfg,
                      correct=[True, True, True, False])
    torch.testing.assert_close(dr, torch.tensor([0.375, 0.0, -0.375, 0.0]))
    with pytest.raises(ValueError, match="same 1-D shape"):
        length_bonus([1, 1], [1, 2, 3], 2)


def test_length_bonus_enters_maxrl_numerator():
    r = torch.tensor([1.0, 1, 1, 0])
    dr = length_bonus(r, [100, 300, 500, 50], 4, LengthRewardConfig(t_len=50))
    adv = compute_advantages("maxrl", r, 4, bonus=dr)
    torch.testing.assert_close(adv, torch.tensor([(1.375 - 0.75) / 0.75, 0.25 / 0.75, (0.625 - 0.75) / 0.75, -1.0]))


def test_linear_ramp():
    assert [linear_ramp(s, 4) for s in (-1, 0, 2, 4, 9)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert linear_ramp(3, 0, final=0.7) == 0.7


# ------------------------------------------------------------------------------------------------
# repetition gate

NATURAL = "\n".join(m.__doc__ for m in (argparse, json, logging, subprocess, collections))


def test_repetition_gate_natural_vs_repetitive():
    assert len(NATURAL.encode()) > 4096
    ratios = chunk_compression_ratios(NATURAL)
    assert min(ratios) > 0.3, ratios
    assert not is_repetitive(NATURAL) and repetition_gate(1.0, NATURAL) == 1.0
    loop = "Wait, let me check the answer again. " * 300
    assert max(chunk_compression_ratios(loop)[1:]) < 0.05
    assert repetition_gate(1.0, loop) == 0.0
    # a response that starts well and falls into a loop is caught by its late chunks
    mixed = NATURAL[:3000] + "so so so " * 800
    ratios = chunk_compression_ratios(mixed)
    assert ratios[0] > 0.3 and ratios[-2] < 0.05 and repetition_gate(0.7, mixed) == 0.0


def test_repetition_gate_stream_is_raw_deflate_with_1k_window():
    data = NATURAL.encode()
    comp = zlib.compressobj(level=1, wbits=-10)
    pieces = [comp.compress(data[i:i + 1000]) + comp.flush(zlib.Z_SYNC_FLUSH) for i in range(0, len(data), 1000)]
    assert [round(len(p) / len(data[i * 1000:(i + 1) * 1000]), 12) for i, p in enumerate(pieces)] == \
        [round(r, 12) for r in chunk_compression_ratios(data, chunk_size=1000)]
    assert zlib.decompressobj(wbits=-10).decompress(b"".join(pieces)) == data
    # chunk sizes: tiny chunks pay the flush overhead and never fall below 0.05; empty text passes
    assert not is_repetitive("ab" * 500, chunk_size=64)
    assert is_repetitive("ab" * 5000, chunk_size=4096)
    assert chunk_compression_ratios("") == [] and not is_repetitive("")
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_compression_ratios("x", chunk_size=0)


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
