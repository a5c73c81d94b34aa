"""``cascade run``: run one stage (``stage=NAME``) or the whole cascade, resuming where a previous
run in the same ``out=`` directory stopped.

Run directory layout::

    OUT/config.yaml                     the merged configuration of the latest invocation
    OUT/metrics.jsonl                   one JSON record per step (stage, phase, step, metrics)
    OUT/init-model/                     the fresh model, when no model= was given
    OUT/stages/N-NAME/checkpoints/step-K/   periodic checkpoints (HF model + trainer state)
    OUT/stages/N-NAME/final/            the stage's hand-off: HF checkpoint + run_state.json
    OUT/tensorboard/                    with logging.tensorboard=true
    OUT/wandb-run-id                    with logging.wandb=true: the W&B run a resume continues
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

USAGE = """usage: cascade run [stage=NAME] [profile=NAME] [config=FILE.yaml] [model=PATH] [out=DIR] [key.sub=value ...]
                   [print_config=true] [resume=false] [overwrite=true]

Runs the four-stage cascade (warmup, rlve, math, behavior) or one stage. Keys follow
configs/cascade.yaml; with stage=NAME, keys not at the top level are relative to that stage
(e.g. `cascade run stage=math rl.group_size=8`). config=FILE.yaml holds overrides (nested or
dotted keys), applied after the profile and before the command line's.

  print_config=true  print the resolved configuration (every key, as YAML) and exit
  resume=false       start fresh; refused when out= holds a previous run
  overwrite=true     start fresh, deleting the previous run's files in out= first

Rerunning the same command resumes (resume=true, the default)."""

# What a run writes directly under out= (what overwrite=true deletes; nothing else is touched).
RUN_ENTRIES = ("config.yaml", "metrics.jsonl", "init-model", "stages", "exchange", "tensorboard", "wandb",
               "wandb-run-id", "report.png")
FLAGS = ("print_config", "resume", "overwrite")  # switches of this command, not configuration keys


def _flags(overrides: dict) -> dict[str, bool]:
    out = {"print_config": False, "resume": True, "overwrite": False}
    for k in FLAGS:
        if k in overrides:
            v = overrides.pop(k)
            if not isinstance(v, bool):
                raise ValueError(f"{k} must be true or false, got {v!r}")
            out[k] = v
    return out


def previous_run(out: Path) -> list[str]:
    """The entries of an earlier run in ``out`` (empty: nothing to resume, nothing ``resume=false`` refuses):
    every one a run writes, its W&B and TensorBoard logs and report included, which a fresh run would mix with
    its own (``wandb-run-id``: log to the old W&B run)."""
    return [n for n in RUN_ENTRIES if (out / n).exists() or (out / n).is_symlink()]


def start_fresh(out: Path, overwrite: bool, model: str | None = None) -> None:
    """``resume=false``: refuse an ``out`` that holds a run, and delete nothing; ``overwrite=true``: delete
    that run's files (never the checkpoint ``model=`` names)."""
    import shutil

    found = previous_run(out)
    if found and not overwrite:
        raise ValueError(f"out={out} holds a previous run ({', '.join(found)}) and resume=false: pick another out=, "
                         f"pass overwrite=true to delete it, or drop resume=false to continue it")
    if not overwrite:
        return
    if model:
        m = Path(model).resolve()
        for n in RUN_ENTRIES:
            if m == (out / n).resolve() or (out / n).resolve() in m.parents:
                raise ValueError(f"overwrite=true would delete model={model} (it lies in out={out}); copy it elsewhere "
                                 f"or pick another out=")
    for n in RUN_ENTRIES:
        p = out / n
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def step_offsets(cfg, names: list[str]) -> dict[str, int]:
    """Each stage's first step on one axis over the whole cascade (W&B's ``step``): the steps (SFT +
    RL) of the stages configured before it."""
    out, at = {}, 0
    for n in names:
        out[n] = at
        s = cfg.stages[n]
        at += s.sft.steps + s.steps
    return out


def _initial_model(cfg, out: Path) -> Path:
    if cfg.model:
        from envs.hub import resolve_model
        from train.model.hf_io import check_loadable

        p = resolve_model(cfg.model)  # a local directory wins; else a Hub id through the HF cache (offline rules)

        # fails now, with a one-line error, if the path is not a checkpoint the backend loads
        model_cfg = check_loadable(p)
        if model_cfg is None and cfg.trainer.distributed:  # the transformers fallback: not on the ranks
            from train.model.hf_io import fallback_architecture

            t = cfg.trainer
            raise ValueError(f"model={cfg.model} ({fallback_architecture(p)}) would load through the transformers "
                             f"fallback, which the sharded trainer ranks (trainer.nproc={t.nproc}, trainer.nnodes="
                             f"{t.nnodes}) cannot run; use trainer.nproc=1 (and trainer.nnodes=1)")
    else:
        p, model_cfg = out / "init-model", None
        if not (p / "COMPLETE").exists():
            from train.presets import init_model

            init_model(cfg.model_preset, p, seed=cfg.seed)
            (p / "COMPLETE").write_text(_init_made(cfg) + "\n")
    if cfg.trainer.distributed:  # the architecture, heads and kv heads against the TSP degree, now
        from train.model.hf_io import load_config
        from train.parallel.tsp import check_tsp_config

        try:
            check_tsp_config(model_cfg or load_config(p), cfg.trainer.tsp)
        except ValueError as e:
            raise ValueError(f"trainer.tsp={cfg.trainer.tsp} does not fit the policy: {e}") from None
    return p


def _check_machine(cfg) -> None:
    """What the config asks of this machine, before any work: a device torch knows and has, and vLLM
    for engine=vllm."""
    from train.engine.torch_engine import engine_device

    engine_device(cfg.device, "device=")
    if cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError("engine=vllm: vLLM is not installed for this Python (on CPU: scripts/setup_vllm_cpu.sh, "
                              "then .venv-vllm/bin/cascade)")


def shared_cores_note(cfg, cores: int | None = None, trainer_threads: int | None = None) -> str | None:
    """A note when the rollout servers ``cascade run`` starts on this CPU machine would share its cores with the
    in-process trainer's torch threads (None otherwise): on 2 cores ``benchmarks/pipeline.py --servers 1`` measured
    0.80-0.88x the in-process loop."""
    import torch

    r = cfg.rollout
    if not r.servers or r.backend != "cascade" or cfg.device != "cpu" or cfg.trainer.distributed:
        return None
    cores = cores or os.cpu_count() or 1
    trainer_threads = trainer_threads or torch.get_num_threads()
    wanted = r.servers * r.threads + trainer_threads
    if wanted <= cores:
        return None
    return (f"note: rollout.servers={r.servers} x rollout.threads={r.threads} and the trainer's {trainer_threads} torch "
            f"thread(s) share this machine's {cores} core(s), which slows both sides (on 2 cores a server beside the "
            f"trainer measured 0.80-0.88x the in-process loop); rollout.urls=[...] puts servers on other machines, "
            f"and rl.max_staleness without rollout.servers overlaps generation and training in this process")


def _check_model_refs(cfg, out: Path, fresh: bool = False) -> None:
    """Reward models, KL references, aggregation experts and SFT teachers (local directories, Hub ids, or for
    the last two a stage that runs before theirs or finished in ``out``), and datasets (an environment's
    ``path``, ``sft.data``: local files or Hub ids) fail now, in one line, when they cannot be had (not cached
    while offline, no such file or directory), rather than when their stage starts. ``fresh`` (overwrite=true):
    no stage counts as finished in ``out``, whose run is about to be deleted."""
    from cascade.checkpoint import is_complete
    from envs.hub import is_hub_id, resolve_dataset, resolve_model

    for i, name in enumerate(cfg.order):
        s = cfg.stages[name]
        refs = [("reward model", "reward_model.path", s.reward_model.path), ("KL reference", "rl.kl_reference",
                                                                              s.rl.kl_reference)]
        for what, key, ref in [("aggregation expert", "aggregation.expert", s.aggregation.expert),
                               ("SFT teacher", "sft.aggregation.teacher", s.sft.aggregation.teacher)]:
            if ref in cfg.stages:  # a stage of this run: one that runs before, or finished in an earlier run
                done = not fresh and any(is_complete(f) for f in out.glob(f"stages/*-{ref}/final"))
                if ref not in cfg.order[:i] and not done:
                    raise FileNotFoundError(f"stages.{name}.{key}={ref}: stage {ref!r} neither runs before {name!r} "
                                            f"(order: {', '.join(cfg.order)}) nor finished in {str(out)!r}"
                                            + (" (overwrite=true deletes the run there)" if fresh else ""))
            elif ref:
                refs.append((what, key, ref))
        for what, key, ref in refs:
            if ref:
                p = resolve_model(ref, what)
                if not (p / "config.json").is_file():
                    raise FileNotFoundError(f"stage {name}: {what} {ref!r} (stages.{name}.{key}) is not a checkpoint "
                                            f"directory ({str(p)!r} has no config.json)")
        data = [(f"SFT data (stages.{name}.sft.data)", s.sft.data)]
        data += [(f"dataset (stages.{name}.env_kwargs.{e}.path)", kw.get("path")) for e, kw in s.env_kwargs.items()
                 if isinstance(kw, dict)]
        for what, ref in data:
            if isinstance(ref, str) and is_hub_id(ref):
                resolve_dataset(ref, what)
            elif isinstance(ref, str) and not Path(ref).expanduser().exists():
                raise FileNotFoundError(f"{what}: no such file or directory {ref!r}")


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]: tree}
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def _warn_changed(out: Path, tree: dict, distributed: bool = False) -> None:
    """A rerun in a run directory whose config.yaml holds other settings: say which changed, that stages
    which already finished keep what they ran (they are not run again), and what a stage resumed from a
    checkpoint keeps. In this process the optimizer's and LambdaLR's state come back: the peak learning rate
    (the scheduler's ``base_lrs``), betas, eps and weight_decay are the checkpoint's, while warm-up and decay (the
    schedule's function, rebuilt from the settings) follow the new settings from the checkpoint's step. The
    trainer ranks (``distributed``) set every optim setting from the new ones each step; the moments come back."""
    import sys

    from cascade.checkpoint import is_complete

    try:
        old = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return
    a, b = _flat(old if isinstance(old, dict) else {}), _flat(tree)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not changed:
        return
    def show(d: dict, k: str) -> str:  # a key the invocation did not set took its default
        return repr(d[k]) if k in d else "(default)"

    shown = ", ".join(f"{k}: {show(a, k)} -> {show(b, k)}" for k in changed[:6]) + (" ..." if len(changed) > 6 else "")
    done = sorted(d.name.split("-", 1)[1] for d in (out / "stages").glob("*-*") if is_complete(d / "final"))
    hit = [n for n in done if any(k.startswith(f"stages.{n}.") for k in changed)]
    note = (f"; finished stage(s) {', '.join(hit)} keep what they ran (overwrite=true starts over)" if hit else "")
    going = sorted(d.name.split("-", 1)[1] for d in (out / "stages").glob("*-*")
                   if not is_complete(d / "final") and any((d / "checkpoints").glob("step-*")))
    going = [n for n in going if any(k.startswith(f"stages.{n}.") for k in changed)]
    if going and distributed:  # the ranks' optimizers take lr * lr_factor(step) and the optim settings each step
        note += (f"; stage(s) {', '.join(going)} resume from a checkpoint with the curriculum (mix weights, levels) "
                 "and optimizer moments it holds; the learning rate with its warm-up and decay, and the other "
                 "settings, follow the new settings from its step")
    elif going:  # the optimizer's and scheduler's state and the curriculum's come back from the checkpoint
        note += (f"; stage(s) {', '.join(going)} resume from a checkpoint with the curriculum (mix weights, levels) "
                 "and optimizer state it holds, its peak learning rate, betas, eps and weight_decay included (new "
                 "values of these optim settings do not apply); warm-up and decay (warmup_steps, schedule, "
                 "total_steps, min_lr_ratio) and the other settings follow the new settings from its step")
    print(f"cascade run: settings differ from the last run in {out}: {shown}{note}", file=sys.stderr)


def _all_finished(cfg, tree: dict, out: Path) -> bool:
    """Whether every stage of this invocation's order has its final checkpoint in ``out``."""
    from cascade.checkpoint import is_complete

    names = list(tree["stages"])
    return all(is_complete(out / "stages" / f"{names.index(n) if n in names else len(names)}-{n}" / "final")
               for n in cfg.order)


def _init_made(cfg) -> str:
    return f"model_preset={cfg.model_preset} seed={cfg.seed}"


def _check_init_model(cfg, tree: dict, out: Path) -> None:
    """A stage about to start from ``init-model/`` (no model=, no earlier stage finished, no checkpoint of its
    own) gets the policy this run's model_preset and seed make: one made with others is refused now."""
    from cascade.checkpoint import is_complete

    marker = out / "init-model" / "COMPLETE"
    made = marker.read_text().strip() if not cfg.model and marker.exists() else "ok"
    if made in ("ok", _init_made(cfg)):  # ("ok": written before the marker said what made it)
        return
    names = list(tree["stages"])
    for pos, name in enumerate(cfg.order):
        i = names.index(name) if name in names else len(names)
        d = out / "stages" / f"{i}-{name}"
        # (a stage after the first of `order` starts from the one before it)
        if pos > 0 or is_complete(d / "final") or _previous_final(cfg, out, i) is not None:
            continue
        if any(is_complete(c) for c in (d / "checkpoints").glob("step-*")):  # it resumes from its own
            continue
        raise ValueError(f"stage {name} would start from {out / 'init-model'}, made with {made}, not this run's "
                         f"{_init_made(cfg)}: use those settings, overwrite=true (a fresh run), or model=PATH")


def _previous_final(cfg, out: Path, stage_index: int) -> Path | None:
    """The hand-off checkpoint of the latest earlier stage that finished in this run directory."""
    from cascade.checkpoint import is_complete

    for i in range(stage_index - 1, -1, -1):
        for d in sorted((out / "stages").glob(f"{i}-*")):
            if is_complete(d / "final"):
                return d / "final"
    return None


def _check_sandbox(cfg) -> None:
    """A stage training on code environments, on a machine whose sandbox cannot run (no bubblewrap, no weaker
    sandbox allowed), fails here in one line, not with every code answer scored 0 hours into the run."""
    from cascade.stagedata import stage_mixes, union_mix
    from envs.base import get_env
    from train.dataclass_config import ConfigError

    for name in cfg.order:
        s = cfg.stages[name]
        code = sorted(e for e in union_mix(stage_mixes(s, name)) if e.startswith("code/"))
        if code:
            from envs.code.sandbox import SandboxUnavailable

            try:
                get_env(code[0], **s.env_kwargs.get(code[0], {})).prepare()
            except SandboxUnavailable as e:
                raise ConfigError(f"stage {name} trains on {code[0]}, whose answers run in the sandbox: {e}") from None


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from cascade.config import load_run_config, parse_overrides

    overrides = parse_overrides(argv)
    flags = _flags(overrides)
    cfg, tree = load_run_config(overrides)
    if cfg.model is not None and not str(cfg.model).strip():  # not a fresh policy: `model=$CKPT` with CKPT unset
        raise ValueError("model= is empty (an unset variable?): name a checkpoint, or leave model= out (model=null) "
                         "for a fresh model_preset policy")
    if flags["print_config"]:
        import dataclasses

        print(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), sort_keys=False), end="")
        return 0
    out = Path(cfg.out).absolute()  # the trainer ranks and servers it starts run in another directory
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={cfg.out} is a file, not a run directory")
    _check_machine(cfg)
    if not flags["resume"] and not flags["overwrite"]:
        start_fresh(out, False)  # refuse a previous run now, before any check takes time
    if cfg.model_backend:  # every loader of this process and of the processes it starts (ranks, servers)
        os.environ["CASCADE_MODEL_BACKEND"] = cfg.model_backend
    if cfg.threads > 0:
        import torch

        torch.set_num_threads(cfg.threads)
    if cfg.model:
        _initial_model(cfg, out)  # a bad model path fails here, before any work
    _check_model_refs(cfg, out, fresh=flags["overwrite"])  # (overwrite=true: against the run about to start)
    from cascade.stagedata import check_env_kwargs

    for name in cfg.order:  # unknown environments (of the mix, its sources or its phases) and settings fail here too
        check_env_kwargs(cfg.stages[name], name)
    _check_sandbox(cfg)
    if cfg.rollout.urls and (flags["overwrite"] or not _all_finished(cfg, tree, out)):  # unreachable servers, or
        # servers disagreeing on the model, fail here too (a rerun of a finished run needs none: it only prints what
        # the stages did; with overwrite=true nothing stays finished)
        from cascade.rollout import url_key
        from train.engine.remote import RemoteEngine

        try:
            RemoteEngine(cfg.rollout.urls, api_key=url_key(cfg.rollout), timeout=10.0).close()
        except ConnectionError as e:  # named by the setting that gave the URL
            raise ConnectionError(f"rollout.urls: {e}") from None
    if flags["overwrite"]:
        start_fresh(out, True, cfg.model)
    _check_init_model(cfg, tree, out)
    out.mkdir(parents=True, exist_ok=True)
    _warn_changed(out, tree, cfg.trainer.distributed)
    (out / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cascade.records import Records
    from cascade.stage import StageRunner

    console = Console(stderr=True)
    note = shared_cores_note(cfg) if not _all_finished(cfg, tree, out) else None
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    all_names = list(tree["stages"])
    records = Records(out, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project, tree,
                      step_offsets=step_offsets(cfg, all_names))
    summary = []
    progress = Progress(TextColumn("[bold]{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                        disable=not cfg.logging.progress)
    try:
        with progress:
            last = None  # the final/ of the stage before this one in this run's order
            for name in cfg.order:
                index = all_names.index(name) if name in all_names else len(all_names)
                # the stage before it in `order` (also where `order` is not the configured one: the configured
                # index alone made order=[behavior, rlve]'s rlve start from a fresh policy), else the latest
                # earlier stage finished in this directory
                prev = last or _previous_final(cfg, out, index)
                first = cfg.model and name == cfg.order[0]  # model= (a directory, or a Hub id's cached snapshot)
                src = _initial_model(cfg, out) if first else (prev or _initial_model(cfg, out))
                if not cfg.model and prev is None and index > 0:  # e.g. `stage=math` alone in a new directory
                    console.print(f"note: stage {name} starts from a fresh {cfg.model_preset} policy (no model= and "
                                  f"no earlier stage finished in {out}); to start from a trained one pass model=PATH, "
                                  f"e.g. an earlier run's stages/0-{all_names[0]}/final",
                                  highlight=False, soft_wrap=True)
                runner = StageRunner(name, index, cfg.stages[name], cfg, out, records, progress)
                final = last = runner.run(src)
                summary.append(json.loads((final / "run_state.json").read_text()))
    finally:
        records.close()
    for s in summary:
        console.print(stage_line(s), highlight=False, soft_wrap=True)
    print(json.dumps({"out": str(out), "stages": [s["stage"] for s in summary],
                      "final": str(final) if summary else None}))
    return 0


def difficulty_rise(s: dict) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Per environment (start, end, highest) level of a stage's ``run_state`` and how many ended above
    their start (an RLVE window: its high end, the hardest level it samples, as the plots show it; a calibrated
    start: the level calibration picked)."""
    from cascade.stage import level

    start, top = s.get("difficulty_start") or {}, s.get("difficulty_max") or {}
    rows = {e: (int(start.get(e, 0)), level(v, high=True), int(top.get(e, level(v, high=True))))
            for e, v in (s.get("difficulty") or {}).items()}
    return rows, sum(end > st for st, end, _ in rows.values())


def stage_line(s: dict) -> str:
    """One line of the final table: held-out avg@k before -> after, and where each difficulty went."""
    k = s.get("eval_k", 0)
    metric = f"avg@{k}" if k else "greedy accuracy"
    at = s.get("eval_difficulty")
    rows, rose = difficulty_rise(s)
    per_env = ", ".join(f"{e} {a}->{b}" + (f" (max {m})" if m > b else "") for e, (a, b, m) in rows.items())
    shown = f": {per_env}" if len(rows) <= 8 else ""
    held = (f"held-out {metric} {s['accuracy_before']:.2f} -> {s['accuracy_after']:.2f} "
            f"({'at difficulty ' + str(at) if at is not None else 'at the start levels'})"
            if s.get("accuracy_before_by_family", True)
            else f"all {s['eval_skipped']} held-out prompts skipped (longer than rl.max_prompt_tokens or the context)"
            if s.get("eval_skipped") else "no held-out problems (eval_problems=0)")
    return f"{s['stage']:>9}: {s['steps']} steps, {held}; difficulty rose on {rose} of {len(rows)}{shown}"

