"""Prompt seams: with a tokenizer whose pre-tokenizer glues punctuation to the newlines after it (Qwen2's regex:
``.\\n\\n`` is one token), ttc's prompts hold the problem as the chat template's encoding of the whole text does
(what the model was trained on, what RL's ``chat_prompt_ids`` and a chat API send), and never exceed the plan."""
from __future__ import annotations

import pytest

from train.engine.base import Completion
from ttc.backends import HFTokenizerSide
from ttc.rsa import MarkovianRSA, RSAConfig
from ttc.templates import MATH, PromptBuilder
from train.tokenizer import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, chat_prompt_ids, training_corpus

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PROBLEMS = ["Find the sum of the two numbers.", "What is 2+3?\n", "What is 2+3? ", "\nWhat is 2+3?"]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """A small byte-level BPE with Qwen2's pre-tokenizer (its Split regex, then ByteLevel without its own regex)
    and the project's chat template, saved and loaded in Hugging Face format."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = training_corpus()
    # paragraphs separated by blank lines, as real text is, so that '.\n\n', '?\n' and '\n\n\n' become tokens
    corpus = ["\n\n".join(corpus[i:i + 4]) for i in range(0, len(corpus), 4)] + \
        ["a\n\n\nb", "x \n\ny", "end.\n\n\n\nnext", "q?\n \n\nPlease"] * 200
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL_TOKENS,
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=SPECIAL_TOKENS[1:3])
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("qwen_tok")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_the_tokenizer_glues_punctuation_to_newlines(qwen_tok):
    """The premise: encoded apart, the problem and the template text meet at a seam the whole text has not."""
    side = HFTokenizerSide(qwen_tok)
    whole = side.encode("s.\n\nPlease")
    assert len(whole) < len(side.encode("s.") + side.encode("\n\nPlease"))


@pytest.mark.parametrize("problem", PROBLEMS)
def test_solve_prompt_is_the_chat_templates_encoding(qwen_tok, problem):
    side = HFTokenizerSide(qwen_tok)
    b = PromptBuilder(MATH, side.encode, side.chat_parts())
    assert b.solve(problem) == chat_prompt_ids(qwen_tok, MATH.solve.format(problem=problem))


@pytest.mark.parametrize("problem", PROBLEMS)
def test_aggregate_prompt_problem_seam_is_the_whole_texts(qwen_tok, problem):
    """Up to the first tail, an aggregation prompt is the whole text's encoding; each tail follows verbatim."""
    side = HFTokenizerSide(qwen_tok)
    pre, post = side.chat_parts()
    b = PromptBuilder(MATH, side.encode, (pre, post))
    tails = [side.encode("so the answer is \\boxed{5}.")[-5:], side.encode("Thus x = 3.")[-4:]]
    ids = b.aggregate(problem, tails)
    blocks = [MATH.candidate.format(tail=side.decode(t), index=i + 1) for i, t in enumerate(tails)]
    text = MATH.aggregate.format(problem=problem, count=2, candidates="".join(blocks))
    assert side.decode(ids) == pre + text + post
    head = side.encode(pre + text[:text.index(blocks[0])] + blocks[0].split(side.decode(tails[0]))[0])
    assert ids[:len(head)] == head
    assert ids[len(head):len(head) + len(tails[0])] == tails[0]
    assert len(ids) <= len(b.aggregate(side.encode(problem), [[]] * 2)) + sum(map(len, tails))


def test_a_problem_that_whole_text_lengthens_keeps_the_planned_size():
    """Where encoding the problem with the text around it gives more tokens than apart (possible with BPE), the
    prompt falls back to the problem's own encoding: no prompt exceeds the plan's size for ``len(encode(problem))``
    tokens. The encoder: one id a character, and one more for each '?' followed by a newline."""
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text] + [0] * text.count("?\n")

    b = PromptBuilder(MATH, encode, ("<u>", "</u><a>"))
    for problem in ("What?", "What?\n", "Sum."):
        q = encode(problem)
        for prompt, planned in [(b.solve(problem), b.solve(q)), (b.cont(problem, [7]), b.cont(q, [7])),
                                (b.aggregate(problem, [[7], [8]]), b.aggregate(q, [[7], [8]]))]:
            assert len(prompt) <= len(planned)
            assert "".join(map(chr, (i for i in prompt if i))) == "".join(map(chr, (i for i in planned if i)))
    assert b.solve("What?") == b.solve(encode("What?"))  # the whole text ('?\n\nPlease') costs one more: apart


class OneLineBackend(HFTokenizerSide):
    """Every completion is the same short reasoning, cut at max_tokens."""

    def generate(self, prompts, params, seeds=None):
        ids = self.encode("<think>\nso the sum is 5.\n</think>\n\nThe answer is \\boxed{5}.")
        ids, fin = (ids[:params.max_tokens], "length") if len(ids) > params.max_tokens else (ids, "stop")
        return [Completion(ids, self.decode(ids), [0.0] * len(ids), fin, i)
                for i, _ in enumerate(prompts) for _ in range(params.n)]


@pytest.mark.parametrize("variant", ["rsa", "delethink"])
def test_run_prompts_hold_the_problem_as_the_chat_template_does_within_the_plan(qwen_tok, variant):
    problem = "Find the sum of the two numbers."
    be = OneLineBackend(qwen_tok)
    rsa = MarkovianRSA(be, RSAConfig(population=2, aggregate=2, rounds=1, budget=8, tail=4, final_budget=3,
                                     variant=variant, seed=1), "math")
    res = rsa.run(problem)
    pre, post = be.chat_parts()
    solve = chat_prompt_ids(qwen_tok, MATH.solve.format(problem=problem))
    assert res.prompts[0].prompt_ids == solve
    later = [p for p in res.prompts if p.stage in ("aggregate", "continue")]
    assert later
    for p in later:
        if p.stage == "continue":
            assert p.prompt_ids == solve + p.forwarded[0]
        else:  # the text up to the first tail, as one string
            head = be.encode(pre + MATH.aggregate.format(problem=problem, count=2, candidates="\0").split("\0")[0]
                             + MATH.candidate.format(tail="\0", index=1).split("\0")[0])
            assert p.prompt_ids[:len(head)] == head
    plan = {s["stage"]: s["prompt"] for s in rsa.plan(len(be.encode(problem)))}
    assert all(len(p.prompt_ids) <= plan[p.stage] for p in res.prompts)
