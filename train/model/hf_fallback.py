"""The transformers fallback: any causal LM that ``AutoModelForCausalLM`` opens, behind the interface of
Cascade's own :class:`~train.model.modeling.CausalLM`, for training and generation.

Cascade's model (Qwen3, Qwen3-MoE, Qwen2, Llama) is the fast path. Other architectures (GPT-2, Phi,
OLMo, Gemma, ...) load through this wrapper when asked for: ``load_pretrained(path, backend=...)``
or ``CASCADE_MODEL_BACKEND`` = ``transformers`` (always) or ``auto`` (Cascade's model where the
config is supported, this wrapper otherwise). The wrapper gives what the trainer and the torch
engine call: ``forward`` / ``hidden_states`` / ``logits`` / ``last_logits``, ``lm_head``, ``config``
(``pad_token_id``, ``eos_token_id``, ``max_position_embeddings``, ``vocab_size``, ``is_moe``),
``device`` / ``dtype``, and a KV cache the engine allocates (:meth:`TransformersCausalLM.allocate_cache`).

Limits, as documented in the README: slower (transformers' modules, no fused CPU decode, packed
sequences run as a right-padded batch), dense models only (no router replay), no tensor/sequence
parallel sharding (``train.parallel.tsp`` / ``tp``), no shared-prefix KV cache, and the LM head must be
a plain linear layer (no bias, no logit scaling or soft-capping: checked when the model is wrapped),
because the trainer computes log-probs from the final hidden states and ``lm_head.weight`` itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.model.modeling import running_positions

BACKENDS = ("cascade", "transformers", "auto")


@dataclass
class TransformersConfig:
    """The fields of :class:`~train.model.config.ModelConfig` that the trainer and engine read, taken
    from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: Any = None
    eos_token_id: Any = None
    pad_token_id: Any = None
    n_params: int = 0
    hf_dict: dict = field(default_factory=dict, repr=False)
    generation_config: dict | None = field(default=None, compare=False, repr=False)
    is_moe: bool = False
    architecture: str = "transformers"
    rope_scaling: None = None
    fp32_residual: bool = False
    qk_norm: bool = False
    attention_bias: bool = False

    @classmethod
    def of(cls, hf_model) -> "TransformersConfig":
        c = hf_model.config
        t = c.get_text_config() if hasattr(c, "get_text_config") else c

        def first(*names, default=None):
            for n in names:
                v = getattr(t, n, None)
                if v is not None:
                    return v
            return default

        return cls(model_type=c.model_type, vocab_size=int(first("vocab_size")),
                   hidden_size=int(first("hidden_size", "n_embd", "d_model", default=0)),
                   num_hidden_layers=int(first("num_hidden_layers", "n_layer", "num_layers", default=0)),
                   max_position_embeddings=int(first("max_position_embeddings", "n_positions", "n_ctx",
                                                     "max_sequence_length", "seq_length", default=2048)),
                   tie_word_embeddings=bool(first("tie_word_embeddings", default=False)),
                   bos_token_id=first("bos_token_id"), eos_token_id=first("eos_token_id"),
                   pad_token_id=first("pad_token_id"),
                   n_params=sum(p.numel() for p in {id(p): p for p in hf_model.parameters()}.values()),
                   hf_dict=c.to_dict())

    def num_parameters(self) -> int:
        return self.n_params

    def layer_is_moe(self, i: int) -> bool:
        return False

    def to_hf(self) -> dict[str, Any]:
        return dict(self.hf_dict)


@dataclass
class TransformersCache:
    """The engine's KV cache for a wrapped model: transformers' own cache object (``past``, made by the
    model on the first call) plus what the engine reads and keeps: ``valid`` [B, capacity] (slots
    holding real tokens), ``length`` (the shared write position) and ``select`` (keep or repeat rows)."""

    valid: torch.Tensor
    length: int = 0
    past: Any = None

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor) -> "TransformersCache":
        past = self.past
        if past is not None:
            import copy

            past = copy.copy(past)
            if hasattr(past, "layers"):  # transformers >= 4.56: per-layer cache objects
                past.layers = [copy.copy(layer) for layer in past.layers]
                for layer in past.layers:
                    layer.batch_select_indices(rows)
            else:
                past.batch_select_indices(rows)
        return TransformersCache(self.valid.index_select(0, rows), self.length, past)

    keep = select  # dropping finished rows: transformers' caches select in place their own way


class TransformersCausalLM(nn.Module):
    """A transformers causal LM with :class:`~train.model.modeling.CausalLM`'s interface. ``state_dict`` /
    ``load_state_dict`` use the transformers names (what its checkpoints hold)."""

    is_transformers_fallback = True

    def __init__(self, hf_model: nn.Module, check_head: bool = True):
        super().__init__()
        self.hf = hf_model
        self.config = TransformersConfig.of(hf_model)
        self._checkpointing = False
        _no_dropout(hf_model)
        if check_head:
            self._check_plain_head()

    # -- the CausalLM interface -------------------------------------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def state_dict(self, *args, **kwargs):
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)

    def _backbone(self, **kw):
        return self.hf.base_model(**kw)

    @property
    def _cache_arg(self) -> str:
        """The keyword of the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
        import inspect

        return "cache" if "cache" in inspect.signature(self.hf.base_model.forward).parameters else "past_key_values"

    def _set_checkpointing(self, on: bool) -> None:
        if on != self._checkpointing:
            new = hasattr(self.hf, "activation_checkpointing_enable")  # the name from transformers 5.x on
            if on:
                if new:
                    self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                (self.hf.activation_checkpointing_disable if new else self.hf.gradient_checkpointing_disable)()
            self._checkpointing = on

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, cache: TransformersCache | None = None,
                      routed_experts=None, record_routing: list | None = None, cu_seqlens=None,
                      checkpoint_layers: bool = False):
        """Final hidden states [B, T, H] (after the final norm), as ``CausalLM.hidden_states``: padding
        anywhere via ``attention_mask`` (rotary/learned positions count real tokens only), packed rows via
        ``cu_seqlens`` (run as a right-padded batch, one row per sequence), ``cache`` for generation."""
        if routed_experts is not None or record_routing is not None:
            raise ValueError("router replay needs an MoE model in Cascade's own implementation")
        self._set_checkpointing(bool(checkpoint_layers) and torch.is_grad_enabled())
        B, T = input_ids.shape
        dev = input_ids.device
        if cu_seqlens is not None:
            if B != 1 or cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens (packed sequences) takes one row [1, N] without attention_mask or cache")
            b = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
            if len(b) < 2 or b[0] != 0 or b[-1] != T or any(e <= s for s, e in zip(b, b[1:])):
                raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {T}; got {b[:8]}...")
            lens = [e - s for s, e in zip(b, b[1:])]
            L = max(lens)
            rows = torch.zeros(len(lens), L, dtype=input_ids.dtype, device=dev)
            mask = torch.zeros(len(lens), L, dtype=torch.bool, device=dev)
            for j, (s, n) in enumerate(zip(b, lens)):
                rows[j, :n] = input_ids[0, s:s + n]
                mask[j, :n] = True
            h = self.hidden_states(rows, mask if len(set(lens)) > 1 else None, checkpoint_layers=checkpoint_layers)
            return h[mask][None]
        if cache is not None:
            start = cache.length
            if start + T > cache.capacity:
                raise ValueError(f"KV cache overflow: {start + T} > {cache.capacity}")
            cache.valid[:, start:start + T] = True if attention_mask is None else attention_mask.to(torch.bool)
            am = cache.valid[:, :start + T]
            if position_ids is None:
                position_ids = running_positions(am)[:, start:]
            out = self._backbone(input_ids=input_ids, attention_mask=am.long(), position_ids=position_ids,
                                 use_cache=True, **{self._cache_arg: cache.past})
            cache.past = out["cache"] if "cache" in out else out["past_key_values"]
            cache.length = start + T
            return out.last_hidden_state
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
            if position_ids is None:
                position_ids = running_positions(attention_mask)
            if bool(attention_mask.all()):
                attention_mask = None
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).expand(B, T)
        out = self._backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             attention_mask=None if attention_mask is None else attention_mask.long())
        return out.last_hidden_state

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from hidden states (LM head in fp32)."""
        return F.linear(h.float(), self.lm_head.weight.float())

    def last_logits(self, input_ids, attention_mask=None, cache: TransformersCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, attention_mask, cache=cache)[:, -1])

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, routed_experts=None,
                record_routing=None, cu_seqlens=None, checkpoint_layers: bool = False):
        return self.logits(self.hidden_states(input_ids, attention_mask, position_ids, cache, routed_experts,
                                              record_routing, cu_seqlens, checkpoint_layers))

    def allocate_cache(self, batch: int, max_len: int, device, dtype) -> TransformersCache:
        """What the torch engine prefills into (``KVCache.allocate`` for Cascade's own model)."""
        return TransformersCache(torch.zeros(batch, max_len, dtype=torch.bool, device=device))

    # -- checks ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _check_plain_head(self) -> None:
        """The trainer's log-probs use ``hidden_states`` and ``lm_head.weight``; refuse a model whose own
        logits are not that product (an LM-head bias, logit scaling or soft-capping)."""
        head = self.lm_head
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{self.config.model_type}: the transformers fallback needs an LM head without bias")
        hc = self.hf.config
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            v = getattr(hc, key, None)  # refused from the config: at a fresh init the values cannot tell
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1):
                raise ValueError(f"{self.config.model_type}: its logits are transformed ({key}={v}); the "
                                 "transformers fallback cannot train it")
        ids = torch.arange(1, 5, device=self.device)[None] % self.config.vocab_size
        was = self.hf.training
        self.hf.eval()
        try:
            ref = self.hf(input_ids=ids, use_cache=False).logits.float()
            got = self.logits(self.hidden_states(ids))
        finally:
            self.hf.train(was)
        tol = max(1e-3, 2 * torch.finfo(self.hf.dtype).eps)  # a bf16 model's own logits are rounded to bf16
        if not torch.allclose(got, ref, rtol=tol, atol=tol * max(1.0, ref.abs().max().item())):
            raise ValueError(f"{self.config.model_type}: its logits are not hidden_states @ lm_head.weight (logit "
                             "scaling or soft-capping); the transformers fallback cannot train it")


def _no_dropout(model: nn.Module) -> None:
    """Dropout off for good (GPT-2 ships 0.1): the trainer's log-probs must be the behaviour policy's, and
    ``train()`` (which gradient checkpointing needs) would turn it on."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for key in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(m, key, None), float):
                setattr(m, key, 0.0)  # the modules only: the checkpoint's config.json keeps its values


def load_transformers(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> TransformersCausalLM:
    """A checkpoint directory opened with ``AutoModelForCausalLM`` and wrapped (the fallback)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=None).to(device)
    wrapped = TransformersCausalLM(model.eval())
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        wrapped.config.generation_config = json.loads(gen.read_text())
    return wrapped


def load_weights_into(model: TransformersCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Strict copy of transformers-named weights (a tied LM head may be absent)."""
    from train.model.hf_io import CheckpointError

    expected = model.hf.state_dict()
    tied = {k for k in expected if k not in sd and any(expected[k] is v or (expected[k].data_ptr() == v.data_ptr())
                                                        for n, v in expected.items() if n != k and n in sd)}
    missing = sorted(set(expected) - set(sd) - tied)
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        raise CheckpointError(f"weights do not match the model: missing {missing[:8]}, unexpected {extra[:8]}")
    bad = [k for k in sd if tuple(sd[k].shape) != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"shape mismatch for {bad[0]}: {tuple(sd[bad[0]].shape)} vs {tuple(expected[bad[0]].shape)}")
    with torch.no_grad():
        for k, v in sd.items():
            expected[k].copy_(v)
