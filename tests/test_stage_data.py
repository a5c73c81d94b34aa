"""A stage's data as the ZAYA1 report describes it: source mixes, phases switching at the configured
step, the response-cap schedule, pass-rate re-filtering on each stage's incoming checkpoint, bounded
aggregation prompts (self, expert, PaCoRe), aggregation SFT examples from a teacher, and avg@k per
environment family."""
import dataclasses
import random
from pathlib import Path

import pytest

from cascade.aggregation import AggregationMixer, aggregation_sft_pairs, compact_message
from cascade.config import Phase, PoolFilter, RunConfig, SFTStage, Source, StageConfig
from envs.base import Problem, get_env
from train.engine.base import Completion
from train.rl.trainer import RLConfig, SamplingConfig, encode_prompt


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def n(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


# -- mixes, phases, response caps -----------------------------------------------------------------------
def test_sources_split_each_share_over_their_environments():
    from cascade.stagedata import mix_of

    mix = mix_of({}, {"puzzles": Source(54.4, ["gym/sudoku", "gym/n_queens"]), "math": Source(31.2, ["math/arith"]),
                      "logic": Source(14.4, ["gym/knights_knaves"])})
    assert mix == pytest.approx({"gym/sudoku": 27.2, "gym/n_queens": 27.2, "math/arith": 31.2,
                                 "gym/knights_knaves": 14.4})
    with pytest.raises(ValueError, match="both set"):
        StageConfig(envs={"toy/add": 1}, sources={"a": Source(1, ["toy/add"])})


def test_the_recipe_config_names_the_warmup_sources_and_the_two_math_phases():
    from cascade.config import load_run_config
    from cascade.stagedata import max_new_tokens_at, phase_starts, stage_mixes

    cfg, _ = load_run_config({})
    w, m = cfg.stages["warmup"], cfg.stages["math"]
    assert {k: s.weight for k, s in w.sources.items()} == {"puzzles": 54.4, "competition_math": 31.2,
                                                           "logic_puzzles": 14.4}
    mix = stage_mixes(w)[0]
    shares = {k: sum(mix[e] for e in s.envs) / sum(mix.values()) for k, s in w.sources.items()}
    assert shares == pytest.approx({"puzzles": 0.544, "competition_math": 0.312, "logic_puzzles": 0.144})
    assert [max_new_tokens_at(w, i, 81920) for i in (0, 115, 116, 231)] == [65536, 65536, 81920, 81920]
    assert [p.steps for p in m.phases] == [384, 464] and phase_starts(m) == [0, 384]
    assert m.aggregation.max_prompt_tokens == 20480 and m.pool.max_pass_rate == 0.75
    # a shortened run: boundaries in proportion, every phase that fits at least one step, in order
    assert [phase_starts(dataclasses.replace(m, steps=n)) for n in (1, 2, 3, 10)] == [[0, 1], [0, 1], [0, 1], [0, 5]]
    assert phase_starts(dataclasses.replace(m, steps=2, phases=m.phases * 2)) == [0, 1, 2, 3]


def test_an_exact_environment_id_sets_its_weight_whatever_the_key_order():
    from cascade.stagedata import mix_of

    a, b = mix_of({"gym/*": 1.0, "gym/sudoku": 3.0}, {}), mix_of({"gym/sudoku": 3.0, "gym/*": 1.0}, {})
    assert a == b and a["gym/sudoku"] == 3.0 and a["gym/catalan"] == 1.0
    assert mix_of({"gym/cat*": 1.0, "gym/catalan": 2.0, "gym/ca*": 0.5}, {})["gym/catalan"] == 2.0


class _RL:
    """What apply_phase touches of an RL trainer: its config."""

    def __init__(self):
        self.cfg = RLConfig(sampling=SamplingConfig(max_new_tokens=40))


def test_held_out_problems_follow_the_stage_mix(tok):
    """Held-out problems are shared out as the stage trains: a phased mix's union weights (6/8 + 6/9 for
    toy/add), equal weights in turn by name, every share within one problem of its proportion."""
    from cascade.stage import StageRunner
    from cascade.stagedata import union_mix

    s = StageConfig(steps=4, controller="fixed", eval_problems=64,
                    phases=[Phase(2, {"toy/add": 6, "math/arith": 1, "toy/max": 1}),
                            Phase(2, {"toy/add": 6, "math/arith": 1, "toy/max": 1, "gym/catalan": 1})])
    stage = StageRunner("math", 2, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
    cur = stage.build_curriculum(tok)
    held = stage.eval_problems(cur, {e: 0 for e in cur.envs})
    counts = {e: sum(x == e for x, _ in held) for e in cur.envs}
    mix = union_mix(stage.mixes)
    for e, w in mix.items():
        assert abs(counts[e] - 64 * w / sum(mix.values())) < 1, (counts, mix)
    assert counts["toy/add"] == 45 and counts["gym/catalan"] == 4
    assert held == stage.eval_problems(cur, {e: 0 for e in cur.envs})  # the same problems before and after
    even = StageConfig(steps=1, controller="fixed", eval_problems=6, envs={"toy/max": 1, "toy/add": 1, "math/arith": 1})
    runner = StageRunner("rlve", 1, even, RunConfig(order=[]), Path("/nonexistent"), None, None)
    picks = [e for e, _ in runner.eval_problems(runner.build_curriculum(tok), {})]
    assert picks == ["math/arith", "toy/add", "toy/max"] * 2


def test_training_draws_avoid_the_held_out_problems(tok):
    """Held-out problems of procedural environments were generated like training ones: in the tiny profile 61 of
    the warm-up's 64 held-out prompts were among its RL draws and all 64 among its SFT examples (toy/add: every
    one). Training draws (the curriculum's, SFT's reference answers) now draw again a held-out prompt; a level
    with fewer problems than that (gym/catalan has 3 at level 0) keeps it and counts it."""
    from cascade.stage import StageRunner
    from envs.hub import normalize_text
    from train.sft import reference_pairs

    s = StageConfig(steps=4, controller="fixed", eval_problems=64, envs={"toy/add": 3, "gym/catalan": 1})
    stage = StageRunner("math", 2, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
    cur = stage.build_curriculum(tok)
    held = stage.eval_problems(cur, {e: 0 for e in cur.envs})
    cur.exclude = stage.held_out(cur, held)
    assert len(cur.exclude) >= 30  # (duplicates among them: toy/add has 100 problems at level 0)
    drawn = cur.sample(random.Random(0), 2000)
    inside = [e for e, p in drawn if normalize_text(p.prompt) in cur.exclude]
    assert inside and set(inside) == {"gym/catalan"} and cur.heldout_overlap == len(inside)
    assert cur.heldout_redraws > 100
    pairs = reference_pairs(["toy/add"], 2000, seed=1, difficulties=(0,), exclude=cur.exclude)
    assert not [pr for pr, _ in pairs if normalize_text(pr) in cur.exclude]
    assert [pr for pr, _ in reference_pairs(["toy/add"], 2000, seed=1, difficulties=(0,)) if normalize_text(pr) in
            cur.exclude]  # (without the exclusion: held-out prompts among them)
    state = cur.state_dict()
    again = stage.build_curriculum(tok)
    again.load_state_dict(state)
    assert (again.heldout_redraws, again.heldout_overlap) == (cur.heldout_redraws, cur.heldout_overlap)


def test_an_rlve_window_counts_groups_of_the_stages_size_and_its_peak_is_its_high_end(tok):
    """RLVE's window moves after tau_prompts groups at its upper level: groups of the stage's ``rl.group_size``
    (it counted groups of 16 whatever the stage's size); the level a stage records as reached is the window's
    high end (it recorded the low end: 0 for a window [0, 3])."""
    from cascade.stage import StageRunner

    def tau_num(**kw):
        s = StageConfig(steps=1, controller="rlve", envs={"toy/add": 1.0}, rl=RLConfig(group_size=8), **kw)
        cur = StageRunner("rlve", 1, s, RunConfig(order=[]), Path("/nonexistent"), None, None).build_curriculum(tok)
        return cur.controllers["toy/add"].tau_num

    assert tau_num() == 8 * 8
    assert tau_num(controller_kwargs={"tau_prompts": 2}) == 2 * 8
    assert tau_num(controller_kwargs={"group_size": 4}) == 8 * 4 and tau_num(controller_kwargs={"tau_num": 5}) == 5
    state = {"difficulty_max": {"toy/add": 0, "toy/max": 1}}
    StageRunner.track_difficulty(state, {"toy/add": [0, 3], "toy/max": 2})
    StageRunner.track_difficulty(state, {"toy/add": [1, 2], "toy/max": 1})
    assert state["difficulty_max"] == {"toy/add": 3, "toy/max": 2}
    # a zaya controller calibrating its start reads 0 until calibration ends: the stage's start is the level it
    # picked (calibrated to 3, up to 4, back to 3 counted as a rise from 0); an RLVE window rose when its high
    # end did ([0, 0] -> [0, 3] counted as no rise: its low end stayed)
    import types

    from cascade.run import difficulty_rise

    calibrating = types.SimpleNamespace(calibrating=True)
    cur = types.SimpleNamespace(controllers={"toy/max": calibrating})
    state = {"difficulty_max": {"toy/max": 0}, "difficulty_start": {"toy/max": 0}, "calibrating": ["toy/max"]}
    StageRunner.track_difficulty(state, {"toy/max": 2}, cur)
    calibrating.calibrating = False
    for now in (3, 4, 3):
        StageRunner.track_difficulty(state, {"toy/max": now}, cur)
    assert state["difficulty_start"] == {"toy/max": 3} and state["calibrating"] == []
    rows, rose = difficulty_rise({**state, "difficulty": {"toy/max": 3}})
    assert rows == {"toy/max": (3, 3, 4)} and rose == 0
    rows, rose = difficulty_rise({"difficulty_start": {"w": 0}, "difficulty": {"w": [0, 3]}, "difficulty_max": {"w": 3}})
    assert rows == {"w": (0, 3, 3)} and rose == 1


def test_the_pool_expert_and_teacher_problems_are_separate_draws_in_every_stage(tok):
    """In the first stage (index 0) the three were drawn with one seed: the teacher's aggregation SFT examples
    were made from the very problems the pass-rate pool then measured the fine-tuned policy on."""
    from cascade.stage import StageRunner

    s = StageConfig(steps=1, controller="fixed", envs={"toy/add": 1.0, "toy/max": 1.0})
    for index in (0, 1):
        stage = StageRunner("warmup", index, s, RunConfig(order=[], seed=3), Path("/nonexistent"), None, None)
        cur = stage.build_curriculum(tok)
        draws = {name: [(e, p.seed) for e, p in cur.sample(stage.stream(name), 16)]
                 for name in ("pool", "expert", "aggregation_sft")}
        assert len({tuple(d) for d in draws.values()}) == 3
        assert draws["pool"] == [(e, p.seed) for e, p in cur.sample(random.Random(3 + 31 * index), 16)]


def test_phases_switch_the_mix_and_aggregation_share_at_the_configured_step(tok):
    from cascade.pool import ProblemPool
    from cascade.stage import StageRunner

    s = StageConfig(steps=5, controller="fixed", sft=SFTStage(steps=2),
                    phases=[Phase(3, {"toy/add": 1.0}), Phase(2, {"toy/max": 1.0, "math/arith": 1.0}, aggregation=0.5)],
                    max_new_tokens_schedule=[[0.0, 24], [0.6, 40]], rl=RLConfig(sampling=SamplingConfig(max_new_tokens=40)))
    s.aggregation.fraction = 0.1
    stage = StageRunner("math", 2, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
    cur = stage.build_curriculum(tok)
    assert set(cur.weights) == {"toy/add", "toy/max", "math/arith"}  # every phase's environments, one curriculum
    mixer = stage.make_mixer(tok, cur)
    rl = _RL()
    rng = random.Random(0)
    seen, logged = [], []
    for rl_step in range(s.steps):
        logged.append(stage.apply_phase(rl, cur, mixer, rl_step))
        seen.append({e for e, _ in cur.sample(rng, 40)})
        assert mixer.fraction == (0.1 if rl_step < 3 else 0.5)
    assert [x["mix_phase"] for x in logged] == [0, 0, 0, 1, 1]
    assert seen[:3] == [{"toy/add"}] * 3 and seen[3:] == [{"toy/max", "math/arith"}] * 2
    assert [x["max_new_tokens"] for x in logged] == [24, 24, 24, 40, 40]  # 3/5 = 0.6 of the RL steps: the cap lifts
    # a pass-rate pool follows the phase's mix too
    pool = ProblemPool(cur, [("toy/add", get_env("toy/add").generate(i, 0)) for i in range(3)] +
                       [("toy/max", get_env("toy/max").generate(i, 0)) for i in range(3)])
    stage.apply_phase(rl, pool, mixer, 0)
    assert {e for e, _ in pool.sample(rng, 30)} == {"toy/add"}
    stage.apply_phase(rl, pool, mixer, 4)
    assert {e for e, _ in pool.sample(rng, 30)} == {"toy/max"}
    # a shortened run scales the switch: 2 RL steps switch after the first
    s.steps = 2
    assert [stage.apply_phase(rl, cur, mixer, i)["mix_phase"] for i in range(2)] == [0, 1]


# -- pass-rate re-filtering on the incoming checkpoint ----------------------------------------------------
def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class _Recs:
    def __init__(self):
        self.logged = []

    def log(self, stage, phase, step, m):
        self.logged.append((stage, phase, step, m))

    def begin(self, stage, step):
        pass


def test_pool_is_refiltered_at_each_stage_on_the_checkpoint_it_starts_from(tiny_dense_dir, tmp_path, monkeypatch):
    import cascade.pool
    from cascade.stage import StageRunner
    from train.model.hf_io import load_pretrained
    from train.optim import OptimConfig

    measured = []
    real = cascade.pool.filter_by_pass_rate

    def spy(rl, picks, *a, **kw):
        measured.append((_checksum(rl.engine.model), _checksum(rl.policy), len(picks)))
        return real(rl, picks, *a, **kw)

    monkeypatch.setattr(cascade.pool, "filter_by_pass_rate", spy)
    rl_cfg = RLConfig(group_size=2, prompts_per_step=2, sampling=SamplingConfig(max_new_tokens=6), dynamic_sampling=False,
                      length_reward=False, optim=OptimConfig(lr=1e-4))
    recs = _Recs()
    rcfg = RunConfig(order=[])
    start = Path(tiny_dense_dir)
    finals = []
    for i, name in enumerate(["first", "second"]):
        s = StageConfig(steps=1, envs={"toy/add": 1.0}, controller="fixed", rl=rl_cfg, eval_problems=2,
                        pool=PoolFilter(size=4, samples=2, max_pass_rate=1.0),
                        sft=SFTStage(steps=1 if i == 0 else 0, examples=8, batch_size=4, micro_batch_size=4,
                                     max_len=64, difficulties=[0], optim=OptimConfig(lr=3e-2)))
        start = StageRunner(name, i, s, rcfg, tmp_path, recs, None).run(start)
        finals.append(start)
    assert len(measured) == 2 and all(x[2] == 4 for x in measured)  # one filter per stage, at its RL start
    incoming = _checksum(load_pretrained(finals[0]))
    assert measured[1][0] == pytest.approx(incoming, rel=1e-9) == measured[1][1]  # stage 2: on stage 1's final/
    assert incoming != pytest.approx(_checksum(load_pretrained(tiny_dense_dir)), rel=1e-9)
    pools = [(st, m) for st, ph, _, m in recs.logged if ph == "pool"]
    assert [st for st, _ in pools] == ["first", "second"] and all(m["pool_size"] == 4 for _, m in pools)


# -- aggregation prompts: the cap, expert tails, PaCoRe messages -----------------------------------------
class _C:
    def __init__(self, tok, text, finish="stop"):
        self.text, self.finish_reason = text, finish
        self.token_ids = tok.encode(text, add_special_tokens=False)


class _G:
    def __init__(self, env_id, problem, comps):
        class _R:
            def __init__(self, c):
                self.completion = c

        self.env_id, self.problem, self.rollouts = env_id, problem, [_R(c) for c in comps]


def _traces(tok, k, words=40):
    return [_C(tok, "<think>" + " ".join(f"idea{i} step{j}" for j in range(words)) + f"</think> so \\boxed{{{40 + i}}}")
            for i in range(k)]


def test_aggregation_prompts_over_the_cap_are_trimmed_keeping_each_tail_end_or_dropped(tok):
    def plen(text):
        return len(encode_prompt(tok, text, True, None))

    p = Problem("What is 6*7?", "42", "toy/add", 1, 0, {})
    free = AggregationMixer(tok, 1.0, 2, 64, seed=0, prompt_len=plen)
    free.remember([_G("toy/add", p, _traces(tok, 3))])
    full = free.mix([("toy/add", p)])[0][1]
    cap = plen(full.prompt) - 40
    mixer = AggregationMixer(tok, 1.0, 2, 64, seed=0, max_prompt_tokens=cap, prompt_len=plen)
    mixer.remember([_G("toy/add", p, _traces(tok, 3))])
    made = [mixer.mix([("toy/add", p)])[0][1] for _ in range(6)]
    for agg in made:
        assert agg.meta["aggregation"] and plen(agg.prompt) <= cap
        assert agg.prompt.startswith("What is 6*7?")
        assert agg.prompt.count("</think> so \\boxed{") == 2  # both tails keep their ends, answers included
    assert mixer.trimmed == 6 and mixer.dropped == 0
    tiny = AggregationMixer(tok, 1.0, 2, 64, seed=0, max_prompt_tokens=plen(p.prompt) + 5, prompt_len=plen)
    tiny.remember([_G("toy/add", p, _traces(tok, 3))])
    assert tiny.mix([("toy/add", p)]) == [("toy/add", p)] and tiny.dropped == 1 and tiny.made == 0


def test_trimming_keeps_the_longest_common_tail_length_that_fits(tok):
    """Three short tails and one long one, 50 tokens over the cap: the long tail loses about those 50 tokens
    (was cut to room / C, leaving hundreds of tokens of the budget unused)."""
    def plen(text):
        return len(encode_prompt(tok, text, True, None))

    p = Problem("What is 2+2?", "4", "toy/add", 0, 0, {})
    long = " ".join(f"step {i} ok" for i in range(200)) + " so \\boxed{4}"
    tails = ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", long]
    full = plen(AggregationMixer(tok, 1.0, 4, 10**6, "math")._render("toy/add", p, tails, False))
    m = AggregationMixer(tok, 1.0, 4, 10**6, "math", max_prompt_tokens=full - 50, prompt_len=plen)
    agg = m.build("toy/add", p, tails)
    assert agg is not None and m.trimmed == 1
    assert full - 50 - 8 <= plen(agg.prompt) <= full - 50
    assert all(t in agg.prompt for t in tails[:3]) and "so \\boxed{4}" in agg.prompt


def test_tails_drop_any_end_id_and_expert_tails_are_decoded_by_the_experts_tokenizer(tok, tmp_path):
    """A rollout that ended on another of the engine's end ids (Qwen3 has two) leaves it out of the tail; a
    cut inside a multi-byte character drops the remnant; an expert whose tokenizer differs from the policy's
    has its tails decoded by its own."""
    from train.tokenizer import build_tokenizer

    end = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else 0
    assert end != tok.eos_token_id
    m = AggregationMixer(tok, 1.0, 1, 32, "math", stop_ids=[end])
    ids = tok.encode("The answer is \\boxed{7}.", add_special_tokens=False)
    assert m.tail_text(ids + [end]) == m.tail_text(ids + [tok.eos_token_id]) == "The answer is \\boxed{7}."
    text = "so x \u2264 5 and y \u2265 3, hence the answer is \\boxed{8}"
    ids = tok.encode(text, add_special_tokens=False)
    for tau in range(2, len(ids)):
        m.tau = tau
        t = m.tail_text(ids)
        assert "\ufffd" not in t and text.endswith(t)
    exp = build_tokenizer(tmp_path / "exptok", vocab_size=700, seed=1)
    trace = "<think>\nadd them\n</think>\nThe answer is \\boxed{42}."
    comps = [_C(exp, trace), _C(exp, trace)]
    for c in comps:
        c.token_ids = c.token_ids + [exp.eos_token_id]
    m = AggregationMixer(tok, 1.0, 2, 64, "math")
    m.remember_expert("toy/add", Problem("What is 40+2?", "42", "toy/add", 1, 0, {}), comps, exp)
    (_, _, tails, messages), = m.expert.values()
    assert tails == [trace, trace]


def test_expert_and_pacore_prompts_take_their_sources_and_keep_the_bounds(tok):
    def plen(text):
        return len(encode_prompt(tok, text, True, None))

    p = Problem("What is 6*7?", "42", "toy/add", 1, 0, {})
    q = Problem("What is 2+2?", "4", "toy/add", 2, 0, {})
    own = [_C(tok, "<think>mine " * 30 + "</think> mine \\boxed{1}")] * 2
    expert = [_C(tok, "<think>" + "expert thought " * 30 + "</think> The answer is \\boxed{42}."),
              _C(tok, "<think>" + "expert unfinished " * 40, finish="length")]
    cap = 260  # the RSA prompts need trimming to fit, the PaCoRe ones (answers, not tails) do not
    mixer = AggregationMixer(tok, 1.0, 2, 24, seed=0, max_prompt_tokens=cap, prompt_len=plen,
                             expert_fraction=1.0, pacore_fraction=0.5)
    mixer.remember([_G("toy/add", q, own)])
    mixer.remember_expert("toy/add", p, expert)
    out = [mixer.mix([("toy/add", q)])[0][1] for _ in range(40)]
    assert all(a.meta["tail_source"] == "expert" and a.prompt.startswith("What is 6*7?") for a in out)
    assert all(plen(a.prompt) <= cap for a in out)
    pacore = [a for a in out if a.meta["kind"] == "pacore"]
    rsa = [a for a in out if a.meta["kind"] == "rsa"]
    assert pacore and rsa and mixer.made_pacore == len(pacore) and mixer.made_expert == 40
    assert mixer.trimmed == len(rsa) and mixer.dropped == 0
    # PaCoRe messages: the finished rollout's answer (not its reasoning), the unfinished one's tail
    msg_done = compact_message(expert[0].text, "stop", "TAIL", lambda t: tok.encode(t, add_special_tokens=False),
                               tok.decode, 24)
    assert msg_done == "The answer is \\boxed{42}."
    for a in pacore:
        assert "The answer is \\boxed{42}." in a.prompt and "expert thought" not in a.prompt
        assert "expert unfinished" in a.prompt and "Continue from these messages" in a.prompt
    for a in rsa:  # RSA tails: the last 24 tokens of each trace, cut from the front to fit
        assert "</think> The answer is \\boxed{42}." in a.prompt
    # self-aggregation when no expert is configured
    own_only = AggregationMixer(tok, 1.0, 2, 24, seed=0, max_prompt_tokens=cap, prompt_len=plen, pacore_fraction=0.0)
    own_only.remember([_G("toy/add", q, own)])
    a = own_only.mix([("toy/add", p)])[0][1]
    assert a.meta["tail_source"] == "self" and a.prompt.startswith("What is 2+2?") and "mine" in a.prompt
    st = mixer.state_dict()
    again = AggregationMixer(tok, 1.0, 2, 24, seed=1, max_prompt_tokens=cap, prompt_len=plen, expert_fraction=1.0,
                             pacore_fraction=0.5)
    again.load_state_dict(st)
    assert list(again.expert) == list(mixer.expert) and again.made_pacore == mixer.made_pacore
    assert again.mix([("toy/add", q)])[0][1].prompt == mixer.mix([("toy/add", q)])[0][1].prompt


class _Teacher:
    """A scripted teacher: a plain prompt gets traces ending in the right or a wrong answer; an
    aggregation prompt gets the right answer when it shows a right tail, a wrong one otherwise."""

    def __init__(self, tok, work: int = 30):
        self.tok, self.calls, self.work = tok, [], work

    def generate(self, prompts, params, **kw):
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            self.calls.append(("agg" if "candidate solutions" in text else "solve", params.n))
            a, b = [int(x) for x in text.split("What is ")[1].split("?")[0].split("+")]
            for j in range(params.n):
                if "candidate solutions" in text:
                    ans = a + b if f"boxed{{{a + b}}}" in text else -1
                    body = f"<think>comparing the candidates</think> \\boxed{{{ans}}}"
                else:
                    body = "<think>" + "work " * self.work + f"</think> \\boxed{{{a + b if j % 4 == 0 else a + b + 1}}}"
                ct = self.tok.encode(body, add_special_tokens=False)
                out.append(Completion(ct, body, [0.0] * len(ct), "stop", prompt_index=i))
        return out


def test_aggregation_sft_examples_are_teacher_answers_to_reshuffled_tails_within_bounds(tok):
    from cascade.trim import trim_pairs

    env = get_env("toy/add")
    picks = [("toy/add", Problem(f"What is {a}+{a + 1}?", str(2 * a + 1), "toy/add", a, 0, {})) for a in range(1, 5)]

    def plen(text):
        return len(encode_prompt(tok, text, True, None))

    # room for two tails of 9 tokens: the 12-token tails are cut from the front, their answers kept
    cap = plen(AggregationMixer(tok, 1.0, 2, 12)._render("toy/add", picks[0][1], ["", ""], False)) + 18
    teacher = _Teacher(tok)
    params = SamplingConfig(max_new_tokens=64).params(1, 0)
    pairs, stats = aggregation_sft_pairs(teacher, tok, picks, lambda e: env, params, samples=4, shuffles=3, tails=2,
                                         tail_tokens=12, max_prompt_tokens=cap, prompt_len=plen, seed=0)
    assert ("solve", 4) in teacher.calls and ("agg", 1) in teacher.calls
    assert stats["aggregation_sft_problems"] == 4 and stats["aggregation_sft_prompts"] == 12
    assert stats["aggregation_sft_trimmed"] == 12 and stats["aggregation_sft_dropped"] == 0
    # every prompt shows 2 tails (with their answers); only tails with a right one let the teacher answer right
    assert 0 < stats["aggregation_sft_correct"] == len(pairs) < 12
    # in a seeded random order: a caller keeping the first k keeps them across the problems (they came
    # problem by problem, so the first few came from the first problems only)
    order = [int(p.split("What is ")[1].split("+")[0]) for p, _ in pairs]
    assert order != sorted(order)
    for prompt, resp in pairs:
        assert plen(prompt) <= cap and prompt.count("--- Candidate") == 2
        a = int(prompt.split("What is ")[1].split("+")[0])
        assert resp.endswith(f"\\boxed{{{2 * a + 1}}}") and f"boxed{{{2 * a + 1}}}" in prompt.split("Candidate 1")[1]
    kept, dropped = trim_pairs(tok, pairs, cap + 12, plen)  # the SFT budget, answer-preserving
    assert len(kept) + dropped == len(pairs)
    assert all(plen(p) + n(tok, r) <= cap + 12 and r.endswith(f"\\boxed{{{2 * int(p.split('What is ')[1].split('+')[0]) + 1}}}")
               for p, r in kept)


# -- avg@k per environment family ---------------------------------------------------------------------------
class _Scripted:
    """Answers problem i's j-th sample right when ``right[i][j]``."""

    def __init__(self, tok, refs, right):
        self.tok, self.refs, self.right, self.params = tok, refs, right, []

    def generate(self, prompts, params, **kw):
        self.params.append(params)
        out = []
        for i, ids in enumerate(prompts):
            key = next(k for k in self.refs if k in self.tok.decode(ids))
            for j in range(params.n):
                text = self.refs[key] if self.right[key][j] else "\\boxed{wrong}"
                out.append(Completion([1], text, [0.0], "stop", prompt_index=i))
        return out


def test_avg_at_k_per_family_matches_hand_computed_values(tok):
    from cascade.evaluation import avg_at_k, family

    add, gcd = get_env("toy/add"), get_env("gym/gcd_lcm")
    probs = [("toy/add", add.generate(1, 0)), ("toy/add", add.generate(2, 0)), ("gym/gcd_lcm", gcd.generate(3, 0))]
    envs = {"toy/add": add, "gym/gcd_lcm": gcd}
    refs = {p.prompt.split("\n")[0]: envs[e].reference_response(p) for e, p in probs}
    keys = list(refs)
    right = {keys[0]: [1, 0, 1, 0], keys[1]: [1, 1, 1, 1], keys[2]: [0, 0, 0, 1]}

    class RL:
        cfg = RLConfig(sampling=SamplingConfig(max_new_tokens=8, temperature=0.7))
        tokenizer = tok
        max_prompt_tokens = 10_000

        @staticmethod
        def env_of(e):
            return envs[e]

    RL.engine = _Scripted(tok, refs, right)
    r = avg_at_k(RL, probs, 4, seed=5, chunk=2)
    # toy: problem 1 solves 2 of 4, problem 2 4 of 4 -> (0.5 + 1) / 2; gym: 1 of 4; overall (0.5 + 1 + 0.25) / 3
    assert r["families"] == pytest.approx({"toy": 0.75, "gym": 0.25})
    assert r["accuracy"] == pytest.approx(1.75 / 3) and r["k"] == 4
    assert r["problems"] == {"gym": 1, "toy": 2} and r["skipped"] == 0
    # each chunk of 2 problems samples its own streams (seed + the chunk's first index): they shared one
    assert [p.n for p in RL.engine.params] == [4, 4] and all(p.temperature == 0.7 for p in RL.engine.params)
    assert [p.seed for p in RL.engine.params] == [5, 7]
    g = avg_at_k(RL, probs, 0)  # k = 0: one greedy answer, the first scripted sample
    assert g["families"] == pytest.approx({"toy": 1.0, "gym": 0.0}) and RL.engine.params[-1].temperature == 0.0
    assert family("ifeval") == "ifeval" and family("rlve/Sorting") == "rlve"
    # a chat template that opens the thinking in the prompt (DeepSeek-R1's, Qwen3-Thinking-2507's): the scripted
    # answers never close it, so none is an answer; the tiny template (thinking not opened) and plain prompts: ""
    import copy

    from train.tokenizer import open_think_of

    opened = copy.deepcopy(tok)
    opened.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    assert open_think_of(opened) == "<think>\n" and open_think_of(tok) == "" and open_think_of(opened, chat=False) == ""
    thinking_off = copy.deepcopy(tok)  # the template's own closed block (enable_thinking=false) leaves nothing open
    thinking_off.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n\n</think>\n\n{% endif %}"
    assert open_think_of(thinking_off) == ""
    RL.tokenizer = opened
    assert avg_at_k(RL, probs, 4, seed=5, chunk=2)["accuracy"] == 0.0


def test_a_stage_builds_teacher_sft_examples_and_expert_aggregation_from_named_checkpoints(tiny_dense_dir, tmp_path):
    """The config keys end to end: sft.aggregation.teacher (an HF directory) and aggregation.expert (an
    earlier stage of the run, by name), with avg@k per family in the records and run_state.json."""
    import json

    from cascade.stage import StageRunner
    from train.optim import OptimConfig

    rl_cfg = RLConfig(group_size=2, prompts_per_step=2, sampling=SamplingConfig(max_new_tokens=6), dynamic_sampling=False,
                      length_reward=False, optim=OptimConfig(lr=1e-4))
    recs = _Recs()
    rcfg = RunConfig(order=[])
    first = StageConfig(steps=1, envs={"toy/add": 1.0}, controller="fixed", rl=rl_cfg, eval_problems=2, eval_k=2,
                        sft=SFTStage(steps=1, examples=8, batch_size=4, micro_batch_size=4, max_len=400, difficulties=[0]))
    first.sft.aggregation.teacher, first.sft.aggregation.problems = str(tiny_dense_dir), 3
    first.sft.aggregation.samples, first.sft.aggregation.tails, first.sft.aggregation.fraction = 2, 2, 0.5
    final = StageRunner("first", 0, first, rcfg, tmp_path, recs, None).run(Path(tiny_dense_dir))
    sft_data = [m for st, ph, _, m in recs.logged if ph == "sft_aggregation" and "aggregation_sft_problems" in m]
    assert sft_data and sft_data[0]["aggregation_sft_problems"] == 3 and sft_data[0]["aggregation_sft_prompts"] == 6
    second = StageConfig(steps=2, envs={"toy/add": 1.0, "gym/gcd_lcm": 1.0}, controller="fixed", rl=rl_cfg,
                         eval_problems=4, eval_k=2)
    a = second.aggregation
    a.fraction, a.tails, a.tail_tokens, a.expert, a.expert_problems, a.expert_samples = 1.0, 2, 4, "first", 3, 2
    a.expert_fraction, a.pacore_fraction = 1.0, 0.5
    out = StageRunner("second", 1, second, rcfg, tmp_path, recs, None).run(final)
    expert = [m for st, ph, _, m in recs.logged if ph == "expert"]
    assert expert == [{"expert_problems": 3, "expert_pool": 3}]
    rl = [m for st, ph, _, m in recs.logged if st == "second" and ph == "rl"]
    assert rl[-1]["aggregation_expert"] == rl[-1]["aggregation_prompts"] > 0  # every prompt from expert tails
    st = json.loads((out / "run_state.json").read_text())
    assert st["eval_k"] == 2 and set(st["accuracy_after_by_family"]) == {"toy", "gym"}
    ev = [m for s_, ph, step, m in recs.logged if s_ == "second" and ph == "eval" and step > 0][0]
    assert ev["accuracy_after_by_family"] == st["accuracy_after_by_family"]


def test_a_mix_given_as_an_override_replaces_the_configured_phases():
    from cascade.config import load_run_config

    cfg, _ = load_run_config({"stage": "math", "envs": {"math/arith": 1}})
    assert cfg.stages["math"].phases == [] and cfg.stages["math"].envs == {"math/arith": 1.0}
    cfg, _ = load_run_config({"stages.math.steps": 10})
    assert [p.steps for p in cfg.stages["math"].phases] == [384, 464]


def test_a_phase_with_no_positive_weight_is_a_config_error_before_any_stage(tmp_path):
    """It passed the checks (the stage's union of phases has a positive sum) and failed when the phase began,
    hundreds of steps in, with an IndexError from the sampler."""
    from cascade.run import main
    from cascade.stagedata import set_mix, stage_mixes, union_mix
    from envs.curriculum import Curriculum
    from train.dataclass_config import ConfigError

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"stages\.math\.phases\[1\]: its weights must be finite and >= 0 with a positive sum"):
        main(["stage=math", "profile=tiny", f"out={out}",
              "stages.math.phases=[{steps: 2, envs: {toy/add: 1}}, {steps: 2, envs: {toy/max: 0}}]"])
    assert not out.exists()
    s = StageConfig(steps=4, phases=[Phase(2, {"toy/add": 1.0}), Phase(2, {"toy/max": 1.0})])
    cur = Curriculum(union_mix(stage_mixes(s)))
    with pytest.raises(ValueError, match="positive sum"):
        set_mix(cur, {"toy/max": 0.0})


def test_a_mapping_override_merges_into_its_section_and_a_sources_mix_replaces(tmp_path):
    """``rl.optim='{lr: 1e-6}'`` on the command line sets the learning rate and keeps the rest of the configured
    optimizer (it put a default one in its place: AdamW for Muon); ``sources:`` in a config file replaces the
    stage's mix of sources whole, and its phases, as on the command line (it was merged into them)."""
    from cascade.config import load_run_config

    base, _ = load_run_config({"stage": "math"})
    cfg, _ = load_run_config({"stage": "math", "rl.optim": {"lr": 1e-6}})
    want = dataclasses.replace(base.stages["math"].rl.optim, lr=1e-6)
    assert cfg.stages["math"].rl.optim == want and want.name == "muon"
    f = tmp_path / "mine.yaml"
    f.write_text("stages:\n  math:\n    sources: {mine: {weight: 1, envs: [toy/add]}}\n")
    from_file, _ = load_run_config({"config": str(f)})
    on_line, _ = load_run_config({"stages.math.sources": {"mine": {"weight": 1, "envs": ["toy/add"]}}})
    for c in (from_file, on_line):
        assert list(c.stages["math"].sources) == ["mine"] and c.stages["math"].phases == []


def test_sft_env_weights_draw_examples_in_proportion():
    """`sft.envs` as a mapping {env: weight}: reference answers drawn in those proportions (0: never)."""
    from train.sft import reference_pairs

    pairs = reference_pairs(["toy/max", "toy/add", "gym/catalan"], 400, seed=3, weights=[3.0, 1.0, 0.0], think=False)
    maxes = sum(p.startswith("max ") for p, _ in pairs)
    adds = sum("+" in p.split("\n")[0] for p, _ in pairs)
    assert maxes + adds == 400 and 260 <= maxes <= 340  # 300 expected
    with pytest.raises(ValueError, match="one per environment"):
        reference_pairs(["toy/max"], 1, weights=[1.0, 2.0])


def test_toy_max_ladder_never_gets_easier():
    """toy/max: digits up to difficulty 3, then wider numbers every 4 levels, so 'the top value' stops paying."""
    from envs.base import get_env

    env = get_env("toy/max")
    for d, hi in ((0, 9), (3, 9), (4, 99), (7, 99), (8, 999)):
        xs = [int(x) for s in range(50) for x in env.generate(s, d).prompt.split("\n")[0].split()[1:]]
        assert max(xs) <= hi and len(xs) == 50 * (2 + d)
        if hi > 9:
            assert max(xs) > 9
    nines = sum(env.generate(s, 21).answer == 9 for s in range(200))
    assert nines == 0  # digits only, 9 would win ~91% at d = 21


def test_toy_add_ladder_grows_in_small_steps():
    """toy/add: operand bounds 9, 19, 49, 99, 199, ... (three levels per digit), each level's sums reaching above
    the previous level's bound."""
    from envs.base import get_env

    env = get_env("toy/add")
    bounds = [9, 19, 49, 99, 199, 499, 999]
    for d, hi in enumerate(bounds):
        ops = [[int(x) for x in env.generate(s, d).prompt.split("=")[0].split("+")] for s in range(200)]
        assert max(max(o) for o in ops) <= hi
        if d:
            assert max(max(o) for o in ops) > bounds[d - 1]
        assert all(env.verify(env.generate(s, d), f"\\boxed{{{sum(o)}}}").correct for s, o in enumerate(ops[:20]))


def test_sft_envs_patterns_and_settings_of_sft_only_environments():
    """``sft.envs`` patterns passed the config check (expanded) and then failed in the SFT step (the raw pattern
    given to get_env, after the before-score); ``env_kwargs`` of an environment named only in ``sft.envs`` (which
    the SFT reference answers read) was refused as "not in the stage's mix"."""
    from cascade.stage import sft_envs
    from cascade.stagedata import check_env_kwargs
    from train.dataclass_config import ConfigError
    from train.sft import reference_pairs

    got = sft_envs(["toy/*"])
    assert {"toy/max", "toy/add"} <= set(got) and set(got.values()) == {1.0}
    assert sft_envs({"toy/*": 1.0, "toy/max": 3.0})["toy/max"] == 3.0 and sft_envs([]) == {}
    pairs = reference_pairs(list(got), 8, seed=0, weights=list(got.values()), think=False)
    assert len(pairs) == 8
    s = StageConfig(envs={"toy/max": 1}, sft=SFTStage(envs=["toy/add"]), env_kwargs={"toy/add": {}})
    check_env_kwargs(s, "warmup")  # an SFT-only environment's settings
    with pytest.raises(ConfigError, match="gym/catalan is not in the stage's mix or sft.envs"):
        check_env_kwargs(StageConfig(envs={"toy/max": 1}, env_kwargs={"gym/catalan": {}}), "warmup")


def test_a_moved_run_directory_resumes_its_stages(tmp_path):
    """The check that a stage continues what it started from compares a start inside the run directory within it:
    a run directory moved elsewhere is the same run."""
    from cascade.stage import StageRunner
    from train.dataclass_config import ConfigError

    runner = StageRunner("rlve", 1, StageConfig(envs={"toy/max": 1}), RunConfig(order=[]), tmp_path / "new", None)
    runner.check_same_start("/somewhere/old/stages/0-warmup/final", tmp_path / "new" / "stages" / "0-warmup" / "final")
    runner.check_same_start("/somewhere/old/init-model", tmp_path / "new" / "init-model")
    with pytest.raises(ConfigError, match="continue a stage started from"):
        runner.check_same_start("/somewhere/old/init-model", tmp_path / "new" / "stages" / "0-warmup" / "final")
    with pytest.raises(ConfigError):
        runner.check_same_start("/models/a", tmp_path / "b")


def test_aggregation_sft_prompts_leave_room_in_sft_max_len_for_the_answer(tok):
    """The stage built aggregation SFT prompts up to RL's aggregation.max_prompt_tokens (20,480 by default), longer
    than sft.max_len (8,192): the trim then dropped every example the teacher had answered. The stage's cap keeps a
    prompt to half of sft.max_len (its tails cut from the front) and the examples survive the trim."""
    from cascade.config import Aggregation, SFTStage, StageConfig
    from cascade.stage import StageRunner
    from cascade.trim import trim_pairs
    from train.sft import prompt_ids

    env = get_env("toy/add")
    picks = [("toy/add", Problem(f"What is {a}+{a + 1}?", str(2 * a + 1), "toy/add", a, 0, {})) for a in range(1, 5)]

    def plen(text):
        return len(encode_prompt(tok, text, True, None))

    base = plen(AggregationMixer(tok, 1.0, 4, 192)._render("toy/add", picks[0][1], [""] * 4, False))
    scfg = StageConfig(sft=SFTStage(max_len=2 * base + 60), aggregation=Aggregation(max_prompt_tokens=20480, tails=4))
    params = SamplingConfig(max_new_tokens=64).params(1, 0)
    got = {}
    for name, cap in (("rl", scfg.aggregation.max_prompt_tokens), ("stage", StageRunner.aggregation_sft_prompt_cap(scfg, 4096))):
        pairs, _ = aggregation_sft_pairs(_Teacher(tok, work=200), tok, picks, lambda e: env, params, samples=4,
                                         shuffles=3, tails=4, tail_tokens=192, max_prompt_tokens=cap, prompt_len=plen, seed=0)
        kept, dropped = trim_pairs(tok, pairs, scfg.sft.max_len - 1, lambda p: len(prompt_ids(tok, p, True, None)))
        got[name] = (len(pairs), len(kept))
    assert got["rl"][0] > 0 and got["rl"][1] == 0  # (the regime: every example answered, then dropped)
    assert got["stage"][0] > 0 and got["stage"][1] == got["stage"][0], got


# -- the pass-rate pool (mutation-testing kills) ---------------------------------------------------------
def test_the_pass_rate_filter_keeps_both_bounds_and_leaves_the_curriculum_alone():
    from types import SimpleNamespace as NS

    from cascade.pool import filter_by_pass_rate

    picks = [("toy/add", Problem(f"q{i}", "0", "toy/add", i, 0, {})) for i in range(5)]
    wins = {"q0": 0, "q1": 1, "q2": 2, "q3": 3, "q4": 4}  # of 4 samples: rates 0, .25, .5, .75, 1

    class Trainer:
        calls = []

        def generate_groups(self, part, group_size, update_curriculum=True):
            self.calls.append(update_curriculum)
            return [NS(env_id=e, problem=p, rollouts=[NS(score=NS(correct=j < wins[p.prompt]))
                                                      for j in range(group_size)]) for e, p in part]

    t = Trainer()
    kept, rates = filter_by_pass_rate(t, picks, 4, max_pass_rate=0.75, min_pass_rate=0.25, chunk=2)
    assert rates == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [p.prompt for _, p in kept] == ["q1", "q2", "q3"]  # both bounds inclusive
    assert t.calls == [False, False, False]  # measuring moves no difficulty level


def test_a_problem_pool_draws_by_the_mix_uniformly_within_an_environment_and_resumes():
    from cascade.pool import ProblemPool

    class Cur:
        envs, controllers = {}, {}
        weights = {"toy/add": 3.0, "toy/max": 1.0, "math/arith": 0.0}

        def state_dict(self):
            return {}

        def load_state_dict(self, st):
            pass

    probs = ([("toy/add", Problem(f"a{i}", "0", "toy/add", i, 0, {})) for i in range(3)]
             + [("toy/max", Problem(f"m{i}", "0", "toy/max", i, 0, {})) for i in range(2)]
             + [("math/arith", Problem("z", "0", "math/arith", 0, 0, {}))])
    pool = ProblemPool(Cur(), probs)
    draws = pool.sample(random.Random(0), 4000)
    envs = [e for e, _ in draws]
    assert "math/arith" not in envs  # a weight of 0: never drawn
    assert 0.72 <= envs.count("toy/add") / 4000 <= 0.78  # 3 : 1
    counts = {p.prompt: sum(q.prompt == p.prompt for _, q in draws) for _, p in probs[:5]}
    assert all(850 <= counts[f"a{i}"] <= 1150 for i in range(3)) and all(400 <= counts[f"m{i}"] <= 600 for i in range(2))
    st = pool.state_dict()
    other = ProblemPool(Cur(), [probs[0]])
    other.load_state_dict(st)
    assert other.problems == probs
    with pytest.raises(ValueError, match="kept no problems"):
        ProblemPool(Cur(), [])
    # none of the mix's environments (with a positive weight) in the pool: a problem uniformly
    only = ProblemPool(Cur(), [probs[5], ("toy/mul", Problem("w", "0", "toy/mul", 0, 0, {}))])
    assert {p.prompt for _, p in only.sample(random.Random(1), 60)} == {"z", "w"}


def test_aggregation_sft_responses_include_the_thinking_a_teachers_template_opens(tok):
    """Under a chat template that opens the thinking in the prompt, the teacher's text starts inside it: each SFT
    response is that text behind the opening, as it was verified."""
    import copy

    opened = copy.deepcopy(tok)
    opened.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"

    class Teacher(_Teacher):
        def generate(self, prompts, params, **kw):
            out = super().generate(prompts, params, **kw)
            for c in out:  # the opening is the template's: the teacher writes from inside the thinking
                c.text = c.text.removeprefix("<think>")
            return out

    env = get_env("toy/add")
    picks = [("toy/add", Problem(f"What is {a}+{a + 1}?", str(2 * a + 1), "toy/add", a, 0, {})) for a in range(1, 4)]
    params = SamplingConfig(max_new_tokens=64).params(1, 0)
    pairs, stats = aggregation_sft_pairs(Teacher(opened, work=3), opened, picks, lambda e: env, params, samples=4,
                                         shuffles=2, tails=2, tail_tokens=64, seed=0)
    assert pairs and stats["aggregation_sft_correct"] == len(pairs)
    assert all(r.startswith("<think>\ncomparing the candidates</think>") for _, r in pairs)


# -- small pieces of the stage runner, checked directly ----------------------------------------------------
def test_patterns_matching_one_environment_add_their_weights_and_an_empty_mix_is_refused():
    """``expand_envs``: two patterns that both match an environment give it the sum of their weights; a stage
    with no environment at all is a config error that says so."""
    from cascade.stage import expand_envs
    from cascade.stagedata import mix_of
    from train.dataclass_config import ConfigError

    assert mix_of({"toy/*": 1.0, "toy/a*": 2.0}, {}) == {"toy/add": 3.0, "toy/max": 1.0}
    with pytest.raises(ConfigError, match="at least one environment"):
        expand_envs({})


def test_a_difficulty_level_reads_numbers_windows_and_nothing():
    from cascade.stage import level

    assert level(4) == 4 and level(4.0) == 4 and level(2.9) == 2
    assert level([1, 3]) == 1 and level([1, 3], high=True) == 3 and level((2, 5), high=True) == 5
    assert level([]) == 0 and level(None) == 0 and level("x") == 0


def test_a_stage_runs_its_sft_steps_and_then_its_rl_steps():
    from cascade.stage import StageRunner

    s = StageConfig(steps=3, envs={"toy/max": 1}, sft=SFTStage(steps=2))
    assert StageRunner("warmup", 0, s, RunConfig(order=[]), Path("/nonexistent"), None).total_steps() == 5


def test_a_checkpoint_resumes_only_on_the_side_its_optimizer_state_lives():
    """check_same_trainer: a checkpoint taken in this process resumes in this process, one of the trainer ranks
    on trainer ranks; each the other way round is refused in one line that says how to resume."""
    from cascade.config import Trainer
    from cascade.stage import StageRunner

    def runner(nproc):
        return StageRunner("rlve", 1, StageConfig(envs={"toy/max": 1}), RunConfig(order=[], trainer=Trainer(nproc=nproc)),
                           Path("/nonexistent"), None)

    latest = Path("/x/step-00000004")
    for nproc, ranks in ((1, False), (2, True), (1, None), (2, None)):  # (None: a checkpoint older than the key)
        runner(nproc).check_same_trainer({"trainer_ranks": ranks}, latest)
    with pytest.raises(ValueError, match="step-00000004 was taken by trainer ranks.*overwrite=true"):
        runner(1).check_same_trainer({"trainer_ranks": True}, latest)
    with pytest.raises(ValueError, match="step-00000004 was taken by this process.*trainer.nproc=1"):
        runner(2).check_same_trainer({"trainer_ranks": False}, latest)


def test_a_rollout_ends_on_the_engines_the_policys_and_the_samplings_stop_ids():
    """``end_ids``: what aggregation tails leave out: the engine's EOS ids, the policy config's (its
    generation config's too) and ``sampling.stop_token_ids``; no policy, none of its ids."""
    import types

    from cascade.stage import end_ids

    engine = types.SimpleNamespace(eos_token_ids=[5])
    policy = types.SimpleNamespace(config=types.SimpleNamespace(eos_token_id=2, generation_config={"eos_token_id": [3]}))
    sampling = SamplingConfig(stop_token_ids=[7, 9])
    assert end_ids(engine, sampling, policy) == {2, 3, 5, 7, 9}
    assert end_ids(engine, sampling) == {5, 7, 9}
    assert end_ids(object(), SamplingConfig(), policy) == {2, 3}


def test_a_response_cap_schedule_keeps_the_length_rewards_l_max_the_stages_cap():
    """With ``max_new_tokens_schedule`` the length reward's l_max stays a constant: the stage's
    ``rl.sampling.max_new_tokens`` when it was left at 0, the configured one otherwise (not the step's cap)."""
    from cascade.stage import StageRunner
    from train.rl.shaping import LengthRewardConfig

    s = StageConfig(steps=4, controller="fixed", envs={"toy/add": 1.0}, max_new_tokens_schedule=[[0.0, 16], [0.5, 32]],
                    rl=RLConfig(sampling=SamplingConfig(max_new_tokens=40)))
    stage = StageRunner("math", 2, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
    for l_max, want in ((0, 40), (100, 100)):
        rl = _RL()
        rl.cfg.length_cfg = LengthRewardConfig(l_max=l_max)
        caps = [stage.apply_phase(rl, None, None, i)["max_new_tokens"] for i in range(4)]
        assert caps == [16, 16, 32, 32] and rl.cfg.length_cfg.l_max == want


def test_a_phases_aggregation_share_makes_a_mixer_and_an_expert_share_needs_an_expert(tok):
    """``make_mixer``: no mixer without aggregation prompts in any phase; a phase's ``aggregation`` share makes one
    where the stage's own share is 0; ``aggregation.expert_fraction`` counts only with an ``aggregation.expert``."""
    from cascade.config import Aggregation
    from cascade.stage import StageRunner

    def mixer(**kw):
        s = StageConfig(steps=4, controller="fixed", **({"envs": {"toy/add": 1.0}} if "phases" not in kw else {}), **kw)
        stage = StageRunner("math", 2, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
        return stage.make_mixer(tok, stage.build_curriculum(tok))

    assert mixer(aggregation=Aggregation(fraction=0.0)) is None
    assert mixer(aggregation=Aggregation(fraction=0.0), phases=[Phase(2, {"toy/add": 1.0}),
                                                                 Phase(2, {"toy/add": 1.0}, aggregation=0.5)]) is not None
    assert mixer(aggregation=Aggregation(fraction=0.5, expert_fraction=0.3)).expert_fraction == 0.0
    assert mixer(aggregation=Aggregation(fraction=0.5, expert_fraction=0.3, expert="warmup")).expert_fraction == 0.3


def test_a_checkpoint_named_by_stage_is_that_stages_finished_final_only(tmp_path, tiny_dense_dir):
    """``model_ref``: a stage's name is its ``final/`` once complete; an unfinished one is no checkpoint (a half
    written final/ is refused, not loaded); a local directory with a config.json is taken as it is."""
    from cascade.stage import StageRunner
    from train.dataclass_config import ConfigError

    runner = StageRunner("math", 2, StageConfig(envs={"toy/max": 1}), RunConfig(order=[]), tmp_path, None)
    final = tmp_path / "stages" / "0-warmup" / "final"
    final.mkdir(parents=True)
    with pytest.raises(ConfigError, match="'warmup' is neither a finished stage of this run nor a checkpoint"):
        runner.model_ref("warmup")
    (final / "COMPLETE").write_text("ok\n")
    assert runner.model_ref("warmup") == final
    assert runner.model_ref(str(tiny_dense_dir)) == Path(tiny_dense_dir)


def test_an_aggregation_sft_prompt_leaves_room_for_the_answer_and_its_end_token():
    """The cap: sft.max_len less min(the teacher's max_tokens + 1 end token, half of sft.max_len), and never
    above RL's aggregation.max_prompt_tokens."""
    from cascade.config import Aggregation
    from cascade.stage import StageRunner

    s = StageConfig(sft=SFTStage(max_len=1000), aggregation=Aggregation(max_prompt_tokens=20480))
    assert StageRunner.aggregation_sft_prompt_cap(s, 100) == 1000 - 101
    assert StageRunner.aggregation_sft_prompt_cap(s, 499) == 500 and StageRunner.aggregation_sft_prompt_cap(s, 498) == 501
    assert StageRunner.aggregation_sft_prompt_cap(s, 4096) == 500
    s.aggregation.max_prompt_tokens = 300
    assert StageRunner.aggregation_sft_prompt_cap(s, 100) == 300


def test_teacher_examples_make_their_share_of_the_sft_data_with_the_teachers_budget(tok, monkeypatch):
    """``aggregation_sft``: as many teacher examples as make ``sft.aggregation.fraction`` of all the SFT examples
    beside ``n_other`` others (0.25 beside 30: 10 of 40), all with fraction 1; the teacher answers with
    ``sft.aggregation.max_new_tokens`` when set, else with the stage's ``rl.sampling.max_new_tokens``."""
    import contextlib

    import cascade.aggregation
    from cascade.config import AggregationSFT
    from cascade.stage import StageRunner

    seen = []

    def pairs(engine, ttok, picks, env_of, params, **kw):
        seen.append(params.max_tokens)
        return [(f"q{i}", f"a{i}") for i in range(100)], {"made": 100}

    monkeypatch.setattr(cascade.aggregation, "aggregation_sft_pairs", pairs)

    def made(fraction, max_new_tokens=0, n_other=30):
        s = StageConfig(steps=1, controller="fixed", envs={"toy/add": 1.0},
                        rl=RLConfig(sampling=SamplingConfig(max_new_tokens=40)),
                        sft=SFTStage(steps=1, aggregation=AggregationSFT(teacher="t", fraction=fraction, problems=2,
                                                                         max_new_tokens=max_new_tokens)))
        recs = _Recs()
        stage = StageRunner("warmup", 0, s, RunConfig(order=[]), Path("/nonexistent"), recs, None)
        monkeypatch.setattr(stage, "other_engine", lambda ref, rl=None: contextlib.nullcontext((None, tok)))
        got = stage.aggregation_sft(tok, stage.build_curriculum(tok), n_other)
        assert recs.logged[-1][3]["aggregation_sft_examples"] == len(got)
        return len(got)

    assert made(0.25) == 10 and made(0.5) == 30 and made(0.5, n_other=200) == 100 and made(1.0) == 100
    assert made(0.1, max_new_tokens=64, n_other=9) == 1
    assert seen == [40, 40, 40, 40, 64]


def test_a_stages_start_level_is_a_windows_low_end():
    import types

    from cascade.stage import StageRunner

    cur = types.SimpleNamespace(difficulties=lambda: {"rlve/a": [1, 3], "toy/max": 2, "zaya/b": 0})
    assert StageRunner.start_levels(cur) == {"rlve/a": 1, "toy/max": 2, "zaya/b": 0}


def test_held_out_problems_are_at_eval_difficulty_or_the_start_levels_and_each_stage_draws_its_own(tok):
    from cascade.stage import StageRunner

    def held(index, **kw):
        s = StageConfig(steps=1, controller="fixed", eval_problems=8, envs={"toy/add": 1.0, "toy/max": 1.0}, **kw)
        stage = StageRunner("math", index, s, RunConfig(order=[]), Path("/nonexistent"), None, None)
        return stage.eval_problems(stage.build_curriculum(tok), {"toy/add": 2, "toy/max": 1})

    assert {(e, p.difficulty) for e, p in held(2)} == {("toy/add", 2), ("toy/max", 1)}
    assert {p.difficulty for _, p in held(2, eval_difficulty=3)} == {3}
    seeds = {i: [p.seed for _, p in held(i)] for i in (1, 2)}
    assert seeds[2] == [p.seed for _, p in held(2)] and all(s >= 10**9 for s in seeds[2])
    assert not set(seeds[1]) & set(seeds[2])  # another stage: other problems


def test_a_stages_updates_count_its_sft_steps_and_its_rl_steps():
    """``updates_done``: the trainer ranks number a stage's updates over SFT and RL together."""
    import types

    from cascade.stage import StageRunner

    rl, sft = types.SimpleNamespace(step_idx=3), types.SimpleNamespace(step_idx=2)
    assert StageRunner.updates_done(rl, sft) == 5 and StageRunner.updates_done(rl, None) == 3


def test_sft_reference_answers_come_from_the_named_environments_with_their_weights(tok, monkeypatch):
    """``sft_examples`` without sft.data: reference answers of ``sft.envs`` (a mapping: drawn by its weights; a
    list: uniformly), else of the stage's environments that have them."""
    import train.sft
    from cascade.stage import StageRunner

    class Drawn(Exception):
        pass

    def reference_pairs(env_ids, n, seed=0, weights=None, **kw):
        raise Drawn(env_ids, n, weights)

    monkeypatch.setattr(train.sft, "reference_pairs", reference_pairs)

    def drawn(sft_envs):
        s = StageConfig(steps=1, controller="fixed", envs={"toy/add": 1.0, "toy/max": 1.0},
                        sft=SFTStage(steps=1, envs=sft_envs, examples=12))
        stage = StageRunner("warmup", 0, s, RunConfig(order=[]), Path("/nonexistent"), _Recs(), None)
        with pytest.raises(Drawn) as e:
            stage.sft_examples(None, tok, stage.build_curriculum(tok))
        return e.value.args

    assert drawn({"toy/max": 3.0, "toy/add": 1.0}) == (["toy/max", "toy/add"], 12, [3.0, 1.0])
    assert drawn(["toy/max"]) == (["toy/max"], 12, None)
    assert drawn([]) == (["toy/add", "toy/max"], 12, None)
