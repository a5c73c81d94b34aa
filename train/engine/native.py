"""Native CPU decoding: one step of the policy for a batch of single tokens through three fused
C++ operators (``csrc/decode_cpu.cpp``), instead of ~80 small PyTorch calls per layer.

On CPU a decoding step of a small model is bound by per-operator overhead, not arithmetic; the
native step keeps every matrix product in ATen (the same MKL/oneDNN kernels) and does the glue in
plain loops. It is used by :class:`~train.engine.TorchEngine` for fp32 models on CPU, and computes
what ``CausalLM.last_logits(tok[:, None], cache=cache)`` computes (tests compare the two).

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja; ``make system-deps`` installs them) into torch's extension cache, keyed by the source hash.
Where it cannot be built the engine keeps the pure-PyTorch step and says so once.
``CASCADE_NATIVE_DECODE=0`` turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import weakref
from pathlib import Path

import torch

from train.model.modeling import CausalLM, KVCache, rope_cos_sin

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("csrc") / "decode_cpu.cpp"
_STATE: dict = {}
_FUSED: "weakref.WeakKeyDictionary[CausalLM, dict]" = weakref.WeakKeyDictionary()


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
        tag = hashlib.sha256(_SRC.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
        cpp_extension.load(name=f"cascade_decode_cpu_{tag}", sources=[str(_SRC)], is_python_module=False,
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"], extra_ldflags=["-fopenmp"], verbose=False)
        _STATE["ok"] = True
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch step still works
        log.warning("native CPU decode unavailable, using the PyTorch step (%s: %s)", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        _STATE["ok"] = False
        _STATE["error"] = f"{type(e).__name__}: {e}"
    return _STATE["ok"]


def usable(model: CausalLM) -> bool:
    """Whether :func:`decode_logits` runs for this model (CPU, fp32, extension built, not disabled)."""
    return enabled() and model.device.type == "cpu" and model.dtype == torch.float32 and load()


def _versions(tensors) -> tuple:
    return tuple((t.data_ptr(), t._version) for t in tensors)


def _fused(model: CausalLM) -> list[dict]:
    """Per layer, the stacked weights the kernels take (q/k/v projections, a dense MLP's gate/up),
    rebuilt whenever a source parameter changes in place (weight sync, optimiser step)."""
    cache = _FUSED.setdefault(model, {})
    out = []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        src = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        if a.q_proj.bias is not None:
            src += [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
        if not layer.is_moe:
            src += [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]
        key = _versions(src)
        hit = cache.get(i)
        if hit is None or hit[0] != key:
            f = {"wqkv": torch.cat(src[:3]).contiguous(),
                 "bqkv": torch.cat(src[3:6]).contiguous() if a.q_proj.bias is not None else None}
            if not layer.is_moe:
                f["gate_up"] = torch.cat((layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)).contiguous()
            hit = cache[i] = (key, f)
        out.append(hit[1])
    return out


@torch.inference_mode()
def decode_logits(model: CausalLM, tok: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """fp32 logits [B, V] for one new token per row (``tok`` [B]) appended at ``cache.length``;
    updates the cache like ``model.last_logits(tok[:, None], cache=cache)``."""
    if not load():
        raise RuntimeError(f"the native decode extension is unavailable: {_STATE.get('error')}")
    cfg = model.config
    s = cache.length
    if s + 1 > cache.capacity:
        raise ValueError(f"KV cache overflow: {s + 1} > {cache.capacity}")
    cache.valid[:, s] = True
    pos = cache.valid[:, :s + 1].sum(-1, keepdim=True) - 1  # running count of real tokens, as in hidden_states
    x = model.model.embed_tokens(tok)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    ops = torch.ops.cascade_native
    for i, (layer, f) in enumerate(zip(model.model.layers, _fused(model))):
        a = layer.self_attn
        x = ops.attn_block(x, layer.input_layernorm.weight, f["wqkv"], f["bqkv"], a.q_norm.weight, a.k_norm.weight,
                           cos, sin, cache.k[i], cache.v[i], cache.valid, s, a.o_proj.weight, a.o_proj.bias,
                           a.n_heads, a.n_kv, cfg.rms_norm_eps)
        ln = layer.post_attention_layernorm
        if layer.is_moe:
            m = layer.mlp
            x = ops.moe_block(x, ln.weight, m.gate.weight, m.experts.gate_up_proj, m.experts.down_proj,
                              m.gate.top_k, m.gate.norm_topk_prob, cfg.rms_norm_eps)
        else:
            x = ops.mlp_block(x, ln.weight, f["gate_up"], layer.mlp.down_proj.weight, cfg.rms_norm_eps)
    cache.length = s + 1
    return model.logits(model.model.norm(x))
