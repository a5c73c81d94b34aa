"""What travels between the three roles of a distributed run: training batches (orchestrator ->
trainer ranks) and weight versions (trainer -> rollout servers).

Both are files in the run directory, written atomically (a temporary name, fsync, rename, then a
completion marker), so a reader never sees half of one and a crash leaves either the old or the
new version, never a mix. This is prime-rl's shape: plain files on a filesystem all roles see.

Batches: ``RUN/exchange/batches/step-000012.pt`` (``torch.save`` of :meth:`TrainBatch.to_dict`).

Weights: ``RUN/exchange/weights/v000004/`` holding ``model.safetensors`` (the policy's in-memory
parameter names, fp32 or the training dtype), ``manifest.json`` (version, sha256 and size of every
file) and ``COMPLETE``. :func:`load_version` re-hashes the files and refuses a version whose
checksum does not match, or any path outside the weights directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
WEIGHTS_FILE = "model.safetensors"


class WeightVersionError(ValueError):
    """A weight version is missing, incomplete, outside the run's weight directory, or corrupt."""


class _Unsettled(WeightVersionError):
    """What a reader also sees while the version is published again (its directory removed, then renamed
    into place before ``COMPLETE``): read again a little later."""


def load_request(body: dict) -> tuple[int | None, str | None]:
    """(version, path) of a rollout server's ``POST /v1/load_weights`` body, or ValueError with a
    one-line message: exactly one of ``version`` (a non-negative int) or ``path`` (a string), or, with
    ``broadcast`` (the version arrives over the weight group), ``version``."""
    version, path = body.get("version"), body.get("path")
    if "broadcast" in body:
        path = None
    elif (version is None) == (path is None):
        raise ValueError('load_weights needs exactly one of "version" (an int) or "path"')
    if (version is not None or "broadcast" in body) and \
            (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if path is not None and not isinstance(path, str):
        raise ValueError(f"path must be a string, got {path!r}")
    return version, path


# ------------------------------------------------------------------------------------------------
# training batches


@dataclass
class TrainSample:
    """One rollout as the trainer needs it.

    ``logprobs`` are the behaviour log-probabilities recorded while sampling (the importance
    ratio's denominator, mu); ``versions`` the policy version that produced each completion token;
    ``routed_experts`` the engine's expert ids for every token of prompt + completion, compact as
    ``[P + C, n_moe_layers, k]`` (router replay; :func:`stack_routing` / :func:`unstack_routing`
    convert from / to the engines' per-layer list form), or None."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    advantage: float
    keep: bool = True
    versions: list[int] | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens")
        if self.versions is not None and len(self.versions) != len(self.completion_ids):
            raise ValueError(f"{len(self.versions)} versions for {len(self.completion_ids)} completion tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained(self) -> bool:
        """Whether the sample has a loss token (kept, with a completion): the others are not forwarded."""
        return bool(self.keep and self.completion_ids)


@dataclass
class TrainBatch:
    """The rollouts of one optimizer step, in the order the groups were formed."""

    step: int
    samples: list[TrainSample]
    temperature: float = 1.0
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def to_dict(self) -> dict:
        return {"step": self.step, "temperature": self.temperature, "meta": self.meta,
                "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainBatch":
        return cls(int(d["step"]), [TrainSample(**s) for s in d["samples"]], float(d.get("temperature", 1.0)),
                   dict(d.get("meta", {})))


def stack_routing(per_layer) -> torch.Tensor | None:
    """The engines' form (per MoE layer, LongTensor [1, T, k]) -> compact int16 [T, n_moe_layers, k]."""
    if per_layer is None:
        return None
    return torch.stack([torch.as_tensor(t).reshape(t.shape[-2], t.shape[-1]) for t in per_layer], 1).to(torch.int16)


def encode_routing(compact: torch.Tensor) -> dict:
    """Compact routing [T, n_moe_layers, k] as JSON: ``{"shape", "dtype": "int16", "data": base64 of its
    little-endian bytes}``, 2 bytes an id where a JSON list takes 2-4 characters and a parse per number
    (at RL scale, 64 rollouts x 40K tokens x 40 MoE layers, hundreds of millions of ids a batch)."""
    import base64

    arr = compact.to(torch.int16).contiguous().numpy().astype("<i2", copy=False)
    return {"shape": list(arr.shape), "dtype": "int16", "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_routing(obj) -> torch.Tensor:
    """:func:`encode_routing`'s dict (or a nested list [T][n_moe_layers][k]) -> int16 tensor [T, n_moe_layers, k];
    ValueError when the data does not fill the shape."""
    import base64

    import numpy as np

    if isinstance(obj, dict):
        if obj.get("dtype") != "int16":
            raise ValueError(f"routed_experts dtype {obj.get('dtype')!r} is not int16")
        shape = [int(x) for x in obj["shape"]]
        raw = base64.b64decode(obj["data"])
        if len(shape) != 3 or len(raw) != 2 * math.prod(shape):
            raise ValueError(f"routed_experts holds {len(raw)} bytes, not an int16 array of shape {shape}")
        return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape))
    t = torch.tensor(obj, dtype=torch.int16)
    if t.dim() != 3:
        raise ValueError(f"routed_experts has shape {list(t.shape)}, not [tokens, MoE layers, k]")
    return t


def unstack_routing(compact: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Compact [T, n_moe_layers, k] -> per MoE layer LongTensor [1, T, k] (what ``CausalLM.forward`` replays)."""
    if compact is None:
        return None
    return [compact[:, i].long().unsqueeze(0) for i in range(compact.shape[1])]


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then fsync and rename onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def batch_path(root: str | Path, step: int) -> Path:
    return Path(root) / "batches" / f"step-{step:06d}.pt"


def write_batch(root: str | Path, batch: TrainBatch) -> Path:
    p = batch_path(root, batch.step)
    _atomic_write(p, lambda t: torch.save(batch.to_dict(), t))
    return p


def read_batch(root: str | Path, step: int) -> TrainBatch | None:
    """The batch of ``step`` if it has been written completely, else None."""
    p = batch_path(root, step)
    if not p.exists():
        return None
    return TrainBatch.from_dict(torch.load(p, map_location="cpu", weights_only=True))  # (each rank moves it)


# ------------------------------------------------------------------------------------------------
# weight versions


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / "weights" / f"v{version:06d}"


def _sha256(f) -> str:
    """Hex digest of a path's contents, or of an open binary file's from where it stands."""
    if not hasattr(f, "read"):
        with open(f, "rb") as fh:
            return _sha256(fh)
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


SERVING = "SERVING"  # weights/SERVING: the version the rollout servers were last given (never pruned)


def pin_serving(root: str | Path, version: int) -> None:
    """Record ``version`` as the one the servers serve: :func:`publish_version` keeps its files, which a server
    restarted later loads to catch up (the trainer ranks also publish at checkpoints the servers never take, and
    pruned the served version three of those later)."""
    _atomic_write(Path(root) / "weights" / SERVING, lambda t: t.write_text(f"{int(version)}\n"))


def serving_version(root: str | Path) -> int | None:
    try:
        return int((Path(root) / "weights" / SERVING).read_text())
    except (OSError, ValueError):
        return None


def publish_version(root: str | Path, version: int, state_dict: dict[str, torch.Tensor], keep: int = 3) -> Path:
    """Write weight version ``version`` atomically and durably; keep it and the newest ``keep - 1`` complete
    versions below it, and the version the servers serve (:func:`pin_serving`). Higher ones are left alone (a
    resumed trainer writes versions again: those of the run it resumes are removed by :func:`clear_after`, and the
    one written now must not be pruned for being low)."""
    from safetensors.torch import save_file

    final = version_dir(root, version)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    _dedupe_shared(tensors)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
    files = {WEIGHTS_FILE: {"sha256": _sha256(tmp / WEIGHTS_FILE), "bytes": (tmp / WEIGHTS_FILE).stat().st_size}}
    (tmp / MANIFEST).write_text(json.dumps({"version": version, "files": files}, indent=1))
    for p in (tmp / WEIGHTS_FILE, tmp / MANIFEST, tmp):  # on disk before the rename: a crash leaves all or nothing
        _fsync(p)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(final / COMPLETE, lambda t: t.write_text("ok\n"))
    _fsync(final)  # COMPLETE's entry, then the rename's
    _fsync(final.parent)
    older = [v for v in complete_versions(root) if v < version]
    served = serving_version(root)
    for old in older[:max(len(older) - keep + 1, 0)] if keep > 0 else []:
        if old != served:
            shutil.rmtree(version_dir(root, old), ignore_errors=True)
    return final


def clear_after(exchange: str | Path, update: int, sft_steps: int = 0,
                subdirs=("metrics", "weights", "sft/weights")) -> None:
    """Remove what the trainer ranks wrote past ``update`` updates under ``exchange`` (a resume at ``update``),
    in ``subdirs``: ``batches`` and ``metrics`` (``step-N``) of update ``update`` on; weight versions (``vN``)
    after it (``weights`` holds RL versions, which count from the end of the ``sft_steps`` SFT updates: all of
    them while ``update`` is inside SFT; ``sft/weights`` those of SFT updates); and in any other subdirectory
    (checkpoints, ``step-N``) those after it, or all of them at update 0. At update 0 a version 0 goes too (an
    earlier stage's, in the run's one exchange directory: a checkpoint before the stage's first update would take
    it for this stage's start), but for the one the servers were given (published by the orchestrator for this
    stage's start, :func:`pin_serving`), and only without SFT steps: with them every RL version goes, the served
    one too (version 0 is the one published after them)."""
    served = serving_version(exchange)
    for sub in subdirs:
        d = Path(exchange) / sub
        pre = "v" if sub.endswith("weights") else "step-"
        for p in d.iterdir() if d.is_dir() else []:
            num = p.name[len(pre):].split(".")[0]  # (also a temporary name: v000012.tmp345)
            if not (p.name.startswith(pre) and num.isdigit()):
                continue
            n = int(num) + (sft_steps if sub == "weights" else 0)
            if sub in ("batches", "metrics"):
                stale = n >= update
            else:
                stale = n > update or (sub == "weights" and update < sft_steps) or (pre == "step-" and update == 0) \
                    or (update == 0 and not (sub == "weights" and served == 0))
            if stale:
                shutil.rmtree(p) if p.is_dir() else p.unlink()


def _dedupe_shared(tensors: dict[str, torch.Tensor]) -> None:
    """safetensors refuses tensors that share storage (tied embeddings): give each its own copy."""
    seen: set[int] = set()
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            tensors[k] = v.clone()
        seen.add(ptr)


def complete_versions(root: str | Path) -> list[int]:
    """Versions with a completion marker, oldest first."""
    d = Path(root) / "weights"
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        if p.name.startswith("v") and p.name[1:].isdigit() and (p / COMPLETE).exists():
            out.append(int(p.name[1:]))
    return sorted(out)


def latest_version(root: str | Path) -> int | None:
    vs = complete_versions(root)
    return vs[-1] if vs else None


def resolve_version_dir(root: str | Path, path: str | Path) -> Path:
    """``path`` as a version directory inside ``root/weights``, or :class:`WeightVersionError`."""
    base = (Path(root) / "weights").resolve()
    p = Path(path)
    p = (p if p.is_absolute() else base / p).resolve()
    if p.parent != base or not (p.name.startswith("v") and p.name[1:].isdigit()):
        raise WeightVersionError(f"{str(path)!r} is not a weight version of this run (expected {base}/vNNNNNN)")
    return p


def load_version(root: str | Path, version: int | None = None, path: str | Path | None = None,
                 verify: bool = True) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, state dict) of a complete version (the newest when neither is given), checksums verified.

    By number or by path, the directory must lie in ``root/weights`` once links are followed, its manifest
    must name its own number and list the weights file, and every file it lists must be a plain file of
    that directory (a link out of it is refused like a bad checksum). A version published again under the
    same number while it is read (v0 after an SFT warm-up) is read again: the manifest and files read are
    those the path still names at the end, so the bytes loaded are the bytes verified; one found missing or
    incomplete meanwhile is read again for about 1.3 s before it is refused."""
    root = Path(root).resolve()  # (a relative root's version path was joined onto it a second time: refused)
    if path is None:
        if version is None:
            version = latest_version(root)
            if version is None:
                raise WeightVersionError(f"no complete weight version under {Path(root) / 'weights'}")
        path = version_dir(root, version)
    d = resolve_version_dir(root, path)
    unsettled = None
    for attempt in range(8):
        try:
            got = _read_version(d, verify)
        except _Unsettled as e:
            unsettled, got = e, None
            if attempt < 7:
                time.sleep(0.01 * 2 ** attempt)  # 1.27 s in all
        if got is not None:
            return got
    if unsettled is not None:
        raise WeightVersionError(str(unsettled)) from None
    raise WeightVersionError(f"weight version {d.name} was published again during each of 8 reads")


def _read_version(d: Path, verify: bool) -> tuple[int, dict[str, torch.Tensor]] | None:
    """:func:`load_version` of directory ``d`` once; None when the files changed under it meanwhile."""
    from safetensors.torch import load_file

    if not (d / COMPLETE).exists():
        raise _Unsettled(f"weight version {d.name} is not complete")
    with contextlib.ExitStack() as stack:
        try:  # files are held open from the start: each is the inode the path named then
            opened = {MANIFEST: stack.enter_context(open(d / MANIFEST, "rb"))}
            man = json.loads(opened[MANIFEST].read())
            files, number = man["files"], int(man["version"])
            if not isinstance(files, dict):
                raise TypeError("'files' is not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _Unsettled(f"weight version {d.name}: unreadable manifest ({e})") from None
        if number != int(d.name[1:]) or WEIGHTS_FILE not in files:
            raise WeightVersionError(f"weight version {d.name}: its manifest names version {number} and files "
                                     f"{sorted(files)} (expected version {int(d.name[1:])} with {WEIGHTS_FILE})")
        bad = None
        for name, info in files.items():
            f = d / str(name)
            if f.is_symlink() or f.parent.resolve() != d or not f.is_file():
                error = WeightVersionError if f.is_symlink() or f.parent.resolve() != d else _Unsettled
                raise error(f"weight version {d.name}: {name!r} is not a file of the version's directory")
            try:
                opened[str(name)] = fh = stack.enter_context(open(f, "rb"))
            except FileNotFoundError:
                raise _Unsettled(f"weight version {d.name}: {name!r} vanished while read") from None
            if verify and bad is None and _sha256(fh) != (info.get("sha256") if isinstance(info, dict) else None):
                bad = name
        try:
            sd = None if bad is not None else load_file(str(d / WEIGHTS_FILE))
        except FileNotFoundError:  # (between the removal of the old directory and the rename of the new)
            return None

        def same(name: str, fh) -> bool:
            try:
                return os.stat(d / name).st_ino == os.fstat(fh.fileno()).st_ino
            except OSError:
                return False

        if not all(same(n, fh) for n, fh in opened.items()):
            return None  # published again meanwhile: read the new one
    if bad is not None:
        raise WeightVersionError(f"weight version {d.name}: checksum mismatch in {bad}")
    return number, sd
