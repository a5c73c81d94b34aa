"""ZAYA1 (``zaya``: CCA attention, ZAYA1 router, residual scaling, partial RoPE) in Cascade's model,
engine and trainers, against transformers' ``ZayaForCausalLM``. Every model is built locally."""
import dataclasses
import json

import pytest
import torch
import transformers

from train.engine import TorchEngine, native
from train.engine.base import SamplingParams
from train.model.config import ModelConfig
from train.model.hf_io import load_pretrained, save_pretrained
from train.model.modeling import CausalLM, token_logprobs
from train.model.zaya import expert_loads, update_balancing_biases
from tests.test_parallel import world_of_one

V = 160


def hf_zaya(seed: int = 0, **kw):
    """A tiny random ZayaForCausalLM, every weight spread out (conv, residual scales, key temperature,
    balancing biases too) so that routing uses several experts and the skip class."""
    torch.manual_seed(seed)
    cfg = transformers.ZayaConfig(**{**dict(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=16, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), **kw})
    return _spread(transformers.ZayaForCausalLM(cfg), lambda name, p: p.normal_(0.0, 0.15)).eval()


def _spread(model, other):
    """Spread a zaya model's weights out (norms and residual scales around 1, key temperatures 1-2,
    router out_proj N(0, 1), ``other(name, p)`` for the rest, balancing biases set) so that routing
    uses several experts and the skip class."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "_scale")):
                p.uniform_(0.7, 1.3)
            elif name.endswith("temp"):
                p.uniform_(1.0, 2.0)
            elif "out_proj" in name:
                p.normal_(0.0, 1.0)
            else:
                other(name, p)
        for layer in model.model.layers:
            layer.mlp.gate.balancing_biases.normal_(0.0, 0.02)
            layer.mlp.gate.balancing_biases[-1] = -0.1
    return model


@pytest.fixture(scope="module")
def zdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("zaya") / "hf"
    hf = hf_zaya()
    hf.save_pretrained(d)
    return d, hf


def _routes(model, ids, **kw):
    rec = []
    with torch.no_grad():
        model.hidden_states(ids, record_routing=rec, **kw)
    return rec


def test_logits_match_transformers_with_padding(zdir):
    d, hf = zdir
    ours = load_pretrained(d).eval()
    assert isinstance(ours, CausalLM) and ours.config.model_type == "zaya" and ours.config.rope_dim == 8
    ids = torch.randint(3, V, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert (got - ref).abs().max().item() < 1e-4
    used = torch.cat([r.flatten() for r in _routes(ours, ids)]).unique()
    assert len(used) >= 3, used  # several experts (the comparison is not of one expert)
    # left padding: the padded rows' real tokens equal the unpadded run (transformers: same, with positions)
    am = torch.ones(3, 24, dtype=torch.long)
    am[1, :7] = 0
    am[2, :15] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=am, position_ids=pos).logits
        got = ours(ids, am)
        alone = ours(ids[2:, 15:])
    keep = am.bool()
    assert (got - ref)[keep].abs().max().item() < 1e-4
    assert (got[2, 15:] - alone[0]).abs().max().item() < 1e-4


def test_a_rope_dict_without_its_rotary_factor_rotates_as_transformers_does(tmp_path):
    """A config whose rope_parameters leave partial_rotary_factor out: transformers rotates every dimension (its
    0.5 is only the default of the rope_parameters it builds itself); Cascade took 0.5 (logits off by ~0.9)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    hf = hf_zaya(rope_parameters={"hybrid": dict(rope), "hybrid_sliding": dict(rope)})
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert ours.config.rope_dim == 16 and (ours(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_cascade_save_opens_in_transformers_with_equal_logits(zdir, tmp_path):
    d, hf = zdir
    ours = load_pretrained(d)
    with torch.no_grad():  # a change the round trip must carry, balancing biases included
        ours.model.layers[0].mlp.gate.balancing_biases[0] += 0.5
    save_pretrained(ours, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "zaya" and cfg["architectures"] == ["ZayaForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.ZayaForCausalLM
    assert back.model.layers[0].mlp.gate.balancing_biases[0].item() == pytest.approx(
        hf.model.layers[0].mlp.gate.balancing_biases[0].item() + 0.5)
    ids = torch.randint(3, V, (2, 17))
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() < 1e-4
    again = load_pretrained(tmp_path / "ours")
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_bf16_keeps_balancing_biases_fp32_and_residual_fp32(zdir):
    d, _ = zdir
    m = load_pretrained(d, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert all(l.mlp.gate.balancing_biases.dtype == torch.float32 for l in m.model.layers)
    with torch.no_grad():
        out = m.hidden_states(torch.randint(3, V, (1, 9)))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_init_model_preset_tiny_zaya_opens_in_transformers(tmp_path):
    from train.model.modeling import count_parameters
    from train.presets import init_model

    model, tok = init_model("tiny-zaya", tmp_path / "z")
    assert model.config.architecture == "zaya" and model.config.num_parameters() == count_parameters(model)
    from train.model.config import ModelConfig

    biased = dataclasses.replace(model.config, attention_bias=True)  # (its q/k/v/o biases were left out of the count)
    assert biased.num_parameters() == count_parameters(CausalLM(biased))
    hf = json.loads((tmp_path / "z" / "config.json").read_text())
    for flat in ({"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}):
        with pytest.raises(ValueError, match="zaya: rope_parameters must be given per layer type"):
            ModelConfig.from_hf({**hf, "rope_parameters": flat})  # (its own theta and type were ignored)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "z").eval()
    assert back.config.model_type == "zaya"
    ids = torch.randint(5, 1000, (2, 12))
    with torch.no_grad():
        assert (back(ids).logits - model(ids)).abs().max().item() < 1e-4


def test_unsupported_zaya_options_refused():
    with pytest.raises(ValueError, match="top-1"):
        ModelConfig(architecture="zaya", num_experts=4, num_experts_per_tok=2).validate()
    with pytest.raises(ValueError, match="hybrid_sliding"):
        ModelConfig.from_hf({"model_type": "zaya", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
                             "layer_types": ["hybrid", "hybrid_sliding"], "sliding_window": 4})
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig(architecture="qwen3", partial_rotary_factor=0.5).validate()


@pytest.mark.parametrize("native_env", ["1", "0"])
def test_engine_decode_with_kv_and_conv_state_equals_full_forward(zdir, native_env, monkeypatch):
    """The torch engine decodes zaya with its KV cache plus CCA's convolution / delayed-value state:
    greedy tokens == the full forward's argmax, logprobs == teacher forcing, routed experts == the
    full forward's; with the native CPU ops (ZayaNativeDecoder: native decoding steps) and without."""
    monkeypatch.setenv("CASCADE_NATIVE_DECODE", native_env)
    d, _ = zdir
    m = load_pretrained(d).eval()
    assert native.usable(m) is (native_env == "1" and native.load())
    assert isinstance(native.decoder(m), native.ZayaNativeDecoder) is native.usable(m)
    eng = TorchEngine(m, return_routed_experts=True)
    prompts = [[5, 17, 100, 42, 9], [7], [100, 150, 30, 40, 50, 60, 70, 80]]
    comps = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2))
    assert len(comps) == 6
    for c in comps:
        p = prompts[c.prompt_index]
        seq = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            full = m(seq)[0]
            lp = token_logprobs(m, seq)[0, len(p) - 1:]
        assert full[len(p) - 1:-1].argmax(-1).tolist() == c.token_ids
        assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
        # per layer [1, P + C, 1]; the last slot (a token never fed back) repeats the previous row
        assert len(c.routed_experts) == 3
        for got, want in zip(c.routed_experts, _routes(m, seq)):
            assert torch.equal(got[:, :-1], want[:, :-1])
        with torch.no_grad():  # replaying them reproduces the forward
            assert (m(seq, routed_experts=c.routed_experts)[0, :-1] - full[:-1]).abs().max().item() < 1e-5
    assert len({tuple(c.token_ids) for c in comps}) > 1


def test_sampled_decode_logprobs_equal_teacher_forcing(zdir):
    d, _ = zdir
    m = load_pretrained(d).eval()
    comps = TorchEngine(m).generate([[5, 6, 7], [9]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                                     seed=3))
    for c, p in zip(comps, [[5, 6, 7], [9]]):
        with torch.no_grad():
            lp = token_logprobs(m, torch.tensor([p + c.token_ids]))[0, len(p) - 1:]
        assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


def test_packed_sequences_restart_the_convolution(zdir):
    """Packed rows (cu_seqlens) equal each sequence run alone, logits and gradients: CCA's convolution
    and delayed value restart at every sequence start."""
    d, _ = zdir
    m = load_pretrained(d)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, V, (n,), generator=g) for n in (7, 1, 12, 4)]
    packed = torch.cat(seqs)[None]
    cu = [0, 7, 8, 20, 24]
    out = m(packed, cu_seqlens=cu)
    alone = [m(s[None])[0] for s in seqs]
    assert (out[0] - torch.cat(alone)).abs().max().item() < 1e-4
    w = torch.randn_like(out)
    (out * w).sum().backward()
    gp = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    (torch.cat(alone) * w[0]).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert torch.allclose(gp[n], p.grad, atol=1e-4, rtol=1e-3), n
    conv = m.model.layers[0].self_attn.qkv_proj.conv_qk_depthwise.weight
    assert conv.grad is not None and conv.grad.abs().sum() > 0


def test_checkpointed_layers_equal_plain_forward_and_backward(zdir):
    d, _ = zdir
    m = load_pretrained(d)
    ids = torch.randint(3, V, (2, 15))
    a = m(ids)
    a.square().mean().backward()
    g1 = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    rec = []
    b = m(ids, record_routing=rec, checkpoint_layers=True)
    b.square().mean().backward()
    assert len(rec) == 3 and (a - b).abs().max().item() < 1e-5
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert torch.allclose(g1[n], p.grad, atol=1e-5), n


def test_router_replay_pins_the_trainers_routing(zdir):
    """Expert ids recorded by the engine pin the trainer's top-1 routing: a trainer whose balancing
    biases moved (so it would route differently) reproduces the engine's forward when replaying, and
    the router still gets gradient through the (unbiased) gate probability."""
    d, _ = zdir
    eng_model = load_pretrained(d).eval()
    comp = TorchEngine(eng_model, return_routed_experts=True).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    seq = torch.tensor([[5, 6, 7, 8] + comp.token_ids])
    trainer = load_pretrained(d)
    with torch.no_grad():
        for layer in trainer.model.layers:
            layer.mlp.gate.balancing_biases[:4] = torch.tensor([0.9, -0.9, 0.9, -0.9])
        ref = eng_model(seq)
        assert not torch.equal(_routes(trainer, seq)[0], _routes(eng_model, seq)[0])
        assert (trainer(seq) - ref).abs().max().item() > 1e-3
        got = trainer(seq, routed_experts=comp.routed_experts)
    assert (got[0, :-1] - ref[0, :-1]).abs().max().item() < 1e-5
    token_logprobs(trainer, seq, routed_experts=comp.routed_experts).sum().backward()
    gate = trainer.model.layers[1].mlp.gate
    assert gate.router_mlp.out_proj.weight.grad.abs().sum() > 0 and gate.router_states_scale.grad is not None
    assert not gate.balancing_biases.requires_grad


def test_balancing_bias_update_moves_towards_uniform_load(zdir):
    d, _ = zdir
    m = load_pretrained(d)
    before = [l.mlp.gate.balancing_biases.clone() for l in m.model.layers]
    routes = [torch.tensor([[[0], [0], [0], [1], [4], [4]]]), torch.tensor([[[2], [4], [3], [1], [0], [4]]]),
              torch.tensor([[[1], [1], [1], [1], [1], [1]]])]
    counts = expert_loads(routes, 4)
    assert counts.tolist()[0] == [3, 1, 0, 0]  # the skip class (4) counts for no expert
    load = update_balancing_biases(m, counts, rate=0.01)
    assert torch.allclose(load[0], torch.tensor([0.75, 0.25, 0.0, 0.0]))
    step = [l.mlp.gate.balancing_biases - b for l, b in zip(m.model.layers, before)]
    assert torch.allclose(step[0], torch.tensor([-0.01, 0.0, 0.01, 0.01, 0.0]))  # expert 1 at 1/E
    assert torch.allclose(step[1], torch.zeros(5))  # every load at 1/E: unchanged
    assert torch.allclose(step[2], torch.tensor([0.01, -0.01, 0.01, 0.01, 0.0]))
    now = [l.mlp.gate.balancing_biases.clone() for l in m.model.layers]
    update_balancing_biases(m, torch.zeros_like(counts), rate=0.01)  # no token at all (a batch all dropped)
    assert all(torch.equal(l.mlp.gate.balancing_biases, b) for l, b in zip(m.model.layers, now))


def _tok_and_policy(tmp_path):
    from train.presets import init_model

    model, tok = init_model("tiny-zaya", tmp_path / "z", seed=0)
    return tok, load_pretrained(tmp_path / "z")


def test_sft_steps_lower_the_loss_and_update_biases_from_the_batch_load(tmp_path):
    from train.optim import OptimConfig
    from train.sft import SFTConfig, SFTTrainer, reference_pairs

    tok, model = _tok_and_policy(tmp_path)
    assert model.config.router_bias_update_rate == 1e-3
    sft = SFTTrainer(model, tok, SFTConfig(batch_size=16, chat_template=False, seed=0,
                                           optim=OptimConfig(lr=3e-3, warmup_steps=2)))
    enc = sft.encode(reference_pairs(["toy/max"], 200, seed=1, difficulties=(1,), think=False))
    biases = lambda: torch.stack([l.mlp.gate.balancing_biases.clone() for l in model.model.layers])  # noqa: E731
    b0 = biases()
    batch = sft.sample_batch(enc)
    losses = [sft.step(batch)["sft_loss"]]
    step = biases() - b0
    # every expert's bias moved by exactly one step of 1e-3, down where overloaded; the skip class stays
    assert torch.allclose(step[:, :4].abs(), torch.full((4, 4), 1e-3)) and torch.equal(step[:, 4], torch.zeros(4))
    assert all(float(l.mlp.gate.load_counts.sum()) == 0 for l in model.model.layers)  # reset after the step
    losses += [sft.step(sft.sample_batch(enc))["sft_loss"] for _ in range(11)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_rl_step_with_router_replay_and_weight_sync(tmp_path):
    import copy

    from envs.curriculum import Curriculum
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig

    tok, model = _tok_and_policy(tmp_path)
    cur = Curriculum(["toy/max"], controller="fixed", seed=0, controller_kwargs={"difficulty": 1})
    rl = RLTrainer(model, tok, TorchEngine(copy.deepcopy(model), tok), cur,
                   RLConfig(group_size=4, prompts_per_step=4, chat_template=False, micro_batch_size=16,
                            sampling=SamplingConfig(max_new_tokens=6), optim=OptimConfig(lr=1e-3), seed=0))
    assert rl.replay  # zaya is MoE: the engine's expert choices pin the trainer's
    b0 = model.model.layers[0].mlp.gate.balancing_biases.clone()
    w0 = model.model.layers[0].self_attn.qkv_proj.conv_qk_grouped.weight.detach().clone()
    groups = rl.rollout(4)  # a random policy scores 0 everywhere: give the rollouts distinct rewards
    for g in groups:
        for i, r in enumerate(g.rollouts):
            r.reward = float(i % 2)
    assert all(r.completion.routed_experts is not None for g in groups for r in g.rollouts)
    m = rl.train_on(groups)
    # the trainer (packed, replaying the engine's routes) scores the completions as the engine did
    assert m["mismatch_max_abs"] < 1e-3 and m["grad_norm"] > 0
    assert not torch.equal(w0, model.model.layers[0].self_attn.qkv_proj.conv_qk_grouped.weight)
    assert not torch.equal(b0, model.model.layers[0].mlp.gate.balancing_biases)
    for k, v in model.state_dict().items():  # balancing biases synced with the weights
        assert torch.equal(v, rl.engine.model.state_dict()[k]), k


def test_dropped_rollouts_are_not_forwarded_so_the_router_load_skips_them(tmp_path, monkeypatch):
    """A rollout with ``keep=False`` (overlong-filtered) or no completion has no loss token: the trainer does
    not forward it, so the balancing biases follow the load of the trained tokens only, as on trainer ranks
    (RLUpdater; tests/test_rl_distributed.py compares the two)."""
    import copy

    import train.model.zaya as zaya
    from envs.curriculum import Curriculum
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig

    tok, model = _tok_and_policy(tmp_path)
    cur = Curriculum(["toy/max"], controller="fixed", seed=0, controller_kwargs={"difficulty": 1})
    rl = RLTrainer(model, tok, TorchEngine(copy.deepcopy(model), tok), cur,
                   RLConfig(group_size=4, prompts_per_step=2, chat_template=False, micro_batch_size=16,
                            sampling=SamplingConfig(max_new_tokens=6), optim=OptimConfig(lr=1e-3), seed=0))
    groups = rl.rollout(2)
    rolls = [r for g in groups for r in g.rollouts]
    for i, r in enumerate(rolls):
        r.reward = float(i % 2)
    rolls[1].keep = False
    counted = []
    real = zaya.count_load
    monkeypatch.setattr(zaya, "count_load", lambda gate, idx, valid: (
        counted.append(int(idx.shape[0] if valid is None else valid.sum())), real(gate, idx, valid))[1])
    rl.train_on(groups)
    trained = sum(len(r.prompt_ids) + len(r.completion.token_ids) for r in rolls if r.keep)
    assert sum(counted) == trained * model.config.num_hidden_layers, (counted, trained)


def test_tsp_takes_zaya_and_refuses_degrees_its_heads_do_not_fit(tmp_path):
    """TSP shards zaya by head groups (ranks share a KV head when there are fewer KV heads than ranks); a
    degree that does not fit the heads is a one-line error; the sharded model and the RL update hold the
    routers' balancing biases (tests/test_parallel.py and tests/test_rl_distributed.py compare them with
    the single-process model)."""

    from train.parallel.rl_update import RLUpdateConfig, RLUpdater
    from train.parallel.tsp import TSPCausalLM, check_tsp_config

    cfg = ModelConfig(architecture="zaya", num_experts=4, num_experts_per_tok=1, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) divisible by D=3") as e:
        check_tsp_config(cfg, 3)
    assert "\n" not in str(e.value)
    for D in (1, 2, 4):
        check_tsp_config(cfg, D)
    with world_of_one(tmp_path):
        names = [f"model.layers.{i}.mlp.gate.balancing_biases" for i in range(2)]
        assert sorted(TSPCausalLM(CausalLM(cfg)).model_buffers()) == names
        up = RLUpdater(CausalLM(cfg), RLUpdateConfig(), tsp=1)
        assert sorted(up.buffers) == names


def test_cascade_run_refuses_a_tsp_degree_that_splits_zaya_heads_before_any_rank_starts(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "cascade", "run", "stage=rlve", "profile=tiny", "model_preset=tiny-zaya",
                        f"out={out}", "trainer.nproc=3", "trainer.tsp=3", "logging.progress=false"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "trainer.tsp=3 does not fit the policy: TSP needs num_attention_heads (4) divisible by D=3" in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert not (out / "exchange").exists() and not (out / "stages").exists()


@pytest.mark.parametrize("nproc,tsp", [(1, 1), (2, 2)])
def test_tiny_cascade_stage_runs_a_zaya_policy(tmp_path, nproc, tsp):
    """`cascade init-model --preset tiny-zaya` then `cascade run profile=tiny model=DIR` (the rlve stage,
    two RL steps), in one process or with the update on TSP 2 trainer ranks (CCA sharded by KV heads;
    data-parallel ranks: tests/test_rl_distributed.py): the hand-off checkpoint is a zaya model that
    transformers opens, its balancing biases moved by the updates."""
    import subprocess
    import sys

    def cascade(*args):
        r = subprocess.run([sys.executable, "-m", "cascade", *args], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    cascade("init-model", "--preset", "tiny-zaya", "--out", str(tmp_path / "m"))
    cascade("run", "stage=rlve", "profile=tiny", f"model={tmp_path / 'm'}", f"out={tmp_path / 'run'}", "steps=2",
            "eval_problems=4", "checkpoint_every=1", f"trainer.nproc={nproc}", f"trainer.tsp={tsp}",
            "rl.dynamic_sampling=false")  # a random policy's groups all score 0: train on them all the same
    final = tmp_path / "run" / "stages" / "1-rlve" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "zaya"
    before, after = load_pretrained(tmp_path / "m").state_dict(), load_pretrained(final).state_dict()
    moved = [k for k in after if k.endswith("balancing_biases") and not torch.equal(before[k], after[k])]
    assert moved, "no balancing bias moved"
    if nproc == 2:
        log = (tmp_path / "run").rglob("trainer.log")
        assert any(f'"dp": {nproc // tsp}' in f.read_text() and f'"tsp": {tsp}' in f.read_text() for f in log)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward_mean" in s for s in steps) == 2 and all(s["groups_trained"] for s in steps if "reward_mean" in s)
    back = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(5, 1000, (1, 9))
    with torch.no_grad():
        assert (back(ids).logits - load_pretrained(final)(ids)).abs().max().item() < 1e-4


def test_cache_row_selection_carries_the_conv_state_and_prefix_cache_is_bypassed(zdir):
    """Dropping / reordering rows of a decoding cache keeps each row's CCA state with it; the shared-prefix
    KV cache (mid-row padding the convolution would see) is bypassed for zaya, outputs unchanged."""
    from train.engine.prefix_cache import enable_prefix_caching
    from train.model.modeling import KVCache

    d, _ = zdir
    m = load_pretrained(d).eval()
    rows = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    L = 5
    ids = torch.tensor([[0] * (L - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    nxt = torch.tensor([30, 31, 32])
    with torch.inference_mode():
        cache = KVCache.allocate(m.config, 3, 16, "cpu", torch.float32)
        m.last_logits(ids, am, cache=cache)
        sub = cache.select(torch.tensor([2, 0]))
        got = m.last_logits(nxt[[2, 0], None], cache=sub)
        want = torch.stack([m(torch.tensor([rows[i] + [int(nxt[i])]]))[0, -1] for i in (2, 0)])
        kept = cache.keep(torch.tensor([0, 2]))  # in place (finished rows dropped), states move too
        got_kept = m.last_logits(nxt[[0, 2], None], cache=kept)
    assert (got - want).abs().max().item() < 1e-4
    assert kept.k[0].data_ptr() == cache.k[0].data_ptr() and (got_kept - want[[1, 0]]).abs().max().item() < 1e-4
    prompts = [[3] * 12 + [40 + i] for i in range(3)]  # a shared 12-token prefix
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = [c.token_ids for c in TorchEngine(m).generate(prompts, sp)]
    eng = TorchEngine(m)
    pc = enable_prefix_caching(eng, min_prefix=4)
    assert [c.token_ids for c in eng.generate(prompts, sp)] == plain and pc.stats.batches == 0


def _spread_zaya(**kw) -> CausalLM:
    """A tiny random zaya CausalLM, weights spread out like :func:`hf_zaya` (several experts and the skip
    class routed)."""
    base = dict(architecture="zaya", vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=1,
                moe_intermediate_size=32, router_hidden_size=16, max_position_embeddings=256)
    m = CausalLM(ModelConfig(**{**base, **kw})).init_weights(0, std=0.15).eval()
    return _spread(m, lambda name, p: p.normal_(0.0, 0.1) if name.endswith("bias") else None)


@pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")
@pytest.mark.parametrize("kw", [{}, dict(attention_bias=True), dict(cca_time0=3, cca_time1=2),
                                dict(cca_time0=1, cca_time1=1), dict(num_key_value_heads=1, head_dim=32),
                                dict(head_dim=24, num_key_value_heads=4)],
                         ids=["base", "bias", "k3", "no-state", "mqa-d32", "mha-d24"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_zaya_step_equals_the_pytorch_step(kw, threads):
    """ZayaNativeDecoder's fused decoding step against the PyTorch step from the same left-padded prefill:
    logits and logprobs within 1e-5, greedy tokens and router classes (skip class included) identical,
    KV cache, convolution state and delayed value equal; head sizes with and without the vectorised
    grouped conv, no convolution state (cca_time 1, 1), biases."""
    from train.model.modeling import KVCache

    assert native.load(), native._STATE.get("error")
    m = _spread_zaya(**kw)
    dec = native.decoder(m)
    assert isinstance(dec, native.ZayaNativeDecoder)
    B, L, steps = 6, 9, 10
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    for i in range(B):
        mask[i, :min(2 * i, L - 1)] = False
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    classes = set()
    try:
        with torch.inference_mode():
            ref_c = KVCache.allocate(m.config, B, L + steps, "cpu", torch.float32)
            nat_c = KVCache.allocate(m.config, B, L + steps, "cpu", torch.float32)
            rec_ref, rec_nat = [], []
            ref = m.logits(m.hidden_states(ids, mask, cache=ref_c, record_routing=rec_ref)[:, -1])
            out = dec.forward(ids, nat_c, mask, record=rec_nat)  # prefill: the PyTorch model
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            assert all(torch.equal(a[mask], b) for a, b in zip(rec_ref, rec_nat))
            tok = ref.argmax(-1)
            for _ in range(steps):
                rec_ref, rec_nat = [], []
                ref = m.logits(m.hidden_states(tok[:, None], cache=ref_c, record_routing=rec_ref)[:, -1])
                out = dec.step(tok, nat_c, record=rec_nat)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(torch.log_softmax(out, -1), torch.log_softmax(ref, -1), rtol=1e-5, atol=1e-5)
                assert torch.equal(out.argmax(-1), ref.argmax(-1))
                for a, b in zip(rec_ref, rec_nat):
                    assert torch.equal(a[:, 0], b)
                    classes |= set(b.flatten().tolist())
                tok = ref.argmax(-1)
    finally:
        torch.set_num_threads(old)
    assert nat_c.length == ref_c.length and torch.equal(nat_c.valid, ref_c.valid)
    keep = ref_c.valid[:, None, :, None]
    for a, b in zip(ref_c.k + ref_c.v, nat_c.k + nat_c.v):
        torch.testing.assert_close(a * keep, b * keep, rtol=1e-5, atol=1e-5)
    for a, b in zip(ref_c.conv + ref_c.vstate, nat_c.conv + nat_c.vstate):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(classes) > 1


@pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")
def test_native_zaya_engine_matches_pytorch_engine_and_follows_weight_updates(zdir, monkeypatch):
    """The engine with native zaya steps samples what it samples without them (greedy tokens equal, seeded
    samples' logprobs close); after load_weights the native decoder uses the new weights."""
    d, _ = zdir
    m = load_pretrained(d).eval()
    assert native.usable(m)
    prompts = [[5, 17, 100, 42, 9], [7], [100, 150, 30, 40, 50, 60, 70, 80]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)

    def both():
        fast = TorchEngine(m).generate(prompts, greedy)
        monkeypatch.setenv("CASCADE_NATIVE_DECODE", "0")
        slow = TorchEngine(m).generate(prompts, greedy)
        monkeypatch.delenv("CASCADE_NATIVE_DECODE")
        for a, b in zip(fast, slow):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        return [c.token_ids for c in fast]

    before = both()
    other = hf_zaya(seed=1)
    eng = TorchEngine(m)
    eng.load_weights(other.state_dict())
    after = [c.token_ids for c in eng.generate(prompts, greedy)]
    assert after == both() and after != before


def test_a_left_padded_row_equals_the_row_alone_with_projection_biases():
    """attention_bias=True: the padding's columns fed the CCA convolution the q/k projections' biases (x is
    zeroed before the projections, the bias was not), so a short prompt in a batch got other logits than alone
    (or packed, as the trainer recomputes them): behaviour log-probs off by up to 0.1."""
    m = _spread_zaya(attention_bias=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :5] = False  # row 1: 4 tokens, left-padded
    with torch.no_grad():
        batch = m.logits(m.hidden_states(ids, mask))[1, 5:]
        alone = m.logits(m.hidden_states(ids[1:, 5:]))[0]
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)


def test_two_packed_sequences_restart_the_convolution():
    """Two sequences packed in one row (cu_seqlens with a single inner bound) each equal the sequence alone: the
    second one's CCA convolution starts from zeros, not from the first one's last projections."""
    m = _spread_zaya()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, V, (6,), generator=g), torch.randint(3, V, (5,), generator=g)
    with torch.no_grad():
        out = m(torch.cat([a, b])[None], cu_seqlens=[0, 6, 11])[0]
        alone = torch.cat([m(a[None])[0], m(b[None])[0]])
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def _load_after_training_forward(m, ids, mask, routes):
    for layer in m.model.layers:
        layer.mlp.gate.load_counts.zero_()
    m(ids, mask, routed_experts=routes).sum().backward()
    return torch.stack([layer.mlp.gate.load_counts.clone() for layer in m.model.layers])


def test_training_forwards_count_the_real_tokens_routed_to_each_expert():
    """load_counts (what balance_router_biases follows) after a training forward: per layer and expert the real
    tokens routed there (replayed ids, counted by hand), padding and the skip class (4) left out; evaluation
    forwards and forwards without gradient count nothing."""
    m = _spread_zaya().train()
    ids = torch.randint(3, V, (2, 4), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    routes = [torch.tensor([[0, 1, 1, 4], [2, 2, 3, 3]])[..., None],  # row 1: the two padded slots (2, 2) not counted
              torch.tensor([[4, 4, 4, 4], [3, 0, 4, 0]])[..., None],
              torch.tensor([[3, 3, 3, 2], [1, 1, 1, 1]])[..., None]]
    got = _load_after_training_forward(m, ids, mask, routes)
    assert got.tolist() == [[1, 2, 0, 2], [1, 0, 0, 0], [0, 2, 1, 3]]
    m.eval()
    assert _load_after_training_forward(m, ids, mask, routes).sum().item() == 0
    m.train()
    with torch.no_grad():
        m(ids, mask, routed_experts=routes)
    assert all(layer.mlp.gate.load_counts.sum().item() == 0 for layer in m.model.layers)


def test_expert_loads_keeps_the_masked_tokens_only():
    routes = [torch.tensor([[[0], [1], [1]], [[2], [4], [3]]]), torch.tensor([[[3], [3], [3]], [[3], [0], [1]]])]
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    assert expert_loads(routes, 4, mask).tolist() == [[0, 2, 1, 0], [1, 0, 0, 3]]
    assert expert_loads(routes, 4).tolist() == [[1, 2, 1, 1], [1, 1, 0, 4]]


def test_bias_update_for_a_layer_whose_tokens_all_skipped_and_wrong_layer_counts():
    """A layer whose every token took the skip class has load 0 on each expert (< 1/E): every expert's bias goes up
    one step (as long as some layer counted a token); counts for another number of layers are refused."""
    m = _spread_zaya()
    before = torch.stack([l.mlp.gate.balancing_biases.clone() for l in m.model.layers])
    counts = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0]])
    load = update_balancing_biases(m, counts, rate=0.01)
    assert load.tolist() == [[0.25] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 0.0]]
    step = torch.stack([l.mlp.gate.balancing_biases for l in m.model.layers]) - before
    torch.testing.assert_close(step, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.01, 0.01, 0.01, 0.01, 0.0],
                                                   [-0.01, 0.01, 0.01, 0.01, 0.0]]))
    with pytest.raises(ValueError, match="layers"):
        update_balancing_biases(m, counts[:2], rate=0.01)


def test_balance_router_biases_with_a_zero_rate_is_a_no_op_that_still_resets_the_counts():
    from train.model.zaya import balance_router_biases

    m = _spread_zaya(router_bias_update_rate=0.0)
    before = [l.mlp.gate.balancing_biases.clone() for l in m.model.layers]
    for l in m.model.layers:
        l.mlp.gate.load_counts += torch.tensor([5.0, 0.0, 1.0, 0.0])
    assert balance_router_biases(m) is None
    assert all(torch.equal(l.mlp.gate.balancing_biases, b) for l, b in zip(m.model.layers, before))
    assert all(l.mlp.gate.load_counts.sum().item() == 0 for l in m.model.layers)
    m.config.router_bias_update_rate = 0.01
    for l in m.model.layers:
        l.mlp.gate.load_counts += torch.tensor([5.0, 0.0, 1.0, 0.0])
    load = balance_router_biases(m)
    assert load is not None and load[0].tolist() == pytest.approx([5 / 6, 0.0, 1 / 6, 0.0])


def test_checkpointed_layers_replay_the_forwards_routing_and_record_a_replayed_one():
    """checkpoint_layers: backward's recomputation routes as the forward did even where the router would now choose
    otherwise (balancing biases moved between forward and backward), so the gradients are the plain forward's; a
    forward that replays given routes records those routes, one entry per layer."""
    m = _spread_zaya()
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(7))
    w = torch.randn(2, 10, V, generator=torch.Generator().manual_seed(8))
    (m(ids) * w).sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    out = m(ids, checkpoint_layers=True)
    with torch.no_grad():
        for layer in m.model.layers:  # the router would now pick expert 0 for every token
            layer.mlp.gate.balancing_biases.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0]))
    (out * w).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-5, msg=n)
    routes = [torch.randint(0, 5, (2, 10, 1), generator=torch.Generator().manual_seed(9)) for _ in range(3)]
    rec = []
    m(ids, routed_experts=routes, record_routing=rec, checkpoint_layers=True).sum().backward()
    assert len(rec) == 3 and all(torch.equal(r.reshape(2, 10, 1), s) for r, s in zip(rec, routes))
    m(ids, routed_experts=routes, checkpoint_layers=True).sum().backward()  # nothing to record into


@pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")
def test_only_the_implemented_zaya_modules_take_the_native_steps():
    """ZayaNativeDecoder implements train/model/zaya.py's modules: a subclass of CausalLM with its own hidden states
    or zaya layer stack, or a zaya layer with a swapped residual scaling / router MLP / q-k norm keeps the PyTorch
    step (its computation may differ from the fused ops')."""
    from train.model.zaya import QKNorm, ResidualScaling, RouterMLP

    assert native.load(), native._STATE.get("error")
    assert isinstance(native.decoder(_spread_zaya()), native.ZayaNativeDecoder)

    class OwnHidden(CausalLM):
        def hidden_states(self, *args, **kw):
            return super().hidden_states(*args, **kw)

    class OwnStack(CausalLM):
        def _zaya_layers(self, *args):
            return super()._zaya_layers(*args)

    class OwnScaling(ResidualScaling):
        pass

    class OwnRouterMLP(RouterMLP):
        pass

    class OwnQKNorm(QKNorm):
        pass

    def swap(obj, cls):
        obj.__class__ = cls

    for change in (lambda m: swap(m, OwnHidden), lambda m: swap(m, OwnStack),
                   lambda m: swap(m.model.layers[2].post_mlp_residual_scale, OwnScaling),
                   lambda m: swap(m.model.layers[0].post_attention_residual_scale, OwnScaling),
                   lambda m: swap(m.model.layers[1].mlp.gate.router_mlp, OwnRouterMLP),
                   lambda m: swap(m.model.layers[1].self_attn.qk_norm, OwnQKNorm)):
        m = _spread_zaya()
        change(m)
        assert not native.usable(m) and native.decoder(m) is None


@pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")
def test_native_zaya_one_token_prompts_and_a_padded_single_token_step():
    """ZayaNativeDecoder.forward with one token per row on an empty cache (prompts of one token: a prefill, with
    no convolution or delayed-value state yet) gives the PyTorch model's logits and cache, then steps on; one token
    per row where a row's token is padding is refused as for longer inputs; a step past the cache's capacity too."""
    from train.model.modeling import KVCache

    assert native.load(), native._STATE.get("error")
    m = _spread_zaya(attention_bias=True)
    dec = native.decoder(m)
    ids = torch.tensor([[5], [9]])
    with torch.inference_mode():
        ref_c = KVCache.allocate(m.config, 2, 3, "cpu", torch.float32)
        nat_c = KVCache.allocate(m.config, 2, 3, "cpu", torch.float32)
        ref = m.last_logits(ids, cache=ref_c)
        torch.testing.assert_close(dec.forward(ids, nat_c), ref, rtol=1e-5, atol=1e-5)
        tok = ref.argmax(-1)
        torch.testing.assert_close(dec.step(tok, nat_c), m.last_logits(tok[:, None], cache=ref_c), rtol=1e-5,
                                   atol=1e-5)
        with pytest.raises(ValueError, match="at least one real token"):
            dec.forward(tok[:, None], nat_c, torch.tensor([[True], [False]]))
        assert nat_c.length == 3
        with pytest.raises(ValueError, match="overflow"):
            dec.step(tok, nat_c)


@pytest.mark.skipif(not native.enabled(), reason="CASCADE_NATIVE_DECODE=0")
def test_native_zaya_prefill_returns_each_rows_last_real_token_wherever_the_padding_is():
    """ZayaNativeDecoder.forward's logits are those of each row's last real token, also where padding follows it
    (as NativeDecoder.forward), not those of the last slot."""
    from train.model.modeling import KVCache

    assert native.load(), native._STATE.get("error")
    m = _spread_zaya()
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(10))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.inference_mode():
        full = m(ids, mask)
        got = native.decoder(m).forward(ids, KVCache.allocate(m.config, 2, 8, "cpu", torch.float32), mask)
    torch.testing.assert_close(got, torch.stack([full[0, 3], full[1, 5]]), rtol=1e-5, atol=1e-5)
