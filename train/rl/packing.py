"""Sequence packing for the trainer: micro-batches by token budget, token-balanced data-parallel
splits, and per-token log-probs from the packed forward.

A micro-batch is one row [1, N] holding its sequences back to back (``CausalLM.hidden_states(...,
cu_seqlens=...)``): positions restart per sequence, attention stays within a sequence, and every
GEMM runs over real tokens only, so no compute goes to padding. The LM head and log-softmax run
only on the positions whose next token is scored, in chunks of rows (:func:`chunked_token_logprobs`),
so the fp32 [tokens, vocab] logits never exist at once, in forward or backward.

    for mb in pack_by_tokens([s.num_tokens for s in samples], budget=8192):
        lps, ents = packed_token_logprobs(policy, [samples[i] for i in mb], temperature)
        # lps[j]: log-probs [C_j] of sample mb[j]'s completion tokens (differentiable)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from train.model.modeling import CausalLM

LOGITS_PER_CHUNK = 1 << 24  # default chunk: about this many fp32 logits (64 MiB) per chunk of rows


# ------------------------------------------------------------------------------------------------
# who goes where


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into micro-batches of at most ``budget`` tokens.

    Longest first, each into the first micro-batch it fits; a sample longer than ``budget`` gets a
    micro-batch of its own. Every index appears exactly once; indices within a micro-batch ascend."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n < 0:
            raise ValueError(f"sample {i} has negative length {n}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(budget - n if n <= budget else -1)
    return [sorted(b) for b in bins]


def pack_micro_batches(lengths: Sequence[int], budget: int, max_rows: int) -> list[list[int]]:
    """:func:`pack_by_tokens`, each micro-batch then cut into runs of at most ``max_rows`` samples (the
    single-process trainers' ``micro_batch_size``): indices into ``lengths``."""
    rows = max(1, int(max_rows))
    return [mb[k:k + rows] for mb in pack_by_tokens(lengths, budget) for k in range(0, len(mb), rows)]


def balance_across_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Sample indices split over ``world`` data-parallel ranks with balanced token counts (longest
    first onto the rank holding the fewest tokens, ties to the fewest samples, then the lowest rank).
    Every index appears exactly once; indices within a rank ascend. With at least ``world`` samples
    of positive length, no rank is left empty."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in order:
        r = min(range(world), key=lambda j: (load[j], len(ranks[j]), j))
        ranks[r].append(i)
        load[r] += int(lengths[i])
    return [sorted(r) for r in ranks]


# ------------------------------------------------------------------------------------------------
# chunked LM head + log-softmax


class _LogitStats(torch.autograd.Function):
    """For logits z = h @ w^T / temperature over the vocabulary rows ``off .. off + V_w`` (the whole
    vocabulary, or one shard of it): per row the log-sum-exp, the target's logit (0 where the target
    lies outside these rows) and, without gradient and only when asked, the softmax-weighted mean logit.
    Computed ``chunk`` rows at a time; backward recomputes each chunk's logits, so only [chunk, V_w]
    fp32 buffers are ever alive. Log-probs are ``target - lse`` and entropies ``lse - mean``, over
    shards after combining their log-sum-exps (:class:`train.parallel.tsp.TSPCausalLM`)."""

    @staticmethod
    def forward(ctx, h, w, targets, off: int, temperature: float, chunk: int, want_mean: bool):
        N, Vw = h.shape[0], w.shape[0]
        wf = w.float()
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        tgt = torch.zeros(N, dtype=torch.float32, device=h.device)
        mean = torch.zeros(N if want_mean else 0, dtype=torch.float32, device=h.device)
        local = targets - off
        inside = (local >= 0) & (local < Vw)
        idx = local.clamp(0, max(Vw - 1, 0))
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z = chunk_logits(h[s:e], wf, temperature)
            m = torch.logsumexp(z, dim=-1)
            lse[s:e] = m
            tgt[s:e] = torch.where(inside[s:e], z.gather(1, idx[s:e, None]).squeeze(1), 0.0)
            if want_mean:
                mean[s:e] = (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(h, w, idx, inside, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(mean)
        return lse, tgt, mean

    @staticmethod
    def backward(ctx, g_lse, g_tgt, _g_mean):
        h, w, idx, inside, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lse is None and g_tgt is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        T, chunk, N = ctx.temperature, ctx.chunk, h.shape[0]
        wf = w.float()
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        gw = torch.zeros(wf.shape, dtype=torch.float32, device=h.device) if need_w else None
        zero = torch.zeros(N, dtype=torch.float32, device=h.device)
        g_lse = zero if g_lse is None else g_lse.float()
        g_tgt = zero if g_tgt is None else g_tgt.float() * inside
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            hc = h[s:e].float()
            # d lse / d z = softmax(z); d tgt / d z = onehot(target) inside these rows; z = h w^T / T
            dz = torch.exp(chunk_logits(hc, wf, T) - lse[s:e, None]).mul_(g_lse[s:e, None])
            dz.scatter_add_(1, idx[s:e, None], g_tgt[s:e, None])
            if T != 1.0:
                dz.div_(T)
            if need_h:
                gh[s:e] = dz @ wf
            if need_w:
                gw.addmm_(dz.t(), hc)
        return (gh.to(h.dtype) if need_h else None, gw.to(w.dtype) if need_w else None,
                None, None, None, None, None)


def logit_stats(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, off: int = 0, temperature: float = 1.0,
                chunk_tokens: int | None = None, want_mean: bool = False):
    """``(lse, target logit, mean logit)`` [N] each of ``softmax(h @ weight^T / temperature)`` over the
    vocabulary rows ``off .. off + len(weight)`` (see :class:`_LogitStats`); ``chunk_tokens`` rows of
    logits at a time (default: about 16M logits a chunk); the mean is empty without ``want_mean``."""
    temperature = float(temperature) if temperature else 1.0
    chunk = int(chunk_tokens) if chunk_tokens else default_chunk(weight.shape[0])
    return _LogitStats.apply(h, weight, targets.to(device=h.device, dtype=torch.long), int(off), temperature,
                             max(1, chunk), bool(want_mean))


def chunk_logits(h: torch.Tensor, wf: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits of the rows ``h`` under the fp32 LM-head weight ``wf``, divided by ``temperature``."""
    z = F.linear(h.float(), wf)
    return z / temperature if temperature != 1.0 else z


def default_chunk(vocab: int) -> int:
    return max(16, LOGITS_PER_CHUNK // max(1, vocab))


def chunked_token_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           chunk_tokens: int | None = None, return_entropy: bool = False):
    """Log-probabilities [N] of ``targets`` [N] under softmax(h @ weight^T / temperature) for hidden
    states ``h`` [N, H] and LM-head ``weight`` [V, H] (fp32 logits whatever their dtype), computed
    ``chunk_tokens`` rows at a time in forward and backward (default: about 16M logits a chunk). With
    ``return_entropy`` also the entropy [N] of each row's distribution (no gradient)."""
    lse, tgt, mean = logit_stats(h, weight, targets, 0, temperature, chunk_tokens, return_entropy)
    lp = tgt - lse
    return (lp, (lse - mean).detach()) if return_entropy else lp


# ------------------------------------------------------------------------------------------------
# packed forward -> per-sequence log-probs


def _sequence(s) -> tuple[list[int], int]:
    """(all token ids, index of the first scored token): a sample's completion, or every next token."""
    if hasattr(s, "prompt_ids") and hasattr(s, "completion_ids"):
        p = list(s.prompt_ids)
        if not p and len(s.completion_ids):
            raise ValueError("a sample needs at least one prompt token to score its completion")
        return p + list(s.completion_ids), max(1, len(p))
    return [int(t) for t in s], 1


def _per_layer_routing(r, length: int) -> list[torch.Tensor]:
    """One sequence's expert ids as per-MoE-layer [L, k]: from the compact [L, n_moe, k] form
    (:func:`train.rl.exchange.stack_routing`) or a per-layer list of [1, L, k] / [L, k]."""
    if torch.is_tensor(r):
        if r.dim() != 3 or r.shape[0] != length:
            raise ValueError(f"routed experts {tuple(r.shape)} do not match a sequence of {length} tokens "
                             "(expected [tokens, n_moe_layers, k])")
        return [r[:, i] for i in range(r.shape[1])]
    out = [torch.as_tensor(t).reshape(-1, torch.as_tensor(t).shape[-1]) for t in r]
    if any(t.shape[0] != length for t in out):
        raise ValueError(f"routed experts cover {[t.shape[0] for t in out]} tokens, not {length}")
    return out


@dataclass
class Pair:
    """A (prompt, completion) pair of token ids as the packing functions take it (its completion scored)."""

    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class PackedRow:
    """Sequences back to back in one row, as :func:`packed_token_logprobs` and the TSP ranks feed it
    to the model."""

    input_ids: torch.Tensor                     # [N] every sequence's tokens, back to back
    cu_seqlens: list[int]                       # 0, end of sequence 1, ..., N
    scored: torch.Tensor                        # [S] positions whose NEXT token is scored, sequence by sequence
    scored_host: torch.Tensor                   # the same on the host (CPU)
    counts: list[int]                           # scored tokens per sequence (sum S)
    routed_experts: list[torch.Tensor] | None   # per MoE layer [1, N, k] (router replay), or None


def pack_row(samples_or_token_lists: Sequence, device, routed_experts: Sequence | None = None) -> PackedRow:
    """The :class:`PackedRow` of the given samples (their completion tokens scored) or token lists
    (tokens 1..L-1 scored); routed experts as in :func:`packed_token_logprobs`."""
    seqs = [_sequence(s) for s in samples_or_token_lists]
    if any(len(ids) == 0 for ids, _ in seqs):
        raise ValueError("an empty sequence cannot be packed")
    if routed_experts is None:
        own = [getattr(s, "routed_experts", None) for s in samples_or_token_lists]
        if all(r is not None for r in own):
            routed_experts = own
        elif any(r is not None for r in own):
            raise ValueError("some samples carry routed experts and some do not; replay needs all or none")
    if routed_experts is not None and len(routed_experts) != len(seqs):
        raise ValueError(f"{len(routed_experts)} routed-expert entries for {len(seqs)} sequences")
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    counts = []
    for toks, first in seqs:
        o = len(ids)
        ids.extend(toks)
        pos.extend(range(o + first - 1, o + len(toks) - 1))
        counts.append(max(0, len(toks) - first))
        cu.append(len(ids))
    replay = None
    if routed_experts is not None:
        per_seq = [_per_layer_routing(r, len(t)) for r, (t, _) in zip(routed_experts, seqs)]
        replay = [torch.cat([p[i] for p in per_seq]).to(device=device, dtype=torch.long)[None]
                  for i in range(len(per_seq[0]))]
    pos_t = torch.tensor(pos, dtype=torch.long)
    return PackedRow(torch.tensor(ids, dtype=torch.long, device=device), cu, pos_t.to(device), pos_t, counts, replay)


def packed_token_logprobs(model: CausalLM, samples_or_token_lists: Sequence, temperature: float = 1.0,
                          routed_experts: Sequence | None = None, return_entropy: bool = True,
                          chunk_tokens: int | None = None, checkpoint_layers: bool = False):
    """Per-sequence token log-probs from one packed forward of all the given sequences.

    ``samples_or_token_lists``: objects with ``prompt_ids`` and ``completion_ids`` (e.g.
    :class:`train.rl.exchange.TrainSample`), whose completion tokens are scored (C values each), or
    plain token lists, whose tokens 1..L-1 are scored given their prefix (L-1 values each, as
    :func:`train.model.modeling.token_logprobs` for that row). Returns ``(logprobs, entropies)``,
    lists of 1-D fp32 tensors (``logprobs`` alone without ``return_entropy``); log-probs carry gradient,
    entropies do not.

    ``routed_experts``: per sequence, the expert ids of all its tokens to replay (compact
    [L, n_moe_layers, k] or a per-layer list); by default a sample's own ``routed_experts`` when every
    sample has one. ``chunk_tokens``: rows of the LM head + log-softmax at a time (see
    :func:`chunked_token_logprobs`); ``checkpoint_layers``: activation checkpointing of decoder layers.
    """
    if not len(samples_or_token_lists):
        return ([], []) if return_entropy else []
    row = pack_row(samples_or_token_lists, model.device, routed_experts)
    h = model.hidden_states(row.input_ids[None], routed_experts=row.routed_experts, cu_seqlens=row.cu_seqlens,
                            checkpoint_layers=checkpoint_layers)[0]
    out = chunked_token_logprobs(h.index_select(0, row.scored), model.lm_head.weight, row.input_ids[row.scored + 1],
                                 temperature, chunk_tokens, return_entropy)
    if not return_entropy:
        return list(torch.split(out, row.counts))
    return list(torch.split(out[0], row.counts)), list(torch.split(out[1], row.counts))


def scatter_rows(values: Sequence[torch.Tensor], starts: Sequence[int], width: int) -> torch.Tensor:
    """Per-sequence 1-D tensors placed into a zero [len(values), width] tensor at column ``starts[i]``
    (differentiable): completion log-probs in the layout of :func:`train.batching.make_batch`'s
    loss mask, where completion token j of a prompt of length P sits at column P - 1 + j."""
    dev = values[0].device if len(values) else None
    rows = torch.cat([torch.full((len(v),), i, dtype=torch.long, device=dev) for i, v in enumerate(values)])
    cols = torch.cat([torch.arange(st, st + len(v), device=dev) for st, v in zip(starts, values)])
    out = torch.zeros(len(values), width, dtype=values[0].dtype, device=dev)
    return out.index_put((rows, cols), torch.cat(list(values)))
