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
from ttc.rsa import MarkovianRSA, RSAConfig, derive_seed, exact_grader, extract_answer, majority_vote, run_rsa
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
    assert abs(overheads.pop() - len(empty)) <= 4  # separately tokenised pieces vs one string
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
    ref = engine.generate([res.prompts[0].prompt_ids],
                          SamplingParams(n=4, temperature=1.0, max_tokens=cfg.budget, seed=cfg.seed))
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
    same = lambda m: {k: v for k, v in m.items() if k != "wall_s"}  # noqa: E731
    assert same(via.metrics) == same(res.metrics)


# -- variants, with a scripted backend (no model) ------------------------------------------------


class ScriptedBackend(HFTokenizerSide):
    """Deterministic fake: each completion is '<think> words </think> \\boxed{A}' with A drawn from
    ``answers`` by the request seed; some stop (EOS) and some are cut at max_tokens."""

    def __init__(self, tokenizer, answers=("1", "2", "2")):
        super().__init__(tokenizer)
        self.answers = answers
        self.calls = []

    def generate(self, prompts, params, seeds=None):
        self.calls.append((prompts, params, seeds))
        out = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                rng = random.Random(derive_seed(seeds[i], j))
                words = [rng.choice(["sum", "check", "graph", "list"]) for _ in range(rng.randint(1, 9))]
                text = "<think>\n" + " ".join(words)
                text += f"\n</think>\n\nThe answer is \\boxed{{{rng.choice(self.answers)}}}."
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
    # delethink: C = 1, candidate i continues its own chain after the assistant header
    cfg = RSAConfig(population=3, aggregate=3, rounds=2, budget=12, tail=6, final_budget=0, seed=2, variant="delethink")
    rsa = MarkovianRSA(be, cfg, "math", grader=exact_grader)
    res = rsa.run("What is 1+1?", gold="2")
    assert rsa.config.aggregate == 1
    solve = rsa.builder.solve(tok.encode("What is 1+1?", add_special_tokens=False))
    for rec in (p for p in res.prompts if p.round > 0):
        assert rec.stage == "continue" and rec.parents == [rec.index]
        own = _trace(res.rounds[rec.round - 1][rec.index], rsa.eos)[-6:]
        assert rec.prompt_ids == solve + own
    # full-chain RSA forwards whole traces
    assert RSAConfig(budget=50, tail=7, variant="full").resolved().tail == 50


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


def test_config_and_template_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="tail tau=9 exceeds the thinking budget beta=8"):
        RSAConfig(budget=8, tail=9).resolved()
    with pytest.raises(ValueError, match="aggregate C=5 exceeds the population N=4"):
        RSAConfig(population=4, aggregate=5, tail=8).resolved()
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
    cases = [
        (["--data", bad, "--model", tiny_dense_dir], "lacks column(s) problem"),
        (["--problem", "1+1", "--base-url", f"http://127.0.0.1:{closed}", "--model", "m", "--retries", "0"],
         f"cannot reach http://127.0.0.1:{closed}"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--budget", "8", "--tail", "16"], "tail tau=16 exceeds"),
        (["--problem", "1+1", "--model", tiny_dense_dir, "--population", "2", "--aggregate", "3"], "aggregate C=3"),
        (["--problem", "1+1", "--model", tmp_path / "missing"], "not found"),
    ]
    for args, msg in cases:
        rc, out, err = _cli(capsys, "solve", "--rounds", "1", *args)
        assert rc == 2, err
        assert err.startswith("ttc solve: error:") and msg in err and err.count("\n") == 1, err


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
