"""``ttc solve`` edges that users see: option bounds and their messages, the summary's accounting of failed
problems (metrics over the problems that finished, usage and cost over all), resume reading (round checkpoints
up to the first gap, a corrupt line), the server backend's retry timing rules and n-splitting (on a scripted
transport, no sockets), the in-flight cap, and template file validation. Each test runs in well under a second."""
from __future__ import annotations

import json
import threading

import pytest

from train.engine import SamplingParams
from ttc.backends import Limiter, OpenAIBackend, retry_after
from ttc.rsa import RSAConfig
from ttc.templates import GENERIC, load_template


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def _cli(capsys, *args):
    from ttc.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- option validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value,msg", [
    ("--concurrency", "0", "--concurrency must be >= 1, got 0"),
    ("--problems-in-flight", "0", "--problems-in-flight must be >= 1, got 0"),
    ("--max-n", "0", "--max-n must be >= 1, got 0"),
    ("--max-tokens-in-flight", "0", "--max-tokens-in-flight must be >= 1, got 0"),
    ("--context", "0", "--context must be >= 1, got 0"),
    ("--backoff", "-0.5", "--backoff must be >= 0, got -0.5"),
    ("--price-out", "-1", "--price-out must be >= 0, got -1.0"),
    ("--tpm", "0", "--tpm must be > 0, got 0.0"),
    ("--retry-horizon", "0", "--retry-horizon must be > 0, got 0.0"),
    ("--request-timeout", "-3", "--request-timeout must be > 0, got -3.0"),
    # the algorithm's and the sampling's settings are named as their options too (they said "rounds", "top_p")
    ("--rounds", "-1", "--rounds must be >= 0, got -1"),
    ("--population", "0", "--population must be >= 1, got 0"),
    ("--final-budget", "-1", "--final-budget must be >= 0, got -1"),
    ("--top-p", "2", "--top-p must be in (0, 1], got 2.0"),
    ("--repetition-penalty", "0", "--repetition-penalty must be a finite number > 0, got 0.0"),
])
def test_out_of_range_options_are_refused_in_one_line_before_any_model_loads(capsys, tmp_path, flag, value, msg):
    rc, out, err = _cli(capsys, "solve", "--problem", "1+1?", "--model", tmp_path / "never-loaded", flag, value)
    assert rc == 2 and out == ""
    assert err == f"ttc solve: error: {msg}\n"


def test_resume_without_out_is_refused(capsys, tmp_path):
    rc, _, err = _cli(capsys, "solve", "--problem", "1+1?", "--model", tmp_path / "never-loaded", "--resume")
    assert rc == 2 and err == "ttc solve: error: --resume needs --out (the results file to resume from)\n"


def test_a_blank_problem_row_is_refused_with_its_row(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "  ", "answer": "3"})
                    + "\n")
    rc, _, err = _cli(capsys, "solve", "--data", data, "--model", tmp_path / "never-loaded")
    assert rc == 2 and "row 1's problem is '  '; every row needs a problem text" in err


# -- summary accounting -----------------------------------------------------------------------------


def _ok(i, acc, maj, passk, gen, usage):
    return {"type": "problem", "index": i, "status": "ok", "mean_accuracy": acc, "round_accuracy": [acc / 2, acc],
            "majority_accuracy": maj, "round_majority_accuracy": [0.0, maj], "pass_at_n": 1.0 if acc else 0.0,
            "pass_at_k": passk, "generated_tokens": gen, "prefill_tokens": 10 * gen, "wall_s": 1.5, "usage": usage}


def test_summary_metrics_are_over_finished_problems_and_usage_over_all():
    """Hand count: two problems finished (accuracy 1.0 and 0.5), one failed after its requests were served. Accuracy,
    majority, pass@k and tokens average/sum the two; usage and cost count the failed problem's requests too."""
    from ttc.cli import summarize

    records = [
        _ok(0, 1.0, 1.0, {"1": 1.0, "2": 1.0}, 100, {"requests": 2, "prompt_tokens": 1000, "completion_tokens": 200}),
        _ok(1, 0.5, 0.0, {"1": 0.5, "2": 0.75}, 60, {"requests": 3, "prompt_tokens": 500, "completion_tokens": 100}),
        {"type": "problem", "index": 2, "status": "failed", "error": "ServerError: x",
         "usage": {"requests": 4, "prompt_tokens": 500, "completion_tokens": 700}},
    ]
    s = summarize(records, RSAConfig(), "key", None, (2.0, 10.0))
    assert (s["problems"], s["failed"], s["failed_indices"]) == (3, 1, [2])
    assert s["mean_accuracy"] == pytest.approx(0.75) and s["majority_accuracy"] == pytest.approx(0.5)
    assert s["round_accuracy"] == pytest.approx([0.375, 0.75]) and s["round_majority_accuracy"] == pytest.approx([0, 0.5])
    assert s["pass_at_n"] == pytest.approx(1.0)
    assert s["pass_at_k"] == pytest.approx({"1": 0.75, "2": 0.875})
    assert (s["generated_tokens"], s["prefill_tokens"], s["problem_wall_s"]) == (160, 1600, 3.0)
    assert s["usage"] == {"requests": 9, "prompt_tokens": 2000, "completion_tokens": 1000}
    # $2 per 1M prompt tokens, $10 per 1M completion tokens: 2000 * 2e-6 + 1000 * 10e-6
    assert s["cost"] == pytest.approx(0.004 + 0.01)
    ok_only = summarize(records[:2], RSAConfig(), "key")
    assert (ok_only["failed"], ok_only["failed_indices"], ok_only["cost"]) == (0, [], None)


def test_cost_prices_each_side_at_its_own_price_and_nothing_without_token_counts():
    from ttc.cli import cost

    assert cost({"prompt_tokens": 1_000_000, "completion_tokens": 0}, 3.0, 15.0) == pytest.approx(3.0)
    assert cost({"prompt_tokens": 0, "completion_tokens": 1_000_000}, 3.0, 15.0) == pytest.approx(15.0)
    assert cost({"completion_tokens": 2_000_000}, None, 1.0) == pytest.approx(2.0)  # one price given
    assert cost({"requests": 5}, 3.0, 15.0) is None  # requests alone: not a free run
    assert cost({"prompt_tokens": 10}, None, None) is None


# -- resume reading ---------------------------------------------------------------------------------


def test_round_checkpoints_resume_up_to_the_first_missing_round(tmp_path):
    from ttc.cli import read_checkpoints

    f = tmp_path / "r.jsonl.rounds.jsonl"
    rows = [(0, "a", 0), (0, "a", 1), (0, "a", 3), (1, "b", 1), (2, "c", 1), (2, "c", 0)]
    f.write_text("".join(json.dumps({"run_key": "k", "index": i, "problem_key": pk, "round": t,
                                     "record": {"t": t, "pk": pk}}) + "\n" for i, pk, t in rows))
    got = read_checkpoints(f, "k")
    assert got[(0, "a")] == [{"t": 0, "pk": "a"}, {"t": 1, "pk": "a"}]  # round 3 without round 2: not resumable
    assert got[(1, "b")] == []  # no round 0
    assert got[(2, "c")] == [{"t": 0, "pk": "c"}, {"t": 1, "pk": "c"}]  # written out of order
    with pytest.raises(ValueError, match="different settings"):
        read_checkpoints(f, "other")


def test_a_corrupt_line_before_the_last_refuses_to_resume(tmp_path):
    from ttc.cli import read_results

    f = tmp_path / "r.jsonl"
    good = json.dumps({"type": "problem", "run_key": "k", "index": 0, "status": "ok"})
    f.write_text(good + "\n{\"type\": \"prob\n" + good + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2 is not JSON; cannot resume from it"):
        read_results(f, "k")
    failed = json.dumps({"type": "problem", "run_key": "k", "index": 1, "status": "failed"})
    f.write_text(good + "\n" + failed + "\n" + json.dumps({"type": "summary", "run_key": "zz"}) + "\n")
    assert [r["index"] for r in read_results(f, "k")] == [0]  # a failed problem is tried again; the summary skipped


# -- the server backend's retry timing and n-splitting (scripted transport) -------------------------


class _Scripted(OpenAIBackend):
    """An OpenAIBackend whose ``_call`` answers from a script instead of a socket (``/v1/models`` lists m1)."""

    def __init__(self, replies=(), **kw):
        self.replies, self.sent = list(replies), []
        super().__init__("http://127.0.0.1:9/v1", **kw)

    def _call(self, method, path, body, **kw):
        if path == "/v1/models":
            return {"data": [{"id": "m1", "max_model_len": 512}]}
        self.sent.append(body)
        return self.replies.pop(0)


def _choices(k, ids=(5, 6)):
    return {"choices": [{"index": j, "text": "x", "token_ids": list(ids), "finish_reason": "stop"} for j in range(k)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2 * k}}


def test_backoff_doubles_from_backoff_up_to_its_cap_and_retry_after_is_capped_at_the_horizon(monkeypatch):
    import ttc.backends as b

    monkeypatch.setattr(b.random, "uniform", lambda lo, hi: hi)  # full jitter's upper end
    be = _Scripted(backoff=0.5, horizon=10.0)
    assert [be._delay(k, None) for k in range(1, 10)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert be._delay(1, 2.0) == pytest.approx(2.0 + 0.25)  # Retry-After 2 s, jitter up to 0.1 * 2 + 0.05
    assert be._delay(3, 5.0) == pytest.approx(5.0 + 0.55)  # the server's wait, not the exponential one
    assert be._delay(1, 9.5) == 10.0 and be._delay(1, 300.0) == 10.0  # never past the retry horizon
    assert be._delay(1, 0.0) == pytest.approx(0.05)


def test_retry_after_values():
    assert retry_after("3") == 3.0 and retry_after("0.5") == 0.5
    assert retry_after("-7") == 0.0  # a negative wait is no wait
    assert retry_after(None) is None and retry_after("") is None and retry_after("soon") is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past


def test_n_is_split_into_requests_of_at_most_max_n_with_their_own_seeds(tok):
    be = _Scripted([_choices(2), _choices(2), _choices(1)], tokenizer=tok, max_n=2)
    usage: dict = {}
    out = be.generate([[1, 2, 3]], SamplingParams(n=5, max_tokens=4), seeds=[11], usage=usage)
    assert [b["n"] for b in be.sent] == [2, 2, 1]
    seeds = [b["seed"] for b in be.sent]
    assert seeds[0] == 11 and len(set(seeds)) == 3  # the later parts are not the first one's samples again
    assert len(out) == 5 and all(c.prompt_index == 0 for c in out)
    assert usage == {"requests": 3, "prompt_tokens": 9, "completion_tokens": 10}


def test_fewer_choices_are_topped_up_and_empty_replies_retried_up_to_retries(tok):
    be = _Scripted([{"choices": []}, _choices(1), {"choices": []}, _choices(2)], tokenizer=tok, retries=2)
    out = be.generate([[1, 2]], SamplingParams(n=3, max_tokens=4), seeds=[4])
    assert len(out) == 3 and [b["n"] for b in be.sent] == [3, 3, 2, 2]
    be = _Scripted([{"choices": []}] * 3, tokenizer=tok, retries=2)
    from ttc.backends import ServerError

    with pytest.raises(ServerError, match="no choices 3 times for n=1"):
        be.generate([[1, 2]], SamplingParams(n=1, max_tokens=4), seeds=[4])
    assert len(be.sent) == 3


def test_the_servers_max_model_len_is_the_context(tok):
    assert _Scripted(tokenizer=tok).context_length() == 512


def test_a_request_larger_than_the_token_cap_goes_alone_when_nothing_is_in_flight():
    lim = Limiter(10)
    done = threading.Event()

    def big():
        lim.acquire(50)
        done.set()

    threading.Thread(target=big, daemon=True).start()
    assert done.wait(2.0) and lim.used == 50
    lim.release(50)
    lim.acquire(4)
    lim.acquire(6)  # 4 + 6 fits the cap of 10
    assert lim.used == 10 and lim.peak == 50


# -- template files ---------------------------------------------------------------------------------


def test_template_file_validation(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text('candidate: "<{index}> {tail}\\n"\n')
    t = load_template(str(f))  # no base: the generic template's other texts
    assert t.base == "generic" and t.solve == GENERIC.solve and t.aggregate == GENERIC.aggregate
    f.write_text("answer_format: regex\n")
    with pytest.raises(ValueError, match="answer_format must be 'boxed' or 'code', got 'regex'"):
        load_template(str(f))
    f.write_text("solve: '{problem}'\nsolution: x\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_template(str(f))
    f.write_text("solve: '{problem} in {language}'\n")  # a field the solve prompt has no value for
    with pytest.raises(ValueError, match=r"fields \['language', 'problem'\]; needs \['problem'\], allows \['problem'\]"):
        load_template(str(f))
    f.write_text("base: nope\n")
    with pytest.raises(ValueError, match="base 'nope' is not one of"):
        load_template(str(f))


# -- a run with a failed problem (scripted backend, no model) ---------------------------------------


def test_a_failed_problem_exits_1_keeps_its_round_checkpoints_and_is_the_only_one_solved_on_resume(
        tmp_path, capsys, tok, monkeypatch):
    """A problem whose requests keep failing is recorded as failed, the run exits with status 1 and keeps the round
    checkpoints; --resume solves that problem alone. A --context equal to the model's own is accepted."""
    import ttc.cli as cli
    from tests.test_ttc import ScriptedBackend
    from ttc.backends import ServerError

    state = {"fail": True, "seen": []}

    class Backend(ScriptedBackend):
        def generate(self, prompts, params, seeds=None):
            texts = [self.decode(p) for p in prompts]
            state["seen"] += texts
            if state["fail"] and any("bad" in t for t in texts):
                raise ServerError("no successful reply from http://x/v1/completions after 9 attempt(s): HTTP 503")
            return super().generate(prompts, params, seeds)

        def context_length(self):
            return 300

        def close(self):
            pass

    monkeypatch.setattr(cli, "build_backend", lambda a: Backend(tok))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "2"}) + "\n" for q in ("1+1?", "a bad one")))
    out = tmp_path / "r.jsonl"
    args = ["solve", "--data", data, "--model", "unused", "--population", "2", "--aggregate", "1", "--rounds", "0",
            "--budget", "40", "--tail", "4", "--final-budget", "0", "--context", "300", "--out", out, "--no-progress"]
    rc, stdout, err = _cli(capsys, *args)
    assert rc == 1, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    summary = lines[-1]
    assert (summary["problems"], summary["failed"], summary["failed_indices"]) == (2, 1, [1])
    assert summary["context"] == 300
    failed = [r for r in lines if r.get("status") == "failed"]
    assert [r["index"] for r in failed] == [1] and failed[0]["error"].startswith("ServerError: no successful reply")
    assert out.with_name("r.jsonl.rounds.jsonl").exists()  # a failed problem: the checkpoints stay
    state.update(fail=False, seen=[])
    rc, _, err = _cli(capsys, *args, "--resume")
    assert rc == 0, err
    assert state["seen"] and all("bad" in t for t in state["seen"])  # only the failed problem was solved again
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["index"] for r in lines if r["type"] == "problem") == [0, 1]
    assert lines[-1]["failed"] == 0 and not out.with_name("r.jsonl.rounds.jsonl").exists()


# -- the chat backend -------------------------------------------------------------------------------


def test_reply_text_puts_back_the_thinking_a_reasoning_parser_split_off():
    from ttc.backends import reply_text

    assert reply_text("42", None, "stop") == "42"  # no parser at work
    assert reply_text("So 42.", "let me see", "stop") == "<think>\nlet me see\n</think>\n\nSo 42."
    assert reply_text(None, "let me see", "stop") == "<think>\nlet me see\n</think>\n\n"  # stopped right after it
    assert reply_text(None, "let me", "length") == "<think>\nlet me"  # cut inside the thinking: left open
    assert reply_text(None, "more", "length", prefix="<think>\nearlier") == "more"  # a continued tail: open already
    assert reply_text(None, "the answer is 4", "stop", prefix="<think>\nx\n</think>\n\n") == "the answer is 4"


def test_the_chat_backend_continues_an_assistant_text_after_the_mark(tok):
    from ttc.backends import ASSISTANT_MARK, ChatBackend

    class Chat(ChatBackend):
        def __init__(self, **kw):
            self.sent = []
            super().__init__("http://127.0.0.1:9", **kw)

        def _call(self, method, path, body, **kw):
            if path == "/v1/models":
                return {"data": [{"id": "m1"}]}
            self.sent.append(body)
            return {"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]}

    be = Chat(tokenizer=tok)
    sp = SamplingParams(n=1, max_tokens=5)
    be.generate([be.encode("Solve 1+1." + ASSISTANT_MARK)], sp, seeds=[1])
    be.generate([be.encode("Solve 1+1." + ASSISTANT_MARK + "<think>\nso far")], sp, seeds=[1])
    plain, cont = be.sent
    assert plain["messages"] == [{"role": "user", "content": "Solve 1+1."}]
    assert "continue_final_message" not in plain and "add_generation_prompt" not in plain
    assert cont["messages"] == [{"role": "user", "content": "Solve 1+1."},
                                {"role": "assistant", "content": "<think>\nso far"}]
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False


# -- status codes on a real socket ------------------------------------------------------------------


class _StatusServer:
    """127.0.0.1 server: GET lists model m1; each POST takes the next (status, headers, body) of ``script``."""

    def __init__(self, script):
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.script, self.arrivals = list(script), []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj, headers=()):
                data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()  # (bytes: a body as it is)
                self.send_response(code)
                for k, v in (("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers):
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.endswith("/v1/models") and not self.path.startswith("/missing"):
                    return self._send(200, {"data": [{"id": "m1"}]})
                self._send(404, {"error": {"message": "no such route"}})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.arrivals.append(time.monotonic())
                code, headers, body = outer.script.pop(0)
                self._send(code, body, headers)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


def test_504_and_503_are_retried_after_retry_after_and_400_and_404_are_not(tok):
    from ttc.backends import OpenAIBackend

    ok = (200, (), {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "stop"}]})
    s = _StatusServer([(504, (), {"error": {"message": "gateway"}}), (503, (("Retry-After", "0.3"),), {}), ok,
                       (400, (), {"error": {"message": "prompt too long"}})])
    try:
        be = OpenAIBackend(s.url, tokenizer=tok, backoff=0.01, retries=3)
        out = be.generate([[1, 2]], SamplingParams(n=1, max_tokens=2), seeds=[0])
        assert [c.token_ids for c in out] == [[5]] and len(s.arrivals) == 3 and be.retried == 2
        assert s.arrivals[2] - s.arrivals[1] >= 0.3  # the server's Retry-After, not the 0.01 s backoff
        with pytest.raises(ValueError, match="server rejected /v1/completions: HTTP 400: prompt too long"):
            be.generate([[1, 2]], SamplingParams(n=1, max_tokens=2), seeds=[0])
        assert len(s.arrivals) == 4  # a 400 is not retried
        be.close()
        with pytest.raises(ValueError, match="answered 404 to /v1/models: no such route"):
            OpenAIBackend(s.url + "/missing", tokenizer=tok)
    finally:
        s.stop()


def test_malformed_200_replies_are_sent_again_and_named_when_they_last(tok):
    """A 200 whose body is garbled (invalid UTF-8, cut-off JSON) or is JSON of another shape (a list, choices that are
    no list of objects, usage no object) is sent again like a 503; when no good reply comes, the error names it.
    (They raised UnicodeDecodeError and AttributeError out of the backend, not retried.)"""
    from ttc.backends import OpenAIBackend, ServerError

    ok = (200, (), {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "stop"}]})
    bad = [b"\xff\xfe{", b'{"choices": [', [], {"choices": "x"}, {"choices": [1]},
           {"choices": ok[2]["choices"], "usage": 7}]
    s = _StatusServer([(200, (), b) for b in bad] + [ok] + [(200, (), b) for b in bad])
    try:
        be = OpenAIBackend(s.url, tokenizer=tok, backoff=0.01, retries=len(bad))
        out = be.generate([[1, 2]], SamplingParams(n=1, max_tokens=2), seeds=[0])
        assert [c.token_ids for c in out] == [[5]] and be.retried == len(bad)
        be.close()
        readable, finished = "no readable reply from .* after 1 attempt\\(s\\): ", "after 1 attempt\\(s\\): "
        for body, why in zip(bad, (readable + "a reply body that is no JSON \\('utf-8' codec",
                                   readable + "a reply body that is no JSON \\(Expecting value",
                                   finished + "a reply that is no JSON object \\(list\\)",
                                   finished + "a reply whose choices are no list of objects",
                                   finished + "a reply whose choices are no list of objects",
                                   finished + "a reply whose usage is no object")):
            be = OpenAIBackend(s.url, tokenizer=tok, backoff=0.01, retries=0)
            with pytest.raises(ServerError, match=why):
                be.generate([[1, 2]], SamplingParams(n=1, max_tokens=2), seeds=[0])
            be.close()
    finally:
        s.stop()
