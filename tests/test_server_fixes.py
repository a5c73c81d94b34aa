"""The OpenAI-compatible server (:mod:`train.engine.server`) and its client :class:`RemoteEngine`: the text shown
under ``skip_special_tokens`` ends where the engine's does, fields it does not implement are refused, boolean
fields are JSON booleans, ``add_special_tokens`` is honoured, ``/health`` needs no key, and the client caps
``max_tokens`` for text prompts."""
from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
import torch

from tests.test_ttc_serve import call, server  # noqa: F401 (fixture)
from train.engine import SamplingParams, TorchEngine
from train.engine.server import serve_in_thread


def _served(path, context: int | None = None):
    """A torch engine over the checkpoint at ``path`` (its context cut to ``context``) served on a thread."""
    eng = TorchEngine.from_pretrained(path)
    if context is not None:
        eng.model.config.max_position_embeddings = context
    srv, url = serve_in_thread(eng, model_name="tiny", api_key="k3y")
    return eng, srv, url


@pytest.fixture(scope="module")
def bos_server(tiny_dense_dir, tmp_path_factory):
    """The tiny dense checkpoint with a tokenizer that puts a BOS token (``<|endoftext|>``) before every text it
    encodes with special tokens, as Llama's does; its context cut to 24 tokens."""
    d = tmp_path_factory.mktemp("tiny-bos")
    shutil.copytree(tiny_dense_dir, d, dirs_exist_ok=True)
    tj = json.loads((d / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tj["post_processor"]["single"].insert(0, bos)
    tj["post_processor"]["pair"].insert(0, bos)
    tj["post_processor"]["special_tokens"] = {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                "tokens": ["<|endoftext|>"]}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": "<|endoftext|>"}))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    eng, srv, url = _served(d, context=24)
    yield eng, url
    srv.shutdown()
    srv.server_close()
    torch.set_num_threads(old)


@pytest.mark.timeout(120)
def test_text_without_special_tokens_ends_where_the_engine_stopped(server):
    """With the default ``skip_special_tokens`` a completion holding a special token is decoded again; its stop
    strings are then looked for as the engine looks for them: none inside the first ``min_tokens`` tokens (vLLM's
    rule), so "aaa" ended by EOS under ``min_tokens: 3, stop: ["a"]`` is shown as "aaa", not cut to ""."""
    eng, url = server
    tok = eng.tokenizer
    a = tok.encode("a", add_special_tokens=False)[0]
    eos = eng.eos_token_ids[0]
    msgs = [{"role": "user", "content": "hi"}]
    ids = call(url, "/tokenize", {"messages": msgs})[1]["tokens"]
    kw = dict(max_tokens=8, min_tokens=3, stop=["a"], logit_bias={a: 100.0, eos: 100.0})
    seed = next(s for s in range(100)
                if eng.generate([ids], SamplingParams(seed=s, **kw))[0].token_ids == [a, a, a, eos])
    ref = eng.generate([ids], SamplingParams(seed=seed, **kw))[0]
    assert ref.text == "aaa" and ref.finish_reason == "stop"
    body = {"seed": seed, **kw, "logit_bias": {str(a): 100, str(eos): 100}}
    code, r = call(url, "/v1/chat/completions", {"messages": msgs, **body})
    assert code == 200 and r["choices"][0]["token_ids"] == ref.token_ids
    assert r["choices"][0]["message"]["content"] == "aaa"
    code, r = call(url, "/v1/completions", {"prompt": ids, **body})
    assert code == 200 and r["choices"][0]["token_ids"] == ref.token_ids and r["choices"][0]["text"] == "aaa"


def test_the_shared_stop_rule_takes_stops_in_list_order_past_min_tokens():
    """The rule of :func:`train.engine.torch_engine.stop_cut` (the engine's and the server's): the first stop
    string of the list that ends past the first ``min_tokens`` tokens' text, not the earliest in the text."""
    from train.engine.torch_engine import stop_cut

    decode = "".join  # tokens are characters here
    assert stop_cut(decode, list("xaby"), ["b", "a"], 0) == "xa"
    assert stop_cut(decode, list("xaby"), ["a", "b"], 0) == "x"
    assert stop_cut(decode, list("aaab"), ["a"], 3) is None
    assert stop_cut(decode, list("aaaab"), ["a"], 3) == "aaa"
    assert stop_cut(decode, list("abcd"), ["bc"], 2) == "a"  # ends past the floor: taken (as vLLM)
    assert stop_cut(decode, list("abcd"), ["ab"], 2) is None


def test_fields_that_change_the_output_are_refused(server):
    """OpenAI's legacy ``functions``/``function_call`` and vLLM's ``logits_processors`` are a 400 naming the
    field (they were answered as if absent), unless at a value that changes nothing."""
    eng, url = server
    msgs = [{"role": "user", "content": "What's the weather?"}]
    fn = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    for path, body, name in [
        ("/v1/chat/completions", {"messages": msgs, "functions": fn}, "functions="),
        ("/v1/chat/completions", {"messages": msgs, "function_call": {"name": "get_weather"}}, "function_call="),
        ("/v1/completions", {"prompt": "hi", "logits_processors": ["my.module:Proc"]}, "logits_processors="),
        ("/v1/chat/completions", {"messages": msgs, "logits_processors": [{"qualname": "m:P"}]}, "logits_processors="),
    ]:
        code, b = call(url, path, {**body, "max_tokens": 2})
        assert code == 400 and name in b["error"]["message"] and "not supported" in b["error"]["message"], b
    for noop in ({"functions": [], "function_call": "none"}, {"function_call": "auto"}, {"logits_processors": []}):
        code, b = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **noop})
        assert code == 200, b


def test_completions_honour_add_special_tokens(bos_server):
    """A text prompt of ``/v1/completions`` is encoded as ``/tokenize`` encodes it: with the tokenizer's special
    tokens (its BOS) unless ``add_special_tokens: false``, as vLLM (it was always without them)."""
    eng, url = bos_server
    tok = eng.tokenizer
    plain = tok.encode("hello world", add_special_tokens=False)
    with_bos = call(url, "/tokenize", {"prompt": "hello world"})[1]["tokens"]
    assert with_bos == [tok.bos_token_id] + plain
    for extra, want in [({}, with_bos), ({"add_special_tokens": True}, with_bos),
                        ({"add_special_tokens": False}, plain)]:
        code, r = call(url, "/v1/completions", {"prompt": "hello world", "max_tokens": 2, "seed": 1, **extra})
        assert code == 200 and r["choices"][0]["prompt_token_ids"] == want and r["usage"]["prompt_tokens"] == len(want)
        ref = eng.generate([want], SamplingParams(max_tokens=2, seed=1))[0]
        assert r["choices"][0]["token_ids"] == ref.token_ids
    code, r = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "add_special_tokens": "yes"})
    assert code == 400 and "add_special_tokens must be true or false" in r["error"]["message"]


@pytest.mark.timeout(120)
def test_remote_engine_caps_max_tokens_for_text_prompts(bos_server):
    """A text prompt's length is the server's to know: with a known context the client sends at most
    ``context - 1`` new tokens (``min_tokens`` too) and the server cuts that to the room the prompt leaves, as
    for token-id prompts (it sent ``max_tokens`` as is, a 400 past the context). Its text prompts are encoded as
    the in-process engine encodes them (no special tokens added), so the samples are the engine's."""
    from train.engine.remote import RemoteEngine

    eng, url = bos_server
    remote = RemoteEngine([url], api_key="k3y")
    try:
        assert remote.context_length == eng.context_length == 24
        for p in (SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, min_tokens=30)):
            got = remote.generate(["hello world", eng.encode(["hi"])[0]], p, seeds=[3, 4])
            ref = eng.generate(["hello world", "hi"], p, seeds=[3, 4])
            assert [c.token_ids for c in got] == [c.token_ids for c in ref]
            assert [c.prompt_token_ids for c in got] == eng.encode(["hello world", "hi"])
            assert len(got[0].token_ids) == 24 - len(eng.encode(["hello world"])[0])
    finally:
        remote.close()


def test_boolean_fields_are_json_booleans(server):
    """``"ignore_eos": "false"`` is false (it was read by truthiness: EOS turned off), as pydantic's lax mode
    reads it in vLLM (0 and 1 too); any other value is a 400 naming the field."""
    eng, url = server
    eos = eng.eos_token_ids[0]
    b = {"prompt": "hi", "max_tokens": 5, "seed": 0, "logit_bias": {str(eos): 100}}
    for v, n in [(False, 1), ("false", 1), ("False", 1), (0, 1), (True, 5), ("true", 5), (1, 5)]:
        code, r = call(url, "/v1/completions", {**b, "ignore_eos": v})
        assert code == 200 and len(r["choices"][0]["token_ids"]) == n, (v, r)
    code, r = call(url, "/v1/completions", {**b, "echo": "false", "return_routed_experts": "false",
                                            "stream": "false"})
    assert code == 200 and "routed_experts" not in r["choices"][0]
    msgs = [{"role": "user", "content": "hi"}]
    code, r = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "logprobs": "false"})
    assert code == 200 and r["choices"][0]["logprobs"] is None
    bare = call(url, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]["tokens"]
    assert call(url, "/tokenize", {"messages": msgs, "add_generation_prompt": "false"})[1]["tokens"] == bare
    for path, body in [("/v1/completions", {"ignore_eos": 2}), ("/v1/completions", {"ignore_eos": "no"}),
                       ("/v1/completions", {"stream": "2"}), ("/v1/completions", {"echo": "yes"}),
                       ("/v1/completions", {"return_routed_experts": []}),
                       ("/v1/chat/completions", {"logprobs": 5}),
                       ("/v1/chat/completions", {"continue_final_message": "on"}),
                       ("/tokenize", {"add_generation_prompt": "1"})]:
        name = next(iter(body))
        full = {"prompt": "hi", **b, **body} if path == "/v1/completions" else {"messages": msgs, **body}
        code, r = call(url, path, full)
        assert code == 400 and f"{name} must be true or false" in r["error"]["message"], (body, r)


def test_health_needs_no_api_key(server):
    """``GET /health`` answers without the key (as vLLM, which guards only /v1/*); the API does not."""
    eng, url = server
    with urllib.request.urlopen(urllib.request.Request(url + "/health"), timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    code, b = call(url, "/v1/models", key="wrong")
    assert code == 401


def test_a_chunked_body_is_read_whole(server):
    """A ``Transfer-Encoding: chunked`` body (what ``requests`` sends for an iterable) is read to its last chunk:
    only ``Content-Length`` was, so it was answered as an empty body and its chunks were read as the next request
    on the kept-alive connection; a malformed one is a 400 that closes the connection."""
    import http.client

    eng, url = server
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 3, "seed": 1}).encode()
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=60)
    try:
        conn.request("POST", "/v1/completions", iter([body[:10], body[10:]]),
                     {"Authorization": "Bearer k3y", "Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 200 and len(json.loads(r.read())["choices"]) == 1
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer k3y"})  # the same connection
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "tiny"
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", "Bearer k3y")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"zz\r\n{}\r\n0\r\n\r\n")
        r = conn.getresponse()
        assert r.status == 400 and "chunk" in json.loads(r.read())["error"]["message"]
        assert r.getheader("Connection") == "close"
    finally:
        conn.close()


def test_routes_ignore_the_query_and_unquote_the_model_id(tiny_dense_dir):
    """The openai client's ``models.retrieve("org/model")`` asks ``/v1/models/org%2Fmodel``, and a client's
    ``default_query`` (Azure-style ``?api-version=``) is on every path: both were 404s."""
    openai = pytest.importorskip("openai")
    srv, url = serve_in_thread(TorchEngine.from_pretrained(tiny_dense_dir), model_name="org/model", api_key="k3y")
    try:
        cli = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        assert cli.models.retrieve("org/model").id == "org/model"
        q = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60,
                          default_query={"api-version": "x"})
        r = q.completions.with_raw_response.create(model="org/model", prompt="hi", max_tokens=2)
        assert r.status_code == 200 and len(r.parse().choices) == 1
        assert [m.id for m in q.models.list()] == ["org/model"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_serves_on_ipv6(server):
    """``--host ::1`` (or ``::``) binds an IPv6 socket (the server was IPv4 only: "Address family for hostname not
    supported"), and the URL given back brackets the address."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    eng, _ = server
    srv, url = serve_in_thread(eng, model_name="tiny", host="::1")
    try:
        assert url == f"http://[::1]:{srv.server_address[1]}"
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    finally:
        srv.shutdown()
        srv.server_close()
