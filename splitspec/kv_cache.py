"""The paged KV cache: page bookkeeping (no tensors) and the tensor pool.

Layout, as flashinfer expects it (NHD): per layer ``[num_pages, 2, page_size,
num_kv_heads, head_dim]`` with K at index 0 and V at index 1; all layers live in
one tensor ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]``.

A sequence owns a :class:`PageTable`: its pages in order, and how many logical
slots it uses. Logical slot s of a sequence lives at global slot
``pages[s // page_size] * page_size + s % page_size``. Tree nodes are written to
fresh logical slots after the committed prefix; after verification the accepted
path is copied down to contiguous slots (:meth:`KVCache.copy_slots`) and the
table is truncated.

A target that serves an EAGLE-3 draft also keeps, per slot, the features it
captured for that slot's token (:meth:`KVCache.hold_features`): written by the
forward that writes the slot's K/V (in a CUDA graph as in eager steps, with no
host work per sequence), moved with them by the compaction, read when the draft
catches up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from splitspec.kernels import HAS_TRITON


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for."""


class PagePool:
    """Free list of page ids. Bookkeeping only: never touches a tensor."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise OutOfPages(f"asked for {num} pages, {len(self._free)} of {self.num_pages} free")
        pages = self._free[len(self._free) - num:][::-1]
        del self._free[len(self._free) - num:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class PageTable:
    """The pages of one sequence and the number of logical slots in use."""

    page_size: int
    pages: list[int] = field(default_factory=list)
    num_slots: int = 0

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_slots: int) -> int:
        """Extra pages needed to hold num_slots logical slots in all."""
        want = -(-num_slots // self.page_size)
        return max(0, want - len(self.pages))

    def reserve(self, pool: PagePool, num_slots: int) -> None:
        """Make room for num_slots logical slots in all (allocating from pool)."""
        need = self.pages_needed(num_slots)
        if need:
            self.pages.extend(pool.allocate(need))

    def release(self, pool: PagePool) -> None:
        pool.free(self.pages)
        self.pages = []
        self.num_slots = 0

    def slots(self, positions: Iterable[int]) -> list[int]:
        """Global slot ids of the given logical slots, on the host (no tensor: for a few
        slots a step, where building tensors costs more than the arithmetic)."""
        page, pages, out = self.page_size, self.pages, []
        for pos in positions:
            if not 0 <= pos < len(pages) * page:
                raise IndexError(f"logical slot {pos} asked, {len(pages) * page} reserved")
            out.append(pages[pos // page] * page + pos % page)
        return out

    def global_slots(self, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global slot ids of logical slots [start, end) as int64."""
        if end > self.capacity:
            raise IndexError(f"logical slots up to {end} asked, {self.capacity} reserved")
        logical = torch.arange(start, end, dtype=torch.int64)
        pages = torch.tensor(self.pages, dtype=torch.int64)
        return (pages[logical // self.page_size] * self.page_size
                + logical % self.page_size).to(device)


def memory_shortfall(need: int, device: torch.device | str, what: str) -> str:
    """Why ``need`` bytes of ``what`` will not fit on ``device`` ("" when they do, or when the
    device is not a GPU): the start-up steps that allocate a cache fail with it, before
    the allocation would."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    free, _ = torch.cuda.mem_get_info(device)
    if need <= free:
        return ""
    return f"{what} needs {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free"


class KVCache:
    """The preallocated K/V tensor pool of one process (all layers)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # data: [L, num_pages, 2, page_size, H_kv, D]
        self.data = torch.zeros(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        # On CUDA the store and the compaction are one Triton kernel each (chosen once here,
        # not on every layer of every step); elsewhere the torch forms below run.
        self._store_kv = self._compact_kv = None
        if self.data.is_cuda and HAS_TRITON:
            from splitspec.kernels.fused_ops import store_kv
            from splitspec.kernels.kv_compact import compact_kv

            self._store_kv, self._compact_kv = store_kv, compact_kv
        self.features: torch.Tensor | None = None  # [num_pages * page_size, width] when held

    def hold_features(self, width: int, dtype: torch.dtype) -> int:
        """Keep ``width`` captured features per slot from now on (zeros until written);
        returns their bytes."""
        self.features = torch.zeros(self.num_pages * self.page_size, width, dtype=dtype,
                                    device=self.data.device)
        return self.features.numel() * self.features.element_size()

    def write_features(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the features ``rows`` ([T, width]) of the tokens at global ``slots`` [T]; nothing
        when this cache keeps none (a rank other than 0, a target without an EAGLE-3 draft)."""
        if self.features is not None:
            self.features.index_copy_(0, slots, rows.to(self.features.dtype))

    @staticmethod
    def bytes_needed(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_pages * 2 * page_size * num_kv_heads * head_dim * itemsize

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([S, H_kv, D] each) of one layer at global slots [S]."""
        pool = self.data[layer]
        pages, offsets = slots // self.page_size, slots % self.page_size
        return pool[pages, 0, offsets], pool[pages, 1, offsets]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, H_kv, D]) at global slots [T]."""
        if self._store_kv is not None:
            self._store_kv(self.data[layer], slots, k, v)
            return
        pool = self.data[layer]
        pages, offsets = slots // self.page_size, slots % self.page_size
        pool[pages, 0, offsets] = k.to(pool.dtype)
        pool[pages, 1, offsets] = v.to(pool.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V, and the features when held, from global slots src to dst
        (same length).

        On CUDA one Triton kernel does the K/V (splitspec/kernels/kv_compact.py); elsewhere
        torch does. Both read a move's source before any later move writes it, so moves down
        over each other's sources in order (an accepted path's) are safe. The kernel moves
        them in chunks (``kv_compact.CHUNK``), so no move may read a slot that a move of an
        earlier chunk writes (its module says why a step's compaction never does).
        """
        if self._compact_kv is not None:
            self._compact_kv(self.data, src, dst)
        else:
            self.copy_slots_torch(src, dst)
        if self.features is not None:
            self.features.index_copy_(0, dst, self.features.index_select(0, src))

    def copy_slots_torch(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """:meth:`copy_slots` in plain torch: the reference of the Triton kernel."""
        src_pages, src_off = src // self.page_size, src % self.page_size
        dst_pages, dst_off = dst // self.page_size, dst % self.page_size
        moved = self.data[:, src_pages, :, src_off].clone()  # [N, L, 2, H_kv, D] after advanced indexing
        self.data[:, dst_pages, :, dst_off] = moved
