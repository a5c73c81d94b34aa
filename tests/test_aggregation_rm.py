"""Aggregation problems graded like their problem, the expert share of aggregation prompts, resuming with more
tails, and a reward model that keeps its BOS when a long conversation is cut."""
import re

import pytest

from cascade.aggregation import AggregationMixer
from envs.base import Problem, get_env
from tests.test_stage_data import _C, _G


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def _traces(tok, tag, k):
    return [_C(tok, f"<think>try</think> answer {tag}.{i} is \\boxed{{{i}}}") for i in range(k)]


# -- aggregation problems are graded as their problem --------------------------------------------------
@pytest.mark.parametrize("pacore", [False, True])
def test_an_aggregation_problem_verifies_like_its_problem_whatever_its_candidates_write(tok, pacore):
    """The rule "an expression the question writes is no answer" reads the question, not the candidates an
    aggregation prompt shows: a right answer in a candidate's spelling is right; the question's own expression
    is still no answer."""
    env = get_env("math")
    m = AggregationMixer(tok, 1.0, 2, 64, "math")
    p = Problem("What is $\\sin(\\pi/4)$?", "\\frac{\\sqrt{2}}{2}", "math", 7, 0, {})
    q = Problem("Simplify $\\sqrt{50}$.", "5\\sqrt{2}", "math", 8, 0, {})
    tails = ["so the value is $\\frac{1}{\\sqrt{2}}$ and $\\sqrt{50}$.", "I get $\\frac{1}{2}$."]
    for problem, boxed, want in ((p, "\\frac{1}{\\sqrt{2}}", True), (p, "\\frac{1}{2}", False),
                                 (q, "\\sqrt{50}", False), (q, "5\\sqrt{2}", True)):
        resp = f"<think>ok</think>\nThe answer is \\boxed{{{boxed}}}."
        agg = m.build("math", problem, tails, pacore=pacore)
        plain, got = env.verify(problem, resp), env.verify(agg, resp)
        assert plain.correct is got.correct is want, (problem.prompt, boxed, got.info)
        assert agg.meta["question"] == problem.prompt


# -- the expert share ----------------------------------------------------------------------------------
def test_expert_fraction_is_the_share_of_expert_prompts_also_before_any_own_tails(tok):
    """Without the policy's own tails yet, an aggregation pick shows the expert's tails only at
    ``expert_fraction`` (it stays plain otherwise): at 0 never (each pick was an expert prompt)."""
    p = Problem("Compute 2+2.", "4", "toy/add", 1, 0, {})
    picks = [("toy/add", Problem(f"Compute {i}+3.", str(i + 3), "toy/add", 10 + i, 0, {})) for i in range(200)]
    none = AggregationMixer(tok, 1.0, 2, 16, "math", seed=0, expert_fraction=0.0)
    none.remember_expert("toy/add", p, _traces(tok, 0, 2))
    assert none.mix(picks) == picks and none.made == none.made_expert == 0
    half = AggregationMixer(tok, 1.0, 2, 16, "math", seed=0, expert_fraction=0.5)
    half.remember_expert("toy/add", p, _traces(tok, 0, 2))
    out = half.mix(picks)
    sources = [q.meta.get("tail_source") for _, q in out]
    assert set(sources) == {"expert", None} and half.made == half.made_expert == sources.count("expert")
    assert 70 <= half.made_expert <= 130
    half.remember([_G("toy/add", Problem("Compute 5+5.", "10", "toy/add", 2, 0, {}), _traces(tok, 1, 2))])
    sources = [q.meta.get("tail_source") for _, q in half.mix(picks)]  # both pools: every pick aggregates
    assert None not in sources and 70 <= sources.count("expert") <= 130


def test_without_an_expert_mix_draws_the_same_sequence_as_before(tok):
    """No expert: the mixer's random draws (and so a seeded run's prompts) are those it always made."""
    m = AggregationMixer(tok, 0.7, 2, 32, "math", seed=3, pacore_fraction=0.5)
    for k in range(3):
        m.remember([_G("toy/add", Problem(f"What is {k}+1?", str(k + 1), "toy/add", k, 0, {}), _traces(tok, k, 4))])
    m.remember([_G("math/arith", Problem("What is 9*9?", "81", "math/arith", 9, 0, {}), _traces(tok, 9, 3))])
    picks = [(e, Problem(f"fresh {i}", "0", e, 100 + i, 0, {}))
             for i in range(6) for e in ("toy/add", "math/arith", "code/solve")]
    got = [(e, q.seed, q.meta.get("kind"), re.findall(r"answer (\d+\.\d+)", q.prompt)) for e, q in m.mix(picks)]
    assert got == [  # the current code's, kept as it is
        ("toy/add", 1, "rsa", ["1.3", "1.2"]), ("math/arith", 9, "rsa", ["9.1", "9.0"]), ("code/solve", 100, None, []),
        ("toy/add", 101, None, []), ("math/arith", 9, "rsa", ["9.2", "9.0"]), ("code/solve", 101, None, []),
        ("toy/add", 1, "rsa", ["1.0", "1.2"]), ("math/arith", 102, None, []), ("code/solve", 102, None, []),
        ("toy/add", 103, None, []), ("math/arith", 9, "rsa", ["9.1", "9.2"]), ("code/solve", 103, None, []),
        ("toy/add", 104, None, []), ("math/arith", 9, "rsa", ["9.0", "9.1"]), ("code/solve", 104, None, []),
        ("toy/add", 2, "pacore", ["2.3", "2.2"]), ("math/arith", 105, None, []), ("code/solve", 105, None, [])]
    assert m.rng.random() == 0.8334771199961473  # no draw more, none less


# -- resuming ------------------------------------------------------------------------------------------
def test_a_checkpoint_with_fewer_tails_than_now_asked_for_is_not_used(tok):
    """Resumed with ``aggregation.tails`` raised from 4 to 6: the saved entries hold too few tails to make a
    prompt, so they are left out (mix made ValueError: sample larger than population); those with enough stay."""
    p, q = (Problem(f"Compute {k}+2.", str(k + 2), "toy/add", k, 0, {}) for k in (1, 2))
    m = AggregationMixer(tok, 1.0, 4, 16, "math", seed=0, expert_fraction=0.5)
    m.remember([_G("toy/add", p, _traces(tok, 1, 4)), _G("toy/add", q, _traces(tok, 2, 6))])
    m.remember_expert("toy/add", p, _traces(tok, 1, 4))
    six = AggregationMixer(tok, 1.0, 6, 16, "math", seed=0, expert_fraction=0.5)
    six.load_state_dict(m.state_dict())
    out = six.mix([("toy/add", p)] * 8)
    assert all(a.meta["tails"] == 6 and a.seed == 2 for _, a in out)
    assert list(six.pool) == [list(m.pool)[1]] and not six.expert


# -- reward model --------------------------------------------------------------------------------------
def test_a_long_conversation_keeps_the_reward_models_bos_and_its_answer(tmp_path, tiny_dense_dir):
    """A Llama-3-style reward model (its chat template writes BOS) reads a conversation longer than ``max_len``
    as BOS plus the conversation's last ``max_len - 1`` tokens (cut from the left it lost its BOS: scores jumped
    at max_len), in score and score_many alike."""
    import torch

    from tests.test_cascade_parts import bos_reward_model

    rm, bos = bos_reward_model(tmp_path / "rm", tiny_dense_dir, max_len=48)
    t = rm.tok
    seen = []
    forward = rm.model.forward

    def spy(input_ids=None, attention_mask=None, **kw):
        seen.extend(ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask))
        return forward(input_ids=input_ids, attention_mask=attention_mask, **kw)

    rm.model.forward = spy
    prompt, resp = "Please write " + "very " * 100 + "long text.", "<think>hmm</think>\n\nThe final answer is FORTY-TWO."
    end = t.encode("The final answer is FORTY-TWO.\n", add_special_tokens=False)
    one = rm.score(prompt, resp)
    many = rm.score_many([(prompt, resp), ("Say hi.", "hi")])
    short = t.apply_chat_template([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}])
    short = list(short["input_ids"] if hasattr(short, "keys") else short)
    assert seen[0] == seen[2] and seen[1] == short  # score_many: shortest first
    ids = seen[0]
    assert len(ids) == 48 and ids[0] == bos and ids[1] != bos and ids[-len(end):] == end
    assert many[0] == pytest.approx(one, abs=1e-5)
    with torch.no_grad():
        assert one == pytest.approx(float(forward(input_ids=torch.tensor([ids])).logits[0, 0]), abs=1e-5)


def test_a_long_conversation_keeps_cls_on_a_bert_style_reward_model(tmp_path):
    """A BERT-style tokenizer has no BOS but [CLS], where such a reward model reads its score: a conversation cut
    to ``max_len`` keeps it (and its closing [SEP]) and its end."""
    from transformers import BertTokenizerFast

    from cascade.reward_model import RewardModel

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "very", "long",
                                                   "answer", "is", "42"]) + "\n")
    rm = object.__new__(RewardModel)  # the tokenizer's part only: no model needed
    rm.tok, rm.max_len = BertTokenizerFast(str(tmp_path / "vocab.txt")), 8
    ids = rm.ids("very " * 20 + "long", "answer is 42")
    assert len(ids) == 8 and ids[0] == rm.tok.cls_token_id and ids[-1] == rm.tok.sep_token_id
    assert rm.tok.convert_ids_to_tokens(ids[-4:-1]) == ["answer", "is", "42"]


# -- edges of the mixer (mutation-testing kills) -------------------------------------------------------
def test_a_pacore_message_is_the_final_answer_of_a_finished_rollout_only():
    """The answer after the *last* ``</think>`` of a rollout that stopped; a rollout cut by the length cap
    (its ``</think>`` may be quoted mid-reasoning) or with nothing after its thinking gives its tail."""
    from cascade.aggregation import compact_message

    enc, dec = (lambda t: [ord(c) for c in t]), (lambda ids: "".join(map(chr, ids)))
    text = "<think>plan</think> draft 1 </think>  final is 7 "
    assert compact_message(text, "stop", "TAIL", enc, dec, 100) == "final is 7"
    assert compact_message(text, "stop", "TAIL", enc, dec, 4) == "is 7"[-4:]  # its end kept
    assert compact_message(text, "length", "TAIL", enc, dec, 100) == "TAIL"
    assert compact_message("<think>x</think>   ", "stop", "TAIL", enc, dec, 100) == "TAIL"
    assert compact_message(None, "stop", "TAIL", enc, dec, 100) == "TAIL"


@pytest.mark.parametrize("name", ["fraction", "expert_fraction", "pacore_fraction"])
def test_shares_outside_zero_to_one_are_refused(tok, name):
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=name):
            AggregationMixer(tok, **{"fraction": 0.5, "tails": 2, "tail_tokens": 8, name: bad})
    AggregationMixer(tok, **{"fraction": 0.5, "tails": 2, "tail_tokens": 8, name: 1.0})  # the ends are shares


def test_bound_keeps_the_lower_of_the_two_caps(tok):
    m = AggregationMixer(tok, 1.0, 2, 8, "math", max_prompt_tokens=50)
    m.bound(100)
    assert m.cap == 50
    m.bound(0)  # no trainer bound: unchanged
    assert m.cap == 50
    m.bound(30)
    assert m.cap == 30
    free = AggregationMixer(tok, 1.0, 2, 8, "math")
    free.bound(70)
    assert free.cap == 70


def test_the_tail_buffer_keeps_the_most_recently_remembered_problems(tok):
    """``buffer`` problems are kept; the oldest remembered goes first, and a problem remembered again is
    fresh again. A problem with fewer than ``tails`` rollouts is no source; one with exactly ``tails`` is."""
    m = AggregationMixer(tok, 1.0, 2, 16, "math", buffer=2)
    ps = [Problem(f"Compute {k}+1.", str(k + 1), "toy/add", k, 0, {}) for k in range(4)]
    m.remember([_G("toy/add", ps[0], _traces(tok, 0, 2)), _G("toy/add", ps[1], _traces(tok, 1, 2))])
    assert [k.split("|")[1] for k in m.pool] == ["0", "1"]
    m.remember([_G("toy/add", ps[0], _traces(tok, 0, 3))])  # remembered again: now the newest
    m.remember([_G("toy/add", ps[2], _traces(tok, 2, 2))])  # the oldest (problem 1) leaves
    assert [k.split("|")[1] for k in m.pool] == ["0", "2"]
    m.remember([_G("toy/add", ps[3], _traces(tok, 3, 1))])  # one rollout, two tails asked: not kept
    assert [k.split("|")[1] for k in m.pool] == ["0", "2"]


def test_an_aggregation_problem_keeps_a_question_its_problem_already_names(tok):
    m = AggregationMixer(tok, 1.0, 2, 16, "math")
    p = Problem("Full prompt with instructions: compute 1+1.", "2", "toy/add", 1, 0, {"question": "compute 1+1"})
    agg = m.build("toy/add", p, ["\\boxed{2}", "\\boxed{3}"])
    assert agg.meta["question"] == "compute 1+1" and agg.meta["tails"] == 2 and agg.meta["tail_source"] == "self"


def test_trimmed_and_dropped_counts_are_metrics_and_survive_a_resume(tok):
    p = Problem("What is 2+2?", "4", "toy/add", 0, 0, {})
    tails = [" ".join(f"step {i}" for i in range(80)) + " \\boxed{4}"] * 2
    full = len(tok.encode(AggregationMixer(tok, 1.0, 2, 10**6, "math")._render("toy/add", p, tails, False),
                          add_special_tokens=False))
    m = AggregationMixer(tok, 1.0, 2, 10**6, "math", max_prompt_tokens=full - 20)
    assert m.build("toy/add", p, tails) is not None
    m.cap = 3  # not even the problem fits
    assert m.build("toy/add", p, tails) is None
    assert m.metrics() == {"aggregation_prompts": 0, "aggregation_expert": 0, "aggregation_pacore": 0,
                           "aggregation_trimmed": 1, "aggregation_dropped": 1}
    again = AggregationMixer(tok, 1.0, 2, 10**6, "math")
    again.load_state_dict(m.state_dict())
    assert again.metrics() == m.metrics()


def test_a_prompt_of_exactly_the_cap_is_made_untrimmed(tok):
    p = Problem("What is 2+2?", "4", "toy/add", 0, 0, {})
    tails = ["so \\boxed{4}", "so \\boxed{5}"]
    full = len(tok.encode(AggregationMixer(tok, 1.0, 2, 64, "math")._render("toy/add", p, tails, False),
                          add_special_tokens=False))
    m = AggregationMixer(tok, 1.0, 2, 64, "math", max_prompt_tokens=full)
    agg = m.build("toy/add", p, tails)
    assert agg is not None and all(t in agg.prompt for t in tails) and m.trimmed == m.dropped == 0


def test_an_expert_only_environment_aggregates_before_any_own_tails(tok):
    """With expert tails only (none of the policy's yet) and expert_fraction 1, every pick is an expert prompt."""
    p = Problem("Compute 2+2.", "4", "toy/add", 1, 0, {})
    m = AggregationMixer(tok, 1.0, 2, 16, "math", seed=0, expert_fraction=1.0)
    m.remember_expert("toy/add", p, _traces(tok, 0, 2))
    out = m.mix([("toy/add", p)] * 5)
    assert [q.meta.get("tail_source") for _, q in out] == ["expert"] * 5 and m.made == m.made_expert == 5


def test_an_experts_own_end_ids_leave_its_tails(tok):
    """``remember_expert(..., stop_ids=)``: the expert engine's end ids, which the policy's mixer does not know,
    are not part of the expert's tails."""
    end = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else 0
    assert end != tok.eos_token_id
    trace = "The answer is \\boxed{7}."
    comps = [_C(tok, trace), _C(tok, trace)]
    for c in comps:
        c.token_ids = c.token_ids + [end]
    m = AggregationMixer(tok, 1.0, 2, 64, "math")  # the policy's: no such stop id
    m.remember_expert("toy/add", Problem("What is 3+4?", "7", "toy/add", 1, 0, {}), comps, tok, stop_ids=[end])
    (_, _, tails, _), = m.expert.values()
    assert tails == [trace, trace]


def test_an_aggregation_problems_rollouts_do_not_replace_its_problems_tails(tok):
    p = Problem("Compute 1+1.", "2", "toy/add", 1, 0, {})
    m = AggregationMixer(tok, 1.0, 2, 32, "math", seed=0)
    m.remember([_G("toy/add", p, _traces(tok, "own", 2))])
    before = [list(v[2]) for v in m.pool.values()]
    (_, agg), = m.mix([("toy/add", p)])
    m.remember([_G("toy/add", agg, _traces(tok, "agg", 2))])  # same problem key, but an aggregation problem
    assert [list(v[2]) for v in m.pool.values()] == before


class _CharTok:
    """One token per character (no end id): prompt lengths by hand."""
    eos_token_id = None

    def encode(self, s, add_special_tokens=False, verbose=False):
        return [ord(c) for c in s]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_trimming_cuts_every_tail_from_the_front_to_the_longest_common_length_that_fits():
    """Tails of 10 and 30 characters, 10 over the cap: the common length is 20 (10 + 20 fills the room
    exactly), the short tail is whole, the long one keeps its last 20 characters, the prompt is the cap."""
    t = _CharTok()
    p = Problem("Q?", "1", "toy/add", 0, 0, {})
    short, long = "s" * 9 + "S", "".join(chr(ord("a") + i % 26) for i in range(30))
    full = len(AggregationMixer(t, 1.0, 2, 100, "math")._render("toy/add", p, [short, long], False))
    m = AggregationMixer(t, 1.0, 2, 100, "math", max_prompt_tokens=full - 10)
    agg = m.build("toy/add", p, [short, long])
    assert agg is not None and len(agg.prompt) == full - 10 and m.trimmed == 1
    assert short in agg.prompt and long[-20:] in agg.prompt and long[-21:] not in agg.prompt
    m.cap = full - 40  # room for the template alone: tails cut to nothing are no prompt
    assert m.build("toy/add", p, [short, long]) is None and m.dropped == 1
    m.cap = full - 40 + 12  # room 12: common length 6 (6 + 6)
    agg = m.build("toy/add", p, [short, long])
    assert short[-6:] in agg.prompt and long[-6:] in agg.prompt and short[-7:] not in agg.prompt
    m.cap = full - 40 + 2  # room 2: a character of each tail, both shown
    agg = m.build("toy/add", p, [short, long])
    assert len(agg.prompt) == m.cap and agg.prompt.count("S") == 1 and long[-1] in agg.prompt


def test_a_reward_model_needs_one_label_and_gets_the_tokenizers_pad_id(tmp_path, tiny_dense_dir):
    """A classifier with two outputs is no scalar reward model; a config without a pad id takes the tokenizer's
    (the batched forward reads each sequence's last non-pad token by it)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    from cascade.reward_model import RewardModel

    tok = AutoTokenizer.from_pretrained(str(tiny_dense_dir))
    assert tok.pad_token_id is not None
    for name, labels, pad in (("two", 2, tok.pad_token_id), ("nopad", 1, None)):
        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=labels,
                          pad_token_id=pad, max_position_embeddings=256)
        Qwen3ForSequenceClassification(cfg).save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    with pytest.raises(ValueError, match="2 labels; expected 1"):
        RewardModel(tmp_path / "two")
    rm = RewardModel(tmp_path / "nopad")
    assert rm.model.config.pad_token_id == tok.pad_token_id
    pairs = [("Say hi.", "hi"), ("Say hello to everyone here.", "hello everyone, all of you")]
    assert rm.score_many(pairs) == pytest.approx([rm.score(p, r) for p, r in pairs], abs=1e-5)


def test_a_reward_model_reads_the_answer_after_the_thinking():
    from cascade.reward_model import RewardModel

    class Tok:  # no chat template: "prompt\nanswer"
        chat_template = None

    rm = object.__new__(RewardModel)
    rm.tok = Tok()
    assert rm.text("Say hi.", "<think>\nplan it\n</think>\n\n  hi there") == "Say hi.\nhi there"
    assert rm._add_special
    rm.tok.chat_template = "{{ messages }}"
    assert not rm._add_special  # the template writes its own special tokens
