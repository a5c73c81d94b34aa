"""The torch engine's weight versions, in-flight weight updates and router-replay recording
(native C++ path and PyTorch path)."""
import copy
import threading

import pytest
import torch

from tests.conftest import wait_until
from tests.test_native import _model as native_model

from train.engine import SamplingParams, TorchEngine, native
from train.model.modeling import token_logprobs

PATHS = ["native", "torch"]


def _model(seed=0, **kw):
    """test_native's model, MoE with a dense middle layer by default, with peaked next-token
    distributions (greedy and sampling differ from noise)."""
    base = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    m = native_model(seed, **{**base, **kw})
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)
    return m


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "native":
        if not native.enabled() or not native.load():
            pytest.skip("native decode extension unavailable")
    else:
        monkeypatch.setenv("CASCADE_NATIVE_DECODE", "0")
    return request.param


PROMPTS = [[5, 17, 33, 2, 90, 11, 7], [120, 4], [9, 9, 31, 64, 150, 3, 77, 18, 42, 1, 6]]


def _teacher(model, prompt, completion, temperature=1.0, routed=None):
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        return token_logprobs(model, seq, temperature=temperature, routed_experts=routed)[0, len(prompt) - 1:]


def _greedy(model, prefix, steps):
    seq = list(prefix)
    for _ in range(steps):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prefix):]


def _record(model, prompt, completion):
    """The expert ids the model itself picks over prompt + completion (teacher forcing)."""
    rec: list = []
    with torch.no_grad():
        model(torch.tensor([prompt + completion]), record_routing=rec)
    return rec


def _updated_in_flight(eng, new_sd, at_step, version, errors):
    """A step hook that, after sampled step ``at_step``, starts ``load_weights`` on another thread and
    returns once that update waits for the generating thread (so it lands at this step boundary)."""
    loader = {}

    def load():
        try:
            eng.load_weights(new_sd, version=version)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def hook(step):
        if step == at_step:
            loader["t"] = threading.Thread(target=load)
            loader["t"].start()
            wait_until(lambda: eng.update_pending or not loader["t"].is_alive(), 30, every=0.001)

    return hook, loader


def test_versions_switch_mid_sequence_under_an_in_flight_update(path):
    old, new = _model(0), _model(1)
    eng = TorchEngine(copy.deepcopy(old), version=3)
    k, T = 3, 9
    errors: list = []
    eng.step_hook, loader = _updated_in_flight(eng, new.state_dict(), k, 4, errors)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True),
                        return_routed_experts=True)
    loader["t"].join(30)
    assert not errors and eng.version == 4 and eng.stats.kv_refreshes == 1
    for prompt, c in zip(PROMPTS, outs):
        assert len(c.token_ids) == T
        assert c.versions == [3] * (k + 1) + [4] * (T - k - 1)
        # before the switch: the old model's greedy tokens; after: the new model's, given that prefix
        assert c.token_ids[:k + 1] == _greedy(old, prompt, k + 1)
        assert c.token_ids[k + 1:] == _greedy(new, prompt + c.token_ids[:k + 1], T - k - 1)
        # logprobs: the old policy's before the switch, exactly the new policy's after it
        torch.testing.assert_close(torch.tensor(c.logprobs[:k + 1]), _teacher(old, prompt, c.token_ids)[:k + 1],
                                   rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(c.logprobs[k + 1:]), _teacher(new, prompt, c.token_ids)[k + 1:],
                                   rtol=0, atol=1e-4)
        # the running rows were re-prefilled under the new weights: the routing is the new model's
        for got, ref in zip(c.routed_experts, _record(new, prompt, c.token_ids[:-1])):
            assert torch.equal(got[:, :-1], ref)
    # the next call runs on the new weights from its first token
    again = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert again.versions == [4] * 4 and again.token_ids == _greedy(new, PROMPTS[0], 4)


def test_sampled_rows_and_stale_kv_option(path):
    """n > 1 seeded sampling with rows leaving the batch; without the refresh the KV cache stays
    (cheaper), the version still switches at the boundary and nothing is dropped."""
    old, new = _model(0), _model(1)
    for refresh in (True, False):
        eng = TorchEngine(copy.deepcopy(old), refresh_kv_on_update=refresh)
        errors: list = []
        eng.step_hook, loader = _updated_in_flight(eng, new.state_dict(), 2, None, errors)
        sp = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=4, stop_token_ids=[7, 11, 90])
        outs = eng.generate(PROMPTS, sp)
        loader["t"].join(30)
        assert not errors and eng.version == 1 and len(outs) == 6
        for c in outs:
            assert len(c.versions) == len(c.token_ids) and c.versions == sorted(c.versions)
            assert c.versions[:3] == [0] * min(3, len(c.token_ids)) and set(c.versions[3:]) <= {1}
            if refresh:
                prompt = PROMPTS[c.prompt_index]
                lp = _teacher(new, prompt, c.token_ids, temperature=0.8)
                torch.testing.assert_close(torch.tensor(c.logprobs[3:]), lp[3:], rtol=0, atol=1e-4)


def test_load_weights_idle_and_failures(path):
    old, new = _model(0), _model(1)
    eng = TorchEngine(copy.deepcopy(old))
    assert eng.version == 0
    eng.load_weights(new.state_dict())
    assert eng.version == 1
    eng.load_weights(old.state_dict(), version=10)
    assert eng.version == 10
    bad = dict(new.state_dict())
    bad.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing"):
        eng.load_weights(bad)
    assert eng.version == 10
    # a failing update in flight: the loader gets the error, generation continues on the old weights
    errors: list = []
    eng.step_hook, loader = _updated_in_flight(eng, bad, 1, 11, errors)
    c = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    loader["t"].join(30)
    assert len(errors) == 1 and "missing" in str(errors[0]) and eng.version == 10
    assert c.versions == [10] * 5 and c.token_ids == _greedy(old, PROMPTS[0], 5)


@pytest.mark.parametrize("kind", ["top2-mixed", "top3-no-renorm"])
def test_recorded_routing_is_what_the_model_routes(path, kind):
    kw = {"top2-mixed": {}, "top3-no-renorm": dict(num_experts=5, num_experts_per_tok=3, norm_topk_prob=False,
                                                   mlp_only_layers=[])}[kind]
    m = _model(0, **kw)
    eng = TorchEngine(m)
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=7, seed=1), return_routed_experts=True)
    n_moe = sum(layer.is_moe for layer in m.model.layers)
    for c in outs:
        P, C = len(c.prompt_token_ids), len(c.token_ids)
        assert len(c.routed_experts) == n_moe
        ref = _record(m, c.prompt_token_ids, c.token_ids[:-1])
        for got, r in zip(c.routed_experts, ref):
            assert got.dtype == torch.long and got.shape == (1, P + C, m.config.num_experts_per_tok)
            assert torch.equal(got[:, :-1], r) and torch.equal(got[:, -1], got[:, -2])
        # replaying its own routing changes nothing
        torch.testing.assert_close(_teacher(m, c.prompt_token_ids, c.token_ids, routed=c.routed_experts),
                                   torch.tensor(c.logprobs), rtol=0, atol=1e-4)
    assert eng.generate(PROMPTS, SamplingParams(max_tokens=3, seed=1))[0].routed_experts is None


def test_router_replay_end_to_end(path):
    """The trainer's copy has perturbed router weights (it has moved on since the engine's version).
    With the engine's recorded expert ids replayed, the trainer's teacher-forced log-probs equal the
    engine's sampled ones; without replay they do not. Top-1 routing with renormalisation makes the
    mixing weight 1 whatever the router's probabilities, so replay alone decides the experts' output."""
    m = _model(0, num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[])
    eng = TorchEngine(copy.deepcopy(m), return_routed_experts=True)
    trainer = copy.deepcopy(m)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in trainer.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.3)
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=2))
    worst = 0.0
    for c in outs:
        lp = torch.tensor(c.logprobs)
        replay = _teacher(trainer, c.prompt_token_ids, c.token_ids, 0.9, routed=c.routed_experts)
        torch.testing.assert_close(replay, lp, rtol=0, atol=1e-4)
        plain = _teacher(trainer, c.prompt_token_ids, c.token_ids, 0.9)
        worst = max(worst, float((plain - lp).abs().max()))
    assert worst > 1e-2, worst


def test_routing_needs_an_moe_model():
    eng = TorchEngine(_model(0, num_experts=0, mlp_only_layers=[]))
    with pytest.raises(ValueError, match="MoE"):
        eng.generate(PROMPTS, SamplingParams(max_tokens=2), return_routed_experts=True)
