"""Rollouts from Cascade's OpenAI-compatible servers (:mod:`train.engine.server`) over HTTP.

``RemoteEngine(urls, api_key=None, model=None)`` honours the :class:`~train.engine.base.Engine`
contract for token-id (or text) prompts: each prompt is one ``/v1/completions`` request carrying
``params.n``; prompts are spread over the servers through one shared queue, with ``per_server``
requests in flight per server (the server batches concurrent requests into one engine call). Text prompts go
with ``add_special_tokens: false`` (encoded as the in-process engines encode them) and, where the servers' context
is known, at most ``context - 1`` new tokens (the server cuts that to the room the prompt leaves).
Completions carry token ids, behaviour log-probs, finish reason (``"stop"`` or ``"length"``, a server's synonyms
read as :func:`~train.engine.base.finish_kind` reads them), the weight ``versions`` of every
token and, when asked, ``routed_experts`` (per MoE layer LongTensor [1, P + C, k], as the torch
and vLLM engines give them). The same requests work against vLLM's server started through
:mod:`train.engine.vllm_server` (``return_token_ids`` gives the ids, ``versions`` are added there);
without ``token_ids`` in a choice the ids are read from the ``token_id:N`` logprob tokens.

Seeds. Prompt i is sent with seed ``seeds[i]`` when given (then its samples are exactly those of
``TorchEngine.generate(prompts, params, seeds=seeds)`` in-process, whichever server runs it), else
with a seed derived from ``(params.seed, i)``, else a random one.

Weights. ``load_version(v)`` asks every server to load version ``v`` from the run's exchange
directory (``POST /v1/load_weights``, which needs the servers' API key); servers take it in flight.
``load_weights(state_dict)`` is refused: publish with :func:`train.rl.exchange.publish_version`.

Fault tolerance. A server that refuses or drops a connection (killed, restarted), does not answer within
the timeout, or answers with a server error (5xx: out of memory, a dead engine) is taken out of the
pool (why is logged, and named in the error when no server is left); its in-flight prompts are sent again to
the servers left, and ``on_server_down(url)`` is called (a caller that started the server may restart it at
the same URL; when the hook returns True the server is checked and used again; when it raises, or the server it
started does not answer, the background probe below calls it again). A prompt whose requests took
servers down ``len(urls) + 2`` times (an engine error on that prompt alone, a generation longer than the
timeout) fails the call, naming the prompt and the last error, rather than restarting servers for ever. A choice
the server did not finish (a finish reason other than a stop or ``length``, e.g. vLLM's ``abort``: a partial
rollout) sends the prompt again, its server staying in the pool; after ``len(urls) + 2`` such answers the call fails,
naming the prompt. A server that dies while it loads weights and is restarted by a ``generate`` worker meanwhile
is sent the load again (not restarted a second time).
A server out of the pool is probed in the background at most every ``readmit_s`` seconds (``GET /v1/models``,
as at the start): one that answers again with the expected model (restarted at its URL by whoever runs it)
rejoins from the next ``generate`` or ``load_version`` call, after ``on_server_back(url)`` (the caller's
catch-up to the newest weights) returns True; ``readmitted`` counts them. When every server is out of the
pool, a call waits up to ``down_wait_s`` (default 0) for one to come back before it raises; the prompts it
already has answers for are kept. A server restarted at its URL between two requests (never seen down) is
told by the ``instance`` id in its answers (:mod:`train.engine.server` and :mod:`train.engine.vllm_server`
give one): the answer, sampled by weights the run did not give it, is dropped and its prompt sent again (so is
an answer to a request sent before the catch-up), and the server takes prompts again after
``on_server_back(url)`` returns True (counted in ``readmitted``), else it leaves the pool. A request the server
answers with 4xx is an error of the request and raises. Only the standard library is used.
"""
from __future__ import annotations

import http.client
import json
import logging
import queue
import random
import socket
import threading
import time
import urllib.parse
from typing import Callable, Sequence

from train.engine.base import (Completion, GenerationInterrupted, SamplingParams, check_prompts, completion_request,
                               finish_kind, request_inputs)
from train.engine.sampling import row_seed
from train.errors import RunFailure

log = logging.getLogger(__name__)

_DOWN = (ConnectionError, socket.timeout, TimeoutError, http.client.RemoteDisconnected,
         http.client.BadStatusLine, http.client.IncompleteRead, OSError)


class RemoteError(RunFailure):
    """A server answered with an error, or no server is left."""


class _ServerDown(Exception):
    pass


class _Unfinished(Exception):
    """A choice the server did not finish (its finish reason, e.g. vLLM's ``abort``, is neither a stop nor the
    length budget: :func:`~train.engine.base.finish_kind`): a partial rollout, not one to train on."""


class _Conn:
    """One keep-alive HTTP connection to a server (one per worker thread)."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad server URL {url!r}; expected http://HOST:PORT")
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self._cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = u.hostname, u.port
        self._prefix = u.path.rstrip("/")
        if self._prefix.endswith("/v1"):
            self._prefix = self._prefix[:-3]
        self._c: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._c is not None:
            self._c.close()
            self._c = None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        """JSON in, JSON out. Raises :class:`_ServerDown` when the server cannot be reached (after one
        retry on a fresh connection, in case a kept-alive one went stale) or does not answer within the
        timeout (not retried), and :class:`RemoteError` when it answers with an error status."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(2):
            fresh = self._c is None
            if fresh:
                self._c = self._cls(self._host, self._port, timeout=self.timeout)
            try:
                self._c.request(method, self._prefix + path, body=data, headers=headers)
                r = self._c.getresponse()
                raw = r.read()
                status = r.status
                break
            except _DOWN as e:
                self.close()
                # a kept-alive connection the server closed fails at once: sent again on a fresh one; a timeout is
                # a server that took the request and did not answer in time (sending it again would run it twice)
                if fresh or attempt or isinstance(e, (socket.timeout, TimeoutError)):
                    raise _ServerDown(f"{type(e).__name__}: {e}") from None
        try:
            obj = json.loads(raw or b"{}")
        except ValueError:
            obj = {}
        if status >= 400:
            msg = obj.get("error", {}).get("message") if isinstance(obj.get("error"), dict) else None
            what = f"HTTP {status}: {msg or raw[:200].decode(errors='replace')}"
            if status >= 500:  # the server's failure, not the request's: its prompts go to the others
                raise _ServerDown(what)
            raise RemoteError(f"{self.url}{path}: {what}")
        return obj


def logprob_mismatch(mode: str | None, params: SamplingParams) -> str | None:
    """Why log-probs a server reports in vLLM's ``--logprobs-mode`` ``mode`` are not the quantity the engines
    return and the trainer recomputes, log_softmax(logits / T) of the sampled token before any truncation,
    penalty or bias, under ``params``; None when they are (or the server names no mode: Cascade's own)."""
    if mode is None:
        return None
    if mode == "raw_logprobs":  # log_softmax(logits): the quantity at temperature 1 (and greedy, taken at 1)
        return None if params.temperature in (0.0, 1.0) else f"raw_logprobs are at temperature 1, not {params.temperature}"
    if mode == "processed_logprobs":
        on = [k for k, v in (("top_k", params.top_k > 0), ("top_p", params.top_p < 1), ("min_p", params.min_p > 0),
                             ("penalties", params.repetition_penalty != 1 or params.presence_penalty
                              or params.frequency_penalty), ("logit_bias", params.logit_bias),
                             ("min_tokens", params.min_tokens > 0)) if v]
        return None if not on else (f"processed_logprobs come after {', '.join(on)} (a truncation or min_tokens' "
                                    "stop mask renormalises: a token's log-prob is higher by -log(kept mass))")
    return f"logprobs mode {mode!r} is not log_softmax(logits / T)"


def fan_out(urls, call: Callable, wait: bool = True) -> tuple[dict, list[threading.Thread]]:
    """Run ``call(url)`` for every url, each on its own thread; returns ``({url: result or the
    exception it raised}, threads)``. With ``wait=False`` it returns at once, and the dict is
    complete once the caller has joined the threads."""
    out: dict = {}

    def one(u):
        try:
            out[u] = call(u)
        except Exception as e:  # noqa: BLE001 - collected for the caller
            out[u] = e

    threads = [threading.Thread(target=one, args=(u,), daemon=True) for u in urls]
    for t in threads:
        t.start()
    for t in threads if wait else ():
        t.join()
    return out, threads


class RemoteEngine:
    """Generation on one or more servers of :mod:`train.engine.server` (see the module docstring).

    ``urls``: server base URLs (``http://host:port``, with or without ``/v1``); ``api_key``: their
    bearer token; ``model``: the served model name every server must report (default: whatever the
    first one serves, and all must agree); ``timeout``: seconds per request; ``per_server``:
    requests in flight per server; ``on_server_down(url) -> bool``, ``on_server_back(url) -> bool``
    ``readmit_s`` and ``down_wait_s``: see the module docstring."""

    def __init__(self, urls: Sequence[str] | str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, per_server: int = 8,
                 on_server_down: Callable[[str], bool | None] | None = None,
                 on_server_back: Callable[[str], bool] | None = None, readmit_s: float = 10.0,
                 down_wait_s: float = 0.0):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RemoteEngine needs at least one server URL")
        if per_server < 1:
            raise ValueError(f"per_server must be >= 1, got {per_server}")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server URLs in {self.urls}")
        if readmit_s <= 0 or down_wait_s < 0:
            raise ValueError(f"readmit_s must be > 0 and down_wait_s >= 0, got {readmit_s} and {down_wait_s}")
        self.down_wait_s = down_wait_s
        self.api_key, self.timeout, self.per_server = api_key, timeout, per_server
        self.on_server_down, self.on_server_back, self.readmit_s = on_server_down, on_server_back, readmit_s
        self.tokenizer = None
        self.model = model
        self.context_length = None
        self._instances: dict[str, str | None] = {}  # url -> the server process admitted there
        self.down_reason: dict[str, str] = {}  # url -> why it last left the pool
        self.closed = False
        self._warned: set[tuple[str, str]] = set()  # (url, reason) of a log-prob warning given
        self.owned_by: dict[str, str | None] = {}  # url -> its model card's owned_by (cascade, vllm)
        self._rejoin_lock = threading.Lock()
        for u in self.urls:
            self._check(u)
        self.alive = set(self.urls)
        self.resent = 0  # prompts sent again after their server went down
        self.requests: dict[str, int] = {u: 0 for u in self.urls}  # requests sent per server
        self._seed_rng = random.Random()
        self._lock = threading.Lock()
        self.readmitted = 0  # servers that came back and rejoined the pool
        self._back: list[str] = []  # probed back, caught up, waiting to rejoin at the next call
        self._restart_failed: set[str] = set()  # the hook could not bring them back: the probe restarts them again
        self._probe: threading.Thread | None = None
        self._probed_at = 0.0
        self._interrupted = threading.Event()

    # -- servers ---------------------------------------------------------------------------------
    def _conn(self, url: str, timeout: float | None = None) -> _Conn:
        return _Conn(url, self.api_key, self.timeout if timeout is None else timeout)

    def _check(self, url: str, timeout: float = 30.0) -> None:
        """The server answers and serves the expected model (one-line errors)."""
        c = self._conn(url, timeout=min(self.timeout, timeout))
        try:
            models = c.call("GET", "/v1/models")
        except _ServerDown as e:
            raise ConnectionError(f"cannot reach rollout server {url}: {e}") from None
        except RemoteError as e:
            raise ConnectionError(f"rollout server {url} refused /v1/models: {e}") from None
        finally:
            c.close()
        self._instances[url] = models.get("instance")
        cards = models.get("data") or []
        self.owned_by[url] = next((m.get("owned_by") for m in cards), None)  # "vllm" for vLLM's server
        names = [m.get("id") for m in cards]
        if self.model is None:
            if not names:
                raise ValueError(f"rollout server {url} lists no model")
            self.model = names[0]
        if self.model not in names:
            raise ValueError(f"rollout server {url} serves {names}, not the expected model {self.model!r}")
        ctx = next((m.get("max_model_len") for m in cards if m.get("id") == self.model), None)
        if ctx is not None:
            self.context_length = ctx if self.context_length is None else min(self.context_length, ctx)

    def _readmit(self) -> None:
        """Rejoin the servers the background probe found back; start a probe of the servers out of the
        pool when the last began ``readmit_s`` ago or more (the calling thread never waits on one)."""
        with self._lock:
            back, self._back = self._back, []
            for u in back:
                self.alive.add(u)
            self.readmitted += len(back)
            down = [u for u in self.urls if u not in self.alive]
            if not down or (self._probe is not None and self._probe.is_alive()) \
                    or time.monotonic() - self._probed_at < self.readmit_s:
                return
            self._probed_at = time.monotonic()
            self._probe = threading.Thread(target=self._probe_down, args=(down,), daemon=True, name="remote-readmit")
            self._probe.start()

    def _probe_down(self, urls: list[str]) -> None:
        for u in urls:
            try:
                self._check(u, timeout=5.0)
                ok = self.on_server_back is None or bool(self.on_server_back(u))
            except Exception:  # noqa: BLE001 - still down, or back with something else: probed again later
                ok = u in self._restart_failed and self._restarted(u)  # (a restart the hook failed: tried again)
            if ok:
                with self._lock:
                    self._restart_failed.discard(u)
                    self._back.append(u)

    def health(self) -> dict[str, dict]:
        """Per server: ``{"ok": bool, "version": int | None, "error": str | None}``."""
        out = {}
        for u in self.urls:
            c = self._conn(u, timeout=min(self.timeout, 10.0))
            try:
                v = c.call("GET", "/v1/weights").get("version")
                out[u] = {"ok": True, "version": v, "error": None}
            except (_ServerDown, RemoteError) as e:
                out[u] = {"ok": False, "version": None, "error": str(e)}
            finally:
                c.close()
        return out

    def load_version(self, version: int | None = None, path: str | None = None) -> dict[str, int]:
        """Every live server loads weight ``version`` (or the version directory ``path``) of the run's
        exchange directory, in flight; returns the version each server reports. Raises with the
        servers' one-line errors if any refuses (those that loaded keep the new version). A server
        that is down is handled as in :meth:`generate`: out of the pool, or restarted by the hook
        and then loaded."""
        if (version is None) == (path is None):
            raise ValueError("load_version needs exactly one of version or path")
        body = {"version": int(version)} if version is not None else {"path": str(path)}
        while True:  # every server down (restarted by whoever runs them): wait for one, as generate does
            results = self._load_on(self._live_servers("no rollout server left to load weights"), body)
            if results:
                break
        bad = {u: r for u, r in results.items() if isinstance(r, Exception)}
        if bad:
            raise RemoteError("; ".join(f"{u}: {e}" for u, e in bad.items()))
        return dict(results)

    def _load_on(self, urls: list[str], body: dict) -> dict:
        """:meth:`load_version` on ``urls``: each server's version or error; a server down is left out (or
        restarted by the hook and loaded)."""

        def one(u):
            c = self._conn(u)
            try:
                return int(c.call("POST", "/v1/load_weights", body)["version"])
            finally:
                c.close()

        with self._lock:
            sent_to = {u: self._instances.get(u) for u in urls}  # the process each load goes to
        results = fan_out(urls, one)[0]
        for u in [u for u, r in results.items() if isinstance(r, _ServerDown)]:  # died: as in generate
            with self._lock:
                # a generate worker found it down first and brought it back (a new process, in the pool again; else
                # it still brings it back): the load is sent to the new one, not restarted a second time
                moved = u in self.alive and self._instances.get(u) != sent_to[u]
                first = u in self.alive and not moved
                if first:
                    self.alive.discard(u)
            if moved or (first and self._restarted(u)):
                with self._lock:
                    self.alive.add(u)
                results.update(fan_out([u], one)[0])
            else:
                del results[u]
        return results

    # -- contract --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]] | Sequence[str], params: SamplingParams,
                 seeds: Sequence[int] | None = None, return_routed_experts: bool = False) -> list[Completion]:
        prompts, seeds = request_inputs(prompts, seeds)
        if seeds is None:
            if params.seed is not None:
                seeds = [row_seed(params.seed, i, 0) & 0x7FFFFFFF for i in range(len(prompts))]
            else:
                seeds = [self._seed_rng.getrandbits(31) for _ in prompts]
        if not prompts:
            return []
        # as the in-process engines: each prompt generates at most what its context leaves (vLLM's server
        # answers 400 to prompt + max_tokens > max_model_len), and a prompt that leaves nothing is refused; a text
        # prompt's length is the server's to know: it gets at most context - 1 (Cascade's server cuts that to the
        # room the prompt leaves; one above max_model_len itself is a 400 there)
        room = [params.max_tokens] * len(prompts)
        ctx = self.context_length
        if ctx is not None:
            if not any(isinstance(x, str) for x in prompts):
                check_prompts(prompts, ctx)
            room = [min(params.max_tokens, ctx - 1 if isinstance(x, str) else max(1, ctx - len(x))) for x in prompts]
        base = {"model": self.model, **completion_request(params)}
        if any(isinstance(x, str) for x in prompts):  # encoded as the in-process engines encode them (servers
            base["add_special_tokens"] = False  # add a tokenizer's BOS to text prompts by default, as vLLM)
        if return_routed_experts:
            base["return_routed_experts"] = True
            base["routed_experts_format"] = "base64"  # int16 bytes, not a JSON list of lists (Cascade's servers)
        todo: queue.Queue = queue.Queue()
        for i in range(len(prompts)):
            todo.put(i)
        results: list[list[Completion] | None] = [None] * len(prompts)
        state = {"left": len(prompts), "error": None}
        # a prompt whose requests took down this many servers (or the same one, restarted) is the cause, not the
        # servers: the call fails naming it, rather than restarting servers for ever (an engine error on it, or a
        # generation longer than the timeout)
        max_tries = len(self.urls) + 2
        tries = [0] * len(prompts)
        cond = threading.Condition()
        live: dict[str, int] = {}  # workers still running per server

        def finished() -> bool:
            return state["left"] == 0 or state["error"] is not None or not any(live.values()) or \
                self._interrupted.is_set()

        def again(i: int, failed: str, why: str, resend: bool) -> None:
            """(Under ``cond``) one more try of prompt ``i``: queued again, or, once it had ``max_tries``, the call
            fails ("prompt i of n FAILED k times WHY"). ``resend``: counted in ``resent`` (its server went down)."""
            tries[i] += 1
            if tries[i] >= max_tries:
                state["error"] = state["error"] or RemoteError(f"prompt {i} of {len(prompts)} {failed} {tries[i]} "
                                                               f"times {why}")
            else:
                todo.put(i)
                self.resent += resend
            cond.notify_all()

        def worker(url: str) -> None:
            conn = self._conn(url)
            try:
                while True:
                    with cond:
                        while todo.empty() and not finished() and url in self.alive:
                            cond.wait(0.5)
                        if finished() or url not in self.alive:
                            return
                        i = todo.get_nowait()
                    body = dict(base, prompt=prompts[i], seed=int(seeds[i]), max_tokens=room[i])
                    if "min_tokens" in body:  # (at most what the context leaves, as the in-process engines)
                        body["min_tokens"] = min(body["min_tokens"], room[i])
                    with self._lock:
                        self.requests[url] += 1
                        sent_to = self._instances.get(url)  # the process the run admitted there when sent
                    try:
                        obj = conn.call("POST", "/v1/completions", body)
                        if not self._same_instance(url, obj.get("instance"), sent_to):  # restarted unseen (or
                            with cond:  # caught up after this was sent): sampled by weights the run did not give
                                todo.put(i)  # it; sent again once it caught up
                                self.resent += 1
                                cond.notify_all()
                            if self._rejoined(url, obj.get("instance")):
                                continue
                            with cond:
                                self.alive.discard(url)
                                cond.notify_all()
                            return
                        outs = _completions(obj, i, return_routed_experts)
                        self._check_logprobs(url, obj.get("logprobs_mode"), params)
                    except _ServerDown as e:
                        with cond:
                            first = url in self.alive
                            self.alive.discard(url)
                            if first:
                                self.down_reason[url] = str(e)
                                if not self.closed:  # a run closing stops its servers: no news
                                    log.warning("rollout server %s left the pool: %s", url, e)
                            again(i, "failed", f"(its server went down or answered 5xx; last: {url}: {e}): the prompt, "
                                               "not the servers, is the likely cause", True)
                        if state["error"] is not None:
                            return
                        if first and self._restarted(url):  # the hook brought it back: keep using it, with
                            with cond:  # per_server workers again (its others have left)
                                self.alive.add(url)
                                more = self.per_server - live[url]
                                live[url] += more
                            for _ in range(more):
                                start(url)
                            continue
                        return
                    except _Unfinished as e:  # (an aborted request) sent again; the server stays in the pool
                        with cond:
                            again(i, "came back unfinished", f"(last: {url}: {e})", False)
                        if state["error"] is not None:
                            return
                        continue
                    except Exception as e:  # noqa: BLE001 - a 4xx or a malformed answer fails the call
                        with cond:
                            state["error"] = state["error"] or e
                            cond.notify_all()
                        return
                    with cond:
                        results[i] = outs
                        state["left"] -= 1
                        cond.notify_all()
            finally:
                conn.close()
                with cond:
                    live[url] -= 1
                    cond.notify_all()

        threads: list[threading.Thread] = []

        def start(url: str) -> None:
            t = threading.Thread(target=worker, args=(url,), daemon=True, name=f"remote-{url}")
            t.start()
            threads.append(t)

        what = "no rollout server is alive"
        while True:  # a round per set of live servers: again when every one went down and one came back
            if self._interrupted.is_set():
                raise GenerationInterrupted("generation interrupted (the engine's interrupt())")
            servers = self._live_servers(what)
            live.update({u: self.per_server for u in servers})
            for u in servers:
                for _ in range(self.per_server):
                    start(u)
            while threads:  # (a worker may start more: a restarted server's)
                threads[0].join(0.2)
                if not threads[0].is_alive():
                    threads.pop(0)
                if self._interrupted.is_set():  # (the workers, daemons, end with the requests they sent)
                    raise GenerationInterrupted("generation interrupted (the engine's interrupt())")
            if state["error"] is not None:
                raise state["error"]
            if not state["left"]:
                return [c for outs in results for c in outs]
            what = f"every rollout server went down; {state['left']} of {len(prompts)} prompts unanswered"

    def interrupt(self, on: bool = True) -> None:
        """Stop every ``generate`` running (without waiting for the requests in flight, which the servers finish) or
        started from now on with :class:`GenerationInterrupted`; ``interrupt(False)`` lets them run again."""
        (self._interrupted.set if on else self._interrupted.clear)()

    def _live_servers(self, what: str) -> list[str]:
        """The servers in the pool; when none is, wait up to ``down_wait_s`` for one to come back
        (probed every ``readmit_s``), else raise :class:`RemoteError` saying ``what``."""
        deadline = time.monotonic() + self.down_wait_s
        warned = False
        while True:
            self._readmit()
            if self.alive:
                return sorted(self.alive)
            if time.monotonic() >= deadline:
                waited = f"; none came back in {self.down_wait_s:g} s" if self.down_wait_s > 0 else ""
                why = [f"{u}: {self.down_reason[u]}" if u in self.down_reason else u for u in self.urls]
                raise RemoteError(f"{what} (servers: {'; '.join(why)}{waited})")
            if not warned:
                log.warning("%s; waiting up to %g s for one to come back", what, self.down_wait_s)
                warned = True
            time.sleep(min(0.5, self.readmit_s))

    def _check_logprobs(self, url: str, mode: str | None, params: SamplingParams) -> None:
        """Warn once per server and reason when its log-probs are not the trainer's quantity (the importance ratio
        against them would be biased): :func:`logprob_mismatch`."""
        why = logprob_mismatch(mode, params)
        if why is not None and (url, why) not in self._warned:
            self._warned.add((url, why))
            log.warning("rollout server %s: its behaviour log-probs are not the trainer's: %s; start vLLM with "
                        "--logprobs-mode raw_logprobs at temperature 1, or sample without truncation", url, why)

    def _same_instance(self, url: str, instance, sent_to) -> bool:
        """The answer came from the server process that was admitted at ``url`` when the request was sent
        (``sent_to``), and still is (or the server names none; the first answer of a server whose ``/v1/models``
        names none, as vLLM's, names the one admitted). An answer of a process caught up after the request was
        sent is not: it may have been sampled before the catch-up."""
        if instance is None:
            return True
        with self._lock:
            known = self._instances.get(url)
            if known is None:
                self._instances[url] = instance
                return True
            return instance == known and sent_to in (None, known)  # (None: sent before the first answer named it)

    def _rejoined(self, url: str, instance: str) -> bool:
        """The server at ``url`` is a new process (``instance``), restarted between two requests: True
        once ``on_server_back(url)`` caught it up (done once, whichever worker saw it first)."""
        with self._rejoin_lock:
            if self._instances.get(url) == instance:
                return True
            try:
                ok = self.on_server_back is None or bool(self.on_server_back(url))
            except Exception:  # noqa: BLE001 - it cannot catch up: out of the pool, probed again later
                ok = False
            if ok:
                with self._lock:
                    self._instances[url] = instance
                    self.readmitted += 1
            return ok

    def _restarted(self, url: str) -> bool:
        """Tell the hook that ``url`` went down; True when it says it restarted the server and the
        server answers again. A restart that failed (the hook raised, or the server it started does not
        answer) is tried again by the background probe."""
        try:
            if self.on_server_down is None or not self.on_server_down(url):
                return False
            self._check(url)
        except Exception as e:  # noqa: BLE001 - it could not start again: out of the pool, restarted again later
            if not self.closed:
                log.warning("rollout server %s did not come back (its restart is tried again): %s", url, e)
            with self._lock:
                self._restart_failed.add(url)
            return False
        return True

    def load_weights(self, state_dict, version: int | None = None) -> None:
        raise NotImplementedError("RemoteEngine cannot ship a state dict; publish it with "
                                  "train.rl.exchange.publish_version and call load_version(version)")

    def close(self) -> None:
        """Marks the engine closed (the servers a run started are stopped next: their dropped requests are not
        reported as servers leaving the pool); it holds no connection of its own to close."""
        self.closed = True


def _completions(obj: dict, prompt_index: int, routed: bool) -> list[Completion]:
    from train.rl.exchange import decode_routing, unstack_routing

    bad = [ch.get("finish_reason") for ch in obj["choices"] if finish_kind(ch.get("finish_reason")) is None]
    if bad:
        raise _Unfinished(f"finish_reason {bad[0]!r}")
    out = []
    for ch in obj["choices"]:
        lps = ch.get("logprobs") or {}
        lp = lps.get("token_logprobs")
        if lp is None:
            raise RemoteError("the server returned no token logprobs")
        ids = ch.get("token_ids")
        if ids is None:  # a vLLM older than return_token_ids: the "token_id:N" strings of the logprobs
            try:
                ids = [int(str(t).rsplit(":", 1)[1]) for t in lps.get("tokens") or []]
            except (IndexError, ValueError):
                raise RemoteError("the server returned no token_ids (and no token_id:N logprob tokens)") from None
        if len(ids) != len(lp):
            raise RemoteError(f"the server returned {len(lp)} logprobs for {len(ids)} tokens")
        ptoks = ch.get("prompt_token_ids")
        versions = ch.get("versions")
        if versions is not None and len(versions) != len(ids):
            raise RemoteError(f"the server returned {len(versions)} versions for {len(ids)} tokens")
        c = Completion([int(t) for t in ids], ch.get("text", ""), [float(x) for x in lp],
                       finish_kind(ch["finish_reason"]), prompt_index, len(ptoks) if ptoks else 0, ptoks,
                       versions=versions)
        if routed:
            r = ch.get("routed_experts")
            if r is None:
                raise RemoteError("the server returned no routed_experts (not an MoE model, or an engine that "
                                  "cannot record them, e.g. a vLLM server: set rl.router_replay=false)")
            try:
                t = decode_routing(r)  # [P + C, n_moe, k]
            except (ValueError, TypeError, KeyError) as e:
                raise RemoteError(f"the server returned unreadable routed_experts: {e}") from None
            c.routed_experts = [x.contiguous() for x in unstack_routing(t)]
        out.append(c)
    return out
