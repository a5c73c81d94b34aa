"""Shared-prefix KV reuse in the torch engine gives the same outputs as plain prefill."""
from __future__ import annotations

import pytest
import torch

from train.engine import SamplingParams, TorchEngine
from train.engine.prefix_cache import common_prefix_len, enable_prefix_caching


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=["moe", "dense"])
def pair(request, tiny_moe_dir, tiny_dense_dir):
    path = tiny_moe_dir if request.param == "moe" else tiny_dense_dir
    plain, cached = TorchEngine.from_pretrained(path), TorchEngine.from_pretrained(path)
    for e in (plain, cached):
        with torch.no_grad():  # sharper than a fresh random model, so greedy paths are not all ties
            e.model.lm_head.weight.mul_(3.0)
    enable_prefix_caching(cached, min_prefix=4)
    return plain, cached


def _prompts(tok, head="Problem: find the sum of the list 5 3 9 1 and the shortest path in the graph. "):
    h = tok.encode(head * 2, add_special_tokens=False)
    tails = ["Candidate one says 18.", "x", "Candidate three: the answer is \\boxed{18} because we add."]
    return h, [h + tok.encode(t, add_special_tokens=False) for t in tails]


def _same(a, b, atol=1e-4):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert x.finish_reason == y.finish_reason and x.prompt_token_ids == y.prompt_token_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


def test_common_prefix_len():
    assert common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_len([[1], [2]]) == 0 and common_prefix_len([[5, 6]]) == 2 and common_prefix_len([]) == 0


def test_outputs_equal_plain_prefill_greedy_and_seeded(pair):
    plain, cached = pair
    head, prompts = _prompts(plain.tokenizer)
    pc = cached.prefix_cache
    b0, s0 = pc.stats.batches, pc.stats.saved_tokens
    for sp in (SamplingParams(temperature=0, max_tokens=12),
               SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=12, seed=4)):
        _same(plain.generate(prompts, sp), cached.generate(prompts, sp))
    assert pc.stats.batches == b0 + 2
    P = common_prefix_len(prompts)
    assert P >= len(head) and pc.stats.saved_tokens - s0 >= 2 * (len(prompts) - 1) * P
    assert plain.stats.prefill_tokens == cached.stats.prefill_tokens  # logical accounting is unchanged


def test_stored_prefix_is_reused_across_calls_and_extended(pair):
    plain, cached = pair
    head, prompts = _prompts(plain.tokenizer, head="A different problem statement about triangles and circles. ")
    pc = cached.prefix_cache
    sp = SamplingParams(temperature=0, max_tokens=8)
    _same(plain.generate(prompts, sp), cached.generate(prompts, sp))
    hits = pc.stats.lru_hits
    # a later batch with the same head but a longer shared prefix starts from the stored one
    longer = [p + plain.tokenizer.encode(" Then add one more.", add_special_tokens=False) + [t]
              for p, t in zip([prompts[0]] * 3, [11, 12, 13])]
    _same(plain.generate(longer, sp), cached.generate(longer, sp))
    assert pc.stats.lru_hits == hits + 1


def test_weight_change_invalidates_stored_prefixes(pair):
    plain, cached = pair
    _, prompts = _prompts(plain.tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=8)
    cached.generate(prompts, sp)  # prefix stored under the current weights
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in plain.model.state_dict().items()}
    plain.load_weights(new)
    cached.load_weights(new)
    _same(plain.generate(prompts, sp), cached.generate(prompts, sp))


def test_no_shared_prefix_falls_back(pair):
    plain, cached = pair
    tok = plain.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["alpha beta gamma", "delta", "one two"]]
    b0 = cached.prefix_cache.stats.batches
    sp = SamplingParams(temperature=0, max_tokens=6)
    _same(plain.generate(prompts, sp), cached.generate(prompts, sp))
    assert cached.prefix_cache.stats.batches == b0


def test_per_prompt_seeds_equal_separate_requests(pair):
    plain, cached = pair
    _, prompts = _prompts(plain.tokenizer)
    seeds = [9, 3, 9]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8)
    alone = [c for p, s in zip(prompts, seeds)
             for c in plain.generate([p], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=s))]
    for eng in (plain, cached):
        together = eng.generate(prompts, sp, seeds=seeds)
        _same(alone, together)
        assert [c.prompt_index for c in together] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        plain.generate(prompts, sp, seeds=[1, 2])


def test_cached_prefill_runs_on_the_engines_own_forward(pair, monkeypatch):
    """The shared-prefix path prefills through the engine's own forward of the call: the native C++ one where the
    plain prefill uses it (fp32 on CPU), PyTorch when native decoding is off; same outputs both ways. The cache
    keeps no native forward of its own (it held a second copy of most weights between calls)."""
    from train.engine import native

    plain, cached = pair
    _, prompts = _prompts(plain.tokenizer)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11)
    given = []
    prefill = cached.prefix_cache.prefill
    monkeypatch.setattr(cached.prefix_cache, "prefill", lambda *a: given.append(a[3]) or prefill(*a))
    _same(plain.generate(prompts, sp), cached.generate(prompts, sp))
    assert given and all(isinstance(d, native.NativeDecoder) == native.usable(cached.model) for d in given)
    assert not any(isinstance(v, native.NativeDecoder) or (isinstance(v, tuple) and any(
        isinstance(x, native.NativeDecoder) for x in v)) for v in vars(cached.prefix_cache).values())
    monkeypatch.setenv("CASCADE_NATIVE_DECODE", "0")
    given.clear()
    for _ in range(2):
        _same(plain.generate(prompts, sp), cached.generate(prompts, sp))
    assert given and all(d is None for d in given)


def test_a_pad_id_outside_the_vocabulary_and_stop_strings_without_a_tokenizer(tiny_dense_dir, monkeypatch):
    """pad_token_id -1 (old LLaMA conversions) was embedded at padded positions: IndexError on any batch of mixed
    lengths off the native path (bf16, GPU); stop strings on an engine without a tokenizer were ignored."""
    monkeypatch.setenv("CASCADE_NATIVE_DECODE", "0")
    eng = TorchEngine.from_pretrained(tiny_dense_dir)
    ref = eng.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=4))
    for pad in (-1, eng.model.config.vocab_size):
        eng.model.config.pad_token_id = pad
        other = TorchEngine(eng.model, tokenizer=eng.tokenizer)
        enable_prefix_caching(other, min_prefix=2)
        for prompts in ([[5, 6, 7], [8, 9]], [[5, 6, 7, 8, 1], [5, 6, 7, 8, 2, 3]]):
            got = other.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
            if prompts[0] == [5, 6, 7]:
                assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    bare = TorchEngine(eng.model, tokenizer=None)
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        bare.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["a"]))


def test_bfloat16_engine_reuses_prefixes_in_pytorch(tiny_dense_dir):
    """No native forward for bf16: the cached prefill runs in PyTorch, call after call, and gives the
    plain engine's tokens."""
    plain = TorchEngine.from_pretrained(tiny_dense_dir, dtype=torch.bfloat16)
    cached = TorchEngine.from_pretrained(tiny_dense_dir, dtype=torch.bfloat16)
    enable_prefix_caching(cached, min_prefix=4)
    _, prompts = _prompts(plain.tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=6)
    for _ in range(2):
        a, b = plain.generate(prompts, sp), cached.generate(prompts, sp)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert cached.prefix_cache.stats.batches == 2


def _engines(path, **kw):
    cached = TorchEngine.from_pretrained(path)
    with torch.no_grad():
        cached.model.lm_head.weight.mul_(3.0)
    plain = TorchEngine(cached.model, cached.tokenizer)  # the same model object, no cache
    return plain, cached, enable_prefix_caching(cached, **kw)


def _ids(outs):
    return [c.token_ids for c in outs]


def test_prefix_cache_settings_are_checked():
    from train.engine.prefix_cache import PrefixCache

    for kw in ({"min_prefix": 0}, {"max_entries": -1}):
        with pytest.raises(ValueError, match="PrefixCache needs min_prefix >= 1 and max_entries >= 0"):
            PrefixCache(**kw)


def test_min_prefix_is_the_shortest_prefix_shared_and_identical_prompts_work(tiny_dense_dir):
    """A prefix of exactly min_prefix tokens is shared, one shorter is not; identical prompts share all but their
    last token (each row keeps one to prefill); outputs equal the plain prefill's."""
    plain, cached, pc = _engines(tiny_dense_dir, min_prefix=4)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for prompts, shared in (([[9, 8, 7, 6, 50], [9, 8, 7, 6, 60, 61]], 4), ([[9, 8, 7, 50], [9, 8, 7, 60]], None),
                            ([[30, 31, 32, 33, 34, 35]] * 3, 5)):
        b0, t0 = pc.stats.batches, pc.stats.shared_tokens
        assert _ids(cached.generate(prompts, sp)) == _ids(plain.generate(prompts, sp))
        assert (pc.stats.batches - b0, pc.stats.shared_tokens - t0) == ((1, shared) if shared else (0, 0)), prompts


def test_the_longest_stored_prefix_is_reused_and_counted(tiny_dense_dir):
    """Stored prefixes of 6 and 10 tokens, then a batch sharing 12: it starts from the 10 (the longest stored one);
    saved tokens = (rows - 1) * 12 copies + the 10 not recomputed."""
    plain, cached, pc = _engines(tiny_dense_dir, min_prefix=4)
    h = list(range(40, 52))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    saved = []
    for k in (6, 10, 12):
        prompts = [h[:k] + [100], h[:k] + [101, 102]]
        s0 = pc.stats.saved_tokens
        assert _ids(cached.generate(prompts, sp)) == _ids(plain.generate(prompts, sp))
        saved.append(pc.stats.saved_tokens - s0)
    assert saved == [6, 10 + 6, 12 + 10] and pc.stats.lru_hits == 2


def test_stored_prefixes_are_dropped_least_recently_used_first(tiny_dense_dir):
    """max_entries 2: A and B stored, A used again, C stored: B (the least recently used) is dropped, A and C kept."""
    plain, cached, pc = _engines(tiny_dense_dir, min_prefix=4, max_entries=2)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    batch = {h: [[h, h + 1, h + 2, h + 3, h + 4, 7], [h, h + 1, h + 2, h + 3, h + 4, 8, 9]] for h in (10, 20, 30)}
    hits = []
    for name in (10, 20, 10, 30, 30, 10):
        h0 = pc.stats.lru_hits
        cached.generate(batch[name], sp)
        hits.append(pc.stats.lru_hits - h0)
    # A miss, B miss, A hit (now the most recent), C miss (stored; B dropped), C hit, A hit
    assert hits == [0, 0, 1, 0, 1, 1]


def test_in_place_weight_changes_invalidate_stored_prefixes(tiny_dense_dir):
    """A trainer stepping the engine's own model in place (no load_weights): the stored keys and values are stale,
    and the next batch recomputes them (the same tokens as the plain prefill under the new weights)."""
    plain, cached, pc = _engines(tiny_dense_dir, min_prefix=4)
    prompts = [list(range(60, 70)) + [3], list(range(60, 70)) + [4, 5]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached.generate(prompts, sp)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in cached.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    h0 = pc.stats.lru_hits
    assert _ids(cached.generate(prompts, sp)) == _ids(plain.generate(prompts, sp))
    assert pc.stats.lru_hits == h0


def test_zaya_prefills_without_the_shared_prefix_path():
    """ZAYA1's CCA convolves over neighbouring positions, which would see the padding between a shared prefix and
    the suffixes: its batches take the plain prefill (no batch counted), with the plain engine's tokens."""
    from tests.test_parallel import _cfgs, _model

    model = _model(_cfgs()["zaya"])
    plain, cached = TorchEngine(model), TorchEngine(model)
    pc = enable_prefix_caching(cached, min_prefix=4)
    prompts = [list(range(20, 30)) + [3], list(range(20, 30)) + [4, 5, 6]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert _ids(cached.generate(prompts, sp)) == _ids(plain.generate(prompts, sp))
    assert pc.stats.batches == 0
