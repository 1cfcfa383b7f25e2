"""Cases of the Triton kernels against their torch references, run by tests/test_kernels.py
(in the interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

import torch

from splitspec.kernels.kv_compact import compact_kv
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
    # nothing to move
    check(device, 1, 2, 4, 1, 32, torch.float32, [], [])
    assert changed == 4
