"""``ttc solve`` at benchmark scale against a scripted OpenAI-compatible server on 127.0.0.1:
429s with Retry-After and random 500s, fewer choices than asked, a global cap on requests in
flight (the server records the peak), problems that fail, the context plan check, a resume after
``kill -9`` mid-run, the resume key, traces, usage and cost, dataset column mapping and the
chat-completions backend."""
from __future__ import annotations

import json
import os
import random
import socket
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import wait_until
from ttc.rsa import derive_seed

ROOT = Path(__file__).resolve().parents[1]


class FakeAPI(ThreadingHTTPServer):
    """Scripted completions: the reply depends only on the request's seed and prompt (the answer
    is ``7`` or ``8``); answers 429 (with Retry-After) and 500 at random, at most ``max_choices``
    choices per response, and records requests (and when they arrive), seeds and the peak of requests
    in flight."""

    daemon_threads = True

    def __init__(self, tokenizer, fail_500=0.0, fail_429=0.0, delay=0.0, max_choices=None, context=4096,
                 models=("m1", "m2"), handler=None):
        self.connections: list[socket.socket] = []
        super().__init__(("127.0.0.1", 0), handler or _Handler)
        self.tok, self.fail_500, self.fail_429, self.delay = tokenizer, fail_500, fail_429, delay
        self.max_choices, self.context, self.models = max_choices, context, models
        self.rng = random.Random(0)
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        self.completions = self.errors = 0
        self.arrivals: list[float] = []  # time.monotonic() of every POST
        self.bodies: list[dict] = []  # every POST's body
        self.poison = "POISON"
        self.eos = tokenizer.eos_token_id
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self):
        self.shutdown()
        self.server_close()

    def get_request(self):
        sock, addr = super().get_request()
        self.connections.append(sock)
        return sock, addr

    def close_idle(self) -> None:
        """Close every client connection, as a server closes idle keep-alive connections."""
        for c in self.connections:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def reply(self, prompt_text: str, seed: int, j: int, max_tokens: int) -> tuple[list[int], str, str]:
        rng = random.Random(derive_seed(seed, j))
        words = " ".join(rng.choice(["sum", "check", "list"]) for _ in range(rng.randint(2, 12)))
        text = f"<think>\n{words}\n</think>\n\nSo \\boxed{{{rng.choice(['7', '7', '8'])}}}."
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eos]
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            return ids, self.tok.decode(ids), "length"
        return ids, self.tok.decode(ids[:-1]), "stop"

    def chat_message(self, text: str) -> dict:
        return {"role": "assistant", "content": text}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj, headers=()):
        self._leave()  # counted out before the reply leaves, so a client's next request never overlaps it
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    counted = False

    def _leave(self):
        if self.counted:
            s = self.server
            with s.lock:
                s.in_flight -= 1
            self.counted = False

    def do_GET(self):
        s = self.server
        self._send(200, {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": s.context}
                                                    for m in s.models]})

    def do_POST(self):
        s: FakeAPI = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with s.lock:
            s.arrivals.append(time.monotonic())
            s.bodies.append(body)
            s.in_flight += 1
            s.peak = max(s.peak, s.in_flight)
            r = s.rng.random()
        self.counted = True
        try:
            time.sleep(s.delay)
            if r < s.fail_429:
                with s.lock:
                    s.errors += 1
                return self._send(429, {"error": {"message": "slow down"}}, [("Retry-After", "0.02")])
            if r < s.fail_429 + s.fail_500:
                with s.lock:
                    s.errors += 1
                return self._send(500, {"error": {"message": "injected"}})
            chat = self.path == "/v1/chat/completions"
            if chat:
                msgs = body["messages"]
                prompt_text = "".join(m["content"] for m in msgs)
                plen = len(s.tok.encode(prompt_text, add_special_tokens=False))
            else:
                prompt_text = s.tok.decode(body["prompt"])
                plen = len(body["prompt"])
            if s.poison in prompt_text:
                return self._send(400, {"error": {"message": "this prompt is refused"}})
            n = int(body.get("n", 1))
            k = min(n, s.max_choices or n)
            choices, gen = [], 0
            for j in range(k):
                budget = body["max_completion_tokens"] if chat else body["max_tokens"]  # as OpenAI's current API
                ids, text, fin = s.reply(prompt_text, int(body.get("seed", 0)), j, int(budget))
                gen += len(ids)
                ch = {"index": j, "finish_reason": fin}
                if chat:
                    ch["message"] = s.chat_message(text)
                else:
                    ch.update(text=text, token_ids=ids)
                choices.append(ch)
            with s.lock:
                s.completions += 1
            self._send(200, {"choices": choices,
                             "usage": {"prompt_tokens": plen, "completion_tokens": gen, "total_tokens": plen + gen}})
        finally:
            self._leave()


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dense_dir)


def _data(path: Path, n: int, extra: list[str] = ()) -> Path:
    rows = [{"problem": f"Problem {i}: what is {i} + {7 - i}?", "answer": "7"} for i in range(n)]
    rows += [{"problem": p, "answer": "7"} for p in extra]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(url, tiny_dense_dir, data, out, *more):
    return ["solve", "--data", str(data), "--base-url", url, "--model", "m1", "--tokenizer", str(tiny_dense_dir),
            "--population", "4", "--aggregate", "2", "--rounds", "1", "--budget", "24", "--tail", "6",
            "--final-budget", "8", "--seed", "5", "--out", str(out), "--no-progress", "--backoff", "0.01",
            *map(str, more)]


def _cli(capsys, args):
    from ttc.cli import main

    rc = main(args)
    o, e = capsys.readouterr()
    return rc, o, e


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_twenty_problems_through_429s_and_500s_with_a_cap_on_requests_in_flight(tmp_path, capsys, tok,
                                                                                  tiny_dense_dir):
    srv = FakeAPI(tok, fail_500=0.15, fail_429=0.15, delay=0.01, max_choices=3)
    try:
        data = _data(tmp_path / "d.jsonl", 20)
        out, traces = tmp_path / "r.jsonl", tmp_path / "traces.jsonl"
        rc, stdout, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--concurrency", 6,
                                             "--save-traces", traces, "--price-in", 2.0, "--price-out", 10.0))
    finally:
        srv.stop()
    assert rc == 0, err
    recs = _lines(out)
    probs, summary = recs[:-1], recs[-1]
    assert sorted(r["index"] for r in probs) == list(range(20)) and all(r["status"] == "ok" for r in probs)
    assert summary["problems"] == 20 and summary["failed"] == 0 and srv.errors > 5
    # the cap: never more than 6 requests in flight, and problems interleave (more than one round's N=4)
    assert 4 < srv.peak <= 6
    # n=4 was topped up from responses of at most 3 choices; every population is complete
    rounds = [r for r in _lines(traces) if r["type"] == "round"]
    assert len(rounds) == 40 and all(len(r["population"]) == 4 for r in rounds)
    for p in rounds[-1]["prompts"]:  # prompts and tails as token ids and as text
        assert p["prompt_text"] == tok.decode(p["prompt_ids"]) and len(p["forwarded_text"]) == len(p["forwarded"])
    # subsets and seeds differ across problems
    parents = {r["index"]: [p["parents"] for p in r["prompts"]] for r in rounds if r["round"] == 1}
    assert len({json.dumps(v) for v in parents.values()}) > 10
    seeds = {r["index"]: r["prompts"][0]["seed"] for r in rounds if r["round"] == 0}
    assert len(set(seeds.values())) == 20
    # usage as the server reported it, and its cost
    u = summary["usage"]
    assert u["completion_tokens"] == summary["generated_tokens"] and u["requests"] >= 20 * 5
    assert summary["cost"] == pytest.approx((u["prompt_tokens"] * 2.0 + u["completion_tokens"] * 10.0) / 1e6)
    assert set(summary["pass_at_k"]) == {"1", "2", "4"} and len(summary["round_majority_accuracy"]) == 2
    assert not out.with_name(out.name + ".rounds.jsonl").exists()  # all done: the round checkpoints are gone


def test_failed_problem_is_recorded_and_retried_on_resume(tmp_path, capsys, tok, tiny_dense_dir):
    srv = FakeAPI(tok)
    try:
        data = _data(tmp_path / "d.jsonl", 3, extra=["POISON problem"])
        out = tmp_path / "r.jsonl"
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--concurrency", 4))
        assert rc == 1
        recs = _lines(out)
        bad = [r for r in recs if r.get("status") == "failed"]
        assert len(bad) == 1 and bad[0]["index"] == 3 and "refused" in bad[0]["error"]
        assert recs[-1]["failed"] == 1 and recs[-1]["failed_indices"] == [3] and recs[-1]["problems"] == 4
        before = srv.completions
        srv.poison = "never matches"
        rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--concurrency", 4, "--resume"))
        assert rc == 0, err
        recs = _lines(out)
        ok = sorted((r for r in recs if r["type"] == "problem" and r["status"] == "ok"), key=lambda r: r["index"])
        assert [r["index"] for r in ok] == [0, 1, 2, 3] and recs[-1]["failed"] == 0
        assert srv.completions - before == ok[3]["requests"]  # only the failed problem ran again
        # the resume key covers the model: the same file with another model is refused
        other = [x if x != "m1" else "m2" for x in _args(srv.url, tiny_dense_dir, data, out, "--resume")]
        rc, _, err = _cli(capsys, other)
        assert rc == 2 and "different settings" in err
    finally:
        srv.stop()


def test_the_summary_counts_what_failed_problems_spent_and_prices_a_resume_at_its_prices(tmp_path, capsys, tok,
                                                                                     tiny_dense_dir):
    """A problem failing in round 1 had its round 0 served and billed, yet the summary said usage None, cost None;
    a resume at other prices summed each run's own costs."""
    srv = FakeAPI(tok)
    srv.poison = "--- Candidate 1"  # every aggregation prompt refused: round 0 served, round 1 fails
    try:
        data = _data(tmp_path / "d.jsonl", 2)
        out = tmp_path / "r.jsonl"
        rc, stdout, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--price-in", 1.0, "--limit", 1))
        assert rc == 1
        summary = _lines(out)[-1]
        assert summary["failed"] == 1 and summary["usage"]["requests"] >= 1 and summary["cost"] > 0
        srv.poison = "never matches"
        rc, stdout, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--price-in", 1000.0, "--resume"))
        assert rc == 0, err
    finally:
        srv.stop()
    summary = _lines(out)[-1]
    assert summary["failed"] == 0 and summary["cost"] == pytest.approx(summary["usage"]["prompt_tokens"] * 1e-3)


def test_plan_check_refuses_before_generating_or_clamps(tmp_path, capsys, tok, tiny_dense_dir):
    srv = FakeAPI(tok, context=340)
    try:
        data = _data(tmp_path / "d.jsonl", 2)
        out = tmp_path / "r.jsonl"
        args = _args(srv.url, tiny_dense_dir, data, out)
        args[args.index("--budget") + 1] = "150"
        rc, _, err = _cli(capsys, args)
        assert rc == 2 and err.count("\n") == 1 and "context 340" in err and "--clamp" in err, err
        assert srv.completions == 0  # nothing was generated
        rc, stdout, err = _cli(capsys, args + ["--clamp"])
        assert rc == 0, err
        summary = json.loads(stdout.splitlines()[-1])
        assert summary["context"] == 340 and summary["clamped"]["budget"][0] == 150
        assert summary["config"]["budget"] == summary["clamped"]["budget"][1] < 150 and "clamped" in err
    finally:
        srv.stop()


def test_resume_after_kill_9_loses_at_most_one_round(tmp_path, tok, tiny_dense_dir):
    srv = FakeAPI(tok, delay=0.08)
    try:
        data = _data(tmp_path / "d.jsonl", 3)
        out = tmp_path / "r.jsonl"
        ckpt = out.with_name(out.name + ".rounds.jsonl")
        args = _args(srv.url, tiny_dense_dir, data, out, "--rounds", 3, "--concurrency", 1,
                     "--problems-in-flight", 1)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen([sys.executable, "-m", "ttc", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline and (not ckpt.exists() or len(ckpt.read_text().splitlines()) < 6):
            assert p.poll() is None, p.stderr.read().decode()
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        # the request the kill cut off finishes on the server (and is counted) first
        wait_until(lambda: not srv.in_flight, 10, every=0.01)
        killed = srv.completions
        completed = [r for r in _lines(out) if r.get("status") == "ok"] if out.exists() else []
        saved = [json.loads(x) for x in ckpt.read_text().splitlines() if x.strip().endswith("}")]
        assert 6 <= len(saved) < 12 and len(completed) >= 1  # problem 0 (4 rounds) done, problem 1 mid-way
        finished = {r["index"] for r in completed}
        kept = sum(r["requests"] for r in completed) + sum(len(r["record"]["prompts"]) for r in saved
                                                           if r["index"] not in finished)
        assert killed - kept <= 4  # lost: at most the round (N = 4 requests) in progress
        srv.delay = 0.0
        from ttc.cli import main

        before = srv.completions
        assert main(args + ["--resume"]) == 0
        resumed = srv.completions - before
        # an uninterrupted run of the same settings, for the request count and the results
        out2 = tmp_path / "fresh.jsonl"
        a2 = list(args)
        a2[a2.index("--out") + 1] = str(out2)
        before = srv.completions
        assert main(a2) == 0
        total = srv.completions - before
    finally:
        srv.stop()
    assert resumed == total - kept  # nothing checkpointed was asked for again
    # the resumed run's results equal the uninterrupted run's
    strip = lambda rs: sorted(({k: v for k, v in r.items() if k not in ("wall_s",)} for r in rs[:-1]),  # noqa: E731
                              key=lambda r: r["index"])
    assert strip(_lines(out)) == strip(_lines(out2))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_cleanly_and_resume_goes_on(tmp_path, tiny_dense_dir, sig):
    """SIGINT mid-run of a local engine: a one-line message, exit 130 (no traceback, no abort from a thread
    left in native code), and --resume finishes the run. SIGTERM (a scheduler's preemption or time limit)
    stops it the same way, exit 143 (it ended the process at once, with no word; its rounds are kept as
    Ctrl-C's are, so only the Ctrl-C case resumes here), here with two problems in flight: the third never
    starts (the pool of problems once ran every queued one before the signal got through)."""
    data = _data(tmp_path / "d.jsonl", 3)
    out = tmp_path / "r.jsonl"
    ckpt = out.with_name(out.name + ".rounds.jsonl")
    args = ["solve", "--data", str(data), "--model", str(tiny_dense_dir), "--population", "4", "--aggregate", "2",
            "--rounds", "3", "--budget", "96", "--tail", "8", "--threads", "1", "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if sig == signal.SIGTERM:
        args += ["--problems-in-flight", "2"]
    # (SIGINT back to its default in the child: a launcher that ran this suite in the background ignores it)
    p = subprocess.Popen([sys.executable, "-m", "ttc", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpt.exists() and ckpt.read_text().strip()):
        assert p.poll() is None, p.stderr.read().decode()
        time.sleep(0.05)
    p.send_signal(sig)
    err = p.communicate(timeout=60)[1].decode()
    how = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert p.returncode == (130 if sig == signal.SIGINT else 143), (p.returncode, err)
    assert err.strip() == f"ttc solve: {how}; rerun with --resume to go on", err
    assert ckpt.read_text().strip()
    if sig == signal.SIGTERM:
        assert len([x for x in _lines(out) if x["type"] == "problem"]) < 3 if out.exists() else True
        assert 2 not in {json.loads(x)["index"] for x in ckpt.read_text().splitlines() if x.strip()}
        return
    r = subprocess.run([sys.executable, "-m", "ttc", *args, "--resume"], cwd=ROOT, env=env, capture_output=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert sorted(x["index"] for x in _lines(out) if x["type"] == "problem") == [0, 1, 2]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_mid_generation_exits_without_waiting_for_the_engine(tmp_path, tiny_dense_dir, sig):
    """A signal while a local engine is inside a long generation (here the final-answer step, started once round 0's
    checkpoint is written) exits at once: the engine, which main leaves running, is not waited for (closing it
    joined its thread for up to 60 s, until the generation under way ended)."""
    out = tmp_path / "r.jsonl"
    ckpt = out.with_name(out.name + ".rounds.jsonl")
    args = ["solve", "--data", str(_data(tmp_path / "d.jsonl", 1)), "--model", str(tiny_dense_dir), "--population",
            "64", "--rounds", "0", "--budget", "4", "--final-budget", "3500", "--threads", "1", "--out", str(out),
            "--no-progress"]
    p = subprocess.Popen([sys.executable, "-m", "ttc", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline and not (ckpt.exists() and ckpt.read_text().strip()):
        assert p.poll() is None, p.stderr.read().decode()
        time.sleep(0.05)
    time.sleep(0.5)  # the final-answer generation is under way
    t = time.time()
    p.send_signal(sig)
    err = p.communicate(timeout=60)[1].decode()
    assert p.returncode == (130 if sig == signal.SIGINT else 143), (p.returncode, err)
    assert time.time() - t < 3, f"exited {time.time() - t:.1f} s after the signal"
    assert _lines(out) == []  # it was stopped mid-generation: no result yet


def test_a_model_the_server_does_not_list_is_refused_before_any_request(tmp_path, capsys, tok, tiny_dense_dir):
    srv = FakeAPI(tok)
    try:
        args = _args(srv.url, tiny_dense_dir, _data(tmp_path / "d.jsonl", 2), tmp_path / "r.jsonl")
        args[args.index("--model") + 1] = "nope"
        rc, _, err = _cli(capsys, args)
    finally:
        srv.stop()
    assert rc == 2 and "does not serve model 'nope'" in err and "'m1', 'm2'" in err and srv.completions == 0


def test_dataset_columns_and_the_chat_backend(tmp_path, capsys, tok, tiny_dense_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["What is 3 + 4?", "What is 1 + 6?"], "solution": [7, 7],
                             "id": [0, 1]}), tmp_path / "aime.parquet")
    srv = FakeAPI(tok)
    try:
        out = tmp_path / "r.jsonl"
        args = _args(srv.url, tiny_dense_dir, tmp_path / "aime.parquet", out)
        rc, _, err = _cli(capsys, args)
        assert rc == 2 and "lacks column(s) problem" in err and "--column" in err
        rc, _, err = _cli(capsys, args + ["--column", "problem=question,answer=solution", "--api", "chat",
                                          "--variant", "delethink", "--rounds", "2"])
        assert rc == 0, err
        recs = _lines(out)
        assert [r["answer"] for r in recs[:-1]] == ["7", "7"] and recs[-1]["failed"] == 0
        assert recs[-1]["round_accuracy"] is not None and recs[-1]["usage"]["requests"] >= 2
        rc, _, err = _cli(capsys, args + ["--column", "problem=nope"])
        assert rc == 2 and "problem=nope" in err
    finally:
        srv.stop()


class _AnswersWhenForced(FakeAPI):
    """A model that answers at once when told to stop thinking (the final-answer step of a cut trace)."""

    def reply(self, prompt_text, seed, j, max_tokens):
        if "final answer now" not in prompt_text[-200:]:
            return super().reply(prompt_text, seed, j, max_tokens)
        ids = self.tok.encode("So \\boxed{7}.", add_special_tokens=False) + [self.eos]
        return ids, self.tok.decode(ids[:-1]), "stop"


class _ReasoningParser(_AnswersWhenForced):
    """As vLLM with ``--reasoning-parser deepseek_r1`` (``BaseThinkingReasoningParser.extract_reasoning``): a
    reply's text up to ``</think>`` is ``reasoning``, the rest ``content`` (null when empty), and a reply with
    no ``</think>`` (cut inside its thinking, or continuing an answer) is all reasoning."""

    def chat_message(self, text):
        head, mark, rest = text.partition("<think>")
        text = rest if mark else head
        if "</think>" not in text:
            return {"role": "assistant", "content": None, "reasoning": text}
        reasoning, _, content = text.partition("</think>")
        return {"role": "assistant", "content": content or None, "reasoning": reasoning}


def test_the_chat_backend_reads_replies_split_by_a_reasoning_parser(tmp_path, capsys, tok, tiny_dense_dir):
    """Traces cut inside their thinking get the final-answer step, whose answer counts, as without a parser
    (a made-up ``</think>`` closed every cut trace, and the answer continuation was wrapped in thinking)."""
    data = _data(tmp_path / "d.jsonl", 3)
    results = {}
    for cls in (_AnswersWhenForced, _ReasoningParser):
        srv = cls(tok)
        try:
            out = tmp_path / f"{cls.__name__}.jsonl"
            rc, _, err = _cli(capsys, _args(srv.url, tiny_dense_dir, data, out, "--api", "chat", "--budget", 6))
            assert rc == 0, err
            forced = sum("final answer now" in m["content"] for b in srv.bodies for m in b["messages"])
            results[cls] = ([r["answers"] for r in _lines(out)[:-1]], _lines(out)[-1]["mean_accuracy"], forced)
        finally:
            srv.stop()
    plain, parsed = results[_AnswersWhenForced], results[_ReasoningParser]
    # (a reply cut right after its </think> reads as cut inside the thinking: content is null either way)
    assert plain[2] > 0 and parsed[2] >= plain[2] and plain[1] >= 0.75 and parsed[1] >= plain[1], (plain, parsed)


def test_the_chat_backend_sends_the_same_sampling_fields(tok):
    """Stop strings and ids, ``ignore_eos``, ``top_k``, ``min_p``, the penalties and the seed reach the server by chat as by
    completions (the chat backend once dropped the stops and ``ignore_eos``); the length budget goes by chat as
    ``max_completion_tokens`` (OpenAI's reasoning models refuse ``max_tokens``; vLLM and SGLang take either);
    completions name top_k, min_p and the penalties even when off."""
    from train.engine import SamplingParams
    from ttc.backends import ChatBackend, OpenAIBackend

    srv = FakeAPI(tok)
    try:
        sp = SamplingParams(n=2, max_tokens=8, top_k=5, min_p=0.1, stop=["\n\n"], stop_token_ids=[3],
                            ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.2)
        for cls in (OpenAIBackend, ChatBackend):
            be = cls(srv.url, model="m1", tokenizer=tok, retries=0)
            be.generate([[5, 6, 7]], sp, seeds=[11])
            be.close()
        sent = [{k: b[k] for k in b if k not in ("prompt", "messages")} for b in srv.bodies]
        fields = {"n": 2, "temperature": 1.0, "top_p": 1.0, "seed": 11, "top_k": 5, "min_p": 0.1,
                  "stop": ["\n\n"], "stop_token_ids": [3], "ignore_eos": True, "repetition_penalty": 1.1,
                  "presence_penalty": 0.5, "frequency_penalty": -0.2}
        assert len(sent) == 2 and all(b.items() >= fields.items() for b in sent), sent
        assert sent[0]["max_tokens"] == 8 and sent[1]["max_completion_tokens"] == 8 and "max_tokens" not in sent[1]
        # unset, completions still name them (a vLLM server fills a field left out from the model's
        # generation_config.json, not with the engine's off); chat, for any API, leaves them out
        for cls in (OpenAIBackend, ChatBackend):
            be = cls(srv.url, model="m1", tokenizer=tok, retries=0)
            be.generate([[5, 6, 7]], SamplingParams(max_tokens=8), seeds=[11])
            be.close()
        plain, chat = srv.bodies[-2:]
        neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0}
        assert plain.items() >= neutral.items() and not set(neutral) & set(chat), (plain, chat)
    finally:
        srv.stop()


class _KeepAliveHandler(_Handler):
    protocol_version = "HTTP/1.1"


def test_requests_keep_their_connection_and_survive_idle_closes(tok):
    from train.engine import SamplingParams
    from ttc.backends import OpenAIBackend

    srv = FakeAPI(tok, handler=_KeepAliveHandler)
    try:
        be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, concurrency=1, retries=0)
        sp = SamplingParams(n=2, max_tokens=32, seed=1)
        outs = [be.generate([[5, 6, 7]], sp) for _ in range(10)]
        # /v1/models from this thread, then ten requests over the request worker's one connection
        assert len(srv.connections) == 2 and srv.completions == 10
        srv.close_idle()
        again = be.generate([[5, 6, 7]], sp)  # the worker's connection is gone: sent again on a new one
        assert [c.token_ids for c in again] == [c.token_ids for c in outs[0]]
        assert len(srv.connections) == 3 and be.retried == 0 and srv.completions == 11
        be.close()
    finally:
        srv.stop()


def test_a_request_given_up_says_how_many_attempts_reached_the_server(tok):
    """Given up at the retry horizon, the attempt about to wait was counted as sent (one too many)."""
    import re

    from train.engine import SamplingParams
    from ttc.backends import OpenAIBackend, ServerError

    for retries, horizon in [(50, 0.15), (3, 60.0)]:
        srv = FakeAPI(tok, fail_429=1.0)  # every request: 429, Retry-After 0.02 s
        try:
            be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, retries=retries, horizon=horizon)
            with pytest.raises(ServerError) as e:
                be.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=4), seeds=[0])
            be.close()
        finally:
            srv.stop()
        said = int(re.search(r"after (\d+) attempt", str(e.value)).group(1))
        assert said == len(srv.arrivals) and (said == retries + 1) == (horizon > 1), (str(e.value), len(srv.arrivals))


def test_the_retry_horizon_counts_from_the_first_failure_and_retry_after_is_read_as_utc_and_jittered(tok):
    """A request whose first try ran longer than the horizon was never retried (with the defaults, a 502 after a
    15-minute generation ended the problem); "-0000" and asctime Retry-After dates were read as local time (five
    hours off in New York: the client gave up at once); every client told "Retry-After: 2" came back together."""
    import os
    import time
    from email.utils import formatdate

    from train.engine import SamplingParams
    from ttc.backends import OpenAIBackend, ServerError, retry_after

    srv = FakeAPI(tok, fail_500=1.0, delay=0.4)  # every request: 0.4 s, then 500
    try:
        be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, retries=2, horizon=0.6, backoff=0.01)
        with pytest.raises(ServerError):
            be.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=4), seeds=[0])
        be.horizon = 60
        waits = {be._delay(1, 2.0) for _ in range(50)}
        be.close()
    finally:
        srv.stop()
    assert len(waits) > 40 and all(2.0 <= w <= 2.25 for w in waits)
    assert len(srv.arrivals) == 3  # the first failure, then both retries started within 0.6 s of it
    tz = os.environ.get("TZ")
    try:
        os.environ["TZ"] = "America/New_York"
        time.tzset()
        for value in (formatdate(time.time() + 30), time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(time.time() + 30))):
            assert 25 < retry_after(value) <= 31, value
    finally:
        os.environ.pop("TZ") if tz is None else os.environ.__setitem__("TZ", tz)
        time.tzset()


def test_a_request_larger_than_the_rate_limit_holds_the_window_for_its_share():
    """``--rpm 0.5`` let one request through per window (twice the rate asked for), and a request of more tokens
    than ``--tpm`` counted as the limit: a request of ``w`` units over a limit of ``L`` now goes alone and
    holds the window ``w / L`` times as long (here a 0.2 s window for a minute)."""
    from ttc.backends import RateLimiter

    for limit, weights, gaps in [(0.5, [1, 1, 1], [0.4, 0.4]), (10, [25, 5, 5], [0.5, 0.0])]:
        rl = RateLimiter(limit, window=0.2)
        times = []
        for w in weights:
            rl.acquire(w)
            times.append(time.monotonic())
        for (a, b), gap in zip(zip(times, times[1:]), gaps):
            assert gap - 0.01 <= b - a < gap + 0.1, (limit, times)


def test_a_large_request_is_not_starved_by_smaller_ones_under_the_limits():
    """``--tpm``/``--rpm`` and ``--max-tokens-in-flight`` admitted whichever waiter fitted first: a request larger than
    what was free waited while smaller later ones kept getting in (8.5 windows measured, without bound). Waiters are
    now admitted in the order they asked: it waits for the window to have room after what asked before it (here
    at most 4 x 30 units over a limit of 100: about 2.5 windows), or for what is in flight to end."""
    from ttc.backends import Limiter, RateLimiter

    def waited(acquire, release, big, hold, give_up):
        done = threading.Event()

        def small(k):  # (sent again after a request time of up to ``hold`` seconds)
            rng = random.Random(k)
            while not done.is_set():
                acquire(30)
                time.sleep(rng.uniform(0, hold))
                release(30)

        ts = [threading.Thread(target=small, args=(k,), daemon=True) for k in range(4)]
        for t in ts:
            t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        threading.Timer(give_up, done.set).start()  # (the old code: it got in once the small senders stopped)
        acquire(big)
        w = time.monotonic() - t0
        release(big)
        done.set()
        for t in ts:
            t.join()
        return w

    window = 0.2
    for big in (150, 80):  # over the limit (goes alone, once the window is empty) and within it
        rl = RateLimiter(100, window=window)
        w = waited(rl.acquire, lambda _: None, big, 0.3 * window, 8 * window)
        assert w < 3.5 * window, (big, w)
    lim = Limiter(100)
    for big in (150, 80):
        assert waited(lim.acquire, lim.release, big, 0.1, 1.0) < 0.3, big


def test_a_request_waiting_for_a_rate_slot_is_not_sent_after_close(tok):
    """A request waiting for its place under ``--tpm`` when the backend closed was still sent once the window
    turned over (up to a minute later, after the run had ended): close() now wakes it and it raises unsent."""
    from train.engine import SamplingParams
    from ttc.backends import OpenAIBackend, ServerError

    srv = FakeAPI(tok)
    try:
        be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, concurrency=2, retries=0, tpm=40, rate_window=30.0)
        errors = []

        def run():
            try:
                be.generate([[5, 6, 1], [5, 6, 2]], SamplingParams(n=1, max_tokens=32, seed=1))
            except ServerError as e:
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 10
        while srv.completions < 1 and time.monotonic() < deadline:  # the first (35 tokens) goes; the second waits
            time.sleep(0.02)
        time.sleep(0.2)
        closed = time.monotonic()
        be.close()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - closed < 2
        time.sleep(0.3)
    finally:
        srv.stop()
    assert len(srv.arrivals) == 1 and len(errors) == 1 and "closed" in str(errors[0]), (srv.arrivals, errors)


@pytest.mark.parametrize("limit,fail", [("rpm", 0.0), ("tpm", 0.0), ("rpm", 0.3)])
def test_requests_and_tokens_per_window_stay_under_the_rate_limits(tok, limit, fail):
    """``rpm``/``tpm`` (``--rpm``/``--tpm``; here over a 0.6 s window instead of a minute): 10 one-sample
    requests from 8 workers at once; the server sees at most 4 (rpm 4) or 2 (tpm 80, each request
    weighing 3 prompt + 32 max tokens) in any stretch shorter than the window, and the last arrives
    after the window has turned over as often as the limit demands. With the server answering 500 to
    30% of requests, the retries count against the limit too (a provider counts every attempt)."""
    from train.engine import SamplingParams
    from ttc.backends import OpenAIBackend

    srv = FakeAPI(tok, fail_500=fail)
    per_window = {"rpm": 4, "tpm": 2}[limit]
    window = 0.6
    try:
        be = OpenAIBackend(srv.url, model="m1", tokenizer=tok, concurrency=8, retries=20, backoff=0.0,
                           rate_window=window, **({"rpm": 4} if limit == "rpm" else {"tpm": 80}))
        t0 = time.monotonic()
        outs = be.generate([[5, 6, i] for i in range(10)], SamplingParams(n=1, max_tokens=32, seed=1))
        be.close()
    finally:
        srv.stop()
    assert len(outs) == 10 and srv.completions == 10 and (srv.errors > 0) == (fail > 0)
    t = sorted(srv.arrivals)  # every attempt, failed ones too
    # any per_window + 1 consecutive arrivals span at least the window (less the transit jitter)
    assert min(t[i + per_window] - t[i] for i in range(len(t) - per_window)) > window - 0.15, t
    assert t[-1] - t0 >= (-(-10 // per_window) - 1) * window - 0.15


def test_the_resume_key_covers_the_tokenizer_and_the_weights(tok, tiny_dense_dir, tmp_path):
    """--resume with another --tokenizer (here: a chat template that opens the thinking) mixed prompts of two
    forms in one summary, and a checkpoint trained again in place resumed into the old results."""
    import copy
    import shutil

    from train.presets import init_model
    from ttc.backends import OpenAIBackend, torch_backend

    srv = FakeAPI(tok)
    try:
        other = copy.deepcopy(tok)
        other.chat_template = tok.chat_template.replace("<|im_start|>assistant\\n", "<|im_start|>assistant\\n<think>\\n")
        assert other.chat_template != tok.chat_template
        ids = []
        for t in (tok, copy.deepcopy(tok), other, None):
            be = OpenAIBackend(srv.url, model="m1", tokenizer=t)
            ids.append(be.identity())
            be.close()
    finally:
        srv.stop()
    assert ids[0] == ids[1] and ids[0] != ids[2] and "tokenizer_sha" not in ids[3]
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dense_dir, d)
    keys = []
    for step in ("as made", "copied", "trained again"):
        if step == "copied":
            shutil.copytree(d, tmp_path / "copy")
            shutil.rmtree(d)
            (tmp_path / "copy").rename(d)
        if step == "trained again":
            init_model("tiny-dense", tmp_path / "s1", seed=1)
            shutil.copy(tmp_path / "s1" / "model.safetensors", d / "model.safetensors")
        be = torch_backend(str(d))
        keys.append(be.identity())
        be.close()
    assert keys[0] == keys[1] != keys[2]
