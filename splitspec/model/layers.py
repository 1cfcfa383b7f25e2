"""Llama building blocks whose parameter names match Hugging Face checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from splitspec.attention.base import AttentionBackend, AttentionMetadata
from splitspec.kernels import Fp8Weight, fp8_linear_torch, quantize_fp8
from splitspec.kv_cache import KVCache
from splitspec.model.config import LlamaConfig, RopeConfig
from splitspec.model.parallel import SINGLE, TPGroup, layout


@dataclass
class AttentionContext:
    """The per-forward attention state every layer needs (passed explicitly, never global)."""

    backend: AttentionBackend
    meta: AttentionMetadata
    cache: KVCache
    layer_offset: int = 0  # first cache layer used by this model (a head may share a cache)


class RMSNorm(nn.Module):
    kernels: ModuleType | None = None  # set by use_fused_kernels: one Triton kernel, not six

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x): a residual add and the norm after it."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self(summed), summed


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 frequency scaling when configured."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv_freq
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class Rotary(nn.Module):
    kernels: ModuleType | None = None  # set by use_fused_kernels

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, H_kv, D], positions: [T]
        if self.kernels is not None:  # q rotated into a new contiguous tensor, k in place
            return self.kernels.rope(q, k, positions, self.inv_freq), k
        freqs = positions.float()[:, None] * self.inv_freq[None, :]       # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :].to(q.dtype), emb.sin()[:, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x W^T in torch: a weight in fp8 (quantize_projections) as its codes times its scales."""
    if isinstance(w, Fp8Weight):
        return fp8_linear_torch(x, w)
    return nn.functional.linear(x, w)


def linear_of(kernels: ModuleType | None):
    """The projection x W^T: ``kernels.linear`` (one row through the GEMV kernel, a few rows
    of an fp8 weight through its own kernel) when the Triton kernels are on, else torch's."""
    return torch_linear if kernels is None else kernels.linear


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    kernels: ModuleType | None = None  # set by use_fused_kernels (the projections)

    def __init__(self, cfg: LlamaConfig, in_features: int | None = None,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        in_features = in_features or cfg.hidden_size
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if tp.size > 1:
            lay = layout(cfg, tp)
            self.num_heads, self.num_kv_heads = lay.heads, lay.kv_heads
        self.q_proj = nn.Linear(in_features, self.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.qkv: torch.Tensor | None = None  # set by fuse_weights
        self.fp8: dict[str, Fp8Weight] = {}  # qkv and o_proj, when quantize_projections ran

    def fuse_weights(self) -> None:
        """One GEMM for q, k and v: the three weights become views of one [q+2kv, in]."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """The weights the forward multiplies by, by their names in ``fp8``."""
        return {"qkv": fused_weight(self, self.qkv), "o_proj": self.o_proj.weight}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layer: int,
                ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        linear = linear_of(self.kernels)
        if self.qkv is not None:
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = linear(x, self.fp8.get("qkv", self.qkv)).split(
                [q_width, kv_width, kv_width], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions)
        out = ctx.backend.forward(ctx.layer_offset + layer, q, k, v, ctx.meta, ctx.cache)
        return self.tp.all_reduce(linear(out.reshape(t, self.num_heads * self.head_dim),
                                         self.fp8.get("o_proj", self.o_proj.weight)))


class LlamaMLP(nn.Module):
    kernels: ModuleType | None = None  # set by use_fused_kernels (SiLU-and-multiply, the
    # projections)

    def __init__(self, cfg: LlamaConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        start, stop = layout(cfg, tp).inter if tp.size > 1 else (0, cfg.intermediate_size)
        self.gate_proj = nn.Linear(cfg.hidden_size, stop - start, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, stop - start, bias=False)
        self.down_proj = nn.Linear(stop - start, cfg.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by fuse_weights
        self.fp8: dict[str, Fp8Weight] = {}  # gate_up and down, when quantize_projections ran

    def fuse_weights(self) -> None:
        """One GEMM for gate and up: their weights become views of one [2I, H]."""
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """The weights the forward multiplies by, by their names in ``fp8``."""
        return {"gate_up": fused_weight(self, self.gate_up), "down": self.down_proj.weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = linear_of(self.kernels)
        if self.gate_up is None:
            act = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            gate_up = linear(x, self.fp8.get("gate_up", self.gate_up))
            if self.kernels is not None:
                act = self.kernels.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = nn.functional.silu(gate) * up
        return self.tp.all_reduce(linear(act, self.fp8.get("down", self.down_proj.weight)))


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate bias-free linears' weights (by output rows) into one tensor and make each
    linear's weight a view of its rows, so the state dict and the fused GEMM share storage."""
    with torch.no_grad():
        fused = torch.cat([lin.weight for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused


def quantize_projections(module: nn.Module) -> int:
    """Give every projection of module a copy of its weight in fp8 (splitspec.kernels.
    quantize_fp8), which the projections then use: each submodule's ``projection_weights()``
    into its ``fp8``. Returns how many. The weights stay as they were beside their copies,
    for the many-row calls."""
    count = 0
    for sub in module.modules():
        if hasattr(sub, "projection_weights"):
            sub.fp8 = {name: quantize_fp8(w) for name, w in sub.projection_weights().items()}
            count += len(sub.fp8)
    return count


def fused_weight(module: nn.Module, fused: torch.Tensor | None) -> torch.Tensor:
    """``fused`` (a module's q/k/v or gate/up weight), or ValueError when fuse_weights has not
    run: the fused projection is the one the forward multiplies by."""
    if fused is None:
        raise ValueError(f"{type(module).__name__}: fuse_weights first (its fused projection is "
                         "what is quantized)")
    return fused


def use_fused_kernels(module: nn.Module, on: bool = True) -> None:
    """Route every norm, rotary embedding, MLP activation and projection of module through
    the Triton kernels of splitspec.kernels.fused_ops (CUDA, needs triton), or back to torch:
    every submodule whose class declares ``kernels``."""
    kernels = None
    if on:
        from splitspec.kernels import fused_ops as kernels
    for sub in module.modules():
        if hasattr(type(sub), "kernels"):
            sub.kernels = kernels


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its input norm's output ``x`` and the residual stream ``h`` that
        was normed: returns the MLP's output and the stream it is still to be added to. The
        caller leaves that add to the next norm (the next layer's input norm or the final
        one: :meth:`RMSNorm.add_forward`), which does it in its own kernel: one kernel a
        layer fewer than adding here, and the same bits."""
        attn = self.self_attn(x, positions, self.layer, ctx)
        x, h = self.post_attention_layernorm.add_forward(attn, h)
        return self.mlp(x), h
