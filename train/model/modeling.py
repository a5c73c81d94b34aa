"""Cascade's policy: a decoder-only transformer weight-compatible with HF Qwen3, Qwen3-MoE, Qwen2 and
Llama (``config.architecture``: q/k norm for Qwen3, q/k/v biases for Qwen2, RoPE scaling ``linear`` and
``llama3``), and ZAYA1 (``zaya``: its layers in :mod:`train.model.zaya`).

Module and parameter names mirror ``transformers`` (``model.layers.N.self_attn.q_proj.weight``,
MoE experts fused as ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj
[E, H, I]``), so an in-memory state dict is the one ``transformers`` 5 uses; on disk experts are
written per expert (see :mod:`train.model.hf_io`). MoE experts run as grouped GEMMs
(``torch._grouped_mm``) over tokens sorted by expert.

Norms, the router softmax, rotary tables and logits are computed in fp32 whatever the weight
dtype, and with ``config.fp32_residual`` (the default) so is the residual stream: the embedding
output and every residual addition stay fp32 while each block computes in the weights' dtype
(ZAYA1's stability measures).
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from train.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in fp32 and returned in ``x``'s dtype (one fused op)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device, scaling: dict | None = None) -> torch.Tensor:
    key = (head_dim, float(theta), str(device), tuple(sorted((scaling or {}).items())))
    if key not in _INV_FREQ:
        with torch.inference_mode(False):  # a normal tensor even when first made during generation
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            _INV_FREQ[key] = scaled_inv_freq(inv, scaling).to(device)
    return _INV_FREQ[key]


def scaled_inv_freq(inv: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies under ``scaling`` (None: unchanged): ``linear`` divides them by
    ``factor``; ``llama3`` (Llama 3.1) divides the low frequencies by ``factor``, keeps the high ones and
    interpolates between (as transformers' ``_compute_llama3_parameters``)."""
    if not scaling:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    import math

    old = float(scaling["original_max_position_embeddings"])
    lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(mid, (1 - smooth) * out / factor + smooth * out, out)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """cos/sin tables [B, T, head_dim] for integer ``positions`` [B, T] (HF's half-rotation layout);
    ``scaling``: ``config.rope_scaling``."""
    freqs = positions.float()[..., None] * _inv_freq(head_dim, theta, positions.device, scaling)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def input_pad_id(cfg) -> int:
    """The id that fills padded input positions (masked, but still embedded): the config's pad id where it is
    a token of the vocabulary (old LLaMA conversions ship -1), else 0."""
    p = cfg.pad_token_id
    return int(p) if p is not None and 0 <= int(p) < cfg.vocab_size else 0


@dataclass
class KVCache:
    """Pre-allocated key/value cache for the engine. All rows share one write position ``length``
    (prompts are left-padded); ``valid`` [B, Tmax] marks key slots that hold real tokens."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    valid: torch.Tensor
    length: int = 0
    # ZAYA1 (CCA) only, per layer: the last pre-conv q/k columns [B, C, K] and the last delayed value
    # projection [B, Hk * D / 2]; written by the first forward into the cache
    conv: list | None = None
    vstate: list | None = None
    # slots 0..shared-1 hold the same keys and values in every row, all valid (a shared prefix copied to
    # every row, or one prompt fanned out to n samples): the native decoder reads them once for all rows
    shared: int = 0

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, device, dtype) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        L = cfg.num_hidden_layers
        zaya = cfg.architecture == "zaya"
        return cls([torch.empty(shape, device=device, dtype=dtype) for _ in range(L)],
                   [torch.empty(shape, device=device, dtype=dtype) for _ in range(L)],
                   torch.zeros(batch, max_len, dtype=torch.bool, device=device),
                   conv=[None] * L if zaya else None, vstate=[None] * L if zaya else None)

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A new cache of the given batch rows (kept or repeated, e.g. to fan out n samples); only the
        written key/value slots (``:length``) are copied, the rest is allocated unwritten."""
        def sel(states):
            return None if states is None else [None if t is None else t.index_select(0, rows) for t in states]

        def written(t):
            out = t.new_empty((rows.numel(), *t.shape[1:]))
            torch.index_select(t[:, :, :self.length], 0, rows, out=out[:, :, :self.length])
            return out

        shared = self.shared
        if self.valid.shape[0] == 1 and bool(self.valid[0, :self.length].all()):
            shared = self.length  # copies of one unpadded row: everything written so far is shared
        return KVCache([written(k) for k in self.k], [written(v) for v in self.v],
                       self.valid.index_select(0, rows), self.length, sel(self.conv), sel(self.vstate), shared)

    def keep(self, rows: torch.Tensor) -> "KVCache":
        """Keep a subset of the batch rows (``rows`` ascending, e.g. dropping finished sequences) in
        place: their written slots move to the front rows of the same storage, and the returned cache
        views it (no allocation, so no fresh pages to fault in on every finished sequence)."""
        n, T = rows.numel(), self.length

        def front(t, cols=None):
            src = t.index_select(0, rows) if cols is None else t[:, :, :cols].index_select(0, rows)
            dst = t[:n] if cols is None else t[:n, :, :cols]
            dst.copy_(src)
            return t[:n]

        def sel(states):
            return None if states is None else [None if t is None else front(t) for t in states]

        return KVCache([front(k, T) for k in self.k], [front(v, T) for v in self.v], front(self.valid), T,
                       sel(self.conv), sel(self.vstate), self.shared)


@dataclass(frozen=True)
class Segments:
    """Packed sequences in one row: sequence j holds token slots ``bounds[j]:bounds[j + 1]``
    (``bounds`` as ``cu_seqlens``: 0, ..., N). Passed to :class:`Attention` in place of a mask,
    it makes each sequence attend causally to itself only."""

    bounds: tuple[int, ...]

    @classmethod
    def of(cls, cu_seqlens, total: int) -> "Segments":
        b = tuple(int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
        if len(b) < 2 or b[0] != 0 or b[-1] != total or any(e <= s for s, e in zip(b, b[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {total}; got {list(b)[:8]}...")
        return cls(b)

    @property
    def lengths(self) -> list[int]:
        return [e - s for s, e in zip(self.bounds, self.bounds[1:])]

    def cu_seqlens(self, device) -> torch.Tensor:
        """``bounds`` as an int32 tensor on ``device`` (what varlen kernels take), made once per device:
        every layer's attention reads the same one."""
        key = f"_cu_seqlens:{torch.device(device)}"
        if key not in self.__dict__:  # a cache beside the frozen fields, not one of them
            self.__dict__[key] = torch.tensor(self.bounds, dtype=torch.int32).to(device)
        return self.__dict__[key]

    def positions(self, device) -> torch.Tensor:
        """Rotary positions [1, N], restarting at 0 for each sequence."""
        lens = torch.tensor(self.lengths, device=device)
        starts = torch.tensor(self.bounds[:-1], device=device)
        n = self.bounds[-1]
        return (torch.arange(n, device=device) - torch.repeat_interleave(starts, lens, output_size=n))[None]


@functools.lru_cache(maxsize=None)
def _varlen() -> tuple | None:
    """torch's FlashAttention varlen entry (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) and
    the keywords this torch version spells causal and GQA with, or None (older torch, or
    ``CASCADE_VARLEN=0``)."""
    if os.environ.get("CASCADE_VARLEN", "1") == "0":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, kw, "enable_gqa" in params


def uses_varlen(q: torch.Tensor) -> bool:
    """Whether :func:`segment_attention` takes one varlen FlashAttention call for ``q``: CUDA, fp16 or bf16,
    head_dim a multiple of 8 up to 256 (FlashAttention refuses others), and a torch that has the kernel."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0 and _varlen() is not None


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, gqa: bool) -> torch.Tensor:
    """Causal attention within each packed sequence: q [1, Hq, N, D], k, v [1, Hkv, N, D] -> [1, Hq, N, D].
    On a GPU in fp16/bf16 one varlen FlashAttention call over all sequences (:func:`uses_varlen`; the
    kernel takes fewer K/V heads as they are); else one fused SDPA call per sequence over slices (no
    N x N mask; no work across sequences)."""
    if len(seg.bounds) == 2:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if uses_varlen(q):
        fn, kw, takes_gqa = _varlen()
        if takes_gqa:
            kw = dict(kw, enable_gqa=gqa)
        cu, longest = seg.cu_seqlens(q.device), max(seg.lengths)
        out = fn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, longest, longest, **kw)
        return out.transpose(0, 1)[None]
    # split (not slicing): its backward is one concatenation, not a full-size zero tensor per sequence
    lens = seg.lengths
    return torch.cat([F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
                      for qs, ks, vs in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))], dim=2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None, layer: int = 0):
        """``mask``: None (causal), a boolean mask [B, 1, T, Tk], or :class:`Segments` (packed sequences in
        one row, no cache); single-token decoding with a cache uses :func:`decode_attention` on CPU, the
        fused SDPA kernel elsewhere."""
        B, T, _ = x.shape
        d, hq, hk = self.cfg.head_dim, self.n_heads, self.n_kv
        # one projection for q, k and v; q and k normed and rotated together
        bias = None if self.q_proj.bias is None else torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        qkv = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)), bias)
        qk = qkv[..., :(hq + hk) * d].view(B, T, hq + hk, d)
        if self.cfg.qk_norm:
            norm_w = torch.cat((self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hk, d)))
            qk = norm_w * rms_normalize(qk, self.q_norm.eps)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[..., (hq + hk) * d:].view(B, T, hk, d).transpose(1, 2)
        return self.o_proj(cached_attention(q, k, v, mask, cache, layer))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cache: "KVCache | None",
                     layer: int) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, T, D] over ``k``/``v`` [B, Hk, T, D], appended to ``cache`` at its
    write position first when one is given: one decoded token on CPU-like devices takes
    :func:`decode_attention`, else SDPA (causal without a mask, or the mask) or
    :func:`segment_attention` for packed sequences. Returns [B, T, Hq * D] (before ``o_proj``)."""
    B, hq, T, d = q.shape
    if cache is not None:
        s = cache.length
        cache.k[layer][:, :, s:s + T] = k
        cache.v[layer][:, :, s:s + T] = v
        k, v = cache.k[layer][:, :, :s + T], cache.v[layer][:, :, :s + T]
        if T == 1 and q.device.type in DECODE_MATMUL_DEVICES:
            return decode_attention(q, k, v, mask).reshape(B, 1, hq * d)
    gqa = k.shape[1] != hq  # grouped-query attention without materialising repeated K/V
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif type(mask) is Segments:
        out = segment_attention(q, k, v, mask, gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(B, T, hq * d)


DECODE_MATMUL_DEVICES = {"cpu"}  # device types whose single-token decode uses decode_attention, not SDPA


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row: q [B, Hq, 1, D] over k, v [B, Hkv, Tk, D] (Hq a multiple of Hkv)
    with a boolean mask [B, 1, 1, Tk] (True = attend) -> [B, Hq, D]. Written as two batched matmuls with the query
    heads of a group stacked, which on CPU is faster than the fused SDPA kernel for a single query."""
    B, hq, _, d = q.shape
    hk = k.shape[1]
    qg = q.reshape(B, hk, hq // hk, d) * d ** -0.5
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v).view(B, hq, d)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_GROUPED_MM_OK: dict[tuple, bool] = {}


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w[e]`` for row groups ending at ``offs``.

    ``torch._grouped_mm`` where the device and dtype support it (CPU fp32/bf16, Hopper bf16) and both
    matrices' inner widths are multiples of 16 bytes (its forward and its backward's transposed products
    need them; a forward that ran on a width only the forward takes failed in backward); elsewhere (e.g. fp32
    on older GPUs) the same product per group.
    """
    key = (x.device.type, x.dtype)
    es = x.element_size()
    if _GROUPED_MM_OK.get(key, True) and (x.shape[-1] * es) % 16 == 0 and (w.shape[-1] * es) % 16 == 0:
        try:
            return torch._grouped_mm(x, w, offs=offs)
        except RuntimeError:
            _GROUPED_MM_OK[key] = False
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])


class Experts(nn.Module):
    """E gated-MLP experts, weights stacked as in transformers 5."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.inter = E, I
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; idx, weights [N, k] -> [N, H]."""
        return expert_mlp(x, weights, idx, self.gate_up_proj, self.down_proj)


def expert_mlp(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token: x [N, H]; w, idx [N, k] (routing
    weights, expert ids); gate_up [E, 2I, H] (gate rows then up rows); down [E, H, I]. Tokens are grouped
    by expert for two grouped GEMMs. The experts' token counts are a scatter-add, not ``bincount``
    (which reads the largest id back to the host on CUDA)."""
    E, two_i, _ = gate_up.shape
    inter, k = two_i // 2, idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = grouped_mm(x[token], gate_up.transpose(1, 2), offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = grouped_mm(a.contiguous(), down.transpose(1, 2), offs)
    y = y * w.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """-> (probs [N, E] fp32, top-k weights [N, k], top-k expert ids [N, k]).

        ``replay`` [N, k] forces the expert choice (MoE router replay); the weights are still the
        router's own probabilities of those experts, so gradients reach the router."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        if replay is None and not probs.requires_grad:
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:  # with gradient, one autograd graph whether replayed or not (a checkpointed layer recomputes by replay)
            top_i = torch.topk(probs.detach(), self.top_k, dim=-1).indices if replay is None else replay.to(torch.long)
            top_w = probs.gather(1, top_i)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        return probs, top_w.to(x.dtype), top_i


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None, record: list | None = None):
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        _, w, idx = self.gate(flat, replay)
        if record is not None:
            record.append(idx.view(B, T, -1))
        return self.experts(flat, idx, w).view(B, T, H)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.is_moe = cfg.layer_is_moe(i)
        self.mlp = SparseMoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, replay=None, record=None):
        """``x``: the residual stream, in the weights' dtype or fp32 (``fp32_residual``); each block
        takes its normed input in the weights' dtype and its output is added in ``x``'s dtype."""
        dt = self.self_attn.o_proj.weight.dtype
        x = x + self.self_attn(self.input_layernorm(x).to(dt), cos, sin, mask, cache, layer)
        h = self.post_attention_layernorm(x).to(dt)
        x = x + (self.mlp(h, replay, record) if self.is_moe else self.mlp(h))
        return x


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.architecture == "zaya":  # train/model/zaya.py; the embeddings are scaled on input
            from train.model.zaya import ZayaDecoderLayer

            self.layers = nn.ModuleList(ZayaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.input_hidden_states_scale = nn.Parameter(torch.ones(cfg.hidden_size))
            self.input_hidden_states_bias = nn.Parameter(torch.zeros(cfg.hidden_size))
        else:
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def running_positions(valid: torch.Tensor) -> torch.Tensor:
    """Rotary positions [B, L] for key slots marked real in ``valid`` [B, L] (bool): the running count
    of real tokens before each slot, so padding anywhere in a row does not shift its positions."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def build_mask(key_valid: torch.Tensor | None, q_slots: torch.Tensor, k_len: int) -> torch.Tensor | None:
    """Boolean attention mask [B, 1, Tq, Tk]: causal over slots, padded keys hidden, and every query
    allowed to see its own slot (so rows of padding never become all-masked)."""
    k_slots = torch.arange(k_len, device=q_slots.device)
    causal = k_slots[None, :] <= q_slots[:, None]  # [Tq, Tk]
    m = causal[None]
    if key_valid is not None:
        m = m & key_valid[:, None, :k_len]
    m = m | (k_slots[None, :] == q_slots[:, None])[None]
    return m[:, None]


class CausalLM(nn.Module):
    """The policy. ``forward`` returns fp32 logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg.validate()
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> "CausalLM":
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "_scale", "qk_norm.temp")):  # norms, ZAYA1's residual scales, key temperature
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None,
                      routed_experts=None, record_routing: list | None = None, cu_seqlens=None,
                      checkpoint_layers: bool = False):
        """Final-norm hidden states [B, T, H].

        ``attention_mask`` [B, T] (1 = real token) marks padding anywhere; without a cache and
        without padding the plain causal kernel is used. With a cache, ``cache.valid`` is updated.
        ``routed_experts``: per MoE layer, expert ids [B, T, k] to replay; ``record_routing``: a
        list that receives the expert ids chosen by each MoE layer.

        ``cu_seqlens`` (packed input): ``input_ids`` is one row [1, N] holding several sequences back
        to back, sequence j in slots ``cu_seqlens[j]:cu_seqlens[j+1]`` (0, ..., N; a list or tensor).
        Positions restart at 0 for each sequence and attention stays within it; projections, MLP and
        experts run over the N real tokens only. No padding, no cache.
        ``checkpoint_layers``: recompute each decoder layer in backward instead of keeping its
        activations (training memory); the routing recorded in forward is replayed when recomputing.
        """
        cfg = self.config
        B, T = input_ids.shape
        dev = input_ids.device
        if cu_seqlens is not None:
            if B != 1 or cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens (packed sequences) takes one row [1, N] without attention_mask or cache")
            seg = Segments.of(cu_seqlens, T)
            if position_ids is None:
                position_ids = seg.positions(dev)
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {start + T} > {cache.capacity}")
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
        if routed_experts is not None:  # replayed ids recorded elsewhere (an engine's CPU-held rollouts): one copy here
            routed_experts = [None if r is None else r.to(dev) for r in routed_experts]
        if cache is not None:
            cache.valid[:, start:start + T] = True if attention_mask is None else attention_mask
        if position_ids is None:
            if cache is not None:
                position_ids = running_positions(cache.valid[:, :start + T])[:, start:]
            elif attention_mask is not None:
                position_ids = running_positions(attention_mask)
            else:
                position_ids = torch.arange(T, device=dev).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, cfg.rope_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
        zaya = cfg.architecture == "zaya"
        if zaya:
            x = (x + self.model.input_hidden_states_bias) * self.model.input_hidden_states_scale
        if cfg.fp32_residual:  # the residual stream in fp32 (a no-op for fp32 weights)
            x = x.float()
        q_slots = torch.arange(start, start + T, device=dev)
        if cu_seqlens is not None:
            mask = seg
        elif cache is not None:
            mask = build_mask(cache.valid, q_slots, start + T)
        elif attention_mask is not None and not bool(attention_mask.all()):
            mask = build_mask(attention_mask, q_slots, T)
        else:
            mask = None
        if zaya:
            x = self._zaya_layers(x, cos, sin, mask, cache, attention_mask, routed_experts, record_routing,
                                  checkpoint_layers)
        moe_i = 0
        for i, layer in enumerate(() if zaya else self.model.layers):
            replay = None
            if layer.is_moe and routed_experts is not None:
                replay = routed_experts[moe_i].reshape(B * T, -1)
            if checkpoint_layers and torch.is_grad_enabled():
                x = _checkpointed(layer, x, cos, sin, mask, replay, record_routing if layer.is_moe else None)
            else:
                x = layer(x, cos, sin, mask, cache, i, replay, record_routing)
            moe_i += int(layer.is_moe)
        if cache is not None:
            cache.length = start + T
        return self.model.norm(x)

    def _zaya_layers(self, x, cos, sin, mask, cache, attention_mask, routed_experts, record_routing, checkpoint_layers):
        """The ZAYA1 decoder stack (train/model/zaya.py): the router state runs from layer to layer and CCA
        zeroes padding before its convolutions (``valid``: this forward's real tokens, None when all real)."""
        from train.model.zaya import checkpointed_layer

        B, T = x.shape[:2]
        valid = cache.valid[:, cache.length:cache.length + T] if cache is not None else attention_mask
        if valid is not None and bool(valid.all()):
            valid = None
        state = None
        for i, layer in enumerate(self.model.layers):
            replay = None if routed_experts is None else routed_experts[i].reshape(B * T, -1)
            if checkpoint_layers and torch.is_grad_enabled() and cache is None:
                x, state = checkpointed_layer(layer, x, cos, sin, mask, replay, record_routing, state, valid)
            else:
                x, state = layer(x, cos, sin, mask, cache, i, replay, record_routing, state, valid)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from hidden states (LM head in fp32)."""
        return F.linear(h.float(), self.lm_head.weight.float())

    def last_logits(self, input_ids, attention_mask=None, cache: KVCache | None = None) -> torch.Tensor:
        """fp32 logits [B, V] of the last position only (what generation needs: the LM head runs on
        one position per row)."""
        return self.logits(self.hidden_states(input_ids, attention_mask, cache=cache)[:, -1])

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, routed_experts=None,
                record_routing=None, cu_seqlens=None, checkpoint_layers: bool = False):
        return self.logits(self.hidden_states(input_ids, attention_mask, position_ids, cache,
                                              routed_experts, record_routing, cu_seqlens, checkpoint_layers))


def _checkpointed(layer: DecoderLayer, x, cos, sin, mask, replay, record: list | None):
    """``layer(x, ...)`` under activation checkpointing (no cache). An MoE layer's expert choice made in
    forward is recorded once and replayed when backward recomputes the layer, so both passes route alike."""
    from torch.utils.checkpoint import checkpoint

    state = {"replay": replay}
    if replay is not None and record is not None:
        record.append(replay.reshape(x.shape[0], x.shape[1], -1))

    def run(x):
        if not layer.is_moe or state["replay"] is not None:
            return layer(x, cos, sin, mask, None, 0, state["replay"])
        rec: list = []
        out = layer(x, cos, sin, mask, None, 0, None, rec)
        state["replay"] = rec[0].reshape(-1, rec[0].shape[-1])
        if record is not None:
            record.append(rec[0])
        return out

    return checkpoint(run, x, use_reentrant=False)


def token_logprobs(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, routed_experts=None, return_entropy: bool = False):
    """Log-probabilities [B, T-1] of ``input_ids[:, 1:]`` given the prefix (teacher forcing), under
    softmax(logits / temperature). With ``return_entropy`` also the per-position entropy."""
    logits = model(input_ids, attention_mask, routed_experts=routed_experts)[:, :-1]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if return_entropy:
        return out, -(logp.exp() * logp).sum(-1)
    return out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
