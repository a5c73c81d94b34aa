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
* ZAYA1 (``zaya``, :mod:`train.model.zaya`): CCA's heads grouped as above. Rank j owns its query heads' q
  rows, convolution channels and o_proj columns, and the KV part of the KV heads it owns (k rows, the
  value rows, which lie in the current-token or the delayed projection by head, the convolutions' key
  channels, the key temperatures; a conv shard's rows are its query channels then its key channels:
  shard kind ``qk_rows``). CCA's key is the mean over a KV head's query heads, so the forward runs in
  units of whole KV heads (:meth:`TSPCausalLM._cca_units`): one rank's group when every rank owns KV
  heads, else one KV head with the ranks that share it (ZAYA1's 2 KV heads on D = 4 or 8 ranks), each
  unit's query bundles and KV bundle broadcast from their owners. CCA mixes q/k along the sequence (two
  causal convolutions of look-back K = cca_time0 + cca_time1 - 2) and projects half of the values from
  the previous token, so each layer first exchanges a halo: every rank all-gathers the last max(K, 1)
  normed inputs of each of its chunks, and each chunk is computed with the max(K, 1) tokens before it
  prepended (zeros before the row; packed sequences restart the convolution and the delayed value, as
  the single-process model); the halo's gradient returns by the all-gather's reduce-scatter. The router
  (down-projection, depth-averaging state carried from layer to layer per token, router MLP) and the
  residual scalings are replicated; the balancing biases are buffers of the replicated routers
  (:attr:`TSPCausalLM.zaya_gates`), moved after each step by the load of every rank's real tokens
  (:func:`train.model.zaya.balance_router_biases` with the TSP and data-parallel groups).
* Replicated (small): RMSNorm weights (input/post-attention/final, q_norm, k_norm), o_proj biases
  and MoE routers. Each rank's gradient covers only its tokens, so :meth:`TSPCausalLM.sync_grads`
  all-reduces them with SUM.

Loading: the constructor reads every shard from a weight source - a full :class:`CausalLM` (its
state dict, sliced) or :class:`train.model.hf_io.CheckpointSlices`, which reads only this rank's
slices from the safetensors files (:func:`tsp_from_pretrained`); the slicing code is the same.
A transformers-fallback model is refused.

The loss is partitioned: each rank's loss covers its own tokens, normalised by the GLOBAL count,
so the ranks' losses sum to the single-process loss and every backward collective matches.
Weight-streaming functions save only their inputs and recompute per-shard partials in backward
(the shards are streamed again), so no rank ever holds more than two shards of a layer at once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from train.model.config import ModelConfig
from train.model.modeling import CausalLM, Router, apply_rope, rope_cos_sin, running_positions
from train.model.zaya import ZayaRouter, cca_conv, count_load, qk_normalize, residual_scaling
from train.parallel import comm
from train.parallel.shard import (ShardedLM, StateDictSource, all_reduce_grads, expert_partial, read_expert_slice,
                                  rms_norm, split_range, split_sizes, weight_source)
from train.rl.packing import default_chunk, logit_stats


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
    which runs any Cascade architecture)."""
    if cfg.num_attention_heads % D:
        raise ValueError(f"TSP needs num_attention_heads ({cfg.num_attention_heads}) divisible by D={D}")
    kv = cfg.num_key_value_heads
    if kv % D and D % kv:
        raise ValueError(f"TSP needs num_key_value_heads ({kv}) to be a multiple or a divisor of D={D}")


@dataclass
class HaloPlan:
    """Where a zaya layer's halo comes from and how each rank's two chunks are laid out with it (host-side,
    once per forward): each chunk is computed as a stream of ``Kh + c`` columns, the ``Kh = max(K, 1)``
    tokens before it then its own ``c``; the two streams lie back to back (2 (Kh + c) columns)."""

    Kh: int                   # halo length per chunk
    t: int                    # tail length each rank shares per chunk: min(c, Kh)
    src: torch.Tensor         # [2 * Kh] long: each halo column's row in the gathered tails (D * 2t = zeros)
    lengths: list[int]        # the streams' segments (a new one at each sequence start and at each stream)
    cols: torch.Tensor        # [2c] long: the chunks' own columns in the streams
    starts: torch.Tensor      # [2c] bool: own columns that start a sequence (the delayed value restarts)


def halo_plan(cfg: ModelConfig, D: int, r: int, c: int, host_starts: list[int] | None, device) -> HaloPlan:
    """The :class:`HaloPlan` of rank ``r`` (zigzag chunks r and 2D-1-r of ``c`` slots); ``host_starts``
    (packed rows): the first slot of each slot's sequence."""
    Kh = max(cfg.cca_time0 + cfg.cca_time1 - 2, 1)
    t = min(c, Kh)
    src, sid = [], []
    for m in (r, 2 * D - 1 - r):
        for g in range(m * c - Kh, m * c):
            if g < 0:  # before the row: a zero row, a segment of its own
                src.append(D * 2 * t)
                continue
            mm = g // c  # the chunk holding slot g, its owner and half; g lies in that chunk's last t slots
            owner, half = (mm, 0) if mm < D else (2 * D - 1 - mm, 1)
            src.append(owner * 2 * t + half * t + g - mm * c - (c - t))
        sid += [(-1 if g < 0 else 0 if host_starts is None else host_starts[g]) for g in range(m * c - Kh, (m + 1) * c)]
    L = Kh + c
    first = [u == 0 or u == L or sid[u] != sid[u - 1] for u in range(2 * L)]
    bounds = [u for u in range(2 * L) if first[u]] + [2 * L]
    cols = [h * L + Kh + i for h in range(2) for i in range(c)]
    return HaloPlan(Kh, t, torch.tensor(src, device=device), [b - a for a, b in zip(bounds, bounds[1:])],
                    torch.tensor(cols, device=device), torch.tensor([first[u] for u in cols], device=device))


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
        self.zaya_gates = None
        if cfg.architecture == "zaya":
            self._init_zaya(src)
            return
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
        return F.linear(self._attend(spans, q, k, v, key_valid, seg_start, q_slots, order), wo)

    def _attend(self, spans, q, k, v, key_valid, seg_start, q_slots, order):
        """Local queries q [B, hq, n, d] over the whole sequence's keys: k, v [B, kvh, n, d] of this rank's
        tokens are all-gathered along the sequence; -> [B, n, hq * d] (before the group's o_proj)."""
        B, hq, n, d = q.shape
        kvh = k.shape[1]
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # [n, 2, B, kvh, d]
        full = comm.all_gather_seq(kv, self.group)[order]  # global slot order
        K, Vv = full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)  # [B, kvh, Tp, d]
        if hq != kvh:
            K, Vv = K.repeat_interleave(hq // kvh, 1), Vv.repeat_interleave(hq // kvh, 1)
        c = n // 2
        dev = q.device
        outs = []
        for half in range(2):
            qs = q_slots[half * c:(half + 1) * c]
            begin, end = spans[half]
            ks = torch.arange(begin, end, device=dev)
            m = (ks[None, :] <= qs[:, None])[None]
            if key_valid is not None:
                m = m & key_valid[:, None, begin:end]
            if seg_start is not None:  # no attention across sequences
                m = m & (ks[None, :] >= seg_start[qs][:, None])[None]
            m = (m | (ks[None, :] == qs[:, None])[None])[:, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, half * c:(half + 1) * c], K[:, :, begin:end],
                                                       Vv[:, :, begin:end], attn_mask=m))
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, n, hq * d)

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

    # ---------------------------------------------------------------------------- ZAYA1
    def _init_zaya(self, src) -> None:
        """This rank's shards of a zaya policy (see the module's docstring)."""
        cfg, D, r, add, read = self.config, self.D, self.rank, self._add, src.read
        d, g, kvh, hq = cfg.head_dim, self.hq, self.kvh, cfg.num_attention_heads
        for n in ("input_hidden_states_scale", "input_hidden_states_bias"):
            add(f"model.{n}", read(f"model.{n}"), "rep")
        h0, h1 = self._own_kv_heads(r)  # (none on a rank that shares a KV head it does not own)
        qrows, krows, heads = slice(r * g * d, (r + 1) * g * d), slice(h0 * d, h1 * d), slice(h0, h1)
        vrows = self._value_rows(h0, h1)
        channels = (qrows, slice(hq * d + krows.start, hq * d + krows.stop))  # the convolutions' q, then k channels
        io, isz = split_range(cfg.moe_intermediate_size, D, r)
        self.zaya_gates = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, pr = p + "self_attn.", p + "self_attn.qkv_proj."
            rep = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"] + [
                f"{p}{s}.{n}" for s in ("post_attention_residual_scale", "post_mlp_residual_scale")
                for n in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")]
            for n in rep:
                add(n, read(n), "rep")
            for n, rows in (("q_proj", qrows), ("k_proj", krows), ("v_proj_current", vrows[0]),
                            ("v_proj_delayed", vrows[1])):
                add(f"{pr}{n}.weight", read(f"{pr}{n}.weight", rows), "row")
                if cfg.attention_bias:
                    add(f"{pr}{n}.bias", read(f"{pr}{n}.bias", rows), "row")
            for n in (f"{c}.{w}" for c in ("conv_qk_depthwise", "conv_qk_grouped") for w in ("weight", "bias")):
                add(pr + n, torch.cat([read(pr + n, ch) for ch in channels]), f"qk_rows:{g * d}")
            add(a + "qk_norm.temp", read(a + "qk_norm.temp", heads), "row")
            add(a + "o_proj.weight", read(a + "o_proj.weight", slice(None), qrows), "col")
            if cfg.attention_bias:  # added once to each local token's attention output
                add(a + "o_proj.bias", read(a + "o_proj.bias"), "rep")
            # replicated; its parameters are this model's "rep" shards, its buffers on their device
            gate = ZayaRouter(cfg, i).to(self._p["model.embed_tokens.weight"].device)
            for n, _ in list(gate.named_parameters()):
                add(p + "mlp.gate." + n, read(p + "mlp.gate." + n), "rep")
                *path, leaf = n.split(".")
                setattr(functools.reduce(getattr, path, gate), leaf, self._p[p + "mlp.gate." + n])
            gate.balancing_biases.copy_(read(p + "mlp.gate.balancing_biases").float())
            self.zaya_gates.append(gate)
            gu, dn = read_expert_slice(src, p + "mlp.experts.", io, isz)
            add(p + "mlp.experts.gate_up_proj", gu, "expert_gate_up")
            add(p + "mlp.experts.down_proj", dn, "expert_down")

    def _value_rows(self, h0: int, h1: int) -> tuple[slice, slice]:
        """KV heads [h0, h1)'s rows of ``v_proj_current`` and of ``v_proj_delayed`` (either may be empty): KV
        head h's value is rows [h d, (h + 1) d) of the two projections' outputs laid end to end (current,
        then delayed: with 2 KV heads, head 0's value is the current token's projection, head 1's the
        previous token's), so a rank's KV heads take their rows from either or both."""
        d, half = self.config.head_dim, self.config.num_key_value_heads * self.config.head_dim // 2
        a, b = h0 * d, h1 * d
        return slice(min(a, half), min(b, half)), slice(max(a, half) - half, max(b, half) - half)

    def _cca_units(self) -> list[tuple[list[int], int]]:
        """CCA's work units, one forward step each: (the ranks whose query heads it takes, the rank that owns
        its KV heads). CCA mixes each KV head's query heads (the key is their mean), so a unit holds whole
        KV heads with all their query heads: one rank's group when each rank owns KV heads
        (``num_key_value_heads >= D``), else one KV head with the D / num_key_value_heads ranks sharing it."""
        kv, D = self.config.num_key_value_heads, self.D
        if kv >= D:
            return [([j], j) for j in range(D)]
        per = D // kv
        return [(list(range(u * per, (u + 1) * per)), u * per) for u in range(kv)]

    def model_buffers(self) -> dict[str, torch.Tensor]:
        """State that is not a parameter under the policy's names: a zaya policy's balancing biases (the same
        on every rank), the live tensors."""
        return {f"model.layers.{i}.mlp.gate.balancing_biases": g.balancing_biases
                for i, g in enumerate(self.zaya_gates or ())}

    def _with_halo(self, x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
        """x [B, 2c, H] (this rank's chunks) -> [B, 2 (Kh + c), H]: each chunk with the Kh tokens before it
        (other ranks' chunk tails through an all-gather, zeros before the row) prepended."""
        B, n, H = x.shape
        c, t = n // 2, plan.t
        tails = torch.cat([x[:, c - t:c], x[:, n - t:]], 1).transpose(0, 1).contiguous()  # [2t, B, H]
        every = comm.all_gather_seq(tails, self.group)  # [D * 2t, B, H], rank by rank
        every = torch.cat([every, every.new_zeros(1, B, H)])
        halo = every.index_select(0, plan.src).view(2, plan.Kh, B, H).permute(2, 0, 1, 3)
        return torch.cat([halo, x.view(B, 2, c, H)], 2).reshape(B, -1, H)

    def _cca_bundles(self, i: int, j: int, kv: bool) -> tuple[list[tuple], list[torch.Tensor]]:
        """(shapes, tensors) of rank j's bundle for layer i's CCA: its query part (q rows, the convolutions'
        query channels, o_proj columns) or (``kv``) its KV part (k rows, value rows, the convolutions' key
        channels, key temperatures). Tensors only on rank j (views of its shards), else empty."""
        cfg, p = self.config, f"model.layers.{i}.self_attn."
        d, H, bias, m = cfg.head_dim, cfg.hidden_size, cfg.attention_bias, self.hq * cfg.head_dim
        conv = [f"qkv_proj.{c}.{w}" for c in ("conv_qk_depthwise", "conv_qk_grouped") for w in ("weight", "bias")]
        if kv:
            h0, h1 = self._own_kv_heads(j)
            vc, vd = self._value_rows(h0, h1)
            c = (h1 - h0) * d
            rows = [("k_proj", c), ("v_proj_current", vc.stop - vc.start), ("v_proj_delayed", vd.stop - vd.start)]
            part, tail = slice(m, None), [("qk_norm.temp", (h1 - h0,))]
        else:
            rows, c, part, tail = [("q_proj", m)], m, slice(None, m), [("o_proj.weight", (H, m))]
        names = [(f"qkv_proj.{n}.weight", (k, H)) for n, k in rows]
        if bias:
            names = [x for (n, shp) in names for x in ((n, shp), (n[:-len("weight")] + "bias", (shp[0],)))]
        names += list(zip(conv, [(c, 1, cfg.cca_time0), (c,), (c, d, cfg.cca_time1), (c,)])) + tail
        mine = []
        if self.rank == j:
            mine = [self._p[p + n][part] if n in conv else self._p[p + n] for n, _ in names]
        return [shp for _, shp in names], mine

    def _cca_fn(self, spans, plan, nq, xs, live, cos, sin, key_valid, seg_start, q_slots, order, *w):
        """One unit of CCA (:meth:`_cca_units`) on this rank's chunks: ``xs`` [B, 2 (Kh + c), H] (the chunks with
        their halos, padding zeroed; ``live`` [B, 2 (Kh + c), 1] marks the real columns where padding's biased
        projections must be zeroed too, else None); ``w``: the query bundles of the unit's ``nq`` ranks, then its KV bundle
        (:meth:`_cca_bundles`). Projections, the two convolutions, the delayed value, q/k normalisation
        and RoPE, then attention over the gathered keys (:meth:`_attend`) and the unit's o_proj columns."""
        cfg, B, bias = self.config, xs.shape[0], self.config.attention_bias
        d, rd, k = cfg.head_dim, cfg.rope_dim, 7 if cfg.attention_bias else 6
        qb = [w[u * k:(u + 1) * k] for u in range(nq)]
        kb = w[nq * k:]
        if bias:
            wk, bk, wc, bc, wd, bd, *kconv, temp = kb
        else:
            (wk, wc, wd, *kconv, temp), bk = kb, None
            bc = bd = None

        def join(idx, dim=0):
            return torch.cat([b[idx] for b in qb], dim)

        off = 1 + bias  # a query bundle: q_proj weight (+ bias), four conv tensors, o_proj weight
        wq, wo = join(0), join(-1, 1)
        convs = [torch.cat([join(off + c), kconv[c]]) for c in range(4)]
        g, kvh = len(wq) // d, len(wk) // d
        b = torch.cat([join(1), bk, bc, bd]) if bias else None
        cols, n = plan.cols, plan.cols.numel()
        xq, xk, vc, vd = F.linear(xs, torch.cat([wq, wk, wc, wd]), b).split([g * d, kvh * d, len(wc), len(wd)], -1)
        qr = xq[:, cols].view(B, n, g, d)
        qr = (qr + xk[:, cols].view(B, n, kvh, 1, d).expand(B, n, kvh, g // kvh, d).reshape(B, n, g, d)) * 0.5
        kr = qr.view(B, n, kvh, g // kvh, d).mean(-2)
        pre = torch.cat([xq, xk], -1)
        if live is not None:  # padding's columns hold the biases: zeroed, as the single-process model does
            pre = pre * live
        qk = cca_conv(pre.transpose(1, 2), *convs, g + kvh, cfg.cca_time0 + cfg.cca_time1 - 2,
                      plan.lengths).transpose(1, 2)[:, cols]
        q = qk[..., :g * d].reshape(B, n, g, d) + qr
        k = qk[..., g * d:].reshape(B, n, kvh, d) + kr
        v0 = bd if bd is not None else vd.new_zeros(vd.shape[-1])  # the delayed projection of a zero token
        prev = torch.where(plan.starts[None, :, None], v0.to(vd.dtype), vd[:, cols - 1])
        v = torch.cat([vc[:, cols], prev], -1).view(B, n, kvh, d).transpose(1, 2)
        qk = qk_normalize(torch.cat([q, k], 2), temp, g).transpose(1, 2)  # [B, g + kvh, n, d]
        qk = torch.cat([apply_rope(qk[..., :rd], cos, sin), qk[..., rd:]], -1)
        return F.linear(self._attend(spans, qk[:, :g], qk[:, g:], v, key_valid, seg_start, q_slots, order), wo)

    def _cca(self, i, x, valid, cos, sin, key_valid, seg_start, q_slots, order, spans, plan):
        live = None
        if valid is not None:  # padding zeroed before the projections, as the single-process model
            x = x * valid[:, :, None].to(x.dtype)
            if self.config.attention_bias:  # ... and after them (the biases): which halo columns are real
                live = self._with_halo(valid[:, :, None].to(x.dtype), plan)
        xs = self._with_halo(x, plan)
        out = None
        for ranks, owner in self._cca_units():
            bundles = [(j, *self._cca_bundles(i, j, False)) for j in ranks]
            bundles.append((owner, *self._cca_bundles(i, owner, True)))
            y = comm.broadcast_apply(functools.partial(self._cca_fn, spans, plan, len(ranks)),
                                     (xs, live, cos, sin, key_valid, seg_start, q_slots, order), bundles, self.group)
            out = y if out is None else out + y
        if self.config.attention_bias:
            out = out + self._p[f"model.layers.{i}.self_attn.o_proj.bias"]
        return out

    def _zaya_moe(self, i, x, state, replay, real):
        """The ZAYA1 MoE on this rank's tokens: the replicated router (its state carried from the previous
        layer, per token), top-1 of E experts or skip, the experts' intermediate slices on the ring.
        ``real`` [B, n] (bool): the tokens whose routing counts for the balancing biases."""
        B, n, H = x.shape
        flat, gate = x.reshape(-1, H), self.zaya_gates[i]
        _, w, idx, r = gate(flat, None if state is None else state.reshape(B * n, -1), replay)
        if self.training and torch.is_grad_enabled():
            count_load(gate, idx, real)
        idx = idx.masked_fill(idx == gate.num_experts, 0)  # skip: expert 0 at weight 0 (as the single-process model)
        p = f"model.layers.{i}.mlp."
        own = [self._p[p + "experts.gate_up_proj"], self._p[p + "experts.down_proj"]]
        y = comm.ring_apply(self._expert_fn, (flat, w, idx), own, self.group, self._expert_shapes)
        return y.view(B, n, H), r.view(B, n, -1)

    def _zaya_layers(self, x, cos, sin, key_valid, seg_start, slots, order, spans, host_starts, T, routed_experts):
        """The ZAYA1 decoder stack on this rank's tokens (``x``: the scaled embeddings, residual dtype)."""
        cfg, (B, n, _) = self.config, x.shape
        Tp, dt = n * self.D, self._p["model.layers.0.self_attn.o_proj.weight"].dtype
        plan = halo_plan(cfg, self.D, self.rank, n // 2, host_starts, x.device)
        valid = None if key_valid is None else key_valid[:, slots]
        real = (slots < T)[None].expand(B, -1)
        if valid is not None:
            real = real & valid
        eps, state = cfg.rms_norm_eps, None
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            scales = {s: [self._p[f"{p}{s}.{k}"] for k in ("hidden_states_scale", "hidden_states_bias",
                                                        "residual_scale", "residual_bias")]
                      for s in ("post_attention_residual_scale", "post_mlp_residual_scale")}
            with comm.tag(f"layer{i}.attn"):
                h = rms_norm(x, self._p[p + "input_layernorm.weight"], eps).to(dt)
                a = self._cca(i, h, valid, cos, sin, key_valid, seg_start, slots, order, spans, plan)
                x = residual_scaling(a, x, *scales["post_attention_residual_scale"])
            with comm.tag(f"layer{i}.mlp"):
                h = rms_norm(x, self._p[p + "post_attention_layernorm.weight"], eps).to(dt)
                replay = None
                if routed_experts is not None:
                    replay = F.pad(routed_experts[i], (0, 0, 0, Tp - T))[:, slots].reshape(B * n, -1)
                m, state = self._zaya_moe(i, h, state, replay, real)
                x = residual_scaling(m, x, *scales["post_mlp_residual_scale"])
        return x

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
        zaya = self.zaya_gates is not None
        if zaya:  # ZAYA1 scales its embeddings on input
            x = (x + self._p["model.input_hidden_states_bias"]) * self._p["model.input_hidden_states_scale"]
        if cfg.fp32_residual:  # as CausalLM: embedding output and residual additions in fp32
            x = x.float()
        if zaya:
            x = self._zaya_layers(x, cos, sin, key_valid, seg_start, slots, order, spans,
                                  None if host_starts is None else host_starts.tolist(), T, routed_experts)
        moe_i = 0
        for i in range(0 if zaya else cfg.num_hidden_layers):
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
        positions); the LM head runs on this rank's scored positions only, the others are zeros. Give it on the
        host (CPU): the rows are chosen there, without waiting for the device (a device tensor is copied back)."""
        B, T = input_ids.shape
        h = self.hidden_states(input_ids, attention_mask, routed_experts, cu_seqlens)
        host_slots = self.local_slots(T)
        slots = host_slots.to(input_ids.device)
        nxt = F.pad(input_ids, (0, len(slots) * self.D - T + 1))[:, slots + 1]
        H, n = h.shape[-1], h.shape[0] * h.shape[1]
        h, nxt = h.reshape(n, H), nxt.reshape(n)
        want = (host_slots < T).expand(B, -1)
        if scored is not None:
            want = want & F.pad(scored.to("cpu", torch.bool), (0, len(slots) * self.D - T))[:, host_slots]
        sel = want.reshape(n).nonzero().squeeze(1).to(h.device, non_blocking=True)  # this rank's LM-head rows
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
        # [rows, D, 3], zeros but at shard j (padded: no index tensor to copy to the device)
        return F.pad(torch.stack([lse, tgt, mean], -1).to(torch.float32)[:, None], (0, 0, j, self.D - 1 - j))

    def sft_loss(self, input_ids, loss_mask=None, attention_mask=None, count=None):
        """Next-token cross-entropy, mean over the GLOBAL number of predicted tokens of the replica's batch
        (``count``: a number given, e.g. the target tokens of every data-parallel replica's batch).

        ``loss_mask`` [B, T] marks the target tokens that count (default: all but the first).
        Returns this rank's part (the parts sum to the full loss; backward this one)."""
        B, T = input_ids.shape
        target = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.to(torch.bool)
        if attention_mask is not None:
            target = target & attention_mask.to(torch.bool)
        target = target.clone()
        target[:, 0] = False
        count = target.sum().clamp(min=1) if count is None else count
        logp, slots = self.token_logprobs(input_ids, attention_mask)
        valid = F.pad(target, (0, len(slots) * self.D - T + 1))[:, slots + 1]
        return -(logp * valid).sum() / count

    def sync_grads(self, mean: bool = True) -> None:
        """After backward: SUM the replicated parameters' gradients over the TSP group; then, on a
        2D mesh, SUM every gradient over the data-parallel group and divide by its size (``mean``: each
        replica's loss a mean over its own tokens, DDP's convention), or not (``mean=False``: losses
        normalised by the tokens of all replicas, ``sft_loss(count=...)``)."""
        all_reduce_grads(self.replicated_parameters(), self.group)
        if self.dp_group is not None:
            all_reduce_grads(list(self._p.values()), self.dp_group, dist.get_world_size(self.dp_group) if mean else 1)

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
