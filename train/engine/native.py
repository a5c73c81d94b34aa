"""Native CPU forward for generation: prefill and decoding steps of the policy through fused C++
operators (``csrc/decode_cpu.cpp``) instead of ~80 small PyTorch calls per layer.

On CPU, generation with a small model is bound by per-operator overhead, not arithmetic. The
native ops run a whole attention block (norm, fused q/k/v projection, q/k norm + RoPE, KV-cache
write, masked softmax attention, output projection), a whole MoE block (router, top-k, experts
grouped and run in parallel, weighted combine) or dense MLP block per call, and sample a token per
row; matrix products stay in ATen (the same MKL/oneDNN kernels), the glue is vectorised loops.
:class:`~train.engine.TorchEngine` uses them for fp32 models on CPU; they compute what
``CausalLM.last_logits(ids, mask, cache=cache)`` computes (tests/test_native.py compares the two).

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
from pathlib import Path

import torch

from train.model.modeling import (MLP, Attention, CausalLM, DecoderLayer, KVCache, SparseMoE, rope_cos_sin,
                                  running_positions)

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("csrc") / "decode_cpu.cpp"
_STATE: dict = {}


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


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
        # -march=native: the build is for this CPU, so the CPU's features are part of its name
        code = _SRC.read_bytes()
        tag = hashlib.sha256(code + f"{torch.__version__} {torch.__file__}".encode()
                             + " ".join(_CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:12]
        name = f"cascade_decode_cpu_{tag}"
        # The build compiles a copy kept in its own folder: installs of the same source at other paths
        # (a checkout, a wheel) share the build instead of rebuilding each time the path changes.
        src = Path(cpp_extension._get_build_directory(name, False)) / _SRC.name
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


def usable(model: CausalLM) -> bool:
    """Whether :class:`NativeDecoder` runs for this model (CPU, fp32, the standard architecture,
    extension built, not disabled). fp32 only, so the model's ``fp32_residual`` option changes nothing
    here; bf16 models keep the PyTorch step, which applies it."""
    return (enabled() and model.device.type == "cpu" and model.dtype == torch.float32 and _standard(model)
            and load())


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
        for i, (attn, attn_tail, mlp) in enumerate(self.layers):
            x = ops.attn_block(x, *attn, cos, sin, cache.k[i], cache.v[i], cache.valid, rows, slots, *attn_tail)
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
