"""benchmarks/learning.py's one-line summary over seeds, and its --mode async path (the pipelined trainer)."""
import json

from benchmarks.learning import main, summarize

FAST = ["--rl-steps", "3", "--sft-steps", "2", "--sft-target", "0", "--held-out", "6", "--samples", "1",
        "--prompts-per-step", "2", "--group-size", "2", "--sft-examples", "64", "--probe", "4"]


def test_summary_line_is_medians_and_points(capsys):
    rows = [{"seed": s, "mode": "sync", "env": "toy/max", "difficulty": 1, "preset": "tiny-dense", "optim": "muon",
             "length_reward": True, "advantage": "maxrl", "loss": "dppo_tv", "metric": "m", "held_out_problems": 200,
             "rl_steps": 120, "accuracy_before": b, "accuracy_after": a, "gain": round(a - b, 4), "sft_steps": 10,
             "version_lag_mean": 0.0, "seconds": 1.0}
            for s, (b, a) in enumerate([(0.2, 0.5), (0.1, 0.7), (0.3, 0.35), (0.2, 0.6), (0.25, 0.65)])]
    out = summarize(rows, 2.0)
    assert out["gain_points_per_seed"] == [30.0, 60.0, 5.0, 40.0, 40.0]
    assert out["gain_median_points"] == 40.0 and out["gain_min_points"] == 5.0
    assert out["accuracy_before"] == 0.2 and out["accuracy_after"] == 0.6
    assert out["goal_met"] is False  # the minimum misses 10 points


def test_async_mode_runs_the_pipelined_trainer(capsys):
    # enough SFT that groups mix right and wrong answers (all-equal groups are dropped, leaving nothing to train)
    fast = [*FAST, "--sft-steps", "40", "--sft-batch", "16", "--group-size", "4", "--prompts-per-step", "4",
            "--rl-steps", "4"]
    assert main(["--seed", "0", "--mode", "async", "--max-staleness", "1", *fast]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["mode"] == "async" and line["rl_steps"] == 4
    assert 0.0 <= line["accuracy_before"] <= 1.0 and 0.0 <= line["accuracy_after"] <= 1.0
    # the producer ran ahead: some rollouts were sampled by the policy one version behind the update
    assert line["version_lag_mean"] > 0.0


def test_seeds_print_one_summary_line(capsys):
    assert main(["--seeds", "0,1", "--jobs", "1", *FAST]) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 1, lines  # the per-seed lines go to stderr
    s = json.loads(lines[0])
    assert s["seeds"] == [0, 1] and len(s["gain_points_per_seed"]) == 2
    assert s["gain_min_points"] <= s["gain_median_points"]
    assert len(out.err.strip().splitlines()) >= 2
