"""Resuming around faults: a checkpoint that cannot be read back because it is damaged (skipped for the one
before it) or because the running code cannot rebuild what it pickled (an error, the checkpoints left in place);
``resume=false`` that deletes nothing; the resume note on settings that changed."""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import cascade_here

# one tiny RLVE stage, a checkpoint after each step: step-1 and step-2 complete, then final/ (step 3)
RLVE = ["run", "stage=rlve", "profile=tiny", "logging.progress=false", "steps=3", "checkpoint_every=1",
        "eval_problems=2", "eval_k=0", "rl.group_size=4", "rl.prompts_per_step=4", "rl.sampling.max_new_tokens=16",
        "rl.dynamic_sampling=false", "rl.advantage=grpo", "rl.overlong.mode=soft", "rl.overlong.max_len=16",
        "rl.overlong.buffer_len=16"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A finished tiny RLVE run with its final/ removed: a rerun resumes from its newest checkpoint (step 2)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    r = cascade_here(*RLVE, f"out={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    stage = out / "stages" / "1-rlve"
    shutil.rmtree(stage / "final")
    assert [p.name for p in sorted((stage / "checkpoints").iterdir())] == ["step-00000001", "step-00000002"]
    return out


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out, out / "stages" / "1-rlve" / "checkpoints"


def _pickle_a_gone_class(path: Path, gone: str) -> None:
    """``trainer_state.pt`` of ``path`` with an object of a class the running code does not have, as after an
    upgrade renamed it: ``module`` (its module is gone) or ``class`` (its module has no such class now)."""
    mod_name = "cascade_renamed_module" if gone == "module" else "cascade.pool"
    cls = types.new_class("RenamedGroup")
    cls.__module__, cls.__qualname__ = mod_name, "RenamedGroup"
    mod = sys.modules.get(mod_name) or types.ModuleType(mod_name)
    had = mod_name in sys.modules
    sys.modules[mod_name] = mod
    mod.RenamedGroup = cls
    try:
        st = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        st["pipeline"] = {"queue": [(0, cls())]}
        torch.save(st, path / "trainer_state.pt")
    finally:
        del mod.RenamedGroup
        if not had:
            del sys.modules[mod_name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gone", ["module", "class"])
def test_a_checkpoint_whose_pickled_class_is_gone_is_an_error_not_damage(stopped_run, tmp_path, gone):
    """Every checkpoint's trainer_state.pt holds an object of a class this code no longer has (ImportError or
    AttributeError when unpickled): each was moved to step-N.unreadable and the stage restarted from step 0 with
    exit code 0. Now the run stops with one line naming the file, and the checkpoints stay where they are."""
    out, ck = _copy(stopped_run, tmp_path)
    for p in ck.iterdir():
        _pickle_a_gone_class(p, gone)
    records = (out / "metrics.jsonl").read_text()
    r = cascade_here(*RLVE, f"out={out}")
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("cascade run: error: checkpoint ") and "step-00000002" in err, err
    assert "trainer_state.pt" in err and "overwrite=true" in err, err
    assert ("cascade_renamed_module" if gone == "module" else "RenamedGroup") in err, err
    assert "unreadable" not in r.stderr, r.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000001", "step-00000002"]
    assert (out / "metrics.jsonl").read_text() == records  # nothing run again from step 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damaged", ["tokenizer.json", "config.json"])
def test_a_damaged_tokenizer_or_config_is_skipped_for_the_checkpoint_before(stopped_run, tmp_path, damaged):
    """The newest checkpoint's tokenizer.json or config.json cut in half after it was marked complete: every
    rerun failed (for the tokenizer with a JSON error naming no file). Now it is set aside, named with the file
    in one line, and the stage resumes from the checkpoint before it and finishes."""
    out, ck = _copy(stopped_run, tmp_path)
    f = ck / "step-00000002" / damaged
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = cascade_here(*RLVE, f"out={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in r.stderr.splitlines() if "unreadable" in ln]
    assert len(warned) == 1 and "step-00000002 is unreadable" in warned[0] and damaged in warned[0], r.stderr
    assert (ck / "step-00000002.unreadable" / damaged).exists()
    final = out / "stages" / "1-rlve" / "final"
    assert json.loads((final / "run_state.json").read_text())["steps"] == 3


def test_when_no_complete_checkpoint_reads_back_the_stage_stops_and_moves_nothing(tmp_path, tiny_dense_dir):
    """Every complete checkpoint damaged: latest_loadable moved them all aside and returned nothing, so the stage
    started over from step 0. Now a ValueError names each with what failed, and they stay in place."""
    from cascade.checkpoint import Checkpointer
    from train.model.hf_io import load_pretrained

    ck = Checkpointer(tmp_path / "ck")
    model = load_pretrained(tiny_dense_dir)
    for step in (1, 2):
        ck.save(step, model, tiny_dense_dir, {"rl": {"step": step}}, {"step": step}, sync=True)
    for p in ck.complete():
        (p / "state.json").write_text("")
    with pytest.raises(ValueError) as e:
        ck.latest_loadable(pytest.fail)
    msg = str(e.value)
    assert "step-00000001" in msg and "step-00000002" in msg and "state.json" in msg and "\n" not in msg, msg
    assert [p.name for p in ck.complete()] == ["step-00000001", "step-00000002"]
    assert Checkpointer(tmp_path / "empty").latest_loadable(pytest.fail) == (None, None)  # nothing to resume


def test_resume_false_deletes_nothing(tmp_path):
    """resume=false on an out= holding only what logging or a report wrote (wandb/, tensorboard/, report.png,
    exchange/): they were deleted, even when the command then failed on a bad setting. resume=false now refuses
    them as a previous run's files, and deletes nothing."""
    out = tmp_path / "run"
    (out / "wandb").mkdir(parents=True)
    (out / "wandb" / "run.log").write_text("the W&B run's log\n")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("x")
    (out / "report.png").write_bytes(b"png")
    r = cascade_here("run", f"out={out}", "resume=false", "stage=math", "envs={gym/no_such_env: 1}")
    assert r.returncode == 2, r.stderr
    assert (out / "wandb" / "run.log").read_text() == "the W&B run's log\n"
    assert (out / "tensorboard" / "events").exists() and (out / "report.png").exists()
    assert r.stderr.count("\n") == 1 and "holds a previous run" in r.stderr and "wandb" in r.stderr, r.stderr


def test_the_resume_note_says_what_a_resumed_optimizer_keeps(tmp_path, capsys):
    """The note said a stage resumed from a checkpoint keeps its schedule; the scheduler's state keeps the peak
    learning rate and the step, while warm-up and decay come from the new settings. The note now says so, and
    this checks it against what the optimizer and scheduler do."""
    import yaml

    from cascade.run import _warn_changed
    from train.optim import OptimConfig, build_optimizer

    m = torch.nn.Linear(4, 4)
    opt, sched = build_optimizer(m, OptimConfig(lr=1e-3, warmup_steps=10, total_steps=100, weight_decay=0.1))
    for _ in range(3):
        opt.step()
        sched.step()
    saved = opt.state_dict(), sched.state_dict()
    new = OptimConfig(lr=5e-3, warmup_steps=0, total_steps=100, weight_decay=0.0)  # the rerun's settings
    opt2, sched2 = build_optimizer(m, new)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    opt2.step()
    sched2.step()
    assert set(sched2.base_lrs) == {1e-3}  # the checkpoint's peak learning rate and weight decay, not the new ones
    assert max(g["weight_decay"] for g in opt2.param_groups) == 0.1
    assert set(sched2.get_last_lr()) == {1e-3}  # no warm-up left: the new settings' (the old gave 4e-4)

    old = {"out": "x", "stages": {"math": {"steps": 4, "rl": {"optim": {"lr": 1e-3}}}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    (tmp_path / "stages" / "2-math" / "checkpoints" / "step-00000002").mkdir(parents=True)
    _warn_changed(tmp_path, {"out": "x", "stages": {"math": {"steps": 4, "rl": {"optim": {"lr": 5e-3}}}}})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stages.math.rl.optim.lr: 0.001 -> 0.005" in err, err
    assert "schedule and curriculum" not in err, err
    assert "peak learning rate, betas, eps and weight_decay" in err and "warm-up and decay" in err, err
    _warn_changed(tmp_path, {"out": "x", "stages": {"math": {"steps": 4, "rl": {"optim": {"lr": 5e-3}}}}},
                  distributed=True)  # the trainer ranks set the learning rate and optim settings every step
    err = capsys.readouterr().err
    assert "optimizer moments" in err and "peak learning rate" not in err, err
