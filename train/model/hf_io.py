"""Load and save the policy in Hugging Face format (config.json + safetensors + tokenizer files).

On disk, MoE experts use the per-expert naming that transformers writes and vLLM reads
(``mlp.experts.{e}.gate_proj.weight``); in memory they are stacked (see ``modeling``).
Files written here open with ``AutoModelForCausalLM.from_pretrained``: one ``model.safetensors``, or
above ``max_shard_size`` (default 5 GB) shards ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json``; ``config.json`` carries ``transformers_version`` and
``generation_config.json`` is the source checkpoint's (sampling defaults, eos list), carried in
``ModelConfig.generation_config``. Loading builds the model on the meta device, allocates it once in
the target dtype and streams each tensor from its shard into place (no second full copy in memory).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from train.model.config import ModelConfig
from train.model.modeling import CausalLM

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# the files that hold a tokenizer's vocabulary (one at least): fast (tokenizer.json), BPE (vocab.json + merges.txt),
# SentencePiece (a Llama-2-era repo's tokenizer.model, T5's spiece.model, ...), WordPiece, Mistral's tekken
VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer.model.v3", "spiece.model",
               "sentencepiece.bpe.model", "vocab.txt", "tekken.json")
TOKENIZER_FILES = VOCAB_FILES + ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                                 "chat_template.jinja", "merges.txt", "generation_config.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy ``src``'s tokenizer files (not its generation config) into ``dst``; the names copied."""
    import shutil

    names = [n for n in TOKENIZER_FILES if n != "generation_config.json" and (Path(src) / n).exists()]
    for n in names:
        shutil.copyfile(Path(src) / n, Path(dst) / n)
    return names


DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes; transformers 4.x's default (5.x writes up to 50 GB per file)
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or corrupt."""


def _require_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {str(p)!r} is not a directory")
    return p


def load_config(path: str | Path) -> ModelConfig:
    p = _require_dir(path)
    f = p / "config.json"
    if not f.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} has no config.json")
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt config.json in {str(p)!r}: {e}") from None
    cfg = ModelConfig.from_hf(d)
    gen = p / "generation_config.json"
    if gen.exists():
        try:
            cfg.generation_config = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"corrupt generation_config.json in {str(p)!r}: {e}") from None
    return cfg


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (as transformers reads them)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {size!r}; expected bytes or e.g. '5GB', '500MB', '2GiB'")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def transformers_version() -> str | None:
    """The installed transformers version (without importing it), written to config.json."""
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # noqa: BLE001 - not installed: leave the field out
        return None


def _weight_files(p: Path) -> list[Path]:
    index = p / INDEX_FILE
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"corrupt model.safetensors.index.json in {str(p)!r}: {e}") from None
        files = [p / n for n in names]
    else:
        files = [p / "model.safetensors"] if (p / "model.safetensors").exists() else sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {str(p)!r} has no safetensors weights")
    missing = [str(f.name) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"checkpoint {str(p)!r} is missing weight files {missing}")
    return files


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    p = _require_dir(path)
    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(p):
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"corrupt weight file {str(f)!r}: {e}") from None
    return sd


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (per-expert or transformers 5's fused ``gate_up_proj``) -> Cascade's in-memory names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        if k.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed from the config
            continue
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        if sorted(per) != list(range(cfg.num_experts)):
            raise CheckpointError(f"{prefix}: expected experts 0..{cfg.num_experts - 1}, found {sorted(per)}")
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0) for e in range(cfg.num_experts)])
            out[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(cfg.num_experts)])
        except KeyError as e:
            raise CheckpointError(f"{prefix}: an expert lacks {e}") from None
    if cfg.tie_word_embeddings:  # (a checkpoint's own head is checked where files are read: stream_into)
        out.pop("lm_head.weight", None)
    return out


def check_tied_head(head: torch.Tensor, embed: torch.Tensor) -> None:
    """A tied config whose checkpoint also holds an ``lm_head.weight`` of its own: the same values as the
    embeddings (a copy) are fine; others are a :class:`CheckpointError` (transformers loads the stored head and
    unties them, Cascade would tie: logits 4.6 apart)."""
    if head.shape != embed.shape or not torch.equal(head.to(embed.dtype), embed):
        raise CheckpointError("tie_word_embeddings is true but the checkpoint holds an lm_head.weight unlike the "
                              "embeddings (transformers would use it, untied): set tie_word_embeddings to false, or "
                              "drop lm_head.weight")


def split_fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cascade's fused expert tensors (``...mlp.experts.gate_up_proj [E, 2I, H]``,
    ``...mlp.experts.down_proj [E, H, I]``) split per expert in HF checkpoint naming; every other
    name passes through."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, inter:]
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Cascade's parameters under the names a ``save_pretrained`` checkpoint uses (per expert)."""
    sd = model.state_dict()
    if getattr(model, "is_transformers_fallback", False):  # already transformers' names
        return sd
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if model.config.architecture == "zaya":  # transformers' ZayaForCausalLM reads and writes the fused experts
        return sd
    return split_fused_experts(sd)


def load_into(model: CausalLM, sd: dict[str, torch.Tensor], hf_names: bool = True) -> None:
    """Copy weights into ``model`` (strict: every parameter present, no stray names, shapes equal)."""
    if getattr(model, "is_transformers_fallback", False):
        from train.model.hf_fallback import load_weights_into

        return load_weights_into(model, sd)
    own = from_hf_state_dict(sd, model.config) if hf_names else dict(sd)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        own.pop("lm_head.weight", None)
    missing, extra = sorted(set(expected) - set(own)), sorted(set(own) - set(expected))
    if missing or extra:
        raise CheckpointError(f"weights do not match the config: missing {missing[:8]}, unexpected {extra[:8]}")
    bad = [k for k in expected if tuple(own[k].shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(f"shape mismatch for {k}: checkpoint {tuple(own[k].shape)} vs model "
                              f"{tuple(expected[k].shape)}")
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(own[k])


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    backend: str | None = None) -> CausalLM:
    """A :class:`CausalLM` from an HF checkpoint directory (Cascade's own or a pretrained Qwen3 / Qwen3-MoE /
    Qwen2 / Llama), sharded or not. The model is made on the meta device and allocated once, in ``dtype``
    on ``device``; each tensor is then read from its shard and copied into place, so the peak memory is
    the model plus one tensor (no full state dict beside it, no fp32 copy of a bf16 model).

    ``backend`` (default ``$CASCADE_MODEL_BACKEND``, else ``cascade``): ``cascade`` (this model; other
    architectures are refused), ``transformers`` (any causal LM through
    :mod:`train.model.hf_fallback`, slower) or ``auto`` (this model where the config is supported, the
    fallback otherwise)."""
    from train.model.hf_fallback import load_transformers

    cfg = check_loadable(path, backend)
    if cfg is None:
        return load_transformers(path, dtype, device)
    files = _weight_files(Path(path))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():  # buffers not saved in checkpoints (ZAYA1's per-step expert load counts) start at zero
        for name, buf in model.named_buffers():
            if name.endswith("load_counts"):
                buf.zero_()
    stream_into(model, files)
    return model


def check_loadable(path: str | Path, backend: str | None = None) -> ModelConfig | None:
    """Check that ``path`` loads with ``backend`` (default ``$CASCADE_MODEL_BACKEND``, else ``cascade``;
    see :func:`load_pretrained`), with a one-line error where not -> its :class:`ModelConfig`, or None
    when it goes through the transformers fallback."""
    from train.model.hf_fallback import BACKENDS

    backend = backend or os.environ.get("CASCADE_MODEL_BACKEND", "").strip().lower() or "cascade"
    if backend not in BACKENDS:
        raise ValueError(f"model backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "transformers":
        if not (_require_dir(path) / "config.json").exists():
            raise CheckpointError(f"checkpoint {str(path)!r} has no config.json")
        return None
    try:
        return load_config(path)
    except CheckpointError:
        raise
    except ValueError:  # an architecture or option Cascade's model does not implement
        if backend != "auto":
            raise
        return None


def ignored_key(k: str, tied: bool) -> bool:
    """Whether a load skips checkpoint tensor ``k`` (Cascade's and vLLM's loaders alike): a rotary buffer
    (recomputed from the config), or with tied embeddings an LM head of its own."""
    return k.endswith("rotary_emb.inv_freq") or (tied and k == "lm_head.weight")


def checkpoint_key(k: str, cfg: ModelConfig, names) -> tuple | None:
    """What safetensors key ``k`` is to a model of ``cfg`` whose tensors are ``names`` (Cascade's names):
    None (skipped: :func:`ignored_key`), ``("expert", fused name, e, part)`` for a per-expert HF tensor,
    ``("plain", k)`` or ``("extra", k)`` (no such tensor)."""
    if ignored_key(k, cfg.tie_word_embeddings):
        return None
    m = _EXPERT.match(k)
    if m:
        prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
        name = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        return ("expert", name, e, part) if name in names and e < cfg.num_experts else ("extra", k)
    return ("plain", k) if k in names else ("extra", k)


def stream_into(model: CausalLM, files: list[Path]) -> None:
    """Copy the tensors of safetensors ``files`` (HF names, per-expert or fused experts) into ``model``
    one at a time; strict as :func:`load_into` (every parameter present, no stray names, shapes equal)."""
    cfg = model.config
    params = model.state_dict()
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    seen: set[str] = set()
    parts: dict[str, set] = {}  # fused expert tensor -> (expert, part) filled from per-expert names
    extra: list[str] = []
    head = None  # a tied model's own lm_head.weight in the checkpoint (file), checked against the embeddings
    with torch.no_grad():
        for f in files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    for k in sf.keys():
                        what = checkpoint_key(k, cfg, params)
                        if what is None:
                            head = f if cfg.tie_word_embeddings and k == "lm_head.weight" else head
                            continue
                        if what[0] == "expert":
                            _, name, e, part = what
                            target = params[name][e]
                            if part != "down_proj":
                                half = target.shape[0] // 2
                                target = target[:half] if part == "gate_proj" else target[half:]
                            parts.setdefault(name, set()).add((e, part))
                        elif what[0] == "plain":
                            name, target = k, params[k]
                            seen.add(k)
                        else:
                            extra.append(k)
                            continue
                        t = sf.get_tensor(k)
                        if tuple(t.shape) != tuple(target.shape):
                            raise CheckpointError(f"shape mismatch for {k}: checkpoint {tuple(t.shape)} vs model "
                                                  f"{tuple(target.shape)}")
                        target.copy_(t)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"corrupt weight file {str(f)!r}: {e}") from None
    for name, got in parts.items():
        need = cfg.num_experts * (1 if name.endswith("down_proj") else 2)
        if len(got) == need:
            seen.add(name)
        elif name not in seen:
            raise CheckpointError(f"{name}: {len(got)} of {need} per-expert tensors in the checkpoint")
    missing = sorted(set(params) - seen)
    if missing or extra:
        raise CheckpointError(f"weights do not match the config: missing {missing[:8]}, unexpected {sorted(extra)[:8]}")
    if head is not None and "model.embed_tokens.weight" in params:
        with safe_open(str(head), framework="pt", device="cpu") as sf:
            check_tied_head(sf.get_tensor("lm_head.weight"), params["model.embed_tokens.weight"])


class CheckpointSlices:
    """An HF checkpoint directory as a weight source for the sharded layouts
    (:class:`train.parallel.tsp.TSPCausalLM`, :class:`train.parallel.tp.TPCausalLM`):
    ``read(name, *index)`` returns ``tensor[index]`` of Cascade's in-memory tensor ``name`` (one slice
    per leading dim, step 1) in ``dtype`` on ``device``, reading only those elements from the
    safetensors files (``get_slice``), so a rank never materialises a full sharded parameter.

    Names follow :func:`stream_into`: experts per expert on disk (``mlp.experts.{e}.gate_proj.weight``,
    stacked here slice by slice) or fused (``mlp.experts.gate_up_proj``); ``rotary_emb.inv_freq`` is
    skipped and with tied embeddings ``lm_head.weight`` is never read. Strict as :func:`stream_into`:
    a missing parameter, a stray name or a shape unlike the config's is a :class:`CheckpointError`
    when the reader is made. ``nbytes_read`` counts the bytes of every slice read."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: str | None = None):
        cfg = check_loadable(path, backend)
        if cfg is None:
            from train.parallel.shard import FALLBACK_REFUSAL

            raise ValueError(FALLBACK_REFUSAL.format(arch=fallback_architecture(path)))
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.nbytes_read = 0
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg).state_dict().items()}
        if cfg.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        self.shapes = shapes
        self._files: dict[str, object] = {}  # file -> open safetensors handle (closed by close())
        try:
            self._index(path, cfg, shapes)
        except BaseException:
            self.close()
            raise

    def _index(self, path, cfg, shapes) -> None:
        self._plain: dict[str, tuple[str, str]] = {}  # our name -> (file, key)
        self._experts: dict[str, dict[tuple[int, str], tuple[str, str]]] = {}  # fused name -> (e, part) -> (file, key)
        extra: list[str] = []
        E = cfg.num_experts
        for f in _weight_files(Path(path)):
            try:
                h = self._files[str(f)] = safe_open(str(f), framework="pt", device="cpu")
                keys = list(h.keys())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"corrupt weight file {str(f)!r}: {e}") from None
            for k in keys:
                what = checkpoint_key(k, cfg, shapes)
                if what is None:
                    continue
                if what[0] == "expert":
                    _, name, e, part = what
                    full = shapes[name][1:]
                    want = full if part == "down_proj" else (full[0] // 2, full[1])
                    self._check_shape(str(f), k, want)
                    self._experts.setdefault(name, {})[(e, part)] = (str(f), k)
                elif what[0] == "plain":
                    self._check_shape(str(f), k, shapes[k])
                    self._plain[k] = (str(f), k)
                else:
                    extra.append(k)
        for name, got in self._experts.items():
            need = E * (1 if name.endswith("down_proj") else 2)
            if len(got) != need and name not in self._plain:
                raise CheckpointError(f"{name}: {len(got)} of {need} per-expert tensors in the checkpoint")
        missing = sorted(set(shapes) - set(self._plain) - set(self._experts))
        if missing or extra:
            raise CheckpointError(f"weights do not match the config: missing {missing[:8]}, unexpected {sorted(extra)[:8]}")

    def _check_shape(self, f: str, k: str, want: tuple) -> None:
        got = tuple(self._files[f].get_slice(k).get_shape())
        if got != tuple(want):
            raise CheckpointError(f"shape mismatch for {k}: checkpoint {got} vs model {tuple(want)}")

    def _get(self, f: str, k: str, index: tuple) -> torch.Tensor:
        t = self._files[f].get_slice(k)[index]
        self.nbytes_read += t.numel() * t.element_size()
        return t

    def read(self, name: str, *index: slice) -> torch.Tensor:
        shape = self.shapes[name]
        idx = [slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape)]
        if any(sl.step not in (None, 1) for sl in index):
            raise ValueError("CheckpointSlices.read takes slices of step 1")
        idx += [slice(0, n) for n in shape[len(idx):]]
        if name in self._plain:
            t = self._get(*self._plain[name], tuple(idx))
        elif name.endswith("gate_up_proj"):  # per expert: rows [a, b) of gate rows then up rows
            (e0, e1), (a, b), rest = idx[0].indices(shape[0])[:2], idx[1].indices(shape[1])[:2], tuple(idx[2:])
            half = shape[1] // 2
            per = []
            for e in range(e0, e1):
                parts = []
                if a < half and min(b, half) > a:
                    parts.append(self._get(*self._experts[name][(e, "gate_proj")], (slice(a, min(b, half)),) + rest))
                if b > half and b > max(a, half):
                    parts.append(self._get(*self._experts[name][(e, "up_proj")],
                                           (slice(max(a, half) - half, b - half),) + rest))
                per.append(torch.cat(parts, 0) if parts else None)
            t = self._stack(per, idx, shape)
        else:  # down_proj per expert
            e0, e1 = idx[0].indices(shape[0])[:2]
            t = self._stack([self._get(*self._experts[name][(e, "down_proj")], tuple(idx[1:])) for e in range(e0, e1)],
                            idx, shape)
        return t.to(device=self.device, dtype=self.dtype)

    @staticmethod
    def _stack(per: list, idx: list, shape: tuple) -> torch.Tensor:
        if per and all(p is not None for p in per):
            return torch.stack(per)
        return torch.empty([len(range(*sl.indices(n))) for sl, n in zip(idx, shape)])

    def close(self) -> None:
        """Release the safetensors files (their mappings go with the handles): a reader is done once
        the shards are built; ``with CheckpointSlices(...) as src:`` closes it on the way out."""
        self._files.clear()

    def __enter__(self) -> "CheckpointSlices":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fallback_architecture(path: str | Path) -> str:
    """The ``model_type`` (else the ``architectures``) named by ``path``'s config.json, for messages."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown architecture"
    return str(d.get("model_type") or (d.get("architectures") or ["unknown architecture"])[0])


def write_weights(sd: dict[str, torch.Tensor], path: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write ``sd`` as ``model.safetensors``, or, when larger than ``max_shard_size``, as shards
    ``model-0000i-of-0000n.safetensors`` (tensors in order, a new shard when the next tensor would not
    fit; a tensor larger than the limit alone) with ``model.safetensors.index.json`` as transformers
    writes them. Weight files of an earlier save in ``path`` are removed first. -> the file names."""
    p = Path(path)
    limit = parse_size(max_shard_size)
    for old in [p / "model.safetensors", p / INDEX_FILE, *p.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v.detach().contiguous().cpu()
        size += n
        total += n
    if len(shards) == 1:
        save_file(shards[0], str(p / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(p / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (p / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def save_pretrained(model: CausalLM, path: str | Path, tokenizer_dir: str | Path | None = None, tokenizer=None,
                    dtype: torch.dtype | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    generation_config: dict | None = None) -> Path:
    """Write config.json, the safetensors weights (sharded above ``max_shard_size``), generation_config.json
    (and tokenizer files) to ``path``. generation_config.json: ``generation_config`` if given, else the
    one the model was loaded with (``model.config.generation_config``), else ``tokenizer_dir``'s, else
    bos/eos/pad from the config."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    version = transformers_version()
    if getattr(model, "is_transformers_fallback", False):  # transformers writes it (sharded the same way)
        for old in [p / "model.safetensors", p / INDEX_FILE, *p.glob("model-*-of-*.safetensors")]:
            old.unlink(missing_ok=True)
        kw = {} if dtype is None else {"state_dict": {k: v.to(dtype) for k, v in model.hf.state_dict().items()}}
        model.hf.save_pretrained(str(p), max_shard_size=parse_size(max_shard_size), **kw)
        cfg_d = {k: getattr(model.config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    else:
        cfg_d = model.config.to_hf()
        sd = to_hf_state_dict(model)
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        cfg_d["torch_dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
        if version:
            cfg_d["transformers_version"] = version
        write_weights(sd, p, max_shard_size)
        (p / "config.json").write_text(json.dumps(cfg_d, indent=2))
    gen = generation_config or model.config.generation_config
    src_gen = Path(tokenizer_dir) / "generation_config.json" if tokenizer_dir is not None else None
    if gen is None and src_gen is not None and src_gen.exists():
        gen = json.loads(src_gen.read_text())
    gen = dict(gen or {})
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the source's values win
        if gen.get(k) is None and cfg_d[k] is not None:
            gen[k] = cfg_d[k]
    if version:
        gen["transformers_version"] = version
    (p / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(p))
    elif tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, p)
    return p
