"""Paged attention through flashinfer (CUDA; bfloat16 or float16 K/V).

Per forward pass :meth:`FlashInferBackend.plan` picks one kernel for the batch:

- every sequence brings one token under the causal mask (plain decode):
  flashinfer's paged decode;
- otherwise (prompts, trees, or a mix): flashinfer's paged prefill, causal
  when no sequence has a mask, else with FA2's custom mask in which every
  sequence's [q_len, kv_len] mask is spelled out on the host (a verify tree's
  too: the CUDA graphs of verification use splitspec/attention/cascade.py
  instead, which never builds it).

The cache layout is already flashinfer's (NHD, K at index 0 and V at 1 of each
page; see splitspec/kv_cache.py), so a layer's cache is passed as it is. New
K/V are written with :meth:`KVCache.write` at the slots ``plan`` computed.
:class:`PagedLayout` holds the page lists flashinfer wants (its write slots come from
``splitspec.attention.base.new_token_slots``, which the CUDA graphs use alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from splitspec.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SeqAttention,
    causal_mask,
    new_token_slots,
)
from splitspec.kv_cache import KVCache, PageTable

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-k scratch size


@dataclass(frozen=True)
class AttentionShape:
    """What a backend needs to know of the model to plan: this rank's heads, the pages."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def use_tensor_cores(self) -> bool:
        """flashinfer's advice: the prefill-style decode kernel pays from GQA groups of 4."""
        return self.num_heads // self.num_kv_heads >= 4


def import_flashinfer() -> Any:
    """The flashinfer module, or ImportError saying how to get it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError("--attention-backend flashinfer needs the flashinfer-python package "
                          "(pip install flashinfer-python); use --attention-backend torch "
                          "without it") from exc
    return flashinfer


@dataclass
class PagedLayout:
    """A batch's pages in flashinfer's form (host int32 tensors) and its new tokens' slots."""

    qo_indptr: torch.Tensor      # [B + 1] query token ranges
    kv_indptr: torch.Tensor      # [B + 1] ranges of kv_indices per sequence
    kv_indices: torch.Tensor     # pages of every sequence, in logical order
    last_page_len: torch.Tensor  # [B] slots used in each sequence's last page
    write_slots: torch.Tensor    # [T] int64 global slots of the new tokens, in query order

    @classmethod
    def of(cls, seqs: list[SeqAttention], page_size: int) -> PagedLayout:
        slots = new_token_slots(seqs)  # (and the shapes checked)
        qo, kv, indices, last = [0], [0], [], []
        for seq in seqs:
            used = -(-seq.kv_len // page_size)
            indices.extend(seq.table.pages[:used])
            qo.append(qo[-1] + seq.q_len)
            kv.append(kv[-1] + used)
            last.append(seq.kv_len - (used - 1) * page_size)
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        return cls(as_int32(qo), as_int32(kv), as_int32(indices), as_int32(last),
                   torch.tensor(slots, dtype=torch.int64))


@dataclass
class FlashInferMetadata(AttentionMetadata):
    wrapper: Any = None  # the planned flashinfer wrapper whose run() every layer calls


class PlannedAttention(AttentionBackend):
    """Runs passes whose flashinfer wrapper was planned by its owner (a CUDA graph's
    wrapper is planned outside the graph, before each replay)."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> FlashInferMetadata:
        raise TypeError("PlannedAttention runs wrappers planned elsewhere; it does not plan")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        return meta.wrapper.run(q.contiguous(), cache.data[layer])


class FlashInferBackend(PlannedAttention):
    def __init__(self, shape: AttentionShape, device: torch.device | str) -> None:
        if shape.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"flashinfer attention needs bfloat16 or float16, not {shape.dtype}; "
                             "use --dtype bfloat16 or --attention-backend torch")
        if not str(device).startswith("cuda"):
            raise ValueError(f"flashinfer attention runs on CUDA devices, not {device}")
        flashinfer = import_flashinfer()
        self.shape = shape
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=shape.use_tensor_cores)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Custom masks need flashinfer's FA2 kernels (its SM90 ones take no custom mask).
        self._masked = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                      backend="fa2")

    def compile_kernels(self, masked: bool) -> float:
        """Run each kernel this backend will use once (decode, causal prefill and, when
        ``masked``, tree-mask prefill) on a scratch cache, so that flashinfer compiles them
        now (minutes on first use on a machine) and not in the first request; returns
        the seconds taken."""
        started = time.perf_counter()
        shape, page = self.shape, self.shape.page_size
        scratch = KVCache(1, 2, page, shape.num_kv_heads, shape.head_dim, shape.dtype, self.device)
        table = PageTable(page, [0, 1], 2)
        batches = [[SeqAttention(table, 2, 1)], [SeqAttention(table, 2, 2)]]
        if masked:
            batches.append([SeqAttention(table, 2, 2, torch.ones(2, 2, dtype=torch.bool))])
        for seqs in batches:
            tokens = sum(seq.q_len for seq in seqs)
            q = torch.zeros(tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype,
                            device=self.device)
            kv = torch.zeros(tokens, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype,
                             device=self.device)
            self.forward(0, q, kv, kv, self.plan(seqs, self.device), scratch)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> FlashInferMetadata:
        shape = self.shape
        layout = PagedLayout.of(seqs, shape.page_size)
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
        types = {"q_data_type": shape.dtype, "kv_data_type": shape.dtype}
        if all(seq.q_len == 1 and seq.causal for seq in seqs):
            self._decode.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len, *heads,
                              pos_encoding_mode="NONE", **types)
            wrapper = self._decode
        else:
            mask = None if all(seq.causal for seq in seqs) else flat_mask(seqs, device)
            wrapper = self._prefill if mask is None else self._masked
            wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices,
                         layout.last_page_len, *heads, custom_mask=mask, causal=mask is None,
                         **types)
        return FlashInferMetadata(layout.write_slots.to(device, non_blocking=True), wrapper)


def flat_mask(seqs: list[SeqAttention], device: torch.device | str) -> torch.Tensor:
    """Every sequence's [q_len, kv_len] mask (causal where it has none), flattened in order:
    flashinfer's custom-mask layout."""
    return torch.cat([_mask_of(seq).reshape(-1) for seq in seqs]).to(device)


def _mask_of(seq: SeqAttention) -> torch.Tensor:
    mask = seq.dense_mask()
    return causal_mask(seq.q_len, seq.kv_len, "cpu") if mask is None else mask.to(
        device="cpu", dtype=torch.bool)
