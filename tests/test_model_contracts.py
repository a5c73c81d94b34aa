"""Config validation, MoE layer placement and routing, router replay and HF-format files of the policy model,
each against an independent expectation (transformers' own model, a hand-computed routing, hand-counted bytes)."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from train.model.config import ModelConfig
from train.model.hf_io import (CheckpointError, copy_tokenizer_files, load_pretrained, parse_size, save_pretrained,
                               write_weights)
from train.model.modeling import CausalLM, KVCache, Segments, SparseMoE, input_pad_id

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
HF_BASE = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def _tiny(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return CausalLM(cfg).init_weights(seed=seed, std=0.2).eval()


# -- config validation and config.json ---------------------------------------------------------------------


def test_validate_refuses_bad_shapes_and_accepts_the_bounds():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(**dict(SMALL, num_attention_heads=6, num_key_value_heads=4)).validate()
    # top-k may be every expert (transformers allows it), not more
    assert ModelConfig(**dict(MOE, num_experts_per_tok=4)).validate().num_experts_per_tok == 4
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**dict(MOE, num_experts_per_tok=5)).validate()
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(**dict(SMALL, architecture="llama", rope_scaling={"rope_type": "linear"})).validate()
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(**dict(SMALL, architecture="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                      "low_freq_factor": 1.0})).validate()
    with pytest.raises(ValueError, match="rotated dims"):  # a zaya head with no rotated dims at all
        ModelConfig(**dict(SMALL, architecture="zaya", num_experts=4, num_experts_per_tok=1,
                           partial_rotary_factor=0.0)).validate()
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict(dict(SMALL, hiden_size=32))


def test_from_hf_refuses_what_the_policy_does_not_implement():
    for extra, msg in (({"hidden_act": "gelu"}, "hidden_act"), ({"pretraining_tp": 2}, "pretraining_tp"),
                       ({"partial_rotary_factor": 0.5}, "partial rotary"),
                       ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
                        "partial rotary")):
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_hf({**HF_BASE, **extra})
    # the base frequency inside rope_scaling wins over the top-level one (transformers takes rope_scaling whole)
    cfg = ModelConfig.from_hf({**HF_BASE, "rope_theta": 1e4,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_moe_fields():
    moe = dict(HF_BASE, model_type="qwen3_moe", head_dim=8, num_experts_per_tok=2, moe_intermediate_size=16)
    # Mixtral-style spelling of the expert count
    assert ModelConfig.from_hf(dict(moe, num_local_experts=6)).num_experts == 6
    # transformers' Qwen3MoeConfig default is norm_topk_prob=False
    assert ModelConfig.from_hf(dict(moe, num_experts=4)).norm_topk_prob is False
    cfg = ModelConfig.from_hf(dict(moe, num_experts=4, num_hidden_layers=6, decoder_sparse_step=2,
                                   mlp_only_layers=[3]))
    assert cfg.decoder_sparse_step == 2 and cfg.mlp_only_layers == [3]
    # as transformers' Qwen3MoeDecoderLayer: MoE where (i + 1) % step == 0 and i not in mlp_only_layers
    assert [i for i in range(6) if cfg.layer_is_moe(i)] == [1, 5]
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back.decoder_sparse_step == 2 and back.mlp_only_layers == [3] and back == cfg


def test_to_hf_writes_the_pre_5_rope_scaling_key():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    d = ModelConfig(**dict(SMALL, architecture="llama", rope_scaling=scaling)).validate().to_hf()
    assert d["rope_scaling"] == {**scaling, "type": "llama3"}  # transformers 4.x and vLLM read this one


@pytest.mark.parametrize("kw", [dict(SMALL), dict(MOE), dict(MOE, num_hidden_layers=4, decoder_sparse_step=2),
                                dict(SMALL, tie_word_embeddings=True, attention_bias=True)])
def test_num_parameters_counts_the_modules_parameters(kw):
    cfg = ModelConfig(**kw).validate()
    with torch.device("meta"):
        m = CausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())


# -- MoE layers against transformers, routing and router replay ---------------------------------------------


def test_sparse_step_and_mlp_only_layers_match_transformers_and_roundtrip(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3]))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    hf.eval().save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert [layer.is_moe for layer in ours.model.layers] == [False, True, False, False, False, True]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids) - ref).abs().max().item() < 1e-4
        # replay is per MoE layer (two here), not per layer
        rec: list = []
        a = ours(ids, record_routing=rec)
        assert len(rec) == 2
        assert torch.allclose(ours(ids, routed_experts=rec), a, atol=1e-6)
    save_pretrained(ours, tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    again = load_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max().item() < 1e-4
        assert (again(ids) - ref).abs().max().item() < 1e-4


def _moe_by_hand(moe: SparseMoE, x: torch.Tensor, idx: torch.Tensor, norm: bool) -> torch.Tensor:
    probs = torch.softmax(x @ moe.gate.weight.T, -1)
    out = torch.zeros_like(x)
    inter = moe.experts.inter
    for t in range(x.shape[0]):
        w = probs[t, idx[t]]
        w = w / w.sum() if norm else w
        for j, e in enumerate(idx[t].tolist()):
            gu = moe.experts.gate_up_proj[e] @ x[t]
            out[t] += w[j] * (moe.experts.down_proj[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_router_picks_top_k_and_replay_forces_the_given_experts(norm):
    """Without replay the k most probable experts; with replay the given ones (weights: the router's own
    probabilities of those experts, renormalised with norm_topk_prob), with or without gradient."""
    cfg = ModelConfig(**dict(MOE, norm_topk_prob=norm)).validate()
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 1.0)
        moe.experts.gate_up_proj.normal_(0, 0.3)
        moe.experts.down_proj.normal_(0, 0.3)
    x = torch.randn(1, 7, 32)
    flat = x[0]
    natural = torch.topk(flat @ moe.gate.weight.T, 2, dim=-1).indices
    rec: list = []
    with torch.no_grad():
        got = moe(x, record=rec)[0]
    assert torch.equal(rec[0][0].sort(-1).values, natural.sort(-1).values)
    assert (got - _moe_by_hand(moe, flat, natural, norm)).abs().max().item() < 1e-5
    # the two experts the router likes least
    forced = torch.topk(-(flat @ moe.gate.weight.T), 2, dim=-1).indices
    want = _moe_by_hand(moe, flat, forced, norm).detach()
    with torch.no_grad():
        assert (moe(x, replay=forced)[0] - want).abs().max().item() < 1e-5
    out = moe(x, replay=forced)[0]  # with gradient: the same, and the router gets a gradient
    assert (out - want).abs().max().item() < 1e-5
    out.sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


# -- small pieces the engine and the trainer rely on --------------------------------------------------------


def test_input_pad_id_is_a_vocabulary_token():
    for pad, want in ((5, 5), (None, 0), (-1, 0), (64, 0), (63, 63)):
        assert input_pad_id(ModelConfig(**dict(SMALL, pad_token_id=pad))) == want


def test_segments_refuse_empty_sequences_and_packed_rows_refuse_a_mask():
    with pytest.raises(ValueError, match="cu_seqlens"):
        Segments.of([0, 3, 3, 5], 5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        Segments.of([0, 3, 4], 5)
    m = _tiny(ModelConfig(**SMALL).validate())
    ids = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(ids, attention_mask=torch.ones(1, 6), cu_seqlens=[0, 2, 6])


def test_kv_cache_fills_to_capacity_and_no_further():
    m = _tiny(ModelConfig(**SMALL).validate())
    ids = torch.randint(0, 64, (2, 6))
    cache = KVCache.allocate(m.config, 2, 6, "cpu", torch.float32)
    with torch.no_grad():
        m.last_logits(ids[:, :5], cache=cache)
        m.last_logits(ids[:, 5:], cache=cache)  # the last slot
        assert cache.length == 6
        with pytest.raises(ValueError, match="overflow"):
            m.last_logits(ids[:, 5:], cache=cache)


def test_cache_select_marks_one_unpadded_row_as_shared():
    m = _tiny(ModelConfig(**SMALL).validate())
    with torch.no_grad():
        one = KVCache.allocate(m.config, 1, 8, "cpu", torch.float32)
        m.last_logits(torch.tensor([[3, 4, 5]]), cache=one)
        fan = one.select(torch.zeros(3, dtype=torch.long))
        assert fan.shared == 3 and fan.length == 3 and fan.valid.shape == (3, 8)
        padded = KVCache.allocate(m.config, 1, 8, "cpu", torch.float32)
        m.last_logits(torch.tensor([[0, 4, 5]]), torch.tensor([[False, True, True]]), cache=padded)
        assert padded.select(torch.zeros(3, dtype=torch.long)).shared == 0


# -- HF-format files ------------------------------------------------------------------------------------------


def test_parse_size_units():
    assert parse_size(123) == 123
    assert parse_size("2KiB") == 2048 and parse_size("2KB") == 2000
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("1GiB") == 2**30 and parse_size(" 7 ") == 7
    with pytest.raises(ValueError, match="bad size"):
        parse_size("5 lots")


def test_write_weights_shards_only_past_the_limit_and_clears_an_earlier_save(tmp_path):
    sd = {"a": torch.zeros(4), "b": torch.ones(4), "c": torch.full((4,), 2.0)}  # 16 bytes each
    assert write_weights(sd, tmp_path, max_shard_size=48) == ["model.safetensors"]  # exactly at the limit: one
    names = write_weights(sd, tmp_path, max_shard_size=47)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": names[0], "b": names[0], "c": names[1]}
    assert index["metadata"]["total_size"] == 48
    # a later unsharded save leaves no shard or index behind (a loader would read the stale index)
    assert write_weights({"a": torch.ones(4)}, tmp_path) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def _moe_checkpoint(tmp_path):
    m = _tiny(ModelConfig(**dict(MOE, architecture="qwen3")).validate())
    save_pretrained(m, tmp_path / "ok")
    return m, tmp_path / "ok"


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_per_expert_checkpoints_must_hold_every_expert_part(tmp_path):
    m, ok = _moe_checkpoint(tmp_path)
    sd = load_file(str(ok / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sd and "model.layers.0.mlp.experts.gate_up_proj" not in sd
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.equal(load_pretrained(ok)(ids), m(ids))
    gone = _rewrite(ok, tmp_path / "gone", lambda sd: sd.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match="per-expert tensors"):
        load_pretrained(gone)
    extra = _rewrite(ok, tmp_path / "extra", lambda sd: sd.update({
        "model.layers.0.mlp.experts.4.down_proj.weight": sd["model.layers.0.mlp.experts.0.down_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_pretrained(extra)
    wide = _rewrite(ok, tmp_path / "wide", lambda sd: sd.update({"model.norm.weight": torch.ones(33)}))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_pretrained(wide)


def test_load_into_refuses_a_missing_expert():
    from train.model.hf_io import load_into, to_hf_state_dict

    m = _tiny(ModelConfig(**dict(MOE, architecture="qwen3")).validate())
    sd = {k: v for k, v in to_hf_state_dict(m).items() if ".experts.3." not in k or "layers.0" not in k}
    with pytest.raises(CheckpointError, match="expected experts 0..3"):
        load_into(_tiny(m.config, seed=1), sd)


def test_saved_files_dtype_tied_head_and_generation_config(tmp_path):
    m = _tiny(ModelConfig(**dict(SMALL, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).validate())
    save_pretrained(m, tmp_path / "bf16", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    sd = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert "lm_head.weight" not in sd and sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    # the source's generation config wins over the model config's ids; an explicit one wins over both
    m.config.generation_config = {"eos_token_id": [2, 7], "temperature": 0.6}
    save_pretrained(m, tmp_path / "src")
    gen = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 7] and gen["bos_token_id"] == 1 and gen["temperature"] == 0.6
    save_pretrained(m, tmp_path / "given", generation_config={"top_p": 0.9})
    gen = json.loads((tmp_path / "given" / "generation_config.json").read_text())
    assert gen["top_p"] == 0.9 and "temperature" not in gen and gen["eos_token_id"] == 2


def test_copy_tokenizer_files_leaves_the_generation_config(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        (src / n).write_text("{}")
    assert sorted(copy_tokenizer_files(src, dst)) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in dst.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


# -- the transformers fallback ------------------------------------------------------------------------------


def _gpt2():
    import transformers

    from train.model.hf_fallback import TransformersCausalLM

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                              n_positions=32))
    return TransformersCausalLM(hf.eval())


def test_fallback_refuses_router_replay_and_a_full_cache():
    m = _gpt2()
    ids = torch.randint(0, 64, (1, 4))
    with pytest.raises(ValueError, match="router replay"):
        m(ids, routed_experts=[torch.zeros(1, 4, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="router replay"):
        m(ids, record_routing=[])
    cache = m.allocate_cache(1, 5, "cpu", torch.float32)
    with torch.no_grad():
        m.last_logits(ids, cache=cache)
        m.last_logits(ids[:, :1], cache=cache)  # the last slot
        with pytest.raises(ValueError, match="overflow"):
            m.last_logits(ids[:, :1], cache=cache)


def test_fallback_load_weights_is_strict():
    from train.model.hf_fallback import load_weights_into

    m = _gpt2()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied to wte: may be absent
    load_weights_into(m, sd)
    with pytest.raises(CheckpointError, match="missing"):
        load_weights_into(m, {k: v for k, v in sd.items() if k != "transformer.ln_f.bias"})
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_weights_into(m, {**sd, "transformer.ln_f.bias": torch.zeros(33)})
