"""Baselines: Megatron-style tensor parallelism (TP) and TP with sequence parallelism (TP+SP).

TP: q/k/v and gate/up are column-parallel (heads / intermediate slices per rank), o_proj and
down_proj row-parallel; activations enter a TP region through ``copy_to_tp`` (identity, backward
all-reduce) and leave it through ``reduce_from_tp`` (all-reduce, backward identity). Norms act on
the full, replicated sequence. MoE experts are sliced along the intermediate dim as in TSP; the
router is replicated and its weights enter the TP region through ``copy_to_tp``. The embedding
and LM head are vocab-parallel, and the loss is a vocab-parallel cross-entropy, so no rank ever
materialises full-vocabulary logits. Requires ``num_key_value_heads % D == 0`` (as Megatron).

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
from train.parallel.shard import ShardedLM, all_reduce_grads, expert_partial, expert_slice, rms_norm, split_range


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
    """The policy sharded over ``group`` in the Megatron TP layout (``sequence_parallel`` for TP+SP)."""

    def __init__(self, model: CausalLM, group=None, sequence_parallel: bool = False):
        super().__init__(model.config, group)
        cfg, D, r = self.config, self.D, self.rank
        self.sp = sequence_parallel
        if cfg.attention_bias:
            raise ValueError("TP baseline does not support attention_bias=True")
        if cfg.architecture != "qwen3" or cfg.rope_scaling:
            raise ValueError(f"TP baseline supports Qwen3 / Qwen3-MoE with plain RoPE only, not {cfg.architecture} / rope_scaling")
        if cfg.num_attention_heads % D or cfg.num_key_value_heads % D:
            raise ValueError(f"TP needs num_attention_heads ({cfg.num_attention_heads}) and num_key_value_heads "
                             f"({cfg.num_key_value_heads}) divisible by D={D}")
        d = cfg.head_dim
        self.hq, self.kvh = cfg.num_attention_heads // D, cfg.num_key_value_heads // D
        full = {k: v.detach() for k, v in model.state_dict().items()}
        vo, vn = split_range(cfg.vocab_size, D, r)
        self.vocab_offset = vo
        self._add("model.embed_tokens.weight", full["model.embed_tokens.weight"][vo:vo + vn], "row")
        if not cfg.tie_word_embeddings:
            self._add("lm_head.weight", full["lm_head.weight"][vo:vo + vn], "row")
        self._add("model.norm.weight", full["model.norm.weight"], "rep")
        self._routers = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
                self._add(p + n + ".weight", full[p + n + ".weight"], "rep")
            q = slice(r * self.hq * d, (r + 1) * self.hq * d)
            kv = slice(r * self.kvh * d, (r + 1) * self.kvh * d)
            self._add(p + "self_attn.q_proj.weight", full[p + "self_attn.q_proj.weight"][q], "row")
            self._add(p + "self_attn.k_proj.weight", full[p + "self_attn.k_proj.weight"][kv], "row")
            self._add(p + "self_attn.v_proj.weight", full[p + "self_attn.v_proj.weight"][kv], "row")
            self._add(p + "self_attn.o_proj.weight", full[p + "self_attn.o_proj.weight"][:, q], "col")
            if cfg.layer_is_moe(i):
                self._add(p + "mlp.gate.weight", full[p + "mlp.gate.weight"], "rep")
                io, isz = split_range(cfg.moe_intermediate_size, D, r)
                gu, dn = expert_slice(full[p + "mlp.experts.gate_up_proj"], full[p + "mlp.experts.down_proj"], io, isz)
                self._add(p + "mlp.experts.gate_up_proj", gu, "expert_gate_up")
                self._add(p + "mlp.experts.down_proj", dn, "expert_down")
                router = Router(cfg)
                router.weight = self._p[p + "mlp.gate.weight"]
                self._routers[i] = router
            else:
                io, isz = split_range(cfg.intermediate_size, D, r)
                for n in ("gate_proj", "up_proj"):
                    self._add(p + f"mlp.{n}.weight", full[p + f"mlp.{n}.weight"][io:io + isz], "row")
                self._add(p + "mlp.down_proj.weight", full[p + "mlp.down_proj.weight"][:, io:io + isz], "col")

    # regions: enter (replicated or sequence-sharded -> full sequence), leave (partial sums -> back)
    def _enter(self, x):
        return comm.all_gather_seq(x, self.group) if self.sp else comm.copy_to_tp(x, self.group)

    def _leave(self, x):
        return comm.reduce_scatter_seq(x, self.group) if self.sp else comm.reduce_from_tp(x, self.group)

    def _attention(self, i, h, cos, sin):
        cfg, p = self.config, f"model.layers.{i}.self_attn."
        d, eps = cfg.head_dim, cfg.rms_norm_eps
        x = self._enter(h)  # [T, B, H]
        T, B, _ = x.shape
        q = rms_norm(F.linear(x, self._p[p + "q_proj.weight"]).view(T, B, self.hq, d), self._p[p + "q_norm.weight"], eps)
        k = rms_norm(F.linear(x, self._p[p + "k_proj.weight"]).view(T, B, self.kvh, d), self._p[p + "k_norm.weight"], eps)
        v = F.linear(x, self._p[p + "v_proj.weight"]).view(T, B, self.kvh, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, T, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.hq != self.kvh:
            k, v = k.repeat_interleave(self.hq // self.kvh, 1), v.repeat_interleave(self.hq // self.kvh, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.permute(2, 0, 1, 3).reshape(T, B, self.hq * d)
        return self._leave(F.linear(o, self._p[p + "o_proj.weight"]))

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
        cos, sin = rope_cos_sin(torch.arange(Tp, device=ids.device)[None], cfg.head_dim, cfg.rope_theta, x.dtype)
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
