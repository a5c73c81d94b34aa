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
    eng, url = server
    code, body = call(url, "/v1/models")
    assert code == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == eng.context_length
    code, body = call(url, "/v1/models", key="wrong")
    assert code == 401 and "API key" in body["error"]["message"]


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


def test_bad_requests(server):
    _, url = server
    for path, body, msg in [
        ("/v1/completions", {"prompt": 5}, "prompt must be"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, "not served"),
        ("/v1/completions", {"prompt": "x", "n": "many"}, "n must be"),
        ("/detokenize", {"tokens": "abc"}, "list of token ids"),
        ("/v1/chat/completions", {"messages": []}, "non-empty"),
    ]:
        code, b = call(url, path, body)
        assert code == 400 and msg in b["error"]["message"], (path, b)
    code, b = call(url, "/v1/nothing", {})
    assert code == 404


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
