"""Paged attention planned on the device: plain decode in the target's CUDA graphs, and the
committed prefix of a verify pass or a drafting level.

splitspec/kernels/paged_decode.py reads each sequence's length and pages from a table
the graph owns ([B, 1 + P] int32: kv_len, then the pages), so a replay needs only that
table copied in with the other inputs: nothing is planned on the host. flashinfer's
decode plan, which it replaces in the graphs, was 0.22 ms of the 0.40 ms of host work
before a batch-1 decode graph's launch on the H200, and its kernel 11.8 against 8.4 µs a
layer (docs/benchmarks.md, bench/bench_decode_attention.py). Eager decode
(splitspec/attention/flashinfer_backend.py) is unchanged.

:class:`TablePrefix` does the same for the committed prefix of a verify pass (its q rows
per sequence over the committed slots, splitspec/attention/cascade.py) and of the draft's
tree search (draft_service/tree_search.py), which flashinfer's decode wrapper, with each
sequence's pages listed once per row, planned on the host before every replay: its plan
is a table filled here and one copy, and each sequence's keys are read once for all its
rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.cascade import LN2, PrefixAttention, TorchPrefix
from splitspec.attention.flashinfer_backend import AttentionShape, FlashInferBackend
from splitspec.kv_cache import KVCache, PageTable
from splitspec.staging import HostTwin


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


def processors(device: torch.device | str) -> int:
    """The device's streaming multiprocessors (1 off CUDA: the interpreter)."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def scratch_floats(shape: AttentionShape, seqs: int, rows: int, device: torch.device | str) -> int:
    """float32 elements of the kernel's scratch (split outputs and log-sum-exps) and merged
    log-sum-exp for ``seqs`` sequences of ``rows`` rows: what :func:`carve` takes."""
    splits = splits_for(seqs, shape.num_kv_heads, processors(device))
    return seqs * rows * shape.num_heads * (splits * (shape.head_dim + 1) + 1)


def carve(flat: torch.Tensor, shape: AttentionShape, seqs: int, rows: int
          ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split and views of ``flat`` (float32, at least :func:`scratch_floats` elements):
    the scratch [N, H, splits, D] and [N, H, splits] and the merged
    log-sum-exp [N, H] of N = seqs * rows rows. CUDA graphs share one ``flat`` (their
    replays run one at a time, and none reads it after its replay)."""
    splits = splits_for(seqs, shape.num_kv_heads, processors(flat.device))
    n, heads, dim = seqs * rows, shape.num_heads, shape.head_dim
    sizes = (n * heads * splits * dim, n * heads * splits, n * heads)
    if flat.dtype != torch.float32 or flat.numel() < sum(sizes):
        raise ValueError(f"scratch of {flat.numel()} {flat.dtype}: need {sum(sizes)} float32")
    out, lse, merged = flat[:sum(sizes)].split(sizes)
    return (splits, out.view(n, heads, splits, dim), lse.view(n, heads, splits),
            merged.view(n, heads))


def splits_for(batch: int, kv_heads: int, processors: int) -> int:
    """Splits per (sequence, KV head): as many as fit in four waves of ``processors``
    blocks, at least 1 and at most 32. On the H200, 8B shape (132 SMs, 8 KV heads: 32, 16,
    8, 4, 2 splits at batch 1, 4, 8, 16, 32) the best measured split at every batch but 4
    with 512 keys (docs/benchmarks.md, thirteenth part); two waves, before, were 10-16 %
    slower at batch 8 and 16."""
    return max(1, min(32, 4 * processors // (batch * kv_heads)))


def block_keys(batch: int) -> int:
    """Keys per block: 32 for one sequence, 64 for more (the faster of each in
    bench_decode_attention on the H200, 8B shape, 512 and 2048 keys)."""
    return 32 if batch == 1 else 64


def fill_decode_table(seqs: list[SeqAttention], page_size: int, table: np.ndarray,
                      slots: np.ndarray) -> None:
    """Write decode rows' lengths and pages into ``table`` ([B, 1 + P] int32, rows beyond a
    sequence's pages left as they were) and the slots of their new tokens into ``slots``
    ([B] int64)."""
    for seq in seqs:
        if seq.q_len != 1:
            raise ValueError(f"a decode row has one query token, got q_len={seq.q_len}")
    fill_table([seq.table for seq in seqs], [seq.kv_len for seq in seqs], page_size, table)
    for row, seq in enumerate(seqs):
        n = seq.kv_len
        slots[row] = seq.table.pages[(n - 1) // page_size] * page_size + (n - 1) % page_size


def fill_table(tables: list[PageTable], lengths: list[int], page_size: int,
               table: np.ndarray) -> None:
    """Row b of ``table`` ([B, 1 + P] int32): lengths[b], then the pages of tables[b] that
    hold its first lengths[b] slots (the rest of the row left as it was)."""
    width = table.shape[1] - 1
    for row, (pages, n) in enumerate(zip(tables, lengths, strict=True)):
        if not 0 < n <= min(pages.capacity, width * page_size):
            raise ValueError(f"a table row needs 0 < length <= "
                             f"{min(pages.capacity, width * page_size)} slots reserved, got "
                             f"length {n}")
        used = -(-n // page_size)
        table[row, 0] = n
        table[row, 1:1 + used] = pages.pages[:used]


class TablePrefix(PrefixAttention):
    """Each query row over its sequence's first slots, through paged_prefix_attention
    (splitspec/kernels/paged_decode.py): each sequence's keys are loaded once for all its
    rows, and planning is a table of lengths and pages filled on the host and copied.

    With ``seqs`` (a CUDA graph's): exactly that many sequences of ``rows`` rows, at most
    ``max_pages`` pages each; the table and its pinned twin are allocated once here, the
    scratch and log-sum-exp buffer carved from ``scratch`` (:func:`carve`), for the graph's
    replays to read. Without (eager calls): each plan allocates its own for the sequences it
    is given."""

    lse_scale = LN2  # the kernel's log-sum-exp is base 2

    def __init__(self, shape: AttentionShape, device: torch.device | str, seqs: int = 0,
                 rows: int = 0, max_pages: int = 0, scratch: torch.Tensor | None = None
                 ) -> None:
        self.shape, self.device = shape, torch.device(device)
        self._fixed = seqs > 0
        self._twin: HostTwin | None = None
        if self._fixed:
            self.table = torch.zeros(seqs, 1 + max_pages, dtype=torch.int32, device=device)
            self._twin = HostTwin(self.table)
            self._size(seqs, rows, scratch)

    def _size(self, seqs: int, rows: int, scratch: torch.Tensor | None = None) -> None:
        """The kernel's split, block and buffers for ``seqs`` sequences of ``rows`` rows."""
        if scratch is None:
            scratch = torch.empty(scratch_floats(self.shape, seqs, rows, self.device),
                                  dtype=torch.float32, device=self.device)
        self.rows, self.block_n = rows, block_keys(seqs)
        self.splits, self._part_out, self._part_lse, self._lse = carve(scratch, self.shape,
                                                                        seqs, rows)

    def plan(self, tables: list[PageTable], lengths: list[int], rows_per_seq: int,
             device: torch.device) -> None:
        page = self.shape.page_size
        if not self._fixed:
            table = np.zeros((len(tables), 1 + max(-(-n // page) for n in lengths)), np.int32)
            fill_table(tables, lengths, page, table)
            self.table = torch.from_numpy(table).to(self.device)
            self._size(len(tables), rows_per_seq)
            return
        if len(tables) != self.table.shape[0] or rows_per_seq != self.rows:
            raise ValueError(f"a table prefix of {self.table.shape[0]} sequences of "
                             f"{self.rows} rows, planned for {len(tables)} of {rows_per_seq}")
        self._twin.wait()
        fill_table(tables, lengths, page, self._twin.array)
        self._twin.send()

    def attend(self, layer: int, q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        from splitspec.kernels.paged_decode import paged_prefix_attention

        return paged_prefix_attention(q.contiguous(), cache.data[layer], self.table, self.rows,
                                      self.splits, self._part_out, self._part_lse,
                                      self.block_n, self._lse)


def prefix_attention_for(backend: AttentionBackend) -> PrefixAttention:
    """The table prefix on a flashinfer backend's device (CUDA), else the torch reference."""
    if isinstance(backend, FlashInferBackend):
        return TablePrefix(backend.shape, backend.device)
    return TorchPrefix()
