"""CUDA graphs of the target's plain decode step, one per batch-size bucket.

A plain decode step (every sequence brings one token, causal, logits for
every token) is the same sequence of kernels at every step of a given batch
size, so it is captured once per bucket during the ``capture_cuda_graphs``
init step and replayed. A batch of n sequences runs the graph of the smallest
bucket >= n; the rows beyond n are padding: token 0 at position 0, writing its
K/V to a scratch page no sequence owns and attending to that page alone.
Batches larger than the largest bucket, prompts and trees run eagerly.

Before each replay only host work happens outside the graph: the inputs are
copied into the graph's static buffers and flashinfer's decode wrapper (built
in CUDA-graph mode, with buffers of its own) is planned for the real pages.
The outputs are the graph's static buffers, cloned before they are returned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from splitspec.attention.base import SeqAttention
from splitspec.attention.flashinfer_backend import (
    AttentionShape,
    FlashInferMetadata,
    PagedLayout,
    import_flashinfer,
)
from splitspec.kv_cache import KVCache, PageTable
from splitspec.model.layers import AttentionContext
from splitspec.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a server of max_batch running sequences needs (the last one covers it)."""
    chosen = tuple(b for b in buckets if b < max_batch)
    return (*chosen, max_batch) if max_batch <= buckets[-1] else buckets


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: Any                 # flashinfer decode wrapper in CUDA-graph mode
    ids: torch.Tensor            # [b] static inputs
    positions: torch.Tensor
    write_slots: torch.Tensor
    logits: torch.Tensor         # [b, V] static outputs
    aux: torch.Tensor | None     # [b, k * H]


class DecodeGraphs:
    """The captured decode graphs of one model, for every bucket and capture variant."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, shape: AttentionShape,
                 scratch_page: int, max_pages_per_seq: int, device: torch.device | str) -> None:
        self.model, self.cache, self.shape = model, cache, shape
        self.scratch_page, self.max_pages_per_seq = scratch_page, max_pages_per_seq
        self.device = device
        self.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, tuple[int, ...]], _Graph] = {}
        self.buckets: tuple[int, ...] = ()

    def capture(self, buckets: tuple[int, ...], variants: tuple[tuple[int, ...], ...]) -> float:
        """Capture every bucket (largest first, so the smaller reuse its memory) for every
        capture variant (the layer inputs a draft may ask for); returns the seconds taken."""
        started = time.perf_counter()
        for capture in variants:
            for size in sorted(buckets, reverse=True):
                self.graphs[size, capture] = self._capture(size, capture)
        self.buckets = tuple(sorted(buckets))
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def bucket_for(self, seqs: list[SeqAttention], capture: tuple[int, ...]) -> int | None:
        """The bucket that runs this batch as a graph, or None (eager)."""
        if not self.buckets or len(seqs) > self.buckets[-1]:
            return None
        if any(seq.q_len != 1 or seq.mask is not None for seq in seqs):
            return None
        size = next(b for b in self.buckets if b >= len(seqs))
        return size if (size, capture) in self.graphs else None

    def run(self, size: int, ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqAttention],
            capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the bucket's graph for these sequences: (logits [n, V], aux [n, k * H] or None)."""
        g = self.graphs[size, capture]
        n = len(seqs)
        layout = PagedLayout.of([*seqs, *self._padding(size - n)], self.shape.page_size)
        self._plan(g.wrapper, layout)
        g.ids[:n].copy_(ids, non_blocking=True)
        g.ids[n:].zero_()
        g.positions[:n].copy_(positions, non_blocking=True)
        g.positions[n:].zero_()
        g.write_slots.copy_(layout.write_slots, non_blocking=True)
        g.graph.replay()
        return g.logits[:n].clone(), None if g.aux is None else g.aux[:n].clone()

    def _padding(self, count: int) -> list[SeqAttention]:
        table = PageTable(self.shape.page_size, [self.scratch_page], 1)
        return [SeqAttention(table, kv_len=1, q_len=1)] * count

    def _plan(self, wrapper: Any, layout: PagedLayout) -> None:
        shape = self.shape
        wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len, shape.num_heads,
                     shape.num_kv_heads, shape.head_dim, shape.page_size, pos_encoding_mode="NONE",
                     q_data_type=shape.dtype, kv_data_type=shape.dtype)

    def _capture(self, size: int, capture: tuple[int, ...]) -> _Graph:
        flashinfer = import_flashinfer()
        device = self.device
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.shape.use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(size * self.max_pages_per_seq, dtype=torch.int32,
                                                device=device),
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device))
        layout = PagedLayout.of(self._padding(size), self.shape.page_size)
        self._plan(wrapper, layout)
        ids = torch.zeros(size, dtype=torch.int64, device=device)
        positions = torch.zeros(size, dtype=torch.int64, device=device)
        write_slots = layout.write_slots.to(device)
        ctx = AttentionContext(_Planned(), FlashInferMetadata(write_slots, wrapper), self.cache)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = self.model(ids, positions, ctx, capture)
            return self.model.compute_logits(out.hidden), out.aux

        with torch.inference_mode():
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up (lazy initialisation must not happen in capture)
                    forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, aux = forward()
        return _Graph(graph, wrapper, ids, positions, write_slots, logits, aux)


class _Planned:
    """The attention backend seen by a captured graph: the wrapper was planned outside it."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: FlashInferMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        return meta.wrapper.run(q.contiguous(), cache.data[layer])
