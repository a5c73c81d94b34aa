"""Crash-safe checkpoints: written in a background thread into ``step-N.tmp``, renamed to ``step-N``,
and marked complete by a ``COMPLETE`` file written last. A directory without the marker is never
loaded (a crash at any moment leaves at worst an incomplete directory, removed at the next start).

Each checkpoint is a Hugging Face model directory (``config.json``, ``model.safetensors``,
tokenizer files) plus ``trainer_state.pt`` (optimizer, scheduler, RNG, curriculum) and
``state.json`` (step, phase and anything JSON-serialisable the stage keeps).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch

from train.background import Behind
from train.model.hf_io import TOKENIZER_FILES, save_pretrained

COMPLETE = "COMPLETE"
_STEP = re.compile(r"^step-(\d+)$")


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).exists()


def _fault(point: str, step: int) -> None:
    """Fault injection for crash tests: ``CASCADE_FAULT=point:step`` SIGKILLs the process there."""
    spec = os.environ.get("CASCADE_FAULT", "")
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of ``src`` into ``dst``; a ``FileNotFoundError`` when ``src`` has none (a checkpoint
    without them could not be used by the next stage)."""
    copied = 0
    for name in TOKENIZER_FILES:
        if (src / name).exists() and name != "generation_config.json":
            shutil.copyfile(src / name, dst / name)
            copied += 1
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {str(src)!r} to copy into {str(dst)!r}")


class Checkpointer:
    """Asynchronous, atomic checkpoints under ``root``; keeps the newest ``keep`` complete ones, and
    ``pinned`` (the one a resumed run started from: its tokenizer files and weights are the run's source,
    read again for its final checkpoint and by rollout servers that restart)."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep
        self.pinned: Path | None = None
        self._behind = Behind("checkpoint write", daemon=False)
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean()

    def clean(self) -> None:
        """Remove incomplete checkpoint directories (left by a crash)."""
        for p in self.root.iterdir():
            if p.is_dir() and not is_complete(p):
                shutil.rmtree(p, ignore_errors=True)

    def complete(self) -> list[Path]:
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP.match(p.name)) and is_complete(p)]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def latest_loadable(self, warn=print) -> tuple[Path | None, tuple[dict, dict] | None]:
        """The newest complete checkpoint whose files read back, with its :func:`load_trainer_state`; one
        that does not (damaged after it was marked complete: a disk error, a hand edit) is renamed
        ``step-N.unreadable``, named by ``warn`` in one line, and the one before it is tried."""
        for path in reversed(self.complete()):
            try:
                _check_weights(path)
                return path, load_trainer_state(path)
            except Exception as e:  # noqa: BLE001 - whatever the damage, the one before may be whole
                aside = path.with_name(path.name + ".unreadable")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(path, aside)
                warn(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); moved to "
                     f"{aside.name}, resuming from the one before it")
        return None, None

    def save(self, step: int, model, tokenizer_dir: Path, trainer_state: dict, state: dict, sync: bool = False) -> Path:
        """Snapshot now (weights cloned, trainer state and ``state`` serialised), write in the background."""
        self.wait()
        weights_model = _Snapshot(model)
        buf = io.BytesIO()
        torch.save(trainer_state, buf)
        payload = buf.getvalue()
        state_json = json.dumps(state)  # now: the caller goes on changing its state while this writes
        final = self.root / f"step-{step:08d}"

        def write():
            tmp = self.root / f"step-{step:08d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(weights_model, tmp)
            copy_tokenizer(Path(tokenizer_dir), tmp)
            (tmp / "trainer_state.pt").write_bytes(payload)
            _fault("checkpoint_write", step)
            (tmp / "state.json").write_text(state_json)
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            (final / COMPLETE).write_text("ok\n")
            _fsync_dir(final)
            for old in self.complete()[:-self.keep]:
                if old != self.pinned:
                    shutil.rmtree(old, ignore_errors=True)

        if sync:
            write()
        else:
            self._behind.start(write, f"checkpoint-{step}")
        return final

    def wait(self) -> None:
        self._behind.wait()


def load_trainer_state(path: Path) -> tuple[dict, dict]:
    st = torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=False)
    try:
        return st, json.loads((Path(path) / "state.json").read_text())
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'state.json'}: {e}") from None


def _check_weights(path: Path) -> None:
    """Every safetensors file of ``path`` as long as its header says (a truncated file raises)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {path}")
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if f.stat().st_size != 8 + n + end:
            raise ValueError(f"{f.name} holds {f.stat().st_size} bytes, its header {8 + n + end}")


class _Snapshot:
    """A frozen CPU copy of a model's weights that :func:`save_pretrained` can write."""

    def __init__(self, model):
        self.config = model.config
        self._sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def state_dict(self):
        return self._sd
