"""KV compaction in one Triton kernel: copy every layer's K and V from slots src to slots dst.

After a tree is verified, the accepted nodes' K/V move down to the slots after
the committed prefix. The torch version (:meth:`splitspec.kv_cache.KVCache.copy_slots`,
the reference) gathers into a temporary and scatters, two advanced-indexing
kernels plus the slot arithmetic; this kernel does it in one launch.

Each program owns one (layer, K or V) plane and one block of the H_kv * D
columns of a slot, and moves that block for every slot pair at once: it loads
all sources into one tile before it stores any, so moves whose sources and
destinations overlap (compaction moves nodes down over each other) are safe,
as in the reference. Planes and column blocks are disjoint between programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # columns (of H_kv * D) a program moves per slot
# The fewest moves a program's tile holds: the move count is a compile-time constant, and a
# verify step moves 1 to depth nodes, so without a floor each new power of two compiled a
# variant while serving (1, 2, 4, 8, ...); with it, every step of a tree up to 16 nodes deep
# takes the one variant the warm-up compiles.
MIN_MOVES = 16


def moves_block(num: int) -> int:
    """The tile's move count for ``num`` moves: a power of two, at least MIN_MOVES."""
    return max(MIN_MOVES, triton.next_power_of_2(num))


# The move count and the slot lists change from step to step. Triton compiles a variant of
# its own for an int argument equal to 1 (a constant) or a multiple of 16, and for a pointer
# 16-byte aligned: not for these, so every step reuses the variant warm-up compiled
# (tests/test_compile_watch.py checks each kernel's on the GPU).
@triton.jit(do_not_specialize=["num_moves"],
            do_not_specialize_on_alignment=["src_slots", "dst_slots"])
def _compact_kernel(data, src_slots, dst_slots, num_moves, num_pages,
                    PAGE: tl.constexpr, WIDTH: tl.constexpr, MOVES: tl.constexpr,
                    BLOCK_COLS: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    moves = tl.arange(0, MOVES)
    active = moves < num_moves
    src = tl.load(src_slots + moves, mask=active, other=0).to(tl.int64)
    dst = tl.load(dst_slots + moves, mask=active, other=0).to(tl.int64)
    layer, kv = plane // 2, plane % 2
    # data is [L, num_pages, 2, PAGE, WIDTH]: element (l, p, c, o, w)
    src_row = ((layer * num_pages + src // PAGE) * 2 + kv) * PAGE + src % PAGE
    dst_row = ((layer * num_pages + dst // PAGE) * 2 + kv) * PAGE + dst % PAGE
    keep = active[:, None] & (cols < WIDTH)[None, :]
    tile = tl.load(data + src_row[:, None] * WIDTH + cols[None, :], mask=keep)
    tl.store(data + dst_row[:, None] * WIDTH + cols[None, :], tile, mask=keep)


def compact_kv(data: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy K/V of global slots src to dst ([N] int64, on data's device) in every layer of
    data ([L, num_pages, 2, page_size, H_kv, D], contiguous)."""
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D")
    if not data.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")
    num = src.numel()
    if num == 0:
        return
    layers, num_pages, _, page, kv_heads, dim = data.shape
    width = kv_heads * dim
    grid = (layers * 2, triton.cdiv(width, BLOCK))
    _compact_kernel[grid](data, src.contiguous(), dst.contiguous(), num, num_pages, PAGE=page,
                          WIDTH=width, MOVES=moves_block(num), BLOCK_COLS=BLOCK)
