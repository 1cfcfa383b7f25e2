"""Cases of the Triton kernels against their torch references, run by tests/test_kernels.py
(in the interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

import os

import torch

from splitspec.kernels.kv_compact import CHUNK, compact_kv
from splitspec.kv_cache import KVCache


def check(device: str, layers: int, pages: int, page: int, heads: int, dim: int,
          dtype: torch.dtype, src: list[int], dst: list[int]) -> int:
    """compact_kv against KVCache.copy_slots; returns 1 when the moves changed the cache."""
    cache = KVCache(layers, pages, page, heads, dim, dtype, device)
    cache.data.copy_(torch.randn(cache.data.shape).to(dtype))
    reference = cache.data.clone()
    want = KVCache(layers, pages, page, heads, dim, dtype, device)
    want.data.copy_(reference)
    src_t = torch.tensor(src, dtype=torch.int64, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=device)
    want.copy_slots_torch(src_t, dst_t)
    compact_kv(cache.data, src_t, dst_t)
    assert torch.equal(cache.data, want.data), (src, dst)
    return int((cache.data != reference).any())

def run(device: str) -> None:
    changed = 0
    # compaction of an accepted path: nodes at 21, 23, 26 move down to 20, 21, 22 (overlapping)
    changed += check(device, 3, 8, 16, 2, 64, torch.float32, [21, 23, 26], [20, 21, 22])
    # across pages, bf16, a width that is not a multiple of the block (3 * 48 = 144 columns)
    changed += check(device, 2, 10, 16, 3, 48, torch.bfloat16, [47, 63, 64, 90], [40, 41, 42, 43])
    # a move upward over another's source, and many moves (not a power of two)
    changed += check(device, 1, 6, 4, 1, 32, torch.float32, [2, 5], [5, 9])
    changed += check(device, 2, 40, 16, 2, 64, torch.float16, list(range(100, 137)),
                     list(range(60, 97)))
    # a batch's compaction in one call, as Engine._compact makes it: 8 sequences' accepted
    # paths in path order (38 moves, so three chunks; the fourth sequence's moves straddle
    # the first chunk's end, and its last move writes a slot one of the first chunk read),
    # each moving down over its own sources, on pages that are not in order
    src, dst = batch_compaction(page=16)
    assert len(src) > 2 * CHUNK
    changed += check(device, 2, 16, 16, 2, 64, torch.bfloat16, src, dst)
    # nothing to move
    check(device, 1, 2, 4, 1, 32, torch.float32, [], [])
    assert changed == 5


def batch_compaction(page: int) -> tuple[list[int], list[int]]:
    """Global source and destination slots of 8 sequences' accepted paths: sequence i holds
    pages 2i + 1 then 2i, its committed prefix ends at position 3 + i, and its path's tree
    indices move down to indices 1, 2, ... after the root (Engine._compact)."""
    paths = [[2, 3, 5, 6, 8], [1, 3, 4, 7, 9, 10], [4, 6], [2, 5, 6, 8, 11, 12], [3],
             [1, 2, 4, 6, 7, 9], [2, 4, 6, 8, 10, 12, 14], [3, 4, 6, 7, 9, 10, 13, 14]]
    src: list[int] = []
    dst: list[int] = []
    for i, path in enumerate(paths):
        pages, length = [2 * i + 1, 2 * i], 3 + i
        slots = [pages[p // page] * page + p % page for p in range(2 * page)]
        for place, node in enumerate(path, 1):
            if node != place:
                src.append(slots[length + node])
                dst.append(slots[length + place])
    return src, dst


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def close(got: torch.Tensor, want: torch.Tensor, what: str,
          scale: torch.Tensor | None = None) -> None:
    """Equal in float32 up to float rounding; in bf16/fp16 at most one rounding step apart
    (the kernels compute in float32 where torch rounds some intermediates), or three in the
    interpreter, which truncates where compiled kernels round."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
    else:
        size = want.float().abs() if scale is None else scale.float().abs()
        step = torch.finfo(got.dtype).eps * size.clamp_min(1e-2)
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= (3 if INTERPRETED else 2) * step + 1e-3).all()), f"{what}: max diff {diff.max():.3g}"


def check_fused(device: str, dtype: torch.dtype, tokens: int, hidden: int, heads: int,
                kv_heads: int, head_dim: int) -> None:
    """Every kernel of splitspec.kernels.fused_ops against the torch form it replaces."""
    from splitspec.kernels import fused_ops
    from splitspec.model.config import RopeConfig
    from splitspec.model.layers import RMSNorm, Rotary, rope_inv_freq

    gen = torch.Generator().manual_seed(tokens * 7 + hidden)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    norm = RMSNorm(hidden, 0.1).to(device=device, dtype=dtype)  # an eps large enough to matter
    with torch.no_grad():
        norm.weight.copy_(rand(hidden))
    x, residual = rand(tokens, hidden), rand(tokens, hidden)
    close(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x), "rms_norm")
    normed, summed = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    if INTERPRETED:  # the interpreter truncates float32 -> bf16; compiled kernels round
        close(summed, residual + x, "add_rms_norm's residual")
    else:
        assert torch.equal(summed, residual + x), "add_rms_norm's residual"
    close(normed, norm(residual + x), "add_rms_norm")

    batched = rand(2, tokens, hidden)  # leading dimensions, and a strided (transposed) input
    close(fused_ops.rms_norm(batched, norm.weight, norm.eps), norm(batched), "rms_norm [B, T, H]")
    strided = rand(hidden, tokens).t()
    close(fused_ops.rms_norm(strided, norm.weight, norm.eps), norm(strided), "rms_norm strided")

    # an EAGLE-3 layer's input: embeddings gathered and normed beside normed hidden states,
    # these contiguous, rows of a wider tensor, or transposed
    table = rand(11, hidden)
    ids = torch.randint(0, 11, (tokens,), generator=gen).to(device)
    own = RMSNorm(hidden, 0.05).to(device=device, dtype=dtype)
    with torch.no_grad():
        own.weight.copy_(rand(hidden))
    for states in (x, rand(tokens, 2 * hidden)[:, hidden:], rand(hidden, tokens).t()):
        close(fused_ops.embed_norm_pair(ids, table, states, norm.weight, own.weight, norm.eps,
                                        own.eps),
              torch.cat((norm(table[ids]), own(states)), dim=-1), "embed_norm_pair")

    inter = 3 * hidden + 5  # not a multiple of the kernel's block
    gate_up = rand(tokens, 2 * inter)
    close(fused_ops.silu_mul(gate_up),
          torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], "silu_mul")

    rope = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position=8192)
    rotary = Rotary(rope, head_dim).to(device)
    rotary.inv_freq = rope_inv_freq(rope, head_dim).to(device)
    width = (heads + 2 * kv_heads) * head_dim   # q, k, v as views of one fused projection
    qkv = rand(tokens, width)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 20000, (tokens,), generator=gen).to(device)
    want_q, want_k = rotary(q.clone(), k.clone(), positions)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    got_q = fused_ops.rope(q, k, positions, rotary.inv_freq)
    assert got_q.is_contiguous()
    # a rotation's products are as large as its inputs however small their sum
    close(got_q, want_q, "rope q", scale=q.abs().amax(-1, keepdim=True))
    close(k, want_k, "rope k (in place)", scale=want_k.abs().amax(-1, keepdim=True))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before), "rope touched v"

    cache = KVCache(2, 6, 4, kv_heads, head_dim, dtype, device)
    want = cache.data.clone()
    slots = torch.randperm(24, generator=gen)[:tokens].to(device)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    want[1, slots // 4, 0, slots % 4] = k
    want[1, slots // 4, 1, slots % 4] = v
    fused_ops.store_kv(cache.data[1], slots, k, v)
    assert torch.equal(cache.data, want), "store_kv"


def run_fused(device: str) -> None:
    check_fused(device, torch.float32, 5, 96, 4, 2, 16)
    check_fused(device, torch.bfloat16, 7, 256, 8, 2, 32)
    check_fused(device, torch.float16, 1, 64, 2, 2, 64)
    check_fused(device, torch.bfloat16, 3, 4096, 32, 8, 128)  # Llama-3.1-8B's widths


def check_tree(device: str, dtype: torch.dtype, seqs: int, width: int, levels: int, seen_levels: int,
               heads: int, kv_heads: int, dim: int, lse_scale: float) -> None:
    """splitspec.kernels.tree_attention against the torch form (masked_attention, then the
    log-sum-exp merge): keys and values are slices of a [B, levels, width, H_kv, D] scratch, as
    the drafting levels pass them; every row sees itself and a random set of other nodes."""
    from splitspec.attention.cascade import masked_attention, merge_attention
    from splitspec.kernels.tree_attention import tree_attention

    gen = torch.Generator().manual_seed(seqs * 31 + width * 7 + levels)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    rows, seen = seqs * width, seen_levels * width
    scratch = rand(2, seqs, levels, width, kv_heads, dim)
    keys = scratch[0, :, :seen_levels].reshape(seqs, seen, kv_heads, dim)
    values = scratch[1, :, :seen_levels].reshape(seqs, seen, kv_heads, dim)
    ancestry = torch.rand(seqs, width, levels * width, generator=gen) < 0.4
    own = torch.arange(width)
    ancestry[:, own, (seen_levels - 1) * width + own] = True
    allowed = ancestry.to(device)[:, :, :seen]
    q = rand(rows, heads, dim)
    prefix_out = rand(rows, heads, dim)
    prefix_lse = (torch.randn(rows, heads, generator=gen) * 3).to(device)
    got = tree_attention(q, keys, values, allowed, prefix_out, prefix_lse, lse_scale)
    out_t, lse_t = masked_attention(q.view(seqs, width, kv_heads, heads // kv_heads, dim), keys,
                                    values, allowed)
    want = merge_attention(prefix_out.float(), prefix_lse * lse_scale, out_t.reshape(q.shape),
                           lse_t.reshape(rows, heads)).to(dtype)
    close(got, want, f"tree_attention {dtype} {seqs}x{width} level {seen_levels}/{levels}")
    assert got.shape == q.shape and got.dtype == q.dtype


def run_tree(device: str) -> None:
    check_tree(device, torch.float32, 1, 4, 4, 1, 4, 2, 16, 1.0)      # the first level
    check_tree(device, torch.float32, 3, 4, 4, 3, 8, 2, 32, 0.6931471805599453)  # base-2 lse
    check_tree(device, torch.bfloat16, 2, 4, 4, 4, 32, 8, 128, 0.6931471805599453)  # 8B head
    check_tree(device, torch.float16, 5, 3, 5, 4, 4, 4, 64, 1.0)      # 12 keys: not a power of 2


def check_prompts(device: str, dtype: torch.dtype, lengths: list[int], rows: int, heads: int,
                  kv_heads: int, dim: int) -> None:
    """splitspec.kernels.prompt_attention against prompt_attention_reference: prompts of these
    lengths packed into rows rows (the rest padding); k and v are views of one [T, 2, H_kv, D]
    block, as a fused projection leaves them, so their row strides are not their widths."""
    from splitspec.attention.prompts import prompt_attention_reference, prompt_starts
    from splitspec.kernels.prompt_attention import prompt_attention

    gen = torch.Generator().manual_seed(sum(lengths) * 13 + rows + dim)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(rows, 2, kv_heads, dim, generator=gen).to(dtype).to(device)
    k, v = kv.unbind(1)
    starts = torch.tensor(prompt_starts(lengths, rows), dtype=torch.int64, device=device)
    got = prompt_attention(q, k, v, starts)
    want = prompt_attention_reference(q, k, v, starts)
    assert got.shape == q.shape and got.dtype == q.dtype
    what = f"prompt_attention {dtype} {lengths} in {rows} rows"
    if dtype == torch.float32:
        close(got, want, what)
    else:  # the kernel rounds the softmax weights to the values' dtype for the tensor-core
        # dot (relative error eps / 2 each, so at most eps / 2 of the largest value), and
        # both round the output once
        eps = torch.finfo(dtype).eps
        bound = 2 * eps * want.float().abs() + eps / 2 * v.float().abs().max() + 1e-3
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= bound).all()), f"{what}: max diff {diff.max():.3g}"
    # A row's output depends on its own prompt alone: the first prompt by itself agrees.
    n = lengths[0]
    alone = prompt_attention(q[:n].contiguous(), k[:n].contiguous(), v[:n].contiguous(),
                             starts[:n].contiguous())
    close(alone, got[:n], f"prompt_attention {dtype}: the first prompt alone")


def run_prompts(device: str) -> None:
    check_prompts(device, torch.float32, [5], 5, 2, 1, 16)                 # one short prompt
    check_prompts(device, torch.float32, [70, 3, 40], 128, 4, 2, 32)       # blocks span prompts
    check_prompts(device, torch.float32, [1, 1, 30], 64, 2, 2, 64)         # one-token prompts
    check_prompts(device, torch.bfloat16, [70, 40, 10], 128, 32, 8, 128)  # 8B heads, padding
    check_prompts(device, torch.float16, [33], 48, 6, 3, 48)               # D not a power of 2
    check_prompts(device, torch.float32, [200, 60], 272, 2, 1, 32)        # many key blocks


def check_paged_decode(device: str, dtype: torch.dtype, lengths: list[int], page: int,
                       heads: int, kv_heads: int, dim: int, splits: int, block_n: int = 32,
                       rows: int = 1) -> None:
    """splitspec.kernels.paged_decode against its torch reference: sequences of these lengths
    on shuffled pages of one layer's cache (each table padded to the longest), ``rows`` query
    rows each (more than 1: paged_prefix_attention, its log-sum-exp checked too)."""
    from splitspec.kernels.paged_decode import (
        paged_decode_attention,
        paged_decode_reference,
        paged_prefix_attention,
    )

    gen = torch.Generator().manual_seed(sum(lengths) * 7 + page + splits + rows)
    used = [-(-n // page) for n in lengths]
    pool = sum(used) + 2
    cache = torch.randn(pool, 2, page, kv_heads, dim, generator=gen).to(dtype).to(device)
    order = torch.randperm(pool, generator=gen).tolist()
    width = max(used)
    table = torch.zeros(len(lengths), 1 + width, dtype=torch.int32)
    for b, (n, count) in enumerate(zip(lengths, used, strict=True)):
        table[b, 0] = n
        table[b, 1:1 + count] = torch.tensor(order[:count])
        order = order[count:]
    table = table.to(device)
    q = torch.randn(len(lengths) * rows, heads, dim, generator=gen).to(dtype).to(device)

    def attend(q: torch.Tensor, table: torch.Tensor, splits: int) -> torch.Tensor:
        if rows == 1:
            return paged_decode_attention(q, cache, table, splits, block_n=block_n)
        out, lse = paged_prefix_attention(q, cache, table, rows, splits, block_n=block_n)
        tol = 1e-5 if dtype == torch.float32 else 1e-4  # 16-bit q.k summed in another order
        torch.testing.assert_close(lse, want_lse[:lse.shape[0]], rtol=tol, atol=tol,
                                   msg=f"{what}: log-sum-exp, {splits} splits")
        return out

    want, want_lse = paged_decode_reference(q, cache, table, rows)
    what = f"paged_decode {dtype} lengths {lengths} page {page} splits {splits} rows {rows}"
    got = attend(q, table, splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    if dtype == torch.float32:
        close(got, want, what)
    else:  # the kernel rounds the softmax weights to the values' dtype for the dot
        eps = torch.finfo(dtype).eps
        bound = 2 * eps * want.float().abs() + eps / 2 * cache.float().abs().max() + 1e-3
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= bound).all()), f"{what}: max diff {diff.max():.3g}"
    # A sequence's output depends on its own keys alone: the first by itself agrees, with
    # one split or many.
    for count in (1, splits + 3):
        alone = attend(q[:rows].contiguous(), table[:1].contiguous(), count)
        close(alone, got[:rows], f"{what}: the first sequence alone, {count} splits",
              scale=want[:rows])


def run_paged_decode(device: str) -> None:
    # one key; a length inside one page; more splits than pages (empty splits)
    check_paged_decode(device, torch.float32, [1, 5, 40], 16, 4, 2, 32, splits=8)
    # the 8B head shape (GQA group 4, head dim 128) in bf16, lengths across many pages
    check_paged_decode(device, torch.bfloat16, [513, 77, 300], 16, 32, 8, 128, splits=16)
    # no GQA, pages of 4 slots (blocks span pages), fp16, one split
    check_paged_decode(device, torch.float16, [33, 64], 4, 4, 4, 64, splits=1, block_n=16)
    # a group of 8 (BLOCK_G 16 rows, half padding), 64-key blocks, odd splits
    check_paged_decode(device, torch.float32, [200, 3], 16, 16, 2, 64, splits=5, block_n=64)
    # a verify step's prefix: 9 rows a sequence over its keys (GQA group 4: 36 of 64 rows)
    check_paged_decode(device, torch.bfloat16, [300, 17], 16, 32, 8, 128, splits=8, rows=9)
    # rows without GQA, a one-key sequence, empty splits
    check_paged_decode(device, torch.float32, [1, 45], 16, 2, 2, 32, splits=6, rows=4)
    # a large tree's rows: 17 rows of a group of 4 are 68 (row, head) pairs, in two blocks of
    # 64 (the second with 4); 33 rows of a group of 2, 66 pairs, with 3 splits
    check_paged_decode(device, torch.float32, [70, 9], 16, 8, 2, 32, splits=2, rows=17)
    check_paged_decode(device, torch.float32, [40], 16, 4, 2, 32, splits=3, rows=33)
    run_table_prefix(device)


def run_table_prefix(device: str) -> None:
    """TablePrefix (the verify and drafting prefix attention on CUDA), as a graph holds it and
    as eager drafting does, against TorchPrefix: sequences of different lengths on shuffled
    pages, several rows each, planned twice (the second plan must replace the first's
    lengths and pages)."""
    from splitspec.attention.cascade import TorchPrefix
    from splitspec.attention.decode_table import TablePrefix, scratch_floats
    from splitspec.attention.flashinfer_backend import AttentionShape
    from splitspec.kv_cache import PageTable

    heads, kv_heads, dim, page, rows = 8, 2, 32, 4, 3
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(2, 40, page, kv_heads, dim, torch.float32, device)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    order = torch.randperm(40, generator=gen).tolist()
    shape = AttentionShape(heads, kv_heads, dim, page, torch.float32)
    need = scratch_floats(shape, 3, rows, device)  # as a graph holds it, in a shared scratch
    table = TablePrefix(shape, device, 3, rows, 12, torch.full((need + 5,), 7.0, device=device))
    eager = TablePrefix(shape, device)  # sized by each plan
    for lengths in ([5, 40, 17], [1, 9, 33]):
        tables = [PageTable(page, order[12 * b:12 * b + -(-n // page)], n)
                  for b, n in enumerate(lengths)]
        q = torch.randn(len(lengths) * rows, heads, dim, generator=gen).to(device)
        results = []
        for prefix in (TorchPrefix(), table, eager):
            prefix.plan(tables, lengths, rows, torch.device(device))
            out, lse = prefix.attend(1, q, cache)
            results.append((out, lse * prefix.lse_scale))  # natural log for all
        (out_ref, lse_ref), *tried = results
        for (out, lse), what in zip(tried, ("a graph's", "eager"), strict=True):
            close(out, out_ref, f"TablePrefix ({what}) lengths {lengths}")
            close(lse, lse_ref, f"TablePrefix ({what}) lengths {lengths}: log-sum-exp")


def run_gemv(device: str) -> None:
    """splitspec.kernels.gemv against torch's linear: rows of W not a multiple of the block,
    columns a multiple of the loop's step or not, a W whose rows are not K apart, a [K] row
    and a [1, K] one."""
    from splitspec.kernels.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(5)
    cases = [(torch.float32, 37, 96, GemvConfig(8, 32, 4)),   # K a multiple of the step
             (torch.float32, 40, 100, GemvConfig(16, 32, 4)),  # K not: a masked last step
             (torch.bfloat16, 29, 200, GemvConfig(4, 64, 2)),
             (torch.float16, 64, 48, GemvConfig(8, 128, 4))]   # one step wider than K
    for dtype, n, k, config in cases:
        wide = (torch.randn(n + 7, k + 9, generator=gen) / k ** 0.5).to(dtype).to(device)
        w = wide[3:3 + n, 2:2 + k]  # part of a larger weight: its rows K + 9 apart
        x = torch.randn(1, k, generator=gen).to(dtype).to(device)
        want = (x.float() @ w.float().T).to(dtype)  # float32 sums, one rounding
        got = gemv(x, w, config)
        assert got.shape == (1, n) and got.dtype == dtype
        close(got, want, f"gemv {dtype} N={n} K={k} {config}", scale=want.abs() + 1e-2)
        flat = gemv(x.reshape(k), w, config)
        assert flat.shape == (n,) and torch.equal(flat, got.reshape(n))


def run_few_rows(device: str) -> None:
    """splitspec.kernels.gemv.few_rows against torch's linear: 2 to 64 rows (padded to 16, 32,
    64), rows of x and of W strided, N not a multiple of the block, K a multiple of the loop's
    step or not, a step wider than K; and linear's routing of them through ROW_CONFIGS (the
    2-byte dtypes' only)."""
    from splitspec.kernels import gemv as module
    from splitspec.kernels.gemv import GemvConfig, few_rows

    gen = torch.Generator().manual_seed(6)
    cases = [(torch.float32, 5, 37, 96, GemvConfig(16, 32, 4)),     # K a multiple of the step
             (torch.float32, 16, 40, 100, GemvConfig(16, 32, 4)),   # K not: a masked last step
             (torch.bfloat16, 40, 29, 200, GemvConfig(16, 64, 4)),  # 64 rows computed, 40 kept
             (torch.float16, 2, 64, 48, GemvConfig(32, 64, 4, 2))]  # one step wider than K
    for dtype, m, n, k, config in cases:
        wide = (torch.randn(n + 7, k + 9, generator=gen) / k ** 0.5).to(dtype).to(device)
        w = wide[3:3 + n, 2:2 + k]  # part of a larger weight: its rows K + 9 apart
        xs = torch.randn(m, k + 5, generator=gen).to(dtype).to(device)
        x = xs[:, 5:]  # rows K + 5 apart
        want = (x.float() @ w.float().T).to(dtype)  # float32 sums, one rounding
        got = few_rows(x, w, config)
        assert got.shape == (m, n) and got.dtype == dtype
        close(got, want, f"few_rows {dtype} M={m} N={n} K={k} {config}",
              scale=want.abs() + 1e-2)
        # linear: the rows of a [.., K] x through few_rows where ROW_CONFIGS lists the shape,
        # in a 2-byte dtype (float32's go to torch: the configs' tiles are bfloat16's)
        pad = module.padded_rows(m)
        saved = dict(module.ROW_CONFIGS)
        module.ROW_CONFIGS[(pad, n, k)] = config
        calls: list[int] = []
        module.few_rows = lambda *args, seen=calls: seen.append(1) or few_rows(*args)
        try:
            routed = module.linear(x.reshape(1, m, k), w)
        finally:
            module.few_rows = few_rows
            module.ROW_CONFIGS.clear()
            module.ROW_CONFIGS.update(saved)
        assert routed.shape == (1, m, n) and len(calls) == (dtype != torch.float32)
        assert torch.equal(routed[0], got if calls else torch.nn.functional.linear(x, w))


def run_fp8_rows(device: str) -> None:
    """splitspec.kernels.gemv.fp8_rows against fp8_linear_torch: 1 to 64 rows, rows of x
    strided, N not a multiple of the block, K a multiple of the loop's step or not, K split
    between programs (split_k) or not; and linear's routing of an fp8 weight (1 to 64 rows of
    a 2-byte x through fp8_rows, more, or float32 ones, through the weight it was made from).
    Compiled, a 2-byte x is multiplied in float16 (the interpreter runs float32 products):
    within two of x's rounding steps of the reference, which is held to differ from the
    unrounded weight's product by more than that."""
    from splitspec.kernels import fp8_linear_torch, quantize_fp8
    from splitspec.kernels import gemv as module
    from splitspec.kernels.gemv import GemvConfig, fp8_rows

    gen = torch.Generator().manual_seed(8)
    cases = [(torch.float32, 1, 37, 96, GemvConfig(16, 32, 4)),    # one row, K a multiple
             (torch.float32, 16, 40, 100, GemvConfig(16, 32, 4)),  # K not: a masked last step
             (torch.bfloat16, 40, 29, 200, GemvConfig(32, 64, 4)),  # 64 rows computed, 40 kept
             (torch.bfloat16, 4, 70, 48, GemvConfig(64, 64, 4, 2)),  # one step wider than K
             (torch.float16, 64, 33, 128, GemvConfig(16, 64, 4)),
             # K shared by 3 programs a block (the last one's columns partly past K), then
             # by 4 where the last has none
             (torch.bfloat16, 5, 40, 200, GemvConfig(16, 32, 4, 3, 3)),
             (torch.float32, 3, 24, 100, GemvConfig(16, 64, 4, 3, 4))]
    for dtype, m, n, k, config in cases:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
        fp8 = quantize_fp8(w)
        xs = torch.randn(m, k + 5, generator=gen).to(dtype).to(device)
        x = xs[:, 5:]  # rows K + 5 apart
        want = fp8_linear_torch(x, fp8)
        got = fp8_rows(x, fp8, config)
        assert got.shape == (m, n) and got.dtype == dtype
        what = f"fp8_rows {dtype} M={m} N={n} K={k} {config}"
        close(got, want, what, scale=want.abs() + 1e-2)
        unrounded = (x.float() @ w.float().T).to(dtype)
        assert not torch.equal(want, unrounded), f"{what}: the fp8 weight is the weight"
        # linear: up to 64 rows of [.., K] through fp8_rows, more through the full weight
        saved = dict(module.FP8_CONFIGS)
        module.FP8_CONFIGS[(n, k)] = config
        calls: list[int] = []
        module.fp8_rows = lambda *args, seen=calls: seen.append(1) or fp8_rows(*args)
        try:
            routed = module.linear(x.reshape(1, m, k), fp8)
            many = torch.randn(65, k, generator=gen).to(dtype).to(device)
            wide = module.linear(many, fp8)
        finally:
            module.fp8_rows = fp8_rows
            module.FP8_CONFIGS.clear()
            module.FP8_CONFIGS.update(saved)
        assert len(calls) == (dtype != torch.float32)  # float32 rows: through W
        assert routed.shape == (1, m, n)
        assert torch.equal(routed[0], got if calls else module.linear(x, w))
        assert torch.equal(wide, module.linear(many, w)), f"{what}: 65 rows not through W"
    if device == "cuda":  # the shipped configs (split K, stages cut to fit at 33-64 rows)
        for (n, k), config in module.FP8_CONFIGS.items():
            fp8 = quantize_fp8(torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5)
            for m in (1, 20, 40):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                want = fp8_linear_torch(x, fp8)
                close(module.linear(x, fp8), want, f"linear fp8 M={m} N={n} K={k} {config}",
                      scale=want.abs() + 1e-2)


def run_top_logprobs(device: str) -> None:
    """splitspec.kernels.top_logprobs's kernels against a stable descending sort and torch's
    log_softmax: rows of one chunk and of several (the last one partial), equal logits within
    a chunk and across chunks (index order), rows strided, k = V, k = 1, a small block."""
    from splitspec.kernels.top_logprobs import BLOCK
    from splitspec.kernels.top_logprobs import top_logprobs_kernels as top_logprobs

    gen = torch.Generator().manual_seed(11)
    cases = [(torch.float32, 3, 2 * BLOCK + 904, 4), (torch.bfloat16, 5, 2 * BLOCK + 1, 8),
             (torch.float16, 1, BLOCK, 1), (torch.float32, 2, 6, 6), (torch.bfloat16, 4, 300, 5)]
    for dtype, rows, width, k in cases:
        wide = (torch.randn(rows, width + 10, generator=gen) * 4).to(dtype)
        if width > BLOCK:  # row 0: its maximum five times, in two chunks, out of index order
            wide[0, [BLOCK + 7, 5, width - 1, 9, BLOCK]] = 30.0
        if dtype == torch.bfloat16:  # a coarse grid: many equal logits below the top too
            wide = (wide * 2).round() / 2
        x = wide[:, :width].to(device)  # rows width + 10 apart
        lp, ids = top_logprobs(x, k)
        assert lp.shape == ids.shape == (rows, k) and lp.dtype == torch.float32
        assert ids.dtype == torch.int64
        order = torch.sort(x.float().cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids.cpu(), order), (dtype, rows, width, k, ids, order)
        want = torch.log_softmax(x.float(), dim=-1).gather(1, ids)
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-6, msg=f"{dtype} {rows}x{width} k={k}")
    # a small block: many chunks, the merge's candidates not a power of two (7 x 3)
    x = (torch.randn(3, 400, generator=gen) * 2).round().to(device)  # many equal logits
    lp, ids = top_logprobs(x, 3, block=64, num_warps=2)
    order = torch.sort(x.cpu(), dim=-1, descending=True, stable=True).indices[:, :3]
    assert torch.equal(ids.cpu(), order)
    torch.testing.assert_close(lp, torch.log_softmax(x, dim=-1).gather(1, ids), rtol=0, atol=2e-6)


class EveryShape(dict):
    """A CONFIGS / ROW_CONFIGS stand-in that lists every shape: all projections take the
    kernels (the shapes the real tables list are measured ones, none of a tiny model's)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def get(self, key, default=None):
        return self.config


WIRED = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
WIRED_DRAFT_VOCAB = 80


def run_wired_projections(device: str) -> None:
    """A small target and its EAGLE-3 head with the Triton kernels on, every projection
    through splitspec.kernels.gemv (one row and a few), against the same weights through
    torch: the logits and the head's top 3 log-probabilities agree, each projection of both
    models went through ``linear``, and the head's top 3 through the top-k kernels (with
    top_logprobs.ROUTED set, as it is by default since the H200 measured them)."""
    from splitspec.kernels import fused_ops
    from splitspec.kernels import gemv as module
    from splitspec.kernels import top_logprobs as ranking

    seen: list[tuple[int, tuple[int, ...]]] = []
    plain_linear, plain_top = fused_ops.linear, ranking.top_logprobs_kernels
    ranked: list[tuple[int, ...]] = []

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append((x.numel() // w.shape[1], tuple(w.shape)))
        return plain_linear(x, w)

    def counted_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # the kernels
        ranked.append((*logits.shape, k))
        return plain_top(logits, k)

    saved = (fused_ops.linear, ranking.top_logprobs_kernels, ranking.ROUTED, module.CONFIGS,
             module.ROW_CONFIGS)
    fused_ops.linear, ranking.top_logprobs_kernels, ranking.ROUTED = counted, counted_top, True
    module.CONFIGS = EveryShape(module.GemvConfig(16, 32, 4))
    module.ROW_CONFIGS = EveryShape(module.GemvConfig(16, 32, 4))
    try:  # on a GPU this runs in the tests' process: the tables go back after
        results = _wired_logits(device)
    finally:
        (fused_ops.linear, ranking.top_logprobs_kernels, ranking.ROUTED, module.CONFIGS,
         module.ROW_CONFIGS) = saved
    for fused, plain in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert ranked == [(6, WIRED_DRAFT_VOCAB, 3), (1, WIRED_DRAFT_VOCAB, 3)], ranked
    h, inter, vocab = WIRED["hidden_size"], WIRED["intermediate_size"], WIRED["vocab_size"]
    qkv = (4 + 2 * 2) * 16
    layer = {(h, h), (2 * inter, h), (h, inter)}  # o_proj, gate_up, down: the same in both
    want = ({(qkv, h), (vocab, h)} | layer  # the target's qkv and lm_head
            | {(h, 3 * h), (qkv, 2 * h), (WIRED_DRAFT_VOCAB, h)})  # the head's fc, qkv, lm_head
    for rows in (6, 1):
        assert {w for r, w in seen if r == rows} == want, (rows, sorted(want), sorted(seen))


def _wired_logits(device: str) -> list[list[torch.Tensor]]:
    """A small target's and its EAGLE-3 head's logits (and the head's top 3 log-probabilities
    and ids) for a prompt of 6 then one decode row, with the Triton kernels on, then off."""
    import tempfile
    from pathlib import Path

    from splitspec.attention import SeqAttention, TorchAttentionBackend
    from splitspec.builtin import build
    from splitspec.kv_cache import KVCache, PagePool, PageTable
    from splitspec.model.layers import AttentionContext, use_fused_kernels
    from splitspec.model.loader import load_eagle3, load_llama

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = build.write_llama(Path(tmp) / "t", WIRED, seed=3)
        head_dir = build.write_eagle3_head(Path(tmp) / "e", target_dir,
                                           draft_vocab_size=WIRED_DRAFT_VOCAB)
        target = load_llama(target_dir, torch.float32, device)
        head = load_eagle3(head_dir, torch.float32, device)
    cfg, backend = target.config, TorchAttentionBackend()
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=gen).to(device)
    features = torch.randn(7, 3 * cfg.hidden_size, generator=gen).to(device)
    results = []
    for on in (True, False):
        use_fused_kernels(target, on)
        use_fused_kernels(head, on)
        outputs = []
        for model, layers in ((target, cfg.num_layers), (head, 1)):
            cache = KVCache(layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
            table = PageTable(16)
            table.reserve(PagePool(2), 7)
            for rows, start in ((6, 0), (1, 6)):  # a prompt of 6, then one decode row
                ids, pos = prompt[start:start + rows], torch.arange(start, start + rows)
                attn = SeqAttention(table, start + rows, rows)
                ctx = AttentionContext(backend, backend.plan([attn], device), cache)
                with torch.inference_mode():
                    if model is target:
                        outputs.append(target.compute_logits(
                            target(ids, pos.to(device), ctx).hidden))
                    else:
                        out = head(ids, head.fuse(features[start:start + rows]),
                                   pos.to(device), ctx)
                        outputs += [out.logits, *head.top_logprobs(out.g, 3)]
        results.append(outputs)
    return results


def run_tree_level(device: str) -> None:
    """splitspec.kernels.tree_level's kernel against tree_level_torch: the root's level and
    later ones, picking a next frontier or not (the last level, a depth-1 tree), topk 1, 3, 4
    and 5 (25 candidates: the next block), draft ids mapped or not, log-probs in strided rows
    as the top-k kernels give them, equal scores (candidate order), -inf log-probs, states
    wider than a copy step and ancestor tables wider than one, float32 and bfloat16 states."""
    from splitspec.kernels import Frontier, tree_level_torch
    from splitspec.kernels.tree_level import SEEN_BLOCK, STATES_BLOCK, tree_level

    gen = torch.Generator().manual_seed(5)

    def inputs(b: int, f: int, k: int, x: int, t: int, dtype: torch.dtype, vocab: int):
        wide = -torch.rand(b * f, k + 3, generator=gen).sort(dim=1, descending=True).values
        wide = (wide * 4).round() / 4  # a coarse grid: equal log-probs, and equal scores
        if k > 1:
            wide[0, k - 1] = float("-inf")
        lp = wide.to(device)[:, :k]  # rows k + 3 apart
        ids = torch.randint(0, vocab, (b * f, k + 3), generator=gen).to(device)[:, :k]
        states = torch.randn(b * f, x, generator=gen).to(dtype).to(device)
        allowed = (torch.rand(b, k, t, generator=gen) < 0.5).to(device)
        front = None
        if f > 1:
            score = (-torch.rand(b, k, generator=gen) * 2).round().double().to(device)
            front = Frontier(score, torch.randint(0, vocab, (b, k), generator=gen).to(device),
                             torch.randint(0, 90, (b, k), generator=gen).to(device),
                             states, allowed)
        return lp, ids, front, states, allowed

    x_wide, t_wide = STATES_BLOCK + 37, SEEN_BLOCK + 11
    cases = [  # (B, root, k, X, T, select, mapped, dtype)
        (3, True, 4, x_wide, 12, True, True, torch.bfloat16),
        (3, False, 4, x_wide, t_wide, True, True, torch.bfloat16),
        (2, False, 4, 40, 20, False, True, torch.float32),
        (2, True, 4, 40, 0, False, False, torch.float32),
        (4, False, 1, 64, 6, True, True, torch.float32),
        (2, False, 3, 48, 15, True, False, torch.bfloat16),
        (1, False, 5, 32, 25, True, True, torch.float32),
    ]
    for b, root, k, x, t, select, mapped, dtype in cases:
        f = 1 if root else k
        vocab = 50
        d2t = torch.randint(0, 30, (vocab,), generator=gen).to(device) if mapped else None
        lp, ids, front, states, allowed = inputs(b, f, k, x, t, dtype, vocab)
        width, col, eye_col = 100, 7, max(t - k - 2, 0) if select else 0
        got_packed, want_packed = (torch.full((3, b, width), 12345.0, dtype=torch.float64,
                                              device=device) for _ in range(2))
        got = tree_level(lp, ids, d2t, front, got_packed, col, select, states, allowed, eye_col)
        want = tree_level_torch(lp, ids, d2t, front, want_packed, col, select, states, allowed,
                                eye_col)
        what = (b, root, k, x, t, select, mapped, dtype)
        assert torch.equal(got_packed, want_packed), what
        assert (got is None) == (want is None) == (not select), what
        if select:
            for name, g, w in zip(Frontier._fields, got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), (what, name, g, w)
            scores = want.score
            assert bool((scores[:, :-1] >= scores[:, 1:]).all()), what  # sorted
    # the ties are real: some level above has equal scores among its best k
    lp, ids, front, states, allowed = inputs(2, 4, 4, 16, 8, torch.float32, 50)
    packed = torch.zeros(3, 2, 40, dtype=torch.float64, device=device)
    scores = tree_level_torch(lp, ids, None, front, packed, 0, True, states, allowed, 4).score
    assert bool((scores[:, :-1] == scores[:, 1:]).any())
