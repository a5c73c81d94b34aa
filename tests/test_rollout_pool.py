"""cascade.rollout without a model: ServerPool over fake server processes (what it runs, with which
environment, how a failed start is told), ServedEngine's versions, and served_engine's wiring of rollout.*."""
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from train.dataclass_config import ConfigError
from train.errors import RunFailure

KEY = "pool-test-key"

# stands in for `python -m train.engine.server`: writes what it was started with to started-PORT.json, then
# serves /v1/models (owned_by cascade), /v1/weights and /v1/load_weights. FAKE_MODE=exit: two lines of output,
# exit 3; FAKE_MODE=401: refuses every request; FAKE_FAIL: a file holding how many of the next starts fail;
# FAKE_CHILD: starts a process of its own (its pid in child-PORT).
_SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in
           ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "CASCADE_API_KEY", "VLLM_API_KEY")}},
          open(os.path.join(os.environ["FAKE_DIR"], f"started-{port}.json"), "w"))
mode = os.environ.get("FAKE_MODE", "")
if mode == "exit":
    print("loading the model", flush=True)
    print("ValueError: unrecognized arguments: --bogus", flush=True)
    sys.exit(3)
if os.environ.get("FAKE_CHILD"):  # a worker of its own, as vLLM's engine core is, in its process group
    import subprocess
    c = subprocess.Popen(["sleep", "120"])
    open(os.path.join(os.environ["FAKE_DIR"], f"child-{port}"), "w").write(str(c.pid))
VER, LOADS = [0], [0]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        if mode == "401":
            return self._send({"error": "bad key"}, 401)
        self._send({"data": [{"id": "policy", "owned_by": "cascade"}], "instance": str(os.getpid())}
                   if self.path == "/v1/models" else {"version": VER[0], "loads": LOADS[0]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_weights":
            VER[0] = body.get("version", 0)
            LOADS[0] += 1
        self._send({"version": VER[0]})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / "fake_server.py").write_text(_SERVER)
    py = tmp_path / "fakepy"  # called as: fakepy -m train.engine.server ARGS...
    py.write_text("#!/bin/sh\nshift 2\n"  # a failing start (FAKE_FAIL) without a Python start: the test stays fast
                  'if [ -n "$FAKE_FAIL" ] && [ "$(cat "$FAKE_FAIL" 2>/dev/null || echo 0)" -gt 0 ]; then\n'
                  '  echo $(($(cat "$FAKE_FAIL") - 1)) > "$FAKE_FAIL"\n'
                  '  echo "loading the model"; echo "ValueError: unrecognized arguments: --bogus"; exit 3\nfi\n'
                  f'exec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    py.chmod(0o755)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return py


def _started(tmp_path, url):
    return json.loads((tmp_path / f"started-{url.rsplit(':', 1)[1]}.json").read_text())


def _pool(tmp_path, py, n=2, **kw):
    from cascade.rollout import ServerPool

    return ServerPool(n, tmp_path, tmp_path / "exchange", KEY, kw.pop("threads", 1), tmp_path / "logs",
                      startup_timeout_s=kw.pop("startup_timeout_s", 30), python=str(py), **kw)


def test_a_pool_refuses_an_unknown_backend_and_gpus_it_cannot_split_before_starting_anything(tmp_path, fake):
    with pytest.raises(ConfigError, match="unknown rollout.backend 'sglang'"):
        _pool(tmp_path, fake, backend="sglang")
    with pytest.raises(ConfigError, match=r"rollout.gpus=\[0, 1, 2\] does not split evenly among 2 servers"):
        _pool(tmp_path, fake, gpus=[0, 1, 2])
    assert not (tmp_path / "logs").exists() and not list(tmp_path.glob("started-*.json"))


def test_each_server_gets_its_gpus_threads_key_and_args_also_when_restarted(tmp_path, fake):
    """rollout.gpus=[4, 5, 6, 7] over 2 servers: "4,5" and "6,7" (the first of its own is cuda), the torch
    threads as OMP_NUM_THREADS, the key by environment, rollout.server_args shell-split; a restarted server gets
    the same and logs to its own file, and servers.json names the new process."""
    pool = _pool(tmp_path, fake, threads=3, gpus=[4, 5, 6, 7], device="cuda:1",
                 server_args="--max-batch 4 --note 'two words'")
    try:
        a, b = pool.urls
        for url, gpus in ((a, "4,5"), (b, "6,7")):
            s = _started(tmp_path, url)
            assert s["env"] == {"CUDA_VISIBLE_DEVICES": gpus, "OMP_NUM_THREADS": "3", "CASCADE_API_KEY": KEY,
                                "VLLM_API_KEY": KEY}
            argv = s["argv"]
            assert argv[argv.index("--device") + 1] == "cuda" and argv[argv.index("--threads") + 1] == "3"
            assert argv[-4:] == ["--max-batch", "4", "--note", "two words"] and KEY not in argv
        old = pool.procs[b].pid
        (tmp_path / f"started-{b.rsplit(':', 1)[1]}.json").unlink()
        pool.procs[b].kill()
        pool.procs[b].wait()
        assert pool.restart(b) is True and pool.restarts == 1
        assert _started(tmp_path, b)["env"]["CUDA_VISIBLE_DEVICES"] == "6,7"
        assert pool.procs[b].pid != old and pool.procs[b].poll() is None
        assert json.loads((tmp_path / "logs" / "servers.json").read_text()) == {u: p.pid for u, p in pool.procs.items()}
    finally:
        pool.close()


def test_a_server_that_exits_while_starting_is_reported_with_its_last_words(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "exit")
    with pytest.raises(RunFailure, match=r"exited with code 3 while starting: ValueError: unrecognized arguments: "
                                         r"--bogus \(log: .*server-0\.log\)"):
        _pool(tmp_path, fake, n=1, startup_timeout_s=20)


def test_a_server_that_refuses_the_key_fails_at_once(tmp_path, fake, monkeypatch):
    import time

    monkeypatch.setenv("FAKE_MODE", "401")
    t0 = time.monotonic()
    with pytest.raises(RunFailure, match=r"refused the run's API key \(HTTP 401\)"):
        _pool(tmp_path, fake, n=1, startup_timeout_s=20)
    assert time.monotonic() - t0 < 15


def test_a_restart_whose_every_try_fails_raises_after_backing_off(tmp_path, fake, monkeypatch, caplog):
    """restart_tries=3: starts 2 and 3 come restart_backoff_s and 2 * restart_backoff_s after the one before;
    when the last fails too, restart raises (the engine's probe tries again later)."""
    pool = _pool(tmp_path, fake, n=2)
    fail = tmp_path / "fail"
    monkeypatch.setenv("FAKE_FAIL", str(fail))
    try:
        pool.restart_tries, pool.restart_backoff_s = 3, 0.05
        url = pool.urls[1]
        fail.write_text("3")
        pool.procs[url].kill()
        with caplog.at_level(logging.WARNING, logger="cascade.rollout"), pytest.raises(
                RunFailure, match=r"exited with code 3 while starting: ValueError: unrecognized arguments: --bogus "
                                  r"\(log: .*server-1\.log\)"):
            pool.restart(url)
        assert [m for m in caplog.messages if "trying again in" in m] and \
            [m.rsplit("trying again in ", 1)[1] for m in caplog.messages if "trying again in" in m] == ["0.05 s",
                                                                                                   "0.1 s"]
        assert fail.read_text().strip() == "0" and pool.restarts == 0
    finally:
        pool.close()


def test_closing_a_pool_stops_what_its_servers_started(tmp_path, fake, monkeypatch):
    """A server's own processes (vLLM's engine core and workers) are stopped with it when the pool closes."""
    from tests.test_isolated import _gone

    monkeypatch.setenv("FAKE_CHILD", "1")
    pool = _pool(tmp_path, fake, n=1)
    child = int((tmp_path / f"child-{pool.urls[0].rsplit(':', 1)[1]}").read_text())
    assert not _gone(child, wait=0)
    pool.close()
    assert _gone(child)  # (waits up to 10 s)


def test_a_catch_up_over_the_weight_group_never_sends_an_older_version():
    """A restarted server that cannot read the version files takes the newest version over a group of its own,
    but only when the one held in memory is the version served (after a version that went by files, it is not)."""
    from cascade.rollout import ServedEngine

    pushed = []
    eng = ServedEngine.__new__(ServedEngine)
    eng.broadcaster = SimpleNamespace(push=lambda sd, v, urls: pushed.append((v, urls)))
    eng._last, eng.version = (1, {"w": torch.ones(1)}), 2
    assert eng._catch_up_by_broadcast("http://h:1") is False and pushed == []
    eng.version = 1
    assert eng._catch_up_by_broadcast("http://h:1") is True and pushed == [(1, ["http://h:1"])]


def test_versions_given_out_by_a_served_engine(tmp_path, fake):
    """load_weights without a version gives out the next one; load_published serves the given one; each is what
    the server loads and what the exchange directory records as served."""
    from cascade.rollout import ServedEngine
    from train.rl.exchange import publish_version, serving_version

    pool = _pool(tmp_path, fake, n=1)
    eng = ServedEngine(pool.urls, tmp_path / "exchange", KEY, pool)
    try:
        sd = {"w": torch.ones(2)}
        eng.load_weights(sd)
        eng.load_weights(sd)
        assert eng.version == 2 and serving_version(tmp_path / "exchange") == 2
        publish_version(tmp_path / "exchange", 7, sd)
        eng.load_published(7)
        assert eng.version == 7 and serving_version(tmp_path / "exchange") == 7
        assert eng.remote._conn(pool.urls[0]).call("GET", "/v1/weights")["version"] == 7
        assert eng.records_routing  # Cascade's server (owned_by cascade)
        eng.remote.owned_by[pool.urls[0]] = "vllm"
        assert not eng.records_routing
    finally:
        eng.close()


def test_a_server_back_catches_up_to_the_version_served(tmp_path, fake):
    """A server restarted by the pool loads the version the run serves when it says another one; and when it
    says the same number, loads it anyway if that version's files are complete (version 0 is given out twice)."""
    from cascade.rollout import ServedEngine
    from train.rl.exchange import publish_version

    pool = _pool(tmp_path, fake, n=1)
    eng = ServedEngine(pool.urls, tmp_path / "exchange", KEY, pool)
    (url,) = pool.urls
    try:
        def back():
            pool.procs[url].kill()
            pool.procs[url].wait()
            assert eng._down(url) is True
            return eng.remote._conn(url).call("GET", "/v1/weights")

        assert back() == {"version": 0, "loads": 0}  # nothing published, the server's version is the run's
        publish_version(tmp_path / "exchange", 0, {"w": torch.ones(2)})
        assert back() == {"version": 0, "loads": 1}  # version 0 republished: loaded
        eng.load_published(3)  # (a version whose files it does not check)
        assert back() == {"version": 3, "loads": 1}
    finally:
        eng.close()


def test_a_served_engine_refuses_an_unknown_transport():
    from cascade.rollout import ServedEngine

    with pytest.raises(ConfigError, match="unknown rollout.weight_transport 'nccl'; choose from files, broadcast"):
        ServedEngine(["http://127.0.0.1:9"], Path("ex"), KEY, transport="nccl")


def test_url_key_takes_rollout_api_key_before_the_environment(monkeypatch):
    from cascade.rollout import url_key

    monkeypatch.setenv("CASCADE_API_KEY", "from-env")
    assert url_key(SimpleNamespace(api_key="from-config")) == "from-config"
    assert url_key(SimpleNamespace(api_key=None)) == "from-env"
    monkeypatch.delenv("CASCADE_API_KEY")
    assert url_key(SimpleNamespace(api_key=None)) is None


class _Recorder:
    """Stands in for ServerPool / ServedEngine: records its arguments."""
    made: list = []
    fail = False

    def __init__(self, *args, **kw):
        self.args, self.kw, self.closed = args, kw, False
        self.urls = ["http://127.0.0.1:1"]
        _Recorder.made.append(self)
        if _Recorder.fail and args and isinstance(args[0], list):
            raise RuntimeError("engine failed")

    def close(self):
        self.closed = True


@pytest.fixture
def recorded(monkeypatch):
    from cascade import rollout

    _Recorder.made, _Recorder.fail = [], False
    monkeypatch.setattr(rollout, "ServerPool", type("Pool", (_Recorder,), {}))
    monkeypatch.setattr(rollout, "ServedEngine", type("Engine", (_Recorder,), {}))
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    return _Recorder


def _cfg(*overrides):
    from cascade.config import load_run_config, parse_overrides

    return load_run_config(parse_overrides(["stage=math", "profile=tiny", *overrides]))[0]


def test_served_engine_wires_rollout_urls(tmp_path, recorded):
    from cascade.rollout import served_engine

    assert served_engine(_cfg(), tmp_path, tmp_path / "out", tmp_path / "logs") is None  # neither: in-process
    with pytest.raises(ConfigError, match=r"rollout.urls needs rollout.api_key"):
        served_engine(_cfg("rollout.urls=[http://h:1]"), tmp_path, tmp_path / "out", tmp_path / "logs")
    assert recorded.made == []
    old = tmp_path / "out" / "exchange" / "weights" / "v3"
    old.mkdir(parents=True)  # a version of an earlier stage
    eng = served_engine(_cfg("rollout.urls=[http://h:1, http://h:2]", "rollout.api_key=K", "rollout.per_server=3",
                             "rollout.down_wait_s=7", "rollout.readmit_s=2.5"), tmp_path, tmp_path / "out",
                        tmp_path / "logs")
    assert not old.exists() and (tmp_path / "out" / "exchange").is_dir()
    assert eng.args == (["http://h:1", "http://h:2"], tmp_path / "out" / "exchange", "K")
    assert eng.kw["per_server"] == 3 and eng.kw["down_wait_s"] == 7 and eng.kw["readmit_s"] == 2.5


def test_served_engine_wires_rollout_servers(tmp_path, recorded):
    from cascade.rollout import served_engine

    eng = served_engine(_cfg("rollout.servers=2", "rollout.api_key=K2", "rollout.gpus=[0, 1]", "rollout.threads=2"),
                        tmp_path, tmp_path / "out", tmp_path / "logs")
    pool = recorded.made[0]
    assert pool.args[:6] == (2, tmp_path, tmp_path / "out" / "exchange", "K2", 2, tmp_path / "logs")
    assert pool.kw["gpus"] == [0, 1] and pool.kw["backend"] == "cascade"
    assert pool.args[8] == "cpu"  # the run's device (device=cpu: None let a server take a GPU where there is one)
    assert eng.args[2] == "K2" and eng.args[3] is pool
    recorded.made, recorded.fail = [], True  # the engine fails: the servers started for it are stopped
    with pytest.raises(RuntimeError, match="engine failed"):
        served_engine(_cfg("rollout.servers=1"), tmp_path, tmp_path / "out", tmp_path / "logs")
    assert recorded.made[0].closed


def test_vllm_python_is_one_that_has_vllm(tmp_path):
    from cascade.rollout import vllm_python

    has, lacks = tmp_path / "has" / "python", tmp_path / "lacks" / "python"
    for py, rc in ((has, 0), (lacks, 3)):  # (the probe exits 3 where vllm or fastapi is missing)
        py.parent.mkdir()
        py.write_text(f"#!/bin/sh\nexit {rc}\n")
        py.chmod(0o755)
    assert vllm_python(str(has)) == str(has)
    with pytest.raises(ConfigError, match="vLLM is not installed for .*lacks/python"):
        vllm_python(str(lacks))
    with pytest.raises(ConfigError, match="no Python at"):
        vllm_python(str(tmp_path / "nope" / "python"))
