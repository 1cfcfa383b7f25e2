"""splitspec.compile_watch: Triton kernel variants compiled after SERVING are logged and
listed (here the hook is called as Triton calls it; on a GPU, by a real compile)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from splitspec import compile_watch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_tp  # bench/ is a script folder, not a package

triton = pytest.importorskip("triton")


@pytest.fixture
def hooks():
    """Triton's post-compile hook and the watch's state, restored after the test."""
    runtime = triton.knobs.runtime
    saved = runtime.jit_post_compile_hook
    watch = compile_watch._WATCH
    state = watch.is_serving, list(watch.compiled), watch.previous
    yield runtime
    runtime.jit_post_compile_hook = saved
    watch.is_serving, watch.compiled, watch.previous = state[0], state[1], state[2]


def compiled(runtime, name: str) -> None:
    """A hook call with a ready description and no signature (the watch's fallback)."""
    runtime.jit_post_compile_hook(key=(name,), repr=name, fn=None, compile={},
                                  is_manual_warmup=False, already_compiled=False)


def test_a_variant_is_described_by_its_arguments_types_alignment_and_constexprs():
    """The hook's arguments as Triton 3.9's _call_hook builds them (triton/runtime/jit.py) for
    _gemv_kernel: its ``repr`` pairs the parameters with the characters of the string key,
    so the description is built from the signature, the constexprs and the divisibility
    attributes (a row x at an odd address: no div16)."""
    names = ["x", "w", "out", "N", "w_row", "K", "BLOCK_N", "BLOCK_K"]
    kinds = ["*bf16", "*bf16", "*bf16", "i32", "i32", "constexpr", "constexpr", "constexpr"]
    div16 = [[], [["tt.divisibility", 16]], [["tt.divisibility", 16]], [],
             [["tt.divisibility", 16]]]
    key = "[('*bf16', ''), ('*bf16', 'D'), ...]{'num_warps': 4}"
    hook_args = {
        "key": key, "repr": "_gemv_kernel[num_warps=4, num_ctas=1, num_stages=3](x: [)",
        "fn": SimpleNamespace(name="_gemv_kernel", module="splitspec.kernels.gemv"),
        "compile": {"key": key, "signature": dict(zip(names, kinds, strict=True)),
                    "constants": {(5,): 4096, (6,): 64, (7,): 256}, "num_warps": 4,
                    "num_stages": 3, "configs": [{(i,): attr for i, attr in enumerate(div16)}]},
        "is_manual_warmup": False, "already_compiled": False}
    assert compile_watch.describe(hook_args) == (
        "_gemv_kernel[num_warps=4, num_stages=3](x: *bf16, w: *bf16 div16, out: *bf16 div16, "
        "N: i32, w_row: i32 div16, K=4096, BLOCK_N=64, BLOCK_K=256)")
    # without a signature (an older Triton): its repr as it is
    assert compile_watch.describe({**hook_args, "compile": {}}) == hook_args["repr"]


def test_variants_compiled_after_serving_are_logged_and_listed(hooks, caplog):
    seen = []
    hooks.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])  # someone else's hook
    compile_watch._WATCH.is_serving, compile_watch._WATCH.compiled = False, []
    assert compile_watch.watch() and compile_watch.watch()  # installed once
    with caplog.at_level(logging.WARNING, logger="splitspec.compile_watch"):
        compiled(hooks, "_norm_kernel[num_warps=4](x: *bf16, N: constexpr 4096)")
        assert compile_watch.compiled_while_serving() == [] and not caplog.records
        compile_watch.serving()
        compiled(hooks, "_rows_kernel[num_warps=4](BLOCK_M: constexpr 32)")
    assert compile_watch.compiled_while_serving() == ["_rows_kernel[num_warps=4](BLOCK_M: constexpr 32)"]
    (record,) = caplog.records
    assert "while serving" in record.getMessage() and "BLOCK_M: constexpr 32" in record.getMessage()
    assert seen == ["_norm_kernel[num_warps=4](x: *bf16, N: constexpr 4096)",
                    "_rows_kernel[num_warps=4](BLOCK_M: constexpr 32)"]  # still called


def test_bench_tp_lists_each_service_logs_compiles_while_serving(hooks, tmp_path, caplog):
    """bench/bench_tp.py reads the services' logs for the watch's warnings (the GPU test of
    the served stack expects none): the warning as the watch writes it, per log."""
    compile_watch._WATCH.compiled = []
    assert compile_watch.watch()
    compile_watch.serving()
    with caplog.at_level(logging.WARNING, logger="splitspec.compile_watch"):
        compiled(hooks, "_rows_kernel[num_warps=4](M: i32, K=96)")
    (tmp_path / "draft.log").write_text("2026-12-02 06:17:56 draft INFO draft SERVING\n")
    (tmp_path / "target-tp1.log").write_text(
        f"2026-12-02 06:17:58,334 target WARNING {caplog.records[0].getMessage()}\nnext\n")
    (tmp_path / "notes.txt").write_text(compile_watch.WHILE_SERVING)  # not a service log
    assert bench_tp.compiled_while_serving(tmp_path) == {
        "target-tp1.log": [caplog.records[0].getMessage()]}
    assert caplog.records[0].getMessage().startswith(compile_watch.WHILE_SERVING)
    assert caplog.records[0].getMessage().endswith("): _rows_kernel[num_warps=4](M: i32, K=96)")


@pytest.mark.gpu
def test_a_real_compile_after_serving_is_listed(hooks):
    """On the GPU machine's Triton: a variant no other test uses (gemv with a 2-warp config),
    compiled after serving(), is listed with its arguments and constexprs."""
    from splitspec.kernels.gemv import GemvConfig, gemv

    compile_watch._WATCH.compiled = []
    assert compile_watch.watch()
    compile_watch.serving()
    x, w = torch.randn(1, 96, device="cuda"), torch.randn(40, 96, device="cuda")
    gemv(x, w, GemvConfig(8, 32, 2, 2))
    (variant,) = [name for name in compile_watch.compiled_while_serving()
                  if name.startswith("_gemv_kernel[num_warps=2, num_stages=2](")]
    assert "x: *fp32 div16, w: *fp32 div16" in variant and "N: i32, " in variant
    assert variant.endswith("K=96, BLOCK_N=8, BLOCK_K=32)")


@pytest.mark.gpu
def test_counts_and_offsets_that_change_while_serving_reuse_start_ups_variants(hooks):
    """What changes from step to step while serving (a count or length that is a multiple
    of 16 or not, or 1; a list or a row at an odd address) makes Triton compile no new variant:
    each kernel met once before serving() (as start-up's warmup meets it), then again with
    only those changed. Before, each such change could compile (and fail) mid-request:
    the trained pair's end-to-end run compiled _compact_kernel and _gemv_kernel while
    serving (docs/benchmarks.md, nineteenth part)."""
    from splitspec.kernels.gemv import GemvConfig, few_rows, gemv
    from splitspec.kernels.kv_compact import compact_kv
    from splitspec.kv_cache import KVCache
    from tests import kernel_cases as cases

    def met(then_serving: bool) -> None:
        dtype, dev = torch.bfloat16, "cuda"
        # the KV compaction: 3 moves from fresh lists, then 16, 1 (Triton makes an int
        # argument equal to 1 a constant) and 40 (a whole batch's, in three chunks) from
        # lists at odd addresses
        for count, offset in ((3, 0), (16, 1), (1, 3), (40, 5)) if then_serving else ((3, 0),):
            cache = KVCache(2, 10, 16, 3, 48, dtype, dev)
            cache.data.copy_(torch.randn(cache.data.shape).to(dtype))
            want = cache.data.clone()
            slots = torch.arange(160, device=dev)
            src, dst = slots[60 + offset:60 + offset + count], slots[offset:offset + count]
            compact_kv(cache.data, src, dst)
            reference = KVCache(2, 10, 16, 3, 48, dtype, dev)
            reference.data.copy_(want)
            reference.copy_slots_torch(src, dst)
            assert torch.equal(cache.data, reference.data)
        # one row (then one at an odd address) and a few rows (3, then 16)
        w = torch.randn(40, 96, device=dev, dtype=dtype)
        buffer = torch.randn(2, 97, device=dev, dtype=dtype)
        for x in (buffer[:1, :96], buffer[1:, 1:]) if then_serving else (buffer[:1, :96],):
            want = (x.float() @ w.float().T).to(dtype)
            cases.close(gemv(x, w, GemvConfig(8, 32, 4)), want, "gemv", scale=want.abs() + 1e-2)
        for rows in (3, 16) if then_serving else (3,):
            x = torch.randn(rows, 96, device=dev, dtype=dtype)
            want = (x.float() @ w.float().T).to(dtype)
            cases.close(few_rows(x, w, GemvConfig(16, 32, 4)), want, "few_rows",
                        scale=want.abs() + 1e-2)
        # the tree's levels: width 4 and 12 keys seen, then width 16 and 16 keys (one block)
        cases.check_tree(dev, dtype, 2, 4, 8, 3, 8, 2, 64, 1.0)
        if then_serving:
            cases.check_tree(dev, dtype, 2, 16, 1, 1, 8, 2, 64, 1.0)
        # prompts: 40 rows, then 48, and 640 (past the prefill graphs' 512 rows, where a
        # trip count fixed at compile time compiled a variant for each power of two)
        cases.check_prompts(dev, dtype, [30, 10], 40, 8, 2, 64)
        if then_serving:
            cases.check_prompts(dev, dtype, [30, 18], 48, 8, 2, 64)
            cases.check_prompts(dev, dtype, [600, 40], 640, 8, 2, 64)
        # paged decode and a verify's prefix: tables 4 wide, 9 rows a sequence; then 16 wide
        # (240 keys), 16 rows. check_paged_decode also runs 1 split and 3 more: 12, 1, 15,
        # then 13, 1, 16 (the merge's block of splits, a constexpr, is 16 for all but 1).
        # (float32: its bf16 bound is loose enough only for run_paged_decode's lengths)
        for lengths, splits, rows in (([40, 7], 12, 1), ([40, 7], 12, 9), ([240, 7], 13, 1),
                                      ([240, 7], 13, 16))[:4 if then_serving else 2]:
            cases.check_paged_decode(dev, torch.float32, lengths, 16, 8, 2, 64, splits=splits,
                                     rows=rows)

    compile_watch._WATCH.compiled = []
    assert compile_watch.watch()
    met(then_serving=False)
    compile_watch.serving()
    met(then_serving=True)
    assert compile_watch.compiled_while_serving() == []
