"""Model presets (``configs/models/*.yaml``) and ``init_model``, which writes a fresh policy checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from train.model.config import ModelConfig


def configs_dir() -> Path:
    """The ``configs/`` folder: ``$CASCADE_CONFIGS`` when set; else the copy an installed wheel carries
    as package data (``cascade/_configs``, see pyproject.toml); else the repository's ``configs/`` (a
    checkout or an editable install). The packaged copy comes first: a ``configs/`` that happens to sit
    next to the packages in site-packages is someone else's."""
    env = os.environ.get("CASCADE_CONFIGS")
    root = Path(__file__).resolve().parents[1]
    candidates = [Path(env)] if env else [root / "cascade" / "_configs", root / "configs"]
    for p in candidates:
        if p.is_dir():
            return p
    raise FileNotFoundError(f"configs directory not found (looked in {', '.join(map(str, candidates))}); "
                            f"set CASCADE_CONFIGS")


def list_presets() -> list[str]:
    return sorted(f.stem for f in (configs_dir() / "models").glob("*.yaml"))


def load_preset(name: str) -> dict:
    f = configs_dir() / "models" / f"{name}.yaml"
    if not f.exists():
        raise ValueError(f"unknown model preset {name!r}; available presets: {', '.join(list_presets())}")
    return yaml.safe_load(f.read_text())


def preset_model_dict(preset: str, vocab_size: int | None = None, **overrides) -> dict:
    """The :class:`ModelConfig` fields of ``preset`` with ``overrides`` (its family from ``model_type``); where
    neither sets a vocabulary size, ``vocab_size`` or else the preset tokenizer's."""
    spec = load_preset(preset)
    m = dict(spec["model"])
    if spec.get("model_type") in ("qwen2", "llama", "zaya"):  # the family; qwen3 / qwen3_moe is the default
        m.setdefault("architecture", spec["model_type"])
    m.update(overrides)
    m.setdefault("vocab_size", vocab_size or spec.get("tokenizer", {}).get("vocab_size", 1024))
    return m


def init_model(preset: str, out: str | Path, seed: int = 0, **overrides):
    """Build the tokenizer and a randomly initialised model from ``preset``; save both to ``out``.

    Returns ``(model, tokenizer)``."""
    from train.model.hf_io import save_pretrained
    from train.model.modeling import CausalLM
    from train.tokenizer import build_tokenizer

    spec = load_preset(preset)
    out = Path(out)
    tok = build_tokenizer(out, vocab_size=spec.get("tokenizer", {}).get("vocab_size", 1024), seed=seed)
    m = preset_model_dict(preset, len(tok), **overrides)
    m.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = ModelConfig.from_dict(m)
    model = CausalLM(cfg).init_weights(seed)
    save_pretrained(model, out, tokenizer=tok)
    return model, tok
