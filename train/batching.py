"""Turning (prompt, completion) token lists into right-padded training tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    input_ids: torch.Tensor       # [B, T]
    attention_mask: torch.Tensor  # [B, T] bool, real tokens
    loss_mask: torch.Tensor       # [B, T-1] float: 1 where the target input_ids[:, t+1] is a completion token
    prompt_lens: list[int]
    completion_lens: list[int]

    def to(self, device) -> "TokenBatch":
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                          self.prompt_lens, self.completion_lens)

    def scatter_completion(self, values: list[list[float]], dtype=torch.float32) -> torch.Tensor:
        """Per-completion token values placed at the loss positions [B, T-1] (zeros elsewhere)."""
        out = torch.zeros(self.loss_mask.shape, dtype=dtype)
        for i, (p, v) in enumerate(zip(self.prompt_lens, values)):
            out[i, p - 1:p - 1 + len(v)] = torch.tensor(v, dtype=dtype)
        return out.to(self.loss_mask.device)


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0) -> TokenBatch:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    lens = [len(p) + len(c) for p, c in zip(prompts, completions)]
    B, T = len(prompts), max(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :lens[i]] = torch.tensor(list(p) + list(c), dtype=torch.long)
        att[i, :lens[i]] = True
        lm[i, len(p) - 1:len(p) - 1 + len(c)] = 1.0
    return TokenBatch(ids, att, lm, [len(p) for p in prompts], [len(c) for c in completions])


def micro_batches(n: int, size: int) -> list[slice]:
    size = max(1, int(size))
    return [slice(s, min(n, s + size)) for s in range(0, n, size)]


def even_slices(n: int, parts: int) -> list[slice]:
    """``n`` rows cut into ``min(parts, n)`` slices whose sizes differ by at most one (as many as asked: cutting
    into slices of ``ceil(n / parts)`` rows can make fewer, e.g. 11 of 64 rows for 12)."""
    parts = max(1, min(int(parts), n))
    return [slice(i * n // parts, (i + 1) * n // parts) for i in range(parts)] if n > 0 else []


def index_batch(b: TokenBatch, sl: slice) -> TokenBatch:
    """Rows ``sl`` of a batch, trimmed to their longest sequence."""
    att = b.attention_mask[sl]
    T = int(att.sum(-1).max())
    return TokenBatch(b.input_ids[sl, :T], att[:, :T], b.loss_mask[sl, :T - 1], b.prompt_lens[sl],
                      b.completion_lens[sl])
