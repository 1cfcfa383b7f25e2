"""Triton kernels against their torch references.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in a
subprocess so that no other test's Triton is affected); on a GPU (marked
``gpu``) they run compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cases", ["run", "run_fused", "run_tree", "run_prompts",
                                   "run_paged_decode", "run_gemv", "run_few_rows",
                                   "run_fp8_rows", "run_wired_projections",
                                   "run_top_logprobs", "run_tree_level"])
def test_kernels_match_torch_in_the_interpreter(cases):
    """run: KV compaction; run_fused: norms, rotary, SiLU-and-multiply, the KV store;
    run_tree: the draft's tree-node attention and merge; run_prompts: packed prompts' causal
    attention; run_paged_decode: decode attention over the paged cache, split and merged, one
    row or several a sequence (the verify and drafting prefix, TablePrefix); run_gemv and
    run_few_rows: a projection of one row and of a few; run_fp8_rows: a few rows through a
    weight in fp8; run_wired_projections: a small target
    and head with every projection through them; run_top_logprobs: the draft's top k;
    run_tree_level: a level of the draft's tree search after its top k."""
    code = f"from tests.kernel_cases import {cases}; {cases}('cpu'); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Every kernel of splitspec/kernels compiles for sm_90 through its wrapper at the
    built-in and the 8B shape's sizes, float32 and bfloat16, each variant within the GPU's
    shared memory (tests/kernel_variants.py; in a process of its own: it stands in for the
    GPU's driver). The float32 rows that ROW_CONFIGS' bfloat16 tiles would overflow are the
    case it found."""
    from triton.runtime import driver

    if not hasattr(driver, "_active"):  # the stand-in is written against Triton 3.9's
        pytest.skip("this Triton's driver config has no _active: no stand-in driver for it")
    done = subprocess.run([sys.executable, "-m", "tests.kernel_variants"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path),
                               "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "never compiled: none; over 232448 B of shared memory: none" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("cases", ["run", "run_fused", "run_tree", "run_prompts",
                                   "run_paged_decode", "run_gemv", "run_few_rows",
                                   "run_fp8_rows", "run_wired_projections",
                                   "run_top_logprobs", "run_tree_level"])
def test_kernels_match_torch_on_the_gpu(cases):
    import tests.kernel_cases

    getattr(tests.kernel_cases, cases)("cuda")


def test_bad_slot_lists_are_refused():
    from splitspec.kernels.kv_compact import compact_kv

    data = torch.zeros(1, 2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="equal 1-D"):
        compact_kv(data, torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="contiguous"):
        compact_kv(data.transpose(2, 3), torch.tensor([1]), torch.tensor([0]))


def test_paged_decode_refuses_inconsistent_inputs():
    from splitspec.kernels.paged_decode import paged_decode_attention

    q = torch.zeros(2, 4, 32)
    cache = torch.zeros(3, 2, 16, 2, 32)
    table = torch.ones(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="inconsistent inputs"):
        paged_decode_attention(q, cache, table.long(), 4)  # the table must be int32
    with pytest.raises(ValueError, match="inconsistent inputs"):
        paged_decode_attention(q, cache, table[:1], 4)  # a row per sequence
    with pytest.raises(ValueError, match="scratch"):  # scratch for 2 splits, 4 asked
        paged_decode_attention(q, cache, table, 4, torch.zeros(2, 4, 2, 32), torch.zeros(2, 4, 2))


def test_gemv_refuses_what_it_cannot_multiply():
    from splitspec.kernels.gemv import GemvConfig, gemv

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="one row of 16"):
        gemv(torch.zeros(2, 16), w)  # two rows
    with pytest.raises(ValueError, match="in w's dtype"):
        gemv(torch.zeros(1, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="columns contiguous"):
        gemv(torch.zeros(1, 8), w.T)
    with pytest.raises(ValueError, match="powers of two"):
        gemv(torch.zeros(1, 16), w, GemvConfig(block_n=6))


def test_fp8_rows_refuses_what_it_cannot_multiply():
    from splitspec.kernels import Fp8Weight, quantize_fp8
    from splitspec.kernels.gemv import GemvConfig, fp8_rows

    w = quantize_fp8(torch.ones(8, 16))
    with pytest.raises(ValueError, match="rows of 16"):
        fp8_rows(torch.zeros(2, 8), w)
    with pytest.raises(ValueError, match="codes"):
        fp8_rows(torch.zeros(2, 16), Fp8Weight(w.full, w.scale, w.full))  # float32 "codes"
    with pytest.raises(ValueError, match="scale"):
        fp8_rows(torch.zeros(2, 16), Fp8Weight(w.codes, w.scale[:4], w.full))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        fp8_rows(torch.zeros(65, 16), w)
    with pytest.raises(ValueError, match="split_k"):
        fp8_rows(torch.zeros(2, 16), w, GemvConfig(16, 16, 4, 3, 0))


def test_embed_norm_pair_refuses_mismatched_inputs():
    """An EAGLE-3 layer's input kernel takes ids [T], a table [V, H] and states [T, H] of
    the table's dtype; anything else is refused before a launch."""
    from splitspec.kernels.fused_ops import embed_norm_pair

    table, w = torch.zeros(11, 8), torch.ones(8)
    ids, states = torch.zeros(3, dtype=torch.int64), torch.zeros(3, 8)
    for bad_ids, bad_states in ((ids, states.double()), (ids[:2], states),
                                (ids.view(3, 1), states), (ids, states[:, :4])):
        with pytest.raises(ValueError, match=r"want \[T\], \[V, H\], \[T, H\] of one dtype"):
            embed_norm_pair(bad_ids, table, bad_states, w, w, 1e-5, 1e-5)


def test_top_logprobs_kernels_refuse_what_they_do_not_take():
    from splitspec.kernels.top_logprobs import MAX_K, top_logprobs_kernels

    x = torch.randn(2, 40)
    for block in (8, 48):
        with pytest.raises(ValueError, match="power of two of at least 16"):
            top_logprobs_kernels(x, 2, block=block)
    for logits, k in ((x, MAX_K + 1), (x, 0), (x.T, 2), (x[0], 2), (x[:0], 2)):
        with pytest.raises(ValueError, match="the kernels take logits"):
            top_logprobs_kernels(logits, k)


def test_tree_level_refuses_inconsistent_inputs():
    """The tree level's checks (tree_level_torch's, and the kernel's before its launch):
    each mismatch is named, and nothing is written."""
    from splitspec.kernels import Frontier, tree_level_torch

    b, k, x, t = 2, 4, 8, 12
    lp, ids = torch.zeros(b * k, k), torch.zeros(b * k, k, dtype=torch.int64)
    states, allowed = torch.zeros(b * k, x), torch.zeros(b, k, t, dtype=torch.bool)
    front = Frontier(torch.zeros(b, k, dtype=torch.float64), ids[:b], ids[:b], states, allowed)
    packed = torch.zeros(3, b, 40, dtype=torch.float64)
    good = dict(lp=lp, ids=ids, d2t=None, front=front, packed=packed, col=4, select=True,
                states=states, allowed=allowed, eye_col=8)
    assert tree_level_torch(**good) is not None
    packed.zero_()
    rows = re.escape("must be [B * F, k]")
    bad = [({"lp": lp[:b]}, rows), ({"front": None}, rows),
           ({"ids": ids.T.contiguous().T}, "contiguous rows"),
           ({"packed": packed.float()}, "float64"), ({"col": 30}, "do not fit packed"),
           ({"states": states[:b]}, "states"), ({"allowed": allowed.int()}, "bool"),
           ({"eye_col": 9}, "do not fit T"),
           ({"front": front._replace(score=front.score[:1])}, "frontier")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            tree_level_torch(**{**good, **change})
    assert not packed.any()
    assert tree_level_torch(**{**good, "eye_col": 9, "select": False}) is None  # unused then


def test_top_logprobs_kernels_share_variants_between_widths():
    """The kernels' k (a constexpr, one compiled variant each): a chain's 1, and the 4-wide
    tree's for 2 to 4 (the policy's 2- and 3-node budgets cap the default tree to those
    widths; the draft's warmup meets 1 and 4), then powers of two; kernel_cases'
    run_top_logprobs checks k = 3, 5 and 6 against a sort."""
    from splitspec.kernels.top_logprobs import MAX_K, kernel_k

    assert [kernel_k(k) for k in (1, 2, 3, 4, 5, 8, 9, MAX_K)] == [1, 4, 4, 4, 8, 8, 16, MAX_K]


@pytest.mark.parametrize("routed", [False, True])
def test_top_logprobs_routes_to_the_kernels_only_when_routed_and_they_fit(monkeypatch, routed):
    from splitspec.kernels import top_logprobs as module

    calls = []
    monkeypatch.setattr(module, "ROUTED", routed)
    monkeypatch.setattr(module, "top_logprobs_kernels",
                        lambda logits, k: calls.append(tuple(logits.shape)) or (None, None))
    x = torch.randn(3, 40)
    for logits, k in ((x, module.MAX_K + 1), (x.T, 2), (x[:0], 2)):  # torch's, either way
        for got, want in zip(module.top_logprobs(logits, k), module.top_logprobs_torch(logits, k),
                             strict=True):
            assert torch.equal(got, want)
    got = module.top_logprobs(x, 4)
    assert calls == ([(3, 40)] if routed else [])
    if not routed:
        assert torch.equal(got[1], module.top_logprobs_torch(x, 4)[1])


def test_few_rows_refuses_what_it_cannot_multiply():
    from splitspec.kernels.gemv import GemvConfig, few_rows, padded_rows

    w, ok = torch.zeros(8, 16), GemvConfig(16, 16)
    with pytest.raises(ValueError, match="1 to 64 rows, got 65"):
        few_rows(torch.zeros(65, 16), w, ok)
    with pytest.raises(ValueError, match="rows of 16"):
        few_rows(torch.zeros(4, 8), w, ok)
    with pytest.raises(ValueError, match="rows of 16"):
        few_rows(torch.zeros(16), w, ok)  # one dimension
    with pytest.raises(ValueError, match="columns contiguous"):
        few_rows(torch.zeros(16, 4).T, w, ok)
    with pytest.raises(ValueError, match="at least 16"):
        few_rows(torch.zeros(4, 16), w, GemvConfig(8, 16))  # below tl.dot's tile
    assert [padded_rows(r) for r in (1, 2, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]


def test_gemv_linear_routes_by_rows_and_configs(monkeypatch):
    """linear: one row to gemv with W's shape's config (DEFAULT if unlisted); a shape listed as
    None (cuBLAS faster) and more rows to torch."""
    from splitspec.kernels import gemv as module

    seen = []
    monkeypatch.setattr(module, "gemv", lambda x, w, config: seen.append(config) or x @ w.T)
    monkeypatch.setattr(module, "CONFIGS", {(8, 16): module.GemvConfig(16, 64, 8), (4, 16): None})
    x = torch.randn(1, 16)
    for w in (torch.randn(8, 16), torch.randn(4, 16), torch.randn(2, 16)):
        torch.testing.assert_close(module.linear(x, w), x @ w.T)
    assert module.linear(torch.randn(3, 16), torch.randn(8, 16)).shape == (3, 8)
    assert seen == [module.GemvConfig(16, 64, 8), module.DEFAULT]


def test_few_rows_linear_routes_only_the_shapes_row_configs_lists(monkeypatch):
    """linear: 2 to 64 rows of bfloat16 (or float16) to few_rows where ROW_CONFIGS lists
    (rows padded, N, K) and x's columns are contiguous; other shapes, row counts, 65 rows or
    more, and float32 (whose tiles would not fit the configs' shared memory) to torch."""
    from splitspec.kernels import gemv as module

    seen = []
    monkeypatch.setattr(module, "few_rows",
                        lambda x, w, config: seen.append((x.shape[0], config)) or x @ w.T)
    listed = module.GemvConfig(32, 64, 4, 4)
    monkeypatch.setattr(module, "ROW_CONFIGS", {(16, 8, 16): listed})
    bf16 = torch.bfloat16
    w = torch.randn(8, 16, dtype=bf16)
    for x in (torch.randn(3, 16, dtype=bf16), torch.randn(2, 8, 16, dtype=bf16)[:, 0, :],
              torch.randn(1, 5, 16, dtype=bf16), torch.randn(20, 16, dtype=bf16),
              torch.randn(3, 32, dtype=bf16)[:, ::2], torch.randn(65, 16, dtype=bf16)):
        torch.testing.assert_close(module.linear(x, w), x @ w.T)
    assert module.linear(torch.randn(4, 16, dtype=bf16), torch.randn(4, 16, dtype=bf16)
                         ).shape == (4, 4)
    x = torch.randn(3, 16)
    torch.testing.assert_close(module.linear(x, w.float()), x @ w.float().T)
    # listed: 3 rows, 2 strided rows, 5 rows of a [1, 5, K]; not: 20 rows (pad 32), columns
    # strided, 65 rows, another N, float32
    assert seen == [(3, listed), (2, listed), (5, listed)]


def test_fp8_configs_fit_shared_memory_at_every_row_count():
    """fp8_shared_bytes: what Triton 3.9 reported compiling fp8_rows for sm_90 (session 32),
    at 4 rows and at 40 (there the widened codes' tile too). (128, 256, 4 stages), down's
    config tuned at 4 rows, would need 262144 B at 33-64 rows, over a block's 232448 B:
    fitted cuts it to 3 stages, and every FP8_CONFIGS entry fits at every row count so."""
    from splitspec.kernels.gemv import (
        FP8_CONFIGS,
        SHARED_BYTES,
        GemvConfig,
        fitted,
        fp8_shared_bytes,
    )

    assert fp8_shared_bytes(GemvConfig(64, 512, 4, 4), 4) == 147456
    assert fp8_shared_bytes(GemvConfig(128, 512, 4, 4), 4) == 245760
    assert fp8_shared_bytes(GemvConfig(32, 256, 4, 2), 40) == 57344
    down = GemvConfig(128, 256, 4, 4, 4)
    assert fp8_shared_bytes(down, 40) == 262144 > SHARED_BYTES
    assert fitted(down, 40) == GemvConfig(128, 256, 4, 3, 4)
    assert fitted(down, 4) == down
    for config in FP8_CONFIGS.values():
        for rows in (1, 20, 64):
            assert fp8_shared_bytes(fitted(config, rows), rows) <= SHARED_BYTES
    with pytest.raises(ValueError, match="smaller blocks"):
        fitted(GemvConfig(128, 1024, 4, 3), 64)
