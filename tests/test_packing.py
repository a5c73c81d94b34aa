"""Sequence packing: packed forward and log-probs against the padded path, chunked log-softmax,
activation checkpointing, and the micro-batch / rank assignment."""
import random

import pytest
import torch

from train.batching import make_batch
from train.model.config import ModelConfig
from train.model.modeling import CausalLM, token_logprobs
from train.rl.exchange import TrainSample
from train.rl.packing import (balance_across_ranks, chunked_token_logprobs, pack_by_tokens,
                              packed_token_logprobs)

V = 97


def tiny(kind: str, seed: int = 0) -> CausalLM:
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
    if kind == "moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    return CausalLM(ModelConfig(**kw)).init_weights(seed, std=0.2)


def samples(seed: int, moe: CausalLM | None = None) -> list[TrainSample]:
    """Mixed lengths, including one-token completions; random router choices to replay for MoE."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 1), (1, 9), (5, 1), (7, 12), (2, 2), (11, 4), (4, 1), (6, 17)]
    out = []
    for p, c in shapes:
        ids = torch.randint(0, V, (p + c,), generator=g).tolist()
        r = None
        if moe is not None:
            n_moe, E, k = moe.config.num_hidden_layers, moe.config.num_experts, moe.config.num_experts_per_tok
            r = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range((p + c) * n_moe)]).view(p + c, n_moe, k)
        out.append(TrainSample(ids[:p], ids[p:], [0.0] * c, 0.0, routed_experts=r))
    return out


def padded_reference(model, ss, temperature):
    """Per sample: completion log-probs and entropies from the right-padded ``token_logprobs``."""
    b = make_batch([s.prompt_ids for s in ss], [s.completion_ids for s in ss])
    replay = None
    if ss[0].routed_experts is not None:
        B, T = b.input_ids.shape
        n_moe, k = ss[0].routed_experts.shape[1:]
        replay = [torch.zeros(B, T, k, dtype=torch.long) for _ in range(n_moe)]
        for i, s in enumerate(ss):
            for j in range(n_moe):
                replay[j][i, :s.num_tokens] = s.routed_experts[:, j]
    lp, ent = token_logprobs(model, b.input_ids, b.attention_mask, temperature, routed_experts=replay,
                             return_entropy=True)
    rows = [slice(len(s.prompt_ids) - 1, s.num_tokens - 1) for s in ss]
    return [lp[i, r] for i, r in enumerate(rows)], [ent[i, r] for i, r in enumerate(rows)]


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(g1, g2, rel=1e-5):
    assert g1.keys() == g2.keys()
    for n in g1:
        scale = g2[n].abs().max().item()
        assert (g1[n] - g2[n]).abs().max().item() <= rel * scale + 1e-12, n


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_logprobs_and_grads_equal_padded(kind):
    model = tiny(kind)
    ss = samples(1, model if kind == "moe" else None)
    weights = [torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(i)) for i, s in enumerate(ss)]
    lps, ents = packed_token_logprobs(model, ss, temperature=0.7, chunk_tokens=5)
    ref_lp, ref_ent = padded_reference(model, ss, 0.7)
    for s, a, b, ea, eb in zip(ss, lps, ref_lp, ents, ref_ent):
        assert a.shape == (len(s.completion_ids),)
        assert (a - b).abs().max().item() < 1e-5
        assert (ea - eb).abs().max().item() < 1e-5
        assert not ea.requires_grad
    g_packed = grads(model, sum((w * a).sum() for w, a in zip(weights, lps)))
    g_pad = grads(model, sum((w * b).sum() for w, b in zip(weights, ref_lp)))
    if kind == "moe":  # replay leaves the router's weights of the chosen experts differentiable
        assert any("mlp.gate" in n for n in g_packed)
    assert_grads_close(g_packed, g_pad)


def test_token_lists_score_every_next_token_and_routing_is_recorded():
    model = tiny("moe")
    seqs = [[5, 7, 9, 11], [3], [8, 1], list(range(20, 33))]
    lps, _ = packed_token_logprobs(model, seqs)
    assert [len(x) for x in lps] == [3, 0, 1, 12]
    with torch.no_grad():
        for s, lp in zip(seqs, lps):
            if len(s) > 1:
                assert (token_logprobs(model, torch.tensor([s]))[0] - lp).abs().max().item() < 1e-5
        # the packed forward records routing as [1, N, k] per MoE layer, and replaying it reproduces the logits
        flat = torch.tensor([sum(seqs, [])])
        cu = [0, 4, 5, 7, 20]
        rec: list = []
        a = model(flat, cu_seqlens=cu, record_routing=rec)
        assert len(rec) == 2 and rec[0].shape == (1, 20, 2)
        assert torch.equal(model(flat, cu_seqlens=cu, routed_experts=rec), a)
        # no attention across sequences: each segment's logits are its own forward's
        for s, e in zip(cu, cu[1:]):
            assert (model(flat[:, s:e]) - a[:, s:e]).abs().max().item() < 1e-5


def test_packed_forward_rejects_bad_boundaries():
    model = tiny("dense")
    ids = torch.randint(0, V, (1, 6))
    for cu in ([0, 3, 5], [1, 6], [0, 3, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(ids, cu_seqlens=cu)
    with pytest.raises(ValueError, match="one row"):
        model(torch.randint(0, V, (2, 3)), cu_seqlens=[0, 3])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_log_softmax_equals_unchunked(temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(V, 16, generator=g, requires_grad=True)
    t = torch.randint(0, V, (23,), generator=g)
    up = torch.randn(23, generator=g)
    lp, ent = chunked_token_logprobs(h, w, t, temperature, chunk_tokens=4, return_entropy=True)
    gh, gw = torch.autograd.grad((lp * up).sum(), [h, w])
    logp = torch.log_softmax(h @ w.t() / temperature, -1)
    ref = logp.gather(1, t[:, None]).squeeze(1)
    rh, rw = torch.autograd.grad((ref * up).sum(), [h, w])
    assert (lp - ref).abs().max().item() < 1e-5
    assert (ent - -(logp.exp() * logp).sum(-1)).abs().max().item() < 1e-5
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)
    # one chunk of everything and a chunk per row give the same numbers
    for c in (1, 100):
        assert (chunked_token_logprobs(h, w, t, temperature, chunk_tokens=c) - lp).abs().max().item() < 1e-5


@pytest.mark.parametrize("replay", [False, True])
def test_activation_checkpointing_gives_identical_grads(replay):
    model = tiny("moe")
    ss = samples(2, model)
    if not replay:
        for s in ss:
            s.routed_experts = None

    def run(ckpt):
        lps, _ = packed_token_logprobs(model, ss, chunk_tokens=8, checkpoint_layers=ckpt)
        loss = sum((lp * (i + 1)).sum() for i, lp in enumerate(lps))
        return [x.detach() for x in lps], grads(model, loss)

    lp0, g0 = run(False)
    lp1, g1 = run(True)
    for a, b in zip(lp0, lp1):
        assert torch.equal(a, b)
    assert_grads_close(g1, g0, rel=1e-6)
    # checkpointed forward records each MoE layer's routing once (not again when backward recomputes)
    rec: list = []
    flat = torch.tensor([sum((s.prompt_ids + s.completion_ids for s in ss), [])])
    cu = [0]
    for s in ss:
        cu.append(cu[-1] + s.num_tokens)
    model(flat, cu_seqlens=cu, record_routing=rec, checkpoint_layers=True).sum().backward()
    assert len(rec) == 2


def test_pack_by_tokens_respects_budget_and_loses_nothing():
    assert pack_by_tokens([5, 3, 4, 2, 9], 9) == [[4], [0, 2], [1, 3]]
    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(0, 60))]
        budget = rng.randint(50, 600)
        mbs = pack_by_tokens(lengths, budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        for mb in mbs:
            assert mb and (sum(lengths[i] for i in mb) <= budget or len(mb) == 1)
        # first-fit decreasing uses at most 11/9 OPT + 1 bins; OPT >= ceil(total / budget)
        fit = [x for x in lengths if x <= budget]
        assert len(mbs) <= len(lengths) - len(fit) + 11 / 9 * -(-sum(fit) // budget) + 1
    with pytest.raises(ValueError):
        pack_by_tokens([1], 0)


def test_balance_across_ranks_balances_tokens():
    rng = random.Random(1)
    for world in (1, 2, 3, 8):
        lengths = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(64)]
        ranks = balance_across_ranks(lengths, world)
        assert len(ranks) == world and all(ranks)
        assert sorted(i for r in ranks for i in r) == list(range(64))
        loads = [sum(lengths[i] for i in r) for r in ranks]
        assert max(loads) - min(loads) <= max(lengths)
    assert balance_across_ranks([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]


def test_packing_indices_ascend_and_micro_batches_split_by_rows():
    """Indices within a micro-batch ascend though first-fit adds them longest first; pack_micro_batches cuts each
    micro-batch into runs of max_rows (at least 1) without losing any sample."""
    from train.rl.packing import pack_micro_batches

    assert pack_by_tokens([2, 5, 3], 5) == [[1], [0, 2]]  # FFD places 2 (len 3) before 0 (len 2) in the 2nd bin
    assert pack_micro_batches([1, 1, 1, 1, 1], 10, 2) == [[0, 1], [2, 3], [4]]
    assert pack_micro_batches([1, 1, 1], 10, 0) == [[0], [1], [2]]


def test_balance_across_ranks_breaks_load_ties_by_fewest_samples():
    """At equal token load a sample goes to the rank holding fewer samples (then the lowest rank)."""
    # 3 -> rank 0, 3 -> rank 1, 0 -> rank 0 (all tied), 0 -> rank 1 (loads tie 3/3, rank 1 holds fewer samples)
    assert balance_across_ranks([3, 3, 0, 0], 2) == [[0, 2], [1, 3]]
    assert balance_across_ranks([0, 0], 2) == [[0], [1]]


def test_make_batch_pads_right_and_marks_the_completion_targets():
    """train.batching: right padding, the loss mask on the positions whose next token is a completion token,
    per-completion values scattered there, rows cut out trimmed to their longest sequence."""
    from train.batching import even_slices, index_batch, micro_batches

    b = make_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14, 15]], pad_id=2)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 10, 2], [8, 11, 12, 13, 14, 15]]
    assert b.attention_mask.tolist() == [[True] * 5 + [False], [True] * 6]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b.prompt_lens == [3, 1] and b.completion_lens == [2, 5]
    assert b.scatter_completion([[0.5, 0.25], [1, 2, 3, 4, 5]]).tolist() == [[0, 0, 0.5, 0.25, 0], [1, 2, 3, 4, 5]]
    first = index_batch(b, slice(0, 1))
    assert first.input_ids.tolist() == [[5, 6, 7, 9, 10]] and first.loss_mask.tolist() == [[0, 0, 1, 1]]
    assert first.attention_mask.tolist() == [[True] * 5] and first.prompt_lens == [3]
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        make_batch([[1], [2]], [[3]])
    assert micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batches(2, 0) == [slice(0, 1), slice(1, 2)]
    assert even_slices(3, 5) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert even_slices(7, 3) == [slice(0, 2), slice(2, 4), slice(4, 7)] and even_slices(0, 4) == []
