"""The attention of a tree's rows over their dense keys, merged with the prefix's, in one
Triton kernel (splitspec/attention/cascade.py on CUDA: the draft's tree search and the
target's verify graphs).

A row attends to two key sets: its sequence's committed slots, which the
prefix attention has already done (its output and log-sum-exp come in), and
the tree nodes its row of the table allows, from a dense block (the draft's
per-call scratch, or the verify pass's own K/V). The torch form of the second
part and the merge (float casts, two einsums, a masked softmax with its
log-sum-exp, the log-sum-exp merge) is about 30 small kernels; here it is one
program per (row, head) with all of a row's tree keys in registers (a tree has
at most a few dozen nodes). References: ``masked_attention`` and
``merge_attention`` in splitspec/attention/cascade.py (tests/kernel_cases.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The tree's width, the keys seen so far and the mask's strides change from level to level
# and step to step: no variant of their own for 1 or multiples of 16 (kv_compact.py says why).
@triton.jit(do_not_specialize=["a_seq", "a_row", "width", "seen"])
def _tree_attention_kernel(q, keys, values, allowed, prefix_out, prefix_lse, out,
                           q_row, q_head, k_seq, k_node, k_head, a_seq, a_row, p_row, p_head,
                           l_row, l_head, o_row, o_head, width, seen, group, lse_scale, sm_scale,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # query row: sequence n // width, frontier row n % width
    h = tl.program_id(1).to(tl.int64)
    b, r, kv_head = n // width, n % width, h // group
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    has_d, has_t = d < D, t < seen
    query = tl.load(q + n * q_row + h * q_head + d, mask=has_d, other=0.0).to(tl.float32)
    may = (tl.load(allowed + b * a_seq + r * a_row + t, mask=has_t, other=0) != 0) & has_t
    at = b * k_seq + t[:, None] * k_node + kv_head * k_head + d[None, :]
    both = has_t[:, None] & has_d[None, :]
    key = tl.load(keys + at, mask=both, other=0.0).to(tl.float32)
    scores = tl.where(may, tl.sum(key * query[None, :], axis=1) * sm_scale, float("-inf"))
    top = tl.max(scores, axis=0)
    weights = tl.where(may, tl.exp(scores - top), 0.0)
    total = tl.sum(weights, axis=0)
    value = tl.load(values + at, mask=both, other=0.0).to(tl.float32)
    tree_out = tl.sum(weights[:, None] * value, axis=0) / total
    tree_lse = top + tl.log(total)
    lse = tl.load(prefix_lse + n * l_row + h * l_head).to(tl.float32) * lse_scale
    prefix = tl.load(prefix_out + n * p_row + h * p_head + d, mask=has_d, other=0.0).to(tl.float32)
    high = tl.maximum(lse, tree_lse)
    w_prefix, w_tree = tl.exp(lse - high), tl.exp(tree_lse - high)
    merged = (prefix * w_prefix + tree_out * w_tree) / (w_prefix + w_tree)
    tl.store(out + n * o_row + h * o_head + d, merged.to(out.dtype.element_ty), mask=has_d)


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   allowed: torch.Tensor, prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                   lse_scale: float) -> torch.Tensor:
    """q [N, H, D] with N = B * width rows; keys, values [B, T, H_kv, D] (same strides, D
    contiguous); allowed [B, width, T] bool (every row must allow at least one key: itself);
    prefix_out [N, H, D] and prefix_lse [N, H] (times lse_scale: natural log). Returns the
    merged attention [N, H, D] in q's dtype."""
    rows, heads, dim = q.shape
    b, seen, kv_heads, _ = keys.shape
    width = rows // b
    if (rows != b * width or keys.stride() != values.stride() or keys.stride(3) != 1
            or q.stride(2) != 1 or prefix_out.stride(2) != 1 or allowed.stride(2) != 1
            or tuple(allowed.shape) != (b, width, seen) or heads % kv_heads):
        raise ValueError(f"tree_attention: inconsistent shapes or strides: q {tuple(q.shape)}, "
                         f"keys {tuple(keys.shape)}, allowed {tuple(allowed.shape)}")
    out = torch.empty_like(q)
    allowed = allowed.view(torch.uint8)
    _tree_attention_kernel[(rows, heads)](
        q, keys, values, allowed, prefix_out, prefix_lse, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        allowed.stride(0), allowed.stride(1), prefix_out.stride(0), prefix_out.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), out.stride(0), out.stride(1),
        width, seen, heads // kv_heads, lse_scale, dim ** -0.5,
        D=dim, BLOCK_T=triton.next_power_of_2(seen), BLOCK_D=triton.next_power_of_2(dim))
    return out
