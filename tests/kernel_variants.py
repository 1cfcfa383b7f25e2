"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (tests/kernel_cases.py) checks what a kernel computes, but not whether
it compiles: it runs each kernel as Python, so a construct the compiler refuses, or a
variant that needs more shared memory than the GPU has, shows only on the GPU. Here
Triton's own compiler (its wheel carries ``ptxas``) builds each kernel through its real
wrapper, at the built-in pair's and the Llama-3.1-8B shape's sizes, in float32 and
bfloat16, for ``GPUTarget("cuda", 90, 32)``: a stand-in driver answers the few questions
the launch asks of a GPU, the tensors are on the meta device (shapes, no data), and each
launch stops once its kernel is compiled (``warmup``). Triton specialises each variant
on its arguments as a launch does (a meta tensor counts as 16-byte aligned).

This machine's Triton is the one torch pins here (3.9 with torch 2.13); the GPU machine's
is older (torch 2.11's). So a pass here is not proof: a construct newer than the GPU's
Triton compiles here and fails there. It catches what the interpreter cannot, before a
device call is spent on it.

    python -m tests.kernel_variants      # prints each variant and its shared memory
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # a script folder
from bench_step_costs import configs

from splitspec.attention.decode_table import block_keys, splits_for
from splitspec.kernels import (
    FP8,
    Fp8Weight,
    Frontier,
    fused_ops,
    gemv,
    kv_compact,
    paged_decode,
    prompt_attention,
    top_logprobs,
    tree_attention,
    tree_level,
)
from splitspec.model.config import Eagle3Config, LlamaConfig

TARGET = GPUTarget("cuda", 90, 32)
SHARED_BYTES = 232448  # the most shared memory one block may use on sm_90 (227 KiB)
PROCESSORS = 132       # an H100/H200's SMs: the decode kernels' split count follows them
PAGE = 16
KERNEL_MODULES = (fused_ops, gemv, kv_compact, paged_decode, prompt_attention, top_logprobs,
                  tree_attention, tree_level)
SHAPES = {"builtin": "builtin", "llama-3.1-8b": "8b"}  # bench_step_costs.py's shapes, by name
BATCHES = (1, 2, 4, 8, 16, 32, 64)


class _StandInDriver:
    """What JITFunction.run asks of the active driver before it compiles."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET



def kernels() -> set[str]:
    """Every launched kernel of splitspec/kernels (``module._name_kernel``; helpers that
    kernels call are compiled inside them)."""
    return {f"{module.__name__.rsplit('.', 1)[1]}.{name}" for module in KERNEL_MODULES
            for name, value in vars(module).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel")}


def _empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _calls(shape: str, dtype: torch.dtype) -> list[tuple[str, Callable[[], object]]]:
    """(what, call) for each wrapper call: the sizes the target's and the draft's steps
    give them (decode and verify batches, the tree search's levels, prompts), for the
    target and EAGLE-3 head of bench_step_costs.py's ``shape``."""
    target_hf, head_hf = configs(SHAPES[shape])
    target, head = LlamaConfig.from_hf(target_hf), Eagle3Config.from_hf(head_hf)
    hidden, heads, kv_heads = target.hidden_size, target.num_heads, target.num_kv_heads
    dim, inter, layers, vocab = (target.head_dim, target.intermediate_size, target.num_layers,
                                 target.vocab_size)
    cache = _empty(layers, 64, 2, PAGE, kv_heads, dim, dtype=dtype)
    layer = cache[0]
    calls: list[tuple[str, Callable[[], object]]] = []
    for rows in (1, 9, 64):  # a decode step, an 8-node tree's verify, a prompt's rows
        qkv = _empty(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)  # q, k, v: views
        q = qkv[:, :heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
        x, weight = _empty(rows, hidden, dtype=dtype), _empty(hidden, dtype=dtype)
        positions = _empty(rows, dtype=torch.int64)
        calls += [
            (f"rms_norm rows={rows}", partial(fused_ops.rms_norm, x, weight, 1e-5)),
            (f"add_rms_norm rows={rows}", partial(fused_ops.add_rms_norm, x, x, weight, 1e-5)),
            (f"embed_norm_pair rows={rows}", partial(  # an EAGLE-3 layer's input
                fused_ops.embed_norm_pair, positions, _empty(vocab, hidden, dtype=dtype), x,
                weight, weight, 1e-5, 1e-5)),
            (f"silu_mul rows={rows}",
             partial(fused_ops.silu_mul, _empty(rows, 2 * inter, dtype=dtype))),
            (f"rope rows={rows}", partial(fused_ops.rope, q, k, positions, _empty(dim // 2))),
            (f"store_kv rows={rows}", partial(fused_ops.store_kv, layer, positions, k, v)),
            (f"prompt_attention rows={rows}",
             partial(prompt_attention.prompt_attention, q, k, v, positions)),
        ]
    moves = _empty(40, dtype=torch.int64)
    calls.append(("compact_kv moves=40", partial(kv_compact.compact_kv, cache, moves, moves)))
    for batch in BATCHES:
        splits = splits_for(batch, kv_heads, PROCESSORS)
        table = _empty(batch, 1 + 512 // PAGE, dtype=torch.int32)
        calls.append((f"paged decode batch={batch} splits={splits}", partial(
            paged_decode.paged_decode_attention, _empty(batch, heads, dim, dtype=dtype), layer,
            table, splits, block_n=block_keys(batch))))
        for rows in (4, 9):  # the draft's level of a 4-wide tree; an 8-node tree's verify
            calls.append((f"paged prefix batch={batch} rows={rows} splits={splits}", partial(
                paged_decode.paged_prefix_attention,
                _empty(batch * rows, heads, dim, dtype=dtype), layer, table, rows, splits)))
    for width, seen in ((1, 6), (4, 8), (4, 20), (8, 40)):  # chains and trees, levels seen
        q = _empty(width, heads, dim, dtype=dtype)
        keys = _empty(1, seen, kv_heads, dim, dtype=dtype)
        allowed = _empty(1, width, seen, dtype=torch.bool)
        calls.append((f"tree_attention width={width} seen={seen}", partial(
            tree_attention.tree_attention, q, keys, keys, allowed, q, _empty(width, heads), 1.0)))
    for rows, k in ((1, 1), (4, 4), (16, 4), (1, 8)):
        for columns in (head.draft_vocab_size, vocab):
            calls.append((f"top_logprobs rows={rows} k={k} vocab={columns}", partial(
                top_logprobs.top_logprobs_kernels, _empty(rows, columns, dtype=dtype), k)))
    width = head.layer.hidden_size
    for b, k, steps in ((1, 4, 5), (4, 4, 5), (1, 1, 5), (2, 8, 3)):  # the search's levels
        seen, columns = 6 + (steps - 1) * k, k + (steps - 1) * k * k
        packed, d2t = _empty(3, b, columns, dtype=torch.float64), _empty(head.draft_vocab_size,
                                                                          dtype=torch.int64)
        allowed = _empty(b, k, seen, dtype=torch.bool)
        front = Frontier(_empty(b, k, dtype=torch.float64), _empty(b, k, dtype=torch.int64),
                         _empty(b, k, dtype=torch.int64), _empty(b * k, width, dtype=dtype),
                         allowed)
        for root, select in ((True, True), (False, True), (False, False)):  # root, level, last
            rows = b * (1 if root else k)
            calls.append((f"tree_level batch={b} k={k} root={root} select={select}", partial(
                tree_level.tree_level, _empty(rows, k, dtype=torch.float32),
                _empty(rows, k, dtype=torch.int64), d2t, None if root else front, packed, 0,
                select, _empty(rows, width, dtype=dtype), allowed, 6)))
    # the projections through gemv.linear, which picks the kernel and its config as serving
    # does (one row: gemv; 2-64 rows of a shape ROW_CONFIGS lists: few_rows; else torch)
    own = head.layer
    projections = {((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim),
                   (2 * inter, hidden), (hidden, inter), (vocab, hidden),  # the target's
                   ((own.num_heads + 2 * own.num_kv_heads) * own.head_dim,
                    2 * own.hidden_size),  # the head's own: its qkv over 2 H, fc, lm_head
                   (own.hidden_size, 3 * head.target_hidden_size),
                   (head.draft_vocab_size, own.hidden_size)}
    for n, k in sorted(projections):
        w = _empty(n, k, dtype=dtype)
        fp8 = Fp8Weight(_empty(n, k, dtype=FP8), _empty(n), w)  # a draft's --quantize fp8
        for rows in (1, 4, 9, 16, 20, 33):
            calls.append((f"linear rows={rows} {n}x{k}",
                          partial(gemv.linear, _empty(rows, k, dtype=dtype), w)))
            calls.append((f"linear rows={rows} {n}x{k} fp8",
                          partial(gemv.linear, _empty(rows, k, dtype=dtype), fp8)))
        if dtype != torch.float32:  # K shared by 4 programs, whatever FP8_CONFIGS chose
            split = gemv.FP8_DEFAULT._replace(split_k=4)
            calls.append((f"fp8_rows rows=4 {n}x{k} {split}",
                          partial(gemv.fp8_rows, _empty(4, k, dtype=dtype), fp8, split)))
    return calls


def compile_all(report: Callable[[str], None] = print) -> dict[str, int]:
    """Compile every call's kernels for TARGET; returns each compiled variant's shared
    memory in bytes, by kernel and constexprs (variants that differ only in how Triton
    specialised their other arguments share an entry). Raises on the first that fails."""
    if not kernels():
        raise RuntimeError("no compiled kernels to build: Triton's interpreter is on "
                           "(TRITON_INTERPRET=1), so @triton.jit made none")
    compiled: dict[str, int] = {}
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: object, grid: object, warmup: bool,
                     **kwargs: object) -> object:
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        constants = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        name = f"{self.fn.__module__.rsplit('.', 1)[1]}.{self.fn.__name__}"
        compiled[f"{name}({constants})"] = kernel.metadata.shared
        return kernel

    previous = driver._active  # (None until a GPU's driver is asked for: none here)
    driver.set_active(_StandInDriver())
    JITFunction.run = compile_only
    try:
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                for what, call in _calls(shape, dtype):
                    report(f"{shape} {str(dtype).removeprefix('torch.')} {what}")
                    call()
    finally:  # the process goes on with Triton as it was (a test may import this module)
        JITFunction.run = run
        driver._active = previous
    return compiled


def main() -> int:
    compiled = compile_all(lambda what: print(what, flush=True))
    for variant, shared in sorted(compiled.items()):
        print(f"{shared:>7} B shared  {variant}")
    names = {variant.split("(", 1)[0] for variant in compiled}
    missing = sorted(kernels() - names)
    over = sorted(v for v, shared in compiled.items() if shared > SHARED_BYTES)
    print(f"{len(compiled)} variants of {len(names)} kernels compiled for sm_90; "
          f"never compiled: {missing or 'none'}; over {SHARED_BYTES} B of shared memory: "
          f"{over or 'none'}")
    return 1 if missing or over else 0


if __name__ == "__main__":
    sys.exit(main())
