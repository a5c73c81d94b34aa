"""Smoke test of benchmarks/rsa_learning.py: its main path with tiny settings (1 seed, a few steps)."""
from __future__ import annotations

import json

from benchmarks.rsa_learning import FIGURES, main, make_template


def test_rsa_learning_main_path_prints_figures_and_only_the_agg_policy_sees_aggregation_prompts(capsys):
    rc = main(["--seeds", "0", "--jobs", "1", "--sft-steps", "10", "--sft-target", "0", "--sft-examples", "200",
               "--rl-steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--held-out", "3",
               "--population", "4", "--aggregate", "2", "--rounds", "1"])
    assert rc == 0
    got = capsys.readouterr()
    out = [json.loads(x) for x in got.out.strip().splitlines()]
    assert len(out) == 1  # stdout: the summary line; each seed's line on stderr
    seeds = [json.loads(x) for x in got.err.strip().splitlines() if x.startswith("{")]
    assert len(seeds) == 1
    seed, summary = seeds[0], out[0]
    assert seed["seed"] == 0 and seed["held_out_problems"] == 3
    for pol in ("agg", "ablation"):
        for f in FIGURES:
            assert 0.0 <= seed[pol][f] <= 1.0, (pol, f, seed[pol][f])
            assert 0.0 <= summary[f"{pol}.{f}"] <= 1.0
    for k in ("rsa_gain_points", "rsa_vs_ablation_points", "goal_met"):
        assert k in summary
    # the aggregation-trained run trained on aggregation prompts (from step 2 on, once tails exist); the ablation none
    assert seed["agg"]["aggregation_prompts"] > 0
    assert seed["ablation"]["aggregation_prompts"] == 0


def test_training_aggregation_prompts_are_token_for_token_the_prompts_rsa_builds(tiny_dense_dir):
    """The mixer (training) renders text that RL encodes with the chat template; RSA splices token ids.
    Both must give the policy the same tokens, or RL trains on prompts RSA never shows."""
    from cascade.aggregation import AggregationMixer
    from envs.base import get_env
    from train.engine import TorchEngine
    from train.model.hf_io import load_pretrained
    from train.tokenizer import chat_prompt_ids, load_tokenizer
    from ttc.backends import EngineBackend
    from ttc.templates import PromptBuilder

    tok = load_tokenizer(tiny_dense_dir)
    be = EngineBackend(TorchEngine(load_pretrained(tiny_dense_dir), tok), tok)
    p = get_env("toy/max").generate(1, 3)
    for name in ("compact", "math"):
        t = make_template(name)
        b = PromptBuilder(t, be.encode, be.chat_parts())
        assert b.solve(be.encode(p.prompt)) == chat_prompt_ids(tok, p.prompt)
        tails = [be.encode(f"I check.\n</think>\n\nThe answer is \\boxed{{{i}}}.") for i in range(4)]
        agg = AggregationMixer(tok, 1.0, 4, 8, template=t).build("toy/max", p, [be.decode(x) for x in tails])
        assert b.aggregate(be.encode(p.prompt), tails) == chat_prompt_ids(tok, agg.prompt)
