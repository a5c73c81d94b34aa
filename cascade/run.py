"""``cascade run``: run one stage (``stage=NAME``) or the whole cascade, resuming where a previous
run in the same ``out=`` directory stopped.

Run directory layout::

    OUT/config.yaml                     the merged configuration of the latest invocation
    OUT/metrics.jsonl                   one JSON record per step (stage, phase, step, metrics)
    OUT/init-model/                     the fresh model, when no model= was given
    OUT/stages/N-NAME/checkpoints/step-K/   periodic checkpoints (HF model + trainer state)
    OUT/stages/N-NAME/final/            the stage's hand-off: HF checkpoint + run_state.json
    OUT/tensorboard/                    with logging.tensorboard=true
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

USAGE = """usage: cascade run [stage=NAME] [profile=NAME] [model=PATH] [out=DIR] [key.sub=value ...]

Runs the four-stage cascade (warmup, rlve, math, behavior) or one stage. Keys follow
configs/cascade.yaml; with stage=NAME, keys not at the top level are relative to that stage
(e.g. `cascade run stage=math rl.group_size=8`). Rerunning the same command resumes."""


def _initial_model(cfg, out: Path) -> Path:
    if cfg.model:
        p = Path(cfg.model)
        from train.model.hf_io import load_config

        load_config(p)  # fails now, with a one-line error, if the path is not a checkpoint
        return p
    init = out / "init-model"
    if not (init / "COMPLETE").exists():
        from train.presets import init_model

        init_model(cfg.model_preset, init, seed=cfg.seed)
        (init / "COMPLETE").write_text("ok\n")
    return init


def _previous_final(cfg, out: Path, stage_index: int) -> Path | None:
    """The hand-off checkpoint of the latest earlier stage that finished in this run directory."""
    from cascade.checkpoint import is_complete

    for i in range(stage_index - 1, -1, -1):
        for d in sorted((out / "stages").glob(f"{i}-*")):
            if is_complete(d / "final"):
                return d / "final"
    return None


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from cascade.config import load_run_config, parse_overrides

    cfg, tree = load_run_config(parse_overrides(argv))
    out = Path(cfg.out)
    if cfg.threads > 0:
        import torch

        torch.set_num_threads(cfg.threads)
    if cfg.model:
        _initial_model(cfg, out)  # a bad model path fails here, before any work
    from cascade.stage import expand_envs

    for name in cfg.order:  # unknown environments fail here too
        expand_envs(cfg.stages[name].envs)
    if cfg.rollout.urls:  # unreachable servers, or servers disagreeing on the model, fail here too
        from train.engine.remote import RemoteEngine

        RemoteEngine(cfg.rollout.urls, api_key=cfg.rollout.api_key, timeout=10.0).close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cascade.records import Records
    from cascade.stage import StageRunner

    console = Console(stderr=True)
    records = Records(out, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project, tree)
    all_names = list(tree["stages"])
    summary = []
    progress = Progress(TextColumn("[bold]{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                        disable=not cfg.logging.progress)
    try:
        with progress:
            for name in cfg.order:
                index = all_names.index(name) if name in all_names else len(all_names)
                prev = _previous_final(cfg, out, index)
                src = Path(cfg.model) if cfg.model and name == cfg.order[0] else (prev or _initial_model(cfg, out))
                runner = StageRunner(name, index, cfg.stages[name], cfg, out, records, progress)
                final = runner.run(src)
                summary.append(json.loads((final / "run_state.json").read_text()))
    finally:
        records.close()
    for s in summary:
        console.print(f"[green]{s['stage']:>9}[/green]: {s['steps']} steps, held-out accuracy "
                      f"{s['accuracy_before']:.2f} -> {s['accuracy_after']:.2f}; difficulty {s['difficulty']}")
    print(json.dumps({"out": str(out), "stages": [s["stage"] for s in summary],
                      "final": str(final) if summary else None}))
    return 0
