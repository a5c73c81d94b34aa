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
import pickle
import re
import shutil
import signal
from pathlib import Path

import torch

from train.background import Behind
from train.model.hf_io import TOKENIZER_FILES, copy_tokenizer_files, save_pretrained

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
    """The tokenizer files of ``src`` into ``dst``, its vocabulary in whichever form it has it (a SentencePiece
    ``tokenizer.model`` too: left behind, the copy loaded as a tokenizer that encodes every text to no tokens); a
    ``FileNotFoundError`` when ``src`` has none (a checkpoint without them could not be used by the next stage)."""
    if not copy_tokenizer_files(src, dst):
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
        """The newest complete checkpoint whose files read back (:func:`read_back`), with its trainer state and
        ``state.json`` (as :func:`load_trainer_state` gives them). Newer ones that are damaged (after they were
        marked complete: a disk error, a hand edit) are renamed ``step-N.unreadable``, each named by ``warn`` in
        one line with the file that failed. Nothing is moved unless an older one reads back: when none does, a ``ValueError`` names each
        with what failed (the stage is not started over from step 0 behind the user's back), and a checkpoint
        whose ``trainer_state.pt`` holds an object this code cannot rebuild stops the run as well (a code error:
        every checkpoint of the run pickled the same classes)."""
        failed: list[tuple[Path, str]] = []
        for path in reversed(self.complete()):
            try:
                loaded = read_back(path)
            except Unreadable as e:
                failed.append((path, str(e)))
                continue
            for bad, why in failed:
                aside = bad.with_name(bad.name + ".unreadable")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(bad, aside)
                warn(f"checkpoint {bad} is unreadable ({why}); moved to {aside.name}, resuming from the one "
                     f"before it")
            return path, loaded
        if failed:
            raise ValueError(f"no complete checkpoint in {self.root} reads back ("
                             + "; ".join(f"{p.name}: {why}" for p, why in failed)
                             + "): delete that directory to start this stage over, or overwrite=true to start the "
                               "run over")
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


class Unreadable(Exception):
    """A checkpoint file that does not read back because it is damaged; its message names the file."""


# What reading a damaged file raises: truncated, zeroed or bit-flipped weights or JSON (ValueError,
# UnicodeDecodeError), trainer_state.pt (EOFError, OSError, a bad zip's RuntimeError or KeyError,
# pickle.UnpicklingError). Not ImportError, AttributeError or TypeError from unpickling trainer_state.pt: an object
# of a class the running code no longer has (renamed, moved or changed by an upgrade) is not damage.
DAMAGE = (OSError, EOFError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError)
NOT_REBUILT = (ImportError, AttributeError, TypeError)


def read_back(path: Path) -> tuple[dict, dict]:
    """What resuming from ``path`` reads, read once to know it can be: the weights' sizes, ``config.json`` (as
    this run's model backend reads it), the tokenizer, ``trainer_state.pt`` and ``state.json`` -> the last two,
    as :func:`load_trainer_state` gives them. Damage raises :class:`Unreadable` naming the file; an object in
    ``trainer_state.pt`` this code cannot rebuild raises a one-line ``ValueError`` (the code changed, nothing is
    damaged)."""
    from train.model.hf_io import check_loadable
    from train.tokenizer import load_tokenizer

    path = Path(path)
    json_damage = DAMAGE + (TypeError, AttributeError)  # data of the wrong shape (JSON holds no code objects)
    read_json = lambda name: lambda: json.loads((path / name).read_text())  # noqa: E731
    steps = [("weights", lambda: _check_weights(path), json_damage),
             ("config.json", lambda: check_loadable(path), json_damage)]
    steps += [(n, read_json(n), json_damage) for n in TOKENIZER_FILES if n.endswith(".json") and (path / n).exists()]
    steps += [("tokenizer files", lambda: load_tokenizer(path), json_damage),  # (the JSON errors above name the file)
              ("trainer_state.pt", lambda: torch.load(path / "trainer_state.pt", map_location="cpu",
                                                      weights_only=False), DAMAGE),
              ("state.json", read_json("state.json"), json_damage)]
    got = {}
    for what, read, damage in steps:
        try:
            got[what] = read()
        except damage as e:
            raise Unreadable(f"{what}: {type(e).__name__}: {str(e)[:200]}") from e
        except NOT_REBUILT as e:
            if what != "trainer_state.pt":
                raise
            raise ValueError(f"checkpoint {path}: its trainer_state.pt holds an object this code cannot rebuild ("
                             f"{type(e).__name__}: {str(e)[:200]}), written by another version of the code; it is "
                             f"not damaged and stays in place: resume with the version that wrote it, or start over "
                             f"with overwrite=true") from None
    return got["trainer_state.pt"], got["state.json"]


def _check_weights(path: Path) -> None:
    """Every safetensors file of ``path`` as long as its header says (a truncated file raises)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {path}")
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        try:
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (AttributeError, KeyError, IndexError, TypeError) as e:  # JSON, but not a safetensors header
            raise ValueError(f"{f.name}: a damaged header ({type(e).__name__}: {e})") from None
        if f.stat().st_size != 8 + n + end:
            raise ValueError(f"{f.name} holds {f.stat().st_size} bytes, its header {8 + n + end}")


class _Snapshot:
    """A frozen CPU copy of a model's weights that :func:`save_pretrained` can write."""

    def __init__(self, model):
        self.config = model.config
        self._sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def state_dict(self):
        return self._sd
