"""Sharded layouts (TSP, TP, TP+SP, DP ZeRO-1, DP x TSP) against the single-process policy.

One gloo process group is spawned per world size (2 and 4); every check runs inside it and the
ranks return their largest deviations to the parent, which asserts. fp32 throughout; forward
logits and EVERY parameter gradient (gathered) must match within 1e-5 (one bf16 check: the fp32
residual stream, :func:`_check_bf16_residual`). Families: Qwen3 dense and MoE, Qwen2 (q/k/v biases, no
q/k norm), Llama 3 (llama3 RoPE scaling, biases on all four projections) and, in TSP, ZAYA1.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

import pytest
import torch

from train.parallel.comm import free_port

TOL = 1e-5
# AdamW's first step is lr * g / (|g| + eps): with eps = 1e-8 a near-zero gradient's sign decides a
# full lr-sized update, so fp32 summation order alone moved parameters by 1.2e-5 (DP 2 x TSP 2). A
# larger eps keeps the comparison well-conditioned (and still sensitive to the gradient's scale).
EPS = 1e-4
T = 13  # not a multiple of 2D for D = 2, 4


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}  # with head_dim 8: two of four frequencies scaled, one smoothed


def _cfgs():
    from train.model.config import ModelConfig

    base = dict(vocab_size=50, hidden_size=32, intermediate_size=42, num_hidden_layers=2, head_dim=8)
    dense = ModelConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **base)
    moe = ModelConfig(num_attention_heads=8, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=18, mlp_only_layers=[0], **base)  # layer 0 dense, layer 1 MoE
    # Qwen2: q/k/v biases, no o_proj bias, no q/k norm (2 kv heads: broadcast with their biases at D = 4)
    qwen2 = ModelConfig(architecture="qwen2", attention_bias=True, num_attention_heads=4, num_key_value_heads=2, **base)
    # Llama 3: no q/k norm, llama3 RoPE scaling, and (attention_bias) biases on all four projections
    llama3 = ModelConfig(architecture="llama", attention_bias=True, rope_scaling=LLAMA3_ROPE, num_attention_heads=8,
                         num_key_value_heads=4, tie_word_embeddings=True, **base)
    # ZAYA1: CCA (q/k convolutions of look-back 3 > the 2-slot zigzag chunks at D = 4, so a halo spans
    # chunks of several ranks; the delayed value), top-1 routing with a skip class, router state across
    # layers, residual scalings; biases on every projection
    zaya = ModelConfig(architecture="zaya", num_attention_heads=8, num_key_value_heads=4, num_experts=4,
                       num_experts_per_tok=1, moe_intermediate_size=18, router_hidden_size=8, partial_rotary_factor=0.5,
                       cca_time0=2, cca_time1=3, attention_bias=True, **base)
    # ZAYA1's 2 KV heads (no biases): at D = 4 two ranks share each KV head (their query heads form one unit)
    zaya2 = ModelConfig(architecture="zaya", num_attention_heads=8, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=1, moe_intermediate_size=18, router_hidden_size=8,
                        partial_rotary_factor=0.5, **base)
    return {"dense": dense, "moe": moe, "qwen2": qwen2, "llama3": llama3, "zaya": zaya, "zaya2": zaya2}


def _model(cfg, seed=0):
    """The test model, biases random too (``init_weights`` zeroes them, which would hide their gradients)."""
    from train.model.modeling import CausalLM

    m = CausalLM(cfg).init_weights(seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith((".bias", "_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif n.endswith(("_scale", ".temp")):  # zaya's residual scales and key temperatures: not all ones
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        for n, b in m.named_buffers():
            if n.endswith("balancing_biases"):  # zaya: routing that the biases decide
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return m


def _batch(seed=1, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (B, T), generator=g), torch.rand(B, T, generator=g) > 0.3


def _ref_loss(model, ids, loss_mask, am=None):
    logits = model(ids, am)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tgt = loss_mask.clone()
    tgt[:, 0] = False
    if am is not None:
        tgt &= am.bool()
    return -(logp * tgt[:, 1:]).sum() / tgt.sum(), logits


def _grad_err(full_grads, ref):
    errs = {n: (full_grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()}
    missing = {n for n, _ in ref.named_parameters()} - set(full_grads)
    assert not missing, missing
    return max(errs.values())


def _check_tsp(W, out):
    from train.model.modeling import token_logprobs
    from train.parallel.tsp import TSPCausalLM

    left_pad = torch.tensor([[0, 0, 1] + [1] * (T - 3), [1] * T])
    for name, cfg in _cfgs().items():
        for am in (None, left_pad):
            key = f"tsp{W}.{name}.{'mask' if am is not None else 'causal'}"
            ref = _model(cfg)
            ids, lm = _batch()
            loss, logits = _ref_loss(ref, ids, lm, am)
            loss.backward()
            tsp = TSPCausalLM(ref)
            local = tsp.sft_loss(ids, lm, am)
            local.backward()
            tsp.sync_grads()
            total = local.detach().clone()
            torch.distributed.all_reduce(total)
            with torch.no_grad():
                full = tsp.gather_logits(tsp(ids, am), T)
            keep = am.bool() if am is not None else torch.ones(ids.shape, dtype=torch.bool)
            out[key + ".logits"] = (full - logits.detach())[keep].abs().max().item()
            out[key + ".loss"] = abs(total.item() - loss.item())
            out[key + ".grads"] = _grad_err(tsp.gather_full(grads=True), ref)
            with torch.no_grad():  # at a temperature, with entropies (the LM head shard by shard)
                lp, slots, ent = tsp.token_logprobs(ids, am, temperature=0.7, return_entropy=True)
                want = token_logprobs(ref, ids, am, temperature=0.7)
                all_lp = torch.log_softmax(ref(ids, am)[:, :-1] / 0.7, -1)
                want_ent = -(all_lp.exp() * all_lp).sum(-1)
                inside = slots < T - 1
                err = (lp[:, inside] - want[:, slots[inside]])
                err_ent = (ent[:, inside] - want_ent[:, slots[inside]])
                if am is not None:
                    err = err[am.bool()[:, slots[inside]]]
                    err_ent = err_ent[am.bool()[:, slots[inside]]]
                out[key + ".logprobs"] = max(err.abs().max().item(), err_ent.abs().max().item())
    # a packed row: sequences back to back (6 + 1 + 10 tokens: the long one straddles zigzag chunks), against
    # each sequence run on its own; the sequences' last tokens (whose next token starts another) are not scored
    lens = [6, 1, 10]
    cu = [0, 6, 7, 17]
    scored = torch.tensor([p for a, b in zip(cu, cu[1:]) for p in range(a, b - 1)])
    for name, cfg in _cfgs().items():
        key = f"tsp{W}.{name}.packed"
        ref = _model(cfg)
        g = torch.Generator().manual_seed(3)
        seqs = [torch.randint(0, 50, (n,), generator=g) for n in lens]
        row = torch.cat(seqs)[None]
        logits = [ref(x[None])[0] for x in seqs]
        want = torch.cat([torch.log_softmax(z[:-1], -1).gather(-1, x[1:, None]).squeeze(-1) for z, x in zip(logits, seqs)])
        loss = -want.sum() / len(scored)
        loss.backward()
        tsp = TSPCausalLM(ref)
        # the LM head 3 rows at a time, on this rank's scored positions only
        mask = torch.zeros(row.shape, dtype=torch.bool)
        mask[0, scored] = True
        lp, slots = tsp.token_logprobs(row, cu_seqlens=cu, chunk_tokens=3, scored=mask)
        valid = torch.isin(slots, scored)
        out[key + ".unscored_nonzero"] = int((lp[0][~valid] != 0).sum())
        local = -(lp[0] * valid).sum() / len(scored)
        local.backward()
        tsp.sync_grads()
        total = local.detach().clone()
        torch.distributed.all_reduce(total)
        with torch.no_grad():
            full = tsp.gather_logits(tsp(row, cu_seqlens=cu), row.shape[1])[0]
        want_at = torch.zeros(row.shape[1])
        want_at[scored] = want.detach()
        out[key + ".logits"] = (full - torch.cat(logits).detach()).abs().max().item()
        out[key + ".loss"] = abs(total.item() - loss.item())
        out[key + ".grads"] = _grad_err(tsp.gather_full(grads=True), ref)
        out[key + ".logprobs"] = (lp[0][valid] - want_at[slots[valid]]).abs().max().item()


def _tp_cfgs(W):
    """The configs TP runs at world size W (Megatron: kv heads divisible by W)."""
    return {n: c for n, c in _cfgs().items()
            if n != "dense" and c.architecture != "zaya" and c.num_key_value_heads % W == 0}


def _check_tp(W, out):
    from train.parallel.tp import TPCausalLM

    for (name, cfg), sp in ((nc, sp) for nc in _tp_cfgs(W).items() for sp in (False, True)):
        key = f"{'sp' if sp else 'tp'}{W}.{name}"
        ref = _model(cfg)
        ids, lm = _batch()
        loss, logits = _ref_loss(ref, ids, lm)
        loss.backward()
        tp = TPCausalLM(ref, sequence_parallel=sp)
        mine = tp.sft_loss(ids, lm)
        mine.backward()
        tp.sync_grads()
        out[key + ".logits"] = (tp.full_logits(ids) - logits.detach()).abs().max().item()
        out[key + ".loss"] = abs(mine.item() - loss.item())
        out[key + ".grads"] = _grad_err(tp.gather_full(grads=True), ref)


def _big_embedding_bf16(cfg, fp32_residual: bool):
    """The test model in bf16 with embeddings scaled by 256 (exact in bf16): the blocks' outputs are
    below half a bf16 ulp of the residual stream, so a bf16 stream rounds them away and an fp32 one
    keeps them."""
    from dataclasses import replace

    m = _model(replace(cfg, fp32_residual=fp32_residual))
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(256.0)
    return m.to(torch.bfloat16)


def _check_bf16_residual(W, out):
    """bf16 with ``fp32_residual``: TSP and TP+SP keep the residual stream in fp32 as the single-process
    model does: their logits stay near the fp32 model's; without it all three lose the blocks' outputs."""
    from train.parallel.tp import TPCausalLM
    from train.parallel.tsp import TSPCausalLM

    for name, cfg in ((n, _cfgs()[n]) for n in ("dense", "moe")):
        ids, _ = _batch()
        with torch.no_grad():
            want = _big_embedding_bf16(cfg, True).float()(ids)
            for flag in (True, False):
                m = _big_embedding_bf16(cfg, flag)
                key = f"bf16res{W}.{name}.{'on' if flag else 'off'}"
                out[key + ".single"] = (m(ids) - want).abs().max().item()
                tsp = TSPCausalLM(m)
                out[key + ".tsp"] = (tsp.gather_logits(tsp(ids), T) - want).abs().max().item()
                if name == "moe":
                    sp = TPCausalLM(m, sequence_parallel=True)
                    out[key + ".sp"] = (sp.full_logits(ids) - want).abs().max().item()


def _adamw_ref(cfg, batches, steps):
    """Single process: AdamW on the mean over replicas of each replica's mean loss."""
    ref = _model(cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(_ref_loss(ref, ids, lm)[0] for ids, lm in batches) / len(batches)
        loss.backward()
        opt.step()
    return ref


def _check_zero(W, out):
    from train.parallel.dp import ZeroAdamW

    cfg = _cfgs()["dense"]
    r = torch.distributed.get_rank()
    batches = [_batch(seed=10 + i) for i in range(W)]
    want = _adamw_ref(cfg, batches, 2)
    model = _model(cfg)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    for _ in range(2):
        opt.zero_grad()
        _ref_loss(model, *batches[r])[0].backward()
        opt.step()
    got = dict(model.named_parameters())
    out[f"zero{W}.params"] = max((got[n] - p).abs().max().item() for n, p in want.named_parameters())
    n_total = sum(p.numel() for p in model.parameters())
    out[f"zero{W}.state_fraction"] = opt.state_bytes() / (2 * 4 * n_total)


def _check_dp_tsp(W, out):
    """World 4 as DP 2 x TSP 2: each DP replica trains on its own batch."""
    from train.parallel.dp import ZeroAdamW
    from train.parallel.shard import make_mesh
    from train.parallel.tsp import TSPCausalLM

    cfg = _cfgs()["moe"]
    tsp_group, dp_group = make_mesh(2, 2)
    d = torch.distributed.get_rank() // 2
    batches = [_batch(seed=20 + i) for i in range(2)]
    want = _adamw_ref(cfg, batches, 1)
    tsp = TSPCausalLM(_model(cfg), tsp_group, dp_group)
    opt = ZeroAdamW(tsp.parameters(), dp_group, lr=1e-2, weight_decay=0.1, eps=EPS, reduce_grads=False)
    tsp.sft_loss(*batches[d]).backward()
    tsp.sync_grads()
    opt.step()
    full = tsp.gather_full()
    out["dp2xtsp2.params"] = max((full[n] - p).abs().max().item() for n, p in want.named_parameters())


def _check_comm_formula(W, out):
    """One training step of each layout under ``comm.track()``: this rank's bytes sent per collective and its
    parameter elements, for the parent to hold against ``cascade calc``'s formulas."""
    from train.parallel import comm
    from train.parallel.dp import ZeroAdamW
    from train.parallel.tp import TPCausalLM
    from train.parallel.tsp import TSPCausalLM

    ids, _ = _batch(seed=5)
    for name in ("moe", "qwen2"):
        cfg = _cfgs()[name]
        for lay in ("tsp", "tp", "sp", "dp"):
            if lay in ("tp", "sp") and cfg.num_key_value_heads % W:
                continue
            ref = _model(cfg)
            m = ref if lay == "dp" else TSPCausalLM(ref) if lay == "tsp" else TPCausalLM(ref, sequence_parallel=lay == "sp")
            with comm.track() as t:
                if lay == "dp":
                    opt = ZeroAdamW(ref.parameters(), lr=1e-3)
                    _ref_loss(ref, ids, torch.ones_like(ids, dtype=torch.bool))[0].backward()
                    opt.step()
                else:
                    m.sft_loss(ids).backward()
                    m.sync_grads()
            out[f"comm{W}.{name}.{lay}"] = {op: v[0] for op, v in t.by("op").items()}
            out[f"comm{W}.{name}.{lay}.params"] = sum(p.numel() for p in m.parameters())


@contextmanager
def world_of_one(tmp_path):
    """A gloo world of one rank in this process (what the sharded modules' collectives need at D = 1)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_checks(rank, world, port, path, checks) -> None:
    """In a spawned rank: join the gloo world, run ``checks`` (each ``fn(world, out)``), save ``out``
    (or the error and its traceback, for the parent to report) to ``path/rank{rank}.pt``."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        for check in checks:
            check(world, out)
    except Exception as e:  # report, then let the parent fail with the message
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))
    if "error" not in out:  # no rank tears its connections down while a peer still uses them (a gloo abort)
        dist.barrier()
    dist.destroy_process_group()


def _worker(rank, world, port, path):
    run_checks(rank, world, port, path, [_check_tsp, _check_tp, _check_zero, _check_bf16_residual, _check_comm_formula]
               + ([_check_dp_tsp] if world == 4 else []))


def spawn(world: int, fn=_worker, *extra):
    """Run ``fn(rank, world, port, dir, *extra)`` on ``world`` gloo ranks; returns each rank's dict."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(fn, args=(world, free_port(), d, *extra), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, spawn(request.param)


def _values(results, prefix):
    W, ranks = results
    for r in ranks:
        assert "error" not in r, r.get("trace")
    vals = {k: max(r[k] for r in ranks) for k in ranks[0] if k.startswith(prefix)}
    assert vals, f"no results for {prefix}"
    return W, vals


@pytest.mark.timeout(300)
def test_tsp_matches_single_process(results):
    W, vals = _values(results, "tsp")
    # dense/moe/qwen2/llama3/zaya/zaya2 x causal/mask/packed x logits/loss/grads/logprobs, and per config the
    # count of nonzero log-probs at unscored positions of the packed row (the LM head skips them: must be 0)
    assert len(vals) == 6 * 3 * 4 + 6, vals
    bad = {k: v for k, v in vals.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.timeout(300)
def test_tp_and_sp_match_single_process(results):
    W, vals = _values(results, ("tp", "sp"))
    assert len(vals) == len(_tp_cfgs(W)) * 2 * 3, vals  # configs x TP/TP+SP x logits/loss/grads
    bad = {k: v for k, v in vals.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.timeout(300)
def test_zero1_step_equals_adamw(results):
    W, vals = _values(results, "zero")
    assert vals[f"zero{W}.params"] < TOL
    # each rank holds about 1/W of the AdamW moments
    assert abs(vals[f"zero{W}.state_fraction"] - 1 / W) < 0.02


@pytest.mark.timeout(300)
def test_dp_x_tsp_mesh(results):
    W, ranks = results
    if W != 4:
        pytest.skip("the 2 x 2 mesh needs world size 4")
    _, vals = _values(results, "dp2xtsp2")
    assert vals["dp2xtsp2.params"] < TOL


@pytest.mark.timeout(300)
def test_bf16_fp32_residual_in_sharded_layouts(results):
    W, vals = _values(results, "bf16res")
    assert len(vals) == 2 * 2 + 2 * 3, vals  # on/off x (dense: single, tsp; moe: single, tsp, sp)
    for name, parts in (("dense", ("single", "tsp")), ("moe", ("single", "tsp", "sp"))):
        for part in parts:
            on, off = vals[f"bf16res{W}.{name}.on.{part}"], vals[f"bf16res{W}.{name}.off.{part}"]
            assert on < 0.25 * off, (name, part, on, off)


def test_track_records_collectives_issued_on_another_thread():
    """On CUDA autograd runs backward on its own device thread: a backward collective recorded there
    (here: a plain thread standing in for it) reaches the tracker of the ``track()`` around it. The
    trackers were thread-local: the backward's reduce-scatter was lost (benchmarks under-counted)."""
    import threading

    from train.parallel import comm

    with comm.track() as t:
        comm._record("all_gather", 8, 8)
        th = threading.Thread(target=comm._record, args=("reduce_scatter.bwd", 8, 8, "layer0"))
        th.start()
        th.join()
    comm._record("all_gather", 8, 8)  # after the block: not recorded
    assert [r[:2] for r in t.records] == [("-", "all_gather"), ("layer0", "reduce_scatter.bwd")]


@pytest.mark.timeout(300)
def test_tracked_bytes_and_rank0_params_equal_calc(results):
    """``cascade calc``'s communication formulas are the bytes the layouts' collectives record (mean over the
    ranks, collective by collective: padded sequences, a KV head shared by ranks at D = 4, q/k/v biases, MoE
    routing, ZeRO-1's gradient all-reduce and parameter all-gather), and its rank-0 parameter count is what
    rank 0 of each layout holds."""
    from train.parallel.calc import Shape, comm_bytes, params_rank0

    W, ranks = results
    for r in ranks:
        assert "error" not in r, r.get("trace")
    keys = [k for k in ranks[0] if k.startswith(f"comm{W}.") and not k.endswith(".params")]
    assert len(keys) == 4 + (4 if W == 2 else 2), keys  # qwen2's 2 KV heads: no TP/SP at D = 4
    for k in keys:
        _, name, lay = k.split(".")
        shape = Shape(_cfgs()[name], T=T, B=2, D=W, b=4)
        want = comm_bytes(shape, lay)
        ops = set(want) | {op for r in ranks for op in r[k]}
        got = {op: sum(r[k].get(op, 0) for r in ranks) / W for op in ops}
        assert all(abs(got[op] - want.get(op, 0)) <= 1 for op in ops), (k, got, want)
        assert ranks[0][k + ".params"] == params_rank0(shape, lay), (k, ranks[0][k + ".params"])


def test_zero1_bytes_and_optimizer_memory_equal_calc_where_ranks_do_not_divide_the_parameters(monkeypatch):
    """ZeRO-1 (``dp``) on D = 3 and 7 ranks, which do not divide the model's parameter count: each rank sends its
    padded ceil(P / D) slice in the all-gather (``cascade calc`` counts the same, mean over the ranks, collective by
    collective), and rank 0's optimizer holds the fp32 slice and both moments of ceil(P / D) elements, as calc's
    memory table says. (The collectives themselves are stubbed: counting needs no process group.)"""
    import torch.distributed as dist

    from train.parallel import comm, dp
    from train.parallel.calc import Shape, comm_bytes, memory

    cfg = _cfgs()["dense"]
    P = cfg.num_parameters()
    ids, mask = _batch(seed=5)
    for fn in ("all_gather_into_tensor", "all_reduce"):
        monkeypatch.setattr(dist, fn, lambda *a, **k: None)
    for D in (3, 7):
        assert P % D, (P, D)
        me = {"rank": 0}
        monkeypatch.setattr(comm, "_size", lambda g, D=D: D)
        monkeypatch.setattr(comm, "_rank", lambda g: me["rank"])
        monkeypatch.setattr(dp.dist, "get_world_size", lambda g=None, D=D: D)
        monkeypatch.setattr(dp.dist, "get_rank", lambda g=None: me["rank"])
        with comm.track() as t:
            for r in range(D):
                me["rank"] = r
                model = _model(cfg)
                opt = dp.ZeroAdamW(model.parameters(), lr=1e-3)
                _ref_loss(model, ids, mask)[0].backward()
                opt.step()
                if r == 0:
                    held = opt.state_bytes() + opt.shard.numel() * opt.shard.element_size()
                    assert opt.shard.numel() == -(-P // D)
        want = comm_bytes(Shape(cfg, T=T, B=2, D=D), "dp")
        got = {op: v[0] / D for op, v in t.by("op").items()}
        assert set(got) == set(want) and all(abs(got[op] - want[op]) <= 1 for op in want), (D, got, want)
        assert held == memory(Shape(cfg, T=T, B=2, D=D), "dp")["optimizer"], D


def test_collective_byte_accounting_per_rank(monkeypatch):
    """The bandwidth-optimal counts of comm's docstring, rank by rank (D = 4, no process group: the collective
    itself is stubbed): all-gather (D-1)n, reduce-scatter (D-1)/D N, all-reduce 2(D-1)/D N, a broadcast chain
    from src (src-1 receives, sends nothing; src sends, receives nothing) and a reduce (the chain reversed)."""
    import torch.distributed as dist

    from train.parallel import comm

    assert comm._chain_bytes(100, 2, 2, 4) == (100, 0) and comm._chain_bytes(100, 1, 2, 4) == (0, 100)
    assert comm._chain_bytes(100, 3, 2, 4) == (100, 100) and comm._chain_bytes(100, 0, 0, 1) == (0, 0)
    me = {"rank": 0}
    monkeypatch.setattr(comm, "_size", lambda g: 4)
    monkeypatch.setattr(comm, "_rank", lambda g: me["rank"])
    for fn in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "reduce"):
        monkeypatch.setattr(dist, fn, lambda *a, **k: None)
    x = torch.zeros(8)  # 32 bytes
    with comm.track() as t:
        comm.all_gather_raw(x, None)
        comm.reduce_scatter_raw(x, None)
        comm.all_reduce_raw(x, None)
        for r in range(4):
            me["rank"] = r
            comm.broadcast_raw(x, 1, None)
            comm.reduce_raw(x, 1, None)
    assert t.records[:3] == [("-", "all_gather", 96, 96), ("-", "reduce_scatter", 24, 24), ("-", "all_reduce", 48, 48)]
    bc = [rec[2:] for rec in t.records[3:] if rec[1] == "broadcast"]
    red = [rec[2:] for rec in t.records[3:] if rec[1] == "reduce"]
    assert bc == [(0, 32), (32, 0), (32, 32), (32, 32)]  # ranks 0..3, src 1: rank 0 ends the chain
    assert red == [(32, 0), (0, 32), (32, 32), (32, 32)]  # rank 0 starts the reversed chain, rank 1 receives


def test_split_sizes_give_the_remainder_to_the_first_parts():
    from train.parallel.shard import split_range, split_sizes

    assert split_sizes(50, 4) == [13, 13, 12, 12] and split_sizes(3, 4) == [1, 1, 1, 0]
    assert [split_range(50, 4, j) for j in range(4)] == [(0, 13), (13, 13), (26, 12), (38, 12)]


def test_vocab_parallel_cross_entropy_counts_a_label_on_the_shard_that_holds_it(monkeypatch):
    """One rank's part of the vocab-parallel cross-entropy (the group's collectives stubbed to one rank): a label
    in this rank's columns [3, 6) contributes its logit; the first label past them (6, the next rank's first
    column) and one before them contribute nothing here - only log-sum-exp over the shard."""
    from train.parallel import comm
    from train.parallel.tp import vocab_parallel_cross_entropy

    monkeypatch.setattr(comm, "_size", lambda g: 1)
    logits = torch.tensor([[4.0, 2.0, 1.0]] * 4)
    labels = torch.tensor([3, 5, 6, 2])
    z = logits - 4.0
    lse = torch.log(z.exp().sum(-1))
    want = torch.stack([lse[0] - z[0, 0], lse[1] - z[1, 2], lse[2], lse[3]])  # z[., 2] = -3: not 0
    got = vocab_parallel_cross_entropy(logits, labels, None, vocab_offset=3)
    assert torch.allclose(got, want), (got, want)


def test_zigzag_slots_and_packed_segment_starts_hand_values():
    """The zigzag partition of T = 13 over D = 2 (chunks of ceil(13 / 4) = 4 slots, padded to 16; rank r holds
    chunks r and 2D-1-r), and the first slot of each slot's sequence in a packed row (the padding one more
    sequence); what is not one packed row [1, T] with boundaries rising from 0 to T is refused."""
    from train.parallel.tsp import packed_segment_starts, zigzag_index

    Tp, s0 = zigzag_index(13, 2, 0)
    assert Tp == 16 and s0.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(13, 2, 1)[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    Tp, s1 = zigzag_index(8, 4, 1)  # chunks of 1 slot: rank 1 holds slots 1 and 6
    assert Tp == 8 and s1.tolist() == [1, 6]
    got = packed_segment_starts([0, 6, 7, 17], 17, 20, 1, None, "cpu")
    assert got.tolist() == [0] * 6 + [6] + [7] * 10 + [17] * 3
    cu = [0, 6, 7, 17]
    for args, needle in (((cu, 17, 20, 2, None), "one row"), ((cu, 17, 20, 1, torch.ones(1, 17)), "one row"),
                         (([0, 6, 16], 17, 20, 1, None), "rise from 0 to the row's length 17"),
                         (([1, 6, 17], 17, 20, 1, None), "rise from 0"),
                         (([0, 7, 6, 17], 17, 20, 1, None), "rise from 0"), (([], 17, 20, 1, None), "rise from 0")):
        with pytest.raises(ValueError, match=needle) as e:
            packed_segment_starts(*args, "cpu")
        assert "\n" not in str(e.value)


def test_tsp_config_needs_kv_heads_a_multiple_or_a_divisor_of_the_degree():
    from train.model.config import ModelConfig
    from train.parallel.tsp import check_tsp_config

    for kv, D in ((3, 2), (2, 3), (4, 6)):
        with pytest.raises(ValueError, match=rf"num_key_value_heads \({kv}\) to be a multiple or a divisor of D={D}"):
            check_tsp_config(ModelConfig(num_attention_heads=12, num_key_value_heads=kv, head_dim=8), D)
    for kv, D in ((1, 4), (2, 4), (8, 4), (4, 4), (3, 1), (6, 3)):
        check_tsp_config(ModelConfig(num_attention_heads=12, num_key_value_heads=kv, head_dim=8), D)


def test_zaya_halo_plan_hand_values():
    """Where each halo column of a rank's two zigzag chunks comes from (rows of the ranks' gathered tails: rank q
    shares the last t slots of its chunk q, then of its chunk 2D-1-q; row D * 2t is a zero row before the row),
    the streams' segments, the chunks' own columns and which of them start a sequence."""
    from train.model.config import ModelConfig
    from train.parallel.tsp import halo_plan

    base = dict(architecture="zaya", num_attention_heads=8, num_key_value_heads=4, num_experts=4,
                num_experts_per_tok=1, head_dim=8, hidden_size=32)
    # look-back K = 0 (cca_time 1 + 1 - 2): a halo of one token still (the delayed value needs the previous one)
    k0 = ModelConfig(cca_time0=1, cca_time1=1, **base)
    p = halo_plan(k0, 2, 0, 2, None, "cpu")  # T = 8, D = 2, rank 0: chunks 0 (slots 0, 1) and 3 (slots 6, 7)
    assert (p.Kh, p.t) == (1, 1)
    assert p.src.tolist() == [4, 3]  # before slot 0: the zero row; slot 5: rank 1's chunk 2 tail (row 1 * 2 + 1)
    assert p.lengths == [1, 2, 3] and p.cols.tolist() == [1, 2, 4, 5]
    assert p.starts.tolist() == [True, False, False, False]
    # a packed row [0, 5) [5, 8): rank 1 holds chunks 1 (slots 2, 3) and 2 (slots 4, 5); slot 5 starts a sequence
    p = halo_plan(k0, 2, 1, 2, [0] * 5 + [5] * 3, "cpu")
    assert p.src.tolist() == [0, 2]  # slot 1: rank 0's chunk 0 tail (row 0); slot 3: rank 1's own chunk 1 tail
    assert p.lengths == [3, 2, 1] and p.starts.tolist() == [False, False, False, True]
    # look-back 3 over chunks of 2 slots (T = 16, D = 4): the tails are the chunks' whole 2 slots, a halo spans ranks
    k3 = ModelConfig(cca_time0=2, cca_time1=3, **base)
    p = halo_plan(k3, 4, 0, 2, None, "cpu")  # rank 0: chunks 0 (slots 0, 1) and 7 (slots 14, 15)
    assert (p.Kh, p.t) == (3, 2)
    # slots 11 (rank 2's chunk 5, second of its tail rows 10, 11), 12 and 13 (rank 1's chunk 6: rows 6, 7)
    assert p.src.tolist() == [16, 16, 16, 11, 6, 7]
    assert p.lengths == [3, 2, 5] and p.cols.tolist() == [3, 4, 8, 9]


def test_tsp_token_logprobs_are_zero_past_the_last_predicting_slot(tmp_path):
    """One rank (D = 1, T = 7 padded to 8): the log-probs at slots 0..T-2 are the single-process model's, the
    entries at slot T-1 (no next token) and at the padding slot are zeros, whatever the LM head computed there."""

    from train.model.modeling import token_logprobs
    from train.parallel.tsp import TSPCausalLM

    ref = _model(_cfgs()["dense"])
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    with world_of_one(tmp_path):
        with torch.no_grad():
            lp, slots = TSPCausalLM(ref).token_logprobs(ids, temperature=0.8)
            want = token_logprobs(ref, ids, None, temperature=0.8)
    assert slots.tolist() == list(range(8))
    assert (lp[:, :6] - want).abs().max().item() < 1e-5
    assert lp[:, 6:].abs().max().item() == 0.0 and want.abs().min().item() > 0
