"""``cascade report``: the per-stage summary and the plot, from hand-written metrics.jsonl records."""
import json

import pytest


def _write(tmp_path, recs):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_summary_counts_steps_and_takes_first_last_mean_in_time_order(tmp_path):
    """The last SFT loss is the latest one, reward first -> last are the earliest and latest RL steps, accuracy is
    the mean over RL steps, seconds the sum of every step's."""
    from cascade.report import summarize

    recs = [{"stage": "math", "phase": "sft", "step": 0, "time": 1, "sft_loss": 0.9, "time_step_s": 0.25},
            {"stage": "math", "phase": "sft", "step": 1, "time": 2, "sft_loss": 0.5, "time_step_s": 0.25},
            {"stage": "math", "phase": "rl", "step": 0, "time": 10, "reward_mean": 0.1, "accuracy": 0.0,
             "time_step_s": 1.0},
            {"stage": "math", "phase": "rl", "step": 1, "time": 11, "reward_mean": 0.2, "accuracy": 0.5,
             "time_step_s": 1.5},
            {"stage": "math", "phase": "rl", "step": 2, "time": 12, "reward_mean": 0.6, "accuracy": 1.0,
             "time_step_s": 2.0}]
    _write(tmp_path, recs)
    (s,) = summarize(tmp_path)
    assert (s["sft_steps"], s["rl_steps"]) == (2, 3)
    assert s["sft_loss_last"] == 0.5
    assert (s["reward_first"], s["reward_last"]) == (0.1, 0.6)
    assert s["accuracy_mean"] == pytest.approx(0.5)
    assert s["seconds"] == pytest.approx(5.0)


def test_summary_difficulty_is_the_highest_level_of_windows_and_nested_mappings(tmp_path):
    """An RLVE window [low, high] counts its high end, a nested mapping its highest level, an empty window
    nothing; the column is the highest over environments and steps."""
    from cascade.report import summarize

    recs = [{"stage": "rlve", "phase": "rl", "step": 0, "time": 0, "reward_mean": 0.0, "accuracy": 0.0,
             "difficulty": {"a": [1, 4], "b": {"x": 3, "y": 2}, "c": []}},
            {"stage": "rlve", "phase": "rl", "step": 1, "time": 1, "reward_mean": 0.0, "accuracy": 0.0,
             "difficulty": {"a": [0, 2], "b": {"x": 1, "y": 2}, "c": []}}]
    _write(tmp_path, recs)
    (s,) = summarize(tmp_path)
    assert s["difficulty"] == 4.0
    recs = [dict(r, difficulty={"b": {"x": 3, "y": 2}}) for r in recs]
    _write(tmp_path, recs)
    (s,) = summarize(tmp_path)
    assert s["difficulty"] == 3.0


def test_summary_rose_counts_environments_out_of_all(tmp_path):
    from cascade.report import summarize

    recs = [{"stage": "rlve", "phase": "rl", "step": 0, "time": 0, "reward_mean": 0.0, "accuracy": 0.0},
            {"stage": "rlve", "phase": "eval", "step": 1, "time": 1, "accuracy_before": 0.1, "accuracy_after": 0.2,
             "eval_k": 2, "difficulty_start": {"a": 1, "b": 3}, "difficulty_end": {"a": 2, "b": 3},
             "difficulty_max": {"a": 2, "b": 3}}]
    _write(tmp_path, recs)
    (s,) = summarize(tmp_path)
    assert s["difficulty_rose"] == "1/2"


def test_report_table_shows_a_dash_where_nothing_was_measured(tmp_path, capsys):
    """An SFT-only stage: no RL steps, no difficulty: its reward, accuracy, max diff and rose cells are '-'."""
    from cascade.report import main

    _write(tmp_path, [{"stage": "warmup", "phase": "sft", "step": 0, "time": 0, "sft_loss": 1.0}])
    assert main([str(tmp_path), "--png", str(tmp_path / "r.png")]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "warmup" in ln and "│" in ln)
    cells = [c.strip() for c in row.strip().strip("│").split("│")]
    assert cells == ["warmup", "1", "0", "- -> -", "-", "- -> -", "-", "-"]


def _plot(tmp_path, monkeypatch, recs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cascade import report

    _write(tmp_path, recs)
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read its axes
    report.plot(tmp_path, tmp_path / "r.png")
    return figs[0].axes


def test_plot_places_each_stage_after_all_steps_of_the_one_before(tmp_path, monkeypatch):
    """Two RL stages of two steps each: the second's steps at x=2, 3; the difficulty panel shows the highest
    level (solid) and the mean over environments (dashed) of each step."""
    recs = [{"stage": st, "phase": "rl", "step": i, "time": 10 * j + i, "reward_mean": 0.1, "accuracy": 0.1,
             "difficulty": {"a": 1 + i, "b": {"x": 3 + i}}}
            for j, st in enumerate(("rlve", "math")) for i in range(2)]
    axes = _plot(tmp_path, monkeypatch, recs)
    reward = {ln.get_label(): list(ln.get_xdata()) for ln in axes[0].lines}
    assert reward["rlve"] == [0, 1] and reward["math"] == [2, 3]
    diff = [ln for ln in axes[2].lines if ln.get_label() == "rlve"]
    assert list(diff[0].get_ydata()) == [3.0, 4.0]
    dashed = [list(ln.get_ydata()) for ln in axes[2].lines if ln.get_linestyle() == "--"]
    assert dashed[0] == [2.0, 3.0]  # mean of (1, 3) and of (2, 4)


def test_plot_shows_no_held_out_point_for_a_stage_without_held_out_problems(tmp_path, monkeypatch):
    recs = [{"stage": "math", "phase": "rl", "step": 0, "time": 0, "reward_mean": 0.1, "accuracy": 0.1},
            {"stage": "math", "phase": "eval", "step": 1, "time": 1, "accuracy_before": 0.0, "accuracy_after": 0.0,
             "eval_k": 4, "accuracy_before_by_family": {}, "accuracy_after_by_family": {}}]
    axes = _plot(tmp_path, monkeypatch, recs)
    assert [ln for ln in axes[-1].lines if ln.get_marker() == "o"] == []


def test_report_of_a_run_without_records_is_refused(tmp_path):
    from cascade.report import main

    _write(tmp_path, [])
    with pytest.raises(ValueError, match="no step records yet"):
        main([str(tmp_path)])
    assert not (tmp_path / "report.png").exists()
