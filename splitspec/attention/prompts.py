"""Attention of fresh prompts over their own tokens: the target's prefill graphs.

A prompt that starts a sequence has nothing before it in the cache, so its
attention needs no page lists: each row sees the rows of its own prompt up to
itself. Prompts packed one after another, each row carrying its prompt's
first row (:func:`prompt_starts`), make a pass whose kernels depend on the
packed length alone, which is what a CUDA graph needs
(splitspec/cuda_graphs.py). On CUDA one Triton kernel attends
(splitspec/kernels/prompt_attention.py); :func:`prompt_attention_reference`
is its torch form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.cascade import masked_attention
from splitspec.kernels import HAS_TRITON
from splitspec.kv_cache import KVCache


def is_fresh_prompt(seq: SeqAttention) -> bool:
    """A causal pass over a sequence's every slot: a prompt with nothing cached before it."""
    return seq.causal and seq.q_len == seq.kv_len


def prompt_starts(lengths: list[int], rows: int) -> list[int]:
    """Each of ``rows`` rows' first row of its prompt, for prompts of these lengths packed
    from row 0; rows past them (padding) are prompts of one row each."""
    starts: list[int] = []
    for n in lengths:
        starts.extend([len(starts)] * n)
    if len(starts) > rows:
        raise ValueError(f"prompts of {len(starts)} tokens do not fit {rows} rows")
    return starts + list(range(len(starts), rows))


def prompt_slots(seqs: list[SeqAttention]) -> torch.Tensor:
    """The global cache slots [T] (host int64) of packed fresh prompts' rows."""
    return torch.cat([seq.table.global_slots(0, seq.q_len) for seq in seqs])


def prompt_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               starts: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k and v [T, H_kv, D], starts [T]: row i attends to rows starts[i]..i."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    index = torch.arange(rows, device=q.device)
    allowed = (index[None, :] >= starts[:, None]) & (index[None, :] <= index[:, None])
    out, _ = masked_attention(q.view(1, rows, kv_heads, heads // kv_heads, dim), k[None], v[None],
                              allowed[None])
    return out.reshape(q.shape).to(q.dtype)


@dataclass
class PromptMetadata(AttentionMetadata):
    starts: torch.Tensor  # [T] int64: each row's first row of its prompt


class PromptAttention(AttentionBackend):
    """Passes of fresh prompts only: K/V go to the cache, attention runs on the pass's own
    K/V (nothing is read back from the cache)."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> PromptMetadata:
        if not seqs or not all(is_fresh_prompt(seq) for seq in seqs):
            raise ValueError("PromptAttention plans fresh prompts only (causal, q_len == kv_len)")
        lengths = [seq.q_len for seq in seqs]
        starts = torch.tensor(prompt_starts(lengths, sum(lengths)), dtype=torch.int64)
        return PromptMetadata(prompt_slots(seqs).to(device), starts.to(device))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: PromptMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        if q.is_cuda and HAS_TRITON:
            from splitspec.kernels.prompt_attention import prompt_attention

            return prompt_attention(q, k, v, meta.starts)
        return prompt_attention_reference(q, k, v, meta.starts)
