"""The policy model against transformers' own Qwen3 / Qwen3-MoE implementation."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import hf_random_model
from train.model.hf_io import CheckpointError, load_pretrained, save_pretrained
from train.model.modeling import Experts, CausalLM, token_logprobs
from train.model.config import ModelConfig


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_match_transformers_and_roundtrip(kind, tmp_path):
    hf = hf_random_model(kind, tie_word_embeddings=(kind == "dense"))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 320, (3, 23), generator=torch.Generator().manual_seed(1))
    am = torch.ones(3, 23, dtype=torch.long)
    am[1, :7] = 0  # left padding
    am[2, 19:] = 0  # right padding
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids) - ref).abs().max().item() < 1e-4
        ref_pad = hf(ids, attention_mask=am).logits
        got_pad = ours(ids, attention_mask=am)
        keep = am.bool()
        assert (got_pad - ref_pad)[keep].abs().max().item() < 1e-4
    # what Cascade saves opens in transformers with the same logits
    save_pretrained(ours, tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() < 1e-4
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_moe" if kind == "moe" else "qwen3")


def test_grouped_experts_match_per_expert_loop_forward_and_backward():
    cfg = ModelConfig(hidden_size=32, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    ex = Experts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.3)
        ex.down_proj.normal_(0, 0.3)
    x = torch.randn(37, 32, requires_grad=True)
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(37)])
    w = torch.rand(37, 2)
    out = ex(x, idx, w)
    ref = torch.zeros_like(out)
    for t in range(37):  # the straightforward definition
        for j in range(2):
            e = int(idx[t, j])
            gu = ex.gate_up_proj[e] @ x[t]
            h = torch.nn.functional.silu(gu[:24]) * gu[24:]
            ref[t] += w[t, j] * (ex.down_proj[e] @ h)
    assert (out - ref).abs().max().item() < 1e-5
    target = torch.randn_like(out)
    g1 = torch.autograd.grad(((out - target) ** 2).sum(), [x, ex.gate_up_proj, ex.down_proj])
    g2 = torch.autograd.grad(((ref - target) ** 2).sum(), [x, ex.gate_up_proj, ex.down_proj])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, inter", [(torch.bfloat16, 18), (torch.float32, 9), (torch.bfloat16, 16)])
def test_expert_widths_grouped_mm_cannot_take_still_train(dtype, inter, monkeypatch):
    """An expert width whose rows are not a multiple of 16 bytes (bf16 18, fp32 9): the first grouped product
    ran in forward and its backward failed ("strides should be multiple of 16 bytes") in a fresh process; such
    widths now take the per-group product, with the same values and gradients as the loop over experts."""
    from train.model import modeling
    from train.model.modeling import expert_mlp

    monkeypatch.setattr(modeling, "_GROUPED_MM_OK", {})  # (a fresh process: nothing learned about the device)
    torch.manual_seed(0)
    E, H = 4, 32
    x = torch.randn(10, H, dtype=dtype, requires_grad=True)
    gu = torch.randn(E, 2 * inter, H, dtype=dtype, requires_grad=True)
    dn = torch.randn(E, H, inter, dtype=dtype, requires_grad=True)
    idx, w = torch.randint(0, E, (10, 2)), torch.rand(10, 2, dtype=dtype)
    out = expert_mlp(x, w, idx, gu, dn)
    grads = torch.autograd.grad(out.float().square().sum(), [x, gu, dn])
    ref = torch.zeros(10, H, dtype=torch.float64)
    for t in range(10):
        for j in range(2):
            e = int(idx[t, j])
            h = gu[e].double() @ x[t].double()
            ref[t] += w[t, j].double() * (dn[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
    refg = torch.autograd.grad(ref.square().sum(), [x, gu, dn])
    for a, b in zip(grads, refg):
        assert (a.double() - b).abs().max().item() < 2 * tol * b.abs().max().item()


@pytest.mark.parametrize("hq,hk", [(4, 2), (4, 4), (6, 1)])
def test_decode_attention_equals_sdpa(hq, hk):
    """The single-query decode attention (two matmuls) == SDPA with the same boolean mask."""
    from train.model.modeling import build_mask, decode_attention

    torch.manual_seed(hq * 10 + hk)
    B, Tk, D = 5, 17, 8
    q, k, v = torch.randn(B, hq, 1, D), torch.randn(B, hk, Tk, D), torch.randn(B, hk, Tk, D)
    valid = torch.rand(B, Tk) > 0.4
    valid[:, -1] = False  # the query's own (last) slot counts even when not marked yet
    mask = build_mask(valid, torch.tensor([Tk - 1]), Tk)
    assert mask[:, 0, 0, -1].all()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hk)
    out = decode_attention(q, k, v, mask)
    assert out.shape == (B, hq, D)
    assert (out - ref[:, :, 0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_decoding_equals_full_forward_with_either_attention(tiny_moe_dir, monkeypatch, dtype):
    """Prefill + one-token steps through the KV cache give the full forward's logits, with the CPU
    matmul decode attention and with the SDPA path that other devices take."""
    from train.model import modeling

    m = load_pretrained(tiny_moe_dir, dtype=dtype).eval()
    ids = torch.randint(5, 1000, (3, 12))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4] = False  # a left-padded row
    with torch.no_grad():
        full = m(ids, mask)[:, -3:]
        for devices in ({"cpu"}, set()):
            monkeypatch.setattr(modeling, "DECODE_MATMUL_DEVICES", devices)
            cache = modeling.KVCache.allocate(m.config, 3, 16, "cpu", dtype)
            steps = [m.last_logits(ids[:, :10], mask[:, :10], cache=cache)]
            steps += [m.last_logits(ids[:, t:t + 1], cache=cache) for t in (10, 11)]
            tol = 1e-4 if dtype == torch.float32 else 0.05
            assert (torch.stack(steps, 1) - full).abs().max().item() < tol, devices


def test_router_replay_reproduces_routing(tiny_moe_dir):
    m = load_pretrained(tiny_moe_dir).eval()
    ids = torch.randint(5, 1000, (2, 11))
    rec: list = []
    with torch.no_grad():
        a = m(ids, record_routing=rec)
        b = m(ids, routed_experts=rec)
    assert len(rec) == m.config.num_hidden_layers
    assert torch.allclose(a, b, atol=1e-6)
    flipped = [r.flip(-1) for r in rec]  # same experts, other order: same output
    with torch.no_grad():
        assert torch.allclose(m(ids, routed_experts=flipped), a, atol=1e-5)


def test_token_logprobs_is_teacher_forcing(tiny_dense_dir):
    m = load_pretrained(tiny_dense_dir).eval()
    ids = torch.randint(5, 1000, (2, 9))
    with torch.no_grad():
        lp = token_logprobs(m, ids, temperature=0.5)
        full = torch.log_softmax(m(ids) / 0.5, -1)
    assert torch.allclose(lp[1, 3], full[1, 3, ids[1, 4]])


def test_bad_checkpoints_give_one_line_errors(tmp_path, tiny_dense_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_dense_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt weight file"):
        load_pretrained(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt config.json"):
        load_pretrained(bad)
    cfg = json.loads((tiny_dense_dir / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type"):
        load_pretrained(bad)


def test_presets_have_the_promised_sizes(tiny_moe_dir):
    m = load_pretrained(tiny_moe_dir)
    n = sum(p.numel() for p in m.parameters())
    assert 1_000_000 <= n <= 10_000_000
    assert m.config.num_experts >= 4 and m.config.num_experts_per_tok == 2
    assert isinstance(m, CausalLM)


# -- fp32 residual stream (ZAYA1's FP32 set) ----------------------------------------------------------


def test_fp32_residual_is_the_hand_cast_forward_and_closer_to_fp32(tiny_dense_dir, tmp_path):
    """With ``fp32_residual`` a bf16 model keeps the embedding output and every residual addition in
    fp32 while each block computes in bf16; its logits are closer to the fp32 model's (same bf16-rounded
    weights) than those of the all-bf16 stream."""
    import copy

    from train.model.modeling import rope_cos_sin

    on = load_pretrained(tiny_dense_dir, dtype=torch.bfloat16).eval()
    assert on.config.fp32_residual  # the default: on for bf16 runs
    off = copy.deepcopy(on)
    off.config.fp32_residual = False
    ref = copy.deepcopy(on).float()  # the fp32 model with the same (bf16-rounded) weights
    ids = torch.randint(5, on.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got_on, got_off, want = on(ids), off(ids), ref(ids)
        # the hand-cast reference: fp32 stream, bf16 blocks, results added in fp32
        cfg = on.config
        x = on.model.embed_tokens(ids).float()
        cos, sin = rope_cos_sin(torch.arange(64).expand(4, 64), cfg.head_dim, cfg.rope_theta, torch.bfloat16)
        for layer in on.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x).to(torch.bfloat16), cos, sin, None).float()
            x = x + layer.mlp(layer.post_attention_layernorm(x).to(torch.bfloat16)).float()
        hand = on.logits(on.model.norm(x))
    assert torch.equal(got_on, hand)
    err_on, err_off = (got_on - want).abs().mean().item(), (got_off - want).abs().mean().item()
    assert err_on < 0.85 * err_off, (err_on, err_off)
    # a no-op in fp32; saved to config.json and read back (the engine's servers load the same option)
    ref_off = copy.deepcopy(ref)
    ref_off.config.fp32_residual = False
    with torch.no_grad():
        assert torch.equal(ref(ids), ref_off(ids))
    save_pretrained(off, tmp_path / "off")
    assert json.loads((tmp_path / "off" / "config.json").read_text())["fp32_residual"] is False
    assert load_pretrained(tmp_path / "off").config.fp32_residual is False


def test_bf16_engine_decode_matches_teacher_forcing(tiny_dense_dir):
    """The torch engine decodes with the policy's own modeling code: a bf16 policy with the option on
    samples with the log-probs its teacher-forced forward gives (within bf16 kernel-shape noise), and
    nearer those than the log-probs of the all-bf16 stream (the engine applies the option too)."""
    import copy

    from train.engine import TorchEngine
    from train.engine.base import SamplingParams
    from train.tokenizer import load_tokenizer

    m = load_pretrained(tiny_dense_dir, dtype=torch.bfloat16).eval()
    off = copy.deepcopy(m)
    off.config.fp32_residual = False
    eng = TorchEngine(m, load_tokenizer(tiny_dense_dir))
    prompts = [[5, 17, 300, 42, 9], [7, 8, 9], [100, 200, 300, 400, 500, 600], [11]]
    comps = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=3, n=2))
    d_on, d_off = [], []
    for c in comps:
        p, got = prompts[c.prompt_index], torch.tensor(c.logprobs)
        assert len(c.token_ids) == 24
        with torch.no_grad():
            d_on.append((token_logprobs(m, torch.tensor([p + c.token_ids]))[0, len(p) - 1:] - got).abs())
            d_off.append((token_logprobs(off, torch.tensor([p + c.token_ids]))[0, len(p) - 1:] - got).abs())
    d_on, d_off = torch.cat(d_on), torch.cat(d_off)
    assert d_on.max().item() < 0.02
    assert d_on.mean().item() < 0.85 * d_off.mean().item(), (d_on.mean().item(), d_off.mean().item())


def test_segments_cu_seqlens_made_once_per_device():
    """The packed attention's varlen bounds: int32 ``cu_seqlens``, one tensor per device that every
    layer reads (not rebuilt per layer)."""
    from train.model.modeling import Segments

    seg = Segments.of([0, 3, 10, 11], 11)
    cu = seg.cu_seqlens("cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 10, 11]
    assert seg.cu_seqlens(torch.device("cpu")) is cu
    assert seg == Segments.of([0, 3, 10, 11], 11)  # the cache is not part of equality
