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
