"""``ttc`` against a scripted server on 127.0.0.1 (the one of tests/test_ttc_scale.py): a round with a refused
request spends (and records) nothing after it fails, a template's ``force_answer`` is rendered as its other
fields are, the resume key ignores how a template file was named and an explicit default grader, and a reply
that did not finish (``abort``, ``content_filter``, no finish reason) is retried, never taken as a stop."""
from __future__ import annotations

import io
import json
import time

import pytest

from tests.test_ttc import ScriptedBackend
from tests.test_ttc_scale import FakeAPI, _args, _cli, _data, _Handler, _lines, tok  # noqa: F401 (tok: a fixture)
from train.engine import SamplingParams
from ttc.rsa import MarkovianRSA, RSAConfig
from ttc.templates import PromptBuilder, load_template


class _RefuseOneAggregate(_Handler):
    """The first aggregation request is refused at once (400); the others are answered after ``hold`` seconds."""

    def do_POST(self):
        s = self.server
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.rfile = io.BytesIO(raw)  # read again by _Handler.do_POST
        if "--- Candidate 1" in s.tok.decode(json.loads(raw).get("prompt") or []):
            with s.lock:
                s.aggregates = getattr(s, "aggregates", 0) + 1
                first = s.aggregates == 1
            if first:
                with s.lock:
                    s.arrivals.append(time.monotonic())
                return self._send(400, {"error": {"message": "prompt too long"}})
            time.sleep(s.hold)
        return super().do_POST()


@pytest.mark.timeout(60)
def test_a_failed_round_waits_for_its_other_requests_and_records_what_they_spent(tmp_path, capsys, tok,
                                                                               tiny_dense_dir):
    """generate returned at the first request that raised: the problem was recorded failed with the usage counted
    so far while the round's other requests went on in the shared pool (holding --concurrency slots), and what
    they spent was never counted."""
    srv = FakeAPI(tok, handler=_RefuseOneAggregate)
    srv.hold = 0.6
    try:
        data = _data(tmp_path / "d.jsonl", 1)
        out = tmp_path / "r.jsonl"
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--concurrency", 8, "--price-in", 1000,
                                        "--price-out", 1000))
        with srv.lock:
            at_return = (len(srv.arrivals), srv.completions, srv.in_flight)
        time.sleep(srv.hold + 0.4)
        with srv.lock:
            later = (len(srv.arrivals), srv.completions, srv.in_flight)
    finally:
        srv.stop()
    assert rc == 1, err
    rec = _lines(out)[0]
    assert rec["status"] == "failed" and "prompt too long" in rec["error"]
    # round 1 (population 4): the refused request, and the held ones sent before it failed (one not started by
    # then is never sent); every request the server answered (round 0's and the held ones) is in the record, priced
    assert 2 <= srv.aggregates <= 4
    assert rec["usage"]["requests"] == srv.completions == 1 + srv.aggregates - 1, (rec["usage"], srv.completions)
    assert rec["cost"] == pytest.approx((rec["usage"]["prompt_tokens"] + rec["usage"]["completion_tokens"]) * 1e-3)
    # nothing was still in flight when main returned, and nothing reached the server after it
    assert at_return == later and at_return[2] == 0, (at_return, later)


def test_force_answer_is_rendered_as_the_other_fields(tmp_path, tok):
    """``force_answer`` was encoded raw while it is checked as a str.format string: ``{{`` reached the model
    doubled and a single ``{`` was refused, so ``\\boxed{`` could not be written."""
    f = tmp_path / "force.yaml"
    f.write_text('base: math\nforce_answer: "\\n</think>\\n\\nThe final answer is \\\\boxed{{"\n')
    t = load_template(str(f))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    text = tok.decode(PromptBuilder(t, enc).force_answer())
    assert text.endswith("The final answer is \\boxed{") and "{{" not in text, text
    # the final-answer step of a cut trace sends it so, and the plan counts the tokens sent
    rsa = MarkovianRSA(ScriptedBackend(tok), RSAConfig(population=2, aggregate=1, rounds=0, budget=4, tail=4,
                                                       final_budget=3), str(f))
    res = rsa.run("What is 1+1?", gold="2")
    finals = [p for p in res.prompts if p.stage == "final"]
    assert finals and all(tok.decode(p.prompt_ids).endswith("\\boxed{") for p in finals)
    plan = rsa.plan(0)
    solve = rsa.builder.solve([])
    assert plan[-1]["prompt"] == len(solve) + 4 + len(enc("\n</think>\n\nThe final answer is \\boxed{"))
    f.write_text('base: math\nforce_answer: "\\\\boxed{"\n')  # a single brace: refused with the fix to write
    with pytest.raises(ValueError, match="force_answer.*literal braces"):
        load_template(str(f))


def test_the_resume_key_takes_a_template_file_by_content_and_the_grader_resolved(tmp_path, capsys, tok,
                                                                               tiny_dense_dir, monkeypatch):
    """The key held the template file's path as typed (relative and absolute paths of one file differed) and the
    raw --grader (an explicit ``--grader math`` under the math template differed from the default), so --resume
    refused the run's own results."""
    from ttc.cli import run_key

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.yaml").write_text('base: math\nsolve: "{problem}\\n\\nAnswer in \\\\boxed{{}}."\n')
    cfg = RSAConfig(population=2, aggregate=1)
    rel, absolute = load_template("t.yaml"), load_template(str(tmp_path / "t.yaml"))
    assert run_key(cfg, rel, None) == run_key(cfg, absolute, None) == run_key(cfg, absolute, "math")
    assert run_key(cfg, load_template("math"), None) == run_key(cfg, load_template("math"), "math")
    assert run_key(cfg, load_template("math"), None) != run_key(cfg, load_template("math"), "exact")
    assert run_key(cfg, load_template("generic"), None) == run_key(cfg, load_template("generic"), "exact")
    # another content is another key, whatever the file is called
    (tmp_path / "u.yaml").write_text('base: math\nsolve: "{problem}\\n\\nFinal answer in \\\\boxed{{}}."\n')
    assert run_key(cfg, load_template("u.yaml"), None) != run_key(cfg, rel, None)
    srv = FakeAPI(tok)
    try:
        data = _data(tmp_path / "d.jsonl", 2)
        out = tmp_path / "r.jsonl"
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--template", "t.yaml"))
        assert rc == 0, err
        served = srv.completions
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--template", tmp_path / "t.yaml",
                                        "--grader", "math", "--resume"))
        assert rc == 0, err
        assert srv.completions == served  # both problems resumed from the file, none solved again
    finally:
        srv.stop()


class _Unfinished(FakeAPI):
    """Replies ``unfinished`` times with the finish reason ``reason`` (None: the field left out), then as usual."""

    reason: str | None = "abort"
    unfinished = 0

    def reply(self, prompt_text, seed, j, max_tokens):
        ids, text, fin = super().reply(prompt_text, seed, j, max_tokens)
        with self.lock:
            if self.unfinished > 0:
                self.unfinished -= 1
                return ids, text, self.reason
        return ids, text, fin


class _UnfinishedHandler(_Handler):
    def _send(self, code, obj, headers=()):
        for ch in obj.get("choices", []):
            if ch.get("finish_reason") is None:
                ch.pop("finish_reason", None)  # missing, not null
        return super()._send(code, obj, headers)


@pytest.mark.parametrize("reason", ["abort", "content_filter", None])
def test_a_reply_that_did_not_finish_is_retried_never_taken_as_a_stop(tok, reason):
    """Every finish reason but ``length`` counted as ``stop``: a trace a server aborted (or filtered, or sent without
    a finish reason) was taken as finished and graded. It is now a failed request, retried as a 5xx is."""
    from ttc.backends import ChatBackend, OpenAIBackend, ServerError

    for cls in (OpenAIBackend, ChatBackend):
        srv = _Unfinished(tok, handler=_UnfinishedHandler)
        srv.reason = reason
        try:
            be = cls(srv.url, model="m1", tokenizer=tok, retries=2, backoff=0.0)
            sp = SamplingParams(n=1, max_tokens=64)
            srv.unfinished = 100
            with pytest.raises(ServerError, match=f"finish_reason {reason!r}"):
                be.generate([[5, 6, 7]], sp, seeds=[1])
            assert len(srv.arrivals) == 3  # the request and its two retries
            srv.unfinished, usage = 1, {}
            outs = be.generate([[5, 6, 7]], sp, seeds=[1], usage=usage)
            be.close()
        finally:
            srv.stop()
        assert [c.finish_reason for c in outs] == ["stop"] and be.retried == 3, cls
        assert len(srv.arrivals) == 5 and usage["requests"] == 2  # the unfinished reply was served, and counted


class _NoUsageHandler(_Handler):
    def _send(self, code, obj, headers=()):
        return super()._send(code, {k: v for k, v in obj.items() if k != "usage"}, headers)


def test_a_server_that_reports_no_token_counts_is_not_priced_as_free(tmp_path, capsys, tok, tiny_dense_dir):
    """A server that sends no ``usage`` left only the request count, which ``--price-in``/``--price-out`` priced at
    0.0: a paid run reported free. Its cost is now unknown (None), and the run says why."""
    srv = FakeAPI(tok, handler=_NoUsageHandler)
    try:
        out = tmp_path / "r.jsonl"
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, _data(tmp_path / "d.jsonl", 2), out,
                                        "--price-in", 2.0, "--price-out", 10.0))
    finally:
        srv.stop()
    assert rc == 0, err
    recs = _lines(out)
    assert recs[-1]["usage"]["requests"] > 0 and "prompt_tokens" not in recs[-1]["usage"]
    assert [r["cost"] for r in recs] == [None] * len(recs)
    assert err.count("no token counts") == 1, err


def test_close_stops_the_requests_that_are_retrying(tok):
    """``close()`` left a request against a failing server retrying until the retry horizon (15 minutes by
    default); it now ends at once, with a ServerError, and the message of one given up on HTTP errors does not say
    the server cannot be reached."""
    import threading

    from ttc.backends import OpenAIBackend, ServerError

    srv = FakeAPI(tok, fail_500=1.0)
    try:
        be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, retries=1000, backoff=0.05, backoff_max=0.1,
                           horizon=30)
        brief = OpenAIBackend(srv.url, model="m1", tokenizer=tok, retries=2, backoff=0.0)
        with pytest.raises(ServerError, match="no successful reply") as e:
            brief.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=8, seed=1))
        brief.close()
        assert "cannot reach" not in str(e.value)
        got = {}

        def go():
            try:
                be.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=8, seed=1))
            except Exception as err:  # noqa: BLE001 - recorded for the assertion
                got["error"] = err

        th = threading.Thread(target=go, daemon=True)
        th.start()
        time.sleep(0.4)
        with srv.lock:
            before = len(srv.arrivals)
        be.close()
        th.join(timeout=2.0)
        time.sleep(0.3)
        with srv.lock:
            after = len(srv.arrivals) - before
    finally:
        srv.stop()
    assert before > 2 and not th.is_alive() and isinstance(got.get("error"), ServerError), got
    assert after < 3, after


def test_a_delethink_carry_past_the_thinking_keeps_its_think_close(tok):
    """A chain cut inside its answer, with its ``</think>`` before the last ``tail`` tokens, was continued from a carry
    with no ``</think>``: a reasoning parser took the continuation for thinking, the chat backend closed it after the
    model's answer, and the answer was lost. The carry now puts the ``</think>`` back before the tail, within the
    tail's tokens (the chunk's context stays within the plan)."""
    from tests.test_ttc_scale import _ReasoningParser
    from ttc.backends import ChatBackend

    class AnswersPastItsThinking(_ReasoningParser):
        """Behind an R1 reasoning parser: the first chunk thinks, writes ``</think>`` and a long answer cut at the
        budget; a continuation (its prompt holds the answer's ``radius`` words) ends it with ``\\boxed{7}``."""

        def reply(self, prompt_text, seed, j, max_tokens):
            if "radius" in prompt_text:
                ids = self.tok.encode("so \\boxed{7}.", add_special_tokens=False) + [self.eos]
                return ids, self.tok.decode(ids[:-1]), "stop"
            text = "<think>\nadd them\n</think>\n\nThe answer follows " + "radius " * 40
            ids = self.tok.encode(text, add_special_tokens=False)[:max_tokens]
            return ids, self.tok.decode(ids), "length"

    srv = AnswersPastItsThinking(tok)
    try:
        be = ChatBackend(srv.url, model="m1", tokenizer=tok, retries=1, backoff=0.0)
        rsa = MarkovianRSA(be, RSAConfig(population=1, rounds=1, budget=24, tail=6, anchor=0, final_budget=0,
                                         variant="delethink"), "math")
        res = rsa.run("What is 3+4?", gold="7")
        be.close()
    finally:
        srv.stop()
    cont = [p for p in res.prompts if p.stage == "continue"]
    assert len(cont) == 1 and res.final[0].finish_reason == "stop"
    carry = cont[0].forwarded[0]
    assert len(carry) <= 6 and tok.decode(carry).startswith("</think>") and "radius" in tok.decode(carry)
    plan = {s["stage"]: s["prompt"] for s in rsa.plan(len(be.encode("What is 3+4?")))}
    assert len(cont[0].prompt_ids) <= plan["continue"]
    assert res.final[0].answer == "7" and res.metrics["mean_accuracy"] == 1.0, res.final[0].response
