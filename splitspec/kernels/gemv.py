"""Few rows through a projection: y = x W^T for x [M, K], W [N, K], at the weights' bandwidth.

At batch 1 each projection of a decode step is a matrix-vector product, bound by reading
W once. On the H200, 8B shape, cuBLAS's kernels at one row reached 75 % (qkv), 59 % (o_proj,
with a split-K reduce kernel after it), 87 % (gate_up) and 85 % (down) of the bandwidth
(docs/benchmarks.md, fifteenth part). Here each program takes BLOCK_N rows of W whole,
streamed BLOCK_K columns at a time into a float32 accumulator, and rounds once at the end:
one kernel, no atomics, the same bits on every run. It rounds where torch's matmul rounds
(once, from float32), but sums in another order, so the last bit can differ from cuBLAS's.

A few rows (2 to MAX_ROWS: the draft's tree levels, a verify of a small tree) take
:func:`few_rows`: still bound by reading W once, but each program multiplies its block of W
by every row at once on the tensor cores (``tl.dot``, which needs 16 rows or more: the rows
are padded to 16, 32 or 64, and the padding is masked, never read). ``linear`` sends them
there only for the shapes that ROW_CONFIGS lists, where it beat cuBLAS when measured.

bench/bench_gemv.py times both against torch's at the 8B shape's projections (and the
EAGLE-3 head's, or a checkpoint's) and prints the CONFIGS and ROW_CONFIGS lines.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from splitspec.kernels import FP8, Fp8Weight


class GemvConfig(NamedTuple):
    block_n: int = 8     # rows of W a program reads
    block_k: int = 512   # columns a step of its loop
    num_warps: int = 4
    num_stages: int = 3  # Triton's software pipelining depth (3 is its default)
    split_k: int = 1     # fp8_rows only: programs a row of W's blocks is shared by (their
    # float32 sums added by a second kernel, in a fixed order)


DEFAULT = GemvConfig()
MAX_ROWS = 64  # the most rows few_rows and fp8_rows take (padded to 16, 32 or 64)
# W's (N, K) -> its config, or None where cuBLAS was faster (bench/bench_gemv.py prints these
# lines); a shape not listed takes DEFAULT.
CONFIGS: dict[tuple[int, int], GemvConfig | None] = {  # H200, Llama-3-8B's shapes, session 20
    (6144, 4096): GemvConfig(8, 512, 4),  # qkv
    (4096, 4096): GemvConfig(4, 512, 8),  # o_proj
    (28672, 4096): GemvConfig(16, 256, 4),  # gate_up
    (4096, 14336): GemvConfig(4, 512, 4),  # down
    (128256, 4096): GemvConfig(4, 1024, 8),  # lm_head
    # the EAGLE-3 head's own shapes (its o_proj, gate_up and down are the target's), session 22
    (6144, 8192): GemvConfig(16, 512, 8, 3),  # draft_qkv
    (4096, 12288): GemvConfig(8, 512, 8, 3),  # draft_fc
    (32000, 4096): GemvConfig(4, 1024, 8, 3),  # draft_lm_head
}
# (rows padded, N, K) -> few_rows's config where it beat cuBLAS (bench_gemv --rows prints these
# lines); every other shape and row count with more than one row goes to torch. H200,
# session 22, measured at 4, 9 and 16 rows (the head's shapes at 4 and 6); gate_up and down
# are absent: cuBLAS was ahead there.
ROW_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (16, 6144, 4096): GemvConfig(64, 256, 4, 4),  # qkv
    (16, 4096, 4096): GemvConfig(32, 256, 4, 4),  # o_proj
    (16, 128256, 4096): GemvConfig(64, 128, 4, 4),  # lm_head
    (16, 6144, 8192): GemvConfig(64, 256, 4, 4),  # draft_qkv
    (16, 4096, 12288): GemvConfig(32, 256, 4, 4),  # draft_fc
    (16, 32000, 4096): GemvConfig(64, 128, 4, 3),  # draft_lm_head
}

# fp8_rows's config by W's (N, K) (bench_gemv --fp8 prints these lines); other shapes take
# FP8_DEFAULT. H200, session 32, measured at 4 rows (the EAGLE-3 head's tree levels): the
# shapes with 4096 or 6144 output rows split K in four.
FP8_DEFAULT = GemvConfig(32, 256, 4, 4)
SUM_BLOCK = 1024  # outputs a program of fp8_rows's second kernel adds (split_k > 1)
SHARED_BYTES = 232448  # an sm_90 block's shared memory at most
FP8_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (6144, 8192): GemvConfig(64, 256, 4, 3, 4),  # draft_qkv, rows 4
    (4096, 4096): GemvConfig(64, 256, 4, 3, 4),  # o_proj, rows 4
    (28672, 4096): GemvConfig(128, 256, 4, 3),  # gate_up, rows 4
    (4096, 14336): GemvConfig(128, 256, 4, 4, 4),  # down, rows 4
    (4096, 12288): GemvConfig(128, 256, 4, 4, 4),  # draft_fc, rows 4
    (32000, 4096): GemvConfig(128, 256, 4, 3),  # draft_lm_head, rows 4
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


@triton.jit(do_not_specialize=["M"])  # the row count varies: no variant for 16, 32, ... (kv_compact)
def _rows_kernel(x, w, out, M, N, x_row, w_row, out_row, K: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    m = tl.arange(0, ROWS)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep_m, keep_n = m < M, n < N
    xs_at = x + m.to(tl.int64)[:, None] * x_row
    ws_at = w + n.to(tl.int64)[:, None] * w_row
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        inside = k < K
        xs = tl.load(xs_at + k[None, :], mask=keep_m[:, None] & inside[None, :], other=0.0)
        ws = tl.load(ws_at + k[None, :], mask=keep_n[:, None] & inside[None, :], other=0.0)
        if IEEE:  # float32 products: float32 inputs, and the interpreter (its dot reads
            # bf16 as raw 16-bit integers)
            acc = tl.dot(xs.to(tl.float32), tl.trans(ws.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(xs, tl.trans(ws), acc)
    tl.store(out + m[:, None] * out_row + n[None, :], acc.to(out.dtype.element_ty),
             mask=keep_m[:, None] & keep_n[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_rows_kernel(x, codes, scale, out, M, N, x_row, w_row, out_row, K: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IEEE: tl.constexpr, SPLIT: tl.constexpr, K_PER: tl.constexpr):
    """SPLIT > 1: program (i, j) sums columns [j K_PER, (j + 1) K_PER) of W's block i and
    stores its float32 products at out[j] ([SPLIT, M, N]) for _sum_splits_kernel."""
    m = tl.arange(0, ROWS)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep_m, keep_n = m < M, n < N
    xs_at = x + m.to(tl.int64)[:, None] * x_row
    ws_at = codes + n.to(tl.int64)[:, None] * w_row
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if SPLIT > 1:
        first = tl.program_id(1) * K_PER
    else:  # bounds known when compiled, as few_rows's
        first = 0
    for start in range(first, first + K_PER, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        inside = k < K
        xs = tl.load(xs_at + k[None, :], mask=keep_m[:, None] & inside[None, :], other=0.0)
        ws = tl.load(ws_at + k[None, :], mask=keep_n[:, None] & inside[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xs.to(tl.float32), tl.trans(ws.to(tl.float32)), acc,
                         input_precision="ieee")
        else:  # float16 products: a pair of codes widens in one instruction, exactly (to
            # bfloat16 it takes three). Widening is what bounds this kernel: clamping x to
            # float16's range first (three more instructions an element) made it up to 17 %
            # slower (docs/benchmarks.md, twenty-eighth part)
            acc = tl.dot(xs.to(tl.float16), tl.trans(ws.to(tl.float16)), acc)
    s = tl.load(scale + n, mask=keep_n, other=0.0)
    if SPLIT > 1:
        out += tl.program_id(1).to(tl.int64) * M * N
    tl.store(out + m[:, None] * out_row + n[None, :], (acc * s[None, :]).to(out.dtype.element_ty),
             mask=keep_m[:, None] & keep_n[None, :])


@triton.jit(do_not_specialize=["M"])  # the row count varies: one variant for all
def _sum_splits_kernel(parts, out, M, N, out_row, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < M * N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(SPLIT):  # in order: the same sum on every run
        total += tl.load(parts + j * M * N + i, mask=keep, other=0.0)
    row, col = i // N, i % N
    tl.store(out + row * out_row + col, total.to(out.dtype.element_ty), mask=keep)


def padded_rows(rows: int) -> int:
    """The row count few_rows computes for ``rows`` (tl.dot's tiles: 16, 32 or 64)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"few_rows and fp8_rows take 1 to {MAX_ROWS} rows, got {rows}")
    return max(16, 1 << (rows - 1).bit_length())


def _check_blocks(config: GemvConfig, least: int = 1) -> None:
    blocks = (config.block_n, config.block_k)
    if any(b & (b - 1) or b < least for b in blocks):
        raise ValueError(f"block sizes must be powers of two, at least {least}, got {config}")


def few_rows(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS; rows may be strided, columns contiguous) times w [N, K],
    transposed: [M, N] in x's dtype, as ``torch.nn.functional.linear(x, w)``; float32 sums,
    one rounding. config.block_n and block_k are at least 16 (tl.dot's smallest tile)."""
    n, k = w.shape
    if (x.dim() != 2 or x.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1
            or x.dtype != w.dtype):
        raise ValueError(f"few_rows needs rows of {k} (got {tuple(x.shape)}) in w's dtype "
                         f"{w.dtype} (got {x.dtype}) and x's and w's columns contiguous")
    rows = padded_rows(x.shape[0])
    _check_blocks(config, least=16)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"
    _rows_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, out, x.shape[0], n, x.stride(0), w.stride(0), out.stride(0), K=k, ROWS=rows,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, IEEE=ieee, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


def fp8_shared_bytes(config: GemvConfig, rows: int) -> int:
    """Shared memory fp8_rows's software pipeline takes for ``config`` at ``rows`` of a 2-byte
    x: num_stages - 1 buffers, each an x tile (rows padded) and a tile of codes; with rows
    padded to 64, also the codes' tile widened to float16. It equals what Triton 3.9 reported
    compiling for sm_90 at 4, 20 and 40 rows for every block_n of 32-128, block_k of 256-512
    and 2-4 stages; tests/kernel_variants.py compiles the configs serving uses."""
    pad = padded_rows(rows)
    widened = 2 * config.block_n * config.block_k if pad == MAX_ROWS else 0
    return (config.num_stages - 1) * config.block_k * (2 * pad + config.block_n) + widened


@functools.cache  # per call on the eager path: a config and a padded row count
def fitted(config: GemvConfig, rows: int) -> GemvConfig:
    """``config`` with fewer pipeline stages where its tiles at ``rows`` would take more than
    a block's shared memory (FP8_CONFIGS were tuned at 4 rows; at 33-64 the x tile is four
    times as tall). ValueError when even two stages do not fit."""
    while fp8_shared_bytes(config, rows) > SHARED_BYTES and config.num_stages > 2:
        config = config._replace(num_stages=config.num_stages - 1)
    if fp8_shared_bytes(config, rows) > SHARED_BYTES:
        raise ValueError(f"{config} needs {fp8_shared_bytes(config, rows)} B of shared memory "
                         f"at {rows} rows, over {SHARED_BYTES}: take smaller blocks")
    return config


def fp8_rows(x: torch.Tensor, w: Fp8Weight, config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS; a 2-byte float or float32; rows may be strided, columns
    contiguous) times a weight in fp8 (:func:`splitspec.kernels.quantize_fp8`), transposed:
    [M, N] in x's dtype, as :func:`splitspec.kernels.fp8_linear_torch` (float32 sums, the
    row's scale, one rounding) except that a 2-byte x is multiplied as float16: a bfloat16
    value beyond float16's range (65504) becomes infinite, and its row's products with it.
    As :func:`few_rows`, but it reads one byte a weight, not two. The config's stages are
    cut to fit a block's shared memory (:func:`fitted`)."""
    codes, scale, _ = w
    n, k = codes.shape
    if (x.dim() != 2 or x.shape[1] != k or codes.stride(1) != 1 or x.stride(1) != 1
            or codes.dtype != FP8 or scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError(f"fp8_rows needs rows of {k} (got {tuple(x.shape)}), {FP8} codes "
                         f"(got {codes.dtype}) with contiguous columns, and a float32 scale "
                         f"per row ({n}, got {tuple(scale.shape)} {scale.dtype})")
    rows = padded_rows(x.shape[0])
    _check_blocks(config, least=16)
    config = fitted(config, rows)
    m, split = x.shape[0], config.split_k
    if split < 1:
        raise ValueError(f"split_k must be at least 1, got {config}")
    k_per = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                               device=x.device)
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"
    _fp8_rows_kernel[(triton.cdiv(n, config.block_n), split)](
        x, codes, scale, parts, m, n, x.stride(0), codes.stride(0),
        out.stride(0) if split == 1 else n, K=k, ROWS=rows, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, IEEE=ieee, SPLIT=split, K_PER=k_per,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            parts, out, m, n, out.stride(0), SPLIT=split, BLOCK=SUM_BLOCK)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [1, K] (or [K]) times w [N, K] (rows may be strided, columns contiguous), transposed:
    [1, N] (or [N]) in x's dtype, as ``torch.nn.functional.linear(x, w)``."""
    n, k = w.shape
    if x.numel() != k or x.shape[-1] != k or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"gemv needs one row of {k} (got {tuple(x.shape)}) in w's dtype "
                         f"{w.dtype} (got {x.dtype}) and w's columns contiguous")
    _check_blocks(config)
    row = x.reshape(k).contiguous()
    if row.data_ptr() % 16:  # a row at an odd offset would compile its own variant: copied
        row = row.clone()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        row, w, out, n, w.stride(0), K=k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``torch.nn.functional.linear(x, w)`` (no bias): one row of x through :func:`gemv` (with
    W's config from CONFIGS; None there: torch), 2 to MAX_ROWS rows of 2-byte floats through
    :func:`few_rows` where ROW_CONFIGS lists their shape, everything else through torch.
    ROW_CONFIGS were measured in bfloat16: in float32 each pipeline stage's tiles take twice
    the shared memory, and the qkv configs' would need 240 KiB, more than a Hopper GPU's
    227 KiB (tests/kernel_variants.py). A weight in fp8: 1 to MAX_ROWS rows of a 2-byte x
    through :func:`fp8_rows` (FP8_CONFIGS), everything else through the weight it was made
    from (more rows are bound by arithmetic, not by reading the weight)."""
    if isinstance(w, Fp8Weight):
        n, k = w.codes.shape
        rows = x.numel() // k
        if (1 <= rows <= MAX_ROWS and x.shape[-1] == k and x.stride(-1) == 1
                and x.element_size() == 2):
            config = FP8_CONFIGS.get((n, k), FP8_DEFAULT)
            return fp8_rows(x.reshape(rows, k), w, config).reshape(*x.shape[:-1], n)
        w = w.full
    n, k = w.shape
    if x.dtype == w.dtype and w.stride(1) == 1 and x.shape[-1] == k:
        rows = x.numel() // k
        if rows == 1:
            config = CONFIGS.get((n, k), DEFAULT)
            if config is not None:
                return gemv(x, w, config)
        elif 1 < rows <= MAX_ROWS and x.stride(-1) == 1 and x.element_size() == 2:
            row_config = ROW_CONFIGS.get((padded_rows(rows), n, k))
            if row_config is not None:
                flat = x.reshape(rows, k)  # a view where x's rows allow one
                return few_rows(flat, w, row_config).reshape(*x.shape[:-1], n)
    return torch.nn.functional.linear(x, w)
