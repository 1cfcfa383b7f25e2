"""Decode attention over a paged KV cache with no host planning: one query token per
sequence, its pages and length read on the device: the target's decode graphs
(splitspec/attention/decode_table.py; bench/bench_decode_attention.py measures it against
flashinfer's decode).

flashinfer's paged decode is planned on the host before every call (0.22 ms of a
0.40 ms pre-launch at batch 1 on the H200, the largest host cost of a decode step:
docs/benchmarks.md), because its split of the keys among thread blocks depends on the
lengths. Here the split is fixed in the launch (``splits`` blocks per sequence and KV
head) and each block works out its share of the sequence's keys from the length in
``table``: the graph is the same for any length, so the step's inputs are one copy.

Two kernels. The first: program (sequence, KV head, split) runs the query heads of the
group, of each of the sequence's ``rows`` query rows, over its share of the keys in blocks
of ``BLOCK_N`` (online softmax, base 2), writing its partial output and log-sum-exp (an
empty share writes -inf). The second: program (row, head) merges the splits by their
log-sum-exp, and can write the merged log-sum-exp too. Rows > 1 is the committed prefix
of a verify step or a drafting level (:func:`paged_prefix_attention`): each sequence's rows
share its keys, loaded once for all of them, or once for each block of MAX_GROUP_ROWS
(row, head) pairs when there are more (a large tree's; axis 2 of the grid is then the
pair's block and the split). Reference: :func:`paged_decode_reference`
(tests/kernel_cases.py compares them).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_GROUP_ROWS = 16  # tl.dot's smallest M: a GQA group of fewer heads is padded to it
MAX_GROUP_ROWS = 64  # a program's most (row, head) pairs: more (a large tree's rows) are
# split into blocks of this many, each loading the keys again
# Triton's interpreter multiplies 16-bit floats wrongly in tl.dot, and cannot loop to a
# bound it loaded: there every dot is float32 and the key loop runs a fixed count.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _key_block(query, cache, table, first, end, b, kv_head, top, total, acc, c_page, c_kv,
               c_slot, c_head, t_seq, sm_scale_log2, PAGE: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One block of keys [first, first + BLOCK_N) (those below ``end``) into the online
    softmax of the group's rows: the new (top, total, acc)."""
    d = tl.arange(0, D)
    t = first + tl.arange(0, BLOCK_N)
    valid = t < end
    page = tl.load(table + b * t_seq + 1 + t // PAGE, mask=valid, other=0).to(tl.int64)
    at = page * c_page + (t % PAGE) * c_slot + kv_head * c_head
    key = tl.load(cache + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    value = tl.load(cache + c_kv + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if IEEE:
        scores = tl.dot(query, tl.trans(key.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(query, tl.trans(key))
    scores = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a block that is all masked
    weights = tl.exp2(scores - safe[:, None])
    shrink = tl.exp2(top - safe)
    total = total * shrink + tl.sum(weights, axis=1)
    if IEEE:
        acc = acc * shrink[:, None] + tl.dot(weights, value.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * shrink[:, None] + tl.dot(weights.to(value.dtype), value)
    return new_top, total, acc


# The table's width (the batch's longest sequence in pages), the splits and the rows a
# sequence change from call to call, and the log-sum-exp scratch's strides with the splits:
# no variant of their own for 1 or multiples of 16 (kv_compact.py says why).
@triton.jit(do_not_specialize=["t_seq", "l_seq", "l_head", "splits", "rows"])
def _split_kernel(q, cache, table, part_out, part_lse,
                  q_seq, q_head, c_page, c_kv, c_slot, c_head, t_seq, p_seq, p_head, p_split,
                  l_seq, l_head, splits, group, rows, sm_scale_log2,
                  PAGE: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, MAX_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
                  BLOCKED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    if not BLOCKED:
        s = tl.program_id(2)
        first_m = 0
    else:  # axis 2 is (row block, split)
        s = tl.program_id(2) % splits
        first_m = (tl.program_id(2) // splits) * BLOCK_G
    kv_len = tl.load(table + b * t_seq)
    # Page-aligned shares, so a block of keys crosses as few pages as it can.
    share = tl.cdiv(tl.cdiv(kv_len, splits), PAGE) * PAGE
    start = s * share
    end = tl.minimum(start + share, kv_len)
    m = first_m + tl.arange(0, BLOCK_G)  # row r's head kv_head * group + g: m = r * group + g
    d = tl.arange(0, D)
    heads = kv_head * group + m % group
    row = b * rows + m // group
    has_g = m < rows * group
    query = tl.load(q + row[:, None] * q_seq + heads[:, None] * q_head + d[None, :],
                    mask=has_g[:, None], other=0.0)
    if IEEE:
        query = query.to(tl.float32)
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    if MAX_BLOCKS:  # the interpreter cannot loop to a loaded bound: a fixed count, masked
        for i in range(MAX_BLOCKS):
            top, total, acc = _key_block(query, cache, table, start + i * BLOCK_N, end, b,
                                         kv_head, top, total, acc, c_page, c_kv, c_slot, c_head,
                                         t_seq, sm_scale_log2, PAGE, D, BLOCK_N, IEEE)
    else:
        for first in range(start, end, BLOCK_N):
            top, total, acc = _key_block(query, cache, table, first, end, b, kv_head, top,
                                         total, acc, c_page, c_kv, c_slot, c_head, t_seq,
                                         sm_scale_log2, PAGE, D, BLOCK_N, IEEE)
    seen = total > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, top + tl.log2(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(part_out + row[:, None] * p_seq + heads[:, None] * p_head + s * p_split
             + d[None, :], out, mask=has_g[:, None])
    tl.store(part_lse + row * l_seq + heads * l_head + s, lse, mask=has_g)


@triton.jit(do_not_specialize=["l_seq", "l_head", "splits"])  # as above
def _merge_kernel(part_out, part_lse, out, lse_out, p_seq, p_head, p_split, l_seq, l_head,
                  o_seq, o_head, s_row, s_head, splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                  WITH_LSE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    has_s = s < splits
    lse = tl.load(part_lse + b * l_seq + h * l_head + s, mask=has_s, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.exp2(lse - top)  # the first split is never empty
    parts = tl.load(part_out + b * p_seq + h * p_head + s[:, None] * p_split + d[None, :],
                    mask=has_s[:, None], other=0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(weights[:, None] * parts, axis=0) / total
    tl.store(out + b * o_seq + h * o_head + d, merged.to(out.dtype.element_ty))
    if WITH_LSE:
        tl.store(lse_out + b * s_row + h * s_head, top + tl.log2(total))


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                           splits: int, part_out: torch.Tensor | None = None,
                           part_lse: torch.Tensor | None = None, block_n: int = 32
                           ) -> torch.Tensor:
    """q [B, H, D] (one token per sequence); cache one layer's [pages, 2, page, H_kv, D]
    (K at 0, V at 1: splitspec/kv_cache.py); table [B, 1 + P] int32: each sequence's number
    of keys (at least 1), then its pages in order. ``part_out`` [B, H, splits, D] and
    ``part_lse`` [B, H, splits] float32 are scratch (allocated when None; a CUDA graph
    passes its own); ``block_n`` keys are loaded at a time (a power of 2, at least 16).
    Returns [B, H, D] in q's dtype."""
    return _attend(q, cache, table, 1, splits, part_out, part_lse, block_n, None)


def paged_prefix_attention(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: int,
                           splits: int, part_out: torch.Tensor | None = None,
                           part_lse: torch.Tensor | None = None, block_n: int = 32,
                           lse: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`paged_decode_attention` for ``rows`` query rows per sequence, all over its
    keys: q [B * rows, H, D], sequence b's rows at b * rows ...; the scratch [B * rows, H,
    splits, D] and [B * rows, H, splits]. Returns the output [B * rows, H, D] and the
    log-sum-exp [B * rows, H] float32, in base 2 (written into ``lse`` when given)."""
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32:
        raise ValueError(f"paged_prefix_attention: lse {tuple(lse.shape)} {lse.dtype}, need "
                         f"float32 {tuple(q.shape[:2])}")
    return _attend(q, cache, table, rows, splits, part_out, part_lse, block_n, lse), lse


def _attend(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: int, splits: int,
            part_out: torch.Tensor | None, part_lse: torch.Tensor | None, block_n: int,
            lse: torch.Tensor | None) -> torch.Tensor:
    total_rows, heads, dim = q.shape
    _, two, page, kv_heads, cache_dim = cache.shape
    if (two != 2 or cache_dim != dim or heads % kv_heads or table.dim() != 2 or rows < 1
            or table.shape[0] * rows != total_rows or table.dtype != torch.int32 or splits < 1
            or q.stride(2) != 1 or cache.stride(4) != 1 or dim & (dim - 1)
            or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"paged attention: inconsistent inputs: q {tuple(q.shape)}, "
                         f"cache {tuple(cache.shape)}, table {tuple(table.shape)} "
                         f"{table.dtype}, {rows} rows a sequence, splits {splits}, block_n "
                         f"{block_n} (a table row per sequence; head dim and block_n powers "
                         "of 2)")
    if part_out is None:
        part_out = torch.empty(total_rows, heads, splits, dim, dtype=torch.float32,
                               device=q.device)
    if part_lse is None:
        part_lse = torch.empty(total_rows, heads, splits, dtype=torch.float32, device=q.device)
    if (tuple(part_out.shape) != (total_rows, heads, splits, dim) or part_out.stride(3) != 1
            or tuple(part_lse.shape) != (total_rows, heads, splits)
            or {part_out.dtype, part_lse.dtype} != {torch.float32}):
        raise ValueError(f"paged attention: scratch {tuple(part_out.shape)} "
                         f"{part_out.dtype} and {tuple(part_lse.shape)} {part_lse.dtype}, "
                         f"need float32 [{total_rows}, {heads}, {splits}, {dim}] and "
                         f"[{total_rows}, {heads}, {splits}]")
    group = heads // kv_heads
    table = table.contiguous()
    most_keys = page * (table.shape[1] - 1)  # the interpreter's fixed count covers a full table
    share = -(-most_keys // splits)
    block_g = min(MAX_GROUP_ROWS, max(MIN_GROUP_ROWS, triton.next_power_of_2(rows * group)))
    row_blocks = -(-rows * group // block_g)
    _split_kernel[(table.shape[0], kv_heads, splits * row_blocks)](
        q, cache, table, part_out, part_lse,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        cache.stride(3), table.stride(0), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1), splits, group, rows,
        dim ** -0.5 * LOG2E, PAGE=page, D=dim, BLOCK_G=block_g, BLOCK_N=block_n,
        MAX_BLOCKS=-(-(-(-share // page) * page) // block_n) if INTERPRETED else 0,
        IEEE=INTERPRETED or q.dtype == torch.float32,
        BLOCKED=row_blocks > 1)  # a bool, not the count: one compiled variant for any count
    out = torch.empty_like(q)
    _merge_kernel[(total_rows, heads)](
        part_out, part_lse, out, part_lse if lse is None else lse, part_out.stride(0),
        part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        0 if lse is None else lse.stride(1), splits, D=dim,
        BLOCK_S=triton.next_power_of_2(splits), WITH_LSE=lse is not None)
    return out


def paged_decode_reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                           rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention in torch, float32, one query row at a time: the output in q's dtype
    and the log-sum-exp in base 2 (float32)."""
    page, kv_heads = cache.shape[2], cache.shape[3]
    heads, dim = q.shape[1], q.shape[2]
    outs, lses = [], []
    for i in range(q.shape[0]):
        n = int(table[i // rows, 0])
        pages = table[i // rows, 1:1 + -(-n // page)].long()
        keys = cache[pages, 0].reshape(-1, kv_heads, dim)[:n].float()    # [n, H_kv, D]
        values = cache[pages, 1].reshape(-1, kv_heads, dim)[:n].float()
        query = q[i].float().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("hgd,nhd->hgn", query, keys) / math.sqrt(dim)
        outs.append(torch.einsum("hgn,nhd->hgd", scores.softmax(-1), values).reshape(heads, dim))
        lses.append(torch.logsumexp(scores, -1).reshape(heads) * LOG2E)
    return torch.stack(outs).to(q.dtype), torch.stack(lses)
