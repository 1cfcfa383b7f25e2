"""Attention split in two key sets and merged: a paged prefix, and a small dense block.

Both the target's tree verification and the draft's tree search have the
same structure: every new row sees ALL of its sequence's committed slots, and
among the few new keys (a tree's nodes) only those a small boolean table
allows. The committed part needs no mask at all, so it runs through a
paged kernel that loads each sequence's keys once for all its rows
(splitspec/attention/decode_table.py's ``TablePrefix``; :class:`TorchPrefix`
is its reference); the new part is a dense [rows, keys] problem of a few dozen
keys (:func:`masked_attention`, one Triton kernel on CUDA); the two are merged
by their log-sum-exp (:func:`merge_attention`), which is exactly the softmax
over the union. Nothing of size [rows, kv_len] is built on the host, where the
one-pass form needs a [q_len, kv_len] mask per sequence and FA2's custom-mask
prefill.

:class:`TreeVerifyAttention` is the target's verify pass in this form (its CUDA
graphs, splitspec/cuda_graphs.py); draft_service/tree_search.py's
``NodeAttention`` is the draft's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.kernels import HAS_TRITON
from splitspec.kv_cache import KVCache, PageTable

LN2 = math.log(2.0)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float32 with its log-sum-exp.

    q [B, R, H_kv, G, D] (G query heads per KV head); k, v [B, T, H_kv, D]; mask [B, R or 1, T]
    bool (True = may attend). Returns out [B, R, H_kv, G, D] and lse [B, R, H_kv, G] (natural
    log; -inf for a row that sees nothing, whose out is then NaN-free zeros after merging).
    """
    scores = torch.einsum("brhgd,bthd->brhgt", q.float(), k.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("brhgt,bthd->brhgd", weights, v.float()), lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's (out [..., D], lse [...])."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]


class PrefixAttention(ABC):
    """Attention of every row over its sequence's first slots (no mask): planned once per
    pass (or per draft call), run per layer."""

    lse_scale = 1.0  # what turns attend()'s log-sum-exp into a natural log
    any_rows = False  # whether attend takes any number of rows per sequence, not only the
                      # number planned

    @abstractmethod
    def plan(self, tables: list[PageTable], lengths: list[int], rows_per_seq: int,
             device: torch.device) -> None:
        """Sequence b's rows are rows b * rows_per_seq ... of every later :meth:`attend`;
        they see its logical slots [0, lengths[b]) (at least one)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, D] -> out [N, H, D], lse [N, H] (times lse_scale: natural log)."""

    def attend_with(self, layer: int, q: torch.Tensor, cache: KVCache, keys: torch.Tensor,
                    values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """:func:`cascade_attention`: the prefix and the dense keys, merged."""
        out_p, lse_p = self.attend(layer, q, cache)
        return merge_with_prefix(q, keys, values, allowed, out_p, lse_p, self.lse_scale)


class TorchPrefix(PrefixAttention):
    """The reference: each sequence's slots gathered from the pages, padded to the longest.

    A layer's prefix K/V are gathered once per plan (the prefix does not change between
    plans: a draft call's levels attend to it again and again), and :meth:`attend_with` is
    one softmax over the prefix and the dense keys together (on CPU the second pass and
    the merge cost more than the work they do)."""

    any_rows = True

    def plan(self, tables: list[PageTable], lengths: list[int], rows_per_seq: int,
             device: torch.device) -> None:
        longest = max(lengths)
        slots, valid = [], []
        for table, n in zip(tables, lengths, strict=True):
            own = table.global_slots(0, n)
            slots.append(torch.cat((own, own[:1].expand(longest - n))))  # padding: never attended
            valid.append(torch.arange(longest) < n)
        self._slots = torch.stack(slots).to(device)              # [B, T]
        self._valid = torch.stack(valid).to(device)[:, None, :]  # [B, 1, T]
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _keys(self, layer: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's prefix K and V [B, T, H_kv, D] in float32, read once per plan."""
        if layer not in self._kv:
            b, t = self._slots.shape
            k, v = cache.read(layer, self._slots.reshape(-1))
            self._kv[layer] = (k.view(b, t, *k.shape[1:]).float(),
                               v.view(b, t, *v.shape[1:]).float())
        return self._kv[layer]

    def _split(self, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """q [B * W, H, D] as [B, W, H_kv, G, D]."""
        b, heads, dim = self._slots.shape[0], q.shape[1], q.shape[2]
        return q.view(b, -1, kv_heads, heads // kv_heads, dim)

    def attend(self, layer: int, q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._keys(layer, cache)
        out, lse = masked_attention(self._split(q, k.shape[2]), k, v, self._valid)
        return out.reshape(q.shape), lse.reshape(q.shape[:2])

    def attend_with(self, layer: int, q: torch.Tensor, cache: KVCache, keys: torch.Tensor,
                    values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        k, v = self._keys(layer, cache)
        mask = torch.cat((self._valid.expand(-1, allowed.shape[1], -1), allowed), dim=2)
        b, rows = allowed.shape[:2]
        kv_heads, dim = k.shape[2], q.shape[2]
        group = q.shape[1] // kv_heads
        # [B, H_kv, group * W, D]: the query heads that share a KV head stacked, so one
        # scaled_dot_product_attention (a third of masked_attention's time on the CPU)
        queries = (self._split(q, kv_heads).permute(0, 2, 3, 1, 4)
                   .reshape(b, kv_heads, group * rows, dim).float())
        out = F.scaled_dot_product_attention(
            queries, torch.cat((k, keys.float()), 1).transpose(1, 2),
            torch.cat((v, values.float()), 1).transpose(1, 2),
            attn_mask=mask.repeat(1, group, 1)[:, None])  # every row sees itself
        return (out.view(b, kv_heads, group, rows, dim).permute(0, 3, 1, 2, 4)
                .reshape(q.shape).to(q.dtype))


def cascade_attention(layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      allowed: torch.Tensor, prefix: PrefixAttention, cache: KVCache
                      ) -> torch.Tensor:
    """q [B * W, H, D] attends to its sequence's planned prefix and to the dense keys, values
    [B, T, H_kv, D] that ``allowed`` [B, W, T] lets each row see (at least one: itself);
    returns [B * W, H, D] in q's dtype."""
    return prefix.attend_with(layer, q, cache, keys, values, allowed)


def merge_with_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      allowed: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                      lse_scale: float) -> torch.Tensor:
    """The dense part of :func:`cascade_attention`, merged with the prefix's out [B * W, H, D]
    and log-sum-exp [B * W, H] (times ``lse_scale``: natural log)."""
    if q.is_cuda and HAS_TRITON:  # one kernel for the dense part and the merge
        from splitspec.kernels.tree_attention import tree_attention

        return tree_attention(q, keys, values, allowed, out_p, lse_p, lse_scale)
    b, width = allowed.shape[:2]
    kv_heads, dim = keys.shape[2], keys.shape[3]
    out_t, lse_t = masked_attention(q.view(b, width, kv_heads, -1, dim), keys, values, allowed)
    merged = merge_attention(out_p.float(), lse_p * lse_scale, out_t.reshape(q.shape),
                             lse_t.reshape(q.shape[:2]))
    return merged.to(q.dtype)


@dataclass
class TreeVerifyMetadata(AttentionMetadata):
    prefix: PrefixAttention  # planned: sequence b's rows over its committed slots
    allowed: torch.Tensor    # [B, q, q] bool: each sequence's tree (SeqAttention.tree)


class TreeVerifyAttention(AttentionBackend):
    """A verify pass of B sequences of q new tokens each (a root and its tree), every new
    token seeing all committed slots: the new K/V go to the cache (for the accepted path's
    compaction) and are also the dense keys of :func:`cascade_attention`."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        raise TypeError("TreeVerifyAttention runs passes planned by their owner (StepGraphs)")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TreeVerifyMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        b, width = meta.allowed.shape[:2]
        shape = (b, width, k.shape[1], k.shape[2])
        return cascade_attention(layer, q, k.view(shape), v.view(shape), meta.allowed,
                                 meta.prefix, cache)
