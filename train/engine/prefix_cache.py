"""Shared-prefix KV reuse for the torch engine.

When the prompts of one batch share a prefix (the chat header and the problem text at the head of
every Markovian-RSA aggregation prompt), the prefix's keys and values are computed once, with
batch 1, and copied into every row; only the differing suffixes are prefilled per row. Prefixes
are also kept in a small LRU across calls (the same problem across rounds), so a later batch that
starts with a stored prefix only computes what follows it.

Layout of a row in the engine's cache: ``[prefix (P slots)] [padding] [suffix]``. Padding in the
middle is fine for :class:`~train.model.modeling.KVCache`: positions are the running count of valid
slots and padded keys are masked, so each row sees exactly its own tokens at their own positions,
as in the plain left-padded prefill.

Entries are invalidated when any model parameter changes in place (``load_weights``, optimiser
steps on a shared model): the cache compares the parameters' version counters on every call.

The prefix and the suffixes run through the same forward as the engine's plain prefill: the fused
C++ ops of :mod:`train.engine.native` for fp32 models on CPU, the PyTorch model elsewhere. The cache
is marked ``shared = P`` (:class:`~train.model.modeling.KVCache`): there the native ops attend to the
prefix for all rows at once (the rows' queries against one copy of its keys and values, two matrix
products per KV head), in the suffix prefill and in every decoding step, rather than row by row.

Use: ``enable_prefix_caching(engine)``; ``engine.prefix_cache.stats`` counts hits and the prefill
tokens that were not recomputed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from train.model.modeling import KVCache, input_pad_id


@dataclass
class PrefixCacheStats:
    batches: int = 0          # batches prefilled through the shared-prefix path
    lru_hits: int = 0         # of those, how many started from a stored prefix
    shared_tokens: int = 0    # prefix tokens in those batches (per batch, counted once)
    saved_tokens: int = 0     # prefill tokens not recomputed (prefix copies + stored prefix reuse)


def common_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of the token lists."""
    if not seqs:
        return 0
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


class PrefixCache:
    """KV reuse for prompts that share a prefix. ``min_prefix``: shortest prefix worth sharing;
    ``max_entries``: prefixes kept across calls (least recently used dropped first)."""

    def __init__(self, min_prefix: int = 8, max_entries: int = 8):
        if min_prefix < 1 or max_entries < 0:
            raise ValueError(f"PrefixCache needs min_prefix >= 1 and max_entries >= 0, got {min_prefix}, {max_entries}")
        self.min_prefix = min_prefix
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self._fingerprint = None
        self.stats = PrefixCacheStats()

    def clear(self) -> None:
        """Forget every stored prefix (call it after writing weights through ``.data``, which no version counter
        sees)."""
        self._lru.clear()
        self._fingerprint = None

    def _check_weights(self, model) -> None:
        # a parameter replaced (its storage) or changed in place (its version counter): the stored KV is stale
        fp = (id(model), model.device, model.dtype, tuple((p._version, p.data_ptr()) for p in model.parameters()))
        if fp != self._fingerprint:
            self._lru.clear()
            self._fingerprint = fp

    def _lookup(self, prefix: tuple[int, ...]):
        best = None
        for key in self._lru:
            if len(key) <= len(prefix) and prefix[:len(key)] == key and (best is None or len(key) > len(best)):
                best = key
        if best is not None:
            self._lru.move_to_end(best)
        return best

    @torch.inference_mode()
    def prefill(self, model, prompts: list[list[int]], max_new: int, decoder="auto"):
        """``(cache, last_logits [B, V])`` for ``prompts`` with room for ``max_new`` tokens, or None
        when the batch has no shared prefix worth reusing (the caller prefills normally). ``decoder``: the
        engine's native forward for this call (train/engine/native.py; None: PyTorch), so that the cached path
        runs where the uncached one does and keeps no copy of the weights; ``"auto"`` builds one for the call."""
        B = len(prompts)
        lens = [len(p) for p in prompts]
        P = min(common_prefix_len(prompts), min(lens) - 1)  # every row keeps >= 1 token to prefill
        if B < 2 or P < self.min_prefix:
            return None
        if model.config.architecture == "zaya":  # CCA's convolution would see the padding between prefix and suffix
            return None
        self._check_weights(model)
        cfg, dev, dtype = model.config, model.device, model.dtype
        prefix = tuple(prompts[0][:P])
        one = KVCache.allocate(cfg, 1, P, dev, dtype)
        key = self._lookup(prefix)
        m = len(key) if key is not None else 0
        if m:
            ks, vs = self._lru[key]
            for layer in range(cfg.num_hidden_layers):
                one.k[layer][:, :, :m] = ks[layer]
                one.v[layer][:, :, :m] = vs[layer]
            one.valid[:, :m] = True
            one.length = m
            self.stats.lru_hits += 1
        if decoder == "auto":
            from train.engine import native

            decoder = native.decoder(model)
        if m < P:
            ids = torch.tensor([prefix[m:]], device=dev)
            if decoder is not None:
                decoder.forward(ids, one)
            else:
                model.hidden_states(ids, cache=one)
            if self.max_entries:
                self._lru[prefix] = ([k[:, :, :P].clone() for k in one.k], [v[:, :, :P].clone() for v in one.v])
                while len(self._lru) > self.max_entries:
                    self._lru.popitem(last=False)
        # fan the prefix out to every row, then prefill the (left-padded) suffixes after it
        Ls = max(lens) - P
        cache = KVCache.allocate(cfg, B, P + Ls + max_new, dev, dtype)
        for layer in range(cfg.num_hidden_layers):
            cache.k[layer][:, :, :P] = one.k[layer][:, :, :P]
            cache.v[layer][:, :, :P] = one.v[layer][:, :, :P]
        cache.valid[:, :P] = True
        cache.length = cache.shared = P  # the decoder reads the prefix once for all rows
        inp = torch.full((B, Ls), input_pad_id(cfg), dtype=torch.long)
        mask = torch.zeros(B, Ls, dtype=torch.bool)
        for i, p in enumerate(prompts):
            s = p[P:]
            inp[i, Ls - len(s):] = torch.tensor(s)
            mask[i, Ls - len(s):] = True
        if decoder is not None:
            logits = decoder.forward(inp, cache, mask)
        else:
            logits = model.last_logits(inp.to(dev), mask.to(dev), cache=cache)
        self.stats.batches += 1
        self.stats.shared_tokens += P
        self.stats.saved_tokens += (B - 1) * P + m
        return cache, logits


def enable_prefix_caching(engine, min_prefix: int = 8, max_entries: int = 8) -> PrefixCache:
    """Turn shared-prefix reuse on for a :class:`~train.engine.torch_engine.TorchEngine`."""
    if getattr(engine.model, "is_transformers_fallback", False):
        raise ValueError("shared-prefix caching needs Cascade's own model, not the transformers fallback")
    engine.prefix_cache = PrefixCache(min_prefix=min_prefix, max_entries=max_entries)
    return engine.prefix_cache
