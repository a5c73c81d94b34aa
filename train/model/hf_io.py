"""Load and save the policy in Hugging Face format (config.json + safetensors + tokenizer files).

On disk, MoE experts use the per-expert naming that transformers writes and vLLM reads
(``mlp.experts.{e}.gate_proj.weight``); in memory they are stacked (see ``modeling``).
Files written here open with ``AutoModelForCausalLM.from_pretrained``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from train.model.config import ModelConfig
from train.model.modeling import CausalLM

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


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
    return ModelConfig.from_hf(d)


def _weight_files(p: Path) -> list[Path]:
    index = p / "model.safetensors.index.json"
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
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


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
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return split_fused_experts(sd)


def load_into(model: CausalLM, sd: dict[str, torch.Tensor], hf_names: bool = True) -> None:
    """Copy weights into ``model`` (strict: every parameter present, no stray names, shapes equal)."""
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


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """A :class:`CausalLM` from an HF checkpoint directory (Cascade's own or a pretrained Qwen3/Qwen3-MoE)."""
    cfg = load_config(path)
    sd = read_state_dict(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_into(model, sd)
    return model.to(dtype)


def save_pretrained(model: CausalLM, path: str | Path, tokenizer_dir: str | Path | None = None, tokenizer=None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write config.json, model.safetensors (and tokenizer files) to ``path``."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg_d = model.config.to_hf()
    sd = to_hf_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    cfg_d["torch_dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, str(p / "model.safetensors"),
              metadata={"format": "pt"})
    (p / "config.json").write_text(json.dumps(cfg_d, indent=2))
    gen = {"bos_token_id": cfg_d["bos_token_id"], "eos_token_id": cfg_d["eos_token_id"],
           "pad_token_id": cfg_d["pad_token_id"]}
    (p / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(p))
    elif tokenizer_dir is not None:
        import shutil

        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists() and name != "generation_config.json":
                shutil.copyfile(src, p / name)
    return p
