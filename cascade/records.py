"""Run records: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when asked for."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def _scalars(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(_scalars(v, key + "/"))
        elif k.endswith("_hist") and isinstance(v, (list, tuple)):  # a histogram: a scalar per bucket
            out.update({f"{key}/{i}": float(x) for i, x in enumerate(v) if isinstance(x, (int, float))})
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            out[key] = float(max(v))  # e.g. an RLVE window [l, h]: its upper end
    return out


WANDB_ID_FILE = "wandb-run-id"


def wandb_run_id(out: Path) -> str:
    """The W&B run id of the run in ``out``: read from ``OUT/wandb-run-id``, made and written there
    on first use, so that every resume of the run logs to the same W&B run."""
    f = Path(out) / WANDB_ID_FILE
    if f.exists() and f.read_text().strip():
        return f.read_text().strip()
    import secrets

    rid = secrets.token_hex(4)  # 8 characters of [0-9a-f], as W&B's own ids are short lowercase strings
    f.write_text(rid + "\n")
    return rid


class Records:
    """``step_offsets`` (stage -> first step on the cascade's axis) place each stage's steps on one
    axis for W&B, whose ``step`` must not go back; a record logged out of order (the pass-rate pool,
    measured after the SFT steps but recorded at step 0) goes to the latest step already logged.

    TensorBoard gets one run per stage (``OUT/tensorboard/<stage>/``, tags ``<phase>/<metric>`` on the
    stage's own step axis, so that the stages' curves overlay). :meth:`begin` opens a stage's writer with
    ``purge_step`` at the step the stage (re)starts from: what an abandoned attempt logged from there on
    is dropped from TensorBoard's display, as :func:`read_records` drops it from ``metrics.jsonl``."""

    def __init__(self, out: Path, tensorboard: bool = False, wandb: bool = False, project: str = "cascade",
                 config: dict | None = None, step_offsets: dict[str, int] | None = None):
        self.path = Path(out) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:  # a line a crash cut short: end it, so that the
            with open(self.path, "rb+") as f:                 # next record is a line of its own
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        self._f = open(self.path, "a")
        self._wb = None
        self._tb_dir = None
        self._tb: dict[str, Any] = {}  # stage -> its SummaryWriter
        self.step_offsets = dict(step_offsets or {})
        self._wb_step = 0
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("logging.tensorboard=true needs the tensorboard package "
                                 "(pip install 'cascade-rl[tensorboard]')") from None
            self._tb_dir = Path(out) / "tensorboard"
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                raise ValueError("logging.wandb=true needs the wandb package (pip install 'cascade-rl[wandb]')") from None
            self._wb = wb.init(project=project, dir=str(out), config=config or {}, id=wandb_run_id(out),
                               resume="allow")

    def begin(self, stage: str, step: int) -> None:
        """Stage ``stage`` (re)starts at ``step`` (0, or the step after the checkpoint it resumes from)."""
        if self._tb_dir is not None:
            self._writer(stage, purge_step=int(step))

    def _writer(self, stage: str, purge_step: int | None = None):
        if stage in self._tb and purge_step is None:
            return self._tb[stage]
        from torch.utils.tensorboard import SummaryWriter

        if stage in self._tb:
            self._tb.pop(stage).close()
        self._tb[stage] = SummaryWriter(str(self._tb_dir / stage), purge_step=purge_step)
        return self._tb[stage]

    def log(self, stage: str, phase: str, step: int, metrics: dict[str, Any]) -> None:
        rec = {**metrics, "stage": stage, "phase": phase, "step": int(step), "time": time.time()}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        flat = _scalars(metrics)
        if self._tb_dir is not None:
            tb = self._writer(stage)
            for k, v in flat.items():
                tb.add_scalar(f"{phase}/{k}", v, step)
        if self._wb is not None:
            self._wb_step = max(self._wb_step, self.step_offsets.get(stage, 0) + int(step))
            self._wb.log({f"{stage}/{phase}/{k}": v for k, v in flat.items()}, step=self._wb_step)

    def close(self) -> None:
        self._f.close()
        for tb in self._tb.values():
            tb.close()
        if self._wb is not None:
            self._wb.finish()


STEP_PHASES = ("sft", "rl")  # phases that log one record per training step, in increasing step order


def read_records(run_dir: str | Path) -> list[dict]:
    """All records of a run, as the run stands: a step re-run after a crash keeps its last record, and what
    the abandoned attempt logged past the checkpoint it resumed from (that phase's later steps, the stage's
    later ``eval``) is dropped once the resumed run logs that step again."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{str(run_dir)!r} has no metrics.jsonl (not a Cascade run directory?)")
    latest: dict[tuple, dict] = {}
    for line in p.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        key = (r.get("stage"), r.get("phase"), r.get("step"))
        if key[1] in STEP_PHASES and isinstance(key[2], int):
            for k in [k for k in latest if k[0] == key[0] and k[1] in (key[1], "eval")
                      and isinstance(k[2], int) and k[2] > key[2]]:
                del latest[k]
        latest[key] = r
    return list(latest.values())
