"""Answer-preserving trimming, aggregation prompts, the pass-rate pool and reward-model gating."""
import pytest

from cascade.aggregation import AggregationMixer
from cascade.trim import drop_thinking, trim_messages, trim_pairs, trim_response
from envs.base import Problem


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def n(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


def test_trim_keeps_answer_and_cuts_the_think_tail(tok):
    think = " ".join(f"step {i} is fine" for i in range(60))
    resp = f"<think>{think}</think>\n\nThe answer is \\boxed{{42}}."
    assert trim_response(tok, resp, n(tok, resp)) == resp  # fits: unchanged
    budget = n(tok, resp) // 3
    cut = trim_response(tok, resp, budget)
    assert n(tok, cut) <= budget
    assert cut.endswith("</think>\n\nThe answer is \\boxed{42}.")
    assert cut.startswith("<think>step 0 is fine")  # the head of the reasoning stays, its tail goes
    assert trim_response(tok, resp, 5) is None  # the answer alone does not fit: dropped
    assert trim_response(tok, "no think block " * 50, 10) is None


def test_trim_multi_turn_drops_earlier_think_blocks_first(tok):
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>" + "long " * 80 + "</think>A1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>" + "more " * 40 + "</think>A2"}]

    def render(ms):
        return "".join(f"{m['role']}: {m['content']}\n" for m in ms)

    full = n(tok, render(msgs))
    out = trim_messages(tok, msgs, full - 60, render)
    assert out[1]["content"] == "A1" and out[3]["content"] == msgs[3]["content"]
    tight = trim_messages(tok, msgs, n(tok, render(out)) - 20, render)
    assert tight[1]["content"] == "A1" and tight[3]["content"].endswith("</think>A2")
    assert n(tok, render(tight)) <= n(tok, render(out)) - 20
    assert trim_messages(tok, msgs, 3, render) is None
    kept, dropped = trim_pairs(tok, [("p", msgs[3]["content"]), ("p", "no think block " * 20)], 12, lambda p: 1)
    assert dropped == 1 and kept[0][1].endswith("A2")
    # an SFT pair whose prompt is a chat context: its earlier turns' thinking goes first (the pair was dropped)
    ctx, last = msgs[:3], msgs[3]["content"]
    budget = n(tok, render(msgs)) - 60
    (kept_ctx, kept_resp), = trim_pairs(tok, [(ctx, last)], budget, lambda p: n(tok, render(p)))[0]
    assert kept_ctx[1]["content"] == "A1" and kept_resp == last and ctx[1]["content"].startswith("<think>")


def test_trim_never_cuts_inside_a_character(tok):
    """The think block is cut at a token boundary; a byte-level token boundary inside a character decoded to
    U+FFFD, which the SFT data then taught."""
    response = "<think>" + "🙂🚀✨ " * 30 + "</think>\n\nso \\boxed{7}"
    for budget in range(n(tok, "<think></think>\n\nso \\boxed{7}"), n(tok, response)):
        cut = trim_response(tok, response, budget)
        assert cut is not None and "\ufffd" not in cut and cut.endswith("so \\boxed{7}") and n(tok, cut) <= budget


class _CharTok:
    """One token per character: budgets by hand."""

    def encode(self, s, add_special_tokens=False, verbose=False):
        return [ord(c) for c in s]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_trim_cuts_the_last_of_several_think_blocks():
    """Each think block is matched on its own (non-greedy) and the last one is cut: 28 + 15 + 6 = 49 chars
    leave 11 of its 50 for a budget of 60; under 49 the first block's answer would be cut: dropped."""
    head = "<think>plan</think>step one."
    resp = head + "<think>" + "x" * 50 + "</think>ANSWER"
    assert trim_response(_CharTok(), resp, 60) == head + "<think>" + "x" * 11 + "</think>ANSWER"
    assert trim_response(_CharTok(), resp, 49) == head + "<think></think>ANSWER"
    assert trim_response(_CharTok(), resp, 48) is None


def test_drop_thinking_drops_every_think_block_and_the_blank_lines_after():
    """Two think blocks go one by one (the text between stays) and the leading blank lines go too."""
    msgs = [{"role": "user", "content": "<think>q</think>"},
            {"role": "assistant", "content": "<think>a</think>\n\nX<think>b</think>Y"}]
    assert drop_thinking(msgs) == [msgs[0], {"role": "assistant", "content": "XY"}]


class _C:
    def __init__(self, ids):
        self.token_ids = ids


class _R:
    def __init__(self, ids):
        self.completion = _C(ids)


class _G:
    def __init__(self, env_id, problem, rollouts):
        self.env_id, self.problem, self.rollouts = env_id, problem, rollouts


def test_aggregation_prompts_hold_the_problem_and_c_tails_of_tau_tokens(tok):
    mixer = AggregationMixer(tok, fraction=1.0, tails=2, tail_tokens=5, seed=0)
    p = Problem("What is 6*7?", "42", "toy/add", 1, 0, {})
    rollouts = [_R(tok.encode(f"reasoning number {i} gives \\boxed{{{40 + i}}}", add_special_tokens=False))
                for i in range(4)]
    mixer.remember([_G("toy/add", p, rollouts)])
    tails = {mixer.tail_text(r.completion.token_ids) for r in rollouts}
    (env_id, agg), = mixer.mix([("toy/add", p)])
    assert env_id == "toy/add" and agg.answer == "42" and agg.meta["aggregation"]
    assert agg.prompt.startswith("What is 6*7?")
    shown = [t for t in tails if t in agg.prompt]
    assert len(shown) == 2 and all(n(tok, t) <= 5 for t in shown)
    # aggregation problems are not remembered as sources of tails
    mixer.remember([_G("toy/add", agg, rollouts)])
    assert len(mixer.pool) == 1
    st = mixer.state_dict()
    other = AggregationMixer(tok, 1.0, 2, 5, seed=0)
    other.load_state_dict(st)
    assert other.mix([("toy/add", p)])[0][1].prompt == mixer.mix([("toy/add", p)])[0][1].prompt


def test_aggregation_prompts_keep_the_phase_mix_each_pick_aggregates_its_own_environment(tok):
    """An aggregation problem replaces a pick with a buffered problem of the pick's own environment (expert
    tails too), so the phase's mix holds; a pick whose environment has nothing buffered stays as it is."""
    rollouts = [_R(tok.encode(f"attempt {i} ends here", add_special_tokens=False)) for i in range(4)]
    mixer = AggregationMixer(tok, 1.0, 2, 5, seed=0, expert_fraction=1.0)
    for i in range(20):  # many buffered toy/add problems, one math/arith, one expert code/solve
        mixer.remember([_G("toy/add", Problem(f"add {i}", str(i), "toy/add", 1, 0, {}), rollouts)])
    mixer.remember([_G("math/arith", Problem("arith", "1", "math/arith", 1, 0, {}), rollouts)])
    mixer.remember_expert("code/solve", Problem("solve", "", "code/solve", 1, 0, {}), [r.completion for r in rollouts])
    picks = [(e, Problem(f"fresh {e} {i}", "0", e, 1, 0, {}))
             for i in range(30) for e in ("toy/add", "math/arith", "code/solve", "code/io_predict")]
    out = mixer.mix(picks)
    assert [e for e, _ in out] == [e for e, _ in picks]
    for (e, p), (got, q) in zip(picks, out):
        assert bool(q.meta.get("aggregation")) == (e != "code/io_predict"), (e, q.prompt)
        if q.meta.get("aggregation"):
            assert q.meta["tail_source"] == ("expert" if e == "code/solve" else "self")
    arith = [q for (e, _), (_, q) in zip(picks, out) if e == "math/arith"]
    assert all(q.prompt.startswith("arith") for q in arith)
    assert mixer.made == 90 and mixer.made_expert == 30


def test_aggregation_prompts_ask_for_the_answer_in_the_form_each_environment_grades(tok):
    """``auto``: a program-writing task's aggregation prompt (and its PaCoRe closing) asks for a code block in
    the task's language, a math task's and an output-prediction task's for \\boxed{}; a named template applies
    to every environment."""
    from envs.base import get_env

    envs = {e: get_env(e) for e in ("code/solve", "code/io_predict", "math/arith")}
    envs["cpp"] = get_env("code/solve", language="cpp")
    rollouts = [_R(tok.encode(f"attempt {i} ends here", add_special_tokens=False)) for i in range(4)]

    def prompts(template, pacore):
        mixer = AggregationMixer(tok, 1.0, 2, 5, template=template, seed=0, env_of=envs.__getitem__,
                                 pacore_fraction=float(pacore))
        out = {}
        for e, env in envs.items():
            p = env.generate(0, 0)
            mixer.pool.clear()
            mixer.remember([_G(e, p, rollouts)])
            (got, agg), = mixer.mix([(e, p)])
            assert got == e and agg.meta["aggregation"] and agg.prompt.startswith(p.prompt)
            out[e] = agg.prompt[len(p.prompt):]
        return out

    for pacore in (False, True):
        auto = prompts("auto", pacore)
        assert "```python code block" in auto["code/solve"] and "boxed" not in auto["code/solve"]
        assert "```cpp code block" in auto["cpp"] and "python" not in auto["cpp"]
        assert "\\boxed{}" in auto["code/io_predict"] and "\\boxed{}" in auto["math/arith"]
        assert all("\\boxed{}" in x for x in prompts("math", pacore).values())


def test_an_aggregation_prompt_too_long_for_the_trainer_is_not_made_and_moves_no_level(tok):
    from envs.curriculum import Curriculum
    from train.rl.trainer import encode_prompt

    p = Problem("What is 6*7?", "42", "toy/add", 1, 3, {})
    rollouts = [_R(tok.encode(" ".join(["long reasoning"] * 40), add_special_tokens=False)) for _ in range(4)]
    mixer = AggregationMixer(tok, 1.0, 2, 200, seed=0, max_prompt_tokens=20480,
                             prompt_len=lambda t: len(encode_prompt(tok, t, True, None)))
    mixer.remember([_G("toy/add", p, rollouts)])
    assert mixer.mix([("toy/add", p)])[0][1].meta.get("aggregation")
    mixer.bound(60)  # the trainer's bound, lower than aggregation.max_prompt_tokens: tails cut to fit, or none
    (e, agg), = mixer.mix([("toy/add", p)])
    assert len(encode_prompt(tok, agg.prompt, True, None)) <= 60 and mixer.cap == 60
    mixer.bound(0)
    assert mixer.cap == 60

    # the trainer's own check: an aggregation prompt it skips as too long leaves the level where it was (a zaya
    # level falls after a group with no pass); the plain problem too long is a failed group at its level
    import types
    from dataclasses import replace

    from train.rl.trainer import RLTrainer

    cur = Curriculum({"gym/argsort": 1.0}, controller="zaya", controller_kwargs={"start": 3})
    q = cur.envs["gym/argsort"].generate(7, 3)
    cfg = types.SimpleNamespace(group_size=8, chat_template=False, system_prompt=None)
    t = types.SimpleNamespace(cfg=cfg, tokenizer=tok, curriculum=cur, prompts_too_long=0,
                              max_prompt_tokens=len(encode_prompt(tok, q.prompt, False, None)) - 1)
    agg = replace(q, meta={**q.meta, "aggregation": True})
    assert RLTrainer.generate_groups(t, [("gym/argsort", agg)]) == [] and t.prompts_too_long == 1
    assert cur.difficulties() == {"gym/argsort": 3}
    assert RLTrainer.generate_groups(t, [("gym/argsort", q)]) == [] and t.prompts_too_long == 2
    assert cur.difficulties() == {"gym/argsort": 2}


def test_tails_cut_to_fit_and_pacore_answers_drop_the_remnant_of_a_split_character(tok):
    """A tail cut down to fit the prompt bound, or a PaCoRe answer cut to tau tokens, inside a multi-byte character
    (CJK, emoji under byte-level BPE) showed the policy U+FFFD; the tail of the whole trace already dropped it."""
    from cascade.aggregation import compact_message
    from train.rl.trainer import encode_prompt

    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    dec = lambda i: tok.decode(i, skip_special_tokens=False)  # noqa: E731
    text = "<think>\nreasoning\n</think>\n\n" + "答案是五。🙂" * 6 + " \\boxed{5}"
    msgs = [compact_message(text, "stop", "TAIL", enc, dec, tau) for tau in range(3, 40)]
    assert not any(m.startswith("\ufffd") for m in msgs)
    p = Problem("What is 6*7?", "42", "toy/add", 1, 3, {})
    rollouts = [_R(enc("思考 " + "答案是五。🙂" * 30 + f" {k}")) for k in range(4)]
    made = 0
    for cap in range(90, 400, 7):
        mixer = AggregationMixer(tok, 1.0, 2, 200, seed=0, max_prompt_tokens=cap,
                                 prompt_len=lambda t: len(encode_prompt(tok, t, True, None)))
        mixer.remember([_G("toy/add", p, rollouts)])
        (_, agg), = mixer.mix([("toy/add", p)])
        if agg.meta.get("aggregation"):
            made += 1
            assert "\ufffd" not in agg.prompt and len(encode_prompt(tok, agg.prompt, True, None)) <= cap
    assert made > 20


def test_sampled_rollouts_of_each_chunk_use_their_own_seed(tok):
    """Engines seed each row by its index within one ``generate`` call: with one seed for every chunk, problem j
    of each chunk drew problem j of chunk 0's random stream (the same samples for a prompt in two chunks). Each
    chunk offsets the seed by its first problem's index, as :func:`cascade.evaluation.avg_at_k` does."""
    from cascade.aggregation import sample_rollouts
    from train.engine.base import Completion, SamplingParams

    class RecordingEngine:  # records each call's seed; the engine itself is not what is tested
        def __init__(self):
            self.seeds = []

        def generate(self, prompts, params):
            self.seeds.append(params.seed)
            return [Completion([1], f"{params.seed}/{i}", [0.0], "stop", prompt_index=i)
                    for i in range(len(prompts)) for _ in range(params.n)]

    picks = [("toy/add", Problem(f"What is {k}+1?", str(k + 1), "toy/add", k, 0, {})) for k in range(4)]
    eng = RecordingEngine()
    out = sample_rollouts(eng, tok, picks, 2, SamplingParams(n=1, seed=7), chat=False, chunk=2)
    assert eng.seeds == [7, 9]  # chunks start at problems 0 and 2
    assert [[c.text for c in cs] for _, _, cs in out] == [["7/0"] * 2, ["7/1"] * 2, ["9/0"] * 2, ["9/1"] * 2]
    eng = RecordingEngine()
    sample_rollouts(eng, tok, picks, 1, SamplingParams(n=1), chat=False, chunk=2)
    assert eng.seeds == [None, None]  # unseeded stays unseeded


def bos_reward_model(root, tiny_dense_dir, **kw):
    """A tiny Llama-3-style reward model: its chat template writes BOS and its tokenizer adds one too; and BOS's id."""
    from tokenizers.processors import TemplateProcessing

    from cascade.reward_model import RewardModel, build_tiny_reward_model

    rm = RewardModel(build_tiny_reward_model(root, tiny_dense_dir), **kw)
    t = rm.tok
    t.bos_token = "<|im_start|>"
    bos = t.convert_tokens_to_ids("<|im_start|>")
    t._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    return rm, bos


def test_reward_model_reads_one_bos_and_a_steep_gate_does_not_overflow(tmp_path, tiny_dense_dir):
    """A Llama-3-style reward model (its chat template writes BOS, its tokenizer adds one too) reads the
    conversation as apply_chat_template(tokenize=True) gives it: one BOS. A steep gate on a very negative
    score is a reward near 0, not an OverflowError scored as a verifier error."""
    from cascade.reward_model import GatedRewardEnv
    from envs.base import Environment, Problem, Score

    rm, bos = bos_reward_model(tmp_path / "rm", tiny_dense_dir)
    t = rm.tok
    seen = []
    forward = rm.model.forward
    rm.model.forward = lambda input_ids=None, **kw: seen.append(input_ids[0].tolist()) or forward(input_ids=input_ids, **kw)
    msgs = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    ref = t.apply_chat_template(msgs, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    rm.score("Say hi.", "hi")
    rm.score_many([("Say hi.", "hi")] * 2)
    assert seen and all(ids == ref for ids in seen) and ref[0] == bos and ref[1] != bos

    class Base(Environment):
        id = "b"

        def generate(self, seed, difficulty):
            return Problem("p", "a", "b", seed, difficulty, {})

        def check(self, problem, response):
            return Score(1.0, True, True, {})

    class RM:
        def score(self, p, r):
            return -40.0

        def score_many(self, pairs):
            return [-40.0] * len(pairs)

    env = GatedRewardEnv(Base(), RM(), scale=20.0)
    p = env.generate(0, 0)
    for s in (env.verify(p, "ok"), *env.verify_many([(p, "ok")])):
        assert s.correct and 0.0 <= s.reward < 1e-300 and s.info["rm_score"] == -40.0


def test_reward_model_score_is_gated_by_the_instruction_checker(tmp_path, tiny_dense_dir):
    from cascade.reward_model import GatedRewardEnv, RewardModel, build_tiny_reward_model
    from envs import get_env

    rm = RewardModel(build_tiny_reward_model(tmp_path / "rm", tiny_dense_dir))
    base = get_env("ifeval")
    env = GatedRewardEnv(base, rm)
    prob = env.generate(3, 0)
    good = base.reference_response(prob)
    s = env.verify(prob, good)
    assert s.correct and 0.0 < s.reward < 1.0 and "rm_score" in s.info
    bad = env.verify(prob, "")
    assert not bad.correct and bad.reward == 0.0
    # the answer after the thinking is what is judged and scored, and a conversation longer than the reward
    # model's max_len keeps its end (it was cut from the right: the answer never reached the model)
    thought = env.verify(prob, "<think>\n" + "let me think, " * 20 + "\n</think>\n\n" + good)
    assert thought.correct and thought.info["rm_score"] == pytest.approx(s.info["rm_score"], abs=1e-5)
    rm.max_len = 64
    long_a = rm.score(prob.prompt, "word " * 200 + "The end.")
    long_b = rm.score(prob.prompt, "word " * 200 + "Another ending altogether, quite different.")
    assert long_a != pytest.approx(long_b, abs=1e-6)
    rm.max_len = 2048

    # a batch: the checker on each response, one padded reward-model pass over those that pass, and
    # the same scores as verify one by one (responses of different lengths share a padded forward)
    from envs import verify_all

    items = []
    for seed in range(6):
        p = env.generate(seed, seed % 3)
        ref = base.reference_response(p)
        items += [(env, p, ref), (env, p, ref + " " + "and so on " * (seed * 7)), (env, p, ""), (env, p, None)]
    calls = []
    many = rm.score_many
    rm.score_many = lambda pairs, **kw: calls.append(len(pairs)) or many(pairs, **kw)
    together = verify_all(items, workers=2)
    alone = [env.verify(p, r) for _, p, r in items]
    assert len(calls) == 1 and calls[0] == sum(s.correct for s in alone) >= 6
    assert [(s.correct, s.format_ok) for s in together] == [(s.correct, s.format_ok) for s in alone]
    assert [s.reward for s in together] == pytest.approx([s.reward for s in alone], abs=1e-5)
    assert [s.info.get("rm_score") for s in together] == pytest.approx([s.info.get("rm_score") for s in alone],
                                                                          abs=1e-4)


def test_a_checkpoint_holds_the_state_of_its_own_step(tmp_path, tiny_dense_dir, monkeypatch):
    """The run's state (difficulty peaks, ...) is taken when the checkpoint is, not when its background
    write gets to it: the steps after it change the state meanwhile."""
    import time

    import cascade.checkpoint as ckmod
    from cascade.checkpoint import Checkpointer, load_trainer_state
    from train.model.hf_io import load_pretrained

    real = ckmod.save_pretrained
    monkeypatch.setattr(ckmod, "save_pretrained", lambda *a, **k: time.sleep(0.5) or real(*a, **k))  # a big model
    ck = Checkpointer(tmp_path / "ck")
    state = {"step": 10, "difficulty_max": {"gym/catalan": 4}}
    ck.save(10, load_pretrained(tiny_dense_dir), tiny_dense_dir, {"rl": {}}, state)
    state["difficulty_max"]["gym/catalan"] = 5  # the next step, while the write goes on
    ck.wait()
    assert load_trainer_state(ck.latest())[1]["difficulty_max"] == {"gym/catalan": 4}


def test_a_background_write_that_the_machine_stops_is_a_run_failure():
    """A checkpoint write stopped by the disk (full, a permission) ends the run in one line with the resume hint
    (a RunFailure); a write that fails for a bug stays a RuntimeError with its traceback."""
    import errno

    from train.background import Behind
    from train.errors import RunFailure

    b = Behind("checkpoint write")
    b.start(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")), "full")
    with pytest.raises(RunFailure, match="checkpoint write failed: .*No space left on device"):
        b.wait()
    b.start(lambda: (_ for _ in ()).throw(KeyError("bug")), "bug")
    with pytest.raises(RuntimeError) as e:
        b.wait()
    assert not isinstance(e.value, RunFailure)


def test_a_reward_model_wrapped_environment_keeps_the_settings_of_the_one_it_wraps():
    """GatedRewardEnv answered the Environment defaults for what it did not forward: a wrapped environment
    without reference answers (rg/boxnet) counted as one with them (the stage's default SFT list took it and
    failed), a code environment got the \\boxed{} aggregation template and the default verify time limit."""
    from cascade.reward_model import GatedRewardEnv
    from envs.base import get_env

    for env_id in ("rg/boxnet", "code/solve", "ifeval"):
        base = get_env(env_id)
        env = GatedRewardEnv(base, rm=None)
        for name in ("no_reference_reason", "aggregation_template", "verify_time_limit", "instruction", "free_form"):
            assert getattr(env, name) == getattr(base, name), (env_id, name)
    assert GatedRewardEnv(get_env("rg/boxnet"), rm=None).no_reference_reason
    assert GatedRewardEnv(get_env("code/solve"), rm=None).aggregation_template != "math"


def test_a_reward_model_wrapped_environment_keeps_its_difficulty_cap():
    """GatedRewardEnv reads and lowers the wrapped environment's max_difficulty: a curriculum over it stops at
    ifeval's cap (it saw no cap and climbed to 40 on a policy solving everything), and a run-time cap reaches it."""
    import random

    from cascade.reward_model import GatedRewardEnv
    from envs.base import Score, get_env
    from envs.curriculum import Curriculum

    base = get_env("ifeval")
    cap = base.max_difficulty
    assert cap is not None
    for wrapped in (False, True):
        env = GatedRewardEnv(base, rm=None) if wrapped else base
        assert env.max_difficulty == cap
        c = Curriculum({"ifeval": 1.0}, controller="zaya", controller_kwargs={"start": 0},
                       environments={"ifeval": env} if wrapped else {})
        rng = random.Random(0)
        for _ in range(40):
            (e, p), = c.sample(rng, 1)
            c.update(e, p.difficulty, [Score(1.0, True, True)] * 8)  # a policy that solves everything
        assert c.difficulties()["ifeval"] == cap, (wrapped, c.difficulties())
    env = GatedRewardEnv(get_env("ifeval"), rm=None)
    env.max_difficulty = 3  # as envs/caps.py lowers it
    assert env.base.max_difficulty == 3


@pytest.mark.parametrize("damage", ["weights", "state", "trainer_state"])
def test_a_damaged_complete_checkpoint_resumes_from_the_one_before(tmp_path, tiny_dense_dir, damage):
    """A checkpoint marked complete whose files were damaged afterwards (a truncated weights file, an empty
    state.json, a truncated trainer_state.pt): the run resumed from nothing or stopped with a traceback; now
    the one before it is used and the damaged one is set aside, named in one line."""
    from cascade.checkpoint import Checkpointer
    from train.model.hf_io import load_pretrained

    ck = Checkpointer(tmp_path / "ck")
    model = load_pretrained(tiny_dense_dir)
    for step in (1, 2):
        ck.save(step, model, tiny_dense_dir, {"rl": {"step": step}}, {"step": step}, sync=True)
    newest = ck.latest()
    f = {"weights": "model.safetensors", "state": "state.json", "trainer_state": "trainer_state.pt"}[damage]
    size = (newest / f).stat().st_size
    with open(newest / f, "r+b") as fh:
        fh.truncate(0 if damage == "state" else size // 2)
    warned = []
    path, (tstate, state) = ck.latest_loadable(warned.append)
    assert path.name == "step-00000001" and state == {"step": 1} and tstate == {"rl": {"step": 1}}
    assert len(warned) == 1 and "step-00000002 is unreadable" in warned[0] and "\n" not in warned[0]
    assert (tmp_path / "ck" / "step-00000002.unreadable" / f).exists() and ck.latest() == path


def test_batched_reward_scores_equal_single_ones_when_the_models_pad_id_is_not_the_tokenizers(tmp_path,
                                                                                            tiny_dense_dir):
    """The model finds each sequence's last token by its config's pad id: a checkpoint whose config names another
    pad id than its tokenizer read the shorter sequence of a batch at a pad position (another score)."""
    from cascade.reward_model import RewardModel, build_tiny_reward_model

    rm = RewardModel(build_tiny_reward_model(tmp_path / "rm", tiny_dense_dir), max_len=64)
    pairs = [("Q", "a"), ("Write a long poem please", "a much longer answer " * 4)]
    rm.model.config.pad_token_id = rm.tok.convert_tokens_to_ids("<|im_start|>")
    assert rm.score_many(pairs) == pytest.approx([rm.score(p, r) for p, r in pairs], abs=1e-5)


def test_a_histogram_goes_to_tensorboard_bucket_by_bucket():
    """``version_lag_hist`` was logged to TensorBoard and W&B as its largest share (the rule for an RLVE window
    [lo, hi], whose upper end is the figure): a scalar per bucket now; a window keeps its upper end."""
    from cascade.records import _scalars

    got = _scalars({"version_lag_hist": [0.1, 0.6, 0.3], "window": [2, 5]}, "rl/")
    assert got == {"rl/version_lag_hist/0": 0.1, "rl/version_lag_hist/1": 0.6, "rl/version_lag_hist/2": 0.3,
                   "rl/window": 5.0}


def test_checkpoints_copy_a_sentencepiece_vocabulary(tmp_path):
    """A source tokenizer whose vocabulary is a SentencePiece ``tokenizer.model`` (Llama-2-era repos) lost it in every
    checkpoint and ``final/`` (only ``tokenizer_config.json`` was copied), which then loaded as a tokenizer that
    encodes every text to no tokens; the same for ``save_pretrained(tokenizer_dir=...)``."""
    import json

    from cascade.checkpoint import copy_tokenizer
    from train.model.hf_io import copy_tokenizer_files

    src, dst, other = tmp_path / "src", tmp_path / "dst", tmp_path / "other"
    for d in (src, dst, other):
        d.mkdir()
    (src / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece model")
    (src / "added_tokens.json").write_text(json.dumps({"<think>": 32000}))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (src / "generation_config.json").write_text("{}")
    copy_tokenizer(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["added_tokens.json", "tokenizer.model", "tokenizer_config.json"]
    assert (dst / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    assert copy_tokenizer_files(other, dst) == []
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        copy_tokenizer(other, dst)


def test_avg_at_k_keeps_prompts_of_exactly_the_cap_and_counts_each_skipped_problem():
    """A prompt of exactly max_prompt_tokens tokens is scored; ``skipped`` counts problems left out, not chunks."""
    from cascade.evaluation import avg_at_k
    from envs.base import get_env
    from train.engine.base import Completion
    from train.rl.trainer import RLConfig, SamplingConfig

    class CharTok:  # one token per character
        @staticmethod
        def encode(text, add_special_tokens=False, verbose=False):
            return [ord(c) for c in text]

    class Engine:
        def generate(self, prompts, params):
            return [Completion([1], "\\boxed{7}", [0.0], "stop", prompt_index=i)
                    for i in range(len(prompts)) for _ in range(params.n)]

    class RL:
        cfg = RLConfig(chat_template=False, sampling=SamplingConfig(max_new_tokens=4))
        tokenizer, engine, max_prompt_tokens = CharTok(), Engine(), 5

        @staticmethod
        def env_of(e):
            return get_env(e)

    # prompt lengths 5 (kept: exactly the cap), 6 (skipped) | 6, 6 (both skipped) | 4 (kept, answer 8: wrong)
    probs = [("toy/add", Problem(t, a, "toy/add")) for t, a in
             [("3+4=?", "7"), ("3+4=??", "7"), ("1+6=??", "7"), ("2+5=??", "7"), ("4+4=", "8")]]
    r = avg_at_k(RL, probs, 2, chunk=2)
    assert r["skipped"] == 3 and r["problems"] == {"toy": 2} and r["accuracy"] == pytest.approx(0.5)


# -- mutation-testing kills: the reward gate, trimming, avg@k ----------------------------------------------
def test_the_gate_is_a_sigmoid_of_the_scaled_score_and_keeps_the_checkers_verdict():
    import math

    from cascade.reward_model import GatedRewardEnv
    from envs.base import Environment, Problem, Score

    class Base(Environment):
        id = "b"

        def generate(self, seed, difficulty):
            return Problem("p", "a", "b", seed, difficulty, {})

        def check(self, problem, response):
            ok = response.startswith("ok")
            return Score(float(ok), ok, True, {"checked": response})

    class RM:
        raw = 0.0

        def score(self, p, r):
            return self.raw

        def score_many(self, pairs):
            return [self.raw] * len(pairs)

    rm = RM()
    env = GatedRewardEnv(Base(), rm, scale=2.0)
    p = env.generate(0, 0)
    for raw, want in ((1.0, 1 / (1 + math.exp(-2.0))), (-1.0, 1 / (1 + math.exp(2.0))), (0.0, 0.5)):
        rm.raw = raw
        for s in (env.verify(p, "ok"), *env.verify_many([(p, "ok")])):
            assert s.correct and s.reward == pytest.approx(want)
            assert s.info["rm_score"] == raw and s.info["checked"] == "ok"  # the checker's info kept
    for s in (env.verify(p, "no"), *env.verify_many([(p, "no")])):
        # instructions not followed: reward 0, yet the response was well formed (format_ok is the checker's)
        assert not s.correct and s.reward == 0.0 and s.format_ok and s.info["checked"] == "no"
        assert "rm_score" not in s.info


def test_a_chat_context_that_fits_keeps_its_earlier_thinking():
    """Earlier turns lose their think blocks only when the conversation does not fit."""
    from cascade.trim import trim_pairs

    tok = _CharTok()
    ctx = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>abc</think>A1"},
           {"role": "user", "content": "q2"}]

    def plen(p):
        return sum(len(m["content"]) for m in p)

    resp = "<think>xy</think>A2"
    (kept,), dropped = trim_pairs(tok, [(ctx, resp)], plen(ctx) + len(resp), plen)
    assert dropped == 0 and kept == (ctx, resp)
    (kept,), _ = trim_pairs(tok, [(ctx, resp)], plen(ctx) + len(resp) - 1, plen)  # one over: earlier thinking goes
    assert kept[0][1]["content"] == "A1" and kept[1] == resp


def test_multi_turn_trimming_counts_the_last_turns_role_tokens_and_refuses_what_still_does_not_fit():
    from cascade.trim import trim_messages

    tok = _CharTok()

    def render(ms):  # each message: a 5-character header plus its content
        return "".join(f"<{m['role'][:3]}>" + m["content"] for m in ms)

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>" + "t" * 20 + "</think>ANS"}]
    full = len(render(msgs))
    out = trim_messages(tok, msgs, full - 5, render)  # 5 characters of thinking go, the header counted
    assert out[1]["content"] == "<think>" + "t" * 15 + "</think>ANS" and len(render(out)) == full - 5
    assert trim_messages(tok, msgs, len(render(msgs[:1])) + 5 + len("<think></think>ANS") - 1, render) is None


def test_a_response_of_exactly_the_budget_is_kept_whole_even_without_thinking():
    from cascade.trim import trim_response

    assert trim_response(_CharTok(), "just the answer", 15) == "just the answer"
    assert trim_response(_CharTok(), "just the answer", 14) is None


def test_sampled_rollouts_keep_prompts_of_exactly_max_prompt_tokens(tok):
    from cascade.aggregation import sample_rollouts
    from train.engine.base import Completion, SamplingParams
    from train.rl.trainer import encode_prompt

    class Engine:
        def generate(self, prompts, params):
            return [Completion([1], "x", [0.0], "stop", prompt_index=i) for i in range(len(prompts)) for _ in range(params.n)]

    picks = [("toy/add", Problem(t, "2", "toy/add", k, 0, {})) for k, t in enumerate(["What is 1+1?", "What is 1+1 again, please?"])]
    cap = len(encode_prompt(tok, picks[0][1].prompt, False, None))
    assert len(encode_prompt(tok, picks[1][1].prompt, False, None)) > cap
    out = sample_rollouts(Engine(), tok, picks, 2, SamplingParams(n=1), chat=False, max_prompt_tokens=cap)
    assert [(p.prompt, len(cs)) for _, p, cs in out] == [("What is 1+1?", 2)]
    assert len(sample_rollouts(Engine(), tok, picks, 1, SamplingParams(n=1), chat=False)) == 2  # 0: no bound


def test_background_writes_run_one_at_a_time_and_each_failure_is_raised_once():
    """Behind.start waits for the write before it (a checkpoint is not written over one still being written); a
    failure is raised by one wait and then forgotten; daemon=False (the checkpointer's) makes a non-daemon thread."""
    import threading

    from train.background import Behind

    order, gate, first_done, daemons = [], threading.Event(), threading.Event(), []

    def first():
        daemons.append(threading.current_thread().daemon)
        gate.wait(5)
        order.append("first")
        first_done.set()

    b = Behind("checkpoint write", daemon=False)
    b.start(first, "first")
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    b.start(lambda: order.append("second"), "second")
    b.wait()
    first_done.wait(5)
    timer.join()
    assert order == ["first", "second"] and daemons == [False]
    b.start(lambda: 1 / 0, "bug")
    with pytest.raises(RuntimeError, match="checkpoint write failed: division by zero"):
        b.wait()
    b.wait()  # raised once
    b.start(lambda: order.append("third"), "third")
    b.wait()
    assert order[-1] == "third"
    daemons.clear()
    d = Behind("weights")
    d.start(lambda: daemons.append(threading.current_thread().daemon), "w")
    d.wait()
    assert daemons == [True]
