"""The torch backend's padded groups against the same attention one sequence at a time."""

import pytest
import torch

from splitspec.attention import SeqAttention, TorchAttentionBackend
from splitspec.attention.torch_backend import attend_each
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.tree import ancestor_mask

PAGE, HEADS, KV_HEADS, DIM, LAYERS = 4, 4, 2, 8, 2


def pass_of(seqs: list[tuple[int, int, str]], dtype: torch.dtype, seed: int = 0
            ) -> tuple[list[SeqAttention], KVCache]:
    """Sequences (kv_len, q_len, kind: causal, tree or mask) over pages taken out of order
    from one pool, every slot before the new tokens filled with random K/V."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(LAYERS, 64, PAGE, KV_HEADS, DIM, dtype, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(dtype))
    pool = PagePool(64)
    pool.allocate(5)
    out = []
    for kv_len, q_len, kind in seqs:
        table = PageTable(PAGE)
        table.reserve(pool, kv_len + int(torch.randint(0, 6, (), generator=gen)))
        pool.allocate(1)  # a gap, so no two sequences' pages are next to each other
        mask = tree = None
        if kind == "tree":  # a root and q_len - 1 nodes, each under a random earlier one
            parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(q_len - 1)]
            tree = ancestor_mask(parents)
        elif kind == "mask":
            mask = torch.rand(q_len, kv_len, generator=gen) < 0.6
            mask[:, 0] = True  # every row sees something
        out.append(SeqAttention(table, kv_len, q_len, mask, tree))
    return out, cache


PASSES = {
    "one decode": [(9, 1, "causal")],
    "decodes of different lengths": [(9, 1, "causal"), (30, 1, "causal"), (1, 1, "causal")],
    "verify trees": [(14, 5, "tree"), (22, 5, "tree")],
    "mixed": [(7, 7, "causal"), (19, 1, "causal"), (12, 4, "tree"), (25, 4, "tree"),
              (10, 3, "mask"), (33, 1, "causal"), (5, 5, "causal")],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(PASSES))
def test_padded_groups_match_one_sequence_at_a_time(name, dtype):
    seqs, cache = pass_of(PASSES[name], dtype)
    tokens = sum(s.q_len for s in seqs)
    gen = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    meta = backend.plan(seqs, "cpu")
    assert len(meta.groups) == len({s.q_len for s in seqs})
    for layer in range(LAYERS):
        q = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
        k = torch.randn(tokens, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(tokens, KV_HEADS, DIM, generator=gen).to(dtype)
        got = backend.forward(layer, q, k, v, meta, cache)
        want = attend_each(q, seqs, cache, layer)  # the new K/V are in the cache by now
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_wrong_mask_is_caught():
    """The check can fail: one tree's mask loosened in the padded pass only."""
    seqs, cache = pass_of(PASSES["verify trees"], torch.float32)
    backend = TorchAttentionBackend()
    meta = backend.plan(seqs, "cpu")
    meta.groups[0].mask[1, 2:, :] = True  # the second tree's nodes see every node
    q = torch.randn(10, HEADS, DIM)
    kv = torch.randn(10, KV_HEADS, DIM)
    got = backend.forward(0, q, kv, kv, meta, cache)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, attend_each(q, seqs, cache, 0))
