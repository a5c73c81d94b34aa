"""The engine contract shared by the torch engine, vLLM and the OpenAI-compatible client.

``Engine.generate(prompts, params) -> list[Completion]`` returns ``params.n`` completions per
prompt, prompt-major: completions ``[i*n:(i+1)*n]`` belong to prompt ``i``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


# the smallest temperature that is not greedy: vLLM raises any lower one to 0.01 (its _MAX_TEMP), so a remote vLLM
# server would sample at 0.01 what this engine (and the trainer's log-probs) would take at the value asked for
MIN_TEMPERATURE = 1e-2
# what an engine's Completion.text is: the tokens decoded with the special ones kept and nothing put between
# them (vLLM's sampling settings and its servers' request fields by these names; a server left to its default
# drops special tokens, a </think> too where the tokenizer marks it special, and the verifiers would not find it)
ENGINE_TEXT = {"skip_special_tokens": False, "spaces_between_special_tokens": False}


def _integer(t) -> bool:
    """Whether ``t`` is an integer (Python's or numpy's, not a bool)."""
    try:
        operator.index(t)
        return not isinstance(t, bool)
    except TypeError:
        return False


def _token_id(t) -> bool:
    """Whether ``t`` is an integer (Python's or numpy's, not a bool) >= 0."""
    return _integer(t) and operator.index(t) >= 0


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM): off
    min_p: float = 0.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's (and OpenAI's) penalties, on the logits before the temperature: a token already in the prompt or the
    # output has a positive logit divided by / a negative one multiplied by ``repetition_penalty``; one in the
    # output loses ``frequency_penalty`` per occurrence and ``presence_penalty`` once
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: no end-of-sequence, stop token or stop string before ``min_tokens`` tokens; ``logit_bias`` (token id ->
    # value, OpenAI's) added to that token's logit before the penalties and the temperature
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("n", "max_tokens", "min_tokens", "top_k") + (("seed",) if self.seed is not None else ()):
            v = getattr(self, name)  # integers (a YAML 512.0 failed later inside torch, some after the prefill)
            if not _integer(v):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
            setattr(self, name, operator.index(v))
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature == float("inf"):  # (sampled uniformly; NaN is refused below)
            raise ValueError(f"SamplingParams.temperature must be a finite number, got {self.temperature}")
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):  # NaN fails both
            raise ValueError(f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (vLLM samples "
                             f"any lower one at {MIN_TEMPERATURE:g}), got {self.temperature}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 or -1: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):  # vLLM's and OpenAI's ranges
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(x, str) and x for x in self.stop):  # "" would end every completion at once
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        # token ids >= 0 (a negative one masked the vocabulary's last token under min_tokens)
        if not all(_token_id(t) for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (integers >= 0), "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = [operator.index(t) for t in self.stop_token_ids]
        bias = {}
        for k, v in dict(self.logit_bias or {}).items():
            try:
                t, b = int(k), float(v)
            except (TypeError, ValueError):
                raise ValueError(f"SamplingParams.logit_bias maps token ids to numbers, got {k!r}: {v!r}") from None
            if t < 0 or str(t) != str(k).strip() or not math.isfinite(b):
                raise ValueError(f"SamplingParams.logit_bias maps token ids (>= 0) to finite numbers, got {k!r}: {v!r}")
            bias[t] = b
        self.logit_bias = bias

    def check_vocab(self, vocab_size: int) -> None:
        """``logit_bias`` names only the model's token ids (a one-line ``ValueError`` otherwise, as vLLM's)."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]}; the model's ids are 0..{vocab_size - 1}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, ``logit_bias``, ``min_tokens``)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


@dataclass
class Completion:
    """One sampled continuation. ``logprobs[i]`` is the log-probability of ``token_ids[i]``
    under softmax(logits / temperature) (temperature 1 when greedy), before logit bias, min_tokens, penalties and
    top-p/top-k/min-p truncation: the distribution a trainer recomputes at the same temperature.
    ``finish_reason`` is ``"stop"`` (EOS, stop token or stop string) or ``"length"``.
    ``prompt_tokens`` counts the prompt's tokens (prefill)."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    prompt_index: int = 0
    prompt_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    routed_experts: object | None = None  # router replay: per MoE layer LongTensor [1, P + C, k] (see vllm_engine)
    versions: list[int] | None = None  # policy (weight) version that sampled each token, where an engine tracks it


# the finish reasons servers give for a generation that ended at an end of sequence or a stop string or token
STOP_REASONS = {"stop", "eos", "eos_token", "stop_sequence", "end_turn"}


def finish_kind(reason) -> str | None:
    """A reply's finish reason as a :class:`Completion`'s: ``"stop"`` (an end of sequence or a stop string or
    token: ``stop``, ``eos``, TGI's ``eos_token``/``stop_sequence``, or SGLang's ``{"type": "stop", "matched":
    ...}``), ``"length"`` (the budget), or None for a generation the server did not finish (``abort``,
    ``content_filter``, ``error``, none given), which is not a trace to grade, forward or train on."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    if reason == "length":
        return "length"
    return "stop" if isinstance(reason, str) and reason in STOP_REASONS else None


class ContextLengthError(ValueError):
    """A prompt (plus what must be generated) does not fit the model's context."""


def request_inputs(prompts, seeds: Sequence[int] | None = None) -> tuple[list, list[int] | None]:
    """``generate``'s prompts as a list (a bare string is one prompt, as vLLM's ``LLM.generate`` takes it,
    not one per character) and its per-prompt ``seeds`` as Python ints (numpy's overflowed the seed
    arithmetic and do not go into JSON), one per prompt."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if seeds is None:
        return prompts, None
    seeds = list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    bad = [s for s in seeds if not _integer(s)]
    if bad:
        raise ValueError(f"every seed must be an integer, got {bad[0]!r}")
    return prompts, [operator.index(s) for s in seeds]


def check_prompts(ids: Sequence[list[int]], context_length: int, seeds: Sequence[int] | None = None,
                  vocab_size: int | None = None) -> None:
    """Every prompt non-empty, of token ids in ``[0, vocab_size)`` (when given) and short enough that at
    least one token can be generated; per-prompt ``seeds``, when given, one per prompt."""
    if seeds is not None and len(seeds) != len(ids):
        raise ValueError(f"got {len(seeds)} seeds for {len(ids)} prompts")
    bad = [s for s in (() if seeds is None else seeds) if not _integer(s)]
    if bad:
        raise ValueError(f"every seed must be an integer, got {bad[0]!r}")
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"prompt {i} is empty")
        if vocab_size is not None and (min(x) < 0 or max(x) >= vocab_size):
            bad = next(t for t in x if not 0 <= t < vocab_size)
            raise ValueError(f"prompt {i} has token id {bad}; the model's ids are 0..{vocab_size - 1}")
        if len(x) >= context_length:
            raise ContextLengthError(f"prompt {i} has {len(x)} tokens; the model's context limit is "
                                     f"{context_length} (at least one token must be generated)")


class GenerationInterrupted(BaseException):
    """Raised by ``generate`` on the thread running it after another thread called the engine's ``interrupt()``
    (a pipelined run stopping with a batch in flight: Ctrl-C, SIGTERM, an error in the trainer). A
    ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the way retries the batch."""


@runtime_checkable
class Engine(Protocol):
    def generate(self, prompts: Sequence[list[int]] | Sequence[str], params: SamplingParams) -> list[Completion]: ...

    def load_weights(self, state_dict) -> None: ...

    def close(self) -> None: ...


def request_extras(params: SamplingParams) -> dict:
    """``min_tokens`` and ``logit_bias`` (ids as strings, as OpenAI's JSON) when set."""
    out = {}
    if params.min_tokens:
        out["min_tokens"] = params.min_tokens
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out


def completion_request(params: SamplingParams) -> dict:
    """The fields of an OpenAI-style ``/v1/completions`` body that samples and decodes as the engines do (the
    model, the prompt, the seed and a per-prompt ``max_tokens`` are the caller's): every sampling field named, as
    a vLLM server fills one left out from the model's generation_config.json (Qwen2.5-Instruct's
    repetition_penalty 1.05, Qwen3's top_k 20), with top_k -1 for off as vLLM and SGLang spell it and the
    penalties the params hold (none unless set), ``min_tokens`` and ``logit_bias`` only when set (no server has a
    default for them); the sampled tokens' log-probs only (no top alternatives, which cost Cascade's server a
    teacher-forced forward per choice), their ids, and the text as the engines decode it (:data:`ENGINE_TEXT`)."""
    return {**request_extras(params), "n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k or -1, "min_p": params.min_p, "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
            "repetition_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True, **ENGINE_TEXT}
