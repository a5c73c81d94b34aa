"""Model configuration, read from and written to Hugging Face ``config.json`` (Qwen3 / Qwen3-MoE,
Qwen2, Llama and ZAYA1 ``zaya``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama", "zaya")
ARCHITECTURES = ("qwen3", "qwen2", "llama", "zaya")  # MoE: Qwen3-MoE (architecture qwen3) and ZAYA1 (always MoE)
ROPE_TYPES = ("default", "linear", "llama3")  # RoPE scalings implemented (``rope_scaling``)
_HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
             "zaya": "ZayaForCausalLM"}


def _flat_rope(r: Any) -> dict:
    """A rope_parameters/rope_scaling entry as one dict (the per-layer-type form has one for all layers)."""
    r = dict(r or {})
    return dict(r["full_attention"]) if isinstance(r.get("full_attention"), dict) else r


def _rope_kind(r: dict) -> dict:
    """What a RoPE entry says beyond its base frequency (its type and scaling fields)."""
    out = {k: v for k, v in r.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = r.get("rope_type", r.get("type")) or "default"
    return out


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
    # family: "qwen3" (q/k RMSNorm), "qwen2" (q/k/v bias, no o_proj bias, no q/k norm), "llama" (no q/k
    # norm; attention_bias on all four projections)
    architecture: str = "qwen3"
    # RoPE scaling beyond plain RoPE: {"rope_type": "linear", "factor": f} or Llama 3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # ZAYA1 (architecture "zaya", see train/model/zaya.py): CCA convolution kernels, router width,
    # RoPE on this fraction of each head (0.5 for ZAYA1; 1.0 for the other families)
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    partial_rotary_factor: float = 1.0
    # ZAYA1's balancing biases move by this step after every optimizer step (0: frozen); an extra
    # config.json key, as fp32_residual (train/model/zaya.py:balance_router_biases)
    router_bias_update_rate: float = 1e-3
    # numerics: keep the residual stream (the embedding output and every residual addition) in fp32
    # when the weights are bf16/fp16 (ZAYA1's FP32 set); a no-op for fp32 weights. Written to
    # config.json as an extra key (transformers and vLLM ignore it), so trainer and engine agree.
    fp32_residual: bool = True
    # the source checkpoint's generation_config.json (sampling defaults, eos list), carried to every
    # checkpoint saved from this config; not part of config.json
    generation_config: dict | None = field(default=None, compare=False, repr=False)
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        if self.architecture == "zaya":
            return "zaya"
        return "qwen3_moe" if self.is_moe else self.architecture

    @property
    def rope_dim(self) -> int:
        """Rotated dims of each head (partial RoPE: ``head_dim * partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm(self) -> bool:
        """RMSNorm on each query and key head before RoPE (Qwen3 only)."""
        return self.architecture == "qwen3"

    @property
    def o_proj_bias(self) -> bool:
        """Qwen2 has q/k/v biases but none on o_proj; Qwen3 and Llama bias all four or none."""
        return self.attention_bias and self.architecture != "qwen2"

    def layer_is_moe(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def validate(self) -> "ModelConfig":
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {list(ARCHITECTURES)}, got {self.architecture!r}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 has q/k/v biases: attention_bias must be true")
        if self.architecture == "zaya":
            if not self.is_moe or self.num_experts_per_tok != 1 or self.mlp_only_layers or self.decoder_sparse_step != 1:
                raise ValueError("zaya: every layer is MoE with top-1 routing (num_experts > 0, num_experts_per_tok 1)")
            if self.rope_scaling is not None or self.cca_time0 < 1 or self.cca_time1 < 1:
                raise ValueError("zaya: plain RoPE only and CCA kernel sizes >= 1")
        elif self.is_moe and self.architecture != "qwen3":
            raise ValueError(f"MoE layers are implemented for qwen3 (Qwen3-MoE) and zaya only, not {self.architecture!r}")
        elif self.partial_rotary_factor != 1.0:
            raise ValueError("partial rotary embeddings are implemented for zaya only")
        if self.rope_dim % 2 or self.rope_dim < 2:
            raise ValueError(f"rotated dims (head_dim * partial_rotary_factor) must be even, got {self.rope_dim}")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type")
            need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                      "original_max_position_embeddings")}.get(rt)
            if need is None or any(k not in self.rope_scaling for k in need):
                raise ValueError(f"rope_scaling {self.rope_scaling!r}: supported are rope_type 'linear' (factor) and "
                                 f"'llama3' (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.is_moe and self.moe_intermediate_size < 1:
            raise ValueError(f"num_experts={self.num_experts} needs moe_intermediate_size >= 1 (the experts' width), "
                             f"got {self.moe_intermediate_size}")
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
        return self

    # -- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From our own keys (a preset; an HF config.json goes through :meth:`from_hf`); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**d).validate()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; Cascade's policy supports {list(SUPPORTED_MODEL_TYPES)} "
                             "(others: model_backend=auto in cascade run, or CASCADE_MODEL_BACKEND=auto, runs them through "
                             "transformers, slower)")
        if mt == "zaya":
            return cls._from_hf_zaya(d)
        params, scaling_in = (_flat_rope(d.get(k)) for k in ("rope_parameters", "rope_scaling"))
        if params and scaling_in and _rope_kind(params) != _rope_kind(scaling_in):
            # transformers (and vLLM) take rope_scaling; a transformers-5 save has rope_parameters, and the model cards
            # say to add rope_scaling for long context: one of the two would be ignored somewhere
            raise ValueError(f"config.json has rope_parameters {params!r} and a different rope_scaling "
                             f"{scaling_in!r}; transformers uses rope_scaling: keep one of them")
        if params and scaling_in and "rope_theta" in params:
            # transformers takes rope_scaling whole, its base from it or the top-level rope_theta (else its default)
            hf_theta = scaling_in.get("rope_theta", d.get("rope_theta"))
            if hf_theta is None or float(hf_theta) != float(params["rope_theta"]):
                raise ValueError(f"config.json has rope_parameters with rope_theta {params['rope_theta']} and a "
                                 f"rope_scaling that transformers uses with rope_theta "
                                 f"{hf_theta if hf_theta is not None else '(its default)'}; keep one of them, or set "
                                 f"the same rope_theta at the top level")
        rope = dict(scaling_in or params or {})
        theta_default = params.get("rope_theta", d.get("rope_theta", 10000.0)) if params else d.get("rope_theta",
                                                                                                     10000.0)
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {rope!r}; Cascade's policy implements rope_type "
                             f"{list(ROPE_TYPES)} (CASCADE_MODEL_BACKEND=auto runs it through transformers)")
        if float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial rotary embeddings are not supported by Cascade's policy")
        theta = rope.get("rope_theta", theta_default)
        scaling = None
        if rope_type != "default":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            scaling = {"rope_type": rope_type, **{k: rope[k] for k in keys if k in rope}}
        arch = "qwen3" if mt == "qwen3_moe" else mt
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported by Cascade's policy (silu only)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by Cascade's policy")
        if int(d.get("pretraining_tp", 1) or 1) != 1:
            raise ValueError("pretraining_tp > 1 is not supported by Cascade's policy")
        n_heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0), num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads, num_key_value_heads=n_heads if d.get("num_key_value_heads") is None else d["num_key_value_heads"],  # (null: MHA)
            head_dim=d.get("head_dim") or (128 if mt == "qwen3" else d["hidden_size"] // n_heads),  # transformers'
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bool(d.get("attention_bias", False)),
            architecture=arch, rope_scaling=scaling,
            fp32_residual=bool(d.get("fp32_residual", True)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
        )
        if mt == "qwen3_moe":
            missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if d.get(k) is None]
            missing += [] if d.get("num_experts", d.get("num_local_experts")) is not None else ["num_experts"]
            if missing:  # (a KeyError or TypeError before, which model_backend=auto did not fall back from)
                raise ValueError(f"config.json of a qwen3_moe model lacks {', '.join(missing)}")
            kw.update(
                num_experts=d.get("num_experts", d.get("num_local_experts")),
                num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=list(d.get("mlp_only_layers") or []),
            )
        sliding = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ())
        if sliding and d.get("sliding_window") is not None:  # the fields are ignored while the window is off
            raise ValueError("sliding-window attention is not supported by Cascade's policy")
        return cls(**kw).validate()

    @classmethod
    def _from_hf_zaya(cls, d: dict[str, Any]) -> "ModelConfig":
        L = d["num_hidden_layers"]
        if any(t != "hybrid" for t in (d.get("layer_types") or ["hybrid"] * L)):
            raise ValueError("zaya: sliding-window layers (hybrid_sliding) are not supported by Cascade's policy")
        if d.get("lm_head_bias") or d.get("hidden_act", "silu") != "silu":
            raise ValueError("zaya: lm_head_bias and hidden_act other than silu are not supported by Cascade's policy")
        given = d.get("rope_parameters") or {}
        if given and not isinstance(given.get("hybrid"), dict):
            raise ValueError(f"zaya: rope_parameters must be given per layer type ({{'hybrid': {{...}}}}), got {given!r}")
        rope = dict(given.get("hybrid") or {})
        if d.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"zaya: unsupported rope {rope!r} (plain RoPE only)")
        n_heads = d.get("num_attention_heads", 8)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=0, num_hidden_layers=L,
            num_attention_heads=n_heads, num_key_value_heads=d.get("num_key_value_heads", 2),
            head_dim=d.get("head_dim", 128), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", 5_000_000.0)),
            # transformers' default: 0.5 in the rope_parameters it builds when a config has none, 1.0 (full
            # rotary) when a given one leaves the factor out
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0 if rope else 0.5)),
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)), architecture="zaya",
            num_experts=d.get("num_experts", 16), num_experts_per_tok=d.get("num_experts_per_tok", 1),
            moe_intermediate_size=d.get("moe_intermediate_size", 2048), norm_topk_prob=False,
            router_hidden_size=d.get("router_hidden_size", 256), cca_time0=d.get("cca_time0", 2),
            cca_time1=d.get("cca_time1", 2), fp32_residual=bool(d.get("fp32_residual", True)),
            router_bias_update_rate=float(d.get("router_bias_update_rate", 1e-3)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
        ).validate()

    def _to_hf_zaya(self) -> dict[str, Any]:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        return {
            "architectures": ["ZayaForCausalLM"], "model_type": "zaya", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"hybrid": rope, "hybrid_sliding": dict(rope)},
            "layer_types": ["hybrid"] * self.num_hidden_layers, "sliding_window": None,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "lm_head_bias": False,
            "num_experts": self.num_experts, "num_experts_per_tok": 1, "moe_intermediate_size": self.moe_intermediate_size,
            "router_hidden_size": self.router_hidden_size, "cca_time0": self.cca_time0, "cca_time1": self.cca_time1,
            "output_router_logits": False, "torch_dtype": "float32", "fp32_residual": self.fp32_residual,
            "router_bias_update_rate": self.router_bias_update_rate,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }

    def to_hf(self) -> dict[str, Any]:
        if self.architecture == "zaya":
            return self._to_hf_zaya()
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else _HF_CLASS[self.architecture]],
            "model_type": self.model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})},
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "hidden_act": "silu",
            "use_sliding_window": False, "sliding_window": None, "torch_dtype": "float32",
            "fp32_residual": self.fp32_residual,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling:  # the pre-5 key, for transformers 4.x and vLLM
            d["rope_scaling"] = dict(self.rope_scaling, type=self.rope_scaling["rope_type"])
        if self.architecture == "qwen2":  # q/k/v biases always; the sliding-window fields, off
            del d["attention_bias"]
            d["max_window_layers"] = self.num_hidden_layers
        elif self.architecture == "llama":
            for k in ("use_sliding_window", "sliding_window"):
                del d[k]
            d.update(mlp_bias=False, pretraining_tp=1)
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=self.mlp_only_layers,
                     output_router_logits=False, router_aux_loss_coef=0.001)
        return d

    def num_parameters(self) -> int:
        h, L = self.hidden_size, self.num_hidden_layers
        if self.architecture == "zaya":
            d, hq, hk, E, R = self.head_dim, self.num_attention_heads, self.num_key_value_heads, self.num_experts, self.router_hidden_size
            C = (hq + hk) * d
            attn = h * C + h * hk * d + hq * d * h + C * (self.cca_time0 + 1) + C * (d * self.cca_time1 + 1) + hk
            attn += self.attention_bias * ((hq + 2 * hk) * d + h)
            router = h * R + R + 2 * (R * R + R) + R + R * (E + 1) + R
            per = attn + router + E * 3 * h * self.moe_intermediate_size + 2 * h + 8 * h
            return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + 3 * h + L * per - R  # no depth state at layer 0
        attn = h * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += 2 * self.head_dim * self.qk_norm
        attn += self.head_dim * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.attention_bias
        attn += h * self.o_proj_bias
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(L):
            mlp = (self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
                   if self.layer_is_moe(i) else 3 * h * self.intermediate_size)
            total += attn + mlp + 2 * h
        return total
