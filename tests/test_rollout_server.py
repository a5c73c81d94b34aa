"""Rollout servers: weight loading over HTTP (auth, exchange directory, checksums, in flight),
versions and routed experts in completions, and RemoteEngine over several real servers (threads and
`cascade serve` subprocesses, one of them killed mid-generate)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from train.engine import ContextLengthError, SamplingParams, TorchEngine
from train.engine.remote import RemoteEngine, RemoteError
from train.engine import server as server_mod
from train.engine.server import serve_in_thread
from train.rl.exchange import WEIGHTS_FILE, decode_routing, publish_version, stack_routing, version_dir

from tests.conftest import alive, wait_until

KEY = "s3cret"
PROMPTS = [[5, 17, 33, 2, 90, 11, 7], [120, 4, 8], [9, 9, 31, 64, 150, 3, 77, 18, 42, 1, 6], [300, 301, 302, 303]]


def call(url, path, body=None, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _new_weights(eng, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eng.model.state_dict().items()}


@pytest.fixture(scope="module")
def setup(tiny_moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("exchange")
    eng = TorchEngine.from_pretrained(tiny_moe_dir)
    sd1, sd2 = _new_weights(eng, 1), _new_weights(eng, 2)
    publish_version(root, 1, sd1)
    publish_version(root, 2, sd2)
    f = version_dir(root, 2) / WEIGHTS_FILE  # flip bytes in the middle of version 2's tensors
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 8] = bytes(8)
    f.write_bytes(bytes(raw))
    servers = [serve_in_thread(TorchEngine.from_pretrained(tiny_moe_dir), model_name="tiny", api_key=KEY,
                               weights_dir=root) for _ in range(2)]
    ref = TorchEngine.from_pretrained(tiny_moe_dir)  # in-process reference
    yield {"root": root, "servers": servers, "urls": [u for _, u in servers], "sd1": sd1, "ref": ref,
           "dir": tiny_moe_dir}
    for srv, _ in servers:
        srv.shutdown()
        srv.server_close()


def test_load_weights_endpoint(setup, monkeypatch):
    url, ref = setup["urls"][0], setup["ref"]
    inst = setup["servers"][0][0].instance  # this server process's id, in every answer
    assert call(url, "/v1/weights") == (200, {"version": 0, "group_members": 1, "group_devices": ["cpu"],
                                              "instance": inst})
    assert call(url, "/v1/models")[1]["instance"] == inst
    assert call(url, "/v1/load_weights", {"version": 1}, key=None)[0] == 401
    assert call(url, "/v1/load_weights", {"version": 1}, key="wrong")[0] == 401
    for body, msg in [({"path": "/etc"}, "not a weight version"), ({"path": "../../weights/v000001"}, "not a weight"),
                      ({"path": str(setup["root"] / "batches")}, "not a weight version"),
                      ({"version": 2}, "checksum mismatch"), ({"version": 7}, "not complete"),
                      ({}, "exactly one"), ({"version": "1"}, "non-negative int"),
                      ({"version": 1, "path": "v000001"}, "exactly one")]:
        code, b = call(url, "/v1/load_weights", body)
        assert code == 400 and msg in b["error"]["message"] and "\n" not in b["error"]["message"], (body, b)
        assert call(url, "/v1/weights")[1]["version"] == 0
    # the good version, by number and by path (relative to the weights directory)
    assert call(url, "/v1/load_weights", {"version": 1}) == (200, {"version": 1})
    assert call(url, "/v1/load_weights", {"path": "v000001"}) == (200, {"version": 1})
    ref.load_weights(setup["sd1"], version=1)
    req = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 1}
    threads = []  # top logprobs' forward runs on the engine's thread, never beside a decode or a weight swap
    real = server_mod._top_logprobs
    monkeypatch.setattr(server_mod, "_top_logprobs",
                        lambda *a: threads.append(threading.current_thread().name) or real(*a))
    code, body = call(url, "/v1/completions", dict(req, n=2))
    assert code == 200 and threads == ["engine-batcher"] * 2
    want = ref.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6))[0]
    for ch in body["choices"]:  # the top-1 of greedy decoding is the sampled token, with its logprob
        assert [list(t) for t in ch["logprobs"]["top_logprobs"]] == [[ref.decode([t])] for t in want.token_ids]
        torch.testing.assert_close(torch.tensor([list(t.values())[0] for t in ch["logprobs"]["top_logprobs"]]),
                                   torch.tensor(ch["logprobs"]["token_logprobs"]), rtol=0, atol=1e-5)
    code, body = call(url, "/v1/completions", req)
    assert code == 200 and body["choices"][0]["token_ids"] == want.token_ids and body["instance"] == inst
    assert body["choices"][0]["versions"] == [1] * len(want.token_ids)
    # a corrupt version is refused and the server keeps serving version 1
    code, b = call(url, "/v1/load_weights", {"version": 2})
    assert code == 400 and "checksum" in b["error"]["message"]
    assert call(url, "/v1/weights")[1] == {"version": 1, "group_members": 1, "group_devices": ["cpu"], "instance": inst}
    assert call(url, "/v1/completions", req)[1]["choices"][0]["token_ids"] == want.token_ids


def test_versions_that_lead_out_of_their_directory_or_belie_their_manifest_are_refused(setup, tmp_path):
    """By number as by path: a version directory that is a link out of the run's weights directory, a
    weights file that is a link, a manifest that leaves the weights file unlisted (so unchecked) or
    names another version: each refused with a one-line reason; the good version loads."""
    import shutil

    from train.rl.exchange import MANIFEST, WeightVersionError, load_version

    ex, elsewhere = tmp_path / "ex", tmp_path / "elsewhere"
    publish_version(ex, 1, setup["sd1"])
    publish_version(elsewhere, 3, setup["sd1"])
    version_dir(ex, 3).symlink_to(version_dir(elsewhere, 3), target_is_directory=True)
    for v, edit in [(4, lambda m: dict(m, files={})), (5, lambda m: dict(m, version=42)),
                    (6, lambda m: dict(m, files="x")), (7, None)]:
        d = version_dir(ex, v)
        shutil.copytree(version_dir(ex, 1), d)
        man = dict(json.loads((d / MANIFEST).read_text()), version=v)
        if edit is None:  # the weights file a link to another version's
            (d / WEIGHTS_FILE).unlink()
            (d / WEIGHTS_FILE).symlink_to(version_dir(ex, 1) / WEIGHTS_FILE)
        (d / MANIFEST).write_text(json.dumps(man if edit is None else edit(man)))
    for v, msg in [(3, "not a weight version of this run"), (4, "expected version 4 with"),
                   (5, "names version 42"), (6, "unreadable manifest"), (7, "is not a file of the version")]:
        for how in ({"version": v}, {"path": version_dir(ex, v)}):
            with pytest.raises(WeightVersionError, match=msg) as e:
                load_version(ex, **how)
            assert "\n" not in str(e.value)
    v, sd = load_version(ex, version=1)
    assert v == 1 and all(torch.equal(sd[k], t) for k, t in setup["sd1"].items())


def test_load_weights_needs_key_and_directory(setup, tmp_path):
    eng = TorchEngine.from_pretrained(setup["dir"])
    srv, url = serve_in_thread(eng, model_name="tiny", api_key=KEY)  # no weights directory
    try:
        code, b = call(url, "/v1/load_weights", {"version": 1})
        assert code == 403 and "--weights-dir" in b["error"]["message"]
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(ValueError, match="API key"):
        serve_in_thread(eng, model_name="tiny", weights_dir=str(tmp_path))


def test_routed_experts_and_in_flight_load_over_http(setup):
    srv, url = setup["servers"][1]
    eng, ref = srv.engine, setup["ref"]
    n_moe = sum(layer.is_moe for layer in eng.model.model.layers)
    k = eng.model.config.num_experts_per_tok
    req = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1,
           "return_routed_experts": True, "n": 2}
    code, body = call(url, "/v1/completions", req)
    assert code == 200
    ref.load_weights(eng.model.state_dict(), version=eng.version)  # same weights as the server now
    want = ref.generate([PROMPTS[2]], SamplingParams(n=2, temperature=1.0, max_tokens=8), seeds=[3],
                        return_routed_experts=True)
    for ch, c in zip(body["choices"], want):
        assert ch["token_ids"] == c.token_ids
        r = ch["routed_experts"]
        assert (len(r), len(r[0]), len(r[0][0])) == (len(PROMPTS[2]) + len(c.token_ids), n_moe, k)
        assert torch.equal(torch.tensor(r, dtype=torch.int16), stack_routing(c.routed_experts))
    assert "routed_experts" not in call(url, "/v1/completions", dict(req, return_routed_experts=False))[1]["choices"][0]
    # the compact form RemoteEngine asks for: int16 bytes in base64, the same ids
    code, packed = call(url, "/v1/completions", dict(req, routed_experts_format="base64"))
    assert code == 200
    for ch, c in zip(packed["choices"], want):
        r = ch["routed_experts"]
        assert r["dtype"] == "int16" and r["shape"] == [len(PROMPTS[2]) + len(c.token_ids), n_moe, k]
        assert torch.equal(decode_routing(r), stack_routing(c.routed_experts))
        with pytest.raises(ValueError, match="not an int16 array of shape"):
            decode_routing(dict(r, shape=[r["shape"][0] + 1, n_moe, k]))
    code, b = call(url, "/v1/completions", dict(req, routed_experts_format="npy"))
    assert code == 400 and "routed_experts_format must be list or base64" in b["error"]["message"]
    # an HTTP load while a request generates: applied between two steps, the request continues
    before = eng.version

    def load_during(version: int, logprobs: int):
        """A greedy request during whose third step ``version`` is loaded over HTTP: (its answer, the load's)."""
        got: dict = {}

        def hook(step):
            if step == 2 and "t" not in got:
                got["t"] = threading.Thread(target=lambda: got.setdefault("r", call(url, "/v1/load_weights",
                                                                                   {"version": version})))
                got["t"].start()
                wait_until(lambda: eng.update_pending or not got["t"].is_alive(), 60, every=0.002)

        eng.step_hook = hook
        try:
            answer = call(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, "logprobs": logprobs})
        finally:
            eng.step_hook = None
        got["t"].join(60)
        return answer, got["r"]

    (code, body), loaded = load_during(1, logprobs=0)
    assert code == 200 and loaded == (200, {"version": 1})
    assert body["choices"][0]["versions"] == [before] * 3 + [1] * 5
    # top alternatives come from the weights loaded when they are computed: for a completion sampled (in
    # part) by others, a 409 rather than another model's alternatives
    publish_version(setup["root"], 3, _new_weights(eng, 3))
    (code, body), loaded = load_during(3, logprobs=1)
    assert code == 409 and "sampled by version(s) [1]" in body["error"]["message"], body
    assert loaded == (200, {"version": 3})


def test_remote_engine_matches_in_process(setup, monkeypatch):
    urls, ref = setup["urls"], setup["ref"]
    tops = []  # the sampled tokens' logprobs only: no top alternatives (a teacher-forced forward per choice)
    monkeypatch.setattr(server_mod, "_top_logprobs", lambda *a: tops.append(a) or [])
    remote = RemoteEngine(urls, api_key=KEY, model="tiny", per_server=3)
    assert remote.load_version(1) == {u: 1 for u in sorted(urls)}
    assert all(h["ok"] and h["version"] == 1 for h in remote.health().values())
    ref.load_weights(setup["sd1"], version=1)
    sp = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=8)
    seeds = [11, 12, 13, 14]
    got = remote.generate(PROMPTS, sp, seeds=seeds, return_routed_experts=True)
    want = ref.generate(PROMPTS, sp, seeds=seeds, return_routed_experts=True)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.prompt_index == b.prompt_index
        assert a.prompt_token_ids == b.prompt_token_ids and a.versions == b.versions == [1] * len(b.token_ids)
        # each server batches its own subset of rows: the expert GEMMs then round differently (~1e-6)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        assert all(torch.equal(x, y) for x, y in zip(a.routed_experts, b.routed_experts))
    assert all(n > 0 for n in remote.requests.values()) and tops == []  # both servers took prompts
    # params.seed alone: deterministic, whichever server runs a prompt
    sp = SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=9)
    assert [c.token_ids for c in remote.generate(PROMPTS, sp)] == [c.token_ids for c in remote.generate(PROMPTS, sp)]
    # a server whose context (/v1/models max_model_len) the prompt nearly fills: what is left, as in-process
    ctx, remote.context_length = remote.context_length, len(PROMPTS[2]) + 1
    try:
        got = remote.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(got[0].token_ids) == 1 and got[0].finish_reason == "length"
        with pytest.raises(ContextLengthError, match="prompt 1 has 12 tokens"):
            remote.generate([PROMPTS[1], PROMPTS[2] + [5]], sp)
    finally:
        remote.context_length = ctx
    # refused loads: a corrupt version, a path outside the run, a wrong key
    with pytest.raises(RemoteError, match="checksum"):
        remote.load_version(2)
    with pytest.raises(RemoteError, match="not a weight version"):
        remote.load_version(path="/tmp")
    with pytest.raises(ConnectionError, match="HTTP 401"):
        RemoteEngine(urls, api_key="wrong")  # /v1/models needs the key too
    assert {h["version"] for h in remote.health().values()} == {1}
    with pytest.raises(NotImplementedError, match="publish_version"):
        remote.load_weights({})


def test_a_request_that_times_out_is_not_sent_again_to_its_server(setup):
    """A server slower than the client's timeout on a kept-alive connection: the request is not sent to it a
    second time (the server would generate it twice); the server is taken for down once."""
    engine = TorchEngine.from_pretrained(setup["dir"])
    calls, real = [], engine.generate

    def slow(prompts, params, seeds=None, **kw):
        calls.append([list(p) for p in prompts])
        if any(p[0] == 99 for p in prompts):
            time.sleep(1.5)  # past the client's timeout
        return real(prompts, params, seeds=seeds, **kw)

    engine.generate = slow
    srv, url = serve_in_thread(engine, model_name="tiny", api_key=KEY)
    down = []
    try:
        remote = RemoteEngine([url], api_key=KEY, timeout=1.0, per_server=1,
                              on_server_down=lambda u: down.append(u) or False)
        with pytest.raises(RemoteError, match="went down"):
            remote.generate([[5, 6, 7], [99, 6, 7]], SamplingParams(max_tokens=2))  # kept alive after the first
        time.sleep(1.0)
        assert sum([99, 6, 7] in c for c in calls) == 1 and down == [url]
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_server_error_sends_the_prompts_to_the_other_servers(setup):
    """A server whose engine fails (500: out of memory, a dead engine) leaves the pool like a server that
    died; its prompts are answered by the other."""
    broken = TorchEngine.from_pretrained(setup["dir"])

    def fail(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    broken.generate = fail
    servers = [serve_in_thread(e, model_name="tiny", api_key=KEY)
               for e in (TorchEngine.from_pretrained(setup["dir"]), broken)]
    try:
        remote = RemoteEngine([u for _, u in servers], api_key=KEY, per_server=1)
        got = remote.generate([PROMPTS[i % 4] for i in range(6)], SamplingParams(max_tokens=2, seed=1))
        assert len(got) == 6 and remote.alive == {servers[0][1]} and remote.requests[servers[1][1]] >= 1
    finally:
        for srv, _ in servers:
            srv.shutdown()
            srv.server_close()


def test_remote_engine_refuses_bad_servers_up_front(setup):
    with pytest.raises(ConnectionError, match="cannot reach rollout server http://127.0.0.1:9"):
        RemoteEngine([setup["urls"][0], "http://127.0.0.1:9"], api_key=KEY)
    with pytest.raises(ValueError, match="not the expected model 'other'"):
        RemoteEngine(setup["urls"], api_key=KEY, model="other")
    with pytest.raises(RemoteError, match="HTTP 400"):  # a bad request is an error, not a dead server
        RemoteEngine(setup["urls"], api_key=KEY).generate([[5, 10 ** 7]], SamplingParams(max_tokens=2))
    with pytest.raises(ContextLengthError, match="prompt 0 has 5000 tokens"):  # refused before it is sent
        RemoteEngine(setup["urls"], api_key=KEY).generate([[5] * 5000], SamplingParams(max_tokens=2))


def _start_servers(model_dir, root, ports):
    """`cascade serve` subprocesses on ``ports`` (0: a free one), started together -> [(process, url)]."""
    cmd = [sys.executable, "-m", "cascade.cli", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
           "--api-key", KEY, "--weights-dir", str(root), "--threads", "1", "--port"]
    procs = [subprocess.Popen(cmd + [str(port)], stderr=subprocess.PIPE, text=True) for port in ports]
    out = []
    for p in procs:
        for line in p.stderr:
            m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if m:
                threading.Thread(target=p.stderr.read, daemon=True).start()  # keep the pipe drained
                out.append((p, m.group(1)))
                break
        else:
            for q in procs:
                q.kill()
            raise RuntimeError(f"server did not start (exit {p.wait()})")
    return out


def _stop(procs):
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _assert_version_1_samples(setup, got, prompts, sp, seeds):
    """``got`` are the in-process reference's samples on version 1's weights, all tagged version 1."""
    ref = setup["ref"]
    ref.load_weights(setup["sd1"], version=1)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref.generate(prompts, sp, seeds=seeds)]
    assert all(set(c.versions) == {1} for c in got)


def test_kill_one_of_two_servers_mid_generate(setup, tmp_path):
    procs = _start_servers(setup["dir"], setup["root"], [0, 0])
    try:
        urls = [u for _, u in procs]
        downs: list[str] = []
        remote = RemoteEngine(urls, api_key=KEY, model="tiny", per_server=2, on_server_down=downs.append)
        assert remote.load_version(1) == {u: 1 for u in sorted(urls)}
        prompts = [PROMPTS[i % 4] + [i] for i in range(12)]
        seeds = list(range(100, 112))
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True)
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("r", remote.generate(prompts, sp, seeds=seeds)))
        t.start()
        victim, vurl = procs[0]
        wait_until(lambda: remote.requests[vurl] >= 2, 60, every=0.005)
        os.kill(victim.pid, signal.SIGKILL)  # kill -9 with requests in flight
        t.join(300)
        assert not t.is_alive() and downs == [vurl] and remote.alive == {urls[1]} and remote.resent >= 1
        got = out["r"]
        ref = setup["ref"]
        ref.load_weights(setup["sd1"], version=1)
        want = ref.generate(prompts, sp, seeds=seeds)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.prompt_index for c in got] == [i for i in range(12) for _ in range(2)]
        # a caller that restarts what it started: the hook brings the server back (same port, current
        # weights) and the engine keeps using it within the same call
        def restart(url):
            downs.append(url)
            procs.extend(_start_servers(setup["dir"], setup["root"], [int(url.rsplit(":", 1)[1])]))
            return call(url, "/v1/load_weights", {"version": 1}) == (200, {"version": 1})

        remote.on_server_down = restart
        before = remote.requests[urls[1]]
        t = threading.Thread(target=lambda: out.__setitem__("r", remote.generate(prompts[:6], sp, seeds=seeds[:6])))
        t.start()
        wait_until(lambda: remote.requests[urls[1]] >= before + 2, 60, every=0.005)
        os.kill(procs[1][0].pid, signal.SIGKILL)  # the only server left
        t.join(300)
        assert not t.is_alive() and downs == [vurl, urls[1]] and remote.alive == {urls[1]}
        assert [c.token_ids for c in out["r"]] == [c.token_ids for c in want[:12]]
        # with no server left, a one-line error
        remote.on_server_down = None
        os.kill(procs[-1][0].pid, signal.SIGKILL)
        procs[-1][0].wait(30)
        with pytest.raises(RemoteError, match="every rollout server went down"):
            remote.generate(prompts[:2], SamplingParams(max_tokens=3))
        # with down_wait_s, a call waits for a server to come back (restarted by whoever runs it) instead
        remote.down_wait_s, remote.readmit_s = 120.0, 0.2
        remote.on_server_back = lambda u: call(u, "/v1/load_weights", {"version": 1}) == (200, {"version": 1})
        t = threading.Thread(target=lambda: out.__setitem__("w", remote.generate(prompts[:4], sp, seeds=seeds[:4])))
        t.start()
        time.sleep(1.0)
        assert t.is_alive() and not remote.alive  # waiting
        procs.extend(_start_servers(setup["dir"], setup["root"], [int(urls[1].rsplit(":", 1)[1])]))
        t.join(120)
        assert not t.is_alive() and remote.alive == {urls[1]} and remote.readmitted == 1
        assert [c.token_ids for c in out["w"]] == [c.token_ids for c in want[:8]]
    finally:
        _stop(procs)


class _CountingEngine:
    """An engine stand-in for the batcher: records the prompts of every generate call."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params, seeds=None):
        from train.engine.base import Completion

        self.calls.append(len(prompts))
        return [Completion([1], "x", [0.0], "length", i, len(p), list(p)) for i, p in enumerate(prompts)
                for _ in range(params.n)]


class _StubServed:
    """A served engine stand-in (tokens are the prompt's own, every token of version ``version``) with a
    context of 10 tokens; ``fail(prompt)`` raises (an engine error on that prompt: a 500), ``slow(prompts)``
    seconds per call."""

    context_length = 10

    class tokenizer:  # token t is the letter chr(97 + t % 26)
        all_special_ids: list[int] = []
        eos_token_id = None

        @staticmethod
        def decode(ids, skip_special_tokens=False):
            return "".join(chr(97 + t % 26) for t in ids)

    def __init__(self, fail=lambda p: False, slow=lambda ps: 0.0):
        self.version, self.fail, self.slow = 0, fail, slow

    def encode(self, prompts):
        return [[ord(c) % 26 for c in p] if isinstance(p, str) else list(p) for p in prompts]

    def generate(self, prompts, params, seeds=None, **kw):
        from train.engine.base import Completion

        if any(self.fail(p) for p in prompts):
            raise RuntimeError("CUDA out of memory (simulated)")
        v = self.version
        time.sleep(self.slow(prompts))
        k = min(params.max_tokens, self.context_length - max(len(p) for p in prompts))
        return [Completion([7] * k, "x", [0.0] * k, "length", i, len(p), list(p), versions=[v] * k)
                for i, p in enumerate(prompts) for _ in range(params.n)]

    def load_weights(self, sd, version=None):
        self.version = version


def test_chat_choices_carry_versions_and_ids_as_completions_do(setup):
    url = setup["urls"][0]
    code, r = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                  "n": 2})
    assert code == 200 and r["instance"] == call(url, "/v1/models")[1]["instance"]
    assert sum(len(ch["token_ids"]) for ch in r["choices"]) == r["usage"]["completion_tokens"]
    for ch in r["choices"]:
        assert len(ch["versions"]) == len(ch["token_ids"]) and len(ch["prompt_token_ids"]) == r["usage"]["prompt_tokens"]


def test_a_prompt_that_fails_every_server_fails_the_call_not_the_servers_for_ever(caplog):
    """One prompt the engine fails on (a 500 each time) with a restart hook that always brings the server
    back: the call fails after len(urls) + 2 tries of that prompt, naming it and the server's error (it used
    to restart the server for ever); why the server left the pool is logged."""
    srv, url = serve_in_thread(_StubServed(fail=lambda p: p == [9, 9]), model_name="m")
    downs = []
    try:
        remote = RemoteEngine([url], per_server=1, on_server_down=lambda u: downs.append(u) or len(downs) < 50)
        with pytest.raises(RemoteError, match=r"prompt 1 of 2 failed 3 times .*CUDA out of memory"):
            remote.generate([[1], [9, 9]], SamplingParams(max_tokens=2))
        assert len(downs) == 2 and "left the pool: HTTP 500" in caplog.text
        # two servers given by URL, both taken out by the prompt: the error says why each left
        srv2, url2 = serve_in_thread(_StubServed(fail=lambda p: p == [9, 9]), model_name="m")
        try:
            with pytest.raises(RemoteError, match=r"every rollout server went down.*: HTTP 500: .*CUDA out of "
                                                  r"memory.*: HTTP 500: .*CUDA out of memory"):
                RemoteEngine([url, url2], per_server=1).generate([[9, 9]], SamplingParams(max_tokens=2))
        finally:
            srv2.shutdown()
            srv2.server_close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_restarted_server_takes_per_server_requests_again():
    """The server goes down (a 500) and the hook restarts it: the worker that restarted it sends again, and so
    do per_server - 1 new ones (its other workers had left: the server ran one request at a time after)."""
    calls, failed = [], []
    restarted: list[int] = []
    eng = _StubServed(slow=lambda ps: (restarted and calls.append(len(ps))) or 0.3)  # sizes after the restart
    # [1] fails twice: in its batch, then alone (as the server retries a failed batch): a 500 for its request
    eng.fail = lambda p: p == [1] and len(failed) < 2 and not failed.append(1)
    srv, url = serve_in_thread(eng, model_name="m")
    try:
        # a restart takes a while: the other workers finish their requests and see the server out of the pool
        remote = RemoteEngine([url], per_server=4,
                              on_server_down=lambda u: time.sleep(1.0) or restarted.append(1) or True)
        got = remote.generate([[i] for i in range(1, 17)], SamplingParams(max_tokens=1))
        assert len(got) == 16 and remote.resent >= 1
        assert max(calls) > 1, calls  # batches of several requests after the restart
    finally:
        srv.shutdown()
        srv.server_close()


def test_log_probs_that_are_not_the_trainers_are_warned_about(monkeypatch, caplog):
    """A vLLM server names its --logprobs-mode in each answer: processed_logprobs under min_p (renormalised over
    the kept tokens) or raw_logprobs at a temperature other than 1 are not the trainer's log_softmax(logits / T):
    the client says so, once per server and reason. cascade run starts vLLM servers with raw_logprobs when every
    stage samples at temperature 1."""
    from cascade.config import load_run_config
    from cascade.rollout import vllm_logprobs_args
    from train.engine.remote import logprob_mismatch

    assert logprob_mismatch(None, SamplingParams(min_p=0.1)) is None  # Cascade's own server: the trainer's quantity
    assert logprob_mismatch("raw_logprobs", SamplingParams(min_p=0.1, top_p=0.9)) is None
    assert "temperature 1" in logprob_mismatch("raw_logprobs", SamplingParams(temperature=0.7))
    assert logprob_mismatch("processed_logprobs", SamplingParams(temperature=0.7)) is None
    assert "min_p" in logprob_mismatch("processed_logprobs", SamplingParams(min_p=1e-5))
    assert "min_tokens" in logprob_mismatch("processed_logprobs", SamplingParams(min_tokens=4))  # stop ids masked
    orig = server_mod.Handler.completions
    monkeypatch.setattr(server_mod.Handler, "completions",
                        lambda self, body: {**orig(self, body), "logprobs_mode": "processed_logprobs"})
    srv, url = serve_in_thread(_StubServed(), model_name="m")
    try:
        remote = RemoteEngine([url], per_server=2)
        for _ in range(2):
            remote.generate([[1], [2]], SamplingParams(max_tokens=2, min_p=1e-5))
        assert caplog.text.count("behaviour log-probs are not the trainer's: processed_logprobs come after min_p") == 1
    finally:
        srv.shutdown()
        srv.server_close()
    cfg, _ = load_run_config({"rollout.backend": "vllm", "rollout.servers": 2})  # the recipe: temperature 1
    assert vllm_logprobs_args(cfg)[-2:] == ["--logprobs-mode", "raw_logprobs"]
    cfg, _ = load_run_config({"rollout.backend": "vllm", "rollout.servers": 2, "stages.math.rl.sampling.temperature": 0.7})
    assert "--logprobs-mode" not in vllm_logprobs_args(cfg)
    cfg, _ = load_run_config({"rollout.backend": "vllm", "rollout.servers": 2, "rollout.server_args": "--logprobs-mode=x"})
    assert vllm_logprobs_args(cfg) == ["--logprobs-mode=x"]
    assert vllm_logprobs_args(load_run_config({"rollout.servers": 2})[0]) == []  # Cascade's servers: no such flag


def test_min_tokens_is_capped_by_the_room_a_prompt_leaves():
    """As the in-process engines: a prompt near the context end generates what is left, even below
    min_tokens (the server refused min_tokens > max_tokens with a 400, failing the call)."""
    srv, url = serve_in_thread(_StubServed(), model_name="m")
    try:
        got = RemoteEngine([url], per_server=1).generate([[1, 2, 3], [1] * 8],
                                                         SamplingParams(max_tokens=5, min_tokens=3))
        assert [len(c.token_ids) for c in got] == [5, 2]
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_answer_to_a_request_sent_before_a_catch_up_is_sent_again():
    """A server replaced at its URL (a new instance, base weights) answers a fast request first: the client
    catches it up (version 5). A slow request sent before the catch-up answers after it, with the instance
    now known: it was sampled by the old weights, and is sent again (it was accepted)."""
    eng = _StubServed(slow=lambda ps: 1.0 if any(len(p) == 2 for p in ps) else 0.0)
    srv, url = serve_in_thread(eng, model_name="m")

    def catch_up(u):
        eng.version = 5
        return True

    try:
        remote = RemoteEngine([url], per_server=2, on_server_back=catch_up)
        srv.instance = "restarted-unseen"  # the process at the URL was replaced between two calls
        got = remote.generate([[1], [2, 2]], SamplingParams(max_tokens=2))
        assert [c.versions for c in got] == [[5, 5], [5, 5]] and remote.readmitted == 1
    finally:
        srv.shutdown()
        srv.server_close()


def test_batcher_window_slides_with_arrivals_up_to_its_cap():
    from train.engine.server import Batcher

    sp = SamplingParams(max_tokens=1)

    def burst(batcher, n, gap):
        threads = []
        for i in range(n):
            t = threading.Thread(target=batcher.submit, args=([[i + 1]], sp))
            t.start()
            threads.append(t)
            time.sleep(gap)
        for t in threads:
            t.join(30)

    # arrivals 20 ms apart, each within the 200 ms window of the one before: one batch, though the
    # burst lasts longer than one window
    eng = _CountingEngine()
    b = Batcher(eng, window_s=0.2, max_wait_s=5.0)
    burst(b, 16, 0.02)
    b.close()
    assert eng.calls == [16]
    # the cap: a stream that never pauses is cut every max_wait_s
    eng = _CountingEngine()
    b = Batcher(eng, window_s=0.2, max_wait_s=0.3)
    burst(b, 24, 0.05)
    b.close()
    assert sum(eng.calls) == 24 and len(eng.calls) >= 3


def test_a_call_during_a_batchs_gathering_runs_before_it():
    """A weight load (Batcher.call) that arrives while the batcher gathers its next batch runs before that batch,
    which takes its effect (it waited for the whole batch to finish first)."""
    from train.engine.server import Batcher

    order = []

    class Recording(_CountingEngine):
        def generate(self, prompts, params, seeds=None):
            order.append("generate")
            return super().generate(prompts, params, seeds)

    b = Batcher(Recording(), window_s=0.5, max_wait_s=1.0)
    t = threading.Thread(target=b.submit, args=([[1]], SamplingParams(max_tokens=1)))
    t.start()
    time.sleep(0.1)  # the request is in, its batch still gathering
    b.call(lambda: order.append("load"))
    t.join(30)
    b.close()
    assert order == ["load", "generate"]


def test_batched_jobs_keep_their_own_seeds_and_prompt_indices():
    """Jobs merged into one generate call: the engine gets each job's per-prompt seeds (or the
    request seed for every prompt of a job without them), and each job's completions index its own
    prompts, as if it had run alone."""
    from train.engine.server import Batcher

    class Seeds(_CountingEngine):
        def generate(self, prompts, params, seeds=None):
            self.seeds = list(seeds)
            return super().generate(prompts, params, seeds)

    eng = Seeds()
    b = Batcher(eng, window_s=0.5, max_wait_s=5.0)
    out = {}
    jobs = {"a": ([[1], [2], [3]], SamplingParams(max_tokens=1, n=2, seed=9), [11, 12, 13]),
            "b": ([[4], [5]], SamplingParams(max_tokens=1, n=2, seed=7), None)}
    threads = [threading.Thread(target=lambda k, j: out.__setitem__(k, b.submit(j[0], j[1], seeds=j[2])), args=(k, j))
               for k, j in jobs.items()]
    for t in threads:
        t.start()
        time.sleep(0.05)  # "a" first, so the merged call's order is known
    for t in threads:
        t.join(30)
    b.close()
    assert eng.calls == [5] and eng.seeds == [11, 12, 13, 7, 7]
    assert [c.prompt_index for c in out["a"]] == [0, 0, 1, 1, 2, 2]
    assert [c.prompt_index for c in out["b"]] == [0, 0, 1, 1]
    assert [c.prompt_token_ids for c in out["b"]] == [[4], [4], [5], [5]]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        Batcher(eng).submit([[1], [2], [3]], SamplingParams(max_tokens=1), seeds=[1, 2])


def test_the_engine_thread_holds_the_torch_threads_and_takes_idle_weight_loads(setup):
    """The engine's thread is the one thread of a server with several torch threads (OpenMP stops
    spinning once the process's pools hold more threads than there are cores: see Batcher): it takes
    ``threads``, the loading thread keeps one (single_threaded_start), :meth:`Batcher.call` runs work
    there (errors reach the caller), and a weight load over HTTP while the engine is idle runs there."""
    from train.engine.server import Batcher, single_threaded_start

    before = torch.get_num_threads()
    try:
        assert single_threaded_start(before + 1) == before + 1 and torch.get_num_threads() == 1
        b = Batcher(_CountingEngine(), threads=before + 1)
        assert b.call(lambda: (threading.current_thread().name, torch.get_num_threads())) == ("engine-batcher",
                                                                                              before + 1)
        assert torch.get_num_threads() == 1  # (OpenMP's count is per thread)
        with pytest.raises(KeyError, match="boom"):
            b.call(lambda: {}["boom"])
        b.close()
    finally:
        torch.set_num_threads(before)
    eng = TorchEngine.from_pretrained(setup["dir"])
    seen, load = [], eng.load_weights

    def spy(state_dict, version=None):
        seen.append(threading.current_thread().name)
        return load(state_dict, version=version)

    eng.load_weights = spy
    srv, url = serve_in_thread(eng, model_name="tiny", api_key=KEY, weights_dir=setup["root"])
    try:
        assert call(url, "/v1/load_weights", {"version": 1}) == (200, {"version": 1})
        assert seen == ["engine-batcher"] and eng.version == 1
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_url_server_that_comes_back_rejoins_with_the_newest_weights(setup, tmp_path):
    """Servers given by URL (not started by the run): one killed with kill -9 leaves the pool; restarted
    at its port by whoever runs it (on the checkpoint's weights, version 0), the background probe finds
    it, it loads the run's newest version, and it takes prompts again; its samples are those of that
    version."""
    from cascade.rollout import ServedEngine

    procs = _start_servers(setup["dir"], setup["root"], [0, 0])
    try:
        urls = [u for _, u in procs]
        se = ServedEngine(urls, setup["root"], KEY, per_server=2, readmit_s=0.2)
        se.load_published(1)
        prompts = [PROMPTS[i % 4] + [i] for i in range(8)]
        seeds = list(range(200, 208))
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=6, ignore_eos=True)
        victim, vurl = procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        se.generate(prompts, sp, seeds=seeds)
        assert se.remote.alive == {urls[1]} and se.remote.readmitted == 0
        procs.extend(_start_servers(setup["dir"], setup["root"], [int(vurl.rsplit(":", 1)[1])]))
        assert call(vurl, "/v1/weights")[1]["version"] == 0
        deadline = time.monotonic() + 60
        while vurl not in se.remote.alive and time.monotonic() < deadline:
            time.sleep(0.3)
            se.generate(prompts[:1], sp, seeds=seeds[:1])  # each call rejoins what the probe found back
        assert se.remote.alive == set(urls) and se.remote.readmitted == 1
        assert call(vurl, "/v1/weights")[1]["version"] == 1
        before = se.remote.requests[vurl]
        got = se.generate(prompts, sp, seeds=seeds)
        assert se.remote.requests[vurl] > before
        _assert_version_1_samples(setup, got, prompts, sp, seeds)
    finally:
        _stop(procs)


def test_a_server_restarted_between_two_calls_catches_up_before_its_samples_count(setup, tmp_path):
    """kill -9 and a restart at the same port between two ``generate`` calls, so no request ever fails:
    the new process (back on version 0) is told by the ``instance`` id of its answers; its answers are
    dropped, it loads the run's newest version, and every sample of the call is that version's."""
    from cascade.rollout import ServedEngine

    procs = _start_servers(setup["dir"], setup["root"], [0, 0])
    try:
        urls = [u for _, u in procs]
        se = ServedEngine(urls, setup["root"], KEY, per_server=2, readmit_s=0.2)
        se.load_published(1)
        victim, vurl = procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        procs.extend(_start_servers(setup["dir"], setup["root"], [int(vurl.rsplit(":", 1)[1])]))
        assert call(vurl, "/v1/weights")[1]["version"] == 0
        prompts, seeds = [PROMPTS[i % 4] + [i] for i in range(8)], list(range(300, 308))
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=6, ignore_eos=True)
        got = se.generate(prompts, sp, seeds=seeds)
        assert se.remote.alive == set(urls) and se.remote.readmitted == 1 and se.remote.resent >= 1
        assert call(vurl, "/v1/weights")[1]["version"] == 1
        _assert_version_1_samples(setup, got, prompts, sp, seeds)
        before = se.remote.requests[vurl]
        se.generate(prompts, sp, seeds=seeds)
        assert se.remote.requests[vurl] > before and se.remote.readmitted == 1  # admitted once
    finally:
        _stop(procs)


def test_a_catch_up_ends_on_a_version_given_out_meanwhile(setup, tmp_path):
    """A server's catch-up reads the run's version (1), and the run gives out version 2 to the pool
    before the catch-up's load reaches the server (which then goes back to 1): the catch-up sees the
    run moved on and loads again, so the server ends on the newest version."""
    from cascade.rollout import ServedEngine

    ex = tmp_path / "exchange"
    publish_version(ex, 1, setup["sd1"])
    publish_version(ex, 2, _new_weights(setup["ref"], 3))
    srv, url = serve_in_thread(TorchEngine.from_pretrained(setup["dir"]), model_name="tiny", api_key=KEY,
                               weights_dir=ex)
    try:
        se = ServedEngine([url], ex, KEY)
        se.version = 1
        conn, posted = se.remote._conn, []

        def racing(u, timeout=None):
            c = conn(u, timeout)
            call_ = c.call

            def call(method, path, body=None):
                if path == "/v1/load_weights":
                    posted.append(body["version"])
                    if se.version == 1:
                        se.load_published(2)  # the run's next version reaches the server first
                return call_(method, path, body)

            c.call = call
            return c

        se.remote._conn = racing
        assert se._catch_up(url)
        assert posted == [1, 2, 2] and call(url, "/v1/weights")[1]["version"] == 2
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_server_back_on_version_0_loads_a_republished_version_0(setup, tmp_path):
    """Version 0 is given out twice in a stage with an SFT warm-up (the start's weights, then the warmed
    up ones, ``step_idx`` still 0): a server back on the checkpoint's weights says version 0 too, and
    still loads the published version 0, whose weights it then serves."""
    from cascade.rollout import ServedEngine

    ex = tmp_path / "exchange"
    publish_version(ex, 0, setup["sd1"])  # the warmed-up weights, as version 0
    srv, url = serve_in_thread(TorchEngine.from_pretrained(setup["dir"]), model_name="tiny", api_key=KEY,
                               weights_dir=ex)
    try:
        se = ServedEngine([url], ex, KEY)
        assert se.version == 0 and call(url, "/v1/weights")[1]["version"] == 0
        assert se._catch_up(url)
        got = srv.engine.model.state_dict()
        assert all(torch.equal(got[k], v.to(got[k].dtype)) for k, v in setup["sd1"].items())
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_url_server_that_comes_back_rejoins_the_weight_broadcast(setup, tmp_path):
    """The same with ``rollout.weight_transport=broadcast``: the server back at its URL catches up from
    the files written behind the broadcast, and the next version forms the weight group again with
    it: both servers serve that version, no broadcast fell back to files."""
    from cascade.rollout import ServedEngine

    ex = tmp_path / "exchange"
    ex.mkdir()
    procs = _start_servers(setup["dir"], ex, [0, 0])
    se = None
    try:
        urls = [u for _, u in procs]
        se = ServedEngine(urls, ex, KEY, per_server=2, transport="broadcast", readmit_s=0.2, group_timeout_s=30)
        se.load_weights(setup["sd1"], version=1)
        victim, vurl = procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=4, ignore_eos=True)
        se.generate([PROMPTS[i % 4] + [i] for i in range(8)], sp, seeds=list(range(8)))  # some go to the victim
        assert vurl not in se.remote.alive
        procs.extend(_start_servers(setup["dir"], ex, [int(vurl.rsplit(":", 1)[1])]))
        deadline = time.monotonic() + 60
        while vurl not in se.remote.alive and time.monotonic() < deadline:
            time.sleep(0.3)
            se.generate([PROMPTS[0]], sp, seeds=[1])
        assert se.remote.alive == set(urls) and call(vurl, "/v1/weights")[1]["version"] == 1
        sd2 = _new_weights(setup["ref"], 7)
        se.load_weights(sd2, version=2)
        assert {u: call(u, "/v1/weights")[1]["version"] for u in urls} == {u: 2 for u in urls}
        assert se.broadcast_failures == 0 and se.broadcaster.members == tuple(sorted(urls))
        prompts, seeds = [PROMPTS[i % 4] + [i] for i in range(6)], list(range(6))
        got = se.generate(prompts, sp, seeds=seeds)
        assert se.remote.requests[vurl] > 0 and all(set(c.versions) == {2} for c in got)
        ref = setup["ref"]
        ref.load_weights(sd2, version=2)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref.generate(prompts, sp, seeds=seeds)]
    finally:
        if se is not None:
            se.broadcaster.close()
            se.wait_published()
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def test_servers_a_run_started_die_with_it(tiny_moe_dir, tmp_path):
    """A process that started rollout servers (``cascade run`` with ``rollout.servers``) killed with
    ``kill -9``: its servers get the parent-death signal and exit, the one restarted from request threads (two at
    once: one restart is made) that have since ended too (the signal follows the thread that forked a child: servers
    are forked from one spawner thread that lives as long as the pool). The pool is given ``rollout.gpus``: each
    server, the restarted one too, sees its own GPU as ``CUDA_VISIBLE_DEVICES`` (on this CPU they serve on the CPU
    all the same)."""
    script = f"""
import threading, time
from pathlib import Path
from cascade.rollout import ServerPool
pool = ServerPool(2, Path({str(tiny_moe_dir)!r}), Path({str(tmp_path / 'ex')!r}), "pool-key-7f3", 1, Path({str(tmp_path / 'logs')!r}),
                  gpus=[3, 5])
got = []
ts = [threading.Thread(target=lambda: got.append(pool.restart(pool.urls[0]))) for _ in range(2)]  # at once
for t in ts: t.start()
for t in ts: t.join()
time.sleep(0.5)
print(*[p.pid for p in pool.procs.values()], *[p.poll() for p in pool.procs.values()], pool.restarts, *got, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[1]))
    pids = []
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 7, line
        pids = [int(x) for x in line[:2]]
        assert line[2:4] == ["None", "None"]  # both alive after the restarting thread ended
        assert line[4:] == ["1", "True", "True"]  # two restarts asked at once: one made, both told it is back
        envs = [dict(x.split("=", 1) for x in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in x)
                for p in pids]
        assert [e.get("CUDA_VISIBLE_DEVICES") for e in envs] == ["3", "5"]
        # the key travels by environment (a command line is every local user's to read), and the servers took it
        assert [e.get("CASCADE_API_KEY") for e in envs] == ["pool-key-7f3"] * 2
        assert not any(b"pool-key-7f3" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        wait_until(lambda: not any(alive(p) for p in pids), 30, every=0.2)
        assert not any(alive(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_weight_load_waits_down_wait_s_for_a_server_to_come_back(setup):
    """rollout.urls servers all down (restarted by whoever runs them) when a version goes out: load_version failed at
    once ("no rollout server left to load weights") while generate waited down_wait_s; it waits too now."""
    procs = _start_servers(setup["dir"], setup["root"], [0])
    try:
        url = procs[0][1]
        remote = RemoteEngine([url], api_key=KEY, model="tiny", down_wait_s=120.0, readmit_s=0.2)
        assert remote.load_version(1) == {url: 1}
        os.kill(procs[0][0].pid, signal.SIGKILL)
        procs[0][0].wait(30)
        port = int(url.rsplit(":", 1)[1])
        back = threading.Thread(target=lambda: (time.sleep(1.0), procs.extend(_start_servers(
            setup["dir"], setup["root"], [port]))))
        back.start()
        assert remote.load_version(1) == {url: 1}  # (raised RemoteError before the server came back)
        assert call(url, "/v1/weights")[1]["version"] == 1
    finally:
        if "back" in locals():
            back.join(120)  # (its server is stopped with the others)
        _stop(procs)


def test_a_choice_the_server_did_not_finish_is_sent_again_not_trained_on(monkeypatch):
    """A choice whose finish reason is neither a stop nor the length budget (vLLM's "abort" for a request it dropped,
    "error", none) is a partial rollout: the prompt is sent again (its server stays in the pool), and the call fails
    naming it when every try came back so; a stop's synonyms (TGI's "eos_token") read as "stop". It used to be taken
    as a finished rollout with finish_reason "abort"."""
    reasons: list = []
    orig = server_mod.Handler.completions

    def completions(self, body):
        out = orig(self, body)
        fin = reasons.pop(0) if reasons else "abort"
        return {**out, "choices": [{**ch, "finish_reason": fin} for ch in out["choices"]]}

    monkeypatch.setattr(server_mod.Handler, "completions", completions)
    srv, url = serve_in_thread(_StubServed(), model_name="m")
    try:
        remote = RemoteEngine([url], per_server=1)
        reasons[:] = ["abort", "stop"]
        got = remote.generate([[1, 2]], SamplingParams(max_tokens=2))
        assert [c.finish_reason for c in got] == ["stop"] and remote.requests[url] == 2 and remote.alive == {url}
        reasons[:] = ["eos_token"]
        assert [c.finish_reason for c in remote.generate([[1, 2]], SamplingParams(max_tokens=2))] == ["stop"]
        with pytest.raises(RemoteError, match=r"prompt 0 of 1 .* 3 times .*finish_reason 'abort'"):
            remote.generate([[1, 2]], SamplingParams(max_tokens=2))
        assert remote.alive == {url}
    finally:
        srv.shutdown()
        srv.server_close()


# stands in for `python -m train.engine.server` in a ServerPool: its endpoints, a new instance id per process;
# FAKE_GEN_S / FAKE_LOAD_S: seconds a generation / weight load takes; FAKE_FAIL: a file holding how many of the
# next starts fail (as a restart fails while the killed server's GPU memory is not yet freed)
_FAKE_SERVER = r'''
import json, os, sys, time, uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
fail = os.environ.get("FAKE_FAIL")
if fail and os.path.exists(fail) and int(open(fail).read() or 0) > 0:
    n = int(open(fail).read())
    open(fail, "w").write(str(n - 1))
    print("CUDA out of memory (fake)", flush=True)
    sys.exit(1)
INST, VER = uuid.uuid4().hex, [0]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self._send({"data": [{"id": "policy", "owned_by": "cascade"}], "instance": INST} if self.path == "/v1/models"
                   else {"version": VER[0]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_weights":
            time.sleep(float(os.environ.get("FAKE_LOAD_S", "0")))
            VER[0] = body.get("version", 0)
            return self._send({"version": VER[0]})
        time.sleep(float(os.environ.get("FAKE_GEN_S", "0")))
        self._send({"instance": INST, "choices": [{"token_ids": [1, 2], "text": "ab", "finish_reason": "stop",
                    "logprobs": {"token_logprobs": [-1.0, -1.0]}, "versions": [VER[0]] * 2}]})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake_pool(tmp_path, n=2):
    """A ServerPool of ``n`` fake servers (:data:`_FAKE_SERVER`, started as the pool starts Cascade's)."""
    from cascade.rollout import ServerPool

    (tmp_path / "fake_server.py").write_text(_FAKE_SERVER)
    py = tmp_path / "fakepy"  # called as: fakepy -m train.engine.server ARGS...
    py.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    py.chmod(0o755)
    return ServerPool(n, tmp_path, tmp_path / "exchange", KEY, 1, tmp_path / "logs", startup_timeout_s=30,
                      python=str(py))


def test_a_run_started_server_whose_restart_fails_is_restarted_again(tmp_path, monkeypatch):
    """A server ``cascade run`` started dies and its start fails (a GPU not yet freed): the start is tried again a
    moment later; and when every try of that restart failed, the server is restarted again, every readmit_s, until
    it is back (it used to be out of the pool for the rest of the run)."""
    from cascade.rollout import ServedEngine

    monkeypatch.setenv("FAKE_GEN_S", "0.1")
    fail = tmp_path / "fail"
    monkeypatch.setenv("FAKE_FAIL", str(fail))
    pool = _fake_pool(tmp_path)
    pool.restart_tries, pool.restart_backoff_s = 2, 0.1
    eng = ServedEngine(pool.urls, tmp_path / "exchange", KEY, pool, per_server=2, readmit_s=0.5)
    try:
        a = pool.urls[0]
        sp = SamplingParams(max_tokens=2, seed=1)
        for starts_failing, restarts in ((1, 1), (2, 2)):  # a start fails once; then both tries of a restart fail
            fail.write_text(str(starts_failing))
            pool.procs[a].kill()
            pool.procs[a].wait()
            deadline = time.monotonic() + 15
            while True:
                assert len(eng.generate([[1, 2, 3]] * 4, sp)) == 4
                if eng.remote.alive == set(pool.urls) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert eng.remote.alive == set(pool.urls) and pool.restarts == restarts and fail.read_text() == "0"
            assert pool.procs[a].poll() is None
    finally:
        eng.close()


def test_a_server_that_dies_during_a_weight_load_is_restarted_once(tmp_path, monkeypatch):
    """One kill of a run-started server while a generate and a slow weight load run: the generate worker restarts
    it; the load, whose request to the dead process failed, finds it restarted and readmitted and sends it the load
    again (it used to restart it a second time, killing the fresh process and the requests sent to it)."""
    from cascade.rollout import ServedEngine

    monkeypatch.setenv("FAKE_GEN_S", "0.5")
    monkeypatch.setenv("FAKE_LOAD_S", "2")
    pool = _fake_pool(tmp_path)
    eng = ServedEngine(pool.urls, tmp_path / "exchange", KEY, pool, per_server=2)
    try:
        a, b = pool.urls
        out = {}
        tg = threading.Thread(target=lambda: out.update(gen=eng.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=2))))
        tl = threading.Thread(target=lambda: out.update(load=eng.remote.load_version(7)))
        tg.start()
        tl.start()
        time.sleep(0.3)
        pool.procs[a].kill()
        tg.join(60)
        tl.join(60)
        assert len(out["gen"]) == 8 and out["load"] == {a: 7, b: 7}
        assert pool.restarts == 1 and eng.remote.alive == {a, b}
    finally:
        eng.close()


def test_a_load_the_engine_fails_is_a_one_line_400_and_the_old_weights_stay(tiny_moe_dir, tmp_path, monkeypatch):
    """A version whose checksums match but whose tensors are not the model's, or an engine that fails to apply
    one (out of memory, a multi-line message): ``cannot load weights: <first line>`` with 400, never a 500, and
    the server keeps version 0; the good version then loads."""
    eng = TorchEngine.from_pretrained(tiny_moe_dir)
    publish_version(tmp_path, 1, eng.model.state_dict())
    publish_version(tmp_path, 2, {"w": torch.zeros(2)})
    srv, url = serve_in_thread(eng, model_name="tiny", api_key=KEY, weights_dir=tmp_path)
    try:
        code, b = call(url, "/v1/load_weights", {"version": 2})
        assert code == 400 and b["error"]["message"].startswith("cannot load weights: weights do not match"), b
        real = eng.load_weights

        def oom(sd, version=None):
            raise RuntimeError("out of memory\nwhile copying the weights")

        monkeypatch.setattr(eng, "load_weights", oom)
        assert call(url, "/v1/load_weights", {"version": 1}) == (400, {"error": {
            "message": "cannot load weights: out of memory", "type": "BadRequestError", "code": 400}})
        assert call(url, "/v1/weights")[1]["version"] == 0
        monkeypatch.setattr(eng, "load_weights", real)
        assert call(url, "/v1/load_weights", {"version": 1}) == (200, {"version": 1})
    finally:
        srv.shutdown()
        srv.server_close()


def test_weight_group_routes_act_on_the_named_group_and_need_loading_on(tiny_moe_dir, tmp_path):
    """An abort names its group: another name leaves the group's broadcast alone. A join leaves the group the
    server was in first, even when the new one cannot be formed. Without --weights-dir both routes are 403."""
    import socket

    from train.rl.weight_group import Group

    class Tracked(Group):
        def close(self):
            self.closed = True

    eng = TorchEngine.from_pretrained(tiny_moe_dir)
    srv, url = serve_in_thread(eng, model_name="tiny", api_key=KEY, weights_dir=tmp_path)
    off, url_off = serve_in_thread(eng, model_name="tiny", api_key=KEY)
    try:
        g = srv.weight_group = Tracked(None, 1, 2, torch.device("cpu"), "g1")
        assert call(url, "/v1/weights_group/abort", {"name": "g0"}) == (200, {"aborted": False})
        assert not g.aborted.is_set()
        assert call(url, "/v1/weights_group/abort", {"name": "g1"}) == (200, {"aborted": True}) and g.aborted.is_set()
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        code, b = call(url, "/v1/weights_group", {"host": "127.0.0.1", "port": port, "rank": 1, "world_size": 2,
                                                  "name": "g2", "timeout_s": 1})
        assert code == 400 and "cannot join the weight group" in b["error"]["message"]
        assert getattr(g, "closed", False) and srv.weight_group is None
        for path, body in (("/v1/weights_group/abort", {"name": "g1"}), ("/v1/load_weights", {"version": 1})):
            code, b = call(url_off, path, body)
            assert code == 403 and "--weights-dir" in b["error"]["message"], (path, b)
    finally:
        for s in (srv, off):
            s.shutdown()
            s.server_close()


def test_serve_refuses_a_weights_dir_without_an_api_key(tmp_path, monkeypatch):
    """``cascade serve --weights-dir`` without --api-key (or $CASCADE_API_KEY) stops before loading anything:
    weight loading over HTTP is never open to anyone who can reach the port."""
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--weights-dir needs --api-key"):
        server_mod.main(["--model", str(tmp_path / "no-model"), "--weights-dir", str(tmp_path / "ex")])
    assert not (tmp_path / "ex").exists()
