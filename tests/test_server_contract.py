"""What an OpenAI client and Cascade's rollout client see of the OpenAI-compatible server (:mod:`train.engine.server`)
and what :class:`~train.engine.remote.RemoteEngine` makes of a server's answers: streamed event shapes, logprob
offsets, error bodies, field bounds, batching keys, and the client's retry, seeding and answer checks. Over a stub
engine (no model): each test takes well under a second."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from train.engine import SamplingParams
from train.engine.base import Completion
from train.engine import server as server_mod
from train.engine.remote import RemoteEngine, RemoteError, logprob_mismatch
from train.engine.server import Batcher, serve_in_thread
from tests.test_ttc_serve import call  # (its key is this file's KEY)

KEY = "k3y"


class _Tok:
    """Token t is the letter chr(97 + t % 26), token 0 ("a") the one special token; a chat template that joins
    the messages' contents."""

    all_special_ids: list[int] = [0]
    eos_token_id = None

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return "".join(chr(97 + t % 26) for t in ids if not (skip_special_tokens and t == 0))

    @staticmethod
    def encode(text, add_special_tokens=False, **kw):
        return [ord(c) - 97 for c in text]

    @staticmethod
    def apply_chat_template(msgs, tokenize=False, **kw):
        return "".join(m["content"] for m in msgs)


class _Stub:
    """A served engine stand-in: each prompt's completion is tokens 1, 2, 3, ... (letters b, c, d, ...) up to
    ``max_tokens``, with log-probs -0.1, -0.2, ...; the seeds of every generate call are recorded; a prompt
    starting with 66 raises ValueError (a bad request the engine finds)."""

    tokenizer = _Tok

    def __init__(self, context_length: int = 10, script=None):
        self.context_length = context_length
        self.script = script  # (token ids, finish reason) of every completion instead
        self.seeds: list = []
        self.version = 0

    def encode(self, prompts):
        return [list(p) for p in prompts]

    def decode(self, ids):
        return _Tok.decode(ids)

    def generate(self, prompts, params, seeds=None, **kw):
        if any(p and p[0] == 66 for p in prompts):
            raise ValueError("prompt starts with 66 (simulated bad input)")
        self.seeds.extend(seeds or [])
        if self.script is not None:
            ids, why = self.script
            return [Completion(list(ids), _Tok.decode(ids), [-1.0] * len(ids), why, i, len(p), None,
                               versions=[0] * len(ids)) for i, p in enumerate(prompts) for _ in range(params.n)]
        k = min(params.max_tokens, self.context_length - max(len(p) for p in prompts))
        return [Completion(list(range(1, k + 1)), _Tok.decode(range(1, k + 1)), [-0.1 * (t + 1) for t in range(k)],
                           "length", i, len(p), list(p), versions=[self.version] * k)
                for i, p in enumerate(prompts) for _ in range(params.n)]


@pytest.fixture
def served():
    eng = _Stub()
    srv, url = serve_in_thread(eng, model_name="m", api_key=KEY)
    yield eng, srv, url
    srv.shutdown()
    srv.server_close()


def events(url, path, body):
    """The ``data:`` payloads of a streamed answer, in order (JSON decoded, ``[DONE]`` as the string)."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        raw = r.read().decode()
    out = []
    for block in raw.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- the server ----------------------------------------------------------------------------------------------


def test_streamed_completions_end_with_done_and_slice_logprobs_per_chunk(served):
    """Streamed ``text_completion`` chunks: per choice the text pieces (here one letter a token), each chunk's
    logprobs the slice of its tokens (adding up to the whole answer's), a last chunk with the finish reason, no usage
    chunk unless ``stream_options.include_usage``, then ``[DONE]``."""
    _, _, url = served
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 3, "n": 2, "logprobs": 0, "seed": 1}
    ev = events(url, "/v1/completions", body)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert [c["text"] for c in mine] == ["b", "c", "d", ""]
        assert [c["finish_reason"] for c in mine] == [None, None, None, "length"]
        lps = [c["logprobs"] for c in mine[:-1]]
        assert [lp["token_logprobs"] for lp in lps] == [[pytest.approx(-0.1)], [pytest.approx(-0.2)],
                                                        [pytest.approx(-0.3)]]
        assert [lp["tokens"] for lp in lps] == [["b"], ["c"], ["d"]]
        assert [lp["text_offset"] for lp in lps] == [[0], [1], [2]]
    ev = events(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == []
    assert ev[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


def test_streamed_chat_chunks(served):
    """Streamed ``chat.completion.chunk`` chunks: a role delta first, content deltas, a finish chunk with an empty
    delta, then ``[DONE]``; ``prompt_tokens`` counts the template's tokens once."""
    _, _, url = served
    ev = events(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in ev[:-1])
    assert [c["choices"][0]["delta"] for c in ev[:-2]] == [{"role": "assistant", "content": ""}, {"content": "b"},
                                                          {"content": "c"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in ev[:-2]] == [None, None, None, "length"]
    assert ev[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_a_stop_token_is_not_text_when_special_tokens_are_left_out():
    """A completion holding a special token is decoded again without it (skip_special_tokens, the default); the
    stop token that ended it is no more text then than in the engine's own decode."""
    srv, url = serve_in_thread(_Stub(script=([1, 0, 2, 3], "stop")), model_name="m")
    try:
        body = {"prompt": [5], "max_tokens": 5, "stop_token_ids": [3]}
        assert call(url, "/v1/completions", body)[1]["choices"][0]["text"] == "bc"
        assert call(url, "/v1/completions", {**body, "skip_special_tokens": False})[1]["choices"][0]["text"] == "bacd"
        # an engine that names no prompt ids (this one): a chat choice's are the template's
        code, r = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert code == 200 and r["choices"][0]["prompt_token_ids"] == [7, 8]
    finally:
        srv.shutdown()
        srv.server_close()


def test_completion_logprobs_name_tokens_with_text_offsets(served):
    """``logprobs`` (OpenAI's legacy form): each token's text and its offset into the choice's text; choices are
    indexed 0..n-1; ``"logprobs": false`` or absent gives none."""
    _, _, url = served
    code, r = call(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "n": 2, "logprobs": 0})
    assert code == 200 and [ch["index"] for ch in r["choices"]] == [0, 1]
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == "bcde" and lp["tokens"] == ["b", "c", "d", "e"]
    assert lp["text_offset"] == [0, 1, 2, 3] and lp["top_logprobs"] is None
    assert lp["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    for extra in ({"logprobs": False}, {}):
        code, r = call(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, **extra})
        assert code == 200 and r["choices"][0]["logprobs"] is None


def test_error_bodies_name_their_kind(served):
    """Errors answer ``{"error": {"message", "type", "code"}}`` with OpenAI's type names; an engine's ValueError on a
    prompt is the request's fault (400), not the server's (500)."""
    _, _, url = served
    code, r = call(url, "/v1/completions", {"prompt": [5], "model": "other"})
    assert code == 404 and r["error"]["type"] == "NotFoundError" and r["error"]["code"] == 404
    code, r = call(url, "/v1/models", key="wrong")
    assert code == 401 and r["error"]["type"] == "AuthenticationError"
    code, r = call(url, "/v1/completions", {"prompt": [5], "n": "x"})
    assert code == 400 and r["error"]["type"] == "BadRequestError"
    code, r = call(url, "/v1/completions", {"prompt": [66, 1], "max_tokens": 2})
    assert code == 400 and "simulated bad input" in r["error"]["message"]


def test_request_field_bounds(served):
    """``max_tokens`` up to the context is taken (cut to the room left), one past it refused; a list of token-id
    prompts holds no empty one; ``routed_experts_format`` is list or base64."""
    _, _, url = served
    code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 10})
    assert code == 200 and len(r["choices"][0]["token_ids"]) == 9
    code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 11})
    assert code == 400 and "max_model_len=10" in r["error"]["message"]
    code, r = call(url, "/v1/completions", {"prompt": [[5], []], "max_tokens": 2})
    assert code == 400 and "prompt must be" in r["error"]["message"]
    for bools in ([True, 6], [[5, False]]):  # JSON booleans are no token ids (they were read as 1 and 0)
        code, r = call(url, "/v1/completions", {"prompt": bools, "max_tokens": 2})
        assert code == 400 and "prompt must be" in r["error"]["message"], bools
    for seed in (2 ** 63, -2 ** 63 - 1, 2 ** 70):  # int64, as vLLM's server (2**70 wrapped around)
        code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, "seed": seed})
        assert code == 400 and r["error"]["message"] == f"seed must be an integer in [-2**63, 2**63 - 1], got {seed}"
    for seed in (2 ** 63 - 1, -2 ** 63, -1):
        assert call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, "seed": seed})[0] == 200, seed
    code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, "return_routed_experts": True,
                                            "routed_experts_format": "npy"})
    assert code == 400 and "routed_experts_format" in r["error"]["message"]


def test_unsupported_boolean_fields_read_like_every_other_flag(served):
    """``use_beam_search``, ``include_stop_str_in_output`` and ``watermarking`` are read as the server's other
    boolean fields: false, 0 or "false" change nothing (0 was refused while ``ignore_eos`` took it), true in any
    form is refused as unsupported, anything else is refused as no boolean."""
    _, _, url = served
    for name in ("use_beam_search", "include_stop_str_in_output", "watermarking"):
        for off in (False, 0, "false", "FALSE", None):
            code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, name: off})
            assert code == 200, (name, off, r)
        for on in (True, 1, "true"):
            code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, name: on})
            assert code == 400 and r["error"]["message"].startswith(f"{name}=") and "not supported" in \
                r["error"]["message"], (name, on, r)
        code, r = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, name: "maybe"})
        assert code == 400 and r["error"]["message"] == f'{name} must be true or false, got "maybe"', r


class _Recorder:
    """An engine stand-in for the batcher that records each generate call's params and prompt count."""

    def __init__(self):
        self.calls: list = []

    def generate(self, prompts, params, seeds=None, **kw):
        time.sleep(0.05)
        self.calls.append((len(prompts), params, bool(kw.get("return_routed_experts"))))
        return [Completion([1], "x", [0.0], "length", i, len(p), list(p)) for i, p in enumerate(prompts)
                for _ in range(params.n)]


@pytest.mark.parametrize("a, b", [
    ({"stop": ["x"]}, {"stop": ["y"]}),
    ({"max_tokens": 3}, {"max_tokens": 4}),
    ({"n": 1}, {"n": 2}),
    ({"stop_token_ids": [4]}, {}),
    ({"logit_bias": {3: 1.0}}, {}),
])
def test_requests_with_other_sampling_settings_are_not_batched_together(a, b):
    """Two requests that arrive together but differ in a sampling setting run as two generate calls, each with its
    own settings (batched, the second would be sampled with the first's)."""
    eng = _Recorder()
    bat = Batcher(eng, window_s=0.2, max_wait_s=0.5)
    try:
        outs = {}
        ts = [threading.Thread(target=lambda k, kw: outs.__setitem__(k, bat.submit([[5, 6]], SamplingParams(**kw))),
                               args=(k, kw)) for k, kw in (("a", a), ("b", b))]
        for t in ts:
            t.start()
            time.sleep(0.02)
        for t in ts:
            t.join(10)
        assert sorted(n for n, _, _ in eng.calls) == [1, 1]
        assert len(outs["a"]) == SamplingParams(**a).n and len(outs["b"]) == SamplingParams(**b).n
        got = sorted(((p.stop, p.max_tokens, p.n, p.stop_token_ids, p.logit_bias) for _, p, _ in eng.calls), key=repr)
        want = sorted(((p.stop, p.max_tokens, p.n, p.stop_token_ids, p.logit_bias)
                       for p in (SamplingParams(**a), SamplingParams(**b))), key=repr)
        assert got == want
    finally:
        bat.close()


def test_routed_and_plain_requests_are_not_batched_together():
    """A request for routed experts and one without, arriving together, are two generate calls: only the first
    asks the engine to record the routing."""
    eng = _Recorder()
    bat = Batcher(eng, window_s=0.2, max_wait_s=0.5)
    try:
        ts = [threading.Thread(target=bat.submit, args=([[5, 6]], SamplingParams()), kwargs={"return_routed_experts": r})
              for r in (True, False)]
        for t in ts:
            t.start()
            time.sleep(0.02)
        for t in ts:
            t.join(10)
        assert sorted(r for _, _, r in eng.calls) == [False, True]
    finally:
        bat.close()


# -- the client ----------------------------------------------------------------------------------------------


def test_remote_engine_takes_urls_with_v1_and_trailing_slashes(served):
    _, _, url = served
    remote = RemoteEngine([url + "/v1/"], api_key=KEY)
    assert remote.urls == [url + "/v1"] and remote.model == "m" and remote.context_length == 10
    assert [c.token_ids for c in remote.generate([[5, 6]], SamplingParams(max_tokens=2))] == [[1, 2]]
    with pytest.raises(ValueError, match="duplicate"):
        RemoteEngine([url, url + "/"], api_key=KEY)


def test_remote_engine_derives_a_seed_per_prompt_from_params_seed(served):
    """With ``params.seed`` only, the prompts of a call get seeds of their own (two copies of one prompt are
    sampled apart), the same at every call."""
    eng, _, url = served
    remote = RemoteEngine([url], api_key=KEY, per_server=1)
    remote.generate([[5, 6], [5, 6]], SamplingParams(max_tokens=1, seed=9))
    first, eng.seeds[:] = list(eng.seeds), []
    remote.generate([[5, 6], [5, 6]], SamplingParams(max_tokens=1, seed=9))
    assert len(set(first)) == 2 and sorted(eng.seeds) == sorted(first)


def test_remote_engine_takes_the_smallest_context_of_its_servers():
    servers = [serve_in_thread(_Stub(context_length=c), model_name="m") for c in (20, 10, 30)]
    try:
        assert RemoteEngine([u for _, u in servers]).context_length == 10
    finally:
        for srv, _ in servers:
            srv.shutdown()
            srv.server_close()


def _edited(monkeypatch, edit):
    """Serve the stub with every completions answer's choices passed through ``edit(choice)``."""
    orig = server_mod.Handler.completions
    monkeypatch.setattr(server_mod.Handler, "completions",
                        lambda self, body: (lambda out: {**out, "choices": [edit(dict(ch)) for ch in out["choices"]]})(
                            orig(self, body)))
    return serve_in_thread(_Stub(), model_name="m")


def test_remote_engine_reads_ids_from_token_id_logprob_tokens(monkeypatch):
    """A server that gives no ``token_ids`` (a vLLM older than return_token_ids): the ids are read from its
    ``token_id:N`` logprob tokens; prompt_tokens counts the prompt's ids."""
    srv, url = _edited(monkeypatch, lambda ch: {**{k: v for k, v in ch.items() if k != "token_ids"}})
    try:
        got = RemoteEngine([url]).generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        assert got[0].token_ids == [1, 2, 3] and got[0].prompt_tokens == 3 and got[0].prompt_token_ids == [5, 6, 7]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("edit, msg", [
    (lambda ch: {**ch, "token_ids": ch["token_ids"][:-1]}, "3 logprobs for 2 tokens"),
    (lambda ch: {**ch, "versions": ch["versions"][:-1]}, "2 versions for 3 tokens"),
])
def test_remote_engine_refuses_answers_whose_lengths_disagree(monkeypatch, edit, msg):
    srv, url = _edited(monkeypatch, edit)
    try:
        with pytest.raises(RemoteError, match=msg):
            RemoteEngine([url]).generate([[5, 6]], SamplingParams(max_tokens=3))
    finally:
        srv.shutdown()
        srv.server_close()


def test_remote_engine_refuses_an_answer_without_routed_experts(served):
    """Routed experts asked for and the server's engine records none (a dense model): an error, not completions
    without them."""
    _, _, url = served
    with pytest.raises(RemoteError, match="no routed_experts"):
        RemoteEngine([url], api_key=KEY).generate([[5, 6]], SamplingParams(max_tokens=2), return_routed_experts=True)


_ONE_TOKEN = {"instance": "i1", "choices": [{"token_ids": [1], "text": "b", "finish_reason": "stop",
                                            "logprobs": {"token_logprobs": [-1.0]}}]}


class _OneModelHandler(BaseHTTPRequestHandler):
    """A stand-in server serving model ``m`` (instance ``i1``); subclasses answer POSTs with ``_send``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        self._send({"data": [{"id": "m"}], "instance": "i1"})


def test_remote_engine_sends_again_on_a_fresh_connection_when_a_kept_alive_one_went_stale():
    """A server that closes each connection after its answer (without saying so): the next request on the kept-alive
    connection fails at once and is sent again on a fresh one; the server stays in the pool."""
    seen = []

    class H(_OneModelHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["prompt"])
            self._send(_ONE_TOKEN)
            self.close_connection = True  # closed with no "Connection: close"

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        remote = RemoteEngine([url], per_server=1)
        got = remote.generate([[1], [2], [3]], SamplingParams(max_tokens=1))
        assert len(got) == 3 and remote.alive == {url} and remote.resent == 0 and sorted(seen) == [[1], [2], [3]]
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_interrupted_remote_generate_stops_without_waiting_for_its_requests():
    """``interrupt()`` from another thread (a pipelined run stopping): the generate running raises
    GenerationInterrupted while the server still holds its request, one started meanwhile raises at once, and after
    ``interrupt(False)`` the engine generates again."""
    from train.engine.base import GenerationInterrupted

    got_request, release = threading.Event(), threading.Event()

    class H(_OneModelHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            got_request.set()
            release.wait(30)  # a long generation
            self._send(_ONE_TOKEN)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        remote = RemoteEngine([url], per_server=1)
        raised = []

        def run():
            try:
                remote.generate([[1], [2]], SamplingParams(max_tokens=1))
            except BaseException as e:  # noqa: BLE001
                raised.append(e)

        th = threading.Thread(target=run)
        th.start()
        assert got_request.wait(30)
        remote.interrupt()
        th.join(10)
        assert not th.is_alive() and not release.is_set()  # ended while the server still held its request
        assert len(raised) == 1 and isinstance(raised[0], GenerationInterrupted)
        with pytest.raises(GenerationInterrupted):
            remote.generate([[3]], SamplingParams(max_tokens=1))
        remote.interrupt(False)
        release.set()
        assert len(remote.generate([[4]], SamplingParams(max_tokens=1))) == 1
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


def test_remote_engine_counts_only_prompts_resent_after_a_server_went_down(monkeypatch):
    """An unfinished choice (vLLM's abort) is asked again from the same server: not counted in ``resent``."""
    reasons = ["abort"]
    srv, url = _edited(monkeypatch, lambda ch: {**ch, "finish_reason": reasons.pop(0) if reasons else "stop"})
    try:
        remote = RemoteEngine([url], per_server=1)
        got = remote.generate([[5, 6]], SamplingParams(max_tokens=2))
        assert [c.finish_reason for c in got] == ["stop"] and remote.requests[url] == 2 and remote.resent == 0
    finally:
        srv.shutdown()
        srv.server_close()


def test_remote_engine_health_and_load_version_arguments(served):
    """``health`` says a server that does not answer is not ok; ``load_version`` takes exactly one of version or
    path."""
    _, srv, url = served
    remote = RemoteEngine([url], api_key=KEY)
    with pytest.raises(ValueError, match="exactly one"):
        remote.load_version(1, path="v000001")
    with pytest.raises(ValueError, match="exactly one"):
        remote.load_version()
    assert remote.health()[url]["ok"] is True
    srv.shutdown()
    srv.server_close()
    h = remote.health()[url]
    assert h["ok"] is False and h["version"] is None and h["error"]


def test_logprob_mismatch_names_each_change_processed_logprobs_carry():
    """vLLM's processed_logprobs are the trainer's quantity only when nothing changes the distribution: top_p and
    logit_bias do; raw_logprobs are at temperature 1, which greedy sampling is taken at."""
    assert "top_p" in logprob_mismatch("processed_logprobs", SamplingParams(top_p=0.9))
    assert "logit_bias" in logprob_mismatch("processed_logprobs", SamplingParams(logit_bias={3: 1.0}))
    assert "top_k" in logprob_mismatch("processed_logprobs", SamplingParams(top_k=5))
    assert logprob_mismatch("processed_logprobs", SamplingParams(top_p=1.0)) is None
    assert logprob_mismatch("raw_logprobs", SamplingParams(temperature=0.0)) is None
    assert "temperature 1" in logprob_mismatch("raw_logprobs", SamplingParams(temperature=0.5))
    assert "not log_softmax" in logprob_mismatch("logits", SamplingParams())


# -- over the tiny dense model (the module fixture of tests/test_ttc_serve.py) ---------------------------------

from tests.test_ttc_serve import server  # noqa: E402,F401 (fixture)


def test_top_logprobs_take_the_requests_temperature_and_up_to_20(server):  # noqa: F811
    """``logprobs: k`` gives the k most likely tokens under softmax(logits / T) at the request's temperature (as the
    sampled tokens' own logprobs are); k runs 0..20 (vLLM's default cap), 21 is a 400."""
    import torch

    eng, url = server
    ids = eng.tokenizer.encode("What is 2+2?", add_special_tokens=False)
    code, r = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0.5, "seed": 3,
                                            "logprobs": 20, "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert code == 200
    ch = r["choices"][0]
    with torch.no_grad():
        logits = eng.model(torch.tensor([ids + ch["token_ids"]]))[0, len(ids) - 1:-1]
    want = torch.log_softmax(logits / 0.5, -1)
    for pos, (t, top) in enumerate(zip(ch["token_ids"], ch["logprobs"]["top_logprobs"])):
        assert len(top) == 20
        best = want[pos].topk(20)
        assert {f"token_id:{i}" for i in best.indices.tolist()} == set(top)
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
        assert ch["logprobs"]["token_logprobs"][pos] == pytest.approx(want[pos, t].item(), abs=1e-4)
    code, r = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 2, "logprobs": 21})
    assert code == 400 and "logprobs must be an integer from 0 to 20" in r["error"]["message"]
    msgs = [{"role": "user", "content": "hi"}]
    code, r = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "logprobs": True,
                                                 "top_logprobs": 21})
    assert code == 400 and "top_logprobs must be an integer from 0 to 20" in r["error"]["message"]


def test_logit_bias_below_minus_100_is_clamped_to_it(server):  # noqa: F811
    """As vLLM's server, a bias past [-100, 100] counts as the bound: -300 on the greedy token and -100 on every
    other one is a uniform shift (the greedy token again), not one that rules it out."""
    eng, url = server
    ids = eng.tokenizer.encode("What is 2+2?", add_special_tokens=False)
    g = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    vocab = eng.model.config.vocab_size
    bias = {str(t): -100 for t in range(vocab)}
    bias[str(g)] = -300
    code, r = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "logit_bias": bias})
    assert code == 200 and r["choices"][0]["token_ids"] == [g]
