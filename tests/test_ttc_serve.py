"""The OpenAI-compatible server over the torch engine: routes, seeds, token ids, errors."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from train.engine import SamplingParams, TorchEngine
from train.engine.server import serve_in_thread


@pytest.fixture(scope="module")
def server(tiny_dense_dir):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = TorchEngine.from_pretrained(tiny_dense_dir)
    srv, url = serve_in_thread(eng, model_name="tiny", api_key="k3y")
    yield eng, url
    srv.shutdown()
    srv.server_close()
    torch.set_num_threads(old)


def call(url, path, body=None, key="k3y"):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_auth(server):
    import http.client

    eng, url = server
    code, body = call(url, "/v1/models")
    assert code == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == eng.context_length
    assert call(url, "/v1/models/tiny") == (200, body["data"][0])  # the openai client's models.retrieve
    assert call(url, "/v1/models/other")[0] == 404
    code, body = call(url, "/v1/models", key="wrong")
    assert code == 401 and "API key" in body["error"]["message"]
    # a refused POST's body is never read as the next request on its connection
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=30)
    post = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    conn.request("POST", "/v1/completions", post, {"Authorization": "Bearer wrong", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 401 and json.loads(r.read())["error"]["code"] == 401
    conn.request("GET", "/v1/models", headers={"Authorization": "Bearer k3y"})  # reconnects: the server closed it
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "tiny"
    conn.close()


def test_completions_match_the_engine(server):
    eng, url = server
    tok = eng.tokenizer
    ids = tok.encode("What is 2+2?", add_special_tokens=False)
    req = {"model": "tiny", "prompt": ids, "n": 2, "max_tokens": 7, "temperature": 1.0, "top_p": 0.9, "seed": 5,
           "logprobs": 1, "return_tokens_as_token_ids": True}
    code, body = call(url, "/v1/completions", req)
    assert code == 200
    ref = eng.generate([ids], SamplingParams(n=2, max_tokens=7, temperature=1.0, top_p=0.9, seed=5))
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in ref]
    assert [c["text"] for c in body["choices"]] == [c.text for c in ref]
    for ch, c in zip(body["choices"], ref):
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in c.token_ids]
        assert ch["logprobs"]["token_logprobs"] == pytest.approx(c.logprobs, abs=1e-6)
        assert ch["finish_reason"] == c.finish_reason
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(len(c.token_ids) for c in ref),
                             "total_tokens": len(ids) + sum(len(c.token_ids) for c in ref)}
    # a text prompt and a batch: every prompt of the batch is seeded like a request of its own
    code, batch = call(url, "/v1/completions", {"prompt": ["What is 2+2?", "Hi"], "max_tokens": 5, "seed": 8})
    code1, alone = call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 5, "seed": 8})
    assert code == code1 == 200 and len(batch["choices"]) == 2
    assert batch["choices"][1]["token_ids"] == alone["choices"][0]["token_ids"]
    # greedy with a stop string
    code, g = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0})
    ref = eng.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert g["choices"][0]["token_ids"] == ref.token_ids
    # vLLM's penalties (they were read as nothing before)
    pen = {"repetition_penalty": 1.6, "presence_penalty": 1.0, "frequency_penalty": 0.5}
    code, g = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **pen})
    ref = eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **pen))[0]
    assert code == 200 and g["choices"][0]["token_ids"] == ref.token_ids
    assert ref.token_ids != eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids


def test_chat_and_tokenize(server):
    eng, url = server
    tok = eng.tokenizer
    msgs = [{"role": "user", "content": "Sort 3 1 2."}]
    code, t = call(url, "/tokenize", {"messages": msgs, "add_generation_prompt": True})
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert code == 200 and t["tokens"] == ids and t["count"] == len(ids)
    code, d = call(url, "/detokenize", {"tokens": ids})
    assert d["prompt"] == tok.decode(ids)
    code, t = call(url, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert t["tokens"] == tok.encode("hello world", add_special_tokens=False)
    code, chat = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "seed": 2, "temperature": 1.0})
    ref = eng.generate([ids], SamplingParams(max_tokens=6, seed=2))[0]
    assert code == 200 and chat["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # a request's own template and its variables (vLLM's chat_template / chat_template_kwargs, e.g. Qwen3's
    # enable_thinking), for chat and tokenize alike; apply_chat_template's own arguments are not variables
    own = {"chat_template": "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "chat_template_kwargs": {"greeting": "Hello! ", "tokenize": True}}
    want = tok.encode("Hello! Sort 3 1 2.", add_special_tokens=False)
    assert call(url, "/tokenize", {"messages": msgs, **own})[1]["tokens"] == want
    code, chat = call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "seed": 2, **own})
    ref = eng.generate([want], SamplingParams(max_tokens=6, seed=2))[0]
    assert code == 200 and chat["choices"][0]["message"]["content"] == ref.text


def test_ttc_chat_backend_against_this_server(server):
    """``ttc solve --api chat`` against this server: a fresh prompt is the user's message, a continued one
    (after ``ASSISTANT_MARK``) a final assistant message to go on from; both sample what the engine samples
    from the chat template's ids with the request's seed, within the budget (``max_completion_tokens``)."""
    from ttc.backends import ASSISTANT_MARK, ChatBackend

    eng, url = server
    tok = eng.tokenizer
    be = ChatBackend(url, model="tiny", tokenizer=tok, api_key="k3y", retries=0)
    try:
        msgs = [{"role": "user", "content": "Sort 3 1 2."}]
        fresh = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        text = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "1 2"}], tokenize=False,
                                       continue_final_message=True)
        cont = tok.encode(text, add_special_tokens=False)
        usage: dict = {}
        outs = be.generate(["Sort 3 1 2.", "Sort 3 1 2." + ASSISTANT_MARK + "1 2"],
                           SamplingParams(max_tokens=6, temperature=1.0), seeds=[2, 5], usage=usage)
        for ids, seed, out in zip([fresh, cont], [2, 5], outs):
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert out.text == eng.generate([ids], SamplingParams(max_tokens=6, seed=seed))[0].text
        assert 0 < usage["completion_tokens"] <= 12 and usage["requests"] == 2
    finally:
        be.close()


def test_bad_requests(server):
    eng, url = server
    ctx = eng.context_length
    for path, body, msg in [
        ("/v1/completions", {"prompt": "x", "max_tokens": ctx + 1}, f"max_model_len={ctx}"),  # as vLLM
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": ctx + 1},
         f"max_completion_tokens={ctx + 1} cannot be greater"),
        ("/v1/completions", {"prompt": 5}, "prompt must be"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        # what this server does not implement is refused, not ignored
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 6]}, "allowed_token_ids=[5, 6] is not supported"),
        ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 3}, "best_of=3"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools="),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}}, "response_format="),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2},
         "min_tokens must be in [0, max_tokens=2]"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias must be an object of token ids"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias has token id 99999"),
        ("/v1/completions", {"prompt": "x", "n": "many"}, "n must be"),
        ("/detokenize", {"tokens": "abc"}, "list of token ids"),
        ("/v1/chat/completions", {"messages": []}, "non-empty"),
        ("/v1/completions", {"prompt": [1, 99999], "max_tokens": 2}, "token id 99999"),
        ("/v1/completions", {"prompt": [-1], "max_tokens": 2, "stream": True}, "token id -1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.7}, "max_tokens must be an integer"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens must be an integer"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [{}]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop must be a non-empty string"),  # as vLLM
        ("/v1/completions", {"prompt": "x", "stop": [5]}, "stop must be"),
        ("/v1/completions", {"prompt": "x", "stop": {"a": 1}}, "stop must be"),
    ]:
        code, b = call(url, path, body)
        assert code == 400 and msg in b["error"]["message"], (path, b)
    noops = {"min_tokens": 0, "logit_bias": {}, "use_beam_search": False, "best_of": 2, "n": 2, "tools": [],
             "response_format": {"type": "text"}, "length_penalty": 1.0, "include_stop_str_in_output": False}
    code, b = call(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **noops})  # at values that change nothing
    assert code == 200 and len(b["choices"]) == 2
    code, b = call(url, "/v1/nothing", {})
    assert code == 404
    code, b = call(url, "/v1/completions", {"prompt": "x", "model": "other"})  # an unknown model: 404, as OpenAI
    assert code == 404 and "not served" in b["error"]["message"]


def test_the_prompts_of_an_unseeded_request_are_sampled_apart(server):
    """Without a seed each prompt of a request gets its own (as vLLM samples them): four copies of one prompt
    do not come back as one completion four times; with a seed they do."""
    eng, url = server
    req = {"model": "tiny", "prompt": ["What is 2+2?"] * 4, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    code, b = call(url, "/v1/completions", req)
    assert code == 200 and len({c["text"] for c in b["choices"]}) > 1
    code, b = call(url, "/v1/completions", dict(req, seed=3))
    assert code == 200 and len({c["text"] for c in b["choices"]}) == 1


def test_a_bad_request_in_a_batch_fails_alone(server):
    eng, url = server
    from concurrent.futures import ThreadPoolExecutor

    too_long = {"prompt": [5] * (eng.context_length + 10), "max_tokens": 3, "seed": 1}
    fine = {"prompt": [5, 6, 7], "max_tokens": 3, "seed": 1}
    with ThreadPoolExecutor(4) as ex:
        res = list(ex.map(lambda b: call(url, "/v1/completions", b), [too_long, fine, too_long, fine]))
    assert [code for code, _ in res] == [400, 200, 400, 200]
    assert "context limit" in res[0][1]["error"]["message"]
    ref = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, seed=1))[0]
    assert res[1][1]["choices"][0]["token_ids"] == ref.token_ids == res[3][1]["choices"][0]["token_ids"]


# -- the official openai client ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    _, url = server
    return openai, openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)


def test_openai_client_completions_stream_and_not(server, client):
    eng, url = server
    openai, cli = client
    tok = eng.tokenizer
    ids = tok.encode("What is 2+2?", add_special_tokens=False)
    ref = eng.generate([ids], SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=4))
    r = cli.completions.create(model="tiny", prompt="What is 2+2?", max_tokens=9, n=2, seed=4, logprobs=3)
    assert [c.text for c in r.choices] == [c.text for c in ref]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(len(c.token_ids) for c in ref)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # top logprobs: 3 per position, against a forward pass of the model; the sampled token's own
    # logprob is the engine's
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(ref[0].token_ids) and all(len(d) == 3 for d in lp.top_logprobs)
    with torch.no_grad():
        logits = eng.model(torch.tensor([ids + ref[0].token_ids]))[0, len(ids) - 1:-1]
    want = torch.log_softmax(logits, -1).topk(3, -1)
    for pos, d in enumerate(lp.top_logprobs):
        assert sorted(d.values(), reverse=True) == pytest.approx(want.values[pos].tolist(), abs=1e-4)
        assert max(d.values()) >= lp.token_logprobs[pos] - 1e-4
    assert lp.token_logprobs == pytest.approx(ref[0].logprobs, abs=1e-5)
    # streaming: chunks that add up to the same text, then usage
    chunks = list(cli.completions.create(model="tiny", prompt="What is 2+2?", max_tokens=9, n=2, seed=4,
                                         stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 4
    text = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[0], text[1]] == [c.text for c in ref] and [finish[0], finish[1]] == [c.finish_reason for c in ref]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # an unknown model is NotFoundError (404)
    with pytest.raises(openai.NotFoundError):
        cli.completions.create(model="nope", prompt="x", max_tokens=2)
    # logit_bias (a value past 100 clamped, as vLLM's server) and vLLM's min_tokens: what the engine samples with them
    eos = eng.eos_token_ids[0]
    r = cli.completions.create(model="tiny", prompt="What is 2+2?", max_tokens=9, n=2, seed=4,
                               logit_bias={str(eos): 300}, extra_body={"min_tokens": 3})
    ref = eng.generate([ids], SamplingParams(n=2, max_tokens=9, seed=4, logit_bias={eos: 100.0}, min_tokens=3))
    assert [c.text for c in r.choices] == [c.text for c in ref] and r.usage.completion_tokens == 8


def test_openai_client_chat_stream_parts_and_default_max_tokens(server, client):
    eng, url = server
    openai, cli = client
    tok = eng.tokenizer
    msgs = [{"role": "user", "content": "Sort 3 1 2."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # no max_tokens: the rest of the context (here the tiny model runs to EOS or the context's end)
    ref = eng.generate([ids], SamplingParams(max_tokens=eng.context_length - len(ids), seed=3, temperature=1.0))[0]
    r = cli.chat.completions.create(model="tiny", messages=msgs, seed=3)
    shown = tok.decode(ref.token_ids, skip_special_tokens=True)  # as vLLM: special tokens left out of the text
    assert r.choices[0].message.content == shown and r.usage.completion_tokens == len(ref.token_ids) > 16
    # content as parts is the same prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort 3 1 "}, {"type": "text", "text": "2."}]}]
    r2 = cli.chat.completions.create(model="tiny", messages=parts, seed=3, max_tokens=6)
    assert r2.choices[0].message.content == eng.generate([ids], SamplingParams(max_tokens=6, seed=3))[0].text
    with pytest.raises(openai.BadRequestError, match="image_url"):
        cli.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    # streaming chat: a role delta, content deltas adding up to the text, a finish reason, usage
    stream = cli.chat.completions.create(model="tiny", messages=msgs, seed=3, max_tokens=12, stream=True,
                                         stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    chunks = list(stream)
    ref = eng.generate([ids], SamplingParams(max_tokens=12, seed=3))[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.finish_reason]
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.logprob for x in lps] == pytest.approx(ref.logprobs, abs=1e-5)
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.logprob - 1e-4 for x in lps)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(server, client):
    """As vLLM's server: the text leaves out the special tokens a model emits mid-text (here the tiny
    tokenizer's ``<|im_start|>``, ``<think>``...), streamed too; ``"skip_special_tokens": false`` keeps
    them, which is what the RL rollouts' client asks for: its text is the engine's own decode."""
    from train.engine.remote import RemoteEngine

    eng, url = server
    openai, cli = client
    tok = eng.tokenizer
    special = set(tok.all_special_ids)

    def sample_with_special(ids, **kw):  # a seed whose sample has a special token before its last token
        for seed in range(300):
            c = eng.generate([ids], SamplingParams(seed=seed, temperature=1.0, **kw))[0]
            if special & set(c.token_ids[:-1]):
                return seed, c
        raise AssertionError("no sample with a special token")

    ids = tok.encode("Hi there", add_special_tokens=False)
    seed, ref = sample_with_special(ids, max_tokens=40, ignore_eos=True)
    shown = tok.decode(ref.token_ids, skip_special_tokens=True)
    assert shown != ref.text
    body = {"model": "tiny", "prompt": ids, "seed": seed, "max_tokens": 40, "ignore_eos": True, "temperature": 1.0}
    code, r = call(url, "/v1/completions", body)
    assert code == 200 and r["choices"][0]["text"] == shown and r["choices"][0]["token_ids"] == ref.token_ids
    assert call(url, "/v1/completions", {**body, "skip_special_tokens": False})[1]["choices"][0]["text"] == ref.text
    code, r = call(url, "/v1/completions", {**body, "skip_special_tokens": "no"})
    assert code == 400 and "skip_special_tokens must be true or false" in r["error"]["message"]
    chunks = cli.completions.create(model="tiny", prompt=ids, seed=seed, max_tokens=40, temperature=1.0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == shown
    # a stop string still ends the text shown (found in it)
    stop = shown[len(shown) // 2:len(shown) // 2 + 3]
    ref_stop = eng.generate([ids], SamplingParams(seed=seed, temperature=1.0, max_tokens=40, ignore_eos=True,
                                                  stop=[stop]))[0]
    got = call(url, "/v1/completions", {**body, "stop": [stop]})[1]["choices"][0]
    full = tok.decode(ref_stop.token_ids, skip_special_tokens=True)
    assert got["token_ids"] == ref_stop.token_ids and got["text"] == full[:full.find(stop)]
    # chat, streamed and not
    msgs = [{"role": "user", "content": "Hi there"}]
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    seed, ref = sample_with_special(chat_ids, max_tokens=40, ignore_eos=True)
    shown = tok.decode(ref.token_ids, skip_special_tokens=True)
    kw = dict(model="tiny", messages=msgs, seed=seed, max_tokens=40, temperature=1.0, extra_body={"ignore_eos": True})
    assert cli.chat.completions.create(**kw).choices[0].message.content == shown != ref.text
    assert "".join(c.choices[0].delta.content or "" for c in cli.chat.completions.create(**kw, stream=True)
                   if c.choices) == shown
    kw["extra_body"] = {"ignore_eos": True, "skip_special_tokens": False}
    assert cli.chat.completions.create(**kw).choices[0].message.content == ref.text
    # the rollouts' client: the engine's own text
    remote = RemoteEngine([url], api_key="k3y")
    try:
        got = remote.generate([ids], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True), seeds=[seed])
    finally:
        remote.close()
    ref = eng.generate([ids], SamplingParams(seed=seed, temperature=1.0, max_tokens=40, ignore_eos=True))[0]
    assert got[0].token_ids == ref.token_ids and got[0].text == ref.text


def test_closing_ends_kept_alive_connections_and_refuses_new_work(tiny_dense_dir):
    """After ``shutdown()`` + ``server_close()`` a kept-alive connection is ended (its next request was
    queued to the stopped engine thread and never answered) and no handler thread is left."""
    import http.client
    import threading
    import time

    def handlers():  # (other servers' too: this module's fixture serves other tests' connections)
        return {th for th in threading.enumerate() if "process_request" in th.name}

    others = handlers()
    srv, url = serve_in_thread(TorchEngine.from_pretrained(tiny_dense_dir), model_name="tiny")
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=10)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.read()
    srv.shutdown()
    srv.server_close()
    t = time.monotonic()
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        conn.getresponse().read()
    assert time.monotonic() - t < 5
    deadline = time.monotonic() + 5
    while handlers() - others and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handlers() - others
    with pytest.raises(RuntimeError, match="closing"):
        srv.batcher.submit([[5, 6]], SamplingParams(max_tokens=1))
