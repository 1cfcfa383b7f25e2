"""Triton kernels, each with its torch reference (the tests compare them)."""

import importlib.util
from typing import NamedTuple

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def top_logprobs_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of logits: (log-probabilities [R, k] float32,
    descending; ids [R, k] int64). The draft's tree search on CPU, and the reference of
    splitspec/kernels/top_logprobs.py (here, where no Triton is needed)."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


FP8 = torch.float8_e4m3fn  # the codes of a weight in fp8


class Fp8Weight(NamedTuple):
    """A projection's weight W [N, K] in fp8 beside the weight itself: codes [N, K] (float8
    e4m3) and a float32 scale per row [N], W ~ codes * scale[:, None]. Half the bytes of
    bfloat16, so half the time where a projection is bound by reading its weight (a few
    rows: the draft's tree levels); ``full`` serves the rows that are bound by arithmetic
    (splitspec.kernels.gemv.linear)."""

    codes: torch.Tensor
    scale: torch.Tensor
    full: torch.Tensor  # W as it was (the same storage, no copy)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """W [N, K] in fp8: each row's largest magnitude maps to e4m3's largest (448), and the
    rest round to 3 bits of mantissa (bfloat16 keeps 7). An all-zero row keeps scale 1."""
    wide = w.detach().float()
    largest = wide.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / torch.finfo(FP8).max, torch.ones_like(largest))
    return Fp8Weight((wide / scale[:, None]).to(FP8), scale, w.detach())


def fp8_linear_torch(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., K] times an fp8 weight, transposed: [..., N] in x's dtype, float32 sums, one
    rounding (the reference of splitspec.kernels.gemv.fp8_rows, and the CPU's path)."""
    return ((x.float() @ w.codes.float().T) * w.scale).to(x.dtype)


class Frontier(NamedTuple):
    """A tree search's frontier of k nodes per sequence (draft_service/tree_search.py)."""

    score: torch.Tensor    # [B, k] float64: each node's score (its path's summed log-probs)
    tokens: torch.Tensor   # [B, k] int64: target ids, the next forward's input
    cand: torch.Tensor     # [B, k] int64: each node's candidate index (its packed column)
    states: torch.Tensor   # [B * k, X]: each node's parent's state
    allowed: torch.Tensor  # [B, k, T] bool: the scratch columns each node sees


def check_level(lp: torch.Tensor, ids: torch.Tensor, front: Frontier | None,
                packed: torch.Tensor, col: int, select: bool, states: torch.Tensor,
                allowed: torch.Tensor, eye_col: int) -> tuple[int, int, int, int, int]:
    """:func:`tree_level_torch`'s arguments checked; returns (B, F, k, X, T). Raises
    ValueError naming what does not fit."""
    b, width = packed.shape[1], packed.shape[2]
    rows, k = lp.shape
    f = 1 if front is None else k
    t = allowed.shape[2]
    problems = []
    if ids.shape != lp.shape or rows != b * f or lp.stride(1) != 1 or ids.stride(1) != 1:
        problems.append(f"log-probs {tuple(lp.shape)} and ids {tuple(ids.shape)} must be "
                        f"[B * F, k] = [{b} * {f}, k] with contiguous rows")
    if packed.dtype != torch.float64 or not packed.is_contiguous() or packed.shape[0] != 3:
        problems.append("packed must be [3, B, C] float64, contiguous")
    if not 0 <= col <= width - f * k:
        problems.append(f"columns {col} .. {col + f * k} do not fit packed's {width}")
    if states.dim() != 2 or states.shape[0] != b * f or states.stride(1) != 1:
        problems.append(f"states {tuple(states.shape)} must be [B * F, X] = [{b * f}, X]")
    if allowed.shape[:2] != (b, k) or not allowed.is_contiguous() or allowed.dtype != torch.bool:
        problems.append(f"allowed {tuple(allowed.shape)} must be [B, k, T] bool, contiguous")
    if front is not None and (front.score.shape != (b, k) or front.cand.shape != (b, k)):
        problems.append(f"the frontier must be [B, k] = [{b}, {k}]")
    if select and not 0 <= eye_col <= t - k:
        problems.append(f"the next level's columns {eye_col} .. {eye_col + k} do not fit T {t}")
    if problems:
        raise ValueError("tree level: " + "; ".join(problems))
    return b, f, k, states.shape[1], t


def tree_level_torch(lp: torch.Tensor, ids: torch.Tensor, d2t: torch.Tensor | None,
                     front: Frontier | None, packed: torch.Tensor, col: int, select: bool,
                     states: torch.Tensor, allowed: torch.Tensor, eye_col: int
                     ) -> Frontier | None:
    """One level of the tree search after its top k (the reference of
    splitspec/kernels/tree_level.py, and the CPU path).

    lp, ids [B * F, k]: the log-probabilities (float32, descending) and draft ids of each
    frontier node's k likeliest children; F = 1 at the root (``front`` None: score 0, no
    parent), k after (``front``). Each of the F * k children becomes a candidate in
    packed[:, b, col:col + F * k] (target id, parent's candidate index or -1, score in
    float64), in frontier order. With ``select``, returns the next frontier: the k best
    candidates in descending score (equal scores in candidate order), their target ids and
    candidate indices, their parents' rows of ``states`` [B * F, X] and of ``allowed``
    [B, k, T] (at the root every row is the same, and row 0 is read), each with its own
    column ``eye_col + j`` set among columns eye_col .. eye_col + k - 1. d2t maps draft ids
    to target ids (target = draft + d2t[draft]); None: the same ids."""
    b, f, k, x, t = check_level(lp, ids, front, packed, col, select, states, allowed, eye_col)
    tokens = (ids if d2t is None else ids + d2t[ids]).reshape(b, f * k)
    scores = lp.double().reshape(b, f, k)
    if front is None:
        parents = torch.full((b, k), -1, dtype=torch.int64, device=ids.device)
    else:
        scores = scores + front.score[:, :, None]
        parents = front.cand[:, :, None].expand(b, k, k).reshape(b, k * k)
    scores = scores.reshape(b, f * k)
    packed[:, :, col:col + f * k] = torch.stack([tokens.double(), parents.double(), scores])
    if not select:
        return None
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    best, row = order.indices[:, :k], order.indices[:, :k] // k
    seen = allowed.gather(1, row[:, :, None].expand(b, k, t))
    seen[:, :, eye_col:eye_col + k] = torch.eye(k, dtype=torch.bool, device=allowed.device)
    return Frontier(order.values[:, :k], tokens.gather(1, best), col + best,
                    states.view(b, f, x).gather(1, row[:, :, None].expand(b, k, x))
                    .reshape(b * k, x), seen)
