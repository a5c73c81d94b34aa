"""The benchmarks that time two paths also check that the paths compute the same thing (DESIGN.md
"Measurements"): each benchmark's tiny mode, run through its ``main``, reports the check's figure."""
from __future__ import annotations

import json


def _line(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_muon_single_and_sharded_steps_end_on_the_same_weights(capsys, monkeypatch):
    """benchmarks/muon.py: the single-process Muon step and the TSP D=2 one (each matrix orthogonalised by its
    owner rank, the shards exchanged in two all-to-alls) give the same parameters after the same steps on the
    same gradients: both fp32, the same Newton-Schulz arithmetic per whole matrix."""
    import torch

    from benchmarks.muon import main

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # (what the script sets for itself, undone afterwards)
    threads = torch.get_num_threads()
    try:
        main(["--hidden", "128", "--layers", "1", "--vocab", "128", "--steps", "1", "--wire-reps", "1"])
    finally:
        torch.set_num_threads(threads)  # (its reference step takes --threads, 2)
    out = _line(capsys)
    assert out["hidden"] == 128 and out["steps"] == 1
    assert 0.0 <= out["max_param_diff"] < 1e-6, out["max_param_diff"]


def test_train_padded_loss_matches_transformers_on_the_fresh_weights(capsys):
    """benchmarks/train.py: Cascade's padded micro-batches and transformers' Qwen3-MoE on the same fresh
    checkpoint give the same policy-gradient loss (fp32, the same padded rows; only summation order differs)."""
    from benchmarks.train import main

    assert main(["--rollouts", "8", "--repeats", "1", "--max-len", "256", "--median-len", "64"]) == 0
    out = _line(capsys)
    assert 0.0 <= out["warmup_loss_rel_diff_padded_vs_hf"] < 1e-5, out["warmup_loss_rel_diff_padded_vs_hf"]
    assert 0.0 <= out["warmup_loss_rel_diff_train_vs_hf"] < 1e-5, out["warmup_loss_rel_diff_train_vs_hf"]


def test_weights_servers_serve_the_weights_that_were_sent(capsys):
    """benchmarks/weights.py: after each transport's timed load, the server's log-probs of the tokens it
    samples equal those of a local model holding the sent weights (fp32 both sides). The versions differ by
    1e-3 per weight, which moves these log-probs far more than the bound."""
    from benchmarks.weights import main

    main(["--servers", "1", "--repeats", "1"])
    out = _line(capsys)
    assert 0.0 <= out["served_logprob_max_abs_diff"] < 1e-4, out["served_logprob_max_abs_diff"]
    assert out["sync_speedup"] is not None
