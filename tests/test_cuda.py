"""The CUDA / NCCL paths, on a machine with a GPU (skipped without one; CI has none).

Everything else in the suite runs on CPU with gloo; these run the same code on ``cuda:0``:
the sharded RL update in an NCCL world against the single-process reference step on CPU (fp32,
two steps), bf16 packed attention as one varlen FlashAttention call (and the per-sequence path for head
sizes FlashAttention refuses), a ZAYA1 policy on the TSP core, the torch engine's sampled log-probs and router replay against the trainer's
teacher-forced ones on the GPU, the HF-format model's logits against transformers' on the GPU, and
the torchrun trainer worker (NCCL) killed and resumed from its sharded checkpoint, and ``cascade
run`` with a rollout server and the weight broadcast on the same GPU, and with the in-process
PipelineRL loop. One GPU allows an NCCL world of one rank only (NCCL refuses two ranks on one device,
and ``cascade run`` keeps a one-rank trainer in its own process), so the multi-rank meshes stay
tested on gloo.

    pytest tests/test_cuda.py        # on a GPU machine
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.test_distributed_run import warm_dir  # noqa: F401 (fixture)
from tests.test_rl_distributed import worker_setup  # noqa: F401 (fixture)

# CASCADE_TEST_DEVICE=cpu runs the same checks on CPU with gloo (to check the tests themselves)
DEV = torch.device(os.environ.get("CASCADE_TEST_DEVICE", "cuda:0"))
pytestmark = pytest.mark.skipif(DEV.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _exact_fp32():
    """No TF32 in matmuls: the comparisons below are fp32 against fp32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_sharded_rl_update_in_an_nccl_world_equals_the_cpu_reference():
    """RLUpdater on cuda:0 in an NCCL world of one rank (every collective of the DP x TSP code runs on
    NCCL with CUDA tensors) ends two RL steps with the CPU single-process reference's weights."""
    import torch.distributed as dist

    from tests.test_parallel import _cfgs, _model
    from tests.test_rl_distributed import CASES, make_batch, reference_weights, rl_cfg
    from train.parallel.comm import free_port
    from train.parallel.rl_update import RLUpdater

    dist.init_process_group("nccl" if DEV.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}", device_id=DEV if DEV.type == "cuda" else None)
    try:
        errs = {}
        for name, loss in CASES:
            cfg = _cfgs()[name]
            rcfg = rl_cfg(loss)
            batches = [make_batch(s, cfg) for s in range(2)]
            want, ref_m = reference_weights(cfg, rcfg, batches)
            up = RLUpdater(_model(cfg).to(DEV), rcfg, tsp=1, dp=1)
            mets = [up.step(b, i) for i, b in enumerate(batches)]
            got = up.full_state_dict()
            assert set(got) == set(want)
            moved = max((want[k] - _model(cfg).state_dict()[k]).abs().max().item() for k in want)
            errs[f"{name}.{loss}"] = max((got[k].cpu() - want[k]).abs().max().item() for k in want)
            assert moved > 1e-4, moved
            assert all(abs(m["loss"] - r["loss"]) < 1e-5 for m, r in zip(mets, ref_m)), (mets, ref_m)
        print("cuda vs cpu reference, max |param diff|:", json.dumps(errs))
        assert max(errs.values()) < 1e-5, errs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("d", [64, 10])
def test_packed_attention_takes_one_varlen_kernel_in_bf16(d):
    """bf16 packed attention on the GPU is one varlen FlashAttention call (GQA heads as they are); its
    output and gradients match per-sequence attention computed in fp32 from the same inputs. A head size
    FlashAttention refuses (not a multiple of 8) takes the per-sequence path instead of raising."""
    from train.model.modeling import Segments, segment_attention, uses_varlen

    g = torch.Generator().manual_seed(0)
    lens = [5, 130, 1, 64, 300]
    N, hq, hk = sum(lens), 8, 2
    seg = Segments.of([0, *torch.tensor(lens).cumsum(0).tolist()], N)
    q, k, v = (torch.randn(1, h, N, d, generator=g).to(DEV, torch.bfloat16).requires_grad_() for h in (hq, hk, hk))
    assert uses_varlen(q) == (DEV.type == "cuda" and d % 8 == 0)
    out = segment_attention(q, k, v, seg, gqa=True)
    dout = torch.randn(out.shape, generator=g).to(DEV, torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.cat([F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                     for qs, ks, vs in zip(q32.split(lens, 2), k32.split(lens, 2), v32.split(lens, 2))], dim=2)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
    print(f"bf16 packed attention (head_dim {d}) vs fp32 per sequence, relative errors (out, dq, dk, dv):", errs)
    assert max(errs) < 2e-2, errs


def test_tsp_zaya_policy_trains_on_the_gpu():
    """A ZAYA1 policy on the TSP core (one rank, NCCL): its routers' balancing biases and load counts live on
    the GPU with its shards (they were left on the CPU, so the first routed forward raised), the log-probs
    equal the single-process model's, and the forward counts the real tokens' experts (at most one per token
    and layer: padding and the skip class count for none)."""
    import torch.distributed as dist

    from tests.test_parallel import _model
    from tests.test_rl_distributed import _zaya_cfg
    from train.model.modeling import token_logprobs
    from train.parallel.comm import free_port
    from train.parallel.tsp import TSPCausalLM

    dist.init_process_group("nccl" if DEV.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}", device_id=DEV if DEV.type == "cuda" else None)
    try:
        ref = _model(_zaya_cfg()).to(DEV)
        tsp = TSPCausalLM(ref)
        devices = {t.device for t in [*tsp.parameters(), *tsp.buffers(), *tsp.model_buffers().values()]}
        assert devices == {DEV}, devices
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 50, (2, 12), generator=g).to(DEV)
        am = torch.ones_like(ids)
        am[0, :3] = 0  # left padding: not counted in the load
        lp, slots = tsp.token_logprobs(ids, am)
        want = token_logprobs(ref, ids, am)
        inside = slots < ids.shape[1] - 1
        real = am.bool()[:, slots[inside]]
        err = (lp[:, inside] - want[:, slots[inside]])[real].abs().max().item()
        assert err < 1e-4, err
        lp[:, inside][real].sum().backward()  # (the backward runs on the GPU too)
        counts = sum(gate.load_counts.sum().item() for gate in tsp.zaya_gates)
        assert counts <= int(am.sum()) * len(tsp.zaya_gates) and counts > 0, counts
    finally:
        dist.destroy_process_group()


def _moe(seed=0):
    from tests.test_engine_inflight import _model

    m = _model(seed, num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[])
    return m


def _teacher(model, prompt, completion, temperature, routed=None):
    from train.model.modeling import token_logprobs

    seq = torch.tensor([prompt + completion], device=DEV)
    with torch.no_grad():
        return token_logprobs(model, seq, temperature=temperature, routed_experts=routed)[0, len(prompt) - 1:].cpu()


def test_engine_logprobs_and_router_replay_on_the_gpu():
    """The torch engine on cuda:0: its sampled tokens' log-probs equal the trainer's teacher-forced
    ones on the GPU; with the trainer's router perturbed, only replaying the engine's recorded expert
    ids keeps them equal."""
    from tests.test_engine_inflight import PROMPTS
    from train.engine import SamplingParams, TorchEngine

    m = _moe().to(DEV)
    eng = TorchEngine(copy.deepcopy(m), return_routed_experts=True)
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=2))
    trainer = copy.deepcopy(m)
    for c in outs:
        torch.testing.assert_close(_teacher(trainer, c.prompt_token_ids, c.token_ids, 0.9, c.routed_experts),
                                   torch.tensor(c.logprobs), rtol=0, atol=1e-4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in trainer.model.layers:
            layer.mlp.gate.weight.add_((torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.3).to(DEV))
    worst = 0.0
    for c in outs:
        lp = torch.tensor(c.logprobs)
        torch.testing.assert_close(_teacher(trainer, c.prompt_token_ids, c.token_ids, 0.9, c.routed_experts), lp,
                                   rtol=0, atol=1e-4)
        worst = max(worst, float((_teacher(trainer, c.prompt_token_ids, c.token_ids, 0.9) - lp).abs().max()))
    assert worst > 1e-2, worst


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_match_transformers_on_the_gpu(kind, tmp_path):
    from tests.conftest import hf_random_model
    from train.model.hf_io import load_pretrained

    hf = hf_random_model(kind, tie_word_embeddings=(kind == "dense"))
    hf.save_pretrained(tmp_path / "hf")
    hf = hf.to(DEV).eval()
    ours = load_pretrained(tmp_path / "hf", device=DEV).eval()
    ids = torch.randint(0, 320, (3, 23), generator=torch.Generator().manual_seed(1)).to(DEV)
    am = torch.ones(3, 23, dtype=torch.long, device=DEV)
    am[1, :7] = 0
    am[2, 19:] = 0
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-4
        keep = am.bool()
        assert (ours(ids, attention_mask=am) - hf(ids, attention_mask=am).logits)[keep].abs().max().item() < 1e-4


def _stage(warm_dir, tmp_path, *args):
    """``cascade run`` of test_distributed_run's RLVE stage from the warm policy on DEV with ``args``;
    returns the run directory and its RL step records."""
    from tests.test_distributed_run import STAGE, cascade, rl_records

    out = tmp_path / "run"
    r = cascade(f"out={out}", f"model={warm_dir}", *STAGE, f"device={DEV.type}", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, rl_records(out)


def test_torchrun_worker_on_the_gpu_resumes_after_kill_9(worker_setup):
    """train/rl/worker.py under torchrun on cuda:0 (NCCL world of one rank): killed with SIGKILL after
    its step-2 checkpoint (torch.distributed.checkpoint of GPU tensors), restarted, it resumes there and
    publishes final weights equal to the CPU single-process reference after three steps."""
    from tests.test_rl_distributed import TOL, _final_weights, _finish, _max_err, _start_worker, _wait_for
    from cascade.learner import kill_tree
    from train.rl.exchange import write_batch

    root, batches, (_, ref3) = worker_setup
    ex = root / "run_cuda" / "exchange"
    ex.mkdir(parents=True)
    extra = ["--checkpoint-every", "1", "--device", DEV.type]
    proc, log = _start_worker(ex, root / "init", 3, tsp=1, dp=1, extra=extra)
    try:
        write_batch(ex, batches[0])
        write_batch(ex, batches[1])
        _wait_for(ex / "trainer_ckpt" / "step-000002" / "COMPLETE", proc)
    finally:
        kill_tree(proc.pid)
        proc.wait()
        log.close()
    write_batch(ex, batches[2])
    proc, log = _start_worker(ex, root / "init", 3, tsp=1, dp=1, extra=extra)
    _finish(proc, log)
    text = open(log.name).read()
    assert '"worker": "start", "step": 2' in text, text[-3000:]
    assert f'"device": "{DEV}"' in text or f'"device": "{DEV.type}"' in text, text[-3000:]
    err = _max_err(_final_weights(ex), ref3)
    print("worker on", DEV, "vs cpu reference, max |param diff|:", err)
    assert err < TOL


def test_cascade_run_with_a_server_and_the_broadcast_on_the_gpu(warm_dir, tmp_path):
    """``cascade run device=cuda`` with a rollout server on the same GPU and the weight broadcast (gloo
    through host memory: the run and the server share a device): the server's behaviour log-probs equal
    the trainer's, no broadcast fails, the policy moves."""
    from tests.test_distributed_run import final_weights
    from train.model.hf_io import read_state_dict

    out, recs = _stage(warm_dir, tmp_path, "steps=3", "rollout.servers=1", "rollout.weight_transport=broadcast")
    print("mismatch_kl per step:", [x["mismatch_kl"] for x in recs])
    assert len(recs) == 3 and all(x["groups_trained"] == 8 for x in recs)
    assert all(x["mismatch_kl"] < 1e-5 and x["version_lag_max"] == 0 for x in recs), recs
    assert all(x["weight_broadcast_failures"] == 0 for x in recs), recs
    assert any(not torch.equal(v, read_state_dict(warm_dir)[k]) for k, v in final_weights(out).items())


def test_cascade_run_pipelined_in_one_process_on_the_gpu(warm_dir, tmp_path):
    """The in-process PipelineRL loop on cuda:0 (``rl.max_staleness=2``): no trained token is more
    than 2 versions old, and the stage ends with its final checkpoint."""
    out, recs = _stage(warm_dir, tmp_path, "steps=4", "rl.max_staleness=2", "rl.sync_every=1")
    print("version_lag_max per step:", [x["version_lag_max"] for x in recs])
    assert len(recs) == 4 and max(x["version_lag_max"] for x in recs) <= 2
    assert (out / "stages" / "1-rlve" / "final" / "config.json").exists()


def test_cascade_run_in_bf16_on_the_gpu(warm_dir, tmp_path):
    """``cascade run device=cuda dtype=bfloat16``: the policy computes in bf16 (on the GPU the packed
    attention is the varlen kernel) with fp32 master weights; the stage trains and ends."""
    out, recs = _stage(warm_dir, tmp_path, "steps=3", "dtype=bfloat16")
    print("bf16 grad_norm per step:", [x["grad_norm"] for x in recs])
    assert len(recs) == 3 and all(x["grad_norm"] > 0 and x["grad_norm"] == x["grad_norm"] for x in recs)
    assert (out / "stages" / "1-rlve" / "final" / "config.json").exists()

