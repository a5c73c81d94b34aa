"""Hugging Face Hub ids wherever Cascade takes a path, and tabular data with column mapping.

One place resolves every model and dataset reference (the policy's ``model=``, a reward model, a KL
reference, ``ttc --model``/``--tokenizer``, ``cascade generate``/``serve --model``, datasets'
``path=``/``--data``, SFT ``data``):

- a local path that exists always wins;
- otherwise ``org/name`` (optionally ``org/name@revision``) is a Hub repository, fetched with
  ``huggingface_hub.snapshot_download`` under its cache and offline rules (``HF_HOME``,
  ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``: the cached snapshot or an error, never the network), and
  a dataset's snapshot is then read with ``datasets.load_dataset`` (its own cache under
  ``HF_HOME``);
- a failure is one line (:class:`HubError`, a ``FileNotFoundError``) naming the id, the cache and
  the offline setting.

Rows are mapped to Cascade's column names with ``columns`` (``{"problem": "question"}``), and
:func:`heldout_side` splits them into training and held-out rows by a hash of the problem text, so
the same text always lands on the same side (held-out evaluation never sees a training prompt).

Pure Python (no torch): ``envs`` sits at the bottom of the import chain, and ``train``, ``ttc`` and
``cascade`` use this module too.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterable

__all__ = ["HubError", "is_hub_id", "resolve_model", "resolve_dataset", "load_table", "load_rows",
           "parse_columns", "table_rows", "answer_text", "normalize_text", "heldout_side", "split_heldout", "TABLE_SUFFIXES"]

# org/name with the Hub's characters; "@revision" optional. One slash exactly: "gpt2"-style legacy
# ids are not taken (a bare word is far more often a mistyped local path).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}(@[A-Za-z0-9_.\-/]+)?$")
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# weight formats Cascade never reads: not fetched with a model snapshot
_MODEL_IGNORE = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.mlmodel",
                 "onnx/*", "openvino/*", "original/*", "coreml/*"]


class HubError(FileNotFoundError):
    """A reference that is neither a local path nor a Hub repository that can be had (one line)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def is_hub_id(ref: str | os.PathLike) -> bool:
    """``org/name`` (or ``org/name@revision``) that is not an existing local path."""
    s = str(ref)
    if Path(s).expanduser().exists() or s.startswith((".", "/", "~")) or s.lower().endswith(tuple(TABLE_SUFFIXES)):
        return False
    return bool(_HUB_ID.match(s))


def _split_revision(ref: str) -> tuple[str, str | None]:
    repo, _, rev = ref.partition("@")
    return repo, rev or None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _where() -> str:
    from huggingface_hub import constants

    mode = "HF_HUB_OFFLINE=1" if _offline() else f"online, HF_ENDPOINT={constants.ENDPOINT}"
    return f"HF_HUB_CACHE={constants.HF_HUB_CACHE}, {mode}"


def _snapshot(ref: str, repo_type: str, what: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    repo, rev = _split_revision(ref)
    kw: dict[str, Any] = {"repo_type": repo_type, "revision": rev}
    if repo_type == "model":
        kw["ignore_patterns"] = _MODEL_IGNORE
    try:
        return Path(snapshot_download(repo, **kw))
    except hf_errors.LocalEntryNotFoundError:
        if _offline():
            raise HubError(f"{what} {ref!r} is not a local path and not in the Hugging Face cache ({_where()}): "
                           f"download it once with network (`hf download {repo}"
                           f"{' --repo-type dataset' if repo_type == 'dataset' else ''}`) or point HF_HOME / "
                           f"HF_HUB_CACHE at a cache that holds it") from None
        raise HubError(f"{what} {ref!r} is not a local path, the Hugging Face Hub cannot be reached and it is not "
                       f"in the cache ({_where()})") from None
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"{what} {ref!r}: the Hub repository has no revision {rev!r}") from None
    except hf_errors.RepositoryNotFoundError:
        raise HubError(f"{what} {ref!r} is not a local path, and the Hugging Face Hub has no {repo_type} repository "
                       f"{repo!r} (or it is private/gated: set HF_TOKEN)") from None
    except hf_errors.HfHubHTTPError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubError(f"{what} {ref!r}: Hugging Face Hub error: {first}") from None


def resolve_model(ref: str | os.PathLike, what: str = "model") -> Path:
    """The local directory of a model reference: the path itself when it exists (or is not a Hub id,
    so that the loader reports it missing), else the Hub snapshot of ``org/name[@revision]``."""
    if isinstance(ref, Path) or not is_hub_id(ref):
        return Path(ref).expanduser()
    return _snapshot(str(ref), "model", what)


def resolve_dataset(ref: str | os.PathLike, what: str = "dataset") -> Path:
    """The local file or directory of a dataset reference (see :func:`resolve_model`)."""
    if isinstance(ref, Path) or not is_hub_id(ref):
        return Path(ref).expanduser()
    return _snapshot(str(ref), "dataset", what)


def load_table(ref: str | os.PathLike, split: str = "train", subset: str | None = None, what: str = "dataset"):
    """A ``datasets.Dataset`` from a jsonl/json/parquet/csv file, a local dataset directory, or a Hub
    dataset ``org/name[@revision]`` (``subset``: its configuration, ``split``: its split; a single
    file has only ``train``)."""
    import datasets

    datasets.disable_progress_bars()
    p = resolve_dataset(ref, what)
    if p.is_file():
        kind = TABLE_SUFFIXES.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"{what} {str(ref)!r}: unsupported file type {p.suffix!r}; "
                             f"use {', '.join(TABLE_SUFFIXES)}")
        if split != "train" or subset:
            raise ValueError(f"{what} {str(ref)!r} is a single file: it has only the 'train' split and no subsets "
                             f"(got split {split!r}{f', subset {subset!r}' if subset else ''}); use a dataset "
                             "directory or Hub dataset for other splits")
        if p.stat().st_size == 0:
            raise ValueError(f"{what} {str(ref)!r} has no rows (the file is empty)")
        level = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs the error we raise below
        try:
            if kind == "csv":
                return _csv_table([str(p)], "train")
            return datasets.load_dataset(kind, data_files=str(p), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps the parser's error: name the file and the cause
            raise ValueError(f"{what} {str(ref)!r} cannot be read as {kind}: {_root_cause(e)}") from None
        finally:
            datasets.logging.set_verbosity(level)
    if not p.is_dir():
        raise FileNotFoundError(f"{what} {str(ref)!r} not found (not a file, a directory or a Hub id org/name)")
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        from datasets.packaged_modules.csv.csv import CsvConfig

        builder = datasets.load_dataset_builder(str(p), name=subset)  # (the folder scanned once)
        config = builder.config
        files = (config.data_files or {}).get(split) if isinstance(config, CsvConfig) else None
        if files:  # csv: as a single file is read (this split alone: another one, a test.csv, may lack the answers)
            return _csv_table(list(files), split, config)
        builder.download_and_prepare()
        return builder.as_dataset(split=split)
    except (ValueError, FileNotFoundError, KeyError) as e:
        first = str(e.args[0] if e.args else e).splitlines()[0]
        raise ValueError(f"{what} {str(ref)!r} (split {split!r}{f', subset {subset!r}' if subset else ''}): "
                         f"{first}") from None
    except Exception as e:  # noqa: BLE001 - a file of the folder that does not parse: name the cause
        raise ValueError(f"{what} {str(ref)!r} (split {split!r}{f', subset {subset!r}' if subset else ''}) "
                         f"cannot be read: {_root_cause(e)}") from None
    finally:
        datasets.logging.set_verbosity(level)


def _csv_table(files: list[str], split: str, config=None):
    """The ``split`` of csv ``files`` with every column as its text: a guessed type turned answers 7 into 7.0, 0012
    into 12, and pandas' missing values (NA, None) into no answer. ``config``: a folder's ``CsvConfig`` (a dataset
    card's separator, encoding, ...). The column names are pandas', with datasets' settings (a byte order mark
    dropped, a blank header - pandas' own index - named 'Unnamed: 0')."""
    import dataclasses

    import datasets
    import pandas
    from datasets.packaged_modules.csv.csv import CsvConfig

    default = CsvConfig()
    skip = {f.name for f in dataclasses.fields(datasets.BuilderConfig)} | {"features", "keep_default_na"}
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(CsvConfig) if config is not None
                and f.name not in skip and getattr(config, f.name) != getattr(default, f.name)}
    header = {**CsvConfig(**settings).pd_read_csv_kwargs, "nrows": 0, "chunksize": None}
    names = pandas.read_csv(files[0], **header).columns
    text = datasets.Features({str(n): datasets.Value("string") for n in names})
    return datasets.load_dataset("csv", data_files={split: files}, split=split, features=text, keep_default_na=False,
                                 **settings)


def _root_cause(e: BaseException) -> str:
    """The first line of the first error with a message of its own in ``e``'s chain (datasets wraps a
    parser's error in ``DatasetGenerationError``)."""
    first = e
    while e is not None:
        msg = str(e).strip()
        if msg and not msg.startswith("An error occurred while generating"):
            return f"{type(e).__name__}: {msg.splitlines()[0]}"
        e = e.__cause__ or e.__context__
    return type(first).__name__


def parse_columns(spec: str | dict | None, keys: Iterable[str], flag: str = "columns") -> dict[str, str]:
    """``"problem=question,answer=sol"`` or ``{"problem": "question"}`` -> the mapping for ``keys``
    (a key not given maps to itself)."""
    keys = list(keys)
    cols = {k: k for k in keys}
    if isinstance(spec, dict):
        items = [(str(k), str(v)) for k, v in spec.items()]
    else:
        items = []
        for part in (spec or "").split(","):
            if part.strip():
                k, sep, v = part.partition("=")
                if not sep:
                    raise ValueError(f"{flag} {spec!r}: expected {','.join(f'{k}=COLUMN' for k in keys)}")
                items.append((k, v))
    for k, v in items:
        k, v = k.strip(), v.strip()
        if k not in cols or not v:
            raise ValueError(f"{flag} {spec!r}: keys are {', '.join(keys)} (e.g. {keys[0]}=COLUMN), got {k!r}")
        cols[k] = v
    return cols


def load_rows(ref: str | os.PathLike, need: Iterable[str], optional: Iterable[str] = (), columns=None,
              split: str = "train", subset: str | None = None, what: str = "dataset",
              hint: str = "columns.") -> list[dict]:
    """Rows ``{key: value}`` with Cascade's column names: ``need`` must be there (after ``columns``
    maps them), ``optional`` are None where absent. One-line errors name the columns found."""
    need, optional = list(need), list(optional)
    cols = parse_columns(columns, need + optional)
    ds = load_table(ref, split=split, subset=subset, what=what)
    return table_rows(ds, cols, need, ref, what, hint)


def table_rows(ds, cols: dict[str, str], need: list[str], ref, what: str = "dataset",
               hint: str = "columns.") -> list[dict]:
    """Rows of ``ds`` under Cascade's names (``cols``: name -> column); the ``need`` ones must exist."""
    absent = [k for k in need if cols[k] not in ds.column_names]
    if absent:
        missing = [k if cols[k] == k else f"{k}={cols[k]}" for k in absent]
        raise ValueError(f"{what} {str(ref)!r} lacks column(s) {', '.join(missing)} "
                         f"(has: {', '.join(ds.column_names)}); map them with {hint}{absent[0]}=COLUMN")
    data = {k: ds[c] if c in ds.column_names else [None] * len(ds) for k, c in cols.items()}
    rows = [{k: data[k][i] for k in data} for i in range(len(ds))]
    if not rows:
        raise ValueError(f"{what} {str(ref)!r} has no rows")
    return rows


def answer_text(v) -> str | None:
    """A row's answer as text: a number read from a typed column (jsonl, parquet) written out in full, never in
    exponent form (1e-05 -> ``0.00001``, 1e+16 -> ``10000000000000000``, 7.0 -> ``7``), which no answer matches,
    and from its shortest form (an integer past int64 that a jsonl column holds as a float, 1e+23 ->
    ``100000000000000000000000``, not the float's binary value 99999999999999991611392); None for a missing one
    (None, NaN as pandas reads an empty cell, a blank string)."""
    if v is None or (isinstance(v, float) and v != v):
        return None
    if isinstance(v, float) and math.isfinite(v):
        d = Decimal(repr(v))
        text = str(int(d)) if v.is_integer() else format(d, "f")
    else:
        text = str(v)
    return text if text.strip() else None


# -- train / held-out split ------------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """The text a split decides on: whitespace runs collapsed, ends stripped."""
    return " ".join(str(text).split())


def _unit_hash(text: str, salt: str = "") -> float:
    h = hashlib.sha256(f"{salt}\x00{normalize_text(text)}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def heldout_side(text: str, fraction: float, salt: str = "") -> bool:
    """True when ``text`` belongs to the held-out share ``fraction`` (a hash of the normalized text, so
    the same problem is on the same side in every run, file order and copy)."""
    return _unit_hash(text, salt) < fraction


def split_heldout(texts: list[str], fraction: float, salt: str = "") -> tuple[list[int], list[int]]:
    """Indices (train, held-out) of ``texts`` by :func:`heldout_side`. With ``0 < fraction`` and at least
    two distinct texts, held-out is never empty (the text of lowest hash then goes there) and training
    is never empty (an error otherwise). Equal texts always share a side."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"heldout fraction must be in [0, 1), got {fraction}")
    hashes = [_unit_hash(t, salt) for t in texts]
    held_of = [h < fraction for h in hashes]
    if fraction > 0 and not any(held_of) and len({normalize_text(t) for t in texts}) >= 2:
        low = min(hashes)
        held_of = [h == low for h in hashes]  # only the lowest-hash text (and its copies)
    held = [i for i, x in enumerate(held_of) if x]
    train = [i for i, x in enumerate(held_of) if not x]
    if not train:
        raise ValueError(f"heldout={fraction} leaves no training rows out of {len(texts)}; lower it")
    return train, held
