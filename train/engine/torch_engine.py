"""The built-in generation engine: batched, KV-cached, seeded sampling with the policy model.

Prompts of different lengths are left-padded into one batch; each prompt is prefilled once and
its cache fanned out to its ``n`` samples; finished rows leave the batch as soon as they stop.
Runs on CPU and CUDA; fp32 models on CPU (Qwen3, Qwen3-MoE, Qwen2, Llama) prefill, decode and sample
through fused C++ ops (:mod:`train.engine.native`), fp32 ZAYA1 on CPU decodes and samples through them
(prefill in PyTorch), everything else (bf16, GPU, and transformers-fallback models from
:mod:`train.model.hf_fallback`) through the PyTorch model.

Weight versions and in-flight updates. ``engine.version`` names the weights in use; every
completion carries ``versions``, the version that sampled each of its tokens. ``load_weights(sd,
version=None)`` may be called from another thread while ``generate`` runs (a server's HTTP thread,
a PipelineRL trainer): the generating thread takes the new weights at the next decoding-step
boundary and running requests continue, so one completion may span versions. By default
(``refresh_kv_on_update=True``) the rows still generating are then re-prefilled (prompt and tokens
so far) under the new weights, so every token after the switch is sampled from exactly the new
policy given its prefix, which is what a trainer recomputes; ``False`` keeps the KV cache computed
with the old weights (cheaper; the first tokens after the switch then see stale keys and values).

Router replay. ``generate(..., return_routed_experts=True)`` (or the engine's default of the same
name) gives each completion ``routed_experts``: per MoE layer a LongTensor [1, P + C, k] of the
experts that routed every token of prompt + completion (the last token, never run through the
model, repeats the previous row), the form ``CausalLM.forward(routed_experts=...)`` replays and
vLLM's engine returns. The native ops record them too; the shared-prefix cache is bypassed while
recording (its prefix is computed once for many rows).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from train.engine import native
from train.engine.base import Completion, GenerationInterrupted, SamplingParams, check_prompts, request_inputs
from train.engine.sampling import LogitsProcessors, row_seed, sample
from train.model.hf_io import load_into, load_pretrained
from train.model.modeling import CausalLM, KVCache, input_pad_id


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_device(spec: str | None, name: str = "--device ") -> str:
    """The device a command's ``--device`` (``name``) names: ``spec`` checked (a one-line ValueError for
    a name torch does not know or a GPU this machine lacks), or cuda where there is one, else cpu."""
    if not spec:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name}{spec!r} is not a device torch knows (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"{name}{spec!r}: this machine's torch sees {torch.cuda.device_count()} CUDA device(s)")
    return spec


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    weight_syncs: int = 0
    last_sync_s: float = 0.0
    kv_refreshes: int = 0  # re-prefills of running rows after an in-flight weight update
    extra: dict = field(default_factory=dict)


@dataclass
class _Update:
    state_dict: dict
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def eos_ids_of(cfg, tokenizer=None) -> set[int]:
    """The ids a model's generation ends on: its config's ``eos_token_id``, its generation config's (e.g.
    Qwen3's list) and the tokenizer's."""
    eos: set[int] = set()
    gen_eos = (getattr(cfg, "generation_config", None) or {}).get("eos_token_id")
    for ids in (getattr(cfg, "eos_token_id", None), gen_eos):
        for e in (ids if isinstance(ids, list) else [ids]):
            if e is not None:
                eos.add(int(e))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos


def stop_cut(decode: Callable[[list[int]], str], tokens: list[int], stop: Sequence[str],
             min_tokens: int = 0) -> str | None:
    """The text (``decode(tokens)``) up to the first stop string (in ``stop``'s order, as vLLM takes them) that ends
    past the first ``min_tokens`` tokens' text (vLLM's rule: none is looked for before), or None. The engine cuts
    its completions by it, and the server (:mod:`train.engine.server`) the text it shows without special tokens."""
    full = decode(tokens)
    floor = len(decode(tokens[:min_tokens])) if min_tokens else 0
    found = [i for i in (full.find(s, max(0, floor - len(s) + 1)) for s in stop) if i >= 0]
    return full[:found[0]] if found else None


class TorchEngine:
    """Generation with Cascade's own model.

    ``TorchEngine.from_pretrained(path)`` loads a checkpoint directory (weights and tokenizer);
    ``TorchEngine(model, tokenizer)`` wraps a model in memory (the engine keeps that object: pass
    a copy when a trainer updates the original and syncs with :meth:`load_weights`).
    ``version``: the version number of the starting weights. ``step_hook(step)``, when set, is
    called by the generating thread after each sampled token step (instrumentation, tests).
    ``interrupt()`` from another thread makes every ``generate`` running or started raise
    :class:`GenerationInterrupted` at its next decoding step, until ``interrupt(False)``.
    """

    supports_inflight_update = True  # load_weights from another thread lands between decode steps
    computes_here = True  # generates on this process's CPU threads / device (PipelineRL splits the threads)

    def __init__(self, model: CausalLM, tokenizer=None, max_batch_rows: int = 256, eos_token_ids: Sequence[int] = (),
                 version: int = 0, return_routed_experts: bool = False, refresh_kv_on_update: bool = True):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        cfg = model.config
        self.eos_token_ids = sorted(set(eos_token_ids) | eos_ids_of(cfg, tokenizer))
        self.pad_id = input_pad_id(cfg)
        self.stats = EngineStats()
        self._seed_rng = random.Random()
        self.prefix_cache = None  # opt-in shared-prefix KV reuse: train.engine.prefix_cache.enable_prefix_caching
        self.version = int(version)
        self.return_routed_experts = bool(return_routed_experts)
        self.refresh_kv_on_update = bool(refresh_kv_on_update)
        self.step_hook: Callable[[int], None] | None = None
        self._interrupted = threading.Event()
        self._lock = threading.Lock()  # guards the fields below and every change of the weights
        self._load_lock = threading.Lock()  # one load_weights at a time
        self._generating: dict[int, int] = {}  # thread id -> generate calls running on it
        self._pending: _Update | None = None
        self._epoch = 0  # bumped whenever the weights change

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        **kw) -> "TorchEngine":
        from envs.hub import resolve_model
        from train.tokenizer import load_tokenizer

        path = resolve_model(path)  # a local directory wins; else a Hub id through the HF cache (offline rules)
        model = load_pretrained(path, dtype=dtype, device=device)
        tok = load_tokenizer(path) if (Path(path) / "tokenizer.json").exists() else None
        return cls(model, tok, **kw)

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    # -- contract -------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[list[int]] | Sequence[str]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or load one")
                p = self.tokenizer.encode(p, add_special_tokens=False, verbose=False)
            out.append([int(t) for t in p])
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def generate(self, prompts: Sequence[list[int]] | Sequence[str], params: SamplingParams,
                 seeds: Sequence[int] | None = None, return_routed_experts: bool | None = None) -> list[Completion]:
        """``seeds`` (optional, one per prompt): prompt i samples exactly as it would alone in a
        request with ``seed=seeds[i]`` (how an OpenAI-compatible server seeds each request).
        ``return_routed_experts`` (default: the engine's setting) fills ``Completion.routed_experts``."""
        prompts, seeds = request_inputs(prompts, seeds)
        ids = self.encode(prompts)
        ctx = self.context_length
        check_prompts(ids, ctx, seeds, vocab_size=self.model.config.vocab_size)
        params.check_vocab(self.model.config.vocab_size)
        if params.stop and self.tokenizer is None:  # (they were ignored: a completion ran on to its length)
            raise ValueError("stop strings need the engine's tokenizer; pass stop_token_ids instead")
        record = self.return_routed_experts if return_routed_experts is None else bool(return_routed_experts)
        if record and not self.model.config.is_moe:
            raise ValueError("return_routed_experts needs an MoE model; this one has no MoE layers")
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        per_chunk = max(1, self.max_batch_rows // params.n)
        out: list[Completion] = []
        me = threading.get_ident()
        with self._lock:
            self._generating[me] = self._generating.get(me, 0) + 1
        try:
            for s in range(0, len(ids), per_chunk):
                out.extend(self._generate_chunk(ids[s:s + per_chunk], s, params, base_seed,
                                                None if seeds is None else seeds[s:s + per_chunk], record))
        finally:
            with self._lock:
                self._generating[me] -= 1
                if not self._generating[me]:
                    del self._generating[me]
                if not self._generating:  # an update posted as the last step ended: nobody else will take it
                    self._take_pending_locked()
        return out

    def interrupt(self, on: bool = True) -> None:
        """Stop every ``generate`` running (at its next decoding step) or started from now on with
        :class:`GenerationInterrupted`; ``interrupt(False)`` lets them run again."""
        (self._interrupted.set if on else self._interrupted.clear)()

    def load_weights(self, state_dict, version: int | None = None) -> None:
        """Copy new weights in (Cascade's in-memory names or HF checkpoint names) and set
        ``self.version`` to ``version`` (default: the current version + 1).

        Thread-safe: while ``generate`` runs on another thread, the update is handed to that thread,
        which applies it at its next decoding-step boundary; this call returns once the new weights
        are in use (or raises what applying them raised; the old weights then stay)."""
        with self._load_lock:
            upd = _Update(state_dict, self.version + 1 if version is None else int(version))
            with self._lock:
                me = threading.get_ident()
                if not self._generating or me in self._generating:
                    self._apply_locked(upd)
                    return
                self._pending = upd
            upd.done.wait()
            if upd.error is not None:
                raise upd.error

    @property
    def generating(self) -> bool:
        """Whether a ``generate`` call runs (on any thread)."""
        return bool(self._generating)

    @property
    def update_pending(self) -> bool:
        """Whether a :meth:`load_weights` call waits for the generating thread's next step boundary."""
        return self._pending is not None

    def _apply_locked(self, upd: _Update) -> None:
        t = time.perf_counter()
        load_into(self.model, upd.state_dict)  # checks every name and shape before copying anything
        self.version = upd.version
        self._epoch += 1
        if self.prefix_cache is not None:  # its keys and values were computed with the old weights
            self.prefix_cache.clear()
        self.stats.weight_syncs += 1
        self.stats.last_sync_s = time.perf_counter() - t

    def _take_pending_locked(self) -> None:
        upd, self._pending = self._pending, None
        if upd is None:
            return
        try:
            self._apply_locked(upd)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of load_weights
            upd.error = e
        finally:
            upd.done.set()

    def _take_pending(self) -> None:
        with self._lock:
            self._take_pending_locked()

    def close(self) -> None:
        self.model = None

    # -- internals -------------------------------------------------------------------------------
    def _prefill(self, seqs: list[list[int]], capacity: int, decoder, record: bool, prefix_ok: bool):
        """Left-padded prefill of ``seqs`` into a new cache of ``capacity`` slots ->
        (cache, last logits [B, V], per-row expert ids [len_i, n_moe, k] or None)."""
        model, dev = self.model, self.model.device
        B, L = len(seqs), max(len(x) for x in seqs)
        if prefix_ok and not record and self.prefix_cache is not None:
            hit = self.prefix_cache.prefill(model, seqs, capacity - L, decoder)
            if hit is not None:  # shared prefix computed once (train/engine/prefix_cache.py)
                return hit[0], hit[1], None
        inp = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        for i, x in enumerate(seqs):
            inp[i, L - len(x):] = torch.tensor(x)
            mask[i, L - len(x):] = True
        if hasattr(model, "allocate_cache"):  # a transformers model (train.model.hf_fallback) keeps its own cache
            cache = model.allocate_cache(B, capacity, dev, model.dtype)
        else:
            cache = KVCache.allocate(model.config, B, capacity, dev, model.dtype)
        rec: list | None = [] if record else None
        if decoder is not None:  # fused C++ forward (fp32 on CPU)
            logits = decoder.forward(inp, cache, mask, record=rec)
            flat = torch.stack(rec, 1) if record else None  # [real tokens, n_moe, k], row-major
        else:
            inp, mask = inp.to(dev), mask.to(dev)
            if record:
                logits = model.logits(model.hidden_states(inp, mask, cache=cache, record_routing=rec)[:, -1])
                flat = torch.stack(rec, 2)[mask]  # [B, L, n_moe, k] -> real tokens, row-major
            else:
                logits = model.last_logits(inp, mask, cache=cache)
        routes = list(flat.split([len(x) for x in seqs])) if record else None
        return cache, logits, routes

    def _decode(self, tok: torch.Tensor, cache: KVCache, decoder, record: bool):
        """One decoding step -> (logits [A, V], expert ids [A, n_moe, k] or None)."""
        rec: list | None = [] if record else None
        if decoder is not None:
            logits = decoder.step(tok, cache, record=rec)
            return logits, (torch.stack(rec, 1) if record else None)
        if not record:
            return self.model.last_logits(tok[:, None], cache=cache), None
        logits = self.model.logits(self.model.hidden_states(tok[:, None], cache=cache, record_routing=rec)[:, -1])
        return logits, torch.stack([r[:, 0] for r in rec], 1)

    def _stop_cut(self, tokens: list[int], p: SamplingParams) -> str | None:
        """:func:`stop_cut` of ``tokens`` as this engine decodes them."""
        return stop_cut(self.decode, tokens, p.stop, p.min_tokens)

    @torch.inference_mode()  # cheaper per op than no_grad (no version counters or view tracking)
    def _generate_chunk(self, prompts: list[list[int]], offset: int, p: SamplingParams, base_seed: int,
                        seeds: Sequence[int] | None = None, record: bool = False):
        if self._interrupted.is_set():
            raise GenerationInterrupted("generation interrupted (the engine's interrupt())")
        model, dev = self.model, self.model.device
        n, B = p.n, len(prompts)
        lens = [len(x) for x in prompts]
        L = max(lens)
        max_new = min(p.max_tokens, self.context_length - min(lens))
        if self._pending is not None:  # an update posted between calls or chunks: take it before prefilling
            self._take_pending()
        epoch, version = self._epoch, self.version
        # fused C++ forward for fp32 on CPU (train/engine/native.py), else the model's own
        decoder = native.decoder(model)
        t0 = time.perf_counter()
        cache, logits, proutes = self._prefill(prompts, L + max_new, decoder, record, prefix_ok=True)
        self.stats.prefill_tokens += sum(lens)
        self.stats.prefill_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if n > 1:
            fan = torch.arange(B, device=dev).repeat_interleave(n)
            cache, logits = cache.select(fan), logits.index_select(0, fan)
        rows = B * n
        row_seeds = None
        if not p.greedy:
            row_seeds = np.array([row_seed(seeds[r // n], 0, r % n) if seeds is not None
                                  else row_seed(base_seed, offset + r // n, r % n) for r in range(rows)], dtype=np.uint64)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        versions: list[list[int]] = [[] for _ in range(rows)]
        # expert ids per row: chunks covering prompt + tokens run through the model so far
        routes: list[list[torch.Tensor]] | None = [[proutes[r // n]] for r in range(rows)] if record else None
        finish = ["length"] * rows
        texts: list[str | None] = [None] * rows
        eos = set(self.eos_token_ids) | set(p.stop_token_ids)
        if p.ignore_eos:
            eos = set(p.stop_token_ids)
        active = list(range(rows))  # row ids still generating, aligned with the cache's batch rows
        limits = [min(max_new, self.context_length - lens[r // n]) for r in range(rows)]
        # tokens to decode for a stop string's check: up to 4 per character (byte-level tokens of one character)
        stop_window = 4 * max((len(s) for s in p.stop), default=0) + 16
        procs = None
        if p.processed:  # min_tokens masks every stop id, EOS too when it is ignored (vLLM's _all_stop_token_ids)
            procs = LogitsProcessors(p, [prompts[r // n] for r in range(rows)], logits.shape[-1], dev,
                                     stop_ids=set(self.eos_token_ids) | set(p.stop_token_ids))
        step = 0
        while active:
            tok, lp = sample(logits, p, None if row_seeds is None else row_seeds[active], step, native=decoder is not None,
                             processors=procs)
            if procs is not None:
                procs.add(tok)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            keep = []
            for j, r in enumerate(active):
                tokens[r].append(tok_l[j])
                logps[r].append(lp_l[j])
                versions[r].append(version)
                done = False
                if tok_l[j] in eos:
                    finish[r], done = "stop", True
                elif p.stop and self.tokenizer is not None and len(tokens[r]) > p.min_tokens:
                    tail = self.decode(tokens[r][-stop_window:])
                    if any(s in tail for s in p.stop):
                        cut = self._stop_cut(tokens[r], p)
                        if cut is not None:
                            finish[r], texts[r], done = "stop", cut, True
                if not done and len(tokens[r]) >= limits[r]:
                    done = True
                if not done:
                    keep.append(j)
            if self.step_hook is not None:
                self.step_hook(step)
            if self._interrupted.is_set():
                raise GenerationInterrupted("generation interrupted (the engine's interrupt())")
            step += 1
            if len(keep) < len(active):
                if not keep:
                    break
                sel = torch.tensor(keep, device=dev)
                cache = cache.keep(sel)
                if procs is not None:
                    procs.keep(sel)
                active = [active[j] for j in keep]
                tok = tok.index_select(0, sel)
            # step boundary: weights posted by another thread are taken here
            if self._pending is not None:
                self._take_pending()
            if self._epoch != epoch:
                epoch, version = self._epoch, self.version
                decoder = native.decoder(model)
                if self.refresh_kv_on_update:  # running rows re-prefilled under the new weights
                    seqs = [prompts[r // n] + tokens[r] for r in active]
                    cache, logits, fresh = self._prefill(seqs, cache.capacity, decoder, record, prefix_ok=False)
                    self.stats.kv_refreshes += 1
                    if record:
                        for j, r in enumerate(active):
                            routes[r] = [fresh[j]]
                    continue
            logits, step_routes = self._decode(tok, cache, decoder, record)
            if record:
                for j, r in enumerate(active):
                    routes[r].append(step_routes[j:j + 1])
        self.stats.decode_s += time.perf_counter() - t0
        out = []
        for r in range(rows):
            self.stats.generated_tokens += len(tokens[r])
            body = tokens[r][:-1] if finish[r] == "stop" and tokens[r] and tokens[r][-1] in eos else tokens[r]
            text = texts[r] if texts[r] is not None else self.decode(body)
            pi = r // n
            c = Completion(tokens[r], text, logps[r], finish[r], offset + pi, lens[pi], prompts[pi],
                           versions=versions[r])
            if record:
                c.routed_experts = _per_layer(routes[r])
            out.append(c)
        return out


def _per_layer(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Expert-id chunks [t_i, n_moe, k] covering prompt + completion but its last token -> per MoE layer
    LongTensor [1, P + C, k] on the CPU, the last token repeating the previous row."""
    t = torch.cat(chunks).to(device="cpu", dtype=torch.long)
    t = torch.cat([t, t[-1:]])
    return [t[:, i].unsqueeze(0).contiguous() for i in range(t.shape[1])]
