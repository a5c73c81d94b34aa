"""The torch generation engine: greedy = recomputation, logprobs = teacher forcing, seeds, batching."""
import re
import subprocess
import sys

import pytest
import torch

from train.engine import ContextLengthError, SamplingParams, TorchEngine
from train.model.hf_io import load_pretrained, to_hf_state_dict
from train.model.modeling import token_logprobs


@pytest.fixture(scope="module", params=["moe", "dense"])
def engine(request, tiny_moe_dir, tiny_dense_dir):
    path = tiny_moe_dir if request.param == "moe" else tiny_dense_dir
    eng = TorchEngine.from_pretrained(path)
    with torch.no_grad():  # sharpen the random model so that sampling is not uniform noise
        eng.model.lm_head.weight.mul_(3.0)
    return eng


def _prompts(eng):
    texts = ["What is 2+2?", "Sort the list 5 3 9 1 and give it in a box, then explain why.", "Hi"]
    return [eng.tokenizer.encode(t) for t in texts]


def greedy_by_recomputation(model, prompt, steps, eos):
    seq = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
        seq.append(nxt)
        if nxt in eos:
            break
    return seq[len(prompt):]


def test_greedy_equals_full_recomputation(engine):
    prompts = _prompts(engine)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for p, c in zip(prompts, outs):
        assert c.token_ids == greedy_by_recomputation(engine.model, p, 12, set(engine.eos_token_ids))
        assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forcing(engine, temperature):
    prompts = _prompts(engine)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3))
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = token_logprobs(engine.model, seq, temperature=temperature)[0, len(c.prompt_token_ids) - 1:]
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_same_seed_same_samples_and_batch_invariance(engine):
    prompts = _prompts(engine)
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=10, seed=11)
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts, sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    c = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=10, seed=12))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # each prompt alone gives what it gave inside the mixed-length batch (greedy and seeded)
    for greedy in (True, False):
        sp = SamplingParams(n=2, temperature=0 if greedy else 1.0, max_tokens=10, seed=5)
        batch = engine.generate(prompts, sp)
        for i, p in enumerate(prompts):
            alone = engine.generate([p], sp)
            # alone the prompt has index 0: compare with seeds derived for index 0
            if not greedy:
                alone = TorchEngine._generate_chunk(engine, [p], i, sp, 5)
            assert [x.token_ids for x in alone] == [x.token_ids for x in batch[2 * i:2 * i + 2]]


def test_rows_finishing_at_different_steps_keep_their_own_cache(engine):
    """Rows that stop at many different steps leave the batch one by one (the KV cache compacts in
    place each time): every completion's log-probs still equal teacher forcing on its own sequence, and
    each prompt alone samples the same tokens."""
    prompts = [engine.tokenizer.encode(t) for t in ("2+2?", "Sort 5 3 9 1.", "Hi", "Name a prime", "x", "Why?")]
    V = engine.model.config.vocab_size
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=7, stop_token_ids=list(range(0, V, 6)))
    outs = engine.generate(prompts, sp)
    lengths = [len(c.token_ids) for c in outs]
    assert len(set(lengths)) >= 5 and {c.finish_reason for c in outs} == {"stop", "length"}, lengths
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = token_logprobs(engine.model, seq)[0, len(c.prompt_token_ids) - 1:]
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    for i in (0, 3, 5):
        alone = TorchEngine._generate_chunk(engine, [prompts[i]], i, sp, 7)
        assert [x.token_ids for x in alone] == [x.token_ids for x in outs[3 * i:3 * i + 3]]


def test_sampling_controls(engine):
    p = _prompts(engine)[:2]
    greedy = engine.generate(p, SamplingParams(temperature=0, max_tokens=8))
    topk1 = engine.generate(p, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=1))
    tiny_p = engine.generate(p, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, seed=1))
    minp1 = engine.generate(p, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, seed=1))
    for other in (topk1, tiny_p, minp1):
        assert [c.token_ids for c in other] == [c.token_ids for c in greedy]
    outs = engine.generate(p, SamplingParams(n=4, temperature=1.0, max_tokens=5, seed=0))
    assert len(outs) == 8 and [c.prompt_index for c in outs] == [0] * 4 + [1] * 4
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in outs)


def penalized_greedy_by_recomputation(model, prompt, steps, rep, presence, frequency):
    """vLLM's penalties, independently: HF transformers' repetition-penalty processor over prompt + output,
    then OpenAI's presence/frequency formula over the output's counts."""
    from transformers import RepetitionPenaltyLogitsProcessor

    seq, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            x = model(torch.tensor([seq]))[0, -1:].float()
        x = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([seq]), x)[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).float()
        nxt = int((x - frequency * counts - presence * (counts > 0).float()).argmax())
        seq.append(nxt)
        out.append(nxt)
    return out


def test_penalties_follow_vllm(engine):
    """repetition/presence/frequency penalties: greedy equals an independent recomputation (and differs from
    greedy without them); sampled rows keep the raw log-probs (before penalties) and batch invariance."""
    prompts = _prompts(engine)
    plain = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    changed = False
    for kw in ({"repetition_penalty": 1.8}, {"presence_penalty": 1.5, "frequency_penalty": 1.0},
               {"repetition_penalty": 0.7, "frequency_penalty": -0.5}):
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw))
        for p, c, u in zip(prompts, outs, plain):
            want = penalized_greedy_by_recomputation(engine.model, p, 12, kw.get("repetition_penalty", 1.0),
                                                     kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0))
            assert c.token_ids == want, kw
            changed |= c.token_ids != u.token_ids
            seq = torch.tensor([c.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                ref = token_logprobs(engine.model, seq)[0, len(p) - 1:]
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    assert changed
    # the penalized logits themselves, every sign and kind of token (in the prompt, sampled once or twice, neither)
    from transformers import RepetitionPenaltyLogitsProcessor

    from train.engine.sampling import LogitsProcessors

    g = torch.Generator().manual_seed(0)
    logits, prompt_ids = torch.randn(2, 50, generator=g) * 3, [[1, 2, 3, 40], [5, 1]]
    out = torch.tensor([[7, 1], [7, 9], [12, 12]])  # three steps of two rows
    for kw in ({"repetition_penalty": 1.7}, {"repetition_penalty": 0.6, "presence_penalty": -0.8},
               {"frequency_penalty": 1.3, "presence_penalty": 0.4}):
        sp = SamplingParams(**kw)
        pen = LogitsProcessors(sp, prompt_ids, 50, "cpu")
        for t in out:
            pen.add(t)
        for r in range(2):
            ids = torch.tensor([prompt_ids[r] + out[:, r].tolist()])
            want = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, logits[r:r + 1].clone())[0]
            counts = torch.bincount(out[:, r], minlength=50).float()
            want = want - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
            assert torch.allclose(pen.apply(logits)[r], want), kw
        both = pen.apply(logits)
        pen.keep(torch.tensor([1]))  # row 0 finished: row 1 keeps its state
        assert torch.equal(pen.apply(logits[1:]), both[1:])
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=4, presence_penalty=1.0, repetition_penalty=1.2)
    outs = engine.generate(prompts, sp)
    for i, p in enumerate(prompts):  # alone (seeds derived for its index in the batch): the same rows
        alone = TorchEngine._generate_chunk(engine, [p], i, sp, 4)
        assert [x.token_ids for x in alone] == [x.token_ids for x in outs[2 * i:2 * i + 2]]
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = token_logprobs(engine.model, seq, temperature=0.8)[0, len(c.prompt_token_ids) - 1:]
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_logit_bias_and_min_tokens_follow_transformers(engine):
    """``logit_bias`` and ``min_tokens`` (vLLM's): greedy equals a recomputation through transformers'
    ``SequenceBiasLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``; the log-probs stay the raw ones; no
    stop string is looked for in the first ``min_tokens`` tokens; an id past the vocabulary is a one-line error."""
    from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

    prompts, eos = _prompts(engine), engine.eos_token_ids[0]
    plain = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    # +100 on EOS: without min_tokens the first token ends it; with 4 the fifth does; a bias that moves the argmax
    bias = {eos: 100.0, plain[0].token_ids[1]: -4.0, plain[1].token_ids[2]: 3.0}
    for k in (0, 4):
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, min_tokens=k, logit_bias=bias))
        for p, c in zip(prompts, outs):
            procs = [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                     MinNewTokensLengthLogitsProcessor(len(p), k, eos)]
            seq, want = list(p), []
            while len(want) < 10 and (not want or want[-1] != eos):
                with torch.no_grad():
                    x = engine.model.last_logits(torch.tensor([seq])).float()
                for proc in procs:
                    x = proc(torch.tensor([seq]), x)
                want.append(int(x[0].argmax()))
                seq.append(want[-1])
            assert c.token_ids == want and len(want) == k + 1 and c.finish_reason == "stop", (k, want)
            with torch.no_grad():
                ref = token_logprobs(engine.model, torch.tensor([p + c.token_ids]))[0, len(p) - 1:]
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    assert plain[0].token_ids[:2] != engine.generate(prompts[:1], SamplingParams(
        temperature=0, max_tokens=2, ignore_eos=True, logit_bias={plain[0].token_ids[1]: -4.0}))[0].token_ids
    # a stop string that the first tokens' text is: found at once without min_tokens; with it, only an occurrence
    # that ends past the first min_tokens tokens' text counts (vLLM's rule)
    full, stop = engine.decode(plain[0].token_ids), engine.decode(plain[0].token_ids[:2])
    for k in (0, 2):
        c = engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop],
                                                        min_tokens=k))[0]
        floor = len(engine.decode(plain[0].token_ids[:k]))
        at = next((i for i in range(len(full)) if full.startswith(stop, i) and i + len(stop) > floor), None)
        assert (c.text, c.finish_reason) == ((full, "length") if at is None else (full[:at], "stop")), k
        assert len(c.token_ids) > k
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias has token id {vocab}; the model's ids are 0..{vocab - 1}"):
        engine.generate(prompts, SamplingParams(logit_bias={vocab: 1.0}))
    for bad in ({"logit_bias": {-1: 1.0}}, {"logit_bias": {"x": 1.0}}, {"logit_bias": {3: float("nan")}},
                {"min_tokens": 11, "max_tokens": 10}, {"min_tokens": -1}):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)


def test_sampler_draws_from_the_shaped_distribution():
    """The counter-based sampler follows softmax(logits / T) (after truncation) across rows and across
    steps of one row, within a chi-square bound; truncated tokens are never drawn."""
    import numpy as np

    from train.engine.sampling import sample, shape_logits, uniforms

    across_rows = uniforms(np.arange(4000, dtype=np.uint64), 0)
    one_row = np.array([uniforms(np.array([7], np.uint64), t)[0] for t in range(4000)])
    for u in (across_rows, one_row):
        assert ((u >= 0) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.005
    assert not np.array_equal(uniforms(np.array([1], np.uint64), 0), uniforms(np.array([1], np.uint64), 1))
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2)):
        probs = torch.softmax(shape_logits(logits[None], p), -1)[0].double()
        n = 6000
        across_rows = sample(logits.expand(n, -1), p, np.arange(n, dtype=np.uint64) * 7919, step=5)[0]
        one_row = torch.cat([sample(logits[None], p, np.array([42], np.uint64), step=t)[0] for t in range(n)])
        for toks in (across_rows, one_row):
            counts = torch.bincount(toks, minlength=6).double()
            assert counts[probs == 0].sum() == 0
            kept = probs > 0
            expected = probs[kept] * n
            chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
            assert chi2 < 25.0, (p, counts.tolist(), expected.tolist())  # df <= 5: p-value < 1e-4
        lp = sample(logits[None], p, np.array([3], np.uint64), step=0)[1]
        assert lp.shape == (1,) and lp.item() <= 0


def test_truncation_is_applied_in_vllms_order():
    """min-p, then top-k / top-p (vLLM v1's sampler): top-p over what min-p left. (Applied last, min-p kept a token
    that a vLLM server's top-p drops: the two sampled different distributions.)"""
    from train.engine.sampling import shape_logits

    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = torch.softmax(shape_logits(logits, SamplingParams(top_p=0.75, min_p=0.3)), -1)[0]
    assert torch.allclose(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_top_p_applies_to_what_top_k_left_and_min_p_to_the_tempered_distribution():
    """top-k before top-p (top-p over the renormalised top k) and temperature before min-p, as vLLM v1 orders them."""
    from train.engine.sampling import shape_logits

    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 2 leaves 4/7, 3/7: the first token alone reaches top_p 0.5 (top-p first would have kept two)
    probs = torch.softmax(shape_logits(logits, SamplingParams(top_k=2, top_p=0.5)), -1)[0]
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # T = 2: probabilities ~ sqrt(0.5, 0.3, 0.2), the smallest 0.63 of the largest, kept by min_p 0.5 (0.2 / 0.5 = 0.4
    # of the untempered distribution would drop it)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    probs = torch.softmax(shape_logits(logits, SamplingParams(temperature=2.0, min_p=0.5)), -1)[0]
    assert torch.allclose(probs, torch.tensor([0.41545, 0.32180, 0.26275]), atol=1e-4)


def test_top_p_drops_a_token_once_the_mass_above_it_reaches_top_p():
    """top-p keeps the smallest set whose mass reaches top_p (vLLM's rule): four tokens of exactly 1/4 at top_p 0.5
    keep two, not three (the third has 0.5 = top_p above it)."""
    from train.engine.sampling import shape_logits

    probs = torch.softmax(shape_logits(torch.zeros(1, 4), SamplingParams(top_p=0.5)), -1)[0]
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_tokens_of_tiny_probability_are_drawn_with_their_probability(monkeypatch):
    """A peaked row of a large vocabulary (top token 0.99): every tail token owns its slice of [0, 1), so a
    uniform in the middle of a slice draws that token, in the PyTorch path (with top-p too) as in the native op.
    With an fp32 running sum, tokens under ~3e-8 had no slice (never drawn) and their mass went to others."""
    import numpy as np

    import train.engine.sampling as S

    V = 150_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2
    logits[7] = 22.0
    probs = torch.softmax(logits.double(), -1)
    small = torch.nonzero((probs > 1e-11) & (probs < 3e-8))[:, 0]
    tail = small[torch.linspace(0, len(small) - 1, 10).long()].tolist()
    assert probs[7] > 0.99 and len(tail) == 10
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=V - 1)):
        # the slices as the sampler lays them out: its (fp32) probabilities, end to end
        shaped = torch.softmax(S.shape_logits(logits[None], p), -1)[0] if S.truncates(p) else \
            torch.log_softmax(logits, -1).exp()
        edges = torch.cat([torch.zeros(1, dtype=torch.float64), shaped.double().cumsum(-1)])
        assert all(edges[j + 1] - edges[j] > 0.5 * probs[j] for j in tail)  # each slice about its probability
        mids = np.array([float((edges[j] + edges[j + 1]) / 2 / edges[-1]) for j in tail])
        monkeypatch.setattr(S, "uniforms", lambda seeds, step: mids)
        tok, lp = S.sample(logits.expand(len(tail), -1).contiguous(), p, np.zeros(len(tail), np.uint64))
        assert tok.tolist() == tail, p
        assert torch.allclose(lp.double(), probs[tail].log(), atol=1e-4)


def test_a_uniform_of_0_never_draws_a_truncated_first_token(monkeypatch):
    """u = 0 lands on token 0 even when truncation removed it (probability 0): the sampler takes the most likely
    kept token instead."""
    import numpy as np

    import train.engine.sampling as S

    monkeypatch.setattr(S, "uniforms", lambda seeds, step: np.zeros(len(seeds)))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for p in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)):
        tok, _ = S.sample(logits, p, np.zeros(1, np.uint64))
        assert tok.tolist() == [1], p


def test_stop_tokens_and_strings(engine):
    p = _prompts(engine)[:1]
    ref = engine.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = ref.token_ids[4]
    first = ref.token_ids.index(stop_tok)
    c = engine.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert c.token_ids == ref.token_ids[:first + 1] and c.finish_reason == "stop"
    full = engine.tokenizer.decode(ref.token_ids)
    needle = full[len(full) // 2:len(full) // 2 + 2]
    if needle.strip():
        c = engine.generate(p, SamplingParams(temperature=0, max_tokens=12, stop=[needle], ignore_eos=True))[0]
        assert c.finish_reason == "stop" and needle not in c.text and full.startswith(c.text)


def test_stop_semantics_as_vllm_with_scripted_tokens(tiny_dense_dir, monkeypatch):
    """Tokens scripted through the sampler: of two stop strings completed by one token, the first in the list
    cuts (vLLM's check_stop_strings); a stop string spelled in byte-level tokens (3 per CJK character) is found
    though its tokens outnumber its characters; min_tokens masks EOS even when EOS is ignored (vLLM's
    _all_stop_token_ids)."""
    import train.engine.torch_engine as te

    eng = TorchEngine.from_pretrained(tiny_dense_dir)
    one = lambda text: [eng.tokenizer.encode(ch, add_special_tokens=False) for ch in text]  # noqa: E731
    script: list[int] = []

    def scripted(logits, p, seeds=None, step=0, native=False, processors=None):
        return torch.full((logits.shape[0],), script[step]), torch.zeros(logits.shape[0])

    monkeypatch.setattr(te, "sample", scripted)
    script[:] = [t[0] for t in one("xabzzzzz")]
    c = eng.generate(eng.encode(["hi"]), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["b", "ab"]))[0]
    assert (c.text, c.finish_reason) == ("xa", "stop")
    cjk = "好" * 10
    pieces = [t for ch in one("x" + cjk + "zzzz") for t in ch]
    assert len(pieces) > 3 * len(cjk)  # the tokenizer spells the character in bytes: the case in question
    script[:] = pieces
    c = eng.generate(eng.encode(["hi"]), SamplingParams(temperature=0, max_tokens=len(pieces), ignore_eos=True,
                                                      stop=[cjk]))[0]
    assert (c.text, c.finish_reason) == ("x", "stop")
    monkeypatch.undo()
    eos = eng.eos_token_ids[0]
    c = eng.generate(eng.encode(["hi"]), SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True,
                                                      logit_bias={eos: 50.0}))[0]
    assert eos not in c.token_ids[:3] and c.token_ids[3:] == [eos] * 3


def test_prompt_longer_than_context_is_an_error(engine):
    long = [5] * engine.context_length
    with pytest.raises(ContextLengthError, match="context limit"):
        engine.generate([long], SamplingParams(max_tokens=4))
    # near the limit generation stops at the context instead of overflowing
    near = [5] * (engine.context_length - 3)
    c = engine.generate([near], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_load_weights_syncs_the_engine(tiny_moe_dir):
    eng = TorchEngine.from_pretrained(tiny_moe_dir)
    trainer = load_pretrained(tiny_moe_dir)
    with torch.no_grad():
        for prm in trainer.parameters():
            prm.add_(torch.randn_like(prm) * 0.05)
    prompts = _prompts(eng)
    for sd in (trainer.state_dict(), to_hf_state_dict(trainer)):  # both namings are accepted
        eng.load_weights(sd)
        outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
        for c in outs:
            seq = torch.tensor([c.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                ref = token_logprobs(trainer, seq)[0, len(c.prompt_token_ids) - 1:]
            assert (torch.tensor(c.logprobs) - ref).abs().max().item() < 1e-4
    assert eng.stats.weight_syncs == 2


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cascade", *args], capture_output=True, text=True, timeout=120)


def test_cli_errors_are_one_line(tmp_path, tiny_dense_dir):
    r = _cli("init-model", "--preset", "huge-thing", "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "unknown model preset 'huge-thing'" in r.stderr and r.stderr.count("\n") == 1
    r = _cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr and r.stderr.count("\n") == 1
    r = _cli("generate", "--model", str(tiny_dense_dir), "--raw", "--prompt", "word " * 4200)
    assert r.returncode == 2 and "context limit" in r.stderr and r.stderr.count("\n") == 1


def test_sampling_params_refuse_what_the_samplers_cannot_do():
    """NaN or overflowing temperatures and negative top-k fail where they are set (they crashed deep in a
    sampler, or gave NaN log-probs); top_k=-1 means off, as in vLLM."""
    for kw, msg in [({"temperature": float("nan")}, "temperature must be 0 (greedy) or >= 0.01"),
                    ({"temperature": 1e-40}, "temperature must be 0 (greedy) or >= 0.01"),
                    ({"temperature": 1e-3}, "vLLM samples any lower one at 0.01"),  # a remote vLLM server would
                    ({"top_k": -2}, "top_k must be >= 0")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            SamplingParams(**kw)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(temperature=0.01).temperature == 0.01


def test_a_tokenizer_without_a_chat_template_says_how_to_go_on(tiny_dense_dir):
    from train.tokenizer import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    assert chat_prompt_ids(tok, "hi")  # the saved template
    tok.chat_template = None
    with pytest.raises(ValueError, match=re.escape("no chat template (chat_template.jinja): use rl.chat_template")):
        chat_prompt_ids(tok, "hi")


def test_stop_token_ids_must_be_token_ids():
    """A negative stop token id is refused (it was accepted, and under min_tokens masked the vocabulary's last
    token through negative indexing); numpy integers are taken as ids."""
    import numpy as np

    for bad in ([-1], [3, -2], [1.5], ["7"], [True]):
        with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
            SamplingParams(stop_token_ids=bad)
    assert SamplingParams(stop_token_ids=[np.int64(5), 0]).stop_token_ids == [5, 0]


def test_sampling_settings_that_must_be_integers_are_refused_otherwise(engine):
    """n, max_tokens, min_tokens, top_k and seed given as floats (a YAML 512.0) passed and failed later inside torch
    (some after the prefill); an infinite temperature sampled uniformly; a per-prompt seed of None failed in
    row_seed. Each is a one-line error naming the setting; numpy integers are integers."""
    import numpy as np

    for kw in (dict(n=2.0), dict(max_tokens=2.5), dict(min_tokens=1.0), dict(top_k=2.5), dict(seed=1.5),
               dict(max_tokens=True)):
        with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(kw))} must be an integer"):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("inf"))
    assert SamplingParams(max_tokens=np.int64(3), seed=np.int32(-4)).max_tokens == 3
    with pytest.raises(ValueError, match="every seed must be an integer, got None"):
        engine.generate([[5, 6], [7]], SamplingParams(max_tokens=2), seeds=[1, None])


def test_one_text_prompt_and_numpy_seeds(engine):
    """A bare string is one prompt, as vLLM's ``LLM.generate`` takes it (it was one prompt per character), and
    per-prompt seeds may be numpy integers, as ``SamplingParams.seed`` may (they overflowed the seed arithmetic,
    or an array was refused as ambiguous)."""
    import numpy as np

    p = SamplingParams(max_tokens=4, temperature=1.0)
    one = engine.generate("What is 2+2?", p, seeds=[3])
    assert len(one) == 1 and one[0].token_ids == engine.generate(["What is 2+2?"], p, seeds=[3])[0].token_ids
    prompts = _prompts(engine)[:2]
    want = [c.token_ids for c in engine.generate(prompts, p, seeds=[3, 4])]
    assert [c.token_ids for c in engine.generate(prompts, p, seeds=np.array([3, 4]))] == want
    assert [c.token_ids for c in engine.generate(prompts, p, seeds=[np.int64(3), np.int64(4)])] == want
    with pytest.raises(ValueError, match="got 1 seeds for 2 prompts"):
        engine.generate(prompts, p, seeds=np.array([3]))


# ------------------------------------------------------------------------------ (mutation-testing additions)


@pytest.fixture(scope="module")
def dense(tiny_dense_dir):
    """One sharpened dense engine for the tests below (unparametrised: they check engine logic, not the model)."""
    eng = TorchEngine.from_pretrained(tiny_dense_dir)
    with torch.no_grad():
        eng.model.lm_head.weight.mul_(3.0)
    return eng


def test_a_neutral_logits_processor_samples_what_the_plain_sampler_does():
    """A processor that changes nothing (a logit bias of 0) takes the same random number at every step as the
    plain sampler: the same tokens, step after step, and the same log-probs."""
    import numpy as np

    from train.engine.sampling import LogitsProcessors, sample

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) * 2
    p = SamplingParams(temperature=0.9, top_k=20, logit_bias={3: 0.0})
    procs = LogitsProcessors(p, [[1, 2]] * 4, 30, "cpu")
    seeds = np.arange(4, dtype=np.uint64) * 977
    for step in range(6):
        want = sample(logits, SamplingParams(temperature=0.9, top_k=20), seeds, step)
        got = sample(logits, p, seeds, step, processors=procs)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1]), step


def test_min_tokens_ignores_stop_ids_outside_the_vocabulary():
    """A stop id past the model's vocabulary (a tokenizer's extra token) cannot be sampled: min_tokens masks the
    others and leaves the logits' shape alone (indexing it was an IndexError)."""
    from train.engine.sampling import LogitsProcessors

    logits = torch.zeros(2, 10)
    procs = LogitsProcessors(SamplingParams(min_tokens=2, max_tokens=4), [[1], [2]], 10, "cpu", stop_ids={3, 12})
    x = procs.apply(logits, 0)
    assert torch.isinf(x[:, 3]).all() and torch.isfinite(x[:, [0, 1, 2, 4, 5, 6, 7, 8, 9]]).all()
    assert torch.equal(procs.apply(logits, 2), logits)  # from the min_tokens-th token on, nothing masked


def test_min_tokens_masks_the_requests_stop_token_ids(dense):
    """min_tokens holds back the request's stop_token_ids as well as EOS (vLLM's _all_stop_token_ids)."""
    p = dense.encode(["What is 2+2?"])
    plain = dense.generate(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    s = next(t for t in range(dense.model.config.vocab_size) if t not in plain.token_ids[:4])
    c = dense.generate(p, SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[s],
                                         logit_bias={s: 100.0}, ignore_eos=True))[0]
    assert s not in c.token_ids[:3] and c.token_ids[3] == s and len(c.token_ids) == 4 and c.finish_reason == "stop"


def test_a_completion_text_leaves_out_the_stop_token(dense):
    """Finished by a stop token (EOS or stop_token_ids): ``token_ids`` ends with it, ``text`` does not show it (vLLM's
    default); finished by length, the text is every token's."""
    p = dense.encode(["Sort the list 5 3 9 1."])
    ref = dense.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert ref.text == dense.tokenizer.decode(ref.token_ids, skip_special_tokens=False)
    stop = ref.token_ids[5]
    k = ref.token_ids.index(stop)
    c = dense.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert c.token_ids == ref.token_ids[:k + 1] and c.finish_reason == "stop"
    assert c.text == dense.tokenizer.decode(ref.token_ids[:k], skip_special_tokens=False)


def test_short_prompts_beside_one_at_the_context_limit_keep_their_max_tokens(dense):
    """Each row stops at its own context room: a prompt 3 tokens short of the context gets 3 tokens, a short prompt
    in the same batch still gets its max_tokens."""

    class Short(TorchEngine):
        context_length = 48

    eng = Short(dense.model, dense.tokenizer)
    near, short = [5] * 45, dense.encode(["Hi"])[0]
    outs = eng.generate([near, short], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [len(c.token_ids) for c in outs] == [3, 20]
    assert [c.finish_reason for c in outs] == ["length", "length"]


def test_batch_chunks_sample_as_one_batch(dense):
    """max_batch_rows splits a request into chunks: prompt i still samples with its seed for index i (the same
    tokens as in one big batch), and keeps its prompt_index."""
    prompts = dense.encode(["2+2?", "Sort 5 3 9 1.", "Hi", "Name a prime", "x"])
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=13)
    whole = dense.generate(prompts, sp)
    small = TorchEngine(dense.model, dense.tokenizer, max_batch_rows=2)
    parts = small.generate(prompts, sp)
    assert [c.token_ids for c in parts] == [c.token_ids for c in whole]
    assert [c.prompt_index for c in parts] == [i for i in range(5) for _ in range(2)]


def test_penalised_rows_finishing_at_different_steps_keep_their_counts(dense):
    """Penalties with rows that stop at different steps (the counts follow the shrinking batch): every prompt alone
    samples what it sampled in the batch, and the log-probs stay the raw ones."""
    prompts = dense.encode(["2+2?", "Sort 5 3 9 1.", "Hi", "Name a prime"])
    V = dense.model.config.vocab_size
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=7, presence_penalty=0.8, repetition_penalty=1.3,
                        stop_token_ids=list(range(0, V, 5)))
    outs = dense.generate(prompts, sp)
    assert len({len(c.token_ids) for c in outs}) >= 3
    for i in range(len(prompts)):
        alone = TorchEngine._generate_chunk(dense, [prompts[i]], i, sp, 7)
        assert [x.token_ids for x in alone] == [x.token_ids for x in outs[2 * i:2 * i + 2]]
    for c in outs:
        with torch.no_grad():
            ref = token_logprobs(dense.model, torch.tensor([c.prompt_token_ids + c.token_ids]))[0,
                                                                                              len(c.prompt_token_ids) - 1:]
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_eos_ids_come_from_config_generation_config_and_tokenizer():
    from types import SimpleNamespace

    from train.engine.torch_engine import eos_ids_of

    cfg = SimpleNamespace(eos_token_id=2, generation_config={"eos_token_id": [2, 7]})
    assert eos_ids_of(cfg) == {2, 7}
    assert eos_ids_of(cfg, SimpleNamespace(eos_token_id=9)) == {2, 7, 9}
    assert eos_ids_of(SimpleNamespace(eos_token_id=None, generation_config={"eos_token_id": 4})) == {4}


def test_stop_cut_looks_for_a_stop_string_ending_past_min_tokens():
    """stop_cut with one character per token: with min_tokens k, a stop string counts only when it ends past the
    first k characters, even when it starts inside them."""
    from train.engine.torch_engine import stop_cut

    dec = lambda ids: "".join(chr(ord("a") + t) for t in ids)  # noqa: E731
    toks = [0, 1, 2, 3, 1, 2]  # "abcdbc"
    assert stop_cut(dec, toks, ["bc"]) == "a"
    assert stop_cut(dec, toks, ["bc"], min_tokens=2) == "a"  # "bc" at 1..2 ends past the first two characters
    assert stop_cut(dec, toks, ["bc"], min_tokens=3) == "abcd"  # the first ends inside "abc": the second cuts
    assert stop_cut(dec, toks, ["zz"]) is None
