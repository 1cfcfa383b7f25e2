"""Page bookkeeping and the K/V pool."""

import pytest
import torch

from splitspec.kv_cache import KVCache, OutOfPages, PagePool, PageTable


def test_pool_allocates_and_frees():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(OutOfPages, match="asked for 2 pages, 1 of 4 free"):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4


def test_page_table_maps_logical_to_global_slots():
    pool = PagePool(8)
    pool.allocate(1)  # so the table's pages are not 0, 1, ...
    table = PageTable(page_size=4)
    table.reserve(pool, 6)
    assert len(table.pages) == 2
    slots = table.global_slots(0, 6).tolist()
    p0, p1 = table.pages
    assert slots == [p0 * 4, p0 * 4 + 1, p0 * 4 + 2, p0 * 4 + 3, p1 * 4, p1 * 4 + 1]
    with pytest.raises(IndexError):
        table.global_slots(0, 9)
    table.release(pool)
    assert pool.num_free == 7 and table.pages == []


def test_write_then_copy_slots_moves_every_layer():
    torch.manual_seed(0)
    cache = KVCache(num_layers=3, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float32, device="cpu")
    slots = torch.tensor([1, 2, 5, 6, 9])
    k, v = torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2, 8)
    for layer in range(3):
        cache.write(layer, slots, k[layer], v[layer])
    # compact nodes at slots 5 and 9 down to 2 and 3 (overlapping src/dst is allowed)
    cache.copy_slots(torch.tensor([5, 9]), torch.tensor([2, 3]))
    for layer in range(3):
        k_got, v_got = cache.read(layer, torch.tensor([1, 2, 3]))
        assert torch.equal(k_got[1], k[layer, 2]) and torch.equal(k_got[2], k[layer, 4])
        assert torch.equal(v_got[1], v[layer, 2]) and torch.equal(v_got[2], v[layer, 4])
        assert torch.equal(k_got[0], k[layer, 0])


def test_repeated_rows_list_each_sequences_pages_once_per_row():
    from splitspec.attention.cascade import repeated_rows

    tables = [PageTable(4, [7, 2, 9], 10), PageTable(4, [5], 3)]
    indptr, indices, last = repeated_rows(tables, [9, 3], 2, 4)
    assert indptr.tolist() == [0, 3, 6, 7, 8]
    assert indices.tolist() == [7, 2, 9, 7, 2, 9, 5, 5]
    assert last.tolist() == [1, 1, 3, 3]
    with pytest.raises(ValueError, match="prefix of 0 slots"):
        repeated_rows(tables, [9, 0], 1, 4)
