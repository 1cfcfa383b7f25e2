"""EAGLE-2 top-k tree drafting kept on the device, batched over sequences of one tree shape.

The host-driven form (drafter.py's ``_grow``, still used for sampled trees)
reads every level's top-k back, keeps the candidates in Python and builds each
level's attention mask and page plan on the host: about 3 ms a level on a GPU,
almost all of it host time. Here a level is a fixed sequence of tensor
operations on [B, k] frontiers (on CUDA, what follows each level's top k is one
kernel: splitspec/kernels/tree_level.py), and the host sees the candidates once,
at the end, to pick each tree (:meth:`Candidates.best_trees`).

A frontier node at depth j of sequence b attends to

- b's committed entries, read from the paged cache (never written here):
  :class:`PrefixAttention`, planned once per draft call since the entries do
  not change while drafting, and
- its ancestors and itself, whose K/V live in a dense per-call scratch
  [layers, 2, B, T, H_kv, D], level j - 1's frontier in columns
  [C + (j - 1) k, C + j k),

and the two parts are merged by their log-sum-exp: exactly the softmax over
the union, which is what the host form computes with one masked pass
(splitspec/attention/cascade.py, shared with the target's tree verification;
on CUDA the scratch part and the merge are one Triton kernel). Which columns
a row sees is a [B, k, T] boolean table: a child inherits its parent's row
and marks itself at its own level.

The draft call's catch-up (the entries the target committed since the last
call) can run in the same pass (:meth:`TreeSearch.run_caught_up`): each
sequence's new entries, padded to C = depth + 1 (the most one verify step
commits), are a causal chain in the scratch's first C columns and are written
to the paged cache too; the prefix is then the entries before them, the root
of each tree the chain's last real row, and every node sees the chain's real
columns. Captured with the search, this takes the eager catch-up forward and
its attention plan off the host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.cascade import PrefixAttention, merge_with_prefix
from splitspec.attention.decode_table import TablePrefix, scratch_floats
from splitspec.attention.flashinfer_backend import FlashInferBackend
from splitspec.cuda_graphs import replay_once
from splitspec.kernels import HAS_TRITON, tree_level_torch
from splitspec.kv_cache import KVCache, PageTable
from splitspec.model.layers import AttentionContext
from splitspec.staging import HostTwin
from splitspec.tree import Tree

if TYPE_CHECKING:
    from draft_service.drafter import TreeShape
    from draft_service.models import DraftModel

T = TypeVar("T")

@dataclass
class NodeMetadata(AttentionMetadata):
    prefix: PrefixAttention
    scratch: torch.Tensor   # [L, 2, B, T, H_kv, D]: K/V of the chain and the frontiers so far
    allowed: torch.Tensor   # [B, W, T] bool: the scratch columns each row of the pass may see
    start: int              # this pass's K/V go to scratch columns [start, start + W)
    rows: int               # rows per sequence the prefix was planned for (>= W)
    commit: bool = False    # the catch-up chain: also written to the paged cache (write_slots)


class NodeAttention(AttentionBackend):
    """The attention of one drafting pass: the paged prefix and the scratch, merged."""

    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> AttentionMetadata:
        raise TypeError("NodeAttention runs levels set up by TreeSearch; it does not plan")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: NodeMetadata, cache: KVCache) -> torch.Tensor:
        b, width = meta.allowed.shape[:2]
        if meta.commit:
            cache.write(layer, meta.write_slots, k, v)
        kv_heads, dim = k.shape[1], k.shape[2]
        scratch, end = meta.scratch[layer], meta.start + width
        scratch[0, :, meta.start:end] = k.view(b, width, kv_heads, dim)
        scratch[1, :, meta.start:end] = v.view(b, width, kv_heads, dim)
        keys, values, allowed = scratch[0, :, :end], scratch[1, :, :end], meta.allowed[:, :, :end]
        if meta.rows == width or meta.prefix.any_rows:
            return meta.prefix.attend_with(layer, q, cache, keys, values, allowed)
        out_p, lse_p = self._prefix(layer, q, meta, cache, b, width)
        return merge_with_prefix(q, keys, values, allowed, out_p, lse_p, meta.prefix.lse_scale)

    @staticmethod
    def _prefix(layer: int, q: torch.Tensor, meta: NodeMetadata, cache: KVCache, b: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix attention of W rows per sequence, through a plan of ``meta.rows`` rows
        per sequence (the catch-up chain and the levels share one plan; padding rows are 0)."""
        heads, dim = q.shape[1], q.shape[2]
        padded = q.new_zeros(b, meta.rows, heads, dim)
        padded[:, :width] = q.view(b, width, heads, dim)
        out, lse = meta.prefix.attend(layer, padded.view(-1, heads, dim), cache)
        return (out.view(b, meta.rows, heads, dim)[:, :width].reshape(b * width, heads, dim),
                lse.view(b, meta.rows, heads)[:, :width].reshape(b * width, heads))


BATCHED_ROWS = 8  # Candidates.best_trees picks all rows at once from this many (else by row)


@dataclass
class Candidates:
    """Every candidate of a batch of trees, on the host: [B, C] in generation order (the
    depth-1 candidates, then per level each frontier row's k children), so a candidate's
    column is never before its parent's, nor a shallower candidate's."""

    tokens: np.ndarray   # [B, C] int64: target ids
    parents: np.ndarray  # [B, C] int64: candidate index, -1 for depth 1
    scores: np.ndarray   # [B, C] float64: cumulative log-prob

    @classmethod
    def of_packed(cls, packed: np.ndarray) -> Candidates:
        """From the search's packed [3, B, C] float64 (ids, parents, scores)."""
        return cls(packed[0].astype(np.int64), packed[1].astype(np.int64), packed[2].copy())

    def best_trees(self, size: int) -> list[Tree]:
        """Every row's :meth:`best_tree`, picked for all rows at once: by score (ties in
        generation order), the first ``size``, in generation order, each parent's place
        among them found by one search. That is :meth:`best_tree`'s pick wherever each of
        those candidates ranks below its parent, as in a real search, whose children never
        score above their parents; a row where one does not is picked by :meth:`best_tree`.
        On the CPU machine, at the 8/4/5 tree: 157 us for 64 rows against 488 row by row,
        but 31 against 7 for one row, so under ``BATCHED_ROWS`` rows it goes row by row."""
        rows, columns = self.scores.shape
        if rows < BATCHED_ROWS:
            return [self.best_tree(row, size) for row in range(rows)]
        size = max(min(size, columns), 0)
        order = np.argsort(-self.scores, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(columns)[None, :], axis=1)
        top = order[:, :size]
        parents = np.take_along_axis(self.parents, top, axis=1)
        parent_rank = np.take_along_axis(rank, np.maximum(parents, 0), axis=1)
        ranked = ((parents < 0) | (parent_rank < np.arange(size)[None, :])).all(axis=1)
        kept = np.sort(top, axis=1)  # generation order
        parents = np.take_along_axis(self.parents, kept, axis=1)
        offset = columns * np.arange(rows)[:, None]  # the rows' columns laid end to end
        place = np.searchsorted((kept + offset).ravel(), (parents + offset).ravel())
        tree_parents = np.where(parents < 0, 0,
                                place.reshape(rows, size) - size * np.arange(rows)[:, None] + 1)
        tokens = np.take_along_axis(self.tokens, kept, axis=1).tolist()
        tree_parents = tree_parents.tolist()
        return [Tree(tokens[row], tree_parents[row]) if ranked[row] else self.best_tree(row, size)
                for row in range(rows)]

    def best_tree(self, row: int, size: int) -> Tree:
        """Row ``row``'s best ``size`` candidates (by score, then generation order: of equal
        scores the shallower first), closed under parents (a candidate whose parent was
        passed over is passed over too), parents first (in generation order)."""
        parents = self.parents[row].tolist()
        kept: list[int] = []
        is_kept = [False] * len(parents)
        for c in np.argsort(-self.scores[row], kind="stable").tolist():
            if len(kept) == size:
                break
            if parents[c] >= 0 and not is_kept[parents[c]]:
                continue
            kept.append(c)
            is_kept[c] = True
        kept.sort()
        index = {c: i + 1 for i, c in enumerate(kept)}
        return Tree(self.tokens[row, kept].tolist(),
                    [0 if parents[c] < 0 else index[parents[c]] for c in kept])


# Raw feature bytes as a request brings them: the protobuf field's bytes, or a read-only
# uint8 view of the target's feature memory (splitspec/feature_memory.py), valid until the reply.
FeatureBytes = bytes | np.ndarray


class WireFeatures(NamedTuple):
    """Target features as a draft request carries them: ``rows`` x ``width`` values of
    ``dtype``, row-major in ``data`` (their size checked where they are read, drafter.py's
    ``wire_features``). They stay bytes until copied to where they go: once, straight into
    the catch-up chain's host buffer (:meth:`ChainInputs.fill`) or the eager catch-up's
    (``RowStaging``, splitspec/staging.py), or into a tensor of their own (:meth:`tensor`)."""

    data: FeatureBytes
    rows: int
    width: int
    dtype: torch.dtype

    def tensor(self) -> torch.Tensor:
        """[rows, width], a writable copy."""
        if not self.rows:
            return torch.empty(0, self.width, dtype=self.dtype)
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.rows, self.width)

    def array(self) -> np.ndarray:
        """[rows, width x item size] bytes, a read-only view of ``data`` (no copy)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(
            self.rows, self.width * self.dtype.itemsize)


class CatchUp(NamedTuple):
    """One sequence's new entries, for :meth:`TreeSearch.run_caught_up`."""

    table: PageTable                # its pages, reserved through first + len(tokens)
    first: int                      # the first new entry's slot: the entries before it stay
    tokens: list[int]               # the new entries' tokens
    # [len(tokens), feature_dim] on the host (as received, or a tensor), or None
    features: WireFeatures | torch.Tensor | None


class GraphKey(NamedTuple):
    size: int   # the bucket: padded number of sequences
    topk: int
    depth: int


@dataclass
class _Chain:
    """The catch-up chain of B sequences, C rows each (device tensors; static in a graph)."""

    tokens: torch.Tensor          # [B * C]
    positions: torch.Tensor       # [B * C]
    write_slots: torch.Tensor     # [B * C]: padding rows write to the padding page
    last_row: torch.Tensor        # [B]: each sequence's last real row
    last: torch.Tensor            # [B * k]: its last entry's position, once per frontier row
    allowed: torch.Tensor         # [B, C, C] bool: causal over each sequence's real entries
    features: torch.Tensor | None  # [B * C, F]


class ChainInputs:
    """The catch-up chain's inputs in one byte buffer on the host (pinned on CUDA), each
    field a view of it, and its twin on the model's device, whose views a graph reads:
    :meth:`fill` writes them on the host and sends them in one copy. Built as tensors per
    call, they were a dozen small tensors and seven copies: 0.18 ms of host time at batch 1
    on the CPU machine, against 0.05 ms for :meth:`fill` (1.04 against 0.44 ms at 64)."""

    def __init__(self, seqs: int, width: int, k: int, feature_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.seqs, self.width = seqs, width
        n = seqs * width
        layout = [("tokens", torch.int64, (n,)), ("positions", torch.int64, (n,)),
                  ("write_slots", torch.int64, (n,)), ("last_row", torch.int64, (seqs,)),
                  ("last", torch.int64, (seqs * k,)), ("allowed", torch.bool, (seqs, width, width))]
        if feature_dim:
            layout.append(("features", dtype, (n, feature_dim)))
        offsets, total = [], 0
        for _, kind, shape in layout:
            offsets.append(total)
            size = math.prod(shape) * torch.empty((), dtype=kind).element_size()
            total += -(-size // 16) * 16  # every view 16-byte aligned
        self.sent = torch.zeros(total, dtype=torch.uint8, device=device)
        self._twin = HostTwin(self.sent)

        def views(buffer: torch.Tensor) -> _Chain:
            found = {name: buffer[start:].view(kind)[:math.prod(shape)].view(shape)
                     for (name, kind, shape), start in zip(layout, offsets, strict=True)}
            return _Chain(**{"features": None, **found})

        self.host, self.chain = views(self._twin.host), views(self.sent)
        host = self.host  # numpy views of the host's fields
        if host.features is not None:  # as bytes: [n, feature_dim x item size]
            self._feature_bytes = host.features.view(torch.uint8).numpy()
        self._written = np.zeros(seqs, dtype=np.int64)  # each sequence's rows of features
        self._tokens, self._positions = host.tokens.numpy(), host.positions.numpy()
        self._slots, self._last_row = host.write_slots.numpy(), host.last_row.numpy()
        self._last, self._allowed = host.last.numpy().reshape(seqs, k), host.allowed.numpy()
        # for n real rows: row i sees rows j <= i that are real, and itself
        columns, causal = np.arange(width), np.tri(width, dtype=bool)
        self._masks = np.stack([(causal & (columns < n)) | np.eye(width, dtype=bool)
                                for n in range(width + 1)])

    def fill(self, seqs: list[CatchUp], pad_slot: int) -> None:
        """Each sequence's new entries padded to the width (token 0, written to ``pad_slot``,
        zero features), on the host, then one copy to the device twin."""
        if len(seqs) != self.seqs:
            raise ValueError(f"chain inputs for {self.seqs} sequences, given {len(seqs)}")
        width = self.width
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        counts, firsts, given = [], [], []
        for b, seq in enumerate(seqs):
            num, first = len(seq.tokens), seq.first
            if not 1 <= num <= width:
                raise ValueError(f"a catch-up of {num} entries, the chain holds 1 .. {width}")
            tokens += seq.tokens
            tokens += [0] * (width - num)
            positions += range(first, first + width)
            slots += seq.table.slots(range(first, first + num))
            slots += [pad_slot] * (width - num)
            counts.append(num)
            firsts.append(first)
            if seq.features is not None:
                given.append((b, num, seq.features))
        self._twin.wait()
        self._tokens[:], self._positions[:], self._slots[:] = tokens, positions, slots
        counts_ = np.array(counts)
        self._last_row[:] = counts_ - 1
        self._last[:] = (np.array(firsts) + counts_ - 1)[:, None]
        self._allowed[:] = self._masks[counts_]
        if self.host.features is not None:
            self._put_features(given)
        self._twin.send()

    def _put_features(self, given: list[tuple[int, int, WireFeatures | torch.Tensor]]) -> None:
        """Every row zero but the real entries' given features, as a fresh fill: each given
        sequence's features go into its first rows (request bytes of the buffer's dtype in
        one copy), and only the rows an earlier fill wrote and this one does not are zeroed
        (zeroing all of it was 0.33 ms of a 64-sequence call at the 8B shape, on the CPU)."""
        width, features, raw = self.width, self.host.features, self._feature_bytes
        written = np.zeros_like(self._written)
        for b, num, rows in given:
            start = b * width
            if isinstance(rows, WireFeatures) and rows.dtype == features.dtype:
                raw[start:start + num] = rows.array()
            else:
                features[start:start + num] = (rows.tensor() if isinstance(rows, WireFeatures)
                                               else rows)
            written[b] = num
        for b in np.flatnonzero(self._written > written).tolist():
            raw[b * width + written[b]:b * width + self._written[b]] = 0
        self._written = written


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    prefix: TablePrefix       # its table, planned (filled and copied) before each replay
    roots: torch.Tensor       # [size, X]: static input (search) or output (caught up)
    positions: torch.Tensor   # [size * topk] static input: each row's last entry position
    packed: torch.Tensor      # [3, size, C] static output (see TreeSearch._levels)
    chain: ChainInputs | None = None  # the catch-up's inputs (run_caught_up's graphs)


class TreeSearch:
    """Greedy EAGLE-2 drafting of B trees of one shape on the model's device.

    Depth 1: the top-k of each root's log-probs. Each later level: ONE forward
    over the B * k frontier nodes, each node's top-k children (score = the
    parent's score + the child's log-prob, in float64 as on the host), and the
    best k of the k * k children become the next frontier, in score order
    (equal scores in candidate order).

    After :meth:`capture` (CUDA with flashinfer), a batch of a captured shape
    and at most the largest bucket replays the graph of the smallest bucket that
    holds it, for the search alone (:meth:`run`) and with the catch-up
    (:meth:`run_caught_up`); the rows beyond the batch are padding (token 0 or a
    zero root over a scratch page no sequence owns). Other batches run eagerly.
    """

    def __init__(self, model: DraftModel, cache: KVCache, prefix: PrefixAttention) -> None:
        self.model, self.cache, self.prefix = model, cache, prefix
        self.attention = NodeAttention()
        self.graphs: dict[GraphKey, _Graph] = {}
        self.caught_up: dict[GraphKey, _Graph] = {}
        self._buckets: tuple[int, ...] = ()
        self._pad_table: PageTable | None = None
        self._scratch: torch.Tensor | None = None  # the graphs' prefix scratch (capture)

    def run(self, roots: torch.Tensor, tables: list[PageTable], num_entries: list[int],
            shape: TreeShape) -> Candidates:
        """roots [B, X]: each sequence's last entry's state; its entries in tables."""
        n, k, device = roots.shape[0], shape.topk, roots.device
        key = self._key(n, shape, self.graphs)
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
        return self._read(packed)

    def can_catch_up(self, num_new: list[int], firsts: list[int], shape: TreeShape) -> bool:
        """Whether :meth:`run_caught_up` has a graph for these sequences: a captured shape and
        bucket, 1 .. depth + 1 new entries each, after at least one entry."""
        return (self._key(len(num_new), shape, self.caught_up) is not None
                and all(1 <= n <= shape.num_steps + 1 for n in num_new) and min(firsts) >= 1)

    def run_caught_up(self, seqs: list[CatchUp], shape: TreeShape
                      ) -> tuple[Candidates, torch.Tensor]:
        """Append every sequence's new entries (1 .. depth + 1 of them, after at least one)
        and search its tree from the last, in one pass (one graph replay once captured);
        returns the candidates and the roots [B, X] (each sequence's last entry's state)."""
        n, k, steps, device = len(seqs), shape.topk, shape.num_steps, self.model.device
        key = self._key(n, shape, self.caught_up)
        size = key.size if key is not None else n
        pad = [CatchUp(self._pad_table, 1, [0], None)] * (size - n) if key is not None else []
        rows, padded = max(steps + 1, k), [*seqs, *pad]
        tables, firsts = [s.table for s in padded], [s.first for s in padded]
        if key is None:
            model = self.model
            inputs = ChainInputs(size, steps + 1, k, model.feature_dim, model.dtype, device)
            inputs.fill(padded, self._pad_slot())
            self.prefix.plan(tables, firsts, rows, device)
            packed, roots = self._caught_up(self.prefix, rows, inputs.chain, k, steps)
        else:
            g = self.caught_up[key]
            g.prefix.plan(tables, firsts, rows, device)
            g.chain.fill(padded, self._pad_slot())
            g.graph.replay()
            packed, roots = g.packed[:, :n], g.roots[:n]
        return self._read(packed), roots[:n].clone()

    @staticmethod
    def _read(packed: torch.Tensor) -> Candidates:
        return Candidates.of_packed(packed.cpu().numpy())  # the one read back

    def use_pad_page(self, page: int) -> None:
        """The page padding rows read and write: one no sequence will own (capture sets it)."""
        self._pad_table = PageTable(self.cache.page_size, [page], 1)

    def _pad_slot(self) -> int:
        """The slot padding rows write (the catch-up chain's too): the padding page's last."""
        if self._pad_table is None:
            raise RuntimeError("the catch-up chain's padding rows need a page of their own: "
                               "call use_pad_page (capture does)")
        return self._pad_table.pages[0] * self.cache.page_size + self.cache.page_size - 1

    def _key(self, n: int, shape: TreeShape, graphs: dict[GraphKey, _Graph]) -> GraphKey | None:
        if not self._buckets or n > self._buckets[-1]:
            return None
        key = GraphKey(next(b for b in self._buckets if b >= n), shape.topk, shape.num_steps)
        return key if key in graphs else None

    def capture(self, backend: FlashInferBackend, buckets: tuple[int, ...],
                shapes: list[tuple[int, int]], pad_page: int, max_context: int) -> float:
        """Capture the search, alone and with the catch-up, for every bucket and (topk, depth)
        (largest bucket first, so the smaller reuse its memory); ``pad_page`` is a page no
        sequence will own. Returns the seconds taken."""
        started = time.perf_counter()
        device = backend.device
        page = self.cache.page_size
        self.use_pad_page(pad_page)
        pool = torch.cuda.graph_pool_handle()
        max_pages = -(-max_context // page)
        # one scratch for every graph's prefix kernel (replays run one at a time)
        self._scratch = torch.empty(max(
            scratch_floats(backend.shape, size, max(depth + 1, topk), device)
            for topk, depth in shapes for size in buckets), dtype=torch.float32, device=device)
        for topk, depth in shapes:
            for size in sorted(buckets, reverse=True):
                key = GraphKey(size, topk, depth)
                prefix = TablePrefix(backend.shape, device, size, topk, max_pages, self._scratch)
                prefix.plan([self._pad_table] * size, [1] * size, topk, device)
                roots = torch.zeros(size, self.model.state_width, dtype=self.model.dtype, device=device)
                positions = torch.zeros(size * topk, dtype=torch.int64, device=device)
                graph, packed = _capture(device, pool, lambda p=prefix, r=roots, x=positions, t=topk,
                                         d=depth: self._search(p, r, x, t, d))
                self.graphs[key] = _Graph(graph, prefix, roots, positions, packed)
                width = depth + 1
                rows = max(width, topk)
                prefix = TablePrefix(backend.shape, device, size, rows, max_pages, self._scratch)
                prefix.plan([self._pad_table] * size, [1] * size, rows, device)
                inputs = ChainInputs(size, width, topk, self.model.feature_dim,
                                     self.model.dtype, device)
                inputs.fill([CatchUp(self._pad_table, 1, [0], None)] * size, self._pad_slot())
                graph, (packed, roots) = _capture(
                    device, pool, lambda p=prefix, r=rows, c=inputs.chain, t=topk, d=depth:
                    self._caught_up(p, r, c, t, d))
                self.caught_up[key] = _Graph(graph, prefix, roots, inputs.chain.last, packed,
                                             inputs)
        self._buckets = tuple(sorted(buckets))
        torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def _search(self, prefix: PrefixAttention, roots: torch.Tensor, last: torch.Tensor, k: int,
                steps: int) -> torch.Tensor:
        """The search alone from given roots (device work only: a CUDA graph can hold it);
        prefix planned for B sequences of k rows."""
        model, b = self.model, roots.shape[0]
        scratch = torch.empty(model.num_layers, 2, b, (steps - 1) * k, model.num_kv_heads,
                              model.head_dim, dtype=model.dtype, device=roots.device)
        allowed = torch.zeros(b, k, (steps - 1) * k, dtype=torch.bool, device=roots.device)
        return self._levels(prefix, k, roots, last, k, steps, scratch, allowed, 0)

    def _caught_up(self, prefix: PrefixAttention, rows: int, chain: _Chain, k: int, steps: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up chain, then the search from each sequence's last real entry (device
        work only); prefix planned for B sequences of ``rows`` rows over the entries before
        the chain. Returns the packed candidates and the roots [B, X]."""
        model = self.model
        b, width = chain.allowed.shape[:2]
        device = chain.tokens.device
        scratch = torch.empty(model.num_layers, 2, b, width + (steps - 1) * k, model.num_kv_heads,
                              model.head_dim, dtype=model.dtype, device=device)
        meta = NodeMetadata(chain.write_slots, prefix, scratch, chain.allowed, 0, rows, commit=True)
        states = model.forward_entries(chain.tokens, chain.features, chain.positions,
                                       AttentionContext(self.attention, meta, self.cache))
        pick = chain.last_row[:, None, None]
        roots = states.view(b, width, -1).gather(1, pick.expand(b, 1, states.shape[-1]))[:, 0]
        allowed = torch.zeros(b, k, width + (steps - 1) * k, dtype=torch.bool, device=device)
        # the last real row sees exactly the real entries: so does every node
        allowed[:, :, :width] = chain.allowed.gather(1, pick.expand(b, 1, width))
        return self._levels(prefix, rows, roots, chain.last, k, steps, scratch, allowed, width), roots

    def _levels(self, prefix: PrefixAttention, rows: int, roots: torch.Tensor, last: torch.Tensor,
                k: int, steps: int, scratch: torch.Tensor, allowed: torch.Tensor, offset: int
                ) -> torch.Tensor:
        """The levels of the search (no host reads). last [B * k]: each row's last entry
        position; the levels' K/V go to scratch columns from ``offset`` on, and ``allowed``
        [B, k, T] holds the columns before it that every row sees. Returns [3, B, C] float64:
        every candidate's target id, parent (-1 for depth 1) and score."""
        model, b, device = self.model, roots.shape[0], roots.device
        packed = torch.empty(3, b, k + (steps - 1) * k * k, dtype=torch.float64, device=device)
        level_step = tree_level_torch
        if device.type == "cuda" and HAS_TRITON:  # one kernel a level
            from splitspec.kernels.tree_level import tree_level as level_step
        lp, ids = model.top_logprobs(roots, k)
        front = level_step(lp, ids, model.d2t, None, packed, 0, steps > 1, roots, allowed, offset)
        for level in range(steps - 1):
            start = offset + level * k  # this level's scratch columns
            meta = NodeMetadata(torch.empty(0), prefix, scratch, front.allowed, start, rows)
            ctx = AttentionContext(self.attention, meta, self.cache)
            states = model.forward_nodes(front.tokens.reshape(-1), front.states,
                                         last + (level + 1), ctx)                 # [B * k, X]
            lp, ids = model.top_logprobs(states, k)
            # this level's children are candidates k + level * k * k on
            front = level_step(lp, ids, model.d2t, front, packed, k + level * k * k,
                               level < steps - 2, states, front.allowed, start + k)
        return packed


def _capture(device: torch.device, pool: object, work: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``work`` twice on a side stream (lazy initialisation must not happen in capture),
    then capture it and replay it once (:func:`replay_once`); returns the graph and the
    outputs it writes at each replay."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                work()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = work()
        replay_once(graph)
    return graph, out
