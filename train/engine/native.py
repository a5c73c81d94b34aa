"""Native CPU forward for generation: prefill and decoding steps of the policy through fused C++
operators (``csrc/decode_cpu.cpp``) instead of ~80 small PyTorch calls per layer.

On CPU, generation with a small model is bound by per-operator overhead, not arithmetic. The
native ops run a whole attention block (norm, fused q/k/v projection, q/k norm + RoPE, KV-cache
write, masked softmax attention, output projection), a whole MoE block (router, top-k, experts
grouped and run in parallel, weighted combine) or dense MLP block per call, and sample a token per
row; matrix products stay in ATen (the same MKL/oneDNN kernels), the glue is vectorised loops.
:class:`~train.engine.TorchEngine` uses them for fp32 models on CPU; they compute what
``CausalLM.last_logits(ids, mask, cache=cache)`` computes (tests/test_native.py compares the two).
A cache whose first ``shared`` slots every row holds alike (:attr:`KVCache.shared`: a prefix the
prefix cache copied to every row, or one prompt fanned out to ``n`` samples) is attended to for all
rows at once there: per KV head, the rows' queries against one copy of those keys and values as two
matrix products, merged with each row's own slots in one softmax.
ZAYA1 (:class:`ZayaNativeDecoder`): its decoding steps run as one op per CCA attention block and one
per MoE block, its prefill in PyTorch (tests/test_zaya.py compares the steps with the PyTorch step).

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler with
OpenMP, and ninja: ``make system-deps`` installs a compiler, the ``ninja`` package comes with
Cascade) into torch's extension cache (``TORCH_EXTENSIONS_DIR``), named by a hash of the source,
flags, torch install and CPU. Where it cannot be built the engine keeps the PyTorch step and says so once.
``CASCADE_NATIVE_DECODE=0`` turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from train.model.modeling import (MLP, Attention, CausalLM, DecoderLayer, KVCache, SparseMoE, rope_cos_sin,
                                  running_positions)

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("csrc") / "decode_cpu.cpp"
_STATE: dict = {}


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
SHARED_MIN = 16  # shortest shared prefix (KVCache.shared) worth the batched attention path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def enabled() -> bool:
    return os.environ.get("CASCADE_NATIVE_DECODE", "1").strip().lower() not in ("0", "false", "no", "off")


# a build takes seconds to a minute: a build lock older than this was left by a process killed while it built
# (``os._exit`` on Ctrl-C, SIGKILL), and torch would wait on it for ever, saying nothing
STALE_LOCK_S = 600.0


def build_name() -> str:
    """The extension's name: its source, torch and this CPU's features (-march=native) in a hash."""
    code = _SRC.read_bytes()
    tag = hashlib.sha256(code + f"{torch.__version__} {torch.__file__}".encode()
                         + " ".join(_CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:12]
    return f"cascade_decode_cpu_{tag}"


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale native-build lock %s (%.0f s old: its builder was killed mid-build)", lock, age)
        lock.unlink(missing_ok=True)


def load() -> bool:
    """Build (first time) and load the extension; True when ``torch.ops.cascade_native`` is usable."""
    if "ok" in _STATE:
        return _STATE["ok"]
    try:
        from torch.utils import cpp_extension

        # pip's ninja lives next to this interpreter, which need not be on PATH
        bindir = str(Path(sys.executable).parent)
        if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        code = _SRC.read_bytes()
        name = build_name()
        # The build compiles a copy kept in its own folder: installs of the same source at other paths
        # (a checkout, a wheel) share the build instead of rebuilding each time the path changes.
        build_dir = Path(cpp_extension._get_build_directory(name, False))
        _clear_stale_lock(build_dir)
        src = build_dir / _SRC.name
        if not src.is_file() or src.read_bytes() != code:
            tmp = src.with_name(f".{src.name}.{os.getpid()}")
            tmp.write_bytes(code)
            os.replace(tmp, src)
        cpp_extension.load(name=name, sources=[str(src)], is_python_module=False,
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        _STATE["ok"] = True
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch step still works
        log.warning("native CPU decode unavailable, using the PyTorch step (%s: %s)", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        _STATE["ok"] = False
        _STATE["error"] = f"{type(e).__name__}: {e}"
    return _STATE["ok"]


def _standard(model) -> bool:
    """The architecture the ops implement: Cascade's CausalLM with its own attention and MLP/MoE
    modules (a subclass or module swap that changes the computation keeps the PyTorch path). Every
    family of ``config.architecture`` is covered: q/k RMSNorm or none, q/k/v and o_proj biases, RoPE
    scaling."""
    return (isinstance(model, CausalLM) and type(model).hidden_states is CausalLM.hidden_states
            and type(model).logits is CausalLM.logits
            and all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                    and type(layer.mlp) is (SparseMoE if layer.is_moe else MLP) for layer in model.model.layers))


def _standard_zaya(model) -> bool:
    """A ZAYA1 model built of exactly the modules of train/model/zaya.py (what :class:`ZayaNativeDecoder`
    implements)."""
    from train.model.modeling import Experts, RMSNorm
    from train.model.zaya import (CCAAttention, CCAProjection, QKNorm, ResidualScaling, RouterMLP, ZayaDecoderLayer,
                                  ZayaMoE, ZayaRouter)

    def ok(layer) -> bool:
        a, m = layer.self_attn, layer.mlp
        return (type(layer) is ZayaDecoderLayer and type(a) is CCAAttention and type(a.qkv_proj) is CCAProjection
                and type(a.qk_norm) is QKNorm and type(m) is ZayaMoE and type(m.gate) is ZayaRouter
                and type(m.gate.router_mlp) is RouterMLP and type(m.experts) is Experts
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                and type(layer.post_attention_residual_scale) is ResidualScaling
                and type(layer.post_mlp_residual_scale) is ResidualScaling)

    return (isinstance(model, CausalLM) and model.config.architecture == "zaya"
            and type(model).hidden_states is CausalLM.hidden_states and type(model).logits is CausalLM.logits
            and type(model)._zaya_layers is CausalLM._zaya_layers and all(ok(layer) for layer in model.model.layers))


def usable(model: CausalLM) -> bool:
    """Whether the native ops run for this model (CPU, fp32, the standard architecture, extension
    built, not disabled): :class:`NativeDecoder`, or for ZAYA1 :class:`ZayaNativeDecoder` (native
    decoding steps, PyTorch prefill). fp32 only, so the model's ``fp32_residual`` option changes
    nothing here; bf16 models keep the PyTorch step, which applies it."""
    return (enabled() and model.device.type == "cpu" and model.dtype == torch.float32
            and (_standard(model) or _standard_zaya(model)) and load())


def decoder(model: CausalLM):
    """The native decoder for ``model`` (:class:`ZayaNativeDecoder` for ZAYA1, else
    :class:`NativeDecoder`), or None where :func:`usable` says no (the PyTorch step then runs)."""
    if not usable(model):
        return None
    return ZayaNativeDecoder(model) if model.config.architecture == "zaya" else NativeDecoder(model)


class NativeDecoder:
    """Prefill and decoding steps of one model through the native ops. Holds the per-layer
    arguments, with the q/k/v projections (and a dense MLP's gate/up) stacked once at construction:
    make one per generation call, while the weights do not change (the torch engine makes one per
    batch, and a new one when weights are loaded in flight). Only fp32 CPU models (see :func:`usable`)."""

    def __init__(self, model: CausalLM):
        if not load():
            raise RuntimeError(f"the native decode extension is unavailable: {_STATE.get('error')}")
        self.model, cfg = model, model.config
        eps = cfg.rms_norm_eps
        self.layers = []
        with torch.inference_mode():
            for layer in model.model.layers:
                a, ln2 = layer.self_attn, layer.post_attention_layernorm
                bias = None if a.q_proj.bias is None else torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
                qk_norm = (a.q_norm.weight, a.k_norm.weight) if cfg.qk_norm else (None, None)  # Qwen2 / Llama: none
                attn = (layer.input_layernorm.weight, torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
                        bias, *qk_norm)
                attn_tail = (a.o_proj.weight, a.o_proj.bias, a.n_heads, a.n_kv, eps)
                m = layer.mlp
                if layer.is_moe:
                    mlp = ("moe", ln2.weight, m.gate.weight, m.experts.gate_up_proj, m.experts.down_proj,
                           m.gate.top_k, m.gate.norm_topk_prob, eps)
                else:
                    mlp = ("mlp", ln2.weight, torch.cat((m.gate_proj.weight, m.up_proj.weight)), m.down_proj.weight, eps)
                self.layers.append((attn, attn_tail, mlp))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None,
                record: list | None = None) -> torch.Tensor:
        """fp32 logits [B, V] at the last real token of each row, for tokens ``ids`` [B, T] appended at
        ``cache.length`` (``mask`` [B, T]: real tokens, None = all); updates the cache as
        ``model.last_logits(ids, mask, cache=cache)`` does. Only real tokens are computed: padded
        slots are masked for attention and their keys/values zeroed.

        ``record`` (a list): receives, per MoE layer, the expert ids [N, k] (int64) of the N real
        tokens in row-major order (router replay)."""
        model, cfg = self.model, self.model.config
        B, T = ids.shape
        s = cache.length
        if s + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {s + T} > {cache.capacity}")
        dense = mask is None or bool(mask.all())
        if not dense:
            mask = mask.to(torch.bool)
            if not bool(mask.any(1).all()):
                raise ValueError("every row needs at least one real token")
        cache.valid[:, s:s + T] = True if dense else mask
        pos = running_positions(cache.valid[:, :s + T])[:, s:].reshape(-1)
        if dense:
            rows = torch.arange(B).repeat_interleave(T)
            slots = torch.arange(s, s + T).repeat(B)
            flat_ids, counts = ids.reshape(-1), None
        else:
            for kv in cache.k + cache.v:  # padded slots are never attended; keep them finite
                kv[:, :, s:s + T].masked_fill_(~mask[:, None, :, None], 0.0)
            flat = mask.reshape(-1).nonzero().squeeze(1)
            rows, slots, pos = flat // T, s + flat % T, pos[flat]
            flat_ids, counts = ids.reshape(-1)[flat], mask.sum(1)
        x = model.model.embed_tokens(flat_ids)
        cos, sin = rope_cos_sin(pos[:, None], cfg.head_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        ops = torch.ops.cascade_native
        # a prefix every row holds (KVCache.shared): its keys and values read once for all rows
        shared = cache.shared if B >= 2 and cache.shared >= SHARED_MIN and s >= cache.shared else 0
        for i, (attn, attn_tail, mlp) in enumerate(self.layers):
            x = ops.attn_block(x, *attn, cos, sin, cache.k[i], cache.v[i], cache.valid, rows, slots, *attn_tail, shared)
            if mlp[0] == "moe":
                routed = None if record is None else torch.empty(x.shape[0], mlp[5], dtype=torch.long)
                x = ops.moe_block(x, *mlp[1:], routed)
                if record is not None:
                    record.append(routed)
            else:
                x = ops.mlp_block(x, *mlp[1:])
        cache.length = s + T
        if T > 1:  # each row's last real token (rows are contiguous in x)
            x = x[(torch.full((B,), T) if counts is None else counts).cumsum(0) - 1]
        return model.logits(model.model.norm(x))

    def step(self, tok: torch.Tensor, cache: KVCache, record: list | None = None) -> torch.Tensor:
        """One decoding step: logits [B, V] after appending ``tok`` [B] (one token per row)."""
        return self.forward(tok[:, None], cache, record=record)


class ZayaNativeDecoder:
    """ZAYA1 generation with native decoding steps: one fused op per CCA attention block
    (projections, both convolutions over the carried state, residual paths, q/k L2 norm + key
    temperature, partial RoPE, KV-cache and state updates, attention, ``o_proj``, residual scaling)
    and one per MoE block (router with depth averaging, top-1 + balancing bias, experts, residual
    scaling). Prefill (several tokens per row, padding) runs the PyTorch model, which writes the
    same cache (KV, convolution state, delayed value). Derived weights (the stacked projections, the
    conv weights as matrices, the q/k scales, the residual-scaling vectors) are built once at
    construction: make one per generation call, and a new one when weights change (as for
    :class:`NativeDecoder`). Only fp32 CPU models (see :func:`usable`)."""

    def __init__(self, model: CausalLM):
        if not load():
            raise RuntimeError(f"the native decode extension is unavailable: {_STATE.get('error')}")
        self.model, cfg = model, model.config
        self.layers = []
        with torch.inference_mode():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                pj = a.qkv_proj
                lin = (pj.q_proj, pj.k_proj, pj.v_proj_current, pj.v_proj_delayed)
                bias = None if pj.q_proj.bias is None else torch.cat([x.bias for x in lin])
                G, d = a.n_heads + a.n_kv, a.cfg.head_dim
                temp = a.qk_norm.temp
                qk_scale = (torch.cat([temp.new_ones(a.n_heads), temp]).to(torch.float32) * a.qk_norm.scale).contiguous()
                ra, rm = layer.post_attention_residual_scale, layer.post_mlp_residual_scale
                rs = [torch.stack((r.hidden_states_scale, r.hidden_states_bias, r.residual_scale, r.residual_bias))
                      for r in (ra, rm)]
                attn = (layer.input_layernorm.weight, torch.cat([x.weight for x in lin]), bias,
                        pj.conv_qk_depthwise.weight[:, 0].t().contiguous(), pj.conv_qk_depthwise.bias,
                        # [C, d_in, k1] -> [G, k1, d_in, d_out]
                        pj.conv_qk_grouped.weight.view(G, d, d, -1).permute(0, 3, 2, 1).contiguous(),
                        pj.conv_qk_grouped.bias)
                attn_tail = (a.o_proj.weight, a.o_proj.bias, rs[0], a.n_heads, a.n_kv, cfg.rms_norm_eps)
                gt, mlp = m.gate, m.gate.router_mlp
                moe = (layer.post_attention_layernorm.weight, gt.down_proj.weight, gt.down_proj.bias,
                       gt.router_states_scale if gt.use_eda else None, mlp.norm.weight, mlp.fc1.weight, mlp.fc1.bias,
                       mlp.fc2.weight, mlp.fc2.bias, mlp.out_proj.weight, gt.balancing_biases, m.experts.gate_up_proj,
                       m.experts.down_proj, rs[1], cfg.rms_norm_eps)
                self.layers.append((attn, qk_scale, attn_tail, moe))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None,
                record: list | None = None) -> torch.Tensor:
        """fp32 logits [B, V] at the last real token of each row for tokens ``ids`` [B, T] appended at
        ``cache.length`` (``mask`` [B, T]: real tokens, None = all), as ``NativeDecoder.forward``.
        One token per row after a prefill: the native step; anything else: the PyTorch model.
        ``record``: receives per layer the class ids [N, 1] (int64, N real tokens, row-major)."""
        model = self.model
        B, T = ids.shape
        dense = mask is None or bool(mask.all())
        if T == 1 and dense and cache.length > 0:
            return self._step(ids[:, 0], cache, record)
        rec: list | None = [] if record is not None else None
        h = model.hidden_states(ids, mask, cache=cache, record_routing=rec)
        if dense:
            last = h[:, -1]
        else:
            mask = mask.to(torch.bool)
            if not bool(mask.any(1).all()):
                raise ValueError("every row needs at least one real token")
            pos = torch.arange(T, device=mask.device).expand(B, T)
            last = h[torch.arange(B, device=h.device), pos.masked_fill(~mask, -1).amax(1)]
        if record is not None:
            record.extend(r.reshape(B * T, -1) if dense else r[mask] for r in rec)
        return model.logits(last)

    def step(self, tok: torch.Tensor, cache: KVCache, record: list | None = None) -> torch.Tensor:
        """One decoding step: logits [B, V] after appending ``tok`` [B] (one token per row)."""
        return self.forward(tok[:, None], cache, record=record)

    def _step(self, tok: torch.Tensor, cache: KVCache, record: list | None) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        s = cache.length
        if s + 1 > cache.capacity:
            raise ValueError(f"KV cache overflow: {s + 1} > {cache.capacity}")
        cache.valid[:, s] = True
        pos = running_positions(cache.valid[:, :s + 1])[:, s:]
        bb = model.model
        x = (bb.embed_tokens(tok) + bb.input_hidden_states_bias) * bb.input_hidden_states_scale
        cos, sin = rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        ops = torch.ops.cascade_native
        state = None
        for i, (attn, qk_scale, attn_tail, moe) in enumerate(self.layers):
            conv = cache.conv[i]
            if conv is not None and not conv.is_contiguous():
                conv = cache.conv[i] = conv.contiguous()
            if not cache.vstate[i].is_contiguous():
                cache.vstate[i] = cache.vstate[i].contiguous()
            x = ops.zaya_attn_step(x, *attn[:3], conv, *attn[3:], cache.vstate[i], qk_scale, cos, sin, cache.k[i],
                                   cache.v[i], cache.valid, s, *attn_tail)
            routed = None if record is None else torch.empty(x.shape[0], 1, dtype=torch.long)
            x, state = ops.zaya_moe_step(x, *moe[:3], state if moe[3] is not None else None, *moe[3:], routed)
            if record is not None:
                record.append(routed)
        cache.length = s + 1
        return model.logits(bb.norm(x))
