"""KV compaction in one Triton kernel: copy every layer's K and V from slots src to slots dst.

After a tree is verified, the accepted nodes' K/V move down to the slots after
the committed prefix. The torch version (:meth:`splitspec.kv_cache.KVCache.copy_slots`,
the reference) gathers into a temporary and scatters, two advanced-indexing
kernels plus the slot arithmetic; this kernel does it in one launch.

Each program owns one (layer, K or V) plane and one block of the H_kv * D
columns of a slot, and moves that block for every slot pair, CHUNK moves at a time
in the order given: it loads a chunk's sources into one tile, waits for all its
threads (a barrier), then stores the tile. So moves whose sources and destinations
overlap within a chunk are safe, as in the reference, and across chunks the result
is the reference's as long as no move reads a slot that a move of an earlier chunk
wrote. An engine step's compaction lists each sequence's accepted path in path
order, every destination below its sequence's later sources, and sequences own
distinct pages, so a whole batch's moves go in one launch (target_service/engine.py,
Engine._compact). Planes and column blocks are disjoint between programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # columns (of H_kv * D) a program moves per slot
# Moves a program's tile holds. The tile's size is a compile-time constant and the move count
# is not: a step moves anything from 1 node to every sequence's accepted path (hundreds at 64
# streams), and one variant, compiled at warm-up, loops over them in chunks. Before, the tile
# held all the moves, and a batch's first step that moved more than 16 compiled a variant
# while serving (docs/benchmarks.md, twenty-second part).
CHUNK = 16


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
    layer, kv = plane // 2, plane % 2
    for start in range(0, num_moves, MOVES):
        moves = start + tl.arange(0, MOVES)
        active = moves < num_moves
        src = tl.load(src_slots + moves, mask=active, other=0).to(tl.int64)
        dst = tl.load(dst_slots + moves, mask=active, other=0).to(tl.int64)
        # data is [L, num_pages, 2, PAGE, WIDTH]: element (l, p, c, o, w)
        src_row = ((layer * num_pages + src // PAGE) * 2 + kv) * PAGE + src % PAGE
        dst_row = ((layer * num_pages + dst // PAGE) * 2 + kv) * PAGE + dst % PAGE
        keep = active[:, None] & (cols < WIDTH)[None, :]
        tile = tl.load(data + src_row[:, None] * WIDTH + cols[None, :], mask=keep)
        # every thread's loads before any thread's stores: a move's destination may be the
        # source of another in the chunk, held by another warp
        tl.debug_barrier()
        tl.store(data + dst_row[:, None] * WIDTH + cols[None, :], tile, mask=keep)


def compact_kv(data: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy K/V of global slots src to dst ([N] int64, on data's device) in every layer of
    data ([L, num_pages, 2, page_size, H_kv, D], contiguous), in chunks of CHUNK moves: no
    move may read a slot that a move of an earlier chunk writes (the module's docstring)."""
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
                          WIDTH=width, MOVES=CHUNK, BLOCK_COLS=BLOCK)
