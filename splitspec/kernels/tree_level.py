"""One level of the draft's top-k tree search after its top k, in one Triton kernel.

After each level's forward and top k (draft_service/tree_search.py), the search turns the
frontier's children into candidates and picks the next frontier: draft ids to target ids,
each child's score (its parent's plus its log-probability, in float64), the candidates'
columns of the packed output, the k best children (sorted, ties in candidate order), and
for them their parents' states and rows of the ancestor table with their own column set.
In torch that is about fifteen small kernels a level, and with the final concatenations
some sixty to seventy of a 5-level draft graph's roughly two hundred kernels: on the H200,
kernels of a microsecond or two each, between the head's projections. Here it is one
launch a level: the 8B draft graph 4.8 % shorter, the built-in pair's 25 %
(docs/benchmarks.md, twenty-fourth part). A program per sequence and next-frontier slot:
each ranks the level's candidates and copies one slot's parent state, so the copies of
the k slots run side by side (one program a sequence took 10.4 us a level at the 8B shape,
its four 8 KiB state copies one after another).

:func:`splitspec.kernels.tree_level_torch` is the reference (and the CPU path), with the
contract both keep; :func:`tree_level` is the kernel behind the same signature. Every
integer argument is left unspecialised and the level's kind (the root's, whether it picks
a next frontier) is a runtime value, so one variant serves every tree shape of up to 16
candidates a level (topk 1 to 4) for a model's dtype; wider trees take 64, 256 or 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitspec.kernels import Frontier, check_level

STATES_BLOCK = 512  # state columns a copy step moves
SEEN_BLOCK = 64     # ancestor-table columns a copy step moves
WARPS = 2


@triton.jit(do_not_specialize=["lp_row", "ids_row", "plane", "width", "col", "states_row",
                               "X", "T", "eye_col", "F", "K", "root", "select"])
def _level_kernel(lp, lp_row, ids, ids_row, d2t, front_score, front_cand,
                  packed, plane, width, col, states, states_row, X, allowed, T, eye_col,
                  next_score, next_tok, next_cand, next_states, next_allowed,
                  F, K, root, select, D2T: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_X: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    mine = tl.program_id(1)  # the next frontier's slot this program fills (0 on a last level)
    i = tl.arange(0, BLOCK_C)
    real = i < F * K
    node = i // K   # the frontier row each candidate descends from
    lp_i = tl.load(lp + (b * F + node) * lp_row + i % K, mask=real, other=float("-inf"))
    ids_i = tl.load(ids + (b * F + node) * ids_row + i % K, mask=real, other=0)
    if D2T:
        ids_i += tl.load(d2t + ids_i, mask=real, other=0)
    has_parent = i < F * K * (1 - root)  # (root is 0 or 1)
    score = (tl.load(front_score + b * K + node, mask=has_parent, other=0.0)
             + lp_i.to(tl.float64))
    parent = tl.load(front_cand + b * K + node, mask=has_parent, other=-1)
    if mine == 0:
        out = packed + b * width + col + i
        tl.store(out, ids_i.to(tl.float64), mask=real)
        tl.store(out + plane, parent.to(tl.float64), mask=real)
        tl.store(out + 2 * plane, score, mask=real)
    if select != 0:
        # every program ranks the level's candidates (a few dozen values); program j keeps
        # the j-th best and copies its parent's state and ancestor row
        alive = real
        for j in range(K):
            best = tl.max(tl.where(alive, score, float("-inf")), axis=0)
            at = tl.min(tl.where(alive & (score == best), i, BLOCK_C), axis=0)
            alive = alive & (i != at)
            if j == mine:
                slot = b * K + j
                tl.store(next_score + slot, best)
                tl.store(next_tok + slot, tl.sum(tl.where(i == at, ids_i, 0), axis=0))
                tl.store(next_cand + slot, (col + at).to(tl.int64))
                row = at // K
                for x0 in range(0, X, BLOCK_X):
                    xs = x0 + tl.arange(0, BLOCK_X)
                    keep = xs < X
                    value = tl.load(states + (b * F + row) * states_row + xs, mask=keep)
                    tl.store(next_states + slot * X + xs, value, mask=keep)
                for t0 in range(0, T, BLOCK_T):
                    ts = t0 + tl.arange(0, BLOCK_T)
                    keep = ts < T
                    seen = tl.load(allowed + (b * K + row) * T + ts, mask=keep, other=0)
                    own = (ts >= eye_col) & (ts < eye_col + K)
                    seen = tl.where(own, (ts - eye_col == j).to(tl.uint8), seen)
                    tl.store(next_allowed + slot * T + ts, seen, mask=keep)


def candidates_block(candidates: int) -> int:
    """The kernel's candidate block for ``candidates`` a level: 16 up to 16, then the next
    power of four (so widths 1-4 share one variant, 5-8 another, ...)."""
    block = 16
    while block < candidates:
        block *= 4
    return block


def tree_level(lp: torch.Tensor, ids: torch.Tensor, d2t: torch.Tensor | None,
               front: Frontier | None, packed: torch.Tensor, col: int, select: bool,
               states: torch.Tensor, allowed: torch.Tensor, eye_col: int) -> Frontier | None:
    """:func:`splitspec.kernels.tree_level_torch` in one kernel (same arguments, same
    results; see there)."""
    b, f, k, x, t = check_level(lp, ids, front, packed, col, select, states, allowed, eye_col)
    device = packed.device
    if select:
        nxt = Frontier(torch.empty(b, k, dtype=torch.float64, device=device),
                       torch.empty(b, k, dtype=torch.int64, device=device),
                       torch.empty(b, k, dtype=torch.int64, device=device),
                       torch.empty(b * k, x, dtype=states.dtype, device=device),
                       torch.empty(b, k, t, dtype=torch.bool, device=device))
    else:  # nothing is written to these; the kernel still takes pointers
        nxt = Frontier(packed, ids, ids, states, allowed)
    score, cand = (packed, ids) if front is None else (front.score, front.cand)
    _level_kernel[(b, k if select else 1)](
        lp, lp.stride(0), ids, ids.stride(0), ids if d2t is None else d2t, score, cand,
        packed, packed.stride(0), packed.stride(1), col, states, states.stride(0), x,
        allowed.view(torch.uint8), t, eye_col, nxt.score, nxt.tokens, nxt.cand, nxt.states,
        nxt.allowed.view(torch.uint8), f, k, int(front is None), int(select),
        D2T=d2t is not None, BLOCK_C=candidates_block(f * k), BLOCK_X=STATES_BLOCK,
        BLOCK_T=SEEN_BLOCK, num_warps=WARPS)
    return nxt if select else None
