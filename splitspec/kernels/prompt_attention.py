"""Causal attention of fresh prompts over their own tokens, packed in one row range, in one
Triton kernel (the target's prefill graphs, splitspec/cuda_graphs.py).

A prompt that starts a sequence attends to nothing but itself: row i of a
prompt that begins at row s sees rows s..i. Many prompts are packed one after
another, and each row carries its prompt's first row (``starts``), so the
kernel's grid depends on the packed length alone: one program per block of
rows and query head, looping over key blocks from its rows' earliest start to
its last row (flash attention's running softmax; the loop's bounds are loaded
and computed in the kernel, so no prompt length compiles a variant of its own).
Nothing is read from the KV cache and no mask tensor is built, so the same
launch serves every mix of prompt lengths and can be captured once per padded
length. Reference:
``prompt_attention_reference`` in splitspec/attention/prompts.py
(tests/kernel_cases.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Triton's interpreter multiplies 16-bit floats wrongly in tl.dot: there every dot is float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 64
BLOCK_N = 32


@triton.jit(do_not_specialize=["rows"])  # the rows vary: no variant for 1, 16, ... (kv_compact)
def _prompt_attention_kernel(q, k, v, starts, out, rows, q_row, q_head, k_row, k_head,
                             v_row, v_head, o_row, o_head, group, scale_log2,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    kv_head = h // group
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    in_rows, has_d = m < rows, d < D
    first = tl.load(starts + m, mask=in_rows, other=0)
    query = tl.load(q + m[:, None].to(tl.int64) * q_row + h * q_head + d[None, :],
                    mask=in_rows[:, None] & has_d[None, :], other=0.0)
    if IEEE:
        query = query.to(tl.float32)
    # Key blocks from the block's earliest start (starts never decrease) to its last row. The
    # trip count was once a compile-time constant, the padded length's key blocks: every
    # program looped over all of them, and a prompt longer than the prefill graphs' 512 rows
    # compiled a variant while serving for each new power of two.
    lo = tl.load(starts + block * BLOCK_M)
    end = tl.minimum(block * BLOCK_M + BLOCK_M, rows)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    top = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for key_start in range(lo, end, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        both = (n < end)[:, None] & has_d[None, :]
        key = tl.load(k + n[:, None].to(tl.int64) * k_row + kv_head * k_head + d[None, :],
                      mask=both, other=0.0)
        if IEEE:
            key = key.to(tl.float32)
            scores = tl.dot(query, tl.trans(key), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(key))
        may = (n[None, :] >= first[:, None]) & (n[None, :] <= m[:, None])
        scores = tl.where(may, scores * scale_log2, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # rows that saw nothing yet
        weights = tl.exp2(scores - safe[:, None])
        shrink = tl.exp2(top - safe)
        total = total * shrink + tl.sum(weights, axis=1)
        value = tl.load(v + n[:, None].to(tl.int64) * v_row + kv_head * v_head + d[None, :],
                        mask=both, other=0.0)
        if IEEE:
            value = value.to(tl.float32)
            acc = acc * shrink[:, None] + tl.dot(weights, value, input_precision="ieee")
        else:
            acc = acc * shrink[:, None] + tl.dot(weights.to(value.dtype), value)
        top = new_top
    result = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out + m[:, None].to(tl.int64) * o_row + h * o_head + d[None, :],
             result.to(out.dtype.element_ty), mask=in_rows[:, None] & has_d[None, :])


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     starts: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k and v [T, H_kv, D] (D contiguous), starts [T] int64: the first row of
    each row's prompt, never decreasing (prompts packed in order; padding rows may be
    prompts of one row each). Returns [T, H, D] in q's dtype: row i's softmax attention over
    rows starts[i]..i."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != rows or k.stride(2) != 1 or v.stride(2) != 1
            or q.stride(2) != 1 or heads % kv_heads or tuple(starts.shape) != (rows,)):
        raise ValueError(f"prompt_attention: inconsistent shapes or strides: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, starts {tuple(starts.shape)}")
    out = torch.empty_like(q)
    grid = (triton.cdiv(rows, BLOCK_M), heads)
    _prompt_attention_kernel[grid](
        q, k, v, starts, out, rows, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), heads // kv_heads,
        dim ** -0.5 * LOG2E,
        D=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        IEEE=q.dtype == torch.float32 or INTERPRETED)
    return out
