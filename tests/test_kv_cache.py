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
    assert table.slots([5, 0, 3]) == [slots[5], slots[0], slots[3]]  # the same, on the host
    with pytest.raises(IndexError, match="logical slot 8"):
        table.slots([1, 8])
    with pytest.raises(IndexError, match="logical slot -1"):
        table.slots([-1])
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


def test_a_table_row_holds_a_sequences_length_and_its_pages_up_to_it():
    """The tables the paged-attention kernel reads (splitspec/attention/decode_table.py)."""
    import numpy as np

    from splitspec.attention.decode_table import fill_table

    tables = [PageTable(4, [7, 2, 9], 10), PageTable(4, [5], 3)]
    table = np.full((2, 4), -1, dtype=np.int32)
    fill_table(tables, [9, 3], 4, table)
    assert table.tolist() == [[9, 7, 2, 9], [3, 5, -1, -1]]  # past a row's pages: untouched
    fill_table(tables, [5, 1], 4, table)
    assert table[:, :3].tolist() == [[5, 7, 2], [1, 5, -1]]
    for lengths in ([9, 0], [13, 1], [9, 5]):  # empty; more than the pages reserved (twice)
        with pytest.raises(ValueError, match="0 < length"):
            fill_table(tables, lengths, 4, table)
    with pytest.raises(ValueError, match="0 < length"):  # more than the table's width holds
        fill_table(tables[:1], [9], 4, np.zeros((1, 2), dtype=np.int32))


def test_torch_prefix_attends_prefix_and_dense_keys_in_one_softmax_and_rereads_on_plan():
    """TorchPrefix.attend_with (one softmax over the prefix and the dense keys) equals the
    two parts merged by log-sum-exp, for rows fewer than planned too; and a new plan reads
    the cache again (each layer's prefix K/V are kept only between plans)."""
    from splitspec.attention.cascade import TorchPrefix, masked_attention, merge_attention

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, page = 4, 2, 16, 4
    cache = KVCache(2, 12, page, kv_heads, dim, torch.float32, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    tables = [PageTable(page, [7, 2, 9], 10), PageTable(page, [5, 0], 6)]
    prefix = TorchPrefix()
    prefix.plan(tables, [9, 3], 4, "cpu")
    for width in (4, 2):  # as planned; fewer rows (a drafting level after the catch-up)
        q = torch.randn(2 * width, heads, dim, generator=gen)
        keys = torch.randn(2, 5, kv_heads, dim, generator=gen)
        values = torch.randn(2, 5, kv_heads, dim, generator=gen)
        allowed = torch.rand(2, width, 5, generator=gen) < 0.5
        allowed[:, :, 0] = True
        out_p, lse_p = prefix.attend(1, q, cache)
        out_t, lse_t = masked_attention(q.view(2, width, kv_heads, -1, dim), keys, values, allowed)
        want = merge_attention(out_p, lse_p, out_t.reshape(q.shape), lse_t.reshape(q.shape[:2]))
        got = prefix.attend_with(1, q, cache, keys, values, allowed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    before = prefix.attend(1, q, cache)[0]
    cache.data[1].add_(1.0)  # new K/V for the same slots, then a new plan
    prefix.plan(tables, [9, 3], 4, "cpu")
    assert not torch.allclose(prefix.attend(1, q, cache)[0], before)


def test_shared_scratch_is_carved_per_shape_and_refused_when_too_small():
    from splitspec.attention.decode_table import carve, scratch_floats
    from splitspec.attention.flashinfer_backend import AttentionShape

    shape = AttentionShape(8, 2, 32, 16, torch.float32)
    need = scratch_floats(shape, 3, 4, "cpu")
    splits, out, lse, merged = carve(torch.zeros(need + 3), shape, 3, 4)
    assert splits == 1  # one "processor" off CUDA
    assert out.shape == (12, 8, 1, 32) and lse.shape == (12, 8, 1) and merged.shape == (12, 8)
    assert out.data_ptr() < lse.data_ptr() < merged.data_ptr()  # disjoint views, in order
    with pytest.raises(ValueError, match="scratch of"):
        carve(torch.zeros(need - 1), shape, 3, 4)
    with pytest.raises(ValueError, match="scratch of"):
        carve(torch.zeros(need, dtype=torch.float64), shape, 3, 4)


def test_splits_fill_four_waves_of_blocks_within_bounds():
    from splitspec.attention.decode_table import splits_for

    # the H200's 132 SMs, the 8B shape's 8 KV heads: the best measured at batch 1-32
    assert [splits_for(b, 8, 132) for b in (1, 4, 8, 16, 32)] == [32, 16, 8, 4, 2]
    assert splits_for(64, 8, 132) == 1 and splits_for(1000, 8, 132) == 1  # at least one
    assert splits_for(1, 1, 132) == 32  # at most 32
    assert splits_for(3, 2, 1) == 1  # the interpreter's one "processor"


def test_new_token_slots_and_flashinfers_page_lists():
    """Where a pass writes its new K/V (the last q_len of each sequence's kv_len slots), and
    the page lists flashinfer plans from (splitspec/attention/flashinfer_backend.py)."""
    from splitspec.attention.base import SeqAttention, new_token_slots
    from splitspec.attention.flashinfer_backend import PagedLayout

    seqs = [SeqAttention(PageTable(4, [7, 2, 9], 10), kv_len=9, q_len=3),
            SeqAttention(PageTable(4, [5], 3), kv_len=3, q_len=1)]
    assert new_token_slots(seqs) == [2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 5 * 4 + 2]
    layout = PagedLayout.of(seqs, 4)
    assert layout.write_slots.tolist() == new_token_slots(seqs)
    assert layout.qo_indptr.tolist() == [0, 3, 4]
    assert layout.kv_indptr.tolist() == [0, 3, 4] and layout.kv_indices.tolist() == [7, 2, 9, 5]
    assert layout.last_page_len.tolist() == [1, 3]
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        new_token_slots([SeqAttention(PageTable(4, [5], 3), kv_len=2, q_len=3)])
    with pytest.raises(IndexError, match="exceeds the 4 slots"):
        new_token_slots([SeqAttention(PageTable(4, [5], 3), kv_len=5, q_len=1)])


def test_memory_shortfall_names_what_does_not_fit_on_a_gpu(monkeypatch):
    """The start-up steps that allocate a cache check the device's free memory first."""
    from splitspec.kv_cache import memory_shortfall

    assert memory_shortfall(2**40, "cpu", "KV cache") == ""  # host memory is not checked
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 2**34))
    assert memory_shortfall(2**29, "cuda:0", "KV cache") == ""
    assert memory_shortfall(3 * 2**30, "cuda:0", "KV cache") == (
        "KV cache needs 3.0 GiB but 1.0 GiB is free")
