"""The attention-backend interface.

One forward pass processes a flat batch of query tokens from several
sequences. Sequence i contributes ``q_len`` new tokens whose K/V are written to
its last ``q_len`` logical slots, then attends over all ``kv_len`` logical
slots of its page table (the new ones included), under either the causal mask
(prefill, plain decode) or an explicit boolean mask (tree verification,
drafting). This is the shape of flashinfer's paged prefill with a custom mask,
so a flashinfer backend plugs in behind the same two calls:

    meta = backend.plan(seqs, device)     # once per forward pass
    out = backend.forward(layer, q, k, v, meta, kv_cache)   # per layer
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitspec.kv_cache import KVCache, PageTable
from splitspec.tree import with_prefix


@dataclass
class SeqAttention:
    """What one sequence brings to a forward pass.

    Invariants: ``q_len <= kv_len <= table.capacity``; at most one of ``mask`` and
    ``tree`` is set, and with neither the mask is causal. ``mask`` is a bool tensor
    [q_len, kv_len] where True means "may attend"; ``tree`` [q_len, q_len] says the
    same of a verify pass, whose new tokens all see every earlier slot and among
    themselves what it allows (a root and its tree: ``splitspec.tree.ancestor_mask``),
    so the [q_len, kv_len] mask need never be built (splitspec/attention/cascade.py).
    """

    table: PageTable
    kv_len: int
    q_len: int
    mask: torch.Tensor | None = None
    tree: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        return self.mask is None and self.tree is None

    def dense_mask(self) -> torch.Tensor | None:
        """The [q_len, kv_len] bool mask on the host (None: causal), checked against the shape."""
        if self.tree is not None:
            if self.mask is not None or tuple(self.tree.shape) != (self.q_len, self.q_len):
                raise ValueError(f"tree shape {tuple(self.tree.shape)} != ({self.q_len}, "
                                 f"{self.q_len}), or a mask as well")
            return with_prefix(self.tree, self.kv_len - self.q_len)
        if self.mask is not None and tuple(self.mask.shape) != (self.q_len, self.kv_len):
            raise ValueError(f"mask shape {tuple(self.mask.shape)} != ({self.q_len}, {self.kv_len})")
        return self.mask


def new_token_slots(seqs: list[SeqAttention]) -> list[int]:
    """The global cache slots of every sequence's q_len new tokens (its last q_len of
    kv_len), in order: where a pass writes its K/V (each table maps with its page size)."""
    slots: list[int] = []
    for seq in seqs:
        if not 0 < seq.q_len <= seq.kv_len:
            raise ValueError(f"need 0 < q_len <= kv_len, got q_len={seq.q_len} kv_len={seq.kv_len}")
        if seq.kv_len > seq.table.capacity:
            raise IndexError(f"kv_len {seq.kv_len} exceeds the {seq.table.capacity} slots "
                             "reserved")
        slots.extend(seq.table.slots(range(seq.kv_len - seq.q_len, seq.kv_len)))
    return slots


@dataclass
class AttentionMetadata:
    """Per-pass state built by :meth:`AttentionBackend.plan`, reused by every layer; each
    backend adds its own fields."""

    write_slots: torch.Tensor        # [T] global slots of the new tokens, in query order


class AttentionBackend(ABC):
    """Computes paged attention for a flat batch of sequences."""

    @abstractmethod
    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        """Build the metadata of one forward pass. Raises ValueError on inconsistent input."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """Write k, v ([T, H_kv, D]) into the cache, attend q ([T, H, D]); returns [T, H, D]."""


def causal_mask(q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """Query j (the token at logical slot kv_len - q_len + j) sees slots 0..kv_len - q_len + j."""
    cols = torch.arange(kv_len, device=device)
    rows = torch.arange(q_len, device=device) + (kv_len - q_len)
    return cols[None, :] <= rows[:, None]


@dataclass
class SplitMetadata(AttentionMetadata):
    rows: int                                          # the first part's rows
    first: tuple[AttentionBackend, AttentionMetadata]  # rows [0, rows)
    second: tuple[AttentionBackend, AttentionMetadata]  # the rest


class SplitAttention(AttentionBackend):
    """A pass of two parts side by side, each with its own backend and metadata (a mixed
    step's CUDA graph: prompts, then decode or verify rows, splitspec/cuda_graphs.py); each
    part writes its own K/V."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        raise TypeError("SplitAttention runs passes planned by their owner (StepGraphs)")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: SplitMetadata, cache: KVCache) -> torch.Tensor:
        n = meta.rows
        (first, first_meta), (second, second_meta) = meta.first, meta.second
        return torch.cat((first.forward(layer, q[:n], k[:n], v[:n], first_meta, cache),
                          second.forward(layer, q[n:], k[n:], v[n:], second_meta, cache)))
