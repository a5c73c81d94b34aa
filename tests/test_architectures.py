"""Qwen2 and Llama in Cascade's own model, the transformers fallback for other causal LMs, and standard
checkpoints (sharding, generation_config.json, transformers_version). Every model is built locally."""
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from train.engine import TorchEngine, native
from train.engine.base import SamplingParams
from train.model.config import ModelConfig
from train.model.hf_io import CheckpointError, load_into, load_pretrained, save_pretrained
from train.model.modeling import CausalLM, token_logprobs

V = 320
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_tiny(kind: str, seed: int = 0, **kw):
    """A tiny random transformers model of family ``kind``, weights spread out (attention far from uniform)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, **kw})
    elif kind == "llama":
        cfg = transformers.LlamaConfig(**{**common, "head_dim": 16, **kw})
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                                      eos_token_id=2, **kw)
    else:
        raise ValueError(kind)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def _ids_and_mask(T=40, seed=1):
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(seed))
    am = torch.ones(3, T, dtype=torch.long)
    am[1, :7] = 0  # left padding
    am[2, T - 10:] = 0  # right padding
    return ids, am


CASES = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen2_llama_logits_match_transformers_with_padding_and_roundtrip(case, tmp_path):
    kind, kw = CASES[case]
    hf = hf_tiny(kind, **kw)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert isinstance(ours, CausalLM) and ours.config.architecture == kind
    assert ours.config.qk_norm is False
    ids, am = _ids_and_mask()
    keep = am.bool()
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
        assert (got - ref).abs().max().item() < 1e-4
        assert (ours(ids, am) - hf(ids, attention_mask=am).logits)[keep].abs().max().item() < 1e-4
    # Cascade's own save opens in transformers (same class) with the same logits
    save_pretrained(ours, tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max().item() < 1e-4
        assert (back(ids, attention_mask=am).logits - ours(ids, am))[keep].abs().max().item() < 1e-4
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == kind and saved["tie_word_embeddings"] == kw.get("tie_word_embeddings", False)
    assert load_pretrained(tmp_path / "ours").config == ours.config


def test_rope_scaling_is_applied_not_ignored(tmp_path):
    """The Llama 3.1 scaling changes the logits beyond the original context; dropping it would be caught."""
    hf = hf_tiny("llama", rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    plain = load_pretrained(tmp_path / "hf").eval()
    plain.config.rope_scaling = None
    ids, _ = _ids_and_mask()
    with torch.no_grad():
        assert (plain(ids) - hf(ids).logits).abs().max().item() > 1e-2
        assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_qwen2_sliding_window_fields_ignored_when_off_refused_when_on(tmp_path):
    hf = hf_tiny("qwen2", use_sliding_window=False, sliding_window=4096, max_window_layers=1)
    hf.save_pretrained(tmp_path / "off")
    assert load_pretrained(tmp_path / "off").config.architecture == "qwen2"
    cfg = json.loads((tmp_path / "off" / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8)
    (tmp_path / "off" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window"):
        load_pretrained(tmp_path / "off", backend="cascade")


def test_unsupported_options_are_refused_with_one_line_errors():
    base = dict(model_type="llama", vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # a transformers-5 save (rope_parameters) with rope_scaling added, as model cards say for long context:
    # transformers and vLLM take rope_scaling, Cascade took rope_parameters (plain RoPE, silently)
    plain = {"rope_type": "default", "rope_theta": 1e6}
    for added in ({"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}):
        with pytest.raises(ValueError, match="rope_parameters .* and a different rope_scaling .* keep one"):
            ModelConfig.from_hf({**base, "rope_parameters": plain, "rope_scaling": added})
    both = ModelConfig.from_hf({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}, "rope_theta": 5e5,
                                "rope_scaling": dict(LLAMA3_ROPE)})  # the same (Cascade's own saves write both)
    assert both.rope_scaling["rope_type"] == "llama3" and both.rope_theta == 5e5
    # the same kind, but transformers' base (rope_scaling's, else the top-level one, else its default) is not
    # rope_parameters' (Cascade took 1000 where transformers took 10000: logits off by 0.8)
    linear = {"rope_type": "linear", "factor": 3.0}
    for top in ({}, {"rope_theta": 1e4}):
        with pytest.raises(ValueError, match="rope_parameters with rope_theta 1000.0 and a rope_scaling"):
            ModelConfig.from_hf({**base, **top, "rope_parameters": {**linear, "rope_theta": 1000.0},
                                 "rope_scaling": {"type": "linear", "factor": 3.0}})
    assert ModelConfig.from_hf({**base, "rope_theta": 1000.0, "rope_parameters": {**linear, "rope_theta": 1000.0},
                                "rope_scaling": {"type": "linear", "factor": 3.0}}).rope_theta == 1000.0
    # a qwen3_moe config without its experts' sizes: a one-line ValueError (a KeyError or TypeError before, which
    # model_backend=auto did not fall back from)
    moe = dict(base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        with pytest.raises(ValueError, match=f"qwen3_moe model lacks {key}"):
            ModelConfig.from_hf({k: v for k, v in moe.items() if k != key})
    assert ModelConfig.from_hf({**base, "rope_parameters": plain}).rope_theta == 1e6
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf({**base, "mlp_bias": True})
    with pytest.raises(ValueError, match="MoE"):
        ModelConfig(architecture="llama", num_experts=4).validate()
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig(architecture="qwen2").validate()


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_engine_greedy_equals_full_recomputation(kind, use_native, tmp_path, monkeypatch):
    """The torch engine, through the native CPU ops (q/k norm off, q/k/v biases, RoPE scaling) and through
    the PyTorch step, decodes left-padded prompts with the KV cache exactly as a full forward of
    prompt + completion chooses."""
    monkeypatch.setenv("CASCADE_NATIVE_DECODE", "1" if use_native else "0")
    kw = {"rope_parameters": LLAMA3_ROPE} if kind == "llama" else {}
    hf_tiny(kind, **kw).save_pretrained(tmp_path / "m")
    m = load_pretrained(tmp_path / "m").eval()
    assert native.usable(m) is use_native, native._STATE.get("error")
    eng = TorchEngine(m)
    prompts = [[5, 17, 300, 42, 9], [7, 8], [100, 200, 30, 40, 50, 60, 70, 80]]
    comps = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2))
    assert len(comps) == 6
    for c in comps:
        p = prompts[c.prompt_index]
        assert len(c.token_ids) == 30
        with torch.no_grad():
            full = m(torch.tensor([p + c.token_ids]))[0]
            lp = token_logprobs(m, torch.tensor([p + c.token_ids]))[0, len(p) - 1:]
        assert full[len(p) - 1:-1].argmax(-1).tolist() == c.token_ids
        assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
    assert len({tuple(c.token_ids) for c in comps}) > 1  # not a degenerate model


@pytest.mark.parametrize("preset,kind", [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_init_model_presets_for_llama_and_qwen2(preset, kind, tmp_path):
    from train.presets import init_model

    from train.model.modeling import count_parameters

    model, tok = init_model(preset, tmp_path / preset)
    assert model.config.architecture == kind
    assert model.config.num_parameters() == count_parameters(model)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / preset).eval()
    assert back.config.model_type == kind
    ids = torch.randint(5, 1000, (2, 12))
    with torch.no_grad():
        assert (back(ids).logits - model(ids)).abs().max().item() < 1e-4


def test_init_model_follows_its_seed_and_writes_the_tokenizers_special_ids(tmp_path):
    """The same seed writes the same weights, another seed others; the config names the tokenizer's own
    end-of-sequence and padding ids (generation stops, and batches pad, on the tokens the tokenizer makes)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from train.presets import init_model

    def weights(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        init_model("tiny-dense", tmp_path / name, seed=seed)
    a, b, c = (weights(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].std() > 0)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)


def test_tsp_takes_qwen2_and_llama():
    """TSP shards Qwen2's q/k/v biases and Llama's RoPE scaling (parity: tests/test_parallel.py); what it
    still refuses is a head count it cannot split."""
    from train.parallel.tsp import check_tsp_config

    check_tsp_config(ModelConfig(architecture="qwen2", attention_bias=True), 2)
    check_tsp_config(ModelConfig(architecture="llama", attention_bias=True, rope_scaling=LLAMA3_ROPE), 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tsp_config(ModelConfig(architecture="llama", num_attention_heads=6, num_key_value_heads=2), 4)


# -- the transformers fallback (GPT-2 built locally) ---------------------------------------------------


@pytest.fixture()
def gpt2_dir(tmp_path):
    hf = hf_tiny("gpt2")
    hf.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2", hf


def test_fallback_is_refused_by_default_and_taken_on_request(gpt2_dir, monkeypatch):
    from train.model.hf_fallback import TransformersCausalLM

    path, _ = gpt2_dir
    monkeypatch.delenv("CASCADE_MODEL_BACKEND", raising=False)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*CASCADE_MODEL_BACKEND"):
        load_pretrained(path)
    assert isinstance(load_pretrained(path, backend="auto"), TransformersCausalLM)
    monkeypatch.setenv("CASCADE_MODEL_BACKEND", "auto")
    assert isinstance(load_pretrained(path), TransformersCausalLM)
    assert isinstance(TorchEngine.from_pretrained(path).model, TransformersCausalLM)
    # auto keeps Cascade's model where it is supported; transformers forces the fallback
    hf_tiny("llama").save_pretrained(path.parent / "llama")
    assert isinstance(load_pretrained(path.parent / "llama"), CausalLM)
    assert isinstance(load_pretrained(path.parent / "llama", backend="transformers"), TransformersCausalLM)
    with pytest.raises(ValueError, match="backend"):
        load_pretrained(path, backend="vllm")


def test_fallback_loads_in_bf16_trains_without_dropout_and_keeps_embeddings_off_muon(gpt2_dir, tmp_path):
    """A bf16 model's own logits are rounded to bf16: the head check must not refuse it for that. GPT-2's
    dropout (0.1) is off in train mode too (the trainer's log-probs are the behaviour policy's), while the
    saved config keeps its values. Muon leaves the embeddings and the tied head (wte, wpe) to AdamW. A
    soft-capped model is refused from its config (at a fresh init its logits cannot tell)."""
    from train.model.hf_fallback import TransformersCausalLM
    from train.optim import OptimConfig, build_optimizer

    path, _ = gpt2_dir
    m = load_pretrained(path, backend="transformers")
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.eval()
        ev = token_logprobs(m, ids)
        m.train()
        assert torch.equal(token_logprobs(m, ids), ev)
    assert m.hf.config.resid_pdrop == 0.1
    opt, _ = build_optimizer(m, OptimConfig(name="muon"))
    names = {id(p): n for n, p in m.named_parameters()}
    on_muon = [names[id(p)] for g in opt.param_groups if g.get("muon") for p in g["params"]]
    assert on_muon and not [n for n in on_muon if "wte" in n or "wpe" in n]
    hf_tiny("llama").save_pretrained(tmp_path / "llama")
    assert isinstance(load_pretrained(tmp_path / "llama", dtype=torch.bfloat16, backend="transformers"),
                      TransformersCausalLM)
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        TransformersCausalLM(AutoModelForCausalLM.from_config(cfg).eval())


def test_a_qwen3_config_without_head_dim_takes_transformers_default():
    d = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
    assert ModelConfig.from_hf(d).head_dim == transformers.AutoConfig.for_model(**d).head_dim == 128
    assert ModelConfig.from_hf({**d, "model_type": "qwen2"}).head_dim == 8


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_null_num_key_value_heads_means_one_per_attention_head(kind):
    """Phi-2-style configs write ``"num_key_value_heads": null``, which transformers reads as one per attention
    head: it raised TypeError (no ValueError, so model_backend=auto did not fall back either)."""
    d = {"model_type": kind, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": None, "head_dim": 8}
    assert ModelConfig.from_hf(d).num_key_value_heads == transformers.AutoConfig.for_model(**d).num_key_value_heads == 4


def test_distributed_trainer_refuses_a_fallback_policy_before_launching_ranks(gpt2_dir, tmp_path):
    """`cascade run model=GPT2_DIR model_backend=auto trainer.nproc=2` fails at once, in one line naming the
    architecture and trainer.nproc=1, before any trainer rank starts (no exchange directory, no trainer log):
    the sharded ranks cannot shard the transformers fallback."""
    import subprocess
    import sys

    path, _ = gpt2_dir
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CASCADE_MODEL_BACKEND"}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "cascade", "run", f"model={path}", "stage=rlve", "profile=tiny", "steps=1",
                        f"out={out}", "logging.progress=false", "model_backend=auto", "trainer.nproc=2"],
                       capture_output=True, text=True, cwd=root, env=env, timeout=300)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, r.stderr
    assert "gpt2" in err and "transformers fallback" in err and "trainer.nproc=1" in err, err
    assert not (out / "exchange").exists() and not list(out.glob("stages/*/logs/trainer.log"))


def test_fallback_logits_padding_and_packed_logprobs_match_transformers(gpt2_dir):
    from train.rl.packing import packed_token_logprobs

    path, hf = gpt2_dir
    m = load_pretrained(path, backend="transformers")
    ids, am = _ids_and_mask(T=30)
    with torch.no_grad():
        assert (m(ids) - hf(ids).logits).abs().max().item() < 1e-4
        got = m(ids, am)
        for r in range(3):  # each padded row equals the row alone, unpadded
            real = am[r].bool()
            alone = hf(ids[r:r + 1, real]).logits[0]
            assert (got[r, real] - alone).abs().max().item() < 1e-4
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 40))]
    lps, ents = packed_token_logprobs(m, seqs)
    for s, lp in zip(seqs, lps):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1].float(), -1)
        want = ref.gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
        assert (lp.detach() - want).abs().max().item() < 1e-4


def test_fallback_trains_a_few_steps(gpt2_dir):
    """Gradients flow through the packed log-probs into transformers' parameters; a few AdamW steps on
    one sequence raise its log-likelihood (with activation checkpointing on)."""
    from train.rl.packing import packed_token_logprobs

    path, _ = gpt2_dir
    m = load_pretrained(path, backend="transformers")
    m.train()
    seq = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    first = None
    for _ in range(5):
        lp = packed_token_logprobs(m, seq, return_entropy=False, checkpoint_layers=True)[0]
        loss = -lp.mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        assert m.lm_head.weight.grad is not None and m.lm_head.weight.grad.abs().sum() > 0
        opt.step()
    m.eval()
    with torch.no_grad():
        after = -token_logprobs(m, torch.tensor(seq)).mean().item()
    assert after < first - 0.05


def test_fallback_engine_greedy_equals_recompute_and_weight_sync(gpt2_dir, tmp_path):
    path, hf = gpt2_dir
    m = load_pretrained(path, backend="transformers")
    eng = TorchEngine(m)
    prompts = [[5, 17, 300, 42, 9], [7, 8], [100, 200, 30, 40, 50, 60, 70, 80]]
    comps = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2))
    for c in comps:
        p = prompts[c.prompt_index]
        with torch.no_grad():
            full = m(torch.tensor([p + c.token_ids]))[0]
        assert full[len(p) - 1:-1].argmax(-1).tolist() == c.token_ids
    assert len({tuple(c.token_ids) for c in comps}) > 1
    # sampling: the reported log-probs are the teacher-forced ones
    s = eng.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True))[0]
    with torch.no_grad():
        lp = token_logprobs(m, torch.tensor([prompts[0] + s.token_ids]))[0, len(prompts[0]) - 1:]
    assert (lp - torch.tensor(s.logprobs)).abs().max().item() < 1e-4
    # weight sync in transformers' names, strict
    other = hf_tiny("gpt2", seed=5)
    eng.load_weights(other.state_dict())
    assert torch.equal(m.lm_head.weight, other.lm_head.weight)
    with pytest.raises(CheckpointError, match="unexpected"):
        load_into(m, {**other.state_dict(), "bogus.weight": torch.zeros(1)})
    # saved back: transformers opens it with the same logits
    save_pretrained(m, tmp_path / "saved")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        assert (back(ids).logits - m(ids)).abs().max().item() < 1e-4


# -- standard checkpoints ---------------------------------------------------------------------------


def test_sharded_save_loads_in_transformers_and_back(tmp_path):
    hf = hf_tiny("llama", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    out = tmp_path / "sharded"
    save_pretrained(ours, out, max_shard_size="60KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert all((out / f).exists() for f in files) and files[0].startswith("model-00001-of-")
    assert set(index["weight_map"]) == set(ours.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.state_dict().values())
    ids, am = _ids_and_mask()
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    again = load_pretrained(out).eval()
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() < 1e-4
        assert torch.equal(again(ids), ours(ids))
    # saving unsharded into the same directory removes the shards and the index
    save_pretrained(ours, out)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("model-*-of-*.safetensors"))
    assert torch.equal(load_pretrained(out)(ids), ours(ids))


def test_sharded_load_of_transformers_checkpoint_in_bf16_and_missing_shard(tmp_path, monkeypatch):
    hf = hf_tiny("qwen2")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    from train.model import hf_io

    def whole_file(*a, **k):
        raise AssertionError("load_pretrained read a whole weight file into memory")

    monkeypatch.setattr(hf_io, "load_file", whole_file)  # tensors are streamed one at a time
    m = load_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    ref = load_pretrained(tmp_path / "hf").to(torch.bfloat16)
    for (k, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing weight files"):
        load_pretrained(tmp_path / "hf")


def test_generation_config_carried_and_transformers_version_written(tmp_path):
    hf = hf_tiny("qwen2")
    hf.generation_config.update(do_sample=True, temperature=0.6, top_p=0.95, eos_token_id=[2, 7])
    hf.save_pretrained(tmp_path / "hf")
    src = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    gen = json.loads((tmp_path / "ours" / "generation_config.json").read_text())
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95 and gen["do_sample"] is True
    assert gen["eos_token_id"] == [2, 7] == src["eos_token_id"]
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["transformers_version"] == transformers.__version__
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.generation_config.temperature == 0.6 and back.generation_config.eos_token_id == [2, 7]
    assert TorchEngine(ours).eos_token_ids == [2, 7]  # the engine stops at every eos of the list
    # a copy made from the config (as trainers do) keeps it; a fresh model takes tokenizer_dir's
    fresh = CausalLM(ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())))
    save_pretrained(fresh, tmp_path / "fresh", tokenizer_dir=tmp_path / "hf")
    assert json.loads((tmp_path / "fresh" / "generation_config.json").read_text())["top_p"] == 0.95
    save_pretrained(fresh, tmp_path / "bare")  # nothing to carry: bos/eos from the config
    bare = json.loads((tmp_path / "bare" / "generation_config.json").read_text())
    assert bare["eos_token_id"] == 2 and "temperature" not in bare


def test_fallback_policy_runs_sft_and_rl_trainers(tmp_path):
    """A GPT-2 policy through the fallback in Cascade's own trainers: SFT lowers its loss, an RL step
    samples with the torch engine, updates and syncs the engine's copy."""
    import copy

    from envs.curriculum import Curriculum
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig
    from train.sft import SFTConfig, SFTTrainer, reference_pairs
    from train.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok", vocab_size=1024, seed=0)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=None,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    model = load_pretrained(tmp_path / "gpt2", backend="transformers")
    sft = SFTTrainer(model, tok, SFTConfig(batch_size=16, chat_template=False, seed=0,
                                           optim=OptimConfig(lr=3e-3, warmup_steps=2)))
    enc = sft.encode(reference_pairs(["toy/max"], 200, seed=1, difficulties=(1,), think=False))
    losses = [sft.step(sft.sample_batch(enc))["sft_loss"] for _ in range(12)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    cur = Curriculum(["toy/max"], controller="fixed", seed=0, controller_kwargs={"difficulty": 1})
    rl = RLTrainer(model, tok, TorchEngine(copy.deepcopy(model), tok), cur,
                   RLConfig(group_size=4, prompts_per_step=4, chat_template=False, micro_batch_size=16,
                            sampling=SamplingConfig(max_new_tokens=6), optim=OptimConfig(lr=1e-3), seed=0))
    m = rl.step()
    assert "reward_mean" in m
    for k, v in model.state_dict().items():
        assert torch.equal(v, rl.engine.model.state_dict()[k]), k


def test_cascade_run_takes_another_architecture_with_model_backend_auto(tmp_path):
    """`cascade run model=GPT2_DIR` is refused in one line naming the way out; with
    `model_backend=auto` the same run trains its step through the transformers fallback."""
    import subprocess
    import sys

    from train.tokenizer import build_tokenizer

    d = tmp_path / "gpt2"
    tok = build_tokenizer(d, vocab_size=1024, seed=0)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                  bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CASCADE_MODEL_BACKEND"}
    args = [sys.executable, "-m", "cascade", "run", f"model={d}", "stage=rlve", "profile=tiny", "steps=1",
            f"out={tmp_path / 'run'}", "logging.progress=false"]
    r = subprocess.run(args, capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert r.returncode == 2 and "model_backend=auto" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run(args + ["model_backend=auto"], capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    final = tmp_path / "run" / "stages" / "1-rlve" / "final"
    assert transformers.AutoConfig.from_pretrained(final).model_type == "gpt2"


def test_a_tied_config_with_a_head_of_its_own_in_the_checkpoint_is_refused(tmp_path):
    """tie_word_embeddings true while the checkpoint holds a different lm_head.weight: transformers loads that head
    (untied), Cascade tied it to the embeddings: logits 4.6 apart, silently. A copy equal to the embeddings loads."""
    from safetensors.torch import load_file, save_file

    from train.model.hf_io import CheckpointError

    hf = hf_tiny("llama", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true but the checkpoint holds an lm_head"):
        load_pretrained(tmp_path / "m", backend="cascade")
    sd = load_file(tmp_path / "m" / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    assert load_pretrained(tmp_path / "m", backend="cascade").config.tie_word_embeddings
