"""The reference attention backend: plain torch, CPU or GPU.

Used on CPU and by the tests as the oracle for faster backends. The sequences of a pass
that bring the same number of new tokens are attended together, in one padded
``scaled_dot_product_attention`` per layer (a decode step's, a verify step's: one call
for the whole batch; on the CPU a call per sequence cost 55 us a layer, most of a
64-sequence step, docs/benchmarks.md); :func:`attend_each` is the same attention one
sequence at a time, as it was written first, kept as the tests' check of the padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitspec.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SeqAttention,
    causal_mask,
    new_token_slots,
)
from splitspec.kv_cache import KVCache


@dataclass
class _Group:
    """Sequences with the same number of new tokens: their keys padded to the longest.

    Key j of sequence b is its logical slot j, read from page ``pages[b * K + j]`` at
    ``offsets[b * K + j]`` (a padding key, past kv_len, reads a slot of the sequence's own
    pages or of its first, and is never attended)."""

    rows: torch.Tensor | None  # [n * q] the pass's query rows (None: all of them, in order)
    pages: torch.Tensor        # [n * K]
    offsets: torch.Tensor      # [n * K]
    mask: torch.Tensor         # [n, q, K] bool, True = may attend
    n: int
    q: int
    keys: int
    _by_group_size: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, group: int) -> torch.Tensor:
        """The mask of query rows laid out [n, 1, group * q, K] (query heads of one KV head
        stacked), built once a pass."""
        if group not in self._by_group_size:
            self._by_group_size[group] = self.mask.repeat(1, group, 1)[:, None]
        return self._by_group_size[group]


@dataclass
class TorchMetadata(AttentionMetadata):
    groups: list[_Group] = field(default_factory=list)


def _group(seqs: list[SeqAttention], rows: torch.Tensor | None, device: torch.device | str
           ) -> _Group:
    n, q = len(seqs), seqs[0].q_len
    keys = max(s.kv_len for s in seqs)
    page_size = seqs[0].table.page_size
    widest = -(-keys // page_size)
    tables = torch.tensor([s.table.pages[:widest] + [s.table.pages[0]] * (widest - len(s.table.pages))
                           for s in seqs], dtype=torch.int64)
    cols = torch.arange(keys)
    lengths = torch.tensor([s.kv_len for s in seqs])
    # causal: row i of sequence b sees its slots up to kv_len - q + i
    last = lengths[:, None] - q + torch.arange(q)[None, :]
    mask = cols[None, None, :] <= last[:, :, None]
    for b, seq in enumerate(seqs):
        dense = seq.dense_mask()
        if dense is not None:
            mask[b] = False
            mask[b, :, :seq.kv_len] = dense.to(torch.bool)
    pages = tables[:, cols // page_size]
    offsets = (cols % page_size).repeat(n)
    return _Group(None if rows is None else rows.to(device), pages.reshape(-1).to(device),
                  offsets.to(device), mask.to(device), n, q, keys)


class TorchAttentionBackend(AttentionBackend):
    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> TorchMetadata:
        write = torch.tensor(new_token_slots(seqs), dtype=torch.int64, device=device)  # checks
        starts, by_len = [0], {}
        for i, seq in enumerate(seqs):
            starts.append(starts[-1] + seq.q_len)
            by_len.setdefault(seq.q_len, []).append(i)
        groups = []
        for members in by_len.values():
            rows = None
            if len(by_len) > 1:
                rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members])
            groups.append(_group([seqs[i] for i in members], rows, device))
        return TorchMetadata(write, groups)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        group = heads // kv_heads
        pool = cache.data[layer]
        out = None if len(meta.groups) == 1 else torch.empty_like(q)
        for g in meta.groups:
            kv = pool[g.pages, :, g.offsets].view(g.n, g.keys, 2, kv_heads, dim)
            keys = kv[:, :, 0].transpose(1, 2).float()    # [n, H_kv, K, D]
            values = kv[:, :, 1].transpose(1, 2).float()
            rows = q if g.rows is None else q[g.rows]
            # [n, H_kv, group * q, D]: the query heads that share a KV head, stacked
            queries = (rows.view(g.n, g.q, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
                       .reshape(g.n, kv_heads, group * g.q, dim).float())
            got = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask_for(group))
            got = (got.view(g.n, kv_heads, group, g.q, dim).permute(0, 3, 1, 2, 4)
                   .reshape(g.n * g.q, heads, dim).to(q.dtype))
            if out is None:
                return got
            out.index_copy_(0, g.rows, got)
        return out


def attend_each(q: torch.Tensor, seqs: list[SeqAttention], cache: KVCache, layer: int
                ) -> torch.Tensor:
    """The attention of :class:`TorchAttentionBackend` one sequence at a time, unpadded, its
    new K/V already in the cache: the tests' check of the padded groups."""
    heads, dim = q.shape[1], q.shape[2]
    out, start = torch.empty_like(q), 0
    for seq in seqs:
        qi = q[start:start + seq.q_len].transpose(0, 1).float()          # [H, q, D]
        k_seq, v_seq = cache.read(layer, seq.table.global_slots(0, seq.kv_len, q.device))
        group = heads // k_seq.shape[1]
        ki = k_seq.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, kv, D]
        vi = v_seq.repeat_interleave(group, dim=1).transpose(0, 1).float()
        mask = seq.dense_mask()
        mask = (causal_mask(seq.q_len, seq.kv_len, q.device) if mask is None
                else mask.to(device=q.device, dtype=torch.bool))
        scores = (qi @ ki.transpose(1, 2)) * dim ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:start + seq.q_len] = (scores.softmax(dim=-1) @ vi).transpose(0, 1).to(q.dtype)
        start += seq.q_len
    return out
