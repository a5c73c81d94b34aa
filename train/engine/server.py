"""A minimal OpenAI-compatible HTTP server over any engine (``cascade serve`` / ``ttc serve``).

It belongs to the engine layer, so test-time compute (``ttc``) and RL rollouts both use it.

Endpoints: ``GET /v1/models``; ``POST /v1/completions`` (prompt as text, token ids, or a list of
either; n, max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
repetition_penalty, presence_penalty, frequency_penalty, min_tokens (vLLM's), logit_bias (OpenAI's: token id ->
bias in [-100, 100], a value past that clamped, as vLLM), logprobs, skip_special_tokens, return_routed_experts,
add_special_tokens (vLLM's: a text prompt is encoded with the tokenizer's special tokens, a BOS, unless false,
as ``/tokenize`` encodes it));
``POST /v1/chat/completions`` (the checkpoint's chat template);
``POST /tokenize`` and ``POST /detokenize`` (vLLM-style); ``GET /health`` (open without the API key, as vLLM
guards only ``/v1/*``); ``GET /v1/weights`` (the weight version served) and ``POST /v1/load_weights`` (see below). Each completion choice carries ``token_ids``
besides the text, ``logprobs.token_logprobs``, ``versions`` (the weight version that sampled each
token, where the engine tracks it) and, when the request sets ``return_routed_experts: true``,
``routed_experts``: the expert ids of every token of prompt + completion as nested lists
``[P + C, n_moe_layers, k]`` (the compact form of :func:`train.rl.exchange.stack_routing`), or with
``routed_experts_format: "base64"`` (what :class:`train.engine.remote.RemoteEngine` asks for) as
``{"shape", "dtype": "int16", "data"}``, the array's bytes in base64 (:func:`train.rl.exchange.encode_routing`);
``usage`` counts prompt tokens once per prompt. ``/v1/models``, ``/v1/weights`` and each completions
answer carry ``instance``, an id of the server process (new at each start): a client tells by it
that the server at a URL was restarted between two of its requests (and lost its weight version).

For OpenAI clients: ``"stream": true`` answers server-sent events (``text_completion`` /
``chat.completion.chunk`` chunks, ``stream_options.include_usage``, then ``[DONE]``); the engine
generates the whole completion first and the events carry it piece by piece. Chat without
``max_tokens`` may use the rest of the context (as vLLM); a ``max_tokens`` past the room the prompt leaves is
cut to it, one above ``max_model_len`` itself is a 400 (as vLLM); chat content may be a list of text parts;
``logprobs: k`` (completions) and ``top_logprobs: k`` (chat) return the k most likely tokens per
position (one teacher-forced forward pass); a model name not served answers 404. As in vLLM, the text
leaves out the special tokens a model emits mid-text unless the request sets ``"skip_special_tokens":
false`` (what Cascade's own clients do: the text then equals the engine's decode, which RL verifies). Chat also takes
vLLM's ``continue_final_message`` (go on from a last assistant message), ``chat_template`` and
``chat_template_kwargs`` (e.g. ``enable_thinking``; ``/tokenize`` with ``messages`` too). Fields of OpenAI's or
vLLM's requests that would change the output and that this server does not implement (``tools``,
``response_format``, beam search, structured outputs, ``allowed_token_ids``, ...: ``_UNSUPPORTED``) are a 400
naming the field unless absent or at a value that changes nothing. Boolean fields are JSON booleans (or the
strings "true"/"false", as pydantic reads them in vLLM); anything else is a 400 naming the field.

A request with ``seed`` samples prompt i exactly as ``engine.generate([prompt_i], seed=seed)``
(every prompt of a batch request gets that seed, as in vLLM; a request without one gets a random
seed). Requests that arrive together (within ``batch_window_s``) and share their sampling settings
run as one batched ``engine.generate`` call with per-prompt seeds, so concurrent clients (RSA's N
aggregation requests, RL rollout workers) are batched, and prefix-cached, without changing any
request's samples.

Weight updates. A server started with an API key and a run's exchange directory (``weights_dir``,
the root that :mod:`train.rl.exchange` publishes versions under) accepts ``POST /v1/load_weights``
with ``{"version": N}`` or ``{"path": "v000004"}`` (relative to ``weights_dir/weights``, or
absolute) and the key as ``Authorization: Bearer KEY``. It loads only from that directory through
:func:`train.rl.exchange.load_version` (checksums verified, paths outside refused); a bad request
answers 4xx with a one-line message (401 without the key, 403 when loading is off, 400 otherwise)
and the old weights stay. The engine takes the new weights in flight (``engine.load_weights(sd, version=N)``:
the torch engine applies them between two decoding steps; requests running continue), and the
answer is ``{"version": N}`` once they are in use. Instead of files, versions can arrive over a
process group with the trainer (:mod:`train.rl.weight_group`): ``POST /v1/weights_group`` with
``{"host", "port", "rank", "world_size", "name", "backend"}`` joins it (``GET /v1/weights`` says this
server brings 1 rank, and its device), and ``POST /v1/load_weights`` with ``{"version": N, "broadcast":
layout}`` receives version N over it, checksums verified, and applies it the same way;
``POST /v1/weights_group/abort`` ``{"name"}`` (rank 0 gave up on a broadcast, a member having failed) makes
that load answer at once instead of waiting for data until the group's timeout.
The standard library is all it needs (torch.distributed for the weight group).
"""
from __future__ import annotations

import argparse
import hmac
import inspect
import json
import os
import queue
import random
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from train.engine.base import ContextLengthError, SamplingParams


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _apply(engine, sd: dict, version: int) -> None:
    if "version" in inspect.signature(engine.load_weights).parameters:
        engine.load_weights(sd, version=version)
    else:  # an engine that does not number its weights (vLLM)
        engine.load_weights(sd)


class BadRequest(ValueError):
    pass


class Forbidden(PermissionError):
    pass


class NotFound(LookupError):
    pass


class Conflict(RuntimeError):
    """The server's state moved under the request (409)."""


@dataclass
class _Job:
    ids: list[list[int]]
    params: SamplingParams
    seeds: list[int]  # one per prompt
    routed: bool = False  # return_routed_experts
    fn: Callable | None = None  # Batcher.call: run this on the engine's thread instead
    done: threading.Event = field(default_factory=threading.Event)
    result: list | None = None
    error: BaseException | None = None


def _batch_key(p: SamplingParams) -> tuple:
    return (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, tuple(p.stop), tuple(p.stop_token_ids),
            p.ignore_eos, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens,
            tuple(sorted(p.logit_bias.items())))


class Batcher:
    """Runs the engine on one thread; requests that arrive within ``window_s`` of each other and
    share their sampling settings go through one ``generate`` call (per-prompt seeds keep every
    request's samples what they would be alone). The window slides: each arrival keeps the batch
    open ``window_s`` longer, up to ``max_wait_s`` after the first request (so a burst of clients
    that connect a few ms apart, e.g. many problems starting a round at once, is one batch rather
    than a batch of the first few followed by one of the rest). ``lock``, when given, is held around
    every ``generate`` call (callers that also use the engine directly hold it too).

    ``threads``: torch's intra-op threads of the engine's thread (set there when it starts). The
    engine's thread should be the only one of the process that runs torch ops on several threads:
    OpenMP (GNU) keeps a pool of workers for every thread that ever started a parallel region, and
    once the pools hold more threads than the machine has cores it stops spinning between regions,
    which made a 4-row decode 4x slower on this 2-core CPU (the model loaded on the main thread's
    pool of 2, then the engine decoding on its own). So the servers load the model on one thread
    (:func:`single_threaded_start`), and :meth:`call` runs other engine work (a weight load) here."""

    def __init__(self, engine, window_s: float = 0.005, max_prompts: int = 256, max_wait_s: float = 0.05,
                 lock: threading.Lock | None = None, threads: int | None = None):
        self.engine, self.window_s, self.max_prompts, self.max_wait_s = engine, window_s, max_prompts, max_wait_s
        self.threads = threads
        self.lock = lock or threading.Lock()
        self.batches = 0
        self._q: queue.Queue = queue.Queue()
        self._closed = False  # after close(): new jobs are refused (those queued before it still run)
        self._closing = threading.Lock()
        self._rng = random.Random()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-batcher")
        self._thread.start()

    def submit(self, ids: list[list[int]], params: SamplingParams, return_routed_experts: bool = False,
               seeds: list[int] | None = None):
        """The completions of ``ids`` (``params.n`` each, in order), prompt i sampled with ``seeds[i]``;
        without ``seeds`` every prompt gets ``params.seed``, or, when that is None, a random one of its own
        (prompts of one unseeded request are sampled independently, as vLLM samples them)."""
        if seeds is None:
            seeds = ([params.seed] * len(ids) if params.seed is not None
                     else [self._rng.getrandbits(31) for _ in ids])
        elif len(seeds) != len(ids):
            raise ValueError(f"{len(seeds)} seeds for {len(ids)} prompts")
        job = _Job(ids, params, [int(s) for s in seeds], bool(return_routed_experts))
        self._put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def call(self, fn):
        """``fn()`` on the engine's thread (after the calls queued before it, and before the requests of a batch
        still being gathered: they take its effects); returns what it returns or raises what it raised."""
        job = _Job([], SamplingParams(), [], fn=fn)
        self._put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _put(self, job: _Job) -> None:
        with self._closing:
            if self._closed:
                raise RuntimeError("the server is closing")
            self._q.put(job)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the engine thread after the calls already queued, waiting up to ``timeout`` s for it
        (a thread left inside the engine's native code at interpreter exit can abort the process);
        a call made after this raises."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self, jobs: list[_Job]) -> None:
        p = jobs[0].params
        prompts = [x for j in jobs for x in j.ids]
        seeds = [s for j in jobs for s in j.seeds]
        kw = {"return_routed_experts": True} if jobs[0].routed else {}
        with self.lock:
            outs = self.engine.generate(prompts, p, seeds=seeds, **kw)
        self.batches += 1
        k = first = 0
        for j in jobs:
            m = len(j.ids) * p.n
            j.result, k = outs[k:k + m], k + m
            for c in j.result:  # indices into this job's prompts, as if it had run alone
                c.prompt_index -= first
            first += len(j.ids)

    def _loop(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        while True:
            job = self._q.get()
            if job is None:
                return
            if job.fn is not None:
                self._call(job)
                continue
            t0 = time.monotonic()
            jobs, deadline, cap = [job], t0 + self.window_s, t0 + max(self.window_s, self.max_wait_s)
            while sum(len(j.ids) for j in jobs) < self.max_prompts:
                try:
                    nxt = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                if nxt.fn is not None:  # a call (a weight load) runs now: the batch being gathered has not
                    self._call(nxt)  # started, and takes its effect (it waited for the whole batch)
                    continue
                jobs.append(nxt)
                deadline = min(cap, time.monotonic() + self.window_s)
            groups: dict[tuple, list[_Job]] = {}
            for j in jobs:
                groups.setdefault((_batch_key(j.params), j.routed), []).append(j)
            for group in groups.values():
                try:
                    self._run(group)
                except Exception:  # noqa: BLE001 - run the requests alone so each gets its own error
                    for j in group:
                        try:
                            self._run([j])
                        except Exception as e:  # noqa: BLE001
                            j.error = e
                for j in group:
                    j.done.set()

    @staticmethod
    def _call(job: _Job) -> None:
        try:
            job.result = job.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.error = e
        job.done.set()


def _whole(v) -> int:
    """An integer field as OpenAI-compatible servers read it (pydantic's lax mode): an int, a float
    without a fraction, or a string of digits; a bool, 2.7 or "x" is a TypeError/ValueError."""
    if isinstance(v, bool):
        raise TypeError(v)
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(v)
    return int(v)


def _seed(v) -> int:
    """A seed: an integer in torch's int64 range, the bounds vLLM's server takes (a larger one wrapped around here:
    2**70 sampled as -2**70 did)."""
    w = _whole(v)
    if not -2 ** 63 <= w < 2 ** 63:
        raise ValueError(w)
    return w


def _flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field as OpenAI-compatible servers read it (pydantic's lax mode): a JSON boolean, the number 0 or 1,
    or the string "true"/"false" (any case); absent or null is ``default``, anything else a BadRequest naming the
    field (never read by truthiness, which took ``"ignore_eos": "false"`` for true)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise BadRequest(f"{name} must be true or false, got {json.dumps(v)[:60]}")


# fields of OpenAI's and vLLM's requests that change what is generated and that this server does not implement:
# refused unless absent or at a value that changes nothing (never answered as if they were not there)
_UNSUPPORTED = {"suffix": ("",), "use_beam_search": (False,), "length_penalty": (1,),
                "include_stop_str_in_output": (False,), "allowed_token_ids": (),
                "bad_words": ([],), "truncate_prompt_tokens": (), "prompt_logprobs": (), "logprob_token_ids": ([],),
                "prompt_embeds": (), "structured_outputs": (), "guided_json": (), "guided_regex": (),
                "guided_choice": (), "guided_grammar": (), "response_format": ({"type": "text"},),
                "repetition_detection": (), "thinking_token_budget": (), "watermarking": (False,), "tools": ([],),
                "documents": ([],), "reasoning_effort": (), "mm_processor_kwargs": ({},), "best_of": (),
                "functions": ([],), "function_call": ("none", "auto"), "logits_processors": ([],)}


def _refuse_unsupported(body: dict) -> None:
    for name, noop in _UNSUPPORTED.items():
        v = body.get(name)
        if name == "best_of":
            noop = (body.get("n", 1),)
        if noop == (False,):  # a boolean field: read as every other flag (false, 0, "false" change nothing)
            used = _flag(body, name, False)
        else:
            used = v is not None and not any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in noop)
        if used:
            raise BadRequest(f"{name}={json.dumps(v)[:60]} is not supported by this server")


def _bias(v: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) with each value clamped to [-100, 100], as vLLM's server."""
    if not isinstance(v, dict) or any(float(b) != float(b) for b in v.values()):  # NaN
        raise TypeError
    return {_whole(k): min(100.0, max(-100.0, float(b))) for k, b in v.items()}


def _params(body: dict, default_max: int = 16, context: int | None = None) -> SamplingParams:
    def get(name, default, cast):
        v = body.get(name)
        if v is None:
            return default
        try:
            return cast(v)
        except (TypeError, ValueError, OverflowError):
            kind = {_whole: "an integer", float: "a number", _bias: "an object of token ids to numbers",
                    _seed: "an integer in [-2**63, 2**63 - 1]"}.get(cast, "a list of integers")
            raise BadRequest(f"{name} must be {kind}, got {v!r}") from None

    if _flag(body, "echo", False):
        raise BadRequest("echo is not supported by this server")
    _flag(body, "stream", False)  # checked before anything is generated (a stream cannot turn into a 400)
    if isinstance(body.get("stream_options"), dict):
        _flag(body["stream_options"], "include_usage", False)
    _refuse_unsupported(body)

    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {body.get('stop')!r}")
    top_k = get("top_k", 0, _whole)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if context is not None and get(name, 0, _whole) > context:  # as vLLM (otherwise capped to the room left)
        raise BadRequest(f"{name}={body[name]} cannot be greater than max_model_len={context}. "
                         "Please request fewer output tokens.")
    try:
        return SamplingParams(n=get("n", 1, _whole), temperature=get("temperature", 1.0, float),
                              top_p=get("top_p", 1.0, float), top_k=top_k, min_p=get("min_p", 0.0, float),
                              max_tokens=get(name, default_max, _whole), stop=list(stop),
                              stop_token_ids=get("stop_token_ids", [], lambda v: [_whole(t) for t in v]),
                              seed=get("seed", None, _seed), ignore_eos=_flag(body, "ignore_eos", False),
                              repetition_penalty=get("repetition_penalty", 1.0, float),
                              presence_penalty=get("presence_penalty", 0.0, float),
                              frequency_penalty=get("frequency_penalty", 0.0, float),
                              min_tokens=get("min_tokens", 0, _whole), logit_bias=get("logit_bias", {}, _bias))
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def _ids(x: list) -> bool:
    """Whether every item of ``x`` is a token id's integer (JSON's true/false are none, though Python's bool is an int)."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(p) -> list:
    """OpenAI's prompt forms: str, [int], [str], [[int]]."""
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if _ids(p):
            return [p]
        ids_list = all(isinstance(x, list) and x and _ids(x) for x in p)
        if ids_list or all(isinstance(x, str) for x in p):
            return list(p)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either")


class Handler(BaseHTTPRequestHandler):
    server_version = "cascade-serve/0.1"
    protocol_version = "HTTP/1.1"
    # headers and body go out in two writes: with Nagle's algorithm on, the body waits for the
    # client's delayed ACK of the headers (~40 ms a response on Linux)
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # quiet unless asked
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)

    # plumbing
    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, msg: str) -> None:
        kinds = {400: "BadRequestError", 404: "NotFoundError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                 409: "ConflictError"}
        kind = kinds.get(code, "InternalServerError")
        self._send(code, {"error": {"message": msg, "type": kind, "code": code}})

    def _authorized(self) -> bool:
        key = getattr(self.server, "api_key", None)
        if key and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {key}".encode()):
            self.close_connection = True  # the request's body is left unread: it must not be taken for the next
            self._error(401, "invalid API key")
            return False
        return True

    def _route(self) -> str:
        """The request's path without its query (the openai client's ``default_query``, Azure's ``?api-version=``)
        nor a trailing slash: what the routes are chosen by."""
        return urllib.parse.urlsplit(self.path).path.rstrip("/")

    def _body(self) -> bytes:
        """The request's body: ``Content-Length`` bytes, or a chunked one (``Transfer-Encoding: chunked``, what
        ``requests`` and httpx send for an iterable body) read through its last chunk and trailers, so that none of
        it is left on a kept-alive connection to be read as the next request. A malformed body is a BadRequest."""
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            n = self.headers.get("Content-Length") or "0"
            if not n.strip().isdecimal():
                raise BadRequest(f"bad Content-Length {n!r}")
            return self.rfile.read(int(n))
        parts = []
        while True:
            line = self.rfile.readline(1026)
            size = line.split(b";", 1)[0].strip()  # a size in hex, maybe chunk extensions after a ";"
            if not line.endswith(b"\n") or not size or size.strip(b"0123456789abcdefABCDEF"):
                raise BadRequest(f"bad chunk size line {line[:40]!r} in a chunked body")
            n = int(size, 16)
            if n == 0:
                break
            parts.append(self.rfile.read(n))
            if len(parts[-1]) < n or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise BadRequest("a chunk of the chunked body ends early or without its CRLF")
        while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers: not used
            pass
        return b"".join(parts)

    def do_GET(self):
        path = self._route()
        if path == "/health":  # a liveness probe: open, as vLLM guards only /v1/*
            return self._send(200, {"status": "ok"})
        if not self._authorized():
            return
        if path == "/v1/models" or path.startswith("/v1/models/"):
            s = self.server
            card = {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "cascade",
                    "max_model_len": s.engine.context_length}
            if path == "/v1/models":
                self._send(200, {"object": "list", "data": [card], "instance": s.instance})
            # what the openai client's models.retrieve asks, the id percent-encoded ("org%2Fmodel")
            elif urllib.parse.unquote(path[len("/v1/models/"):]) == s.model_name:
                self._send(200, card)
            else:
                self._error(404, f"The model `{urllib.parse.unquote(path[len('/v1/models/'):])}` does not exist.")
        elif path == "/v1/health":
            self._send(200, {"status": "ok"})
        elif path == "/v1/weights":
            # group_members: how many ranks this server contributes to a weight group (train.rl.weight_group)
            # group_devices: the device each of them joins on (train.rl.weight_group.device_tag)
            from train.rl.weight_group import device_tag

            self._send(200, {"version": getattr(self.server.engine, "version", None), "group_members": 1,
                             "group_devices": [device_tag(self._device())], "instance": self.server.instance})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self):
        if not self._authorized():
            return
        try:
            raw = self._body()
        except BadRequest as e:  # where this body ends is unknown: the connection cannot serve another request
            self.close_connection = True
            return self._error(400, str(e))
        try:
            body = json.loads(raw.decode() or "{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(400, f"invalid JSON body: {e}")
        path = self._route()
        route = {"/v1/completions": self.completions, "/v1/chat/completions": self.chat,
                 "/tokenize": self.tokenize, "/detokenize": self.detokenize,
                 "/v1/load_weights": self.load_weights, "/v1/weights_group": self.weights_group,
                 "/v1/weights_group/abort": self.abort_broadcast}.get(path)
        if route is None:
            return self._error(404, f"no route POST {self.path}")
        try:
            out = route(body)
            try:
                streamed = path in ("/v1/completions", "/v1/chat/completions")
                if streamed and _flag(body, "stream", False):
                    return self._stream(out, body)
                self._send(200, out)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout): nobody to answer
                self.close_connection = True
        except Forbidden as e:
            self._error(403, str(e))
        except NotFound as e:
            self._error(404, str(e))
        except Conflict as e:
            self._error(409, str(e))
        except (BadRequest, ContextLengthError, ValueError) as e:  # bad prompts, ids out of range, ...
            self._error(400, str(e))
        except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dying
            self._error(500, f"{type(e).__name__}: {e}")

    # routes
    def _model_check(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and m != self.server.model_name:
            raise NotFound(f"model {m!r} is not served here; this server has {self.server.model_name!r}")

    def _generate(self, prompts: list, params: SamplingParams, return_routed_experts: bool = False):
        ids = self.server.engine.encode(prompts)
        return ids, self.server.batcher.submit(ids, params, return_routed_experts)

    def _tops(self, seqs: list, k: int, temperature: float, outs: list) -> list:
        """:func:`_top_logprobs` of each ``(prompt ids, completion ids)`` in ``seqs``, run on the engine's
        thread (like a weight load: never beside a decode step or a weight swap, and on the one OpenMP
        pool of the process). They come from the weights the engine holds then: a completion sampled (in
        part) by other weights (``outs``' versions; a load arrived meanwhile) gets a 409, not another
        model's alternatives."""
        eng = self.server.engine

        def run():
            now = getattr(eng, "version", None)
            moved = sorted({v for c in outs for v in (c.versions or ())} - {now})
            if moved:
                raise Conflict(f"top logprobs cannot be given: weights version {now} is loaded, and the completion "
                               f"was sampled by version(s) {moved}; ask again")
            return [_top_logprobs(eng, p, c, k, temperature) for p, c in seqs]

        return self.server.batcher.call(run)

    def completions(self, body: dict) -> dict:
        self._model_check(body)
        params = _params(body, context=self.server.engine.context_length)
        routed = _flag(body, "return_routed_experts", False)
        fmt = body.get("routed_experts_format", "list")
        if fmt not in ("list", "base64"):
            raise BadRequest(f"routed_experts_format must be list or base64, got {fmt!r}")
        packed = fmt == "base64"
        skip = _skips(body)
        # text prompts encoded as /tokenize encodes them: with the tokenizer's special tokens (a BOS) unless
        # add_special_tokens is false, as vLLM (token-id prompts are taken as they are)
        add = _flag(body, "add_special_tokens", True)
        tok = self.server.engine.tokenizer
        prompts = [tok.encode(p, add_special_tokens=add, verbose=False) if isinstance(p, str) else p
                   for p in _prompts(body.get("prompt"))]
        prompt_ids, outs = self._generate(prompts, params, routed)
        as_ids = _flag(body, "return_tokens_as_token_ids", False)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        top_k = _int_field(body, "logprobs") if want_lp and not isinstance(body.get("logprobs"), bool) else 0
        eng = self.server.engine
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: eng.decode([t]))  # noqa: E731
        tops = self._tops([(c.prompt_token_ids or prompt_ids[c.prompt_index], c.token_ids) for c in outs],
                          top_k, params.temperature, outs) if want_lp and top_k > 0 else [None] * len(outs)
        choices = []
        for i, (c, top) in enumerate(zip(outs, tops)):
            ch = {"index": i, "text": _shown(self.server, c, params, skip), "finish_reason": c.finish_reason,
                  "token_ids": c.token_ids,
                  "prompt_token_ids": c.prompt_token_ids, "logprobs": None, "versions": c.versions}
            if routed:
                from train.rl.exchange import encode_routing, stack_routing

                r = stack_routing(c.routed_experts)
                ch["routed_experts"] = None if r is None else encode_routing(r) if packed else r.tolist()
            if want_lp:
                toks = [name(t) for t in c.token_ids]
                if top is not None:
                    top = [{name(t): lp for t, lp in row} for row in top]
                offsets, pos = [], 0
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                ch["logprobs"] = {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": top,
                                  "text_offset": offsets}
            choices.append(ch)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.model_name, "choices": choices, "usage": _usage(prompt_ids, outs),
                "instance": self.server.instance}

    def chat(self, body: dict) -> dict:
        self._model_check(body)
        eng = self.server.engine
        ids = _chat_ids(eng.tokenizer, body.get("messages"), body)
        room = eng.context_length - len(ids)
        if room < 1:
            raise BadRequest(f"the messages take {len(ids)} tokens; the model's context limit is {eng.context_length}")
        # like vLLM: no max_tokens means the rest of the context
        params = _params(body, default_max=room, context=eng.context_length)
        want_lp = _flag(body, "logprobs", False)
        top_k = _int_field(body, "top_logprobs") if want_lp else 0
        skip = _skips(body)
        prompt_ids, outs = self._generate([ids], params)
        tops_all = self._tops([(c.prompt_token_ids or ids, c.token_ids) for c in outs], top_k, params.temperature,
                              outs) \
            if top_k > 0 else [[[] for _ in c.token_ids] for c in outs]
        choices = []
        for i, (c, tops) in enumerate(zip(outs, tops_all)):
            ch = {"index": i, "message": {"role": "assistant", "content": _shown(self.server, c, params, skip)},
                  "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                  "prompt_token_ids": c.prompt_token_ids or ids, "logprobs": None, "versions": c.versions}
            if want_lp:
                ch["logprobs"] = {"content": [
                    {"token": eng.decode([t]), "logprob": lp, "bytes": list(eng.decode([t]).encode()),
                     "top_logprobs": [{"token": eng.decode([u]), "logprob": ulp, "bytes": list(eng.decode([u]).encode())}
                                      for u, ulp in row]}
                    for t, lp, row in zip(c.token_ids, c.logprobs, tops)]}
            choices.append(ch)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.server.model_name, "choices": choices, "usage": _usage(prompt_ids, outs),
                "instance": self.server.instance}

    # streaming: the finished completion sent as server-sent events, piece by piece
    def _stream(self, resp: dict, body: dict) -> None:
        eng = self.server.engine
        chat = resp["object"] == "chat.completion"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": resp["id"], "object": obj, "created": resp["created"], "model": resp["model"]}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def emit(obj: dict | str) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")
            self.wfile.flush()

        for ch in resp["choices"]:
            i = ch["index"]
            text = ch["message"]["content"] if chat else ch["text"]
            if chat:
                emit({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
            for a, b, piece in _pieces(_decoder(eng, _skips(body)), ch["token_ids"], text):
                if chat:
                    c = {"index": i, "delta": {"content": piece}, "finish_reason": None, "logprobs": None}
                    if ch.get("logprobs"):
                        c["logprobs"] = {"content": ch["logprobs"]["content"][a:b]}
                else:
                    c = {"index": i, "text": piece, "finish_reason": None, "logprobs": None}
                    if ch.get("logprobs"):
                        lp = ch["logprobs"]
                        c["logprobs"] = {k: (lp[k][a:b] if lp.get(k) is not None else None)
                                         for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
                emit({**head, "choices": [c]})
            last = {"index": i, "finish_reason": ch["finish_reason"], "logprobs": None}
            last.update({"delta": {}} if chat else {"text": ""})
            emit({**head, "choices": [last]})
        opts = body.get("stream_options") or {}
        if isinstance(opts, dict) and _flag(opts, "include_usage", False):
            emit({**head, "choices": [], "usage": resp["usage"]})
        emit("[DONE]")

    def _loading_on(self):
        """The server, if it loads weights (an API key and a run's exchange directory), else Forbidden."""
        s = self.server
        if not s.api_key or s.weights_dir is None:
            raise Forbidden("weight loading is off: start the server with --weights-dir and --api-key")
        return s

    def _device(self):
        return getattr(getattr(self.server.engine, "model", None), "device", "cpu")

    def weights_group(self, body: dict) -> dict:
        """Join the trainer's weight group (``{"host", "port", "rank", "world_size", "name"}``), leaving
        any earlier one; blocks until every member joined."""
        s = self._loading_on()
        from train.rl.weight_group import join, join_request

        try:
            host, port, rank, world, name, timeout_s, backend = join_request(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        with s.load_lock:
            if s.weight_group is not None:
                s.weight_group.close()
                s.weight_group = None
            try:
                s.weight_group = join(host, port, rank, world, name, device=self._device(), timeout_s=timeout_s,
                                      backend=backend)
            except Exception as e:  # noqa: BLE001
                raise BadRequest(f"cannot join the weight group: {_first_line(e)}") from None
        return {"joined": name, "rank": rank}

    def abort_broadcast(self, body: dict) -> dict:
        """``{"name"}``: rank 0 gave up on the broadcast under way in the weight group of that name (a member
        failed): the load waiting for it answers at once (without the load lock, which that load holds)."""
        g = self._loading_on().weight_group
        hit = g is not None and g.name == body.get("name")
        if hit:
            g.aborted.set()
        return {"aborted": hit}

    def load_weights(self, body: dict) -> dict:
        """Load a weight version in flight: published in the run's exchange directory, or (with
        ``"broadcast"``: its layout) arriving over the weight group this server joined."""
        s = self._loading_on()
        from train.rl.exchange import load_request, load_version

        try:
            version, path = load_request(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if "broadcast" in body:
            return self._load_broadcast(version, body["broadcast"])

        with s.load_lock:  # one load at a time: reading and hashing happen here, not on the engine's thread
            try:
                v, sd = load_version(s.weights_dir, version=version, path=path)
                self._apply(sd, v)
            except Exception as e:  # noqa: BLE001 - any failure leaves the old weights in use
                msg = _first_line(e)
                raise BadRequest(f"cannot load weights: {msg}") from None
        return {"version": getattr(s.engine, "version", v)}

    def _apply(self, sd: dict, version: int) -> None:
        """Load ``sd`` into the engine: a generating engine takes it at its next step boundary (on the
        engine's thread, :meth:`TorchEngine.load_weights`); an idle one on the engine's thread too, as
        a :meth:`Batcher.call` (the copies would start a pool of torch threads on this one)."""
        s = self.server
        if getattr(s.engine, "generating", True) or s.batcher is None:
            _apply(s.engine, sd, version)
        else:  # (if a batch starts meanwhile, the load runs after it)
            s.batcher.call(lambda: _apply(s.engine, sd, version))

    def _load_broadcast(self, version: int, layout) -> dict:
        from train.rl.weight_group import receive

        s = self.server
        with s.load_lock:
            group = s.weight_group
            if group is None:
                raise BadRequest("cannot load weights: this server has not joined a weight group")
            box: dict = {}
            done, lock = threading.Event(), threading.Lock()

            def run():  # on a thread of its own: a gloo receive cannot be interrupted, only left behind
                try:
                    box["sd"] = receive(group, layout)
                except Exception as e:  # noqa: BLE001 - the group is broken or the version corrupt
                    box["error"] = e
                with lock:
                    done.set()
                    if box.get("left"):  # the load gave up on it: the group is this thread's to close
                        group.close()

            threading.Thread(target=run, name="weights-receive", daemon=True).start()
            while not done.wait(0.05) and not group.aborted.is_set():
                pass
            with lock:
                box["left"] = not done.is_set()
            if box["left"] or "error" in box:  # old weights stay; the group is not used again
                s.weight_group = None
                if not box["left"] or group.device.type == "cuda":  # (NCCL's abort also ends a receive under way)
                    group.close()
                why = _first_line(box["error"]) if "error" in box else "rank 0 gave up on this broadcast"
                raise BadRequest(f"cannot load weights: {why}")
            sd = box["sd"]
            try:
                self._apply(sd, version)
            except Exception as e:  # noqa: BLE001
                raise BadRequest(f"cannot load weights: {_first_line(e)}") from None
        return {"version": getattr(s.engine, "version", version)}

    def tokenize(self, body: dict) -> dict:
        tok = self.server.engine.tokenizer
        if "messages" in body:
            ids = _chat_ids(tok, body["messages"], body)
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
        else:
            raise BadRequest("tokenize needs 'prompt' (a string) or 'messages'")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.server.engine.context_length}

    def detokenize(self, body: dict) -> dict:
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise BadRequest("detokenize needs 'tokens', a list of token ids")
        return {"prompt": self.server.engine.decode(toks)}


def _int_field(body: dict, name: str) -> int:
    v = body.get(name)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20:
        raise BadRequest(f"{name} must be an integer from 0 to 20, got {v!r}")
    return v


ROLES = ("system", "developer", "user", "assistant", "tool")


def _plain_message(m) -> dict:
    """A chat message with its content as text (OpenAI content parts joined; only text parts)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest("each message must be an object with a 'role' and 'content'")
    if m["role"] not in ROLES:
        raise BadRequest(f"message role {m['role']!r} is not one of {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"content part of type {kind!r} is not supported; only text parts")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise BadRequest("message content must be a string or a list of text parts")
    return {**m, "content": content}


# apply_chat_template's own arguments: not template variables (vLLM drops such keys of chat_template_kwargs too)
_TEMPLATE_ARGS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
                  "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                  "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _chat_ids(tok, msgs, body: dict) -> list[int]:
    """The token ids of ``messages`` through the chat template, as vLLM's chat and tokenize endpoints build them:
    ``add_generation_prompt`` (default: unless continuing), ``continue_final_message`` (go on from the last
    assistant message's text, no end-of-turn after it), ``chat_template`` (a template of the request's own) and
    ``chat_template_kwargs`` (the template's variables, e.g. Qwen3's ``enable_thinking``)."""
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list")
    msgs = [_plain_message(m) for m in msgs]
    cont = _flag(body, "continue_final_message", False)
    gen = _flag(body, "add_generation_prompt", not cont)
    if cont and msgs[-1]["role"] != "assistant":
        raise BadRequest("continue_final_message needs the last message to be the assistant's")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    extra = {k: v for k, v in extra.items() if k not in _TEMPLATE_ARGS}
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise BadRequest("chat_template must be a string (a Jinja template)")
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=gen and not cont, tokenize=False,
                                       continue_final_message=cont, chat_template=template, **extra)
    except Exception as e:  # noqa: BLE001 - the template's own error, as a bad request
        raise BadRequest(f"cannot apply the chat template: {str(e).splitlines()[0] if str(e) else e}") from None
    # vLLM's chat add_special_tokens (default false: the template wrote them): true adds the tokenizer's (a BOS)
    return tok.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))


def _top_logprobs(engine, prompt_ids, completion_ids, k: int, temperature: float) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens and their log-probabilities at every completion position, under
    softmax(logits / temperature) as the sampled tokens' logprobs are (temperature 1 when greedy),
    from one teacher-forced forward pass of prompt + completion."""
    if not completion_ids:
        return []
    model = getattr(engine, "model", None)
    if model is None:
        raise BadRequest("top logprobs need an engine with its model in this process")
    import torch

    ids = list(prompt_ids or []) + list(completion_ids)
    p = len(ids) - len(completion_ids)
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=dev))[0, max(p - 1, 0):len(ids) - 1].float()
    t = temperature if temperature and temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [[(int(i), float(v)) for i, v in zip(ri.tolist(), rv.tolist())] for ri, rv in zip(idx, vals)]


def _skips(body: dict) -> bool:
    """vLLM's ``skip_special_tokens`` (default true): special tokens are left out of the text."""
    return _flag(body, "skip_special_tokens", True)


def _decoder(engine, skip: bool):
    """Token ids -> text, with or without the special tokens."""
    if not skip:
        return engine.decode
    return lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)


def _shown(server, c, params: SamplingParams, skip: bool) -> str:
    """A completion's text as vLLM's server shows it: with ``skip`` (its default) the special tokens a
    model emitted mid-text (``<|im_start|>``, and ``<think>`` where a tokenizer marks it special) are left
    out; the engine's own text keeps them (what RL verifies: Cascade's clients ask for them). A token that
    stopped the completion is not text either way, and a stop string still ends it, found by the engine's rule
    (:func:`train.engine.torch_engine.stop_cut`: in the list's order, none inside the first ``min_tokens``
    tokens), so a completion the engine kept whole is shown whole."""
    ids = c.token_ids
    if not skip or not server.special_ids.intersection(ids):
        return c.text
    from train.engine.torch_engine import stop_cut

    eng = server.engine
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(getattr(eng, "eos_token_ids", ())))
    if c.finish_reason == "stop" and ids and ids[-1] in ends:
        ids = ids[:-1]
    decode = _decoder(eng, True)
    cut = stop_cut(decode, ids, params.stop, params.min_tokens) if params.stop else None
    return decode(ids) if cut is None else cut


def _pieces(decode, ids: list[int], text: str) -> list[tuple[int, int, str]]:
    """``(first token, end token, text)`` pieces of a completion for streaming, decoded
    incrementally by ``decode`` (a piece waits while its bytes end inside a character); the pieces add up
    to ``text`` (a completion cut by a stop string ends where its text does)."""
    out, start, prefix, read = [], 0, 0, 0
    for k in range(1, len(ids) + 1):
        before = decode(ids[prefix:read])
        now = decode(ids[prefix:k])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            out.append((start, k, now[len(before):]))
            start, prefix, read = k, read, k
    if start < len(ids):
        out.append((start, len(ids), ""))
    joined, fixed, pos = "".join(p for _, _, p in out), [], 0
    if joined == text:
        return out
    if not joined.startswith(text):
        return [(0, len(ids), text)]
    for a, b, piece in out:  # cut at the stop string
        piece = piece[:max(0, len(text) - pos)]
        pos += len(piece)
        fixed.append((a, b, piece))
    return fixed


def _usage(prompt_ids: list[list[int]], outs) -> dict:
    p = sum(len(x) for x in prompt_ids)
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # the listen backlog (socketserver's default is 5): with more clients connecting at once than
    # the backlog holds, the kernel drops their SYNs and each waits out a TCP retransmission (~1 s)
    request_queue_size = 4096

    batcher: Batcher | None = None
    weights_dir: str | None = None
    weight_group = None  # train.rl.weight_group.Group once the trainer formed one

    def __init__(self, *args, **kwargs):
        self._requests: set = set()  # the connections being served (ended by server_close)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        self._requests.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        self._requests.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        """Stop listening, end the connections kept alive (their threads would serve requests to a stopped
        engine), stop the engine's thread and leave the weight group."""
        super().server_close()
        for sock in list(self._requests):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.batcher is not None:
            self.batcher.close()
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None


def make_server(engine, model_name: str = "cascade", host: str = "127.0.0.1", port: int = 0,
                api_key: str | None = None, handler=Handler, verbose: bool = False,
                batch_window_s: float = 0.005, weights_dir: str | None = None, threads: int | None = None) -> Server:
    """A server bound to (host, port) (port 0: a free one; see ``server.server_address``); call
    ``serve_forever()`` (e.g. in a thread), then ``shutdown()`` and ``server_close()``.
    ``weights_dir`` (a run's exchange root, with ``api_key``) turns ``POST /v1/load_weights`` on.
    ``threads``: the engine thread's torch threads (:class:`Batcher`)."""
    if engine.tokenizer is None:
        raise ValueError("the engine has no tokenizer; serve a checkpoint directory with tokenizer files")
    if weights_dir is not None and not api_key:
        raise ValueError("weights_dir (weight loading over HTTP) needs an API key")
    # the address family of ``host`` (an IPv6 address such as "::1" or "::" needs AF_INET6; IPv4 where a name has both)
    families = {ai[0] for ai in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                    flags=socket.AI_PASSIVE)}
    family = socket.AF_INET if socket.AF_INET in families else families.pop()
    srv = type("Server", (Server,), {"address_family": family})((host, port), handler)
    srv.engine, srv.model_name, srv.api_key, srv.verbose = engine, model_name, api_key, verbose
    srv.weights_dir = None if weights_dir is None else str(Path(weights_dir).resolve())
    srv.load_lock = threading.Lock()
    srv.batcher = Batcher(engine, window_s=batch_window_s, threads=threads)
    srv.created = int(time.time())
    srv.instance = uuid.uuid4().hex  # this process: a client tells a restart at the same URL by it
    srv.special_ids = frozenset(engine.tokenizer.all_special_ids)
    return srv


def single_threaded_start(threads: int | None = None) -> int:
    """Run this thread's torch ops on one thread from now on and return the count an engine thread
    should take (``threads``, or torch's default): call before loading a model that a
    :class:`Batcher` will run (see there why)."""
    import torch

    n = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def base_url(srv: Server) -> str:
    """``http://HOST:PORT`` of a server, an IPv6 address in brackets."""
    host, port = srv.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_in_thread(engine, **kw) -> tuple[Server, str]:
    """Start a server on a background thread; returns (server, base_url)."""
    srv = make_server(engine, **kw)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, base_url(srv)


def main(argv: list[str] | None = None, prog: str = "cascade serve") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Serve a checkpoint over an OpenAI-compatible HTTP API.")
    ap.add_argument("--model", required=True, help="checkpoint directory (weights + tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None,
                    help="name reported by /v1/models (default: the directory name)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--no-prefix-cache", action="store_true", help="turn shared-prefix KV reuse off")
    ap.add_argument("--api-key", default=os.environ.get("CASCADE_API_KEY") or None,
                    help="require this bearer token (default: $CASCADE_API_KEY, which, unlike the flag, other "
                         "users of the machine cannot read in the process list)")
    ap.add_argument("--weights-dir", default=None,
                    help="a run's exchange directory (RUN/exchange; created if missing): turns POST /v1/load_weights on "
                         "(needs --api-key)")
    ap.add_argument("--weights-version", type=int, default=0, help="the version number of the starting weights")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every request")
    a = ap.parse_args(argv)

    from train.engine.prefix_cache import enable_prefix_caching
    from train.engine.torch_engine import DTYPES, TorchEngine, engine_device

    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0-65535 (0: any free port), got {a.port}")
    if a.weights_dir is not None and not a.api_key:
        raise ValueError("--weights-dir needs --api-key or $CASCADE_API_KEY (weight loading over HTTP must be "
                         "authenticated)")
    if a.weights_dir is not None:  # a server may start before the run that writes there: created if missing
        if Path(a.weights_dir).exists() and not Path(a.weights_dir).is_dir():
            raise ValueError(f"--weights-dir {a.weights_dir!r} is not a directory")
        Path(a.weights_dir).mkdir(parents=True, exist_ok=True)
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    threads = single_threaded_start(a.threads)  # the engine's thread takes them (Batcher)
    eng = TorchEngine.from_pretrained(a.model, device=engine_device(a.device), dtype=DTYPES[a.dtype],
                                      version=a.weights_version)
    if not a.no_prefix_cache:
        enable_prefix_caching(eng)
    name = a.served_model_name or Path(a.model).resolve().name
    try:
        srv = make_server(eng, name, a.host, a.port, a.api_key, verbose=a.verbose, weights_dir=a.weights_dir,
                          threads=threads)
    except OSError as e:
        raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    print(f"serving {name!r} on {base_url(srv)}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
