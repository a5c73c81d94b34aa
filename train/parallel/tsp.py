"""TSP: tensor and sequence parallelism folded onto one device axis of size D.

Each rank holds 1/D of every layer's weights and 1/D of the tokens.

Tokens: zigzag partition. The sequence (padded at the END to a multiple of 2D; the padding sits
after every real token, so the causal mask already hides it from real queries and its outputs are
dropped) is cut into 2D chunks of c tokens; rank r holds chunks r and 2D-1-r. Positions stay
global (RoPE, causal mask), so a rank's early chunk attends to few keys and its late chunk to
many: every rank does the same attention work, c^2 (2D+1) query-key pairs per head.

Packed rows (``cu_seqlens``, as :meth:`CausalLM.hidden_states`): one row [1, T] holding several
sequences back to back is partitioned the same way; positions restart per sequence and a query
attends only to earlier keys of its own sequence (each chunk's keys start at the first key of its
first query's sequence, so a chunk pays for at most its own length beyond the real query-key pairs).

Weights:
* Attention: query heads in D groups (``num_attention_heads % D == 0``); rank j owns group j's
  q_proj rows and o_proj columns. KV heads: with ``num_key_value_heads >= D`` (a multiple of
  D) rank j owns its group's kv heads; with fewer (D a multiple of them) kv head h is owned by
  the first rank whose group uses it, and the other groups receive it from that owner.
  For each group j the bundles are broadcast (:func:`comm.broadcast_apply`), every rank projects
  its own tokens, K/V are all-gathered along the sequence (zigzag order restored to global
  order), local queries attend, and the matching o_proj shard's output is accumulated locally.
  Families: Qwen3 (q/k RMSNorm), Qwen2 and Llama (no q/k norm). With ``attention_bias`` the q/k/v
  biases are sharded with their rows and travel in the same bundles (a kv head broadcast to other
  groups carries its bias); an o_proj bias (Llama) is replicated and added once to each local
  token's summed output. RoPE uses the config's scaling (``linear``, ``llama3``) at global positions.
* Dense MLP: rank j owns a slice of the intermediate dim (gate/up rows, down columns); the
  slices travel around a ring (:func:`comm.ring_apply`) and partial outputs are summed locally.
* MoE experts: sliced the same way - rank j owns a slice of EVERY expert's intermediate dim (not
  whole experts). Routing is decided locally for local tokens, every rank runs every expert on
  its own tokens, the load is balanced whatever the router does, and no token all-to-all is
  needed; the grouped GEMMs keep their shape with intermediate I/D.
* Embedding and LM head: vocab-sharded (rows), also circulated on the ring; the LM head ring
  concatenates the shards' logits so each rank gets full-vocabulary fp32 logits for its tokens
  (:meth:`TSPCausalLM.forward`). The log-probs of the loss (:meth:`TSPCausalLM.token_logprobs`)
  never make them: each shard arriving on the ring gives, chunk of rows by chunk of rows, its own
  log-sum-exp, target logit and softmax-weighted mean logit (:func:`train.rl.packing.logit_stats`; backward
  recomputes each chunk), and those combine exactly into log-probs and entropies, so no rank holds
  more than [chunk, V/D] fp32 logits at once. Tied embeddings use the same shard for both.
* Replicated (small): RMSNorm weights (input/post-attention/final, q_norm, k_norm), o_proj biases
  and MoE routers. Each rank's gradient covers only its tokens, so :meth:`TSPCausalLM.sync_grads`
  all-reduces them with SUM.

Loading: the constructor reads every shard from a weight source - a full :class:`CausalLM` (its
state dict, sliced) or :class:`train.model.hf_io.CheckpointSlices`, which reads only this rank's
slices from the safetensors files (:func:`tsp_from_pretrained`); the slicing code is the same.
zaya is refused (:data:`ZAYA_REFUSAL`; its data-parallel training runs on the unsharded model), and so
is a transformers-fallback model.

The loss is partitioned: each rank's loss covers its own tokens, normalised by the GLOBAL count,
so the ranks' losses sum to the single-process loss and every backward collective matches.
Weight-streaming functions save only their inputs and recompute per-shard partials in backward
(the shards are streamed again), so no rank ever holds more than two shards of a layer at once.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.model.config import ModelConfig
from train.model.modeling import CausalLM, Router, apply_rope, rope_cos_sin, running_positions
from train.parallel import comm
from train.parallel.shard import (ShardedLM, StateDictSource, all_reduce_grads, expert_partial, read_expert_slice,
                                  rms_norm, split_range, split_sizes, weight_source)
from train.rl.packing import default_chunk, logit_stats


ZAYA_REFUSAL = ("the sharded core does not run zaya (ZAYA1) sharded by tensor or sequence: CCA's sequence "
                "convolutions need each shard's preceding tokens; use trainer.tsp=1 (data-parallel ranks) or one process")


def zigzag_index(T: int, D: int, r: int) -> tuple[int, torch.Tensor]:
    """(padded length, global slots held by rank r): chunks r and 2D-1-r of size ceil(T/2D)."""
    c = -(-T // (2 * D))
    a, b = r, 2 * D - 1 - r
    return 2 * D * c, torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def packed_segment_starts(cu_seqlens, T: int, Tp: int, B: int, attention_mask, device) -> torch.Tensor:
    """[Tp] long: the first slot of each slot's sequence for a packed row with boundaries ``cu_seqlens``
    (0, ..., T); the padding slots T..Tp-1 form one more sequence."""
    cu = [int(c) for c in cu_seqlens]
    if B != 1 or attention_mask is not None:
        raise ValueError(f"a packed row (cu_seqlens) is one row [1, T] without an attention mask, got {B} rows"
                         + (" and a mask" if attention_mask is not None else ""))
    if not cu or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the row's length {T}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    bounds = torch.tensor(cu + [Tp], dtype=torch.long, device=device)
    return torch.repeat_interleave(bounds[:-1], bounds[1:] - bounds[:-1], output_size=Tp)


def check_tsp_config(cfg: ModelConfig, D: int) -> None:
    """One-line errors for a policy that TSP degree ``D`` cannot shard (D = 1: plain data parallelism,
    which runs any Cascade architecture, zaya included)."""
    if cfg.architecture == "zaya" and D > 1:
        raise ValueError(ZAYA_REFUSAL)
    if cfg.num_attention_heads % D:
        raise ValueError(f"TSP needs num_attention_heads ({cfg.num_attention_heads}) divisible by D={D}")
    kv = cfg.num_key_value_heads
    if kv % D and D % kv:
        raise ValueError(f"TSP needs num_key_value_heads ({kv}) to be a multiple or a divisor of D={D}")


class TSPCausalLM(ShardedLM):
    """The policy sharded over ``group`` (size D) in the TSP layout. ``model`` is a full
    :class:`CausalLM` (only this rank's slices of its weights are copied) or a weight source such as
    :class:`train.model.hf_io.CheckpointSlices` (only this rank's slices are read from the checkpoint:
    :func:`tsp_from_pretrained`); the slicing is the same code either way.

    ``dp_group`` (optional) is the data-parallel axis of a 2D mesh: :meth:`sync_grads` also
    sums gradients over it and divides by its size."""

    def __init__(self, model: CausalLM | StateDictSource, group=None, dp_group=None):
        src = weight_source(model)
        super().__init__(src.config, group, dp_group)
        cfg, D, r = self.config, self.D, self.rank
        if cfg.architecture == "zaya":
            raise ValueError(ZAYA_REFUSAL)
        check_tsp_config(cfg, D)
        d = cfg.head_dim
        self.hq = cfg.num_attention_heads // D
        self.kvh = max(cfg.num_key_value_heads // D, 1)
        add, read = self._add, src.read

        V = cfg.vocab_size
        vo, vn = split_range(V, D, r)
        add("model.embed_tokens.weight", read("model.embed_tokens.weight", slice(vo, vo + vn)), "row")
        if not cfg.tie_word_embeddings:
            add("lm_head.weight", read("lm_head.weight", slice(vo, vo + vn)), "row")
        add("model.norm.weight", read("model.norm.weight"), "rep")
        norms = ("input_layernorm", "post_attention_layernorm") + (("self_attn.q_norm", "self_attn.k_norm")
                                                                   if cfg.qk_norm else ())
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for n in norms:
                add(p + n + ".weight", read(p + n + ".weight"), "rep")
            rows = slice(r * self.hq * d, (r + 1) * self.hq * d)
            kv = self._own_kv_heads(r)
            kv_rows = slice(kv[0] * d, kv[1] * d)
            add(p + "self_attn.q_proj.weight", read(p + "self_attn.q_proj.weight", rows), "row")
            add(p + "self_attn.o_proj.weight", read(p + "self_attn.o_proj.weight", slice(None), rows), "col")
            add(p + "self_attn.k_proj.weight", read(p + "self_attn.k_proj.weight", kv_rows), "row")
            add(p + "self_attn.v_proj.weight", read(p + "self_attn.v_proj.weight", kv_rows), "row")
            if cfg.attention_bias:  # q/k/v biases go with their rows (a broadcast kv head carries its bias)
                add(p + "self_attn.q_proj.bias", read(p + "self_attn.q_proj.bias", rows), "row")
                add(p + "self_attn.k_proj.bias", read(p + "self_attn.k_proj.bias", kv_rows), "row")
                add(p + "self_attn.v_proj.bias", read(p + "self_attn.v_proj.bias", kv_rows), "row")
            if cfg.o_proj_bias:  # added once to each local token's attention output
                add(p + "self_attn.o_proj.bias", read(p + "self_attn.o_proj.bias"), "rep")
            if cfg.layer_is_moe(i):
                add(p + "mlp.gate.weight", read(p + "mlp.gate.weight"), "rep")
                io, isz = split_range(cfg.moe_intermediate_size, D, r)
                gu, dn = read_expert_slice(src, p + "mlp.experts.", io, isz)
                add(p + "mlp.experts.gate_up_proj", gu, "expert_gate_up")
                add(p + "mlp.experts.down_proj", dn, "expert_down")
            else:
                io, isz = split_range(cfg.intermediate_size, D, r)
                for n in ("gate_proj", "up_proj"):
                    add(p + f"mlp.{n}.weight", read(p + f"mlp.{n}.weight", slice(io, io + isz)), "row")
                add(p + "mlp.down_proj.weight", read(p + "mlp.down_proj.weight", slice(None), slice(io, io + isz)), "col")
        self._routers = {}
        for i in range(cfg.num_hidden_layers):
            if cfg.layer_is_moe(i):
                router = Router(cfg)
                router.weight = self._p[f"model.layers.{i}.mlp.gate.weight"]
                self._routers[i] = router

    # ---------------------------------------------------------------------------- layout
    def _kv_owner(self, j: int) -> int:
        """Rank that owns (and broadcasts) the kv heads used by query group j."""
        kv = self.config.num_key_value_heads
        return j if kv >= self.D else (j // (self.D // kv)) * (self.D // kv)

    def _own_kv_heads(self, r: int) -> tuple[int, int]:
        kv = self.config.num_key_value_heads
        if kv >= self.D:
            return r * self.kvh, (r + 1) * self.kvh
        if self._kv_owner(r) != r:
            return 0, 0
        h = r // (self.D // kv)
        return h, h + 1

    def local_slots(self, T: int) -> torch.Tensor:
        """Global positions of this rank's tokens for a length-T sequence (values >= T are padding)."""
        return zigzag_index(T, self.D, self.rank)[1]

    # ---------------------------------------------------------------------------- forward
    def _vocab_shapes(self, j: int) -> list[tuple]:
        return [(split_sizes(self.config.vocab_size, self.D)[j], self.config.hidden_size)]

    def _embed_fn(self, ids, j, w):
        off, n = split_range(self.config.vocab_size, self.D, j)
        inside = (ids >= off) & (ids < off + n)
        return F.embedding((ids - off).clamp(0, n - 1), w) * inside.unsqueeze(-1).to(w.dtype)

    @staticmethod
    def _head_fn(h, j, w):
        return F.linear(h.float(), w.float())

    def _mlp_shapes(self, j: int) -> list[tuple]:
        H, n = self.config.hidden_size, split_sizes(self.config.intermediate_size, self.D)[j]
        return [(n, H), (n, H), (H, n)]

    @staticmethod
    def _mlp_fn(x, j, g, u, dn):
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), dn)

    def _expert_shapes(self, j: int) -> list[tuple]:
        c = self.config
        n = split_sizes(c.moe_intermediate_size, self.D)[j]
        return [(c.num_experts, 2 * n, c.hidden_size), (c.num_experts, c.hidden_size, n)]

    @staticmethod
    def _expert_fn(x, w, idx, j, gu, dn):
        return expert_partial(x, w, idx, gu, dn)

    def _attn_fn(self, spans, x, cos, sin, qn, kn, key_valid, seg_start, q_slots, order, *w):
        """One query-head group: project local tokens, gather K/V, attend, project out. ``w``: the
        group's q_proj (+ bias) and o_proj, then its k_proj (+ bias) and v_proj (+ bias).
        ``seg_start`` [Tp] (packed rows): the first slot of each slot's sequence. ``spans``: per zigzag
        chunk the (first, last + 1) key slot its queries can see, known on the host (no device reads)."""
        cfg, B, n = self.config, x.shape[0], x.shape[1]
        d, hq, kvh = cfg.head_dim, self.hq, self.kvh
        eps = cfg.rms_norm_eps
        if cfg.attention_bias:
            wq, bq, wo, wk, bk, wv, bv = w
        else:
            (wq, wo, wk, wv), bq = w, None
            bk = bv = None
        q = F.linear(x, wq, bq).view(B, n, hq, d)
        k = F.linear(x, wk, bk).view(B, n, kvh, d)
        if qn is not None:
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = F.linear(x, wv, bv).view(B, n, kvh, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # [n, 2, B, kvh, d]
        full = comm.all_gather_seq(kv, self.group)[order]  # global slot order
        K, Vv = full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)  # [B, kvh, Tp, d]
        if hq != kvh:
            K, Vv = K.repeat_interleave(hq // kvh, 1), Vv.repeat_interleave(hq // kvh, 1)
        c = n // 2
        outs = []
        for half in range(2):
            qs = q_slots[half * c:(half + 1) * c]
            begin, end = spans[half]
            ks = torch.arange(begin, end, device=x.device)
            m = (ks[None, :] <= qs[:, None])[None]
            if key_valid is not None:
                m = m & key_valid[:, None, begin:end]
            if seg_start is not None:  # no attention across sequences
                m = m & (ks[None, :] >= seg_start[qs][:, None])[None]
            m = (m | (ks[None, :] == qs[:, None])[None])[:, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, half * c:(half + 1) * c], K[:, :, begin:end],
                                                       Vv[:, :, begin:end], attn_mask=m))
        o = torch.cat(outs, 2).transpose(1, 2).reshape(B, n, hq * d)
        return F.linear(o, wo)

    def _attention(self, i, x, cos, sin, key_valid, seg_start, q_slots, order, spans):
        cfg, p, r = self.config, f"model.layers.{i}.self_attn.", self.rank
        d, H, bias = cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        qo_shapes = [(self.hq * d, H)] + [(self.hq * d,)] * bias + [(H, self.hq * d)]
        kv_shapes = [(self.kvh * d, H)] + [(self.kvh * d,)] * bias
        kv_shapes = kv_shapes * 2
        qo_names = ["q_proj.weight"] + ["q_proj.bias"] * bias + ["o_proj.weight"]
        kv_names = ["k_proj.weight"] + ["k_proj.bias"] * bias + ["v_proj.weight"] + ["v_proj.bias"] * bias
        qn, kn = (self._p[p + "q_norm.weight"], self._p[p + "k_norm.weight"]) if cfg.qk_norm else (None, None)
        out = None
        for j in range(self.D):
            src = self._kv_owner(j)
            bundles = [(j, qo_shapes, [self._p[p + n] for n in qo_names] if r == j else []),
                       (src, kv_shapes, [self._p[p + n] for n in kv_names] if r == src else [])]
            y = comm.broadcast_apply(functools.partial(self._attn_fn, spans),
                                     (x, cos, sin, qn, kn, key_valid, seg_start, q_slots, order), bundles,
                                     self.group)
            out = y if out is None else out + y
        if cfg.o_proj_bias:
            out = out + self._p[p + "o_proj.bias"]
        return out

    def _mlp(self, i, x, replay):
        p = f"model.layers.{i}.mlp."
        if i not in self._routers:
            own = [self._p[p + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj")]
            return comm.ring_apply(self._mlp_fn, (x,), own, self.group, self._mlp_shapes)
        B, n, H = x.shape
        flat = x.reshape(-1, H)
        _, w, idx = self._routers[i](flat, replay)
        own = [self._p[p + "experts.gate_up_proj"], self._p[p + "experts.down_proj"]]
        y = comm.ring_apply(self._expert_fn, (flat, w, idx), own, self.group, self._expert_shapes)
        return y.view(B, n, H)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      routed_experts: list[torch.Tensor] | None = None, cu_seqlens=None) -> torch.Tensor:
        """The final-norm hidden states [B, n_local, H] of this rank's tokens (see :meth:`forward`)."""
        cfg, D = self.config, self.D
        B, T = input_ids.shape
        Tp, host_slots = zigzag_index(T, D, self.rank)
        dev = input_ids.device
        slots = host_slots.to(dev)
        ids = F.pad(input_ids, (0, Tp - T))
        seg_start = host_starts = None
        if cu_seqlens is not None:
            host_starts = packed_segment_starts(cu_seqlens, T, Tp, B, attention_mask, "cpu")
            seg_start = host_starts.to(dev)
            key_valid, pos = None, (torch.arange(Tp, device=dev) - seg_start)[None]
        elif attention_mask is not None:
            key_valid = F.pad(attention_mask.to(torch.bool), (0, Tp - T))
            pos = running_positions(key_valid)
            if bool(attention_mask.all()):
                key_valid = None
        else:
            key_valid, pos = None, torch.arange(Tp, device=dev).expand(B, Tp)
        # per zigzag chunk, the key slots its queries can see: up to its last slot (later keys are all in
        # the future), from the first query's sequence start in a packed row (slots ascend within a chunk)
        c = len(host_slots) // 2
        spans = tuple((0 if host_starts is None else int(host_starts[host_slots[h * c]]),
                       int(host_slots[(h + 1) * c - 1]) + 1) for h in range(2))
        order = torch.argsort(torch.cat([zigzag_index(T, D, j)[1] for j in range(D)])).to(dev)
        embed = self._p["model.embed_tokens.weight"]
        with comm.tag("embed"):
            x = comm.ring_apply(self._embed_fn, (ids[:, slots],), [embed], self.group, self._vocab_shapes)
        cos, sin = rope_cos_sin(pos[:, slots], cfg.rope_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
        dt = x.dtype  # the blocks compute in the weights' dtype; the residual stream may be fp32
        if cfg.fp32_residual:  # as CausalLM: embedding output and residual additions in fp32
            x = x.float()
        moe_i = 0
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            with comm.tag(f"layer{i}.attn"):
                h = rms_norm(x, self._p[p + "input_layernorm.weight"], cfg.rms_norm_eps).to(dt)
                x = x + self._attention(i, h, cos, sin, key_valid, seg_start, slots, order, spans)
            with comm.tag(f"layer{i}.mlp"):
                h = rms_norm(x, self._p[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps).to(dt)
                replay = None
                if i in self._routers and routed_experts is not None:
                    full = F.pad(routed_experts[moe_i], (0, 0, 0, Tp - T))
                    replay = full[:, slots].reshape(B * len(slots), -1)
                moe_i += int(i in self._routers)
                x = x + self._mlp(i, h, replay)
        return rms_norm(x, self._p["model.norm.weight"], cfg.rms_norm_eps)

    def _head(self) -> torch.Tensor:
        return self._p["model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                routed_experts: list[torch.Tensor] | None = None, cu_seqlens=None) -> torch.Tensor:
        """fp32 logits [B, n_local, V] of this rank's tokens (global slots: :meth:`local_slots`).

        ``input_ids`` [B, T] and ``attention_mask`` [B, T] (1 = real token; padding anywhere) are
        the FULL batch, identical on every rank of the group; ``routed_experts`` (per MoE layer,
        [B, T, k]) replays the expert choice. ``cu_seqlens`` (0, end of sequence 1, ..., T): one
        packed row (B = 1, no attention mask) of sequences back to back, positions restarting per
        sequence and no attention across them."""
        h = self.hidden_states(input_ids, attention_mask, routed_experts, cu_seqlens)
        with comm.tag("lm_head"):
            return comm.ring_apply(self._head_fn, (h,), [self._head()], self.group, self._vocab_shapes, concat=True)

    # ---------------------------------------------------------------------------- losses
    def token_logprobs(self, input_ids, attention_mask=None, temperature: float = 1.0, routed_experts=None,
                       return_entropy: bool = False, cu_seqlens=None, chunk_tokens: int | None = None,
                       scored: torch.Tensor | None = None):
        """Per-token log-probabilities for the RL loss, partitioned like the tokens.

        Returns ``(logp [B, n_local], slots [n_local])``: ``logp[:, i]`` is log p(input_ids[:, s+1]
        | input_ids[:, :s+1]) for the global slot ``s = slots[i]`` - the same value as
        ``modeling.token_logprobs(...)[:, s]``. Entries with ``s >= T-1`` are zeros (no next token).
        A loss built from these must sum over this rank's tokens only, with GLOBAL normalisers, and
        :meth:`sync_grads` after backward. With ``return_entropy`` a third item holds the entropy
        of each local position's distribution [B, n_local] (no gradient). ``cu_seqlens``: a packed
        row (see :meth:`forward`); the value at a sequence's last token (whose next token starts the
        following sequence) means nothing and must be masked by the loss. ``chunk_tokens``: rows of
        LM-head logits at a time (default: about 16M fp32 logits per chunk of a vocab shard).
        ``scored`` [B, T] (bool): the positions whose log-probs are wanted (an RL batch's completion
        positions); the LM head runs on this rank's scored positions only, the others are zeros."""
        B, T = input_ids.shape
        h = self.hidden_states(input_ids, attention_mask, routed_experts, cu_seqlens)
        slots = self.local_slots(T).to(input_ids.device)
        nxt = F.pad(input_ids, (0, len(slots) * self.D - T + 1))[:, slots + 1]
        H, n = h.shape[-1], h.shape[0] * h.shape[1]
        h, nxt = h.reshape(n, H), nxt.reshape(n)
        want = (slots < T).expand(B, -1)
        if scored is not None:
            want = want & F.pad(scored.to(torch.bool), (0, len(slots) * self.D - T))[:, slots]
        sel = want.reshape(n).nonzero().squeeze(1)  # this rank's rows for the LM head
        temperature = float(temperature) if temperature else 1.0
        chunk = int(chunk_tokens) if chunk_tokens else default_chunk(max(split_sizes(self.config.vocab_size, self.D)))
        with comm.tag("lm_head"):  # per shard j: [rows, D, 3] with (lse_j, target logit, mean logit) at j
            stats = comm.ring_apply(functools.partial(self._head_stats_fn, temperature, chunk, return_entropy),
                                    (h.index_select(0, sel), nxt.index_select(0, sel)), [self._head()], self.group,
                                    self._vocab_shapes)
        lse_j, tgt_j, mean_j = stats.unbind(-1)
        lse = torch.logsumexp(lse_j, dim=-1)
        logp = torch.zeros(n, dtype=lse.dtype, device=lse.device).index_copy(0, sel, tgt_j.sum(-1) - lse).view(B, -1)
        logp = logp * (slots < T - 1).to(logp.dtype)
        if return_entropy:
            with torch.no_grad():  # H = lse - sum_v p_v z_v, the sum taken shard by shard
                ent = lse - (torch.exp(lse_j - lse[:, None]) * mean_j).sum(-1)
                ent = torch.zeros(n, dtype=ent.dtype, device=ent.device).index_copy(0, sel, ent).view(B, -1)
            return logp, slots, ent
        return logp, slots

    def _head_stats_fn(self, temperature, chunk, want_mean, h, targets, j, w):
        off = split_range(self.config.vocab_size, self.D, j)[0]
        lse, tgt, mean = logit_stats(h, w, targets, off, temperature, chunk, want_mean)
        if not want_mean:
            mean = torch.zeros_like(lse)
        out = torch.zeros(h.shape[0], self.D, 3, dtype=torch.float32, device=h.device)
        return out.index_copy(1, torch.tensor([j], device=h.device), torch.stack([lse, tgt, mean], -1)[:, None])

    def sft_loss(self, input_ids, loss_mask=None, attention_mask=None):
        """Next-token cross-entropy, mean over the GLOBAL number of predicted tokens.

        ``loss_mask`` [B, T] marks the target tokens that count (default: all but the first).
        Returns this rank's part (the parts sum to the full loss; backward this one)."""
        B, T = input_ids.shape
        target = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.to(torch.bool)
        if attention_mask is not None:
            target = target & attention_mask.to(torch.bool)
        target = target.clone()
        target[:, 0] = False
        count = target.sum().clamp(min=1)
        logp, slots = self.token_logprobs(input_ids, attention_mask)
        valid = F.pad(target, (0, len(slots) * self.D - T + 1))[:, slots + 1]
        return -(logp * valid).sum() / count

    def sync_grads(self) -> None:
        """After backward: SUM the replicated parameters' gradients over the TSP group; then, on a
        2D mesh, SUM every gradient over the data-parallel group and divide by its size."""
        all_reduce_grads(self.replicated_parameters(), self.group)
        if self.dp_group is not None:
            all_reduce_grads(list(self._p.values()), self.dp_group, dist.get_world_size(self.dp_group))

    # ---------------------------------------------------------------------------- gather
    def gather_logits(self, local: torch.Tensor, T: int) -> torch.Tensor:
        """Full-sequence [B, T, ...] tensor from every rank's local [B, n_local, ...] (no gradient)."""
        with torch.no_grad():
            full = comm.all_gather_raw(local.transpose(0, 1).contiguous(), self.group, "all_gather.eval")
            order = torch.argsort(torch.cat([zigzag_index(T, self.D, j)[1] for j in range(self.D)]))
            return full[order.to(full.device)][:T].transpose(0, 1)


def tsp_from_pretrained(path, group=None, dp_group=None, dtype=torch.float32, device="cpu") -> TSPCausalLM:
    """This rank's TSP shards of the HF checkpoint at ``path``, in ``dtype`` on ``device``: only the
    rank's slices are read from the safetensors files (the full model is never built)."""
    from train.model.hf_io import CheckpointSlices

    with CheckpointSlices(path, dtype=dtype, device=device) as src:
        return TSPCausalLM(src, group, dp_group)
