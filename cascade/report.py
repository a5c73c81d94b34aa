"""``cascade report RUN_DIR``: a per-stage summary and a PNG of reward, accuracy and difficulty."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cascade.records import read_records

PANELS = (("reward_mean", "reward"), ("accuracy", "accuracy (train rollouts)"), ("difficulty", "difficulty (max, mean --)"),
          ("held_out", "held-out avg@k"))


def _levels(v: dict) -> list[float]:
    """Each environment's level in a ``difficulty`` mapping (those that have one)."""
    return [x for x in (_difficulty(y) for y in v.values()) if x is not None]


def _difficulty(v) -> float | None:
    if isinstance(v, dict):
        vals = _levels(v)
        return max(vals) if vals else None
    if isinstance(v, (list, tuple)) and v:  # an RLVE window [low, high]
        return float(max(v))
    return float(v) if isinstance(v, (int, float)) else None


def _mean_difficulty(v) -> float | None:
    vals = _levels(v) if isinstance(v, dict) else []
    return sum(vals) / len(vals) if vals else None


def summarize(run_dir: Path) -> list[dict]:
    recs = read_records(run_dir)
    stages: dict[str, dict] = {}
    for r in sorted(recs, key=lambda r: (r["time"])):
        s = stages.setdefault(r["stage"], {"stage": r["stage"], "sft_steps": 0, "rl_steps": 0, "reward": [],
                                             "accuracy": [], "accuracy_before": None, "accuracy_after": None,
                                             "difficulty": None, "difficulty_rose": None, "seconds": 0.0})
        if r["phase"] == "sft":
            s["sft_steps"] += 1
            s["sft_loss_last"] = r.get("sft_loss")
        elif r["phase"] == "rl":
            s["rl_steps"] += 1
            s["reward"].append(r.get("reward_mean", 0.0))
            s["accuracy"].append(r.get("accuracy", 0.0))
            s["difficulty"] = max((x for x in (s["difficulty"], _difficulty(r.get("difficulty"))) if x is not None),
                                  default=None)  # the highest level reached (the ZAYA controller also lowers it)
        elif r["phase"] == "eval":
            for k in ("accuracy_before", "accuracy_after"):
                if r.get(f"{k}_by_family") == {}:  # eval_problems=0: no held-out score, not 0.00
                    s[k] = None
                elif k in r:
                    s[k] = r[k]
            s["eval_k"] = r.get("eval_k", s.get("eval_k"))
            if _difficulty(r.get("difficulty_max")) is not None:  # the stage's own record of its peak
                s["difficulty"] = max(s["difficulty"] or 0.0, _difficulty(r["difficulty_max"]))
            if r.get("difficulty_end") is not None:
                from cascade.run import difficulty_rise

                rows, rose = difficulty_rise({"difficulty": r["difficulty_end"], "difficulty_max": r.get("difficulty_max"),
                                              "difficulty_start": r.get("difficulty_start")})
                s["difficulty_rose"] = f"{rose}/{len(rows)}"
        s["seconds"] += float(r.get("time_step_s", 0.0))
    out = []
    for s in stages.values():
        rw, ac = s.pop("reward"), s.pop("accuracy")
        s["reward_first"], s["reward_last"] = (rw[0], rw[-1]) if rw else (None, None)
        s["accuracy_mean"] = sum(ac) / len(ac) if ac else None
        out.append(s)
    return out


def plot(run_dir: Path, png: Path) -> Path:
    """Plot the run's RL steps, stage after stage (a stage without RL steps, SFT only, one x slot), to ``png``
    (``.png`` added to a name without a suffix); returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_recs = read_records(run_dir)
    recs = [r for r in all_recs if r["phase"] == "rl"]
    evals = {r["stage"]: r for r in all_recs if r["phase"] == "eval" and r.get("accuracy_after") is not None
             and r.get("accuracy_after_by_family") != {}}  # eval_problems=0 scores nothing
    # every stage that trained or was scored, SFT-only ones (steps=0) too: the table shows them all
    stage_order = list(dict.fromkeys(r["stage"] for r in sorted(all_recs, key=lambda r: r["time"])
                                     if r["phase"] in ("sft", "rl", "eval")))
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 10), sharex=True)
    offset = 0
    nan = float("nan")
    for st in stage_order:
        # a stage without RL steps (SFT only): one slot, with no points but its held-out score
        rs = sorted((r for r in recs if r["stage"] == st), key=lambda r: r["step"]) or [{}]
        xs = [offset + i for i in range(len(rs))]
        for ax, (key, _) in zip(axes, PANELS):
            if key == "held_out":  # the stage's held-out score before (first step) and after (last step)
                ev = evals.get(st)
                if ev is not None:
                    ax.plot([xs[0], xs[-1]], [ev.get("accuracy_before", nan), ev["accuracy_after"]], marker="o")
                    ax.annotate(f"{ev.get('accuracy_before', nan):.2f}->{ev['accuracy_after']:.2f}",
                                (xs[-1], ev["accuracy_after"]), fontsize=7, ha="right", va="bottom")
                else:
                    ax.plot([], [])  # keeps the stage colours aligned across panels
                continue
            ys = [_difficulty(r.get(key)) if key == "difficulty" else r.get(key) for r in rs]
            line, = ax.plot(xs, [y if y is not None else nan for y in ys], marker=".", label=st)
            if key == "difficulty":
                mean = [_mean_difficulty(r.get(key)) for r in rs]
                ax.plot(xs, [y if y is not None else nan for y in mean], ls="--", color=line.get_color())
        offset += len(rs)
        for ax in axes:
            ax.axvline(offset - 0.5, color="grey", lw=0.5, ls=":")
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    if stage_order:
        axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("RL step (stages in order)")
    fig.suptitle(f"Cascade run {run_dir}")
    fig.tight_layout()
    png = png if png.suffix else png.with_name(png.name + ".png")  # what matplotlib writes for a bare name
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _avg_at(rows: list[dict]) -> str:
    """What the held-out column scores: avg@k with the stages' k (0: greedy accuracy)."""
    ks = {s["stage"]: int(s["eval_k"]) for s in rows if s.get("eval_k") is not None}
    name = {k: f"avg@{k}" if k else "greedy accuracy" for k in ks.values()}
    if len(name) <= 1:
        return next(iter(name.values()), "avg@k")
    return "avg@k (" + ", ".join(f"{n} {name[k]}" for n, k in ks.items()) + ")"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="cascade report", description="Summarise a run and plot its metrics.")
    ap.add_argument("run_dir")
    ap.add_argument("--png", default=None, help="where to write the plot (default RUN_DIR/report.png)")
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    rows = summarize(run)
    if not rows:
        raise ValueError(f"{run}: no step records yet (nothing in metrics.jsonl to report)")
    from rich.console import Console
    from rich.table import Table

    # Short headers, so that the table fits the 80 columns rich assumes when stdout is not a terminal;
    # the caption says what each column is.
    t = Table(title=f"Cascade run {run}",
              caption="SFT, RL: steps; reward: first -> last RL step; acc: mean training accuracy; held-out: "
                      f"{_avg_at(rows)} before -> after; max diff: highest difficulty reached; rose: environments "
                      "whose difficulty rose")
    for col in ("stage", "SFT", "RL", "reward", "acc", "held-out", "max diff", "rose"):
        t.add_column(col, no_wrap=col in ("reward", "held-out"))

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for s in rows:
        t.add_row(s["stage"], str(s["sft_steps"]), str(s["rl_steps"]), f"{f(s['reward_first'])} -> {f(s['reward_last'])}",
                  f(s["accuracy_mean"]), f"{f(s['accuracy_before'])} -> {f(s['accuracy_after'])}", f(s["difficulty"]),
                  s["difficulty_rose"] or "-")
    Console().print(t)
    png = plot(run, Path(a.png) if a.png else run / "report.png")
    print(json.dumps({"png": str(png), "stages": rows}, default=str))
    return 0
