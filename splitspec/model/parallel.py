"""Tensor parallelism: which shard of every weight a rank holds, and the collectives.

A :class:`TPGroup` names a rank and the group it computes with (size 1 = no
parallelism, no collectives). The Llama modules take one and build only their
shard:

- attention: query heads split evenly (the group size must divide them); KV
  heads split when the size divides them, else replicated, rank r using KV
  head r * num_kv_heads // size (the size must then be a multiple of the KV
  heads); ``o_proj`` is row-parallel, its partial sums all-reduced;
- MLP: ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel;
- embedding and LM head: vocabulary-parallel (contiguous ranges of
  ceil(V / size) ids); the embedding all-reduces, the LM head all-gathers.

:func:`shard_plan` says, for every checkpoint tensor name, which slice a rank
reads, so that loading never materialises the full model on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from splitspec.model.config import LlamaConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup (None when size == 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (same shape on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


class Shard(NamedTuple):
    """Rows [start, stop) of dimension ``dim`` of a checkpoint tensor; dim None = whole."""

    dim: int | None
    start: int = 0
    stop: int = 0


WHOLE = Shard(None)


def tp_error(cfg: LlamaConfig, size: int) -> str | None:
    """Why this model cannot run over ``size`` ranks, or None."""
    if size < 1:
        return f"the tensor-parallel size must be at least 1, got {size}"
    if cfg.num_heads % size:
        return (f"--tp {size} does not divide the {cfg.num_heads} attention heads; use one of "
                f"{[n for n in range(1, cfg.num_heads + 1) if cfg.num_heads % n == 0]}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        return (f"--tp {size} neither divides the {cfg.num_kv_heads} KV heads nor is a multiple "
                "of them")
    return None


class Layout(NamedTuple):
    """One rank's share of the model's dimensions."""

    heads: int                  # query heads on this rank
    kv_heads: int               # KV heads on this rank
    kv_first: int               # first KV head this rank holds
    inter: tuple[int, int]      # MLP intermediate rows [start, stop)
    vocab: tuple[int, int]      # vocabulary ids [start, stop)
    vocab_shard: int            # ceil(V / size): every rank's padded vocabulary width


def layout(cfg: LlamaConfig, tp: TPGroup) -> Layout:
    problem = tp_error(cfg, tp.size)
    if problem:
        raise ValueError(problem)
    heads = cfg.num_heads // tp.size
    if cfg.num_kv_heads % tp.size == 0:
        kv_heads, kv_first = cfg.num_kv_heads // tp.size, tp.rank * cfg.num_kv_heads // tp.size
    else:  # more ranks than KV heads: each rank keeps the one its query heads use
        kv_heads, kv_first = 1, tp.rank * cfg.num_kv_heads // tp.size
    return Layout(heads, kv_heads, kv_first, _split(cfg.intermediate_size, tp),
                  _split(cfg.vocab_size, tp), -(-cfg.vocab_size // tp.size))


def _split(total: int, tp: TPGroup) -> tuple[int, int]:
    """Rank's contiguous share of total rows: ceil(total / size) each, the last ones shorter."""
    width = -(-total // tp.size)
    return min(tp.rank * width, total), min((tp.rank + 1) * width, total)


def shard_plan(cfg: LlamaConfig, tp: TPGroup) -> dict[str, Shard]:
    """Checkpoint tensor name -> the slice this rank loads (names absent here load whole)."""
    if tp.size == 1:
        return {}
    lay = layout(cfg, tp)
    hd = cfg.head_dim
    q = Shard(0, tp.rank * lay.heads * hd, (tp.rank + 1) * lay.heads * hd)
    kv = Shard(0, lay.kv_first * hd, (lay.kv_first + lay.kv_heads) * hd)
    plan = {"model.embed_tokens.weight": Shard(0, *lay.vocab),
            "lm_head.weight": Shard(0, *lay.vocab)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        plan[p + "self_attn.q_proj.weight"] = q
        plan[p + "self_attn.k_proj.weight"] = kv
        plan[p + "self_attn.v_proj.weight"] = kv
        plan[p + "self_attn.o_proj.weight"] = Shard(1, q.start, q.stop)
        plan[p + "mlp.gate_proj.weight"] = Shard(0, *lay.inter)
        plan[p + "mlp.up_proj.weight"] = Shard(0, *lay.inter)
        plan[p + "mlp.down_proj.weight"] = Shard(1, *lay.inter)
    return plan


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [start, stop) of the embedding; ids outside them contribute zeros, summed over ranks."""

    def __init__(self, cfg: LlamaConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop = layout(cfg, tp).vocab if tp.size > 1 else (0, cfg.vocab_size)
        self.weight = torch.nn.Parameter(torch.empty(self.stop - self.start, cfg.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = torch.nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)
