"""EAGLE-2 top-k tree drafting kept on the device, batched over sequences of one tree shape.

The host-driven form (drafter.py's ``_grow``, still used for sampled trees)
reads every level's top-k back, keeps the candidates in Python and builds each
level's attention mask and page plan on the host: about 3 ms a level on a GPU,
almost all of it host time. Here a level is a fixed sequence of tensor
operations on [B, k] frontiers, and the host sees the candidates once, at the
end, to pick each tree (:meth:`_Candidates.best_tree`, the same rule as the
host form).

A frontier node at depth j of sequence b attends to

- b's committed entries, read from the paged cache (never written here):
  :class:`PrefixAttention`, planned once per draft call since the entries do
  not change while drafting, and
- its ancestors and itself, whose K/V live in a dense per-call scratch
  [layers, 2, B, depth - 1, k, H_kv, D] (level j - 1 holds the depth-j frontier),

and the two parts are merged by their log-sum-exp: exactly the softmax over
the union, which is what the host form computes with one masked pass
(splitspec/attention/cascade.py, shared with the target's tree verification;
on CUDA the scratch part and the merge are one Triton kernel).
Ancestry is a [B, k, depth - 1, k] boolean table: a child inherits its
parent's row and marks itself at its own level.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.cascade import FlashInferPrefix, PrefixAttention, cascade_attention
from splitspec.attention.flashinfer_backend import FlashInferBackend
from splitspec.kv_cache import KVCache, PageTable
from splitspec.model.layers import AttentionContext

if TYPE_CHECKING:
    from draft_service.drafter import TreeShape
    from draft_service.models import DraftModel

@dataclass
class NodeMetadata(AttentionMetadata):
    prefix: PrefixAttention
    scratch: torch.Tensor   # [L, 2, B, depth - 1, k, H_kv, D]: K/V of the frontiers so far
    ancestry: torch.Tensor  # [B, k, (depth - 1) * k] bool: scratch columns each row may see
    level: int              # this pass's frontier goes to scratch level `level`


class NodeAttention(AttentionBackend):
    """The attention of one drafting level: the paged prefix and the scratch, merged."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        raise TypeError("NodeAttention runs levels set up by TreeSearch; it does not plan")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: NodeMetadata, cache: KVCache) -> torch.Tensor:
        b, width = meta.ancestry.shape[:2]
        kv_heads, dim = k.shape[1], k.shape[2]
        scratch, level = meta.scratch[layer], meta.level
        scratch[0, :, level] = k.view(b, width, kv_heads, dim)
        scratch[1, :, level] = v.view(b, width, kv_heads, dim)
        seen = (level + 1) * width
        keys = scratch[0, :, : level + 1].reshape(b, seen, kv_heads, dim)
        values = scratch[1, :, : level + 1].reshape(b, seen, kv_heads, dim)
        return cascade_attention(layer, q, keys, values, meta.ancestry[:, :, :seen], meta.prefix,
                                 cache)


@dataclass
class Candidates:
    """Every candidate of a batch of trees, on the host: [B, C] in generation order (the
    depth-1 candidates, then per level each frontier row's k children)."""

    tokens: list[list[int]]
    parents: list[list[int]]   # candidate index, -1 for depth 1
    scores: list[list[float]]  # cumulative log-prob


class GraphKey(NamedTuple):
    size: int   # the bucket: padded number of sequences
    topk: int
    depth: int


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    prefix: FlashInferPrefix  # its wrapper in CUDA-graph mode, planned before each replay
    roots: torch.Tensor       # [size, X] static input
    positions: torch.Tensor   # [size * topk] static input: each row's last entry position
    packed: torch.Tensor      # [3, size, C] static output (see TreeSearch._search)


class TreeSearch:
    """Greedy EAGLE-2 drafting of B trees of one shape on the model's device.

    Depth 1: the top-k of each root's log-probs. Each later level: ONE forward
    over the B * k frontier nodes, each node's top-k children (score = the
    parent's score + the child's log-prob, in float64 as on the host), and the
    best k of the k * k children become the next frontier, in score order.

    After :meth:`capture` (CUDA with flashinfer), a batch of a captured shape
    and at most the largest bucket replays the graph of the smallest bucket that
    holds it; the rows beyond the batch are padding (a zero root on a scratch
    page no sequence owns). Other batches run eagerly.
    """

    def __init__(self, model: DraftModel, cache: KVCache, prefix: PrefixAttention) -> None:
        self.model, self.cache, self.prefix = model, cache, prefix
        self.attention = NodeAttention()
        self.graphs: dict[GraphKey, _Graph] = {}
        self._buckets: tuple[int, ...] = ()
        self._pad_table: PageTable | None = None

    def run(self, roots: torch.Tensor, tables: list[PageTable], num_entries: list[int],
            shape: TreeShape) -> Candidates:
        """roots [B, X]: each sequence's last entry's state; its entries in tables."""
        n, k, device = roots.shape[0], shape.topk, roots.device
        key = self._key(n, shape)
        if key is None:
            last = torch.tensor(num_entries, device=device).repeat_interleave(k) - 1
            if shape.num_steps > 1:
                self.prefix.plan(tables, num_entries, k, device)
            packed = self._search(self.prefix, roots, last, k, shape.num_steps)
        else:
            g, pad = self.graphs[key], key.size - n
            g.prefix.plan([*tables, *[self._pad_table] * pad], [*num_entries, *[1] * pad], k, device)
            g.roots[:n].copy_(roots)
            g.roots[n:].zero_()
            last = torch.tensor([*num_entries, *[1] * pad]).repeat_interleave(k) - 1
            g.positions.copy_(last, non_blocking=True)
            g.graph.replay()
            packed = g.packed[:, :n]
        tok, par, score = packed.cpu().unbind(0)  # the one read back
        return Candidates(tok.long().tolist(), par.long().tolist(), score.tolist())

    def _key(self, n: int, shape: TreeShape) -> GraphKey | None:
        if not self._buckets or n > self._buckets[-1]:
            return None
        key = GraphKey(next(b for b in self._buckets if b >= n), shape.topk, shape.num_steps)
        return key if key in self.graphs else None

    def capture(self, backend: FlashInferBackend, buckets: tuple[int, ...],
                shapes: list[tuple[int, int]], pad_page: int, max_context: int) -> float:
        """Capture the search for every bucket and (topk, depth) (largest bucket first, so the
        smaller reuse its memory); ``pad_page`` is a page no sequence will own. Returns the
        seconds taken."""
        started = time.perf_counter()
        device = backend.device
        page = self.cache.page_size
        self._pad_table = PageTable(page, [pad_page], 1)
        pool = torch.cuda.graph_pool_handle()
        max_pages = -(-max_context // page)
        for topk, depth in shapes:
            for size in sorted(buckets, reverse=True):
                prefix = FlashInferPrefix(backend.shape, backend.workspace, size * topk, max_pages)
                prefix.plan([self._pad_table] * size, [1] * size, topk, device)
                roots = torch.zeros(size, self.model.state_width, dtype=self.model.dtype, device=device)
                positions = torch.zeros(size * topk, dtype=torch.int64, device=device)
                with torch.inference_mode():
                    side = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        for _ in range(2):  # lazy initialisation must not happen in capture
                            self._search(prefix, roots, positions, topk, depth)
                    torch.cuda.current_stream(device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        packed = self._search(prefix, roots, positions, topk, depth)
                self.graphs[GraphKey(size, topk, depth)] = _Graph(graph, prefix, roots, positions,
                                                                  packed)
        self._buckets = tuple(sorted(buckets))
        torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def _search(self, prefix: PrefixAttention, roots: torch.Tensor, last: torch.Tensor, k: int,
                steps: int) -> torch.Tensor:
        """Device work only (no host reads: a CUDA graph can hold it). last [B * k]: each
        row's last entry position; prefix planned for B sequences of k rows. Returns
        [3, B, C] float64: every candidate's target id, parent (-1 for depth 1) and score."""
        model, b, device = self.model, roots.shape[0], roots.device
        top_lp, top_ids = torch.log_softmax(model.logits(roots), dim=-1).topk(k, dim=-1)
        tokens = [model.to_target_ids(top_ids)]                                   # [B, k]
        scores = [top_lp.double()]
        parents = [torch.full((b, k), -1, dtype=torch.int64, device=device)]
        if steps > 1:
            cfg = (model.num_layers, 2, b, steps - 1, k, model.num_kv_heads, model.head_dim)
            scratch = torch.empty(cfg, dtype=model.dtype, device=device)
            ancestry = torch.zeros(b, k, steps - 1, k, dtype=torch.bool, device=device)
            eye = torch.eye(k, dtype=torch.bool, device=device)
            front_tok, front_score = tokens[0], scores[0]
            front_cand = torch.arange(k, device=device).expand(b, k)
            parent_states = roots.repeat_interleave(k, dim=0)                     # [B * k, X]
            for level in range(steps - 1):
                ancestry[:, :, level] = eye
                meta = NodeMetadata(torch.empty(0), prefix, scratch, ancestry.view(b, k, -1), level)
                ctx = AttentionContext(self.attention, meta, self.cache)
                states = model.forward_nodes(front_tok.reshape(-1), parent_states,
                                             last + (level + 1), ctx)             # [B * k, X]
                lp, ids = torch.log_softmax(model.logits(states), dim=-1).topk(k, dim=-1)
                first = k + level * k * k  # candidate index of this level's first child
                child_score = (front_score[:, :, None] + lp.double().view(b, k, k)).view(b, k * k)
                child_tok = model.to_target_ids(ids).view(b, k * k)
                tokens.append(child_tok)
                scores.append(child_score)
                parents.append(front_cand.repeat_interleave(k, dim=1))
                if level == steps - 2:
                    break
                front_score, best = child_score.topk(k, dim=-1)                   # sorted
                row = best // k  # the frontier row each new frontier node descends from
                front_tok = child_tok.gather(1, best)
                front_cand = first + best
                parent_states = states.view(b, k, -1).gather(
                    1, row[:, :, None].expand(b, k, states.shape[-1])).reshape(b * k, -1)
                ancestry = ancestry.gather(1, row[:, :, None, None].expand(b, k, steps - 1, k))
        return torch.stack([torch.cat(tokens, 1).double(), torch.cat(parents, 1).double(),
                            torch.cat(scores, 1)])
