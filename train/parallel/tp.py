"""Baselines: Megatron-style tensor parallelism (TP) and TP with sequence parallelism (TP+SP).

TP: q/k/v and gate/up are column-parallel (heads / intermediate slices per rank), o_proj and
down_proj row-parallel; activations enter a TP region through ``copy_to_tp`` (identity, backward
all-reduce) and leave it through ``reduce_from_tp`` (all-reduce, backward identity). Norms act on
the full, replicated sequence. MoE experts are sliced along the intermediate dim as in TSP; the
router is replicated and its weights enter the TP region through ``copy_to_tp``. The embedding
and LM head are vocab-parallel, and the loss is a vocab-parallel cross-entropy, so no rank ever
materialises full-vocabulary logits. Requires ``num_key_value_heads % D == 0`` (as Megatron).
Qwen3, Qwen2 and Llama: q/k/v biases are column-parallel with their rows, an o_proj bias (Llama with
``attention_bias``) is replicated and added after the reduction, q/k norm only where the family has
it, RoPE with the config's scaling. Built from a full :class:`CausalLM` or, reading only this rank's
slices of a checkpoint, from :class:`train.model.hf_io.CheckpointSlices` (:func:`tp_from_pretrained`).

TP+SP: the same, except that between TP regions the activations are split along the sequence:
``all_gather_seq`` (backward reduce-scatter) replaces ``copy_to_tp`` and ``reduce_scatter_seq``
(backward all-gather) replaces ``reduce_from_tp``; norms (and MoE routers) run on 1/D of the
tokens, so their gradients are SUMmed over the group in :meth:`sync_grads`.

Activations are sequence-first ``[T, B, H]``. The sequence is padded at the end to a multiple of
D (SP); the causal mask hides the padding from real tokens. Padding masks are not supported.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.model.modeling import CausalLM, Router, apply_rope, rope_cos_sin
from train.parallel import comm
from train.parallel.shard import (ShardedLM, StateDictSource, all_reduce_grads, expert_partial, read_expert_slice,
                                  rms_norm, split_range, weight_source)

ZAYA_REFUSAL = ("the TP layout does not run zaya (ZAYA1): CCA's sequence convolutions need each shard's preceding "
                "tokens, which only the TSP layout exchanges; use TSPCausalLM (trainer.tsp) or data parallelism")


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_offset: int) -> torch.Tensor:
    """Per-token cross-entropy [N] from vocab-sharded fp32 logits [N, V_r] (labels [N], global
    ids). The result is replicated on every rank; its gradient reaches only the local shard."""
    m = logits.detach().max(-1).values
    comm.all_reduce_raw(m, group, "all_reduce.ce_max", op=dist.ReduceOp.MAX)
    z = logits - m.unsqueeze(-1)
    sumexp = comm.reduce_from_tp(z.exp().sum(-1), group)
    n = logits.shape[-1]
    inside = (labels >= vocab_offset) & (labels < vocab_offset + n)
    tgt = z.gather(-1, (labels - vocab_offset).clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * inside.to(z.dtype)
    tgt = comm.reduce_from_tp(tgt, group)
    return torch.log(sumexp) - tgt


class TPCausalLM(ShardedLM):
    """The policy sharded over ``group`` in the Megatron TP layout (``sequence_parallel`` for TP+SP).
    ``model``: a full :class:`CausalLM` or a weight source (:class:`train.model.hf_io.CheckpointSlices`:
    only this rank's slices are read, :func:`tp_from_pretrained`), sliced by the same code."""

    def __init__(self, model: CausalLM | StateDictSource, group=None, sequence_parallel: bool = False):
        src = weight_source(model)
        super().__init__(src.config, group)
        cfg, D, r = self.config, self.D, self.rank
        self.sp = sequence_parallel
        if cfg.architecture == "zaya":
            raise ValueError(ZAYA_REFUSAL)
        if cfg.num_attention_heads % D or cfg.num_key_value_heads % D:
            raise ValueError(f"TP needs num_attention_heads ({cfg.num_attention_heads}) and num_key_value_heads "
                             f"({cfg.num_key_value_heads}) divisible by D={D}")
        d = cfg.head_dim
        self.hq, self.kvh = cfg.num_attention_heads // D, cfg.num_key_value_heads // D
        add, read = self._add, src.read
        vo, vn = split_range(cfg.vocab_size, D, r)
        self.vocab_offset = vo
        add("model.embed_tokens.weight", read("model.embed_tokens.weight", slice(vo, vo + vn)), "row")
        if not cfg.tie_word_embeddings:
            add("lm_head.weight", read("lm_head.weight", slice(vo, vo + vn)), "row")
        add("model.norm.weight", read("model.norm.weight"), "rep")
        norms = ("input_layernorm", "post_attention_layernorm") + (("self_attn.q_norm", "self_attn.k_norm")
                                                                   if cfg.qk_norm else ())
        self._routers = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for n in norms:
                add(p + n + ".weight", read(p + n + ".weight"), "rep")
            q = slice(r * self.hq * d, (r + 1) * self.hq * d)
            kv = slice(r * self.kvh * d, (r + 1) * self.kvh * d)
            add(p + "self_attn.q_proj.weight", read(p + "self_attn.q_proj.weight", q), "row")
            add(p + "self_attn.k_proj.weight", read(p + "self_attn.k_proj.weight", kv), "row")
            add(p + "self_attn.v_proj.weight", read(p + "self_attn.v_proj.weight", kv), "row")
            add(p + "self_attn.o_proj.weight", read(p + "self_attn.o_proj.weight", slice(None), q), "col")
            if cfg.attention_bias:  # column-parallel biases go with their rows
                add(p + "self_attn.q_proj.bias", read(p + "self_attn.q_proj.bias", q), "row")
                add(p + "self_attn.k_proj.bias", read(p + "self_attn.k_proj.bias", kv), "row")
                add(p + "self_attn.v_proj.bias", read(p + "self_attn.v_proj.bias", kv), "row")
            if cfg.o_proj_bias:  # the row-parallel o_proj's bias: added once, after the reduction
                add(p + "self_attn.o_proj.bias", read(p + "self_attn.o_proj.bias"), "rep")
            if cfg.layer_is_moe(i):
                add(p + "mlp.gate.weight", read(p + "mlp.gate.weight"), "rep")
                io, isz = split_range(cfg.moe_intermediate_size, D, r)
                gu, dn = read_expert_slice(src, p + "mlp.experts.", io, isz)
                add(p + "mlp.experts.gate_up_proj", gu, "expert_gate_up")
                add(p + "mlp.experts.down_proj", dn, "expert_down")
                router = Router(cfg)
                router.weight = self._p[p + "mlp.gate.weight"]
                self._routers[i] = router
            else:
                io, isz = split_range(cfg.intermediate_size, D, r)
                for n in ("gate_proj", "up_proj"):
                    add(p + f"mlp.{n}.weight", read(p + f"mlp.{n}.weight", slice(io, io + isz)), "row")
                add(p + "mlp.down_proj.weight", read(p + "mlp.down_proj.weight", slice(None), slice(io, io + isz)), "col")

    # regions: enter (replicated or sequence-sharded -> full sequence), leave (partial sums -> back)
    def _enter(self, x):
        return comm.all_gather_seq(x, self.group) if self.sp else comm.copy_to_tp(x, self.group)

    def _leave(self, x):
        return comm.reduce_scatter_seq(x, self.group) if self.sp else comm.reduce_from_tp(x, self.group)

    def _attention(self, i, h, cos, sin):
        cfg, p = self.config, f"model.layers.{i}.self_attn."
        d, eps = cfg.head_dim, cfg.rms_norm_eps
        bias = (lambda n: self._p[p + n + ".bias"]) if cfg.attention_bias else (lambda n: None)  # noqa: E731
        x = self._enter(h)  # [T, B, H]
        T, B, _ = x.shape
        q = F.linear(x, self._p[p + "q_proj.weight"], bias("q_proj")).view(T, B, self.hq, d)
        k = F.linear(x, self._p[p + "k_proj.weight"], bias("k_proj")).view(T, B, self.kvh, d)
        if cfg.qk_norm:
            q, k = rms_norm(q, self._p[p + "q_norm.weight"], eps), rms_norm(k, self._p[p + "k_norm.weight"], eps)
        v = F.linear(x, self._p[p + "v_proj.weight"], bias("v_proj")).view(T, B, self.kvh, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, T, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.hq != self.kvh:
            k, v = k.repeat_interleave(self.hq // self.kvh, 1), v.repeat_interleave(self.hq // self.kvh, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.permute(2, 0, 1, 3).reshape(T, B, self.hq * d)
        out = self._leave(F.linear(o, self._p[p + "o_proj.weight"]))
        return out + self._p[p + "o_proj.bias"] if cfg.o_proj_bias else out

    def _mlp(self, i, h):
        p = f"model.layers.{i}.mlp."
        if i not in self._routers:
            x = self._enter(h)
            y = F.linear(F.silu(F.linear(x, self._p[p + "gate_proj.weight"])) * F.linear(x, self._p[p + "up_proj.weight"]),
                         self._p[p + "down_proj.weight"])
            return self._leave(y)
        Tl, B, H = h.shape
        _, w, idx = self._routers[i](h.reshape(-1, H))
        k = idx.shape[1]
        if self.sp:  # route local tokens, then gather tokens, weights and choices
            x = comm.all_gather_seq(h, self.group)
            w = comm.all_gather_seq(w.view(Tl, B, k), self.group).reshape(-1, k)
            idx = comm.all_gather_raw(idx.view(Tl, B, k), self.group, "all_gather.idx").reshape(-1, k)
        else:
            x, w = comm.copy_to_tp(h, self.group), comm.copy_to_tp(w, self.group)
        T = x.shape[0]
        y = expert_partial(x.reshape(-1, H), w, idx, self._p[p + "experts.gate_up_proj"],
                           self._p[p + "experts.down_proj"])
        return self._leave(y.view(T, B, H))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocab shard of the fp32 logits, [B, T, V_r] (full sequence)."""
        cfg, D = self.config, self.D
        B, T = input_ids.shape
        Tp = -(-T // D) * D if self.sp else T
        ids = F.pad(input_ids, (0, Tp - T)).t()  # [Tp, B]
        emb = self._p["model.embed_tokens.weight"]
        off, n = self.vocab_offset, emb.shape[0]
        with comm.tag("embed"):
            inside = (ids >= off) & (ids < off + n)
            x = F.embedding((ids - off).clamp(0, n - 1), emb) * inside.unsqueeze(-1).to(emb.dtype)
            x = self._leave(x)
        cos, sin = rope_cos_sin(torch.arange(Tp, device=ids.device)[None], cfg.rope_dim, cfg.rope_theta, x.dtype,
                                cfg.rope_scaling)
        dt = x.dtype  # the blocks compute in the weights' dtype; the residual stream may be fp32 (as CausalLM)
        if cfg.fp32_residual:
            x = x.float()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            with comm.tag(f"layer{i}.attn"):
                h = rms_norm(x, self._p[p + "input_layernorm.weight"], cfg.rms_norm_eps).to(dt)
                x = x + self._attention(i, h, cos, sin)
            with comm.tag(f"layer{i}.mlp"):
                x = x + self._mlp(i, rms_norm(x, self._p[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps).to(dt))
        h = rms_norm(x, self._p["model.norm.weight"], cfg.rms_norm_eps)
        head = emb if cfg.tie_word_embeddings else self._p["lm_head.weight"]
        with comm.tag("lm_head"):
            logits = F.linear(self._enter(h).float(), head.float())  # [Tp, B, V_r]
        return logits[:T].transpose(0, 1)

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, V] fp32 logits, replicated (forward only)."""
        from train.parallel.shard import split_sizes

        with torch.no_grad():
            return comm.gather_from_tp(self(input_ids), self.group, split_sizes(self.config.vocab_size, self.D))

    def sft_loss(self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token cross-entropy, mean over counted targets; replicated on every rank."""
        logits = self(input_ids)[:, :-1]
        B, T = input_ids.shape
        target = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.to(torch.bool)
        valid = target[:, 1:]
        with comm.tag("loss"):
            ce = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1),
                                              self.group, self.vocab_offset)
        return (ce * valid.reshape(-1)).sum() / valid.sum().clamp(min=1)

    def sync_grads(self) -> None:
        """SUM over the group the gradients that are partial on each rank: q_norm/k_norm (each rank
        sees its own heads) and, with SP, every replicated parameter (each rank sees its tokens)."""
        names = [n for n, k in self.kinds.items() if k == "rep" and (self.sp or n.endswith(("q_norm.weight",
                                                                                             "k_norm.weight")))]
        all_reduce_grads([self._p[n] for n in names], self.group)


def tp_from_pretrained(path, group=None, sequence_parallel: bool = False, dtype=torch.float32,
                       device="cpu") -> TPCausalLM:
    """This rank's TP (TP+SP) shards of the HF checkpoint at ``path``: only the rank's slices are read."""
    from train.model.hf_io import CheckpointSlices

    with CheckpointSlices(path, dtype=dtype, device=device) as src:
        return TPCausalLM(src, group, sequence_parallel)
