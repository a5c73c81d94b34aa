"""Markovian RSA: prompt structure and bounds, seeds, token accounting, the OpenAI-compatible path
(server on 127.0.0.1, with injected 500s), variants, metrics, CLI errors and resume."""
from __future__ import annotations

import json
import random
import socket
import threading

import pytest
import torch

from train.engine import SamplingParams, TorchEngine
from train.engine.base import Completion
from ttc.backends import EngineBackend, HFTokenizerSide, OpenAIBackend
from ttc.rsa import (MarkovianRSA, RSAConfig, derive_seed, exact_grader, extract_answer, majority_vote, math_grader,
                     pass_at_k, problem_seed, run_rsa)
from ttc.serve import Handler, serve_in_thread
from ttc.templates import MATH, PromptBuilder, load_template

PROBLEM = "Let x be the sum of 17 and 25. What is x?"
SMALL = dict(population=4, aggregate=2, rounds=2, budget=14, tail=5, final_budget=5, temperature=1.0, seed=7)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def engine(tiny_dense_dir):
    return TorchEngine.from_pretrained(tiny_dense_dir)


@pytest.fixture(scope="module")
def run(engine):
    """One RSA run through the engine (module-scoped: several tests inspect it)."""
    before = (engine.stats.generated_tokens, engine.stats.prefill_tokens)
    res = run_rsa(EngineBackend(engine), PROBLEM, RSAConfig(**SMALL), gold="42")
    after = (engine.stats.generated_tokens, engine.stats.prefill_tokens)
    return res, (after[0] - before[0], after[1] - before[1])


def _trace(c, eos):
    ids = list(c.token_ids)
    return ids[:-1] if c.finish_reason == "stop" and ids and ids[-1] in eos else ids


def _find(hay: list[int], needle: list[int], start: int = 0) -> int:
    for i in range(start, len(hay) - len(needle) + 1):
        if hay[i:i + len(needle)] == needle:
            return i
    return -1


def test_aggregation_prompts_hold_problem_and_C_tails_of_previous_round(run, engine):
    res, _ = run
    tok, cfg = engine.tokenizer, res.config
    eos = set(engine.eos_token_ids) | {tok.eos_token_id}
    q = tok.encode(PROBLEM, add_special_tokens=False)
    agg = [p for p in res.prompts if p.stage == "aggregate"]
    assert len(agg) == cfg.rounds * cfg.population
    pre, post = tok.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                        add_generation_prompt=True).split("@@")
    overheads = set()
    for rec in agg:
        prev = res.rounds[rec.round - 1]
        assert len(rec.parents) == cfg.aggregate == len(set(rec.parents))
        assert all(0 <= j < cfg.population for j in rec.parents)
        # each forwarded piece is the last tau tokens of that parent's trace in the previous round
        assert rec.forwarded == [_trace(prev[j], eos)[-cfg.tail:] for j in rec.parents]
        assert all(len(t) <= cfg.tail for t in rec.forwarded)
        # the prompt holds the problem, then the tails in order, verbatim
        pos = _find(rec.prompt_ids, q)
        assert pos >= 0
        for t in rec.forwarded:
            pos = _find(rec.prompt_ids, t, pos + 1)
            assert pos >= 0
        # the text is the template filled in, inside the chat template
        blocks = "".join(MATH.candidate.format(index=k + 1, tail=tok.decode(t)) for k, t in enumerate(rec.forwarded))
        body = MATH.aggregate.format(problem=PROBLEM, candidates=blocks, count=cfg.aggregate)
        assert tok.decode(rec.prompt_ids) == pre + body + post
        overheads.add(len(rec.prompt_ids) - len(q) - sum(map(len, rec.forwarded)))
        assert len(rec.prompt_ids) <= len(q) + cfg.aggregate * cfg.tail + max(overheads)
    # the template costs the same number of tokens in every prompt: the bound |q| + C*tau + |template|
    assert len(overheads) == 1
    empty = tok.encode(pre + MATH.aggregate.format(problem="", count=cfg.aggregate, candidates="".join(
        MATH.candidate.format(index=k + 1, tail="") for k in range(cfg.aggregate))) + post, add_special_tokens=False)
    assert overheads.pop() == len(empty)  # each run of text between the tails is encoded as one string
    # candidates record their parents; parent draws differ between candidates
    assert [c.parents for c in res.rounds[1]] == [r.parents for r in agg if r.round == 1]
    assert len({tuple(r.parents) for r in agg}) > 1


def test_round0_is_parallel_sampling_with_the_same_seed(engine):
    cfg = RSAConfig(**{**SMALL, "rounds": 0, "final_budget": 0})
    res = run_rsa(EngineBackend(engine), PROBLEM, cfg, gold="42")
    tok = engine.tokenizer
    solve = MATH.solve.format(problem=PROBLEM)
    ref_prompt = tok.apply_chat_template([{"role": "user", "content": solve}], tokenize=False,
                                         add_generation_prompt=True)
    assert [p.stage for p in res.prompts] == ["solve"]
    assert tok.decode(res.prompts[0].prompt_ids) == ref_prompt
    assert res.prompts[0].seed == derive_seed(cfg.seed, 0, problem_seed(PROBLEM))  # the problem's own seed
    ref = engine.generate([res.prompts[0].prompt_ids],
                          SamplingParams(n=4, temperature=1.0, max_tokens=cfg.budget, seed=res.prompts[0].seed))
    assert [c.token_ids for c in res.rounds[0]] == [c.token_ids for c in ref]
    assert len(res.rounds) == 1 and res.metrics["round_accuracy"] == [0.0]


def test_token_accounting_is_exact(run):
    res, (eng_gen, eng_prefill) = run
    m = res.metrics
    assert m["prefill_tokens"] == sum(len(p.prompt_ids) for p in res.prompts) == eng_prefill
    assert m["generated_tokens"] == eng_gen
    per_round = [sum(len(c.token_ids) for c in rnd) for rnd in res.rounds]
    assert [r["generated"] for r in m["round_tokens"]] == per_round
    assert m["generated_tokens"] == sum(per_round) + m["final_answer_tokens"]["generated"]
    finals = [p for p in res.prompts if p.stage == "final"]
    cut = [c for c in res.final if c.finish_reason == "length"]
    assert len(finals) == len(cut) and m["final_answer_tokens"]["prefill"] == sum(len(p.prompt_ids) for p in finals)
    for p, c in zip(finals, cut):  # the final-answer prompt continues the cut trace
        assert p.prompt_ids[:len(c.prompt_ids) + len(c.token_ids)] == c.prompt_ids + c.token_ids
    assert m["requests"] == len(res.prompts) == 1 + res.config.rounds * res.config.population + len(finals)
    assert len(m["answers"]) == res.config.population and m["wall_s"] > 0


class FlakyHandler(Handler):
    """Answers 500 to some /v1/completions requests before serving them."""

    fail_at = {2, 3, 6}
    lock = threading.Lock()
    seen = 0
    failed = 0

    def completions(self, body):
        with FlakyHandler.lock:
            FlakyHandler.seen += 1
            fail = FlakyHandler.seen in FlakyHandler.fail_at
            FlakyHandler.failed += fail
        if fail:
            raise RuntimeError("injected failure")
        return super().completions(body)


def test_server_run_equals_engine_run_and_retries_500s(run, tiny_dense_dir):
    res, _ = run
    srv, url = serve_in_thread(TorchEngine.from_pretrained(tiny_dense_dir), model_name="tiny", handler=FlakyHandler,
                               batch_window_s=0.05)
    try:
        be = OpenAIBackend(url, model="tiny", tokenizer=None, concurrency=4, backoff=0.01)  # tokens via /tokenize
        via = run_rsa(be, PROBLEM, RSAConfig(**SMALL), gold="42")
    finally:
        srv.shutdown()
        srv.server_close()
    assert FlakyHandler.failed == 3 and be.retried == 3
    assert srv.batcher.batches < len(via.prompts)  # concurrent requests were batched (same samples as alone)
    assert [(p.stage, p.round, p.index, p.prompt_ids, p.parents, p.seed, p.n) for p in via.prompts] == \
        [(p.stage, p.round, p.index, p.prompt_ids, p.parents, p.seed, p.n) for p in res.prompts]
    assert [[c.token_ids for c in r] for r in via.rounds] == [[c.token_ids for c in r] for r in res.rounds]
    same = lambda m: {k: v for k, v in m.items() if k not in ("wall_s", "usage")}  # noqa: E731
    assert same(via.metrics) == same(res.metrics)
    # the server's usage counts agree with ours
    m = via.metrics
    assert m["usage"] == {"requests": m["requests"], "prompt_tokens": m["prefill_tokens"],
                          "completion_tokens": m["generated_tokens"]}


# -- variants, with a scripted backend (no model) ------------------------------------------------


class ScriptedBackend(HFTokenizerSide):
    """Deterministic fake: each completion is '<think> words </think> \\boxed{A}' with A drawn from
    ``answers`` by the request seed; some stop (EOS) and some are cut at max_tokens."""

    def __init__(self, tokenizer, answers=("1", "2", "2"), in_order=False):
        super().__init__(tokenizer)
        self.answers = answers
        self.in_order = in_order  # sample j of a prompt answers answers[j] instead of a seeded draw
        self.calls = []

    def generate(self, prompts, params, seeds=None):
        self.calls.append((prompts, params, seeds))
        out = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                rng = random.Random(derive_seed(seeds[i], j))
                words = [rng.choice(["sum", "check", "graph", "list"]) for _ in range(rng.randint(1, 9))]
                text = "<think>\n" + " ".join(words)
                answer = self.answers[j] if self.in_order else rng.choice(self.answers)
                text += f"\n</think>\n\nThe answer is \\boxed{{{answer}}}."
                ids = self.encode(text) + [self.tokenizer.eos_token_id]
                fin = "stop"
                if len(ids) > params.max_tokens:
                    ids, fin = ids[:params.max_tokens], "length"
                body = ids[:-1] if fin == "stop" else ids
                out.append(Completion(ids, self.decode(body), [0.0] * len(ids), fin, i, len(p), list(p)))
        return out


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def test_pacore_forwards_post_think_answers_and_delethink_continues_own_chain(tok):
    be = ScriptedBackend(tok)
    cfg = RSAConfig(population=5, aggregate=3, rounds=2, budget=40, tail=30, final_budget=0, seed=1, variant="pacore")
    rsa = MarkovianRSA(be, cfg, "math", grader=exact_grader)
    res = rsa.run("What is 1+1?", gold="2")
    think_end = tok.convert_tokens_to_ids("</think>")
    for rec in res.prompts:
        if rec.stage != "aggregate":
            continue
        for j, piece in zip(rec.parents, rec.forwarded):
            c = res.rounds[rec.round - 1][j]
            ids = _trace(c, rsa.eos)
            answer = ids[len(ids) - ids[::-1].index(think_end):] if think_end in ids else []
            if answer:  # finished thinking: its answer, after </think>
                assert piece == answer[-cfg.tail:]
                assert "\\boxed" in tok.decode(piece) and "</think>" not in tok.decode(piece)
            else:
                assert piece == ids[-cfg.tail:]
    # delethink: C = 1, chain i continues its own chain after the assistant header
    cfg = RSAConfig(population=3, aggregate=3, rounds=2, budget=12, tail=6, final_budget=0, seed=2, variant="delethink")
    rsa = MarkovianRSA(be, cfg, "math", grader=exact_grader)
    res = rsa.run("What is 1+1?", gold="2")
    assert rsa.config.aggregate == 1
    solve = rsa.builder.solve(tok.encode("What is 1+1?", add_special_tokens=False))
    conts = [p for p in res.prompts if p.round > 0]
    assert conts
    for rec in conts:
        assert rec.stage == "continue" and rec.parents == [rec.index] and rec.max_tokens == 12 - 6
        prev = res.rounds[rec.round - 1][rec.index]
        own = (prev.history_ids + _trace(prev, rsa.eos))[-6:]
        assert rec.prompt_ids == solve + own
    # full-chain RSA forwards whole traces
    assert RSAConfig(budget=50, tail=7, variant="full").resolved().tail == 50


def test_pacore_forwards_at_most_tau_tokens_of_a_long_answer(tok):
    """pacore forwards the last tau = 3 tokens of a post-</think> answer longer than that, not the whole answer."""
    cfg = RSAConfig(population=4, aggregate=2, rounds=1, budget=40, tail=3, final_budget=0, seed=1, variant="pacore")
    rsa = MarkovianRSA(ScriptedBackend(tok), cfg, "math", grader=exact_grader)
    res = rsa.run("What is 1+1?", gold="2")
    think_end = tok.convert_tokens_to_ids("</think>")
    answers = 0
    for rec in (r for r in res.prompts if r.stage == "aggregate"):
        for j, piece in zip(rec.parents, rec.forwarded):
            ids = _trace(res.rounds[0][j], rsa.eos)
            assert len(piece) <= 3
            if think_end in ids:  # the scripted answer '\n\nThe answer is \\boxed{2}.' is longer than 3 tokens
                answers += 1
                assert piece == ids[len(ids) - ids[::-1].index(think_end):][-3:]
    assert answers


def test_parents_are_drawn_anew_each_round(tok):
    """A candidate's parents depend on the round: round 1 and round 2 draw different parent lists."""
    cfg = RSAConfig(population=4, aggregate=2, rounds=2, budget=40, tail=8, final_budget=0, seed=7)
    res = MarkovianRSA(ScriptedBackend(tok), cfg, "math", grader=exact_grader).run("What is 17 + 25?", gold="42")
    par = {t: [r.parents for r in res.prompts if r.stage == "aggregate" and r.round == t] for t in (1, 2)}
    assert len(par[1]) == len(par[2]) == 4 and par[1] != par[2]


def test_metrics_against_a_hand_count(tok):
    be = ScriptedBackend(tok, answers=("7", "7", "3", "x"))
    cfg = RSAConfig(population=6, aggregate=2, rounds=1, budget=200, tail=10, final_budget=0, seed=3)
    res = MarkovianRSA(be, cfg, "math", grader=exact_grader).run("q", gold="7")
    final = [extract_answer(c.text) for c in res.final]
    m = res.metrics
    assert m["answers"] == final
    assert m["mean_accuracy"] == pytest.approx(sum(a == "7" for a in final) / 6)
    r0 = [extract_answer(c.text) for c in res.rounds[0]]
    assert m["round_accuracy"] == pytest.approx([sum(a == "7" for a in r0) / 6, m["mean_accuracy"]])
    counts = {a: final.count(a) for a in final}
    top = max(counts.values())
    assert m["majority_count"] == top and m["majority_answer"] == next(a for a in final if counts[a] == top)
    assert m["majority_accuracy"] == float(m["majority_answer"] == "7")
    assert m["pass_at_n"] == float("7" in final)
    # majority vote groups equivalent answers and breaks ties by first appearance
    same = lambda x, y: x.lower() == y.lower()  # noqa: E731
    assert majority_vote(["c", "B", "b", None, "a"], same) == ("B", 2)
    assert majority_vote(["a", "B", "b", None, "A"], same) == ("a", 2)  # a tie: the first cluster wins
    assert majority_vote([None, ""], exact_grader) == (None, 0)


def test_majority_vote_clusters_only_mutually_equal_answers(tok):
    """math_equal is one-sided (1/3 equals 0.333333 as a prediction, not the reverse): a cluster takes only
    answers equal both ways, so a stray rounding neither absorbs the true majority nor depends on the order."""
    answers = ["0.333333", "\\frac{1}{3}", "\\frac{1}{3}", "\\frac{1}{3}"]
    assert majority_vote(answers, math_grader) == majority_vote(answers[::-1], math_grader) == ("\\frac{1}{3}", 3)
    be = ScriptedBackend(tok, answers=answers, in_order=True)
    cfg = RSAConfig(population=4, rounds=0, budget=200, final_budget=0)
    m = MarkovianRSA(be, cfg, "math").run("1/3 = ?", gold="\\frac{1}{3}").metrics
    assert m["answers"] == answers
    assert (m["majority_answer"], m["majority_count"], m["majority_accuracy"]) == ("\\frac{1}{3}", 3, 1.0)
    assert m["round_majority_accuracy"] == [1.0]


def test_config_and_template_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="tail tau=9 exceeds the thinking budget beta=8"):
        RSAConfig(budget=8, tail=9).resolved()
    with pytest.raises(ValueError, match="aggregate C=5 exceeds the population N=4"):
        RSAConfig(population=4, aggregate=5, tail=8).resolved()
    assert RSAConfig(rounds=0, population=2, aggregate=4, budget=8, tail=4096).resolved().rounds == 0  # no tails
    with pytest.raises(ValueError, match="unknown variant"):
        RSAConfig(variant="beam").resolved()
    f = tmp_path / "t.yaml"
    f.write_text('base: math\ncandidate: "[{index}] {tail}\\n"\n')
    t = load_template(str(f))
    assert t.candidate == "[{index}] {tail}\n" and t.solve == MATH.solve
    b = PromptBuilder(t, lambda s: tok.encode(s, add_special_tokens=False))
    assert tok.decode(b.aggregate([5, 6], [[7], [8]])).count("[2] ") == 1
    f.write_text("aggregate: 'no fields here'\n")
    with pytest.raises(ValueError, match="needs"):
        load_template(str(f))
    # a tail (or the candidates) written twice: prompts longer than the context plan counts
    for text in ('candidate: "[{index}] {tail} (again: {tail})"', 'aggregate: "{problem} {candidates} {candidates}"',
                 'continue: "{tail}{tail}"'):
        f.write_text(text + "\n")
        with pytest.raises(ValueError, match="appears 2 times; it may appear once"):
            load_template(str(f))
    with pytest.raises(ValueError, match="unknown template"):
        load_template("nope")


# -- CLI --------------------------------------------------------------------------------------------


def _cli(capsys, *args):
    from ttc.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_errors_are_one_line(tmp_path, capsys, tiny_dense_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    bad_yaml, empty, not_json, null_problem = (tmp_path / n for n in ("t.yaml", "e.jsonl", "j.jsonl", "n.jsonl"))
    bad_yaml.write_text("foo: [unclosed\n")
    empty.write_text("")
    not_json.write_text('{"problem": "a"}\nnot json\n{"problem": "b"}\n')
    null_problem.write_text('{"problem": "a"}\n{"problem": null}\n')
    cases = [
        (["--data", bad, "--model", tiny_dense_dir], "lacks column(s) problem"),
        (["--problem", "1+1", "--base-url", f"http://127.0.0.1:{closed}", "--model", "m", "--retries", "0"],
         f"cannot reach http://127.0.0.1:{closed}"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--budget", "8", "--tail", "16"], "tail tau=16 exceeds"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--population", "2", "--aggregate", "3"], "aggregate C=3"),
        (["--problem", "1+1", "--model", tmp_path / "missing"], "not found"),
        (["--data", bad, "--model", tiny_dense_dir, "--limit", "0"], "--limit must be >= 1"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--threads", "-2"], "--threads must be >= 1"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--retries", "-1"], "--retries must be >= 0"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--rpm", "0"], "--rpm must be > 0"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--device", "bogus"], "not a device torch knows"),
        (["--data", bad, "--answer", "2", "--model", tiny_dense_dir], "--answer is the gold answer of --problem"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--out", tmp_path], "is a directory"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--template", bad_yaml], "is not valid YAML"),
        (["--data", empty, "--model", tiny_dense_dir], "has no rows (the file is empty)"),
        (["--data", not_json, "--model", tiny_dense_dir], "cannot be read as json: ArrowInvalid"),
        (["--data", null_problem, "--model", tiny_dense_dir], "row 1's problem is None"),
        (["--data", bad, "--column", "problem=question,answer=solutio", "--model", tiny_dense_dir],
         "lacks column(s) answer=solutio (has: question, answer); map them with --column answer=COLUMN"),
        (["--data", bad, "--column", "problem=question, answer =solutio", "--model", tiny_dense_dir],  # (ignored)
         "lacks column(s) answer=solutio (has: question, answer); map them with --column answer=COLUMN"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--context", "1000000"],
         "--context 1000000 exceeds the model's own context"),
    ]
    for args, msg in cases:
        rc, out, err = _cli(capsys, "solve", "--rounds", "1", *args)
        assert rc == 2, err
        assert err.startswith("ttc solve: error:") and msg in err and err.count("\n") == 1, err


def test_cli_notes_what_it_cannot_do(tmp_path, capsys, tiny_dense_dir):
    """A file without answers runs ungraded, and prices without a server's usage price nothing: both say so."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    rc, out, err = _cli(capsys, "solve", "--data", data, "--column", "problem=question", "--model", tiny_dense_dir,
                        "--population", "2", "--aggregate", "1", "--rounds", "0", "--budget", "4", "--tail", "2",
                        "--final-budget", "0", "--price-in", "2", "--no-progress")
    assert rc == 0, err
    assert "has no answers: the problems are solved but not graded" in err
    assert "a local --model reports none, so no cost" in err
    assert json.loads(out.splitlines()[-1])["round_accuracy"] is None


def test_lines_appended_on_resume_start_after_a_line_a_kill_cut_short(tmp_path):
    """A resumed run appends round checkpoints, results and traces to the files of the killed one: a cut last
    line (readers drop it) ran into the first line appended, and the next read refused the file."""
    from ttc.cli import _read_jsonl, _Writer

    for before, kept in [('{"a": 1}\n{"b": ', [{"a": 1}]), ('{"a": 1}\n', [{"a": 1}]), ('{"cut', []), ("", [])]:
        f = tmp_path / "f.jsonl"
        f.write_text(before)
        assert [r for _, r in _read_jsonl(f)] == kept
        w = _Writer(f)
        w.write({"c": 2})
        w.close()
        assert [r for _, r in _read_jsonl(f)] == kept + [{"c": 2}]


def test_cli_writes_results_and_resumes(tmp_path, capsys, tiny_dense_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in [("1+1?", "2"), ("2+2?", "4")]))
    out = tmp_path / "r.jsonl"
    common = ["solve", "--data", data, "--model", tiny_dense_dir, "--population", "2", "--aggregate", "1",
              "--rounds", "1", "--budget", "4", "--tail", "2", "--final-budget", "0", "--seed", "3", "--out", out,
              "--template", "generic", "--no-progress"]
    rc, stdout, _ = _cli(capsys, *common, "--limit", "1")
    assert rc == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["type"] for r in first] == ["problem", "summary"] and first[1]["problems"] == 1
    assert json.loads(stdout.splitlines()[-1]) == first[1]
    rc, _, _ = _cli(capsys, *common, "--resume")
    assert rc == 0
    second = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["type"] for r in second] == ["problem", "problem", "summary"]
    assert second[0] == first[0]  # not recomputed (same wall time), kept as it was
    assert [r["index"] for r in second[:2]] == [0, 1] and second[2]["problems"] == 2
    assert second[2]["generated_tokens"] == second[0]["generated_tokens"] + second[1]["generated_tokens"]
    for r in second[:2]:
        assert set(r) >= {"mean_accuracy", "round_accuracy", "majority_accuracy", "pass_at_n", "generated_tokens",
                          "prefill_tokens", "wall_s"} and len(r["round_accuracy"]) == 2
    # a resume with other settings is refused
    rc, _, err = _cli(capsys, *common, "--resume", "--seed", "4")
    assert rc == 2 and "different settings" in err
    rc, _, err = _cli(capsys, *common, "--resume", "--presence-penalty", "0.5")
    assert rc == 2 and "different settings" in err
    # penalties, added after results files existed, are not in the key while off: an older file still resumes
    from ttc.rsa import RSAConfig, config_dict

    assert not {"repetition_penalty", "presence_penalty"} & set(config_dict(RSAConfig()))
    assert config_dict(RSAConfig(presence_penalty=0.5))["presence_penalty"] == 0.5
    # a smaller --limit: the summary is of this run's problems; the other result stays in the file
    rc, stdout, err = _cli(capsys, *common, "--resume", "--limit", "1")
    assert rc == 0 and "1 result(s)" in err and json.loads(stdout.splitlines()[-1])["problems"] == 1
    assert [json.loads(line) for line in out.read_text().splitlines()][:2] == second[:2]
    # ... and its round checkpoints stay when this run completes (another problem's, here made up)
    ckpt = out.with_name(out.name + ".rounds.jsonl")
    ckpt.write_text(json.dumps({"run_key": second[2]["run_key"], "index": 1, "problem_key": "p", "round": 0,
                                "record": {}}) + "\n")
    assert _cli(capsys, *common, "--resume", "--limit", "1")[0] == 0 and json.loads(ckpt.read_text())["index"] == 1
    ckpt.unlink()
    # answers changed since (a gold fixed, or none before): those problems are solved again and graded anew
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in [("1+1?", "2"), ("2+2?", "5")]))
    rc, stdout, err = _cli(capsys, *[fixed if x == data else x for x in common], "--resume")
    assert rc == 0 and "1 result(s)" in err and "graded against another answer" in err
    regraded = [json.loads(line) for line in out.read_text().splitlines()]
    assert regraded[0] == second[0] and regraded[1]["answer"] == "5" and regraded[1]["wall_s"] != second[1]["wall_s"]
    out.write_text("".join(json.dumps(r) + "\n" for r in second))  # (the file as before, for what follows)
    # other data into the same file is refused, and the file is kept
    other = tmp_path / "o.jsonl"
    other.write_text(json.dumps({"problem": "9+9?", "answer": "18"}) + "\n")
    rc, _, err = _cli(capsys, *[other if x == data else x for x in common], "--resume")
    assert rc == 2 and "holds a result for another problem 0" in err
    assert [json.loads(line) for line in out.read_text().splitlines()][:2] == second[:2]
    # --save-traces: a fresh run replaces the file (it appended to the last run's)
    traces = tmp_path / "t.jsonl"
    for _ in range(2):
        assert _cli(capsys, *common, "--save-traces", traces)[0] == 0
        assert [json.loads(line)["type"] for line in traces.read_text().splitlines()].count("round") == 4


class RoundScript(HFTokenizerSide):
    """A scripted engine: the text of a completion depends on the stage of its prompt."""

    def __init__(self, tokenizer, solve, cont="<think>\nstill thinking, no answer here", agg="\\boxed{5}"):
        super().__init__(tokenizer)
        self.solve_text, self.cont_text, self.agg_text = solve, cont, agg
        self.calls = []

    def generate(self, prompts, params, seeds=None):
        out = []
        for i, p in enumerate(prompts):
            text = self.decode(p)
            kind = "agg" if "candidate solutions" in text else "solve" if text.endswith(self.chat_parts()[1]) \
                else "cont"  # a continuation has chain tokens after the assistant header
            self.calls.append((kind, params.max_tokens))
            for j in range(params.n):
                body = {"solve": self.solve_text(j) if callable(self.solve_text) else self.solve_text,
                        "cont": self.cont_text, "agg": self.agg_text}[kind]
                ids = self.encode(body) + [self.tokenizer.eos_token_id]
                fin = "stop"
                if len(ids) > params.max_tokens:
                    ids, fin = ids[:params.max_tokens], "length"
                out.append(Completion(ids, self.decode(ids[:-1] if fin == "stop" else ids), [0.0] * len(ids), fin, i,
                                      len(p), list(p)))
        return out


def test_a_template_that_opens_the_thinking_leaves_cut_traces_without_an_answer(tok):
    """DeepSeek-R1's and Qwen3-Thinking-2507's templates end the generation prompt with ``<think>\\n``: the model never
    writes it, so a trace cut in its thinking (no ``</think>``) must not be graded on a \\boxed{} it tried there; one
    that closes its thinking is graded on what follows."""
    import copy

    opened = copy.deepcopy(tok)
    opened.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    cfg = dict(population=4, aggregate=2, rounds=1, budget=12, tail=4, final_budget=0, seed=0)
    cut = RoundScript(opened, "maybe \\boxed{5}? no, let me check every step again", agg="still \\boxed{5} unsure ...")
    r = MarkovianRSA(cut, RSAConfig(**cfg), "math", grader=exact_grader).run("q", gold="5")
    assert all(c.finish_reason == "length" for c in r.rounds[0])
    assert [c.answer for rnd in r.rounds for c in rnd] == [None] * 8 and r.metrics["round_accuracy"] == [0.0, 0.0]
    done = RoundScript(opened, "ok</think> \\boxed{5}", agg="ok</think> \\boxed{5}")
    r = MarkovianRSA(done, RSAConfig(**cfg), "math", grader=exact_grader).run("q", gold="5")
    assert r.metrics["round_accuracy"] == [1.0, 1.0]
    # the same cut traces under the tiny tokenizer's own template (thinking not opened in the prompt): graded
    r = MarkovianRSA(RoundScript(tok, "\\boxed{5} and more words here"), RSAConfig(**cfg), "math",
                     grader=exact_grader).run("q", gold="5")
    assert r.rounds[0][0].answer == "5"


def test_delethink_freezes_finished_chains_and_grades_whole_traces(tok):
    """The issue's case: round-0 traces end in \\boxed{5} + EOS. Delethink must not continue them
    (and so not lose the answer); RSA aggregates into \\boxed{5} again."""
    cfg = dict(population=4, aggregate=2, rounds=1, budget=60, tail=8, final_budget=0, seed=1)
    be = RoundScript(tok, "<think>\nadd them</think> The answer is \\boxed{5}")
    dele = MarkovianRSA(be, RSAConfig(**cfg, variant="delethink"), "math", grader=exact_grader).run("q", gold="5")
    assert dele.metrics["round_accuracy"] == [1.0, 1.0] and dele.metrics["mean_accuracy"] == 1.0
    assert [k for k, _ in be.calls] == ["solve"] and all(c.frozen for c in dele.final)
    rsa = MarkovianRSA(be, RSAConfig(**cfg, variant="rsa"), "math", grader=exact_grader).run("q", gold="5")
    assert rsa.metrics["round_accuracy"] == [1.0, 1.0]
    # chains cut at beta continue in chunks of beta - tau - anchor tokens from (anchor, last tau) of
    # their chain; the answer in chunk 2 is graded on the whole trace, and a chain that stops in round 1
    # stays frozen in round 2
    long = "<think>\n" + " ".join(["step"] * 40)
    be = RoundScript(tok, lambda j: long if j % 2 == 0 else "<think>\nok</think> \\boxed{5}",
                     cont="thinking more</think> so \\boxed{5}")
    cfg = RSAConfig(population=4, rounds=2, budget=20, tail=6, anchor=3, final_budget=0, seed=1, variant="delethink")
    rsa = MarkovianRSA(be, cfg, "math", grader=exact_grader)
    res = rsa.run("q", gold="5")
    assert res.metrics["round_accuracy"] == [0.5, 1.0, 1.0]
    assert res.metrics["finished_chains"] == [2, 4, 4]
    conts = [p for p in res.prompts if p.stage == "continue"]
    assert [p.index for p in conts] == [0, 2] and all(p.max_tokens == 20 - 6 - 3 for p in conts)
    q = tok.encode("q", add_special_tokens=False)
    for p in conts:
        chain = _trace(res.rounds[0][p.index], rsa.eos)
        assert len(chain) == 20 and p.prompt_ids == rsa.builder.solve(q) + chain[:3] + chain[-6:]
        c = res.rounds[1][p.index]
        assert c.history_ids == chain and c.response.startswith(res.rounds[0][p.index].text)
        assert res.rounds[2][p.index].frozen and res.rounds[2][p.index].response == c.response
    # requests per plan: one solve (n=4) + two continuations; nothing in round 2
    assert res.metrics["requests"] == 3


def test_tails_sent_as_text_hold_whole_characters(tok):
    """Tails are cut in tokens; a backend that sends text (``--api chat``) decoded a cut through a multi-token
    character (CJK, math symbols) as U+FFFD into the prompt. There a cut drops the remnant (at most tau tokens
    still); token-id backends send the cut as it is."""
    for sends_text in (False, True):
        split = []
        for variant, extra in (("rsa", {}), ("delethink", {"anchor": 3})):
            for tau in (3, 4, 5, 6, 7):
                be = RoundScript(tok, "<think>\n" + "计算√π" * 30, cont="<think>\n" + "≤∑" * 40)
                be.sends_text = sends_text
                cfg = RSAConfig(population=2, aggregate=2 if variant == "rsa" else 1, rounds=1, budget=40, tail=tau,
                                final_budget=0, seed=0, variant=variant, **extra)
                res = MarkovianRSA(be, cfg, "math", grader=exact_grader).run("q")
                cuts = [ids for p in res.prompts if p.round == 1 for ids in p.forwarded]
                assert cuts and all(len(ids) <= tau + extra.get("anchor", 0) for ids in cuts)
                # (the script's traces end where the budget cut them, as token ids: a remnant may end them; a chat
                # backend's traces are its replies' text encoded, whole characters)
                split += [t for ids in cuts if "\ufffd" in (t := tok.decode(ids).rstrip("\ufffd"))]
        assert bool(split) != sends_text, (sends_text, split)


def test_plan_check_and_clamp(tok):
    be = RoundScript(tok, "x")
    cfg = RSAConfig(population=4, aggregate=3, rounds=2, budget=200, tail=16, final_budget=50, seed=0)
    rsa = MarkovianRSA(be, cfg, "math", grader=exact_grader)
    steps = {s["stage"]: s for s in rsa.plan(20)}
    q = [7] * 20
    assert steps["solve"]["prompt"] == len(rsa.builder.solve(q))
    assert steps["aggregate"]["prompt"] == len(rsa.builder.aggregate(q, [[1] * 16] * 3))
    assert steps["final"]["prompt"] == steps["aggregate"]["prompt"] + 200 + len(rsa.builder.force_answer())
    need = steps["final"]["total"]
    assert rsa.check_plan(20, need) is None
    with pytest.raises(ValueError, match=r"final request of round 2 .* > the model's context .*--final-budget"):
        rsa.check_plan(20, need - 1)
    ctx = steps["aggregate"]["total"] - 10
    with pytest.raises(ValueError, match=r"aggregate request of round 1 .*lower --budget, --tail or --aggregate"):
        rsa.check_plan(20, ctx)
    changes = rsa.check_plan(20, ctx, clamp=True)
    # the final-answer continuation keeps its room (it was clamped to 0: cut traces got no answer): here all of
    # final_budget=50, a quarter of what the solve prompt leaves being more
    force = len(rsa.builder.force_answer())
    assert changes["budget"] == (200, 190 - force - 50) and rsa.config.final_budget == 50
    assert all(s["total"] <= ctx for s in rsa.plan(20)) and "final_budget" not in changes
    # parallel sampling (rounds=0) forwards no tails: a tail longer than the clamped budget is no reason to refuse
    solo = MarkovianRSA(be, RSAConfig(population=4, rounds=0, budget=4000, tail=4096, seed=0), "math")
    solve_prompt = solo.plan(20)[0]["prompt"]
    got = solo.check_plan(20, solve_prompt + 400, clamp=True)
    assert got["budget"][1] >= 1 and all(s["total"] <= solve_prompt + 400 for s in solo.plan(20))
    with pytest.raises(ValueError, match="no thinking budget fits"):
        MarkovianRSA(be, cfg, "math").check_plan(20, steps["aggregate"]["prompt"] + 5, clamp=True)
    # the full variant forwards whole traces (tail = budget): clamping solves C + 1 budgets into the context
    full = MarkovianRSA(be, RSAConfig(population=4, aggregate=2, rounds=1, budget=1000, tail=1000, final_budget=0,
                                      variant="full"), "math")
    over = len(full.builder.aggregate(q, [[]] * 2))
    assert full.check_plan(20, over + 3 * 300, clamp=True) == {"budget": (1000, 300), "tail": (1000, 300)}
    assert max(s["total"] for s in full.plan(20)) == over + 3 * 300
    # delethink's later chunks: prompt + chunk budget stays within the first chunk's context
    d = MarkovianRSA(be, RSAConfig(population=2, rounds=3, budget=100, tail=10, anchor=5, final_budget=0,
                                   variant="delethink"), "math")
    st = {s["stage"]: s for s in d.plan(9)}
    assert st["continue"]["max_tokens"] == 85
    assert st["continue"]["total"] == st["solve"]["total"] + len(d.builder.cont([], [])) - len(d.builder.solve([]))


def test_clamp_reserves_a_quarter_of_the_solve_room_for_the_final_and_fits_delethink_chunks(tok):
    """--clamp keeps min(final_budget, (context - solve prompt) // 4) for the final answer and fits the thinking
    budget around it; delethink's budget is bounded by the later chunks' prompt + budget - tail - anchor."""
    be = RoundScript(tok, "x")
    rsa = MarkovianRSA(be, RSAConfig(population=4, aggregate=3, rounds=2, budget=200, tail=16, final_budget=1000,
                                     seed=0), "math", grader=exact_grader)
    st = {s["stage"]: s for s in rsa.plan(20)}
    solve, agg, force = st["solve"]["prompt"], st["aggregate"]["prompt"], len(rsa.builder.force_answer())
    ctx = agg + 300
    reserve = (ctx - solve) // 4  # under final_budget=1000
    budget = ctx - reserve - force - agg  # final prompt (aggregate prompt + budget + force) + reserve fills ctx
    assert 16 <= budget < 200
    assert rsa.check_plan(20, ctx, clamp=True) == {"budget": (200, budget), "final_budget": (1000, reserve)}
    assert max(s["total"] for s in rsa.plan(20)) == ctx
    d = MarkovianRSA(be, RSAConfig(population=2, rounds=3, budget=100, tail=10, anchor=5, final_budget=0,
                                   variant="delethink"), "math")
    st = {s["stage"]: s for s in d.plan(9)}
    ctx = st["solve"]["prompt"] + 80
    assert d.check_plan(9, ctx, clamp=True) == {"budget": (100, 80)}
    st = {s["stage"]: s for s in d.plan(9)}
    assert st["continue"]["max_tokens"] == 80 - 15 and st["continue"]["total"] <= ctx


def test_pass_at_k_and_problem_dependent_draws(tok):
    from math import comb
    for n, c, k in [(8, 3, 1), (8, 3, 4), (8, 0, 2), (8, 8, 8), (5, 4, 2)]:
        ref = 1 - comb(n - c, k) / comb(n, k) if n - c >= k else 1.0
        assert pass_at_k(n, c, k) == pytest.approx(ref)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    rsa = MarkovianRSA(RoundScript(tok, "x"), RSAConfig(population=8, aggregate=3, rounds=1, budget=20, tail=4), "math")
    a = [rsa.parents(1, i, problem_seed("problem A")) for i in range(8)]
    b = [rsa.parents(1, i, problem_seed("problem B")) for i in range(8)]
    assert a != b and a == [rsa.parents(1, i, problem_seed("problem A")) for i in range(8)]
    be = ScriptedBackend(tok)
    r1 = MarkovianRSA(be, RSAConfig(population=4, aggregate=2, rounds=1, budget=30, tail=5, seed=3), "math").run("p1", "2")
    r2 = MarkovianRSA(be, RSAConfig(population=4, aggregate=2, rounds=1, budget=30, tail=5, seed=3), "math").run("p2")
    assert r1.prompts[0].seed != r2.prompts[0].seed
    assert [p.seed for p in r1.prompts[1:]] != [p.seed for p in r2.prompts[1:]]
    m = r1.metrics
    assert set(m["pass_at_k"]) == {"1", "2", "4"} and m["pass_at_k"]["4"] == m["pass_at_n"]
    assert len(m["round_majority_accuracy"]) == len(m["round_pass_at_k"]) == 2


def test_pass_at_k_when_fewer_wrong_than_k_only():
    """pass@k is 1 only when n - c < k: n - c == k still has one all-wrong draw of k."""
    assert pass_at_k(4, 3, 1) == pytest.approx(0.75)      # 1 - C(1,1)/C(4,1)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0


def test_problems_in_flight_on_a_local_engine_share_batched_calls(engine):
    """``--problems-in-flight`` on a local engine: problems run in threads over one EngineBackend,
    whose batcher merges their rounds into fewer engine calls, each prompt with its own seed, so
    every problem's prompts and samples are those of the problem run alone."""
    from concurrent.futures import ThreadPoolExecutor

    problems = [PROBLEM, "What is 6 times 7?", "Compute 50 - 8.", "Add 40 and 2."]
    alone, calls = [], 0
    for p in problems:
        be = EngineBackend(engine)
        alone.append(run_rsa(be, p, RSAConfig(**SMALL), gold="42"))
        calls += be._batcher.batches
        be._batcher.close()  # (be.close() would close the shared engine too)
    be = EngineBackend(engine)
    with ThreadPoolExecutor(len(problems)) as ex:
        together = list(ex.map(lambda p: run_rsa(be, p, RSAConfig(**SMALL), gold="42"), problems))
    batches = be._batcher.batches
    be._batcher.close()
    for a, b in zip(alone, together):
        assert [(p.stage, p.round, p.prompt_ids, p.seed, p.n) for p in b.prompts] == \
            [(p.stage, p.round, p.prompt_ids, p.seed, p.n) for p in a.prompts]
        assert [[c.token_ids for c in r] for r in b.rounds] == [[c.token_ids for c in r] for r in a.rounds]
        assert [c.token_ids for c in b.final] == [c.token_ids for c in a.final]
    assert batches < calls, (batches, calls)


def test_a_local_engine_with_threads_runs_every_call_on_its_own_thread(engine):
    """``ttc solve --model``: the engine runs on the batcher's thread, which holds the torch threads,
    for seeded calls (batched) and the others alike, with the same samples as on the caller's thread."""
    import threading

    class Where:
        def __init__(self, eng):
            self.eng, self.tokenizer, self.eos_token_ids, self.threads = eng, eng.tokenizer, eng.eos_token_ids, []

        def generate(self, prompts, params, seeds=None):
            self.threads.append(threading.current_thread().name)
            return self.eng.generate(prompts, params, seeds=seeds)

    spy = Where(engine)
    be = EngineBackend(spy, threads=torch.get_num_threads())
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3)
    got = [be.generate([[5, 6, 7]], sp), be.generate([[5, 6, 7]], sp, seeds=[4])]
    be._batcher.close()
    assert spy.threads == ["engine-batcher", "engine-batcher"]
    want = [engine.generate([[5, 6, 7]], sp), engine.generate([[5, 6, 7]], sp, seeds=[4])]
    assert [[c.token_ids for c in x] for x in got] == [[c.token_ids for c in x] for x in want]


def test_missing_answers_and_the_model_identity(tmp_path, tiny_dense_dir):
    """An empty answer cell (NaN as pandas reads it, or a blank string) leaves the problem ungraded instead of
    graded against "nan"; the resume key tells a bfloat16 run from a float32 one (and keeps float32 CPU runs'
    key as results files written before it had dtypes)."""
    import argparse

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ttc.cli import load_problems

    pq.write_table(pa.table({"problem": ["a?", "b?", "c?"], "answer": [7.0, None, float("nan")]}),
                   tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n"
                                              for p, a in [("a?", "7"), ("b?", ""), ("c?", "  ")]))
    for f in ("d.parquet", "d.jsonl"):  # a float column's 7.0 is the answer 7
        a = argparse.Namespace(problem=None, data=str(tmp_path / f), column=None, split="train", subset=None,
                               limit=None)
        assert [p["answer"] for p in load_problems(a)] == ["7", None, None]
    idents = [EngineBackend(TorchEngine.from_pretrained(tiny_dense_dir, dtype=dt)).identity()
              for dt in (torch.float32, torch.bfloat16)]
    assert "dtype" not in idents[0] and "device" not in idents[0] and idents[1]["dtype"] == "torch.bfloat16"


def test_a_blank_answer_flag_leaves_the_problem_ungraded(capsys, tiny_dense_dir):
    """--answer "" (or blanks) is no answer, as an empty cell in --data is: the run is not graded against ""."""
    for blank in ("", "  "):
        rc, out, err = _cli(capsys, "solve", "--problem", "What is 1+1?", "--answer", blank, "--model", tiny_dense_dir,
                            "--population", "2", "--rounds", "0", "--budget", "4", "--no-progress")
        assert rc == 0, err
        r = json.loads(out.splitlines()[0])
        assert r["answer"] is None and r["mean_accuracy"] is None and r["majority_accuracy"] is None


def test_a_repeated_problem_is_sampled_apart(tmp_path, capsys, tiny_dense_dir):
    """A dataset that lists a problem twice (avg@k by repetition) gets two independent samples of it; a problem
    listed once keeps the key (and so the seeds) it always had."""
    from ttc.cli import _problem_key, _problem_keys

    assert _problem_keys(["a", "b", "a"]) == [_problem_key("a"), _problem_key("b"), _problem_key("a") + "#1"]
    data = tmp_path / "d.jsonl"
    data.write_text((json.dumps({"problem": "What is 2+2?", "answer": "4"}) + "\n") * 2)
    traces = tmp_path / "t.jsonl"
    rc, _, _ = _cli(capsys, "solve", "--data", data, "--model", tiny_dense_dir, "--population", "2", "--rounds", "0",
                    "--budget", "8", "--seed", "1", "--out", tmp_path / "r.jsonl", "--save-traces", traces,
                    "--no-progress")
    pops = {r["index"]: r["population"] for r in map(json.loads, traces.read_text().splitlines())
            if r["type"] == "round"}
    assert rc == 0 and pops[0] != pops[1]


def test_template_file_on_math_grades_as_math_and_null_means_empty(tmp_path, tok):
    """A reworded math template (a file with base: math) keeps the math grader (0.5 == 1/2), as the built-in
    does; a null value in the file is the empty text, not the word None."""
    f = tmp_path / "t.yaml"
    f.write_text('base: math\nsolve: "{problem}\\n\\nShow your work; final answer in \\\\boxed{{}}."\nforce_answer:\n')
    t = load_template(str(f))
    assert t.force_answer == "" and t.base == "math"
    for spec in ("math", str(f)):
        r = MarkovianRSA(ScriptedBackend(tok), RSAConfig(population=2, aggregate=1), spec)
        assert r.grader("0.5", "1/2") and r.grader("042", "42")
    assert MarkovianRSA(ScriptedBackend(tok), RSAConfig(population=2, aggregate=1), "generic").grader is exact_grader


class _CountingHandler(Handler):
    """Counts POSTs in flight (each held 20 ms) and the API keys it was sent."""

    lock = threading.Lock()
    now = peak = 0
    keys: set = set()

    def do_POST(self):
        import time

        cls = _CountingHandler
        with cls.lock:
            cls.now += 1
            cls.peak = max(cls.peak, cls.now)
            cls.keys.add(self.headers.get("Authorization"))
        self._counted = True
        try:
            time.sleep(0.02)
            super().do_POST()
        finally:
            self._done()

    def send_response(self, *args, **kw):
        self._done()  # out of flight once answering: the client may send its next request as soon as it reads this
        super().send_response(*args, **kw)

    def _done(self):
        if getattr(self, "_counted", False):
            self._counted = False
            with _CountingHandler.lock:
                _CountingHandler.now -= 1


def test_server_key_concurrency_wall_time_and_resume_settings(tmp_path, capsys, tiny_dense_dir, monkeypatch):
    """Against a keyed `ttc serve`: CASCADE_API_KEY wins over an OPENAI_API_KEY the shell also exports (that
    secret is never sent); --concurrency caps every request in flight, /tokenize and /detokenize too; the
    summary's wall_s is the run's elapsed time (problems in flight overlap), problem_wall_s their sum; --max-n
    is part of the resume key."""
    import time

    monkeypatch.setenv("CASCADE_API_KEY", "secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-server")
    srv, url = serve_in_thread(TorchEngine.from_pretrained(tiny_dense_dir), model_name="tiny", api_key="secret",
                               handler=_CountingHandler)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    out = tmp_path / "r.jsonl"
    common = ["solve", "--data", data, "--base-url", url + "/v1", "--population", "2", "--aggregate", "1",
              "--rounds", "1", "--budget", "4", "--tail", "2", "--final-budget", "0", "--no-progress", "--out", out]
    try:
        t = time.perf_counter()
        rc, _, err = _cli(capsys, *common, "--concurrency", "1", "--problems-in-flight", "4",
                          "--save-traces", tmp_path / "tr.jsonl")
        elapsed = time.perf_counter() - t
        assert rc == 0, err
        assert _CountingHandler.peak == 1 and _CountingHandler.keys == {"Bearer secret"}
        summary = json.loads(out.read_text().splitlines()[-1])
        assert summary["wall_s"] <= elapsed and summary["problem_wall_s"] > summary["wall_s"]
        rc, _, err = _cli(capsys, *common, "--resume", "--max-n", "1")
        assert rc == 2 and "different settings" in err
    finally:
        srv.shutdown()
        srv.server_close()


def test_clamp_fits_the_whole_dataset_so_a_larger_limit_resumes(tmp_path, capsys, tiny_dense_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" +
                    json.dumps({"problem": "A much longer problem statement " * 8 + "so what is 2+2?", "answer": "4"})
                    + "\n")
    out = tmp_path / "r.jsonl"
    common = ["solve", "--data", data, "--model", tiny_dense_dir, "--threads", "1", "--population", "2",
              "--aggregate", "1", "--rounds", "1", "--budget", "200", "--tail", "4", "--final-budget", "0",
              "--context", "450", "--clamp", "--no-progress", "--out", out]
    rc, _, err = _cli(capsys, *common, "--limit", "1")
    assert rc == 0 and "clamped" in err, err
    rc, _, err = _cli(capsys, *common, "--resume")
    assert rc == 0, err
    assert json.loads(out.read_text().splitlines()[-1])["problems"] == 2


def test_an_unexpected_error_in_one_problem_lets_the_running_ones_finish(tmp_path, tok, monkeypatch):
    """A problem whose backend call raises something unexpected (a malformed server reply's KeyError) ends the
    run with that error, but only after the problems already running have finished and written their results
    (they used to go on writing into files the failing run had closed)."""
    import time

    import ttc.cli as cli

    class Backend(ScriptedBackend):
        def generate(self, prompts, params, seeds=None):
            if any("bad" in self.decode(p) for p in prompts):
                time.sleep(0.05)
                raise KeyError("choices")
            time.sleep(0.3)
            return super().generate(prompts, params, seeds)

        def close(self):
            pass

    monkeypatch.setattr(cli, "build_backend", lambda a: Backend(tok))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "2"}) + "\n" for q in ("bad one", "1+1?", "2+0?")))
    out = tmp_path / "r.jsonl"
    with pytest.raises(KeyError, match="choices"):
        cli.solve_main(["--data", str(data), "--model", "unused", "--population", "2", "--aggregate", "1",
                        "--rounds", "0", "--budget", "8", "--tail", "4", "--final-budget", "0",
                        "--problems-in-flight", "3", "--out", str(out), "--no-progress"])
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in done if r.get("type") == "problem") == [1, 2]
