"""CUDA graphs of the target's decode and verify steps, one per batch-size bucket.

A step in which every sequence brings the same number q of tokens and wants
the logits of all of them is the same sequence of kernels at every step of a
given batch size: plain decode (q = 1, causal) and tree verification (q =
nodes + 1, each sequence's ``SeqAttention.tree``). Such steps are captured
once per (bucket, q, captured features) during the ``capture_cuda_graphs``
init step and replayed. A batch of n sequences runs the graph of the smallest
bucket >= n; the rows beyond n are padding: token 0 on scratch pages no
sequence owns, attending to those pages alone.

Fresh prompts (nothing cached before them) have graphs of their own, one per
padded token count: the prompts are packed one after another and attend to
their own rows only (splitspec/attention/prompts.py), so the kernels depend on
the padded count alone; padding rows are one-token prompts writing to a
scratch slot, and the logits are taken of the rows asked for only. A step
that prefills arriving prompts while the running sequences decode or verify
(a mixed step: most steps, once requests arrive one by one) replays the
prompts' graph and then the step's (:meth:`StepGraphs.plan`). Trees of other
sizes, prompts over the largest count, prompts that continue a cached prefix
and batches larger than the largest bucket run eagerly.

Before each replay only host work happens outside the graph: the inputs (ids,
positions and KV write slots, padded) are written to a pinned host buffer and
copied into the graph's static buffer in one copy, and its flashinfer decode wrapper
(built in CUDA-graph mode with buffers of its own) is planned for the real
pages. For q = 1 that wrapper is the whole attention. A verify graph attends
in two parts (splitspec/attention/cascade.py): the wrapper runs q rows per
sequence over its committed slots, and the tree's own K/V, dense, go through
the [q, q] tree tables copied into a static buffer; no [q, kv_len] mask is
built. The outputs are the graph's static buffers, cloned before they are
returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from splitspec.attention.base import SeqAttention
from splitspec.attention.cascade import FlashInferPrefix, TreeVerifyAttention, TreeVerifyMetadata
from splitspec.attention.flashinfer_backend import (
    WORKSPACE_BYTES,
    AttentionShape,
    FlashInferMetadata,
    PagedLayout,
    PlannedAttention,
    import_flashinfer,
)
from splitspec.attention.prompts import (
    PromptAttention,
    PromptMetadata,
    is_fresh_prompt,
    prompt_slots,
    prompt_starts,
)
from splitspec.kv_cache import KVCache, PageTable
from splitspec.model.layers import AttentionContext
from splitspec.model.llama import LlamaForCausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # prompt tokens of a prefill graph
MAX_PROMPT_LOGITS = 64  # logit rows a prefill graph returns (one per prompt: prompts per step)


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a server of max_batch running sequences needs (the last one covers it)."""
    chosen = tuple(b for b in buckets if b < max_batch)
    return (*chosen, max_batch) if max_batch <= buckets[-1] else buckets


class GraphKey(NamedTuple):
    size: int                  # the bucket: padded batch size
    q_len: int                 # tokens per sequence: 1 = decode, nodes + 1 = a tree
    capture: tuple[int, ...]   # captured layer inputs (features for the draft)


class PromptKey(NamedTuple):
    tokens: int                # the bucket: padded prompt tokens
    capture: tuple[int, ...]


class StepPlan(NamedTuple):
    """How a pass runs as graphs: its first ``prompts`` sequences (fresh prompts, ``tokens``
    rows) through ``prefill``, the others through ``step``; either may be None (no such
    sequences)."""

    prompts: int
    tokens: int
    prefill: PromptKey | None
    step: GraphKey | None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: Any                 # decode wrapper (q = 1) or FlashInferPrefix (verify), in
                                 # CUDA-graph mode, planned before replay
    inputs: torch.Tensor         # [3, W] int64 static inputs: ids, positions, write slots in
                                 # the first b * q of each row (W: b * q rounded up to 16);
                                 # a prefill graph's [5, W] adds each row's prompt start
                                 # and the rows whose logits it computes
    staging: Any                 # numpy view of a pinned [3, W] host twin of inputs
    staged: torch.Tensor         # the pinned twin itself
    copied: torch.cuda.Event     # recorded after the last copy out of staging
    trees: torch.Tensor | None   # [b, q, q] static input of a verify graph
    logits: torch.Tensor         # [b * q, V] static outputs (prefill: [MAX_PROMPT_LOGITS, V])
    aux: torch.Tensor | None     # [b * q, k * H]


class StepGraphs:
    """The captured step graphs of one model (one rank's shard)."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, shape: AttentionShape,
                 scratch_pages: list[int], max_kv_len: int, device: torch.device | str) -> None:
        """``scratch_pages`` hold the padding rows (enough for the largest q plus one);
        ``max_kv_len`` bounds every sequence's kv_len (sizes the page buffers)."""
        self.model, self.cache, self.shape = model, cache, shape
        self.scratch_pages, self.max_kv_len = scratch_pages, max_kv_len
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, _Graph] = {}
        self.prompt_graphs: dict[PromptKey, _Graph] = {}
        self.buckets: tuple[int, ...] = ()
        self.prompt_buckets: tuple[int, ...] = ()

    def capture(self, buckets: tuple[int, ...], q_lens: tuple[int, ...],
                variants: tuple[tuple[int, ...], ...]) -> float:
        """Capture every bucket (largest first, so the smaller reuse its memory) for every
        q (1 = decode; n + 1 = a tree of n nodes) and capture variant (the layer inputs a
        draft may ask for); returns the seconds taken."""
        room = len(self.scratch_pages) * self.shape.page_size
        if max(q_lens) + 1 > room:
            raise ValueError(f"q={max(q_lens)} needs more than the {room} scratch slots")
        started = time.perf_counter()
        for capture in variants:
            for q_len in q_lens:
                for size in sorted(buckets, reverse=True):
                    key = GraphKey(size, q_len, capture)
                    self.graphs[key] = self._capture(size, q_len, capture)
        self.buckets = tuple(sorted(buckets))
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def capture_prompts(self, buckets: tuple[int, ...], variants: tuple[tuple[int, ...], ...]
                        ) -> float:
        """Capture a prefill graph of fresh prompts for every padded token count and capture
        variant (largest first); returns the seconds taken."""
        started = time.perf_counter()
        for capture in variants:
            for tokens in sorted(buckets, reverse=True):
                self.prompt_graphs[PromptKey(tokens, capture)] = self._capture_prompts(tokens,
                                                                                      capture)
        self.prompt_buckets = tuple(sorted(buckets))
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def plan(self, seqs: list[SeqAttention], logit_rows: list[int], capture: tuple[int, ...]
             ) -> StepPlan | None:
        """How this pass runs as graphs (its leading fresh prompts, then the rest), or None
        (eager)."""
        count = next((i for i, seq in enumerate(seqs) if not is_fresh_prompt(seq)), len(seqs))
        tokens = sum(seq.q_len for seq in seqs[:count])
        prefill = step = None
        if count:
            wanted = [row for row in logit_rows if row < tokens]
            if len(wanted) > MAX_PROMPT_LOGITS or logit_rows[:len(wanted)] != wanted:
                return None  # too many prompt logits, or not all before the step's
            size = next((b for b in self.prompt_buckets if b >= tokens), None)
            prefill = None if size is None else PromptKey(size, capture)
            if prefill not in self.prompt_graphs:
                return None
        if count < len(seqs):
            rest = [row - tokens for row in logit_rows if row >= tokens]
            step = self.key_for(seqs[count:], rest, capture)
            if step is None:
                return None
        return StepPlan(count, tokens, prefill, step)

    def run_plan(self, plan: StepPlan, ids: torch.Tensor, positions: torch.Tensor,
                 seqs: list[SeqAttention], logit_rows: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay a plan's graphs: (logits [len(logit_rows), V], aux [T, k * H] or None)."""
        parts = []
        if plan.prefill is not None:
            wanted = [row for row in logit_rows if row < plan.tokens]
            parts.append(self.run_prompts(plan.prefill, ids[:plan.tokens],
                                          positions[:plan.tokens], seqs[:plan.prompts], wanted))
        if plan.step is not None:
            parts.append(self.run(plan.step, ids[plan.tokens:], positions[plan.tokens:],
                                  seqs[plan.prompts:]))
        if len(parts) == 1:
            return parts[0]
        (logits_p, aux_p), (logits_s, aux_s) = parts
        aux = None if aux_p is None else torch.cat((aux_p, aux_s))
        return torch.cat((logits_p, logits_s)), aux

    def run_prompts(self, key: PromptKey, ids: torch.Tensor, positions: torch.Tensor,
                    seqs: list[SeqAttention], logit_rows: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay a prefill graph for these fresh prompts: (logits of logit_rows, aux
        [T, k * H] or None)."""
        g = self.prompt_graphs[key]
        rows, size = len(ids), key.tokens
        g.copied.synchronize()  # the last replay's inputs have left the pinned buffer
        staging = g.staging
        staging[0, :rows] = ids.cpu().numpy()
        staging[1, :rows] = positions.cpu().numpy()
        staging[:2, rows:size] = 0  # padding rows: token 0 at position 0, one-row prompts
        staging[2, :rows] = prompt_slots(seqs).numpy()
        staging[2, rows:size] = self.scratch_pages[0] * self.shape.page_size
        staging[3, :size] = prompt_starts([seq.q_len for seq in seqs], size)
        staging[4, :len(logit_rows)] = logit_rows
        staging[4, len(logit_rows):MAX_PROMPT_LOGITS] = 0
        return self._replay(g, len(logit_rows), rows)

    def key_for(self, seqs: list[SeqAttention], logit_rows: list[int],
                capture: tuple[int, ...]) -> GraphKey | None:
        """The graph that runs this pass, or None (eager)."""
        if not seqs or not self.buckets or len(seqs) > self.buckets[-1]:
            return None
        q_len = seqs[0].q_len
        if any(seq.q_len != q_len for seq in seqs):
            return None
        # decode: causal; verify: every sequence a tree (a prompt is causal; a full mask is
        # for the one-pass backends).
        if any(seq.mask is not None or (seq.tree is None) != (q_len == 1) for seq in seqs):
            return None
        if logit_rows != list(range(q_len * len(seqs))):
            return None
        size = next(b for b in self.buckets if b >= len(seqs))
        key = GraphKey(size, q_len, capture)
        return key if key in self.graphs else None

    def run(self, key: GraphKey, ids: torch.Tensor, positions: torch.Tensor,
            seqs: list[SeqAttention]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay a graph for these sequences: (logits [n * q, V], aux [n * q, k * H] or None).
        ``ids`` and ``positions`` ([n * q]) are best on the host: they go to the device in
        one copy with the write slots (one copy instead of seven small ones)."""
        size, q_len, _ = key
        g = self.graphs[key]
        rows = len(seqs) * q_len
        padded = [*seqs, *self._padding(size - len(seqs), q_len)]
        layout = PagedLayout.of(padded, self.shape.page_size)
        self._plan(g.wrapper, layout, padded, q_len)
        if g.trees is not None:
            g.trees.copy_(torch.stack([seq.tree for seq in padded]), non_blocking=True)
        g.copied.synchronize()  # the last replay's inputs have left the pinned buffer
        g.staging[0, :rows] = ids.cpu().numpy()
        g.staging[1, :rows] = positions.cpu().numpy()
        g.staging[:2, rows:] = 0  # padding rows: token 0 at position 0
        g.staging[2, :size * q_len] = layout.write_slots.numpy()
        return self._replay(g, rows, rows)

    @staticmethod
    def _replay(g: _Graph, logit_rows: int, aux_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the staged inputs in, replay, and clone the outputs asked for."""
        g.inputs.copy_(g.staged, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        return (g.logits[:logit_rows].clone(),
                None if g.aux is None else g.aux[:aux_rows].clone())

    def _padding(self, count: int, q_len: int) -> list[SeqAttention]:
        """Padding rows on the scratch pages: a verify row's committed part is one slot."""
        page = self.shape.page_size
        if q_len == 1:
            return [SeqAttention(PageTable(page, self.scratch_pages[:1], 1), 1, 1)] * count
        table = PageTable(page, self.scratch_pages[: -(-(q_len + 1) // page)], q_len + 1)
        tree = torch.ones(q_len, q_len, dtype=torch.bool)
        return [SeqAttention(table, kv_len=q_len + 1, q_len=q_len, tree=tree)] * count

    def _plan(self, wrapper: Any, layout: PagedLayout, seqs: list[SeqAttention], q_len: int) -> None:
        shape = self.shape
        if q_len == 1:
            wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len,
                         shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
                         pos_encoding_mode="NONE", q_data_type=shape.dtype,
                         kv_data_type=shape.dtype)
        else:  # the committed slots, each sequence's q rows over them
            wrapper.plan([seq.table for seq in seqs], [seq.kv_len - q_len for seq in seqs],
                         q_len, self.device)

    def _wrapper(self, size: int, q_len: int) -> Any:
        pages_per_seq = -(-self.max_kv_len // self.shape.page_size)
        if q_len > 1:
            return FlashInferPrefix(self.shape, self.workspace, size * q_len, pages_per_seq)

        def int32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        return import_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.shape.use_tensor_cores,
            paged_kv_indptr_buffer=int32(size + 1),
            paged_kv_indices_buffer=int32(size * pages_per_seq),
            paged_kv_last_page_len_buffer=int32(size))

    def _capture(self, size: int, q_len: int, capture: tuple[int, ...]) -> _Graph:
        device = self.device
        wrapper = self._wrapper(size, q_len)
        padded = self._padding(size, q_len)
        layout = PagedLayout.of(padded, self.shape.page_size)
        self._plan(wrapper, layout, padded, q_len)
        # Each row starts 128-byte aligned, as a tensor of its own would: Triton kernels
        # specialise on 16-byte-aligned pointers, and rows of [3, 1] would put the
        # positions 8 bytes in.
        width = -(-size * q_len // 16) * 16
        inputs = torch.zeros(3, width, dtype=torch.int64, device=device)
        ids, positions, write_slots = inputs[:, : size * q_len].unbind()
        write_slots.copy_(layout.write_slots)
        staged = torch.zeros(3, width, dtype=torch.int64, pin_memory=True)
        trees = None
        if q_len == 1:
            ctx = AttentionContext(PlannedAttention(), FlashInferMetadata(write_slots, wrapper),
                                   self.cache)
        else:
            trees = torch.ones(size, q_len, q_len, dtype=torch.bool, device=device)
            ctx = AttentionContext(TreeVerifyAttention(),
                                   TreeVerifyMetadata(write_slots, wrapper, trees), self.cache)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = self.model(ids, positions, ctx, capture)
            return self.model.compute_logits(out.hidden), out.aux

        graph, (logits, aux) = self._record(forward)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, wrapper, inputs, staged.numpy(), staged, copied, trees, logits, aux)

    def _capture_prompts(self, tokens: int, capture: tuple[int, ...]) -> _Graph:
        """A prefill graph of ``tokens`` rows, all one-row prompts on the scratch slot until
        replayed."""
        width = -(-max(tokens, MAX_PROMPT_LOGITS) // 16) * 16  # 128-byte rows, as in _capture
        inputs = torch.zeros(5, width, dtype=torch.int64, device=self.device)
        ids, positions, write_slots, starts = inputs[:4, :tokens].unbind()
        logit_rows = inputs[4, :MAX_PROMPT_LOGITS]
        write_slots.fill_(self.scratch_pages[0] * self.shape.page_size)
        starts.copy_(torch.arange(tokens))
        staged = torch.zeros(5, width, dtype=torch.int64, pin_memory=True)
        ctx = AttentionContext(PromptAttention(), PromptMetadata(write_slots, starts), self.cache)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = self.model(ids, positions, ctx, capture)
            return self.model.compute_logits(out.hidden.index_select(0, logit_rows)), out.aux

        graph, (logits, aux) = self._record(forward)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, None, inputs, staged.numpy(), staged, copied, None, logits, aux)

    def _record(self, forward: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Warm forward up on a side stream (lazy initialisation must not happen in capture),
        then capture it into this model's pool: the graph and forward's static outputs."""
        device = self.device
        with torch.inference_mode():
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = forward()
        return graph, outputs
