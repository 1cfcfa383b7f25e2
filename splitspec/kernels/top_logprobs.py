"""The k most likely tokens of each row of logits, with their log-probabilities, in two kernels.

The draft's tree search asks this of every level: ``log_softmax(logits).topk(k)`` over the
head's vocabulary (32000 for Llama-3's EAGLE-3 heads) for a few rows. In torch that is a cast
to float32, a softmax kernel and a radix select of eight or more kernels; on the H200, at the
8B shape, about 40 µs a level (docs/benchmarks.md, eighteenth part), against the few
microseconds it takes to read the logits.

Here the first kernel splits each row into chunks of BLOCK columns, one program a chunk, and
finds each chunk's k best (by value, then by the smaller index) with its maximum and its sum
of exp(x - max); the second, one program a row, merges the chunks' sums into the row's
log-sum-exp and their candidates into the row's k best. The k best of a row are among its
chunks' k best, so this is exact: the same tokens as a stable descending sort (equal logits
in index order), and log-probabilities x - logsumexp(x) in float32, summed in another order
than torch's (so within float rounding of torch's). :func:`top_logprobs_torch` is the
reference. The k the kernels find is a constexpr (one compiled variant each), so they find
:func:`kernel_k` tokens, shared between widths, and return the first k.

:func:`top_logprobs` (what the EAGLE-3 head's tree search calls with the kernels on) takes
the kernels while ROUTED is set, as it is since the H200 measured them: 5-8 µs against torch's
53-65 µs a level at 1-16 rows of 32000 ids, and the 8B draft graph 1.647 -> 1.350 ms
(docs/benchmarks.md, nineteenth part; bench/bench_top_logprobs.py, bench/bench_step_costs.py
--torch-top-k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitspec.kernels import top_logprobs_torch  # the reference (also the CPU path)

BLOCK = 2048  # columns of a row a program of the first kernel reads (a power of two)
WARPS = 4     # each kernel's warps
MAX_K = 32    # the most tokens a row the kernels return; more go to torch
ROUTED = True  # top_logprobs through the kernels (False: torch's, as bench_step_costs --torch-top-k)


@triton.jit
def _chunk_kernel(x, row_stride, V, vals, ids, maxes, sums, CHUNKS, K: tl.constexpr,
                  BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    keep = cols < V
    v = tl.load(x + row * row_stride + cols, mask=keep, other=float("-inf")).to(tl.float32)
    top = tl.max(v, axis=0)
    slot = (row * CHUNKS + chunk) * K
    tl.store(maxes + row * CHUNKS + chunk, top)
    tl.store(sums + row * CHUNKS + chunk, tl.sum(tl.where(keep, tl.exp(v - top), 0.0), axis=0))
    for j in tl.static_range(K):
        best = tl.max(v, axis=0)
        at = tl.min(tl.where(v == best, cols, 2147483647), axis=0)  # the first of equals
        tl.store(vals + slot + j, best)
        tl.store(ids + slot + j, at)
        v = tl.where(cols == at, float("-inf"), v)


@triton.jit
def _merge_kernel(vals, ids, maxes, sums, out_lp, out_ids, CHUNKS, K: tl.constexpr,
                  CHUNKS_P: tl.constexpr, CANDIDATES_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, CHUNKS_P)
    real = chunk < CHUNKS
    m = tl.load(maxes + row * CHUNKS + chunk, mask=real, other=float("-inf"))
    s = tl.load(sums + row * CHUNKS + chunk, mask=real, other=0.0)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(tl.where(real, s * tl.exp(m - top), 0.0), axis=0))
    c = tl.arange(0, CANDIDATES_P)
    listed = c < CHUNKS * K
    v = tl.load(vals + row * CHUNKS * K + c, mask=listed, other=float("-inf"))
    at = tl.load(ids + row * CHUNKS * K + c, mask=listed, other=2147483647)
    for j in tl.static_range(K):
        best = tl.max(v, axis=0)
        pick = tl.min(tl.where(v == best, at, 2147483647), axis=0)
        tl.store(out_lp + row * K + j, best - lse)
        tl.store(out_ids + row * K + j, pick.to(tl.int64))
        v = tl.where(at == pick, float("-inf"), v)


def fits(logits: torch.Tensor, k: int) -> bool:
    """Whether the kernels take these logits: [R, V], R >= 1, columns contiguous, and
    1 <= k <= min(MAX_K, V)."""
    return (logits.dim() == 2 and logits.shape[0] > 0 and logits.stride(1) == 1
            and 1 <= k <= min(MAX_K, logits.shape[1]))


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits.float(), -1).topk(k, -1)``: the kernels where ROUTED is set and
    they take the logits (:func:`fits`), torch's otherwise."""
    if ROUTED and fits(logits, k):
        return top_logprobs_kernels(logits, k)
    return top_logprobs_torch(logits, k)


def top_logprobs_kernels(logits: torch.Tensor, k: int, block: int = BLOCK,
                         num_warps: int = WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels on logits [R, V] (any float dtype): log-probabilities [R, k] float32,
    descending, and ids [R, k] int64, equal logits in index order (a row with fewer than k
    finite logits may repeat an id among its -inf entries; a projection's logits are finite).
    ``block`` (a power of two) and ``num_warps`` are bench_top_logprobs.py's. Raises
    ValueError where they do not fit."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 16 (got {block})")
    if not fits(logits, k):
        raise ValueError(f"the kernels take logits [R, V] with R >= 1, columns contiguous and "
                         f"1 <= k <= min({MAX_K}, V) (got {tuple(logits.shape)}, "
                         f"strides {logits.stride()}, k {k})")
    rows, width = logits.shape
    chunks = triton.cdiv(width, block)
    device = logits.device
    asked, k = k, kernel_k(k)
    vals = torch.empty(rows, chunks, k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, chunks, k, dtype=torch.int32, device=device)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    _chunk_kernel[(rows, chunks)](logits, logits.stride(0), width, vals, ids, maxes, sums,
                                  chunks, K=k, BLOCK=block, num_warps=num_warps)
    out_lp = torch.empty(rows, k, dtype=torch.float32, device=device)
    out_ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    _merge_kernel[(rows,)](vals, ids, maxes, sums, out_lp, out_ids, chunks, K=k,
                           CHUNKS_P=triton.next_power_of_2(chunks),
                           CANDIDATES_P=triton.next_power_of_2(chunks * k), num_warps=num_warps)
    return out_lp[:, :asked], out_ids[:, :asked]


def kernel_k(k: int) -> int:
    """The k the kernels find (a constexpr: each value is a variant Triton compiles): 1 for
    a chain; 4 for 2 to 4, the widths the default 4-wide tree is capped to at 2 and 3 nodes
    (the speculation policy's small budgets), so that the variants the draft's warmup meets
    (its chain and 4-wide tree) serve them; the next power of two beyond. The k best are
    the first k of the kernel_k best."""
    return 1 if k == 1 else max(4, triton.next_power_of_2(k))
