"""ZAYA1 (``model_type`` ``zaya``) layers for Cascade's policy, weight-compatible with transformers'
``ZayaForCausalLM`` (same module and parameter names, experts fused as in transformers 5).

- CCA attention (GQA mode): q/k projections mixed along the sequence by a causal depthwise conv
  (kernel ``cca_time0``) then a grouped conv (kernel ``cca_time1``, one group per head) on top of a
  residual path; the value is half the current token's projection, half the previous token's
  (``v_proj_delayed``); q and k are L2-normalised to sqrt(head_dim), the key scaled by a learned
  per-KV-head temperature; RoPE on the first ``rope_dim`` dims of each head (50% for ZAYA1).
  Decoding carries, next to the KV cache, the last ``K = cca_time0 + cca_time1 - 2`` pre-conv q/k
  projections (the convolution state) and the last delayed value projection per layer
  (:class:`~train.model.modeling.KVCache` ``conv`` / ``vstate``).
  Padding is zeroed before the projections (as transformers does), so a left-padded row equals the
  unpadded one; packed sequences (:class:`~train.model.modeling.Segments`) restart the convolution
  and the delayed value at every sequence start (each sequence sees K zero slots before it).
- ZAYA1 router: down-projection to ``router_hidden_size``, exponential depth averaging with the
  previous layer's router state (``router_states_scale``), RMSNorm, fc1-GELU-fc2-GELU-out_proj over
  E + 1 classes (the last one a "skip" expert that computes nothing), fp32 softmax; top-1 of the
  detached probabilities plus ``balancing_biases`` (a buffer, outside the gradient path); the gate is
  the unbiased probability. :func:`update_balancing_biases` is the load-balancing control rule.
- Residual scaling: ``x_{l+1} = RS_res(x_l) + RS_out(block(RMSNorm(x_l)))`` with
  ``RS(x) = (x + beta) * alpha``, computed in fp32; embeddings scaled the same way on input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.model.config import ModelConfig


class ResidualScaling(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(h))
        self.hidden_states_bias = nn.Parameter(torch.zeros(h))
        self.residual_scale = nn.Parameter(torch.ones(h))
        self.residual_bias = nn.Parameter(torch.zeros(h))

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual_scaling(out, residual, self.hidden_states_scale, self.hidden_states_bias,
                                self.residual_scale, self.residual_bias)


def residual_scaling(out, residual, hs_scale, hs_bias, res_scale, res_bias) -> torch.Tensor:
    """``(out + hs_bias) * hs_scale + (residual + res_bias) * res_scale`` in ``residual``'s dtype promoted
    to fp32 where the residual stream is fp32."""
    dt = torch.promote_types(residual.dtype, out.dtype)
    o = (out.to(dt) + hs_bias.to(dt)) * hs_scale.to(dt)
    return o + (residual.to(dt) + res_bias.to(dt)) * res_scale.to(dt)


def cca_conv(p: torch.Tensor, dw_w: torch.Tensor, dw_b: torch.Tensor, gw_w: torch.Tensor, gw_b: torch.Tensor,
             groups: int, K: int, lengths: list[int] | None = None) -> torch.Tensor:
    """CCA's two causal convolutions over p [B, C, T] (pre-conv q/k columns): depthwise (``dw_w`` [C, 1, k0]),
    then grouped (``gw_w`` [C, C / groups, k1], one group per head). Each packed sequence of ``lengths``
    (default: the whole row) sees K = k0 + k1 - 2 zero columns before it. -> [B, C, T]."""
    C, T = p.shape[1], p.shape[-1]

    def conv(x):
        return F.conv1d(F.conv1d(x, dw_w, dw_b, groups=C), gw_w, gw_b, groups=groups)

    if lengths is None or len(lengths) < 2:
        return conv(F.pad(p, (K, 0)))
    lens = torch.tensor(lengths, device=p.device)
    sid = torch.repeat_interleave(torch.arange(len(lens), device=p.device), lens, output_size=T)
    idx = torch.arange(T, device=p.device) + K * (sid + 1)
    buf = p.new_zeros(p.shape[0], C, T + K * len(lens)).index_copy(2, idx, p)
    return conv(buf)[..., idx - K]


class CCAProjection(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d, hq, hk = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        b = cfg.attention_bias
        self.d, self.hq, self.hk = d, hq, hk
        self.q_proj = nn.Linear(h, hq * d, bias=b)
        self.k_proj = nn.Linear(h, hk * d, bias=b)
        self.v_proj_current = nn.Linear(h, hk * d // 2, bias=b)
        self.v_proj_delayed = nn.Linear(h, hk * d // 2, bias=b)
        C = (hq + hk) * d
        self.conv_qk_depthwise = nn.Conv1d(C, C, cfg.cca_time0, groups=C)
        self.conv_qk_grouped = nn.Conv1d(C, C, cfg.cca_time1, groups=hq + hk)
        self.K = cfg.cca_time0 + cfg.cca_time1 - 2  # the convolution's look-back (state length)

    def _conv(self, p: torch.Tensor, state: torch.Tensor | None, seg) -> torch.Tensor:
        """p [B, C, T] (pre-conv q/k) -> conv output [B, C, T]; ``state`` [B, C, K]: the previous K
        columns (decoding), else zeros; ``seg``: packed sequences, each preceded by K zero columns."""
        dw, gw = self.conv_qk_depthwise, self.conv_qk_grouped
        if seg is not None and len(seg.bounds) > 2:
            return cca_conv(p, dw.weight, dw.bias, gw.weight, gw.bias, self.hq + self.hk, self.K, seg.lengths)
        if state is not None:
            p = torch.cat([state, p], -1)
            if p.shape[-1] - self.K == 1 and not torch.is_grad_enabled():  # a decoding step: the same sums, no conv1d
                return self._conv_step(p)
            return gw(dw(p))
        return cca_conv(p, dw.weight, dw.bias, gw.weight, gw.bias, self.hq + self.hk, self.K)

    def _conv_step(self, p: torch.Tensor) -> torch.Tensor:
        """Both convolutions for one new column: p [B, C, K + 1] -> [B, C, 1] (elementwise depthwise
        taps, the grouped conv as one batched matmul over groups; on CPU faster than two conv1d calls)."""
        B, C, _ = p.shape
        dw, gw = self.conv_qk_depthwise, self.conv_qk_grouped
        w = dw.weight[:, 0]
        k0, L = w.shape[1], p.shape[-1] - w.shape[1] + 1
        d = dw.bias[:, None] + sum(p[..., i:i + L] * w[:, i, None] for i in range(k0))  # [B, C, k1]
        G = self.hq + self.hk
        wg = gw.weight.reshape(G, self.d, -1)  # [G, D_out, D_in * k1]
        out = torch.bmm(d.reshape(B, G, -1).transpose(0, 1), wg.transpose(1, 2)).transpose(0, 1)
        return (out + gw.bias.view(G, self.d)).reshape(B, C, 1)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None, seg, cache, layer: int):
        """x [B, T, H] -> q [B, T, Hq, D], k, v [B, T, Hk, D]. ``valid`` [B, T] (bool) zeroes padding
        before the projections; with ``cache`` the convolution and delayed-value states are read and written."""
        B, T, _ = x.shape
        d, hq, hk = self.d, self.hq, self.hk
        if valid is not None:
            x = x * valid[:, :, None].to(x.dtype)
        # the four projections as one matmul
        lin = (self.q_proj, self.k_proj, self.v_proj_current, self.v_proj_delayed)
        bias = None if self.q_proj.bias is None else torch.cat([m.bias for m in lin])
        xq, xk, vc, vd = F.linear(x, torch.cat([m.weight for m in lin]), bias).split(
            [hq * d, hk * d, hk * d // 2, hk * d // 2], -1)
        qr = xq.view(B, T, hq, d)
        qr = (qr + xk.view(B, T, hk, 1, d).expand(B, T, hk, hq // hk, d).reshape(B, T, hq, d)) * 0.5
        kr = qr.view(B, T, hk, hq // hk, d).mean(-2)
        p = torch.cat([xq, xk], -1).transpose(1, 2)
        if valid is not None and bias is not None:  # padding's columns hold the bias: zero them, as a row alone
            p = p * valid[:, None, :].to(p.dtype)  # (or packed) sees zeros before its first token
        cont = cache is not None and cache.length > 0
        state = cache.conv[layer] if cont else None
        if cache is not None and self.K:
            full = torch.cat([state if state is not None else p.new_zeros(B, p.shape[1], self.K), p], -1)
            cache.conv[layer] = full[..., -self.K:].clone()
        qk = self._conv(p, state, seg).transpose(1, 2)
        q = qk[..., :hq * d].reshape(B, T, hq, d) + qr
        k = qk[..., hq * d:].reshape(B, T, hk, d) + kr
        v0 = cache.vstate[layer][:, None] if cont else self.v_proj_delayed(x.new_zeros(B, 1, x.shape[-1]))
        prev = torch.cat([v0.to(vd.dtype), vd[:, :-1]], 1)
        if seg is not None and len(seg.bounds) > 2:  # the delayed value restarts at every packed sequence
            starts = torch.zeros(T, dtype=torch.bool, device=x.device)
            starts[list(seg.bounds[:-1])] = True
            prev = torch.where(starts[None, :, None], v0.to(vd.dtype), prev)
        if cache is not None:
            cache.vstate[layer] = vd[:, -1].clone()
        v = torch.cat([vc, prev], -1).view(B, T, hk, d)
        return q, k, v


class QKNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = cfg.head_dim ** 0.5
        self.temp = nn.Parameter(torch.zeros(cfg.num_key_value_heads))

    def forward(self, qk: torch.Tensor, hq: int) -> torch.Tensor:
        return qk_normalize(qk, self.temp, hq)


def qk_normalize(qk: torch.Tensor, temp: torch.Tensor, hq: int) -> torch.Tensor:
    """qk [B, T, Hq + Hk, D] (query heads, then key heads): every head L2-normalised to sqrt(D) (fp32
    norms), the key heads times their temperature ``temp`` [Hk]."""
    eps = torch.finfo(qk.dtype).eps
    s = torch.cat([temp.new_ones(hq), temp]).to(torch.float32) * qk.shape[-1] ** 0.5
    return (F.normalize(qk.float(), dim=-1, eps=eps) * s[:, None]).to(qk.dtype)


class CCAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = CCAProjection(cfg)
        self.qk_norm = QKNorm(cfg)
        self.o_proj = nn.Linear(self.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, mask, cache=None, layer: int = 0, valid=None):
        from train.model.modeling import Segments, apply_rope, cached_attention

        hq, rd = self.n_heads, self.cfg.rope_dim
        seg = mask if type(mask) is Segments else None
        q, k, v = self.qkv_proj(x, valid, seg, cache, layer)
        qk = self.qk_norm(torch.cat([q, k], 2), hq).transpose(1, 2)  # [B, Hq + Hk, T, D]
        qk = torch.cat([apply_rope(qk[..., :rd], cos, sin), qk[..., rd:]], -1)
        q, k, v = qk[:, :hq], qk[:, hq:], v.transpose(1, 2)
        return self.o_proj(cached_attention(q, k, v, mask, cache, layer))


class RouterMLP(nn.Module):
    def __init__(self, r: int, classes: int, eps: float):
        super().__init__()
        from train.model.modeling import RMSNorm

        self.norm = RMSNorm(r, eps)
        self.fc1 = nn.Linear(r, r)
        self.fc2 = nn.Linear(r, r)
        self.out_proj = nn.Linear(r, classes, bias=False)

    def forward(self, x):
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class ZayaRouter(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        E, R = cfg.num_experts, cfg.router_hidden_size
        self.num_experts = E
        self.down_proj = nn.Linear(cfg.hidden_size, R)
        self.use_eda = layer != 0
        if self.use_eda:
            self.router_states_scale = nn.Parameter(torch.ones(R))
        self.router_mlp = RouterMLP(R, E + 1, cfg.rms_norm_eps)
        b = torch.zeros(E + 1)
        b[-1] = -1.0  # the skip class
        self.register_buffer("balancing_biases", b)
        # tokens routed to each expert by training forwards since the last bias update (not saved)
        self.register_buffer("load_counts", torch.zeros(E), persistent=False)

    def _apply(self, fn, recurse=True):
        """The balancing biases stay fp32 whatever the weights' dtype (their updates are small steps)."""
        super()._apply(fn, recurse)
        if self.balancing_biases.dtype != torch.float32:
            self.balancing_biases = self.balancing_biases.float()
        if self.load_counts.dtype != torch.float32:
            self.load_counts = self.load_counts.float()
        return self

    def forward(self, x: torch.Tensor, state: torch.Tensor | None, replay: torch.Tensor | None = None):
        """x [N, H]; ``state`` [N, R] (the previous layer's router state) -> (probs [N, E+1] fp32,
        gate [N, 1], class ids [N, 1] in [0, E] (E = skip), this layer's router state). ``replay`` [N, 1]
        forces the class (router replay); the gate is still the router's own probability."""
        r = self.down_proj(x)
        if self.use_eda and state is not None:
            r = r + state * self.router_states_scale
        probs = F.softmax(self.router_mlp(r).float(), dim=-1)
        if replay is None:
            idx = torch.topk(probs.detach() + self.balancing_biases.float(), 1, dim=-1).indices
        else:
            idx = replay.to(torch.long).reshape(-1, 1).clone()  # (an engine's inference tensor: a normal copy)
        gate = probs.gather(1, idx).masked_fill(idx == self.num_experts, 0.0)
        return probs, gate.to(x.dtype), idx, r


class ZayaMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        from train.model.modeling import Experts

        self.gate = ZayaRouter(cfg, layer)
        self.experts = Experts(cfg)

    def forward(self, x, state=None, replay=None, record: list | None = None, valid=None):
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        _, w, idx, r = self.gate(flat, None if state is None else state.reshape(B * T, -1), replay)
        if record is not None:
            record.append(idx.view(B, T, 1))
        if self.training and torch.is_grad_enabled():  # the load the balancing biases follow (real tokens only;
            # a checkpointed layer's recomputation counts its tokens twice, which leaves the load fractions alone)
            count_load(self.gate, idx, valid)
        eidx = idx.masked_fill(idx == self.gate.num_experts, 0)  # skip: expert 0 at weight 0 (as transformers)
        return self.experts(flat, eidx, w).view(B, T, H), r.view(B, T, -1)


@torch.no_grad()
def count_load(gate: ZayaRouter, idx: torch.Tensor, valid: torch.Tensor | None) -> None:
    """Add the tokens routed to each expert (class ids ``idx`` [N, 1]; ``valid``: the real tokens, any
    shape of N elements, or None) to ``gate.load_counts``; the skip class counts for no expert."""
    ids = idx[:, 0]
    ones = torch.ones_like(ids, dtype=torch.float32) if valid is None else valid.reshape(-1).to(torch.float32)
    # not bincount, and padding weighted 0 rather than masked out: no host sync on CUDA
    n = torch.zeros(gate.num_experts + 1, device=ids.device).scatter_add_(0, ids, ones)
    gate.load_counts += n[:-1]


class ZayaDecoderLayer(nn.Module):
    is_moe = True

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        from train.model.modeling import RMSNorm

        self.self_attn = CCAAttention(cfg)
        self.mlp = ZayaMoE(cfg, i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_residual_scale = ResidualScaling(cfg.hidden_size)
        self.post_mlp_residual_scale = ResidualScaling(cfg.hidden_size)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, replay=None, record=None, state=None, valid=None):
        """-> (residual stream, router state). Norms on the residual stream in fp32, blocks in the weights' dtype."""
        dt = self.self_attn.o_proj.weight.dtype
        a = self.self_attn(self.input_layernorm(x).to(dt), cos, sin, mask, cache, layer, valid)
        x = self.post_attention_residual_scale(a, x)
        m, state = self.mlp(self.post_attention_layernorm(x).to(dt), state, replay, record, valid)
        return self.post_mlp_residual_scale(m, x), state


def checkpointed_layer(layer: ZayaDecoderLayer, x, cos, sin, mask, replay, record: list | None, state, valid):
    """``layer(...)`` under activation checkpointing (no cache); the routing chosen in forward is
    replayed when backward recomputes the layer."""
    from torch.utils.checkpoint import checkpoint

    box = {"replay": replay}
    if replay is not None and record is not None:
        record.append(replay.reshape(x.shape[0], x.shape[1], -1))

    def run(x, state):
        if box["replay"] is not None:
            return layer(x, cos, sin, mask, None, 0, box["replay"], None, state, valid)
        rec: list = []
        out = layer(x, cos, sin, mask, None, 0, None, rec, state, valid)
        box["replay"] = rec[0].reshape(-1, 1)
        if record is not None:
            record.append(rec[0])
        return out

    return checkpoint(run, x, state, use_reentrant=False)


def router_gates(model) -> list[ZayaRouter]:
    """A zaya policy's routers, layer by layer: a :class:`~train.model.modeling.CausalLM`'s, or a sharded
    model's (``zaya_gates``: the TSP layout's replicated routers)."""
    gates = getattr(model, "zaya_gates", None)
    if gates is not None:
        return list(gates)
    return [layer.mlp.gate for layer in model.model.layers if isinstance(layer, ZayaDecoderLayer)]


def balance_router_biases(model, group=None) -> torch.Tensor | None:
    """After an optimizer step: move a zaya model's balancing biases by its ``router_bias_update_rate``
    towards load 1/E, from the tokens its training forwards routed since the last call (summed over
    ``group``, the ranks that saw other tokens of the batch - a process group or a sequence of them, e.g.
    the TSP and the data-parallel groups - when given), and reset the counts. No-op (None) for other
    models, a zero rate, or no training tokens seen. -> the per-layer loads [n_layers, E]."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "architecture", None) != "zaya":
        return None
    gates = router_gates(model)
    counts = torch.stack([g.load_counts for g in gates])
    for g in gates:
        g.load_counts.zero_()
    if not cfg.router_bias_update_rate or (group is None and not bool(counts.sum() > 0)):
        return None
    return update_balancing_biases(model, counts, cfg.router_bias_update_rate, group)


def expert_loads(routes: list[torch.Tensor], num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-layer token counts per expert [n_layers, E] from recorded class ids (each [B, T, 1], or
    [N, 1]); ``mask`` (same leading shape) keeps real tokens only. The skip class counts for no expert."""
    out = []
    for r in routes:
        ids = r[..., 0]
        if mask is not None:
            ids = ids[mask.to(torch.bool)]
        ids = ids.reshape(-1)
        out.append(torch.bincount(ids[ids < num_experts], minlength=num_experts)[:num_experts].float())
    return torch.stack(out)


@torch.no_grad()
def update_balancing_biases(model, counts: torch.Tensor, rate: float = 1e-3, group=None) -> torch.Tensor:
    """The ZAYA1 balancing control rule: per layer, each expert's bias moves by ``rate`` towards load
    1/E: ``b_e += rate * sign(1/E - load_e)`` with ``load_e`` the expert's share of the routed tokens of
    the *global* batch (``counts`` [n_layers, E] summed over ``group`` - a process group or a sequence of
    them - with all-reduces when given); a batch without a single counted token moves nothing.
    The skip class's bias is left as it is. Biases are buffers: no gradient reaches them. -> the loads."""
    counts = counts.detach().float().clone()
    if group is not None:
        import torch.distributed as dist

        for g in (group if isinstance(group, (list, tuple)) else (group,)):
            if g is not None:
                dist.all_reduce(counts, group=g)
    E = counts.shape[1]
    load = counts / counts.sum(1, keepdim=True).clamp_min(1.0)
    seen = (counts.sum() > 0).float()  # no token anywhere (every rollout dropped): nothing to follow (no host sync)
    gates = router_gates(model)
    if len(gates) != counts.shape[0]:
        raise ValueError(f"counts for {counts.shape[0]} layers; the model has {len(gates)} zaya layers")
    for gate, ld in zip(gates, load):
        b = gate.balancing_biases
        b[:E] += (rate * seen * torch.sign(1.0 / E - ld)).to(b.device, b.dtype)
    return load
