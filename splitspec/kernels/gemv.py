"""One row through a projection: y = x W^T for x [1, K], W [N, K], at the weights' bandwidth.

At batch 1 each projection of a decode step is a matrix-vector product, bound by reading
W once. On the H200, 8B shape, cuBLAS's kernels at one row reached 75 % (qkv), 59 % (o_proj,
with a split-K reduce kernel after it), 87 % (gate_up) and 85 % (down) of the bandwidth
(docs/benchmarks.md, fifteenth part). Here each program takes BLOCK_N rows of W whole,
streamed BLOCK_K columns at a time into a float32 accumulator, and rounds once at the end:
one kernel, no atomics, the same bits on every run. It rounds where torch's matmul rounds
(once, from float32), but sums in another order, so the last bit can differ from cuBLAS's.

bench/bench_gemv.py times it against torch's at the 8B shape's projections.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class GemvConfig(NamedTuple):
    block_n: int = 8     # rows of W a program reads
    block_k: int = 512   # columns a step of its loop
    num_warps: int = 4


DEFAULT = GemvConfig()
# W's (N, K) -> its config, or None where cuBLAS was faster (bench/bench_gemv.py prints these
# lines); a shape not listed takes DEFAULT.
CONFIGS: dict[tuple[int, int], GemvConfig | None] = {  # H200, Llama-3-8B's shapes, session 20
    (6144, 4096): GemvConfig(8, 512, 4),  # qkv
    (4096, 4096): GemvConfig(4, 512, 8),  # o_proj
    (28672, 4096): GemvConfig(16, 256, 4),  # gate_up
    (4096, 14336): GemvConfig(4, 512, 4),  # down
    (128256, 4096): GemvConfig(4, 1024, 8),  # lm_head
}


@triton.jit
def _gemv_kernel(x, w, out, N, w_row, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = n < N
    rows = w + n.to(tl.int64)[:, None] * w_row
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        if K % BLOCK_K == 0:
            xs = tl.load(x + k)
            ws = tl.load(rows + k[None, :], mask=keep[:, None], other=0.0)
        else:
            inside = k < K
            xs = tl.load(x + k, mask=inside, other=0.0)
            ws = tl.load(rows + k[None, :], mask=keep[:, None] & inside[None, :], other=0.0)
        acc += ws.to(tl.float32) * xs.to(tl.float32)[None, :]
    tl.store(out + n, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=keep)


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [1, K] (or [K]) times w [N, K] (rows may be strided, columns contiguous), transposed:
    [1, N] (or [N]) in x's dtype, as ``torch.nn.functional.linear(x, w)``."""
    n, k = w.shape
    if x.numel() != k or x.shape[-1] != k or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"gemv needs one row of {k} (got {tuple(x.shape)}) in w's dtype "
                         f"{w.dtype} (got {x.dtype}) and w's columns contiguous")
    if config.block_n & (config.block_n - 1) or config.block_k & (config.block_k - 1):
        raise ValueError(f"block sizes must be powers of two, got {config}")
    row = x.reshape(k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        row, w, out, n, w.stride(0), K=k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps)
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.linear(x, w)`` (no bias): one row of x through :func:`gemv`
    (with W's config from CONFIGS), more rows, and W's shapes where cuBLAS was faster, through
    torch."""
    if x.numel() == w.shape[1] and x.dtype == w.dtype and w.stride(1) == 1:
        config = CONFIGS.get((w.shape[0], w.shape[1]), DEFAULT)
        if config is not None:
            return gemv(x, w, config)
    return torch.nn.functional.linear(x, w)
