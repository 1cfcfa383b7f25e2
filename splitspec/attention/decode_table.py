"""Plain decode attention for the target's CUDA graphs, planned on the device.

splitspec/kernels/paged_decode.py reads each sequence's length and pages from a table
the graph owns ([B, 1 + P] int32: kv_len, then the pages), so a replay needs only that
table copied in with the other inputs: nothing is planned on the host. flashinfer's
decode plan, which it replaces in the graphs, was 0.22 ms of the 0.40 ms of host work
before a batch-1 decode graph's launch on the H200, and its kernel 11.8 against 8.4 µs a
layer (docs/benchmarks.md, bench/bench_decode_attention.py). Eager decode
(splitspec/attention/flashinfer_backend.py) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.kv_cache import KVCache


@dataclass
class DecodeTableMetadata(AttentionMetadata):
    table: torch.Tensor      # [B, 1 + P] int32 on the device: kv_len, then the pages
    splits: int              # blocks per (sequence, KV head)
    part_out: torch.Tensor   # [B, H, splits, D] float32 scratch
    part_lse: torch.Tensor   # [B, H, splits] float32 scratch
    block_n: int             # keys loaded at a time


class DecodeTableAttention(AttentionBackend):
    """One query token per sequence over its paged keys, from the metadata's table."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        raise TypeError("DecodeTableAttention runs graphs whose tables their owner fills")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: DecodeTableMetadata, cache: KVCache) -> torch.Tensor:
        from splitspec.kernels.paged_decode import paged_decode_attention

        cache.write(layer, meta.write_slots, k, v)
        return paged_decode_attention(q, cache.data[layer], meta.table, meta.splits,
                                      meta.part_out, meta.part_lse, meta.block_n)


def splits_for(batch: int, kv_heads: int, processors: int) -> int:
    """Splits per (sequence, KV head) that fill about two waves of ``processors`` blocks, at
    least 1 and at most 32."""
    return max(1, min(32, -(-2 * processors // (batch * kv_heads))))


def block_keys(batch: int) -> int:
    """Keys per block: 32 for one sequence, 64 for more (the faster of each in
    bench_decode_attention on the H200, 8B shape, 512 and 2048 keys)."""
    return 32 if batch == 1 else 64


def fill_decode_table(seqs: list[SeqAttention], page_size: int, table: np.ndarray,
                      slots: np.ndarray) -> None:
    """Write decode rows' lengths and pages into ``table`` ([B, 1 + P] int32, rows beyond a
    sequence's pages left as they were) and the slots of their new tokens into ``slots``
    ([B] int64)."""
    width = table.shape[1] - 1
    for row, seq in enumerate(seqs):
        n = seq.kv_len
        if seq.q_len != 1 or not 0 < n <= min(seq.table.capacity, width * page_size):
            raise ValueError(f"a decode row needs q_len 1 and 0 < kv_len <= "
                             f"{min(seq.table.capacity, width * page_size)} slots reserved, "
                             f"got q_len={seq.q_len} kv_len={n}")
        used = -(-n // page_size)
        pages = seq.table.pages[:used]
        table[row, 0] = n
        table[row, 1:1 + used] = pages
        slots[row] = pages[-1] * page_size + (n - 1) % page_size
