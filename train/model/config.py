"""Model configuration, read from and written to Hugging Face ``config.json`` (Qwen3 / Qwen3-MoE)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    def layer_is_moe(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def validate(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
        return self

    # -- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From our own keys (a preset) or an HF config dict; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**d).validate()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; Cascade's policy supports {list(SUPPORTED_MODEL_TYPES)}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope!r}; only default RoPE is implemented")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        n_heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0), num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads, num_key_value_heads=d.get("num_key_value_heads", n_heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
        )
        if mt == "qwen3_moe":
            kw.update(
                num_experts=d.get("num_experts", d.get("num_local_experts")),
                num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=list(d.get("mlp_only_layers") or []),
            )
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by Cascade's policy")
        return cls(**kw).validate()

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": self.model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": None, "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=self.mlp_only_layers,
                     output_router_logits=False, router_aux_loss_coef=0.001)
        return d

    def num_parameters(self) -> int:
        h, L = self.hidden_size, self.num_hidden_layers
        attn = h * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * self.head_dim
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(L):
            mlp = (self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
                   if self.layer_is_moe(i) else 3 * h * self.intermediate_size)
            total += attn + mlp + 2 * h
        return total
