"""splitspec.compile_watch: Triton kernel variants compiled after SERVING are logged and
listed (here the hook is called as Triton calls it; on a GPU, by a real compile)."""

from __future__ import annotations

import logging

import pytest
import torch

from splitspec import compile_watch

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
    """What Triton does after compiling a variant (triton/runtime/jit.py's _call_hook)."""
    runtime.jit_post_compile_hook(key=(name,), repr=name, fn=None, compile={},
                                  is_manual_warmup=False, already_compiled=False)


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


@pytest.mark.gpu
def test_a_real_compile_after_serving_is_listed(hooks):
    """On the GPU machine's Triton: a variant no other test uses (gemv with a 2-warp config),
    compiled after serving(), is listed by its kernel's name."""
    from splitspec.kernels.gemv import GemvConfig, gemv

    compile_watch._WATCH.compiled = []
    assert compile_watch.watch()
    compile_watch.serving()
    x, w = torch.randn(1, 96, device="cuda"), torch.randn(40, 96, device="cuda")
    gemv(x, w, GemvConfig(8, 32, 2, 2))
    assert any("_gemv_kernel" in name for name in compile_watch.compiled_while_serving())
