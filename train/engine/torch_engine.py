"""The built-in generation engine: batched, KV-cached, seeded sampling with the policy model.

Prompts of different lengths are left-padded into one batch; each prompt is prefilled once and
its cache fanned out to its ``n`` samples; finished rows leave the batch as soon as they stop.
Runs on CPU and CUDA; fp32 models on CPU prefill, decode and sample through fused C++ ops
(:mod:`train.engine.native`), everything else through the PyTorch model.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from train.engine import native
from train.engine.base import Completion, SamplingParams, check_prompts
from train.engine.sampling import row_seed, sample
from train.model.hf_io import load_into, load_pretrained
from train.model.modeling import CausalLM, KVCache


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    weight_syncs: int = 0
    last_sync_s: float = 0.0
    extra: dict = field(default_factory=dict)


class TorchEngine:
    """Generation with Cascade's own model.

    ``TorchEngine.from_pretrained(path)`` loads a checkpoint directory (weights and tokenizer);
    ``TorchEngine(model, tokenizer)`` wraps a model in memory (the engine keeps that object: pass
    a copy when a trainer updates the original and syncs with :meth:`load_weights`).
    """

    def __init__(self, model: CausalLM, tokenizer=None, max_batch_rows: int = 256, eos_token_ids: Sequence[int] = ()):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        cfg = model.config
        eos = set(eos_token_ids)
        for e in (cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]):
            if e is not None:
                eos.add(int(e))
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self.pad_id = int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        self.stats = EngineStats()
        self._seed_rng = random.Random()
        self.prefix_cache = None  # opt-in shared-prefix KV reuse: train.engine.prefix_cache.enable_prefix_caching

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        **kw) -> "TorchEngine":
        from train.tokenizer import load_tokenizer

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
                 seeds: Sequence[int] | None = None) -> list[Completion]:
        """``seeds`` (optional, one per prompt): prompt i samples exactly as it would alone in a
        request with ``seed=seeds[i]`` (how an OpenAI-compatible server seeds each request)."""
        ids = self.encode(prompts)
        ctx = self.context_length
        check_prompts(ids, ctx, seeds)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        per_chunk = max(1, self.max_batch_rows // params.n)
        out: list[Completion] = []
        for s in range(0, len(ids), per_chunk):
            out.extend(self._generate_chunk(ids[s:s + per_chunk], s, params, base_seed,
                                            None if seeds is None else seeds[s:s + per_chunk]))
        return out

    def load_weights(self, state_dict) -> None:
        """Copy new weights in (Cascade's in-memory names or HF checkpoint names)."""
        t = time.perf_counter()
        load_into(self.model, state_dict)
        self.stats.weight_syncs += 1
        self.stats.last_sync_s = time.perf_counter() - t

    def close(self) -> None:
        self.model = None

    # -- internals -------------------------------------------------------------------------------
    @torch.inference_mode()  # cheaper per op than no_grad (no version counters or view tracking)
    def _generate_chunk(self, prompts: list[list[int]], offset: int, p: SamplingParams, base_seed: int,
                        seeds: Sequence[int] | None = None):
        model, dev = self.model, self.model.device
        n, B = p.n, len(prompts)
        lens = [len(x) for x in prompts]
        L = max(lens)
        max_new = min(p.max_tokens, self.context_length - min(lens))
        inp = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        for i, x in enumerate(prompts):
            inp[i, L - len(x):] = torch.tensor(x)
            mask[i, L - len(x):] = True
        # fused C++ forward for fp32 on CPU (train/engine/native.py), else the model's own
        decoder = native.NativeDecoder(model) if native.usable(model) else None
        t0 = time.perf_counter()
        hit = self.prefix_cache.prefill(model, prompts, max_new) if self.prefix_cache is not None else None
        if hit is not None:  # shared prefix computed once (train/engine/prefix_cache.py)
            cache, logits = hit
        else:
            cache = KVCache.allocate(model.config, B, L + max_new, dev, model.dtype)
            if decoder is not None:
                logits = decoder.forward(inp, cache, mask)
            else:
                logits = model.last_logits(inp.to(dev), mask.to(dev), cache=cache)
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
        finish = ["length"] * rows
        texts: list[str | None] = [None] * rows
        eos = set(self.eos_token_ids) | set(p.stop_token_ids)
        if p.ignore_eos:
            eos = set(p.stop_token_ids)
        active = list(range(rows))  # row ids still generating, aligned with the cache's batch rows
        limits = [min(max_new, self.context_length - lens[r // n]) for r in range(rows)]
        stop_window = max((len(s) for s in p.stop), default=0) + 16
        decode_step = decoder.step if decoder is not None else (lambda t, c: model.last_logits(t[:, None], cache=c))
        step = 0
        while active:
            tok, lp = sample(logits, p, None if row_seeds is None else row_seeds[active], step, native=decoder is not None)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            keep = []
            for j, r in enumerate(active):
                tokens[r].append(tok_l[j])
                logps[r].append(lp_l[j])
                done = False
                if tok_l[j] in eos:
                    finish[r], done = "stop", True
                elif p.stop and self.tokenizer is not None:
                    tail = self.decode(tokens[r][-stop_window:])
                    if any(s in tail for s in p.stop):
                        full = self.decode(tokens[r])
                        cut = min(full.find(s) for s in p.stop if s in full)
                        finish[r], texts[r], done = "stop", full[:cut], True
                if not done and len(tokens[r]) >= limits[r]:
                    done = True
                if not done:
                    keep.append(j)
            step += 1
            if len(keep) < len(active):
                if not keep:
                    break
                sel = torch.tensor(keep, device=dev)
                cache = cache.select(sel)
                active = [active[j] for j in keep]
                tok = tok.index_select(0, sel)
            logits = decode_step(tok, cache)
        self.stats.decode_s += time.perf_counter() - t0
        out = []
        for r in range(rows):
            self.stats.generated_tokens += len(tokens[r])
            body = tokens[r][:-1] if finish[r] == "stop" and tokens[r] and tokens[r][-1] in eos else tokens[r]
            text = texts[r] if texts[r] is not None else self.decode(body)
            pi = r // n
            out.append(Completion(tokens[r], text, logps[r], finish[r], offset + pi, lens[pi], prompts[pi]))
        return out
