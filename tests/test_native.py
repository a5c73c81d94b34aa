"""The native CPU forward (train/engine/native.py, csrc/decode_cpu.cpp) against the PyTorch model.

The extension must build wherever the README's setup ran (a C++ compiler and ninja); set
CASCADE_NATIVE_DECODE=0 to run without it, and these tests are then skipped.
"""
import os
import time

import numpy as np
import pytest
import torch

from train.engine import SamplingParams, TorchEngine, native
from train.engine.sampling import sample, uniforms
from train.model.config import ModelConfig
from train.model.hf_io import load_pretrained
from train.model.modeling import CausalLM, KVCache

pytestmark = pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")


def test_extension_builds():
    assert native.load(), native._STATE.get("error")


def _model(seed=0, **kw):
    base = dict(vocab_size=203, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=80, max_position_embeddings=256)
    base.update(kw)
    m = CausalLM(ModelConfig(**base)).init_weights(seed, std=0.15).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return m


CONFIGS = {
    "moe-gqa": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24),
    "moe-no-renorm-top3": dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False),
    "moe-mixed-layers": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1]),
    "dense-mha-bias": dict(num_key_value_heads=4, attention_bias=True),
    "dense-mqa-d32": dict(num_attention_heads=6, num_key_value_heads=1, head_dim=32),
    "dense-odd-head-dim": dict(head_dim=10),  # no vector specialisation: the plain loops
    "qwen2-bias-no-qk-norm": dict(architecture="qwen2", attention_bias=True),
    "llama-llama3-rope": dict(architecture="llama", num_key_value_heads=1, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
}


def _left_padded(B, L, seed, pads):
    """``B`` rows of ``L`` random token ids and their mask, row i's first ``pads[i]`` positions padding."""
    ids = torch.randint(0, 203, (B, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, L, dtype=torch.bool)
    for i, n in enumerate(pads):
        mask[i, :n] = False
    return ids, mask


def _clone(c: KVCache) -> KVCache:
    return KVCache([k.clone() for k in c.k], [v.clone() for v in c.v], c.valid.clone(), c.length)


def _close_caches(a: KVCache, b: KVCache):
    assert a.length == b.length and torch.equal(a.valid, b.valid)
    keep = a.valid[:, :a.length][:, None, :, None]
    for x, y in zip(a.k + a.v, b.k + b.v):
        torch.testing.assert_close(x[:, :, :a.length] * keep, y[:, :, :a.length] * keep, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("threads", [1, 2])
def test_forward_matches_the_model(kind, threads):
    """Left-padded prefill, one-token steps, then an unpadded multi-token chunk: the native forward
    gives the model's last-position logits and the same KV cache."""
    m = _model(**CONFIGS[kind])
    B, L = 5, 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 203, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    for i in range(B):
        mask[i, :2 * i] = False  # row 4 is 1 real token
    dec = native.NativeDecoder(m)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            ref_cache = KVCache.allocate(m.config, B, L + 12, "cpu", torch.float32)
            ref = m.last_logits(ids, mask, cache=ref_cache)
            cache = KVCache.allocate(m.config, B, L + 12, "cpu", torch.float32)
            out = dec.forward(ids, cache, mask)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            _close_caches(ref_cache, cache)
            tok = ref.argmax(-1)
            for _ in range(4):
                ref = m.last_logits(tok[:, None], cache=ref_cache)
                torch.testing.assert_close(dec.step(tok, cache), ref, rtol=1e-5, atol=1e-5)
                tok = ref.argmax(-1)
            chunk = torch.randint(0, 203, (B, 3), generator=g)
            torch.testing.assert_close(dec.forward(chunk, cache), m.last_logits(chunk, cache=ref_cache),
                                       rtol=1e-5, atol=1e-5)
            _close_caches(ref_cache, cache)
    finally:
        torch.set_num_threads(old)


def test_long_context_softmax_and_rows_of_different_lengths():
    """Hundreds of keys (the vectorised exp over many blocks), rows whose real lengths differ a lot."""
    m = _model(**CONFIGS["moe-gqa"])
    B, L = 3, 200
    ids, mask = _left_padded(B, L, 2, [0, 150, 199])
    with torch.inference_mode():
        c1 = KVCache.allocate(m.config, B, L + 2, "cpu", torch.float32)
        c2 = KVCache.allocate(m.config, B, L + 2, "cpu", torch.float32)
        ref = m.last_logits(ids, mask, cache=c1)
        out = native.NativeDecoder(m).forward(ids, c2, mask)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        tok = ref.argmax(-1)
        torch.testing.assert_close(native.NativeDecoder(m).step(tok, c2), m.last_logits(tok[:, None], cache=c1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["moe-gqa", "dense-mqa-d32", "dense-odd-head-dim", "qwen2-bias-no-qk-norm"])
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_prefix_is_read_once_and_gives_the_models_logits(kind, threads, monkeypatch):
    """A prefix copied to every row (KVCache.shared, as the prefix cache lays it out: prefix, padding,
    suffix) takes the batched attention path: suffix prefill and decoding steps give the PyTorch model's
    logits (which attends row by row), and the path is really taken (disabling it changes nothing else)."""
    m = _model(**CONFIGS[kind])
    B, P, Ls = 4, 40, 5
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 203, (1, P), generator=g)
    suffix = torch.randint(0, 203, (B, Ls), generator=g)
    mask = torch.ones(B, Ls, dtype=torch.bool)
    for i in range(B):
        mask[i, :i] = False  # suffixes of different lengths, left-padded after the prefix
    calls = []
    native.load()  # (the op exists once the extension is loaded: this test may run first)
    real = torch.ops.cascade_native.attn_block

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            ref_cache = KVCache.allocate(m.config, B, P + Ls + 8, "cpu", torch.float32)
            m.hidden_states(prefix.expand(B, P), cache=ref_cache)
            ref = m.last_logits(suffix, mask, cache=ref_cache)
            one = KVCache.allocate(m.config, 1, P, "cpu", torch.float32)
            dec = native.NativeDecoder(m)
            dec.forward(prefix, one)
            cache = KVCache.allocate(m.config, B, P + Ls + 8, "cpu", torch.float32)
            for layer in range(m.config.num_hidden_layers):
                cache.k[layer][:, :, :P] = one.k[layer]
                cache.v[layer][:, :, :P] = one.v[layer]
            cache.valid[:, :P] = True
            cache.length = cache.shared = P
            monkeypatch.setattr(torch.ops.cascade_native, "attn_block", spy, raising=False)
            torch.testing.assert_close(dec.forward(suffix, cache, mask), ref, rtol=1e-5, atol=1e-5)
            tok = ref.argmax(-1)
            for _ in range(4):
                ref = m.last_logits(tok[:, None], cache=ref_cache)
                torch.testing.assert_close(dec.step(tok, cache), ref, rtol=1e-5, atol=1e-5)
                tok = ref.argmax(-1)
            kept = cache.keep(torch.tensor([1, 3]))  # finished rows dropped: the rest still share the prefix
            ref = m.last_logits(tok[[1, 3], None], cache=ref_cache.keep(torch.tensor([1, 3])))
            torch.testing.assert_close(dec.step(tok[[1, 3]], kept), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)
    assert calls and all(c == P for c in calls), calls[:8]


def test_one_prompt_fanned_out_shares_it():
    """n samples of one unpadded prompt (KVCache.select of one row) share the whole prompt; a padded
    batch does not."""
    m = _model(**CONFIGS["moe-gqa"])
    with torch.inference_mode():
        c = KVCache.allocate(m.config, 1, 30, "cpu", torch.float32)
        m.hidden_states(torch.randint(0, 203, (1, 20)), cache=c)
        assert c.select(torch.zeros(4, dtype=torch.long)).shared == 20
        two = KVCache.allocate(m.config, 2, 30, "cpu", torch.float32)
        mask = torch.ones(2, 20, dtype=torch.bool)
        mask[1, :3] = False
        m.hidden_states(torch.randint(0, 203, (2, 20)), mask, cache=two)
        assert two.select(torch.tensor([0, 0, 1, 1])).shared == 0


def test_engine_generates_the_same_with_and_without_native(tiny_moe_dir, monkeypatch):
    """Greedy tokens equal; seeded samples equal (same uniforms, same inverse transform); logprobs close."""
    eng = TorchEngine.from_pretrained(tiny_moe_dir)
    with torch.no_grad():
        eng.model.lm_head.weight.mul_(3.0)
    prompts = [eng.tokenizer.encode(t) for t in ("What is 2+2?", "Sort 5 3 9 1, explain why.", "Hi")]
    for sp in (SamplingParams(temperature=0, max_tokens=16), SamplingParams(n=3, temperature=0.8, max_tokens=16, seed=5)):
        fast = eng.generate(prompts, sp)
        monkeypatch.setenv("CASCADE_NATIVE_DECODE", "0")
        assert not native.usable(eng.model)
        slow = eng.generate(prompts, sp)
        monkeypatch.delenv("CASCADE_NATIVE_DECODE")
        assert native.usable(eng.model)
        for a, b in zip(fast, slow):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_native_sampler_matches_the_torch_sampler():
    """Same tokens as train.engine.sampling's torch path for (nearly) every draw, same logprobs, over
    vocabularies that are and are not multiples of 16, peaked and flat rows, and -inf entries."""
    g = torch.Generator().manual_seed(0)
    for V, T in ((1024, 1.0), (203, 0.7), (7, 1.3)):
        logits = torch.randn(64, V, generator=g) * torch.linspace(0.1, 8.0, 64)[:, None]
        logits[5, : V // 2] = float("-inf")
        seeds = np.arange(64, dtype=np.uint64) * 7919 + V
        p = SamplingParams(temperature=T)
        same = total = 0
        for step in range(60):
            t_ref, lp_ref = sample(logits, p, seeds, step)
            t_nat, lp_nat = sample(logits, p, seeds, step, native=True)
            assert not torch.isinf(logits[5, t_nat[5]])
            hit = t_ref == t_nat
            same += int(hit.sum())
            total += hit.numel()
            torch.testing.assert_close(lp_nat[hit], lp_ref[hit], rtol=0, atol=1e-5)
        assert same >= total - 1, (V, same, total)  # a draw may fall within rounding of a token boundary


def test_native_sampler_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf")])
    probs = torch.softmax(logits / 0.7, -1).double()
    n = 6000
    u = torch.from_numpy(uniforms(np.arange(n, dtype=np.uint64) * 7919, 3))
    toks, lps = torch.ops.cascade_native.sample_rows(logits.expand(n, -1).contiguous(), 0.7, u)
    counts = torch.bincount(toks, minlength=7).double()
    assert counts[6] == 0
    expected = probs[:6] * n
    assert (((counts[:6] - expected) ** 2) / expected).sum().item() < 25.0
    torch.testing.assert_close(lps, torch.log(probs.float())[toks], rtol=0, atol=1e-5)


def test_bad_input_is_a_clear_error():
    m = _model(**CONFIGS["moe-gqa"])
    dec = native.NativeDecoder(m)
    cache = KVCache.allocate(m.config, 2, 4, "cpu", torch.float32)
    with pytest.raises(ValueError, match="KV cache overflow"):
        dec.forward(torch.zeros(2, 5, dtype=torch.long), cache)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.cascade_native.sample_rows(torch.zeros(2, 8, dtype=torch.float64), 1.0, torch.zeros(2))
    with pytest.raises(RuntimeError, match="temperature"):
        torch.ops.cascade_native.sample_rows(torch.zeros(2, 8), 0.0, torch.zeros(2))
    # rows without a finite logit do not crash: token 0 and a NaN logprob
    bad = torch.tensor([[float("-inf")] * 5, [float("nan")] * 5, [0.0, 1.0, float("nan"), 2.0, 3.0]])
    tok, lp = torch.ops.cascade_native.sample_rows(bad, 1.0, torch.tensor([0.5, 0.5, 0.5]))
    assert tok[:2].tolist() == [0, 0] and torch.isnan(lp[:2]).all() and 0 <= int(tok[2]) < 5


def test_engine_falls_back_when_the_extension_is_missing(tiny_dense_dir, monkeypatch):
    eng = TorchEngine.from_pretrained(tiny_dense_dir)
    ref = eng.generate(["Hi there"], SamplingParams(temperature=0, max_tokens=6))
    monkeypatch.setattr(native, "_STATE", {"ok": False, "error": "no compiler"})
    assert not native.usable(eng.model)
    assert eng.generate(["Hi there"], SamplingParams(temperature=0, max_tokens=6))[0].token_ids == ref[0].token_ids
    bf16 = load_pretrained(tiny_dense_dir, dtype=torch.bfloat16)
    monkeypatch.setattr(native, "_STATE", {"ok": True})
    assert not native.usable(bf16)  # fp32 only: other dtypes keep the PyTorch step
    assert native.usable(eng.model)

    class Scaled(torch.nn.Module):  # a swapped-in module the ops do not implement
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    eng.model.model.layers[0].mlp = Scaled(eng.model.model.layers[0].mlp)
    assert not native.usable(eng.model)


def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_next_load(tmp_path):
    """A process killed while it built the extension (ttc's Ctrl-C leaves with os._exit; a SIGKILL) left torch's build
    lock behind, and every later load waited on it for ever, silently. A lock older than any build is removed (with a
    warning) before the build. (torch's build stands in: it takes the lock as torch does, or says it would wait.)"""
    import subprocess
    import sys

    ext = tmp_path / "ext"
    lock = ext / native.build_name() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    code = """if True:
        import os, sys
        from torch.utils import cpp_extension, file_baton
        from train.engine import native
        def build(name, **kw):  # torch's: a lock it cannot take is waited on, for ever
            baton = file_baton.FileBaton(os.path.join(cpp_extension._get_build_directory(name, False), "lock"))
            if not baton.try_acquire():
                sys.exit(3)
            baton.release()
        cpp_extension.load = build
        native.load()
        """
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 3 and lock.exists()  # a lock of a build under way (seconds old) is waited on
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "stale native-build lock" in r.stderr, r.stderr[-2000:]
    assert not lock.exists()


def test_the_switch_reads_common_spellings_of_off(monkeypatch):
    for off in ("0", "false", "False", " OFF ", "no"):
        monkeypatch.setenv("CASCADE_NATIVE_DECODE", off)
        assert not native.enabled(), off
    monkeypatch.delenv("CASCADE_NATIVE_DECODE")
    assert native.enabled()


def test_build_name_follows_the_cpu_features(monkeypatch):
    """-march=native: a build for one CPU's features is not loaded on another (shared TORCH_EXTENSIONS_DIR)."""
    name = native.build_name()
    assert name == native.build_name() and name.startswith("cascade_decode_cpu_")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags\t\t: fpu sse2")
    assert native.build_name() != name


def test_only_the_implemented_modules_on_cpu_take_the_native_path():
    from train.model.modeling import Attention

    m = _model(**CONFIGS["moe-gqa"])
    assert native.usable(m) and isinstance(native.decoder(m), native.NativeDecoder)

    class OwnLogits(CausalLM):
        def logits(self, h):
            return 2 * super().logits(h)

    sub = _model(**CONFIGS["moe-gqa"])
    sub.__class__ = OwnLogits
    assert not native.usable(sub) and native.decoder(sub) is None

    class OwnAttention(Attention):
        pass

    swapped = _model(**CONFIGS["moe-gqa"])
    swapped.model.layers[1].self_attn.__class__ = OwnAttention
    assert not native.usable(swapped)
    assert not native.usable(_model(**CONFIGS["moe-gqa"]).to("meta"))  # not on the CPU


def test_a_cache_filled_exactly_and_rows_without_tokens():
    m = _model(**CONFIGS["dense-mha-bias"])
    dec = native.NativeDecoder(m)
    ids = torch.randint(0, 203, (2, 4), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = m.last_logits(ids, cache=KVCache.allocate(m.config, 2, 4, "cpu", torch.float32))
        cache = KVCache.allocate(m.config, 2, 4, "cpu", torch.float32)
        torch.testing.assert_close(dec.forward(ids, cache), ref, rtol=1e-5, atol=1e-5)
        assert cache.length == 4
        with pytest.raises(ValueError, match="KV cache overflow: 5 > 4"):
            dec.step(ids[:, 0], cache)
        mask = torch.ones(2, 4, dtype=torch.bool)
        mask[1] = False
        with pytest.raises(ValueError, match="at least one real token"):
            dec.forward(ids, KVCache.allocate(m.config, 2, 8, "cpu", torch.float32), mask)


def test_a_reused_cache_gets_its_padded_slots_zeroed():
    """Padded slots of a cache that held something before (NaN here) are zeroed, so the decoding steps stay
    finite and equal the model's."""
    m = _model(**CONFIGS["moe-gqa"])
    B, L = 3, 6
    ids, mask = _left_padded(B, L, 5, [0, 2, 5])
    with torch.inference_mode():
        ref_cache = KVCache.allocate(m.config, B, L + 3, "cpu", torch.float32)
        ref = m.last_logits(ids, mask, cache=ref_cache)
        cache = KVCache.allocate(m.config, B, L + 3, "cpu", torch.float32)
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
        dec = native.NativeDecoder(m)
        torch.testing.assert_close(dec.forward(ids, cache, mask), ref, rtol=1e-5, atol=1e-5)
        pad = ~mask[:, None, :, None]
        for t in cache.k + cache.v:
            assert bool((t[:, :, :L].masked_select(pad.expand_as(t[:, :, :L])) == 0).all())
        tok = ref.argmax(-1)
        torch.testing.assert_close(dec.step(tok, cache), m.last_logits(tok[:, None], cache=ref_cache),
                                   rtol=1e-5, atol=1e-5)


def test_router_replay_records_the_models_experts_for_real_tokens():
    m = _model(**CONFIGS["moe-mixed-layers"])
    B, L = 2, 5
    ids, mask = _left_padded(B, L, 6, [0, 3])
    with torch.inference_mode():
        ref = []
        m.hidden_states(ids, mask, cache=KVCache.allocate(m.config, B, L, "cpu", torch.float32), record_routing=ref)
        got = []
        native.NativeDecoder(m).forward(ids, KVCache.allocate(m.config, B, L, "cpu", torch.float32), mask, record=got)
    assert len(got) == len(ref) == 2  # the MoE layers (layer 1 is dense)
    for g, r in zip(got, ref):
        assert g.dtype == torch.long and g.shape == (7, 2)
        assert torch.equal(g.sort(-1).values, r[mask].sort(-1).values)


def test_the_shared_prefix_path_needs_two_rows_and_a_prefix_of_shared_min_tokens(monkeypatch):
    """KVCache.shared takes the batched attention path from SHARED_MIN shared tokens and two rows on (one token
    shorter, or one row, attends row by row); either way the logits are the PyTorch model's."""
    assert native.load(), native._STATE.get("error")
    m = _model(**CONFIGS["moe-gqa"])
    calls = []
    real = torch.ops.cascade_native.attn_block

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(torch.ops.cascade_native, "attn_block", spy, raising=False)
    g = torch.Generator().manual_seed(4)
    for B, P, want in ((3, native.SHARED_MIN, native.SHARED_MIN), (3, native.SHARED_MIN - 1, 0),
                       (1, native.SHARED_MIN + 4, 0)):
        prefix = torch.randint(0, 203, (1, P), generator=g)
        tok = torch.randint(0, 203, (B,), generator=g)
        with torch.inference_mode():
            ref_cache = KVCache.allocate(m.config, B, P + 2, "cpu", torch.float32)
            m.hidden_states(prefix.expand(B, P), cache=ref_cache)
            ref = m.last_logits(tok[:, None], cache=ref_cache)
            dec = native.NativeDecoder(m)
            cache = KVCache.allocate(m.config, B, P + 2, "cpu", torch.float32)
            dec.forward(prefix.expand(B, P), cache)
            cache.shared = P
            calls.clear()
            torch.testing.assert_close(dec.step(tok, cache), ref, rtol=1e-5, atol=1e-5)
        assert calls == [want] * m.config.num_hidden_layers, (B, P, calls)
