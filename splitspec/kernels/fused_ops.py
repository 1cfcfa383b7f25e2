"""The decoder layer's small operations, one Triton kernel each (the model's fast path on CUDA).

At batch 1 a Llama step is bound by reading the weights, and every extra kernel
launch between the GEMMs is time the GPU is not reading them. The torch forms
of RMSNorm, rotary embedding, SiLU-and-multiply and the KV cache store take
four to eight kernels each (casts, reductions, concatenations, index
arithmetic); each of these takes one:

- :func:`rms_norm` and :func:`add_rms_norm` (the residual add and the next
  norm together, writing the new residual stream as well);
- :func:`embed_norm_pair`, an EAGLE-3 layer's input: the token embeddings gathered and
  normed beside the normed hidden states, in one [T, 2H] (torch: a gather, two norms and
  a concatenation);
- :func:`rope` (queries out of place into a contiguous tensor, keys in place;
  cos/sin computed from the positions and the model's inverse frequencies);
- :func:`silu_mul` over the fused gate/up projection;
- :func:`store_kv`: K and V of every token into its cache slot;
- :func:`linear`, the projections, one row at a time through splitspec/kernels/gemv.py;
- :func:`top_logprobs`, the draft's log-softmax and top-k (splitspec/kernels/top_logprobs.py).

Each rounds where the torch form (Hugging Face's) rounds, so in bf16 they agree
with it to the last bit or one rounding step; the torch forms in
splitspec.model.layers are the references (tests/kernel_cases.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitspec.kernels.gemv import linear
from splitspec.kernels.top_logprobs import top_logprobs

__all__ = ["add_rms_norm", "embed_norm_pair", "linear", "rms_norm", "rope", "silu_mul",
           "store_kv", "top_logprobs"]


@triton.jit
def _store_normed(dst, h, w, eps, N: tl.constexpr, keep):
    """Store w * normalise(h) (float32 rows, masked by keep) at dst, rounded as torch's RMSNorm
    rounds: the normalised row to dst's dtype, then the product."""
    scale = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * scale).to(dst.dtype.element_ty).to(tl.float32)
    tl.store(dst, (normed * w).to(dst.dtype.element_ty), mask=keep)


@triton.jit
def _norm_kernel(x, residual, weight, out, residual_out, eps, N: tl.constexpr,
                 BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    h = tl.load(x + row * N + cols, mask=keep, other=0.0).to(tl.float32)
    if ADD:  # the new residual stream, rounded to its dtype as torch's add rounds it
        h = h + tl.load(residual + row * N + cols, mask=keep, other=0.0).to(tl.float32)
        h = h.to(residual_out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(residual_out + row * N + cols, h, mask=keep)
        h = h.to(tl.float32)
    w = tl.load(weight + cols, mask=keep, other=0.0).to(tl.float32)
    _store_normed(out + row * N + cols, h, w, eps, N, keep)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as a contiguous [T, H] (a view when x is contiguous already)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dimension of x [..., H]."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        n = rows.shape[1]
        _norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, eps, N=n,
                                       BLOCK=triton.next_power_of_2(n), ADD=False)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalise(residual + x), residual + x) for x, residual [..., H]."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    rows, residual_rows = _rows(x), _rows(residual)
    out, summed = torch.empty_like(rows), torch.empty_like(residual_rows)
    if rows.shape[0]:
        n = rows.shape[1]
        _norm_kernel[(rows.shape[0],)](rows, residual_rows, weight, out, summed, eps, N=n,
                                       BLOCK=triton.next_power_of_2(n), ADD=True)
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _norm_pair_kernel(ids, table, table_row, hidden, hidden_row, w_embed, w_hidden, out,
                      eps_embed, eps_hidden, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)  # 0: the token's embedding, 1: the hidden state
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    if half == 0:
        token = tl.load(ids + row).to(tl.int64)
        h = tl.load(table + token * table_row + cols, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_embed + cols, mask=keep, other=0.0).to(tl.float32)
        eps = eps_embed
    else:
        h = tl.load(hidden + row * hidden_row + cols, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_hidden + cols, mask=keep, other=0.0).to(tl.float32)
        eps = eps_hidden
    _store_normed(out + row * 2 * N + half * N + cols, h, w, eps, N, keep)


def embed_norm_pair(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor,
                    w_embed: torch.Tensor, w_hidden: torch.Tensor, eps_embed: float,
                    eps_hidden: float) -> torch.Tensor:
    """[w_embed * normalise(table[ids]) ‖ w_hidden * normalise(hidden)]: [T, 2H] for ids [T],
    table [V, H] and hidden [T, H] of table's dtype, in one kernel."""
    rows = ids.shape[0] if ids.dim() == 1 else -1
    if table.dtype != hidden.dtype or hidden.shape != (rows, table.shape[1]):
        raise ValueError(f"ids {tuple(ids.shape)}, table {tuple(table.shape)} {table.dtype} and "
                         f"hidden {tuple(hidden.shape)} {hidden.dtype}: want [T], [V, H], [T, H] "
                         "of one dtype")
    n = table.shape[1]
    if table.stride(1) != 1:
        table = table.contiguous()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    out = torch.empty(ids.shape[0], 2 * n, dtype=table.dtype, device=table.device)
    if ids.shape[0]:
        _norm_pair_kernel[(ids.shape[0], 2)](ids, table, table.stride(0), hidden,
                                             hidden.stride(0), w_embed, w_hidden, out,
                                             eps_embed, eps_hidden, N=n,
                                             BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _silu_mul_kernel(gate_up, out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < N
    gate = tl.load(gate_up + row * 2 * N + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * 2 * N + N + cols, mask=keep, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * N + cols, (act * up).to(out.dtype.element_ty), mask=keep)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first): [..., I]."""
    rows = _rows(gate_up)
    t, width = rows.shape
    out = torch.empty(t, width // 2, dtype=rows.dtype, device=rows.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(width // 2, block))](rows, out, N=width // 2,
                                                              BLOCK=block)
    return out.view(*gate_up.shape[:-1], width // 2)


def _check_heads(**tensors: torch.Tensor) -> None:
    """[T, H, D] tensors whose rows may be strided (views into a fused projection) but whose
    heads lie contiguous within a row, as the kernels index them."""
    for name, x in tensors.items():
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"{name} {tuple(x.shape)} must be [T, H, D] with each token's "
                             "heads contiguous")


@triton.jit
def _rope_kernel(q, k, q_out, positions, inv_freq, q_row_stride, k_row_stride,
                 HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    keep = cols < HALF
    angle = tl.load(positions + token).to(tl.float32) * tl.load(inv_freq + cols, mask=keep,
                                                                other=0.0)
    if head < HEADS:
        src = q + token * q_row_stride + head * 2 * HALF
        dst = q_out + (token * HEADS + head) * 2 * HALF
    else:
        src = k + token * k_row_stride + (head - HEADS) * 2 * HALF
        dst = src
    x1 = tl.load(src + cols, mask=keep, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=keep, other=0.0)
    cos = tl.cos(angle).to(x1.dtype).to(tl.float32)
    sin = tl.sin(angle).to(x1.dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # torch: q * cos + rotate_half(q) * sin, each product and the sum rounded to q's dtype
    lo = (a1 * cos).to(x1.dtype).to(tl.float32) + (-a2 * sin).to(x1.dtype).to(tl.float32)
    hi = (a2 * cos).to(x1.dtype).to(tl.float32) + (a1 * sin).to(x1.dtype).to(tl.float32)
    tl.store(dst + cols, lo.to(x1.dtype), mask=keep)
    tl.store(dst + HALF + cols, hi.to(x1.dtype), mask=keep)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of q [T, H, D] and k [T, H_kv, D] at positions
    [T]: returns the rotated q (contiguous), rotates k in place. q and k may be views into a
    fused QKV projection (rows strided, each row's heads contiguous)."""
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    _check_heads(q=q, k=k)
    if inv_freq.dtype != torch.float32 or inv_freq.numel() * 2 != dim:
        raise ValueError(f"inv_freq must be float32 [{dim // 2}]")
    q_out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    if t:
        _rope_kernel[(t, heads + kv_heads)](q, k, q_out, positions, inv_freq, q.stride(0),
                                            k.stride(0), HEADS=heads, HALF=dim // 2,
                                            BLOCK=triton.next_power_of_2(dim // 2))
    return q_out


@triton.jit
def _store_kv_kernel(data, k, v, slots, k_row_stride, v_row_stride, PAGE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < WIDTH
    slot = tl.load(slots + token).to(tl.int64)
    # data is this layer's [num_pages, 2, PAGE, WIDTH]
    k_row = ((slot // PAGE) * 2) * PAGE + slot % PAGE
    v_row = k_row + PAGE
    tl.store(data + k_row * WIDTH + cols,
             tl.load(k + token * k_row_stride + cols, mask=keep).to(data.dtype.element_ty),
             mask=keep)
    tl.store(data + v_row * WIDTH + cols,
             tl.load(v + token * v_row_stride + cols, mask=keep).to(data.dtype.element_ty),
             mask=keep)


def store_kv(layer_data: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write k, v [T, H_kv, D] (rows may be strided) at global slots [T] of one layer's
    cache [num_pages, 2, page_size, H_kv, D] (contiguous)."""
    if not layer_data.is_contiguous():
        raise ValueError("the layer's KV cache must be contiguous")
    _, _, page, kv_heads, dim = layer_data.shape
    width = kv_heads * dim
    _check_heads(k=k, v=v)
    t = slots.numel()
    if t:
        block = min(1024, triton.next_power_of_2(width))
        _store_kv_kernel[(t, triton.cdiv(width, block))](
            layer_data, k, v, slots, k.stride(0), v.stride(0), PAGE=page,
            WIDTH=width, BLOCK=block)
