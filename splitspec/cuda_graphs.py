"""CUDA graphs of the target's steps: decode and verify per batch-size bucket, and with
arriving prompts prefilled in the same pass.

A step in which every sequence brings the same number q of tokens and wants
the logits of all of them is the same sequence of kernels at every step of a
given batch size: plain decode (q = 1, causal) and tree verification (q =
nodes + 1, each sequence's ``SeqAttention.tree``). Such steps are captured
once per (bucket, q, captured features) during the ``capture_cuda_graphs``
init step and replayed. A batch of n sequences runs the graph of the smallest
bucket >= n; the rows beyond n are padding: token 0 on scratch pages no
sequence owns, attending to those pages alone.

Fresh prompts (nothing cached before them) are captured too, per padded token
count: packed one after another, each row attends to its own prompt's rows
only (splitspec/attention/prompts.py), so the kernels depend on the padded
count alone; padding rows are one-token prompts writing to a scratch slot,
and logits are taken of the rows asked for only. Once requests arrive one by
one, most steps prefill a prompt or two while the running sequences decode or
verify, so those mixed steps have graphs of their own: the prompt rows first,
then the step's, one pass that reads the weights once (each part attends in
its own way, :class:`splitspec.attention.base.SplitAttention`). Trees of
other sizes, prompts over the largest count, prompts that continue a cached
prefix and batches larger than the largest bucket run eagerly.

Before each replay only host work happens outside the graph: the inputs (ids,
positions, KV write slots, the prompts' starts and logit rows, padded) are
written to a pinned host buffer and copied into the graph's static buffer in
one copy. A decode graph (q = 1) plans nothing on the host: each row's length
and pages go in one more copy, into a table its attention kernel reads on the
device (splitspec/attention/decode_table.py). A verify graph attends in two
parts (splitspec/attention/cascade.py): the same kernel runs q rows per
sequence over its committed slots, from a table of its own filled and copied
before each replay (TablePrefix), and the tree's own K/V, dense, go through
the [q, q] tree tables copied into a static buffer; no [q, kv_len] mask is
built. Every graph leaves its logits in one buffer all graphs share (replays
are one at a time, and what a replay returns is copied out before the next),
so the graphs cost no more logits memory than the largest of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from splitspec.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SeqAttention,
    SplitAttention,
    SplitMetadata,
    new_token_slots,
)
from splitspec.attention.cascade import TreeVerifyAttention, TreeVerifyMetadata
from splitspec.attention.decode_table import (
    DecodeTableAttention,
    DecodeTableMetadata,
    TablePrefix,
    block_keys,
    carve,
    fill_decode_table,
    scratch_floats,
)
from splitspec.attention.flashinfer_backend import AttentionShape
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
from splitspec.staging import HostTwin

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)  # padded prompt tokens of a graph
MAX_PROMPT_LOGITS = 64  # logit rows of a graph's prompts (one per prompt: prompts per step)


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a server of max_batch running sequences needs (the last one covers it)."""
    chosen = tuple(b for b in buckets if b < max_batch)
    return (*chosen, max_batch) if max_batch <= buckets[-1] else buckets


class GraphKey(NamedTuple):
    size: int                  # the step's bucket: padded batch size (0: prompts only)
    q_len: int                 # tokens per sequence: 1 = decode, nodes + 1 = a tree
    capture: tuple[int, ...]   # captured layer inputs (features for the draft)
    tokens: int = 0            # the prompts' bucket: padded prompt rows, first (0: none)


class StepPlan(NamedTuple):
    """A pass as one graph: its first ``prompts`` sequences are fresh prompts of ``tokens``
    rows, the rest decode or verify."""

    key: GraphKey
    prompts: int
    tokens: int


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: TablePrefix | None  # a verify graph's prefix attention, planned before replay;
                                 # None for decode and prompts alone
    inputs: torch.Tensor         # [5, W] int64 static inputs, the prompt rows then the step's:
                                 # ids, positions, write slots, each prompt row's first row
                                 # (prompt rows only), and the rows whose logits are taken
                                 # (the prompts' MAX_PROMPT_LOGITS, then every step row's)
    staged: HostTwin             # inputs' pinned twin, refilled before each replay
    trees: torch.Tensor | None   # [b, q, q] static input of a verify graph
    logits: torch.Tensor         # [P + b * q, V] static outputs, in the shared buffer (P:
                                 # MAX_PROMPT_LOGITS with prompts, else 0)
    context: AttentionContext | None = None  # what the graph's attention reads outside the
    # graph's pool (its table, a verify graph's TablePrefix): kept alive as long as the
    # graph, or the allocator hands that memory to other tensors while every replay still
    # reads it (the kernels' scratch is StepGraphs.scratch, held by the StepGraphs)
    table: HostTwin | None = None  # a decode graph's [b, 1 + P] int32 table's twin
    # (decode_table.py), sent before the inputs, whose send's event covers both


class StepGraphs:
    """The captured step graphs of one model (one rank's shard)."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, shape: AttentionShape,
                 scratch_pages: list[int], max_kv_len: int, device: torch.device | str) -> None:
        """``scratch_pages`` hold the padding rows (enough for the largest q plus one);
        ``max_kv_len`` bounds every sequence's kv_len (sizes the page buffers)."""
        self.model, self.cache, self.shape = model, cache, shape
        self.scratch_pages, self.max_kv_len = scratch_pages, max_kv_len
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, _Graph] = {}
        self.buckets: tuple[int, ...] = ()
        self.prompt_buckets: tuple[int, ...] = ()
        self.logits_out: torch.Tensor | None = None  # the logits buffer every graph shares
        self.scratch: torch.Tensor | None = None  # and their attention kernels' scratch

    def capture(self, buckets: tuple[int, ...], q_lens: tuple[int, ...],
                variants: tuple[tuple[int, ...], ...], prompt_buckets: tuple[int, ...] = ()
                ) -> float:
        """Capture, for every capture variant (the layer inputs a draft may ask for): every
        bucket for every q (1 = decode; n + 1 = a tree of n nodes); with ``prompt_buckets``
        (padded prompt tokens) also the prompts alone and every (bucket, q) after them (mixed
        steps). Largest first, so the smaller reuse its memory; returns the seconds taken."""
        if self.graphs:
            raise RuntimeError("StepGraphs.capture runs once (the graphs share their outputs)")
        room = len(self.scratch_pages) * self.shape.page_size
        if max(q_lens) + 1 > room:
            raise ValueError(f"q={max(q_lens)} needs more than the {room} scratch slots")
        keys = [GraphKey(size, q_len, capture, tokens) for capture in variants for q_len in q_lens
                for size in buckets for tokens in (0, *prompt_buckets)]
        keys += [GraphKey(0, 0, capture, tokens) for capture in variants for tokens in prompt_buckets]
        started = time.perf_counter()
        self.logits_out = torch.empty(max(map(_logit_rows, keys)), self.model.config.vocab_size,
                                      dtype=torch.float32, device=self.device)
        self.scratch = torch.empty(max((scratch_floats(self.shape, key.size, key.q_len,
                                                       self.device) for key in keys if key.size),
                                       default=0), dtype=torch.float32, device=self.device)
        for key in sorted(keys, key=lambda k: k.tokens + k.size * k.q_len, reverse=True):
            self.graphs[key] = self._capture(key)
        self.buckets, self.prompt_buckets = tuple(sorted(buckets)), tuple(sorted(prompt_buckets))
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def plan(self, seqs: list[SeqAttention], logit_rows: list[int], capture: tuple[int, ...]
             ) -> StepPlan | None:
        """The graph that runs this pass (its leading fresh prompts, then decode or verify
        rows), or None (eager)."""
        count = next((i for i, seq in enumerate(seqs) if not is_fresh_prompt(seq)), len(seqs))
        tokens = sum(seq.q_len for seq in seqs[:count])
        size = q_len = bucket = 0
        if count < len(seqs):
            rest = ([row - tokens for row in logit_rows if row >= tokens] if count
                    else logit_rows)  # (a pass without prompts: no copy per step)
            shaped = self._step_shape(seqs[count:], rest)
            if shaped is None:
                return None
            size, q_len = shaped
        if count:
            wanted = [row for row in logit_rows if row < tokens]
            if len(wanted) > MAX_PROMPT_LOGITS or logit_rows[:len(wanted)] != wanted:
                return None  # too many prompt logits, or not all before the step's
            bucket = next((b for b in self.prompt_buckets if b >= tokens), 0)
            if not bucket:
                return None
        key = GraphKey(size, q_len, capture, bucket)
        return StepPlan(key, count, tokens) if key in self.graphs else None

    def _step_shape(self, seqs: list[SeqAttention], logit_rows: list[int]
                    ) -> tuple[int, int] | None:
        """(bucket, q) of decoding or verifying sequences that a graph can run, or None."""
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
        return next(b for b in self.buckets if b >= len(seqs)), q_len

    def run_plan(self, plan: StepPlan, ids: torch.Tensor, positions: torch.Tensor,
                 seqs: list[SeqAttention], logit_rows: list[int]) -> torch.Tensor:
        """Replay a plan's graph: its logits [len(logit_rows), V] (the captured features, if
        any, went to the cache's, ``KVCache.write_features``).
        ``ids`` and ``positions`` ([T]) are best on the host: they go to the device in one
        copy with the rest of the inputs."""
        key, count, tokens = plan
        g = self.graphs[key]
        prompts, steps = seqs[:count], seqs[count:]
        step_rows = len(steps) * key.q_len
        if key.size:
            padded = [*steps, *self._padding(key.size - len(steps), key.q_len)]
            if key.q_len > 1:
                g.wrapper.plan([seq.table for seq in padded],
                               [seq.kv_len - key.q_len for seq in padded], key.q_len,
                               self.device)  # the committed slots, each row over them
                g.trees.copy_(torch.stack([seq.tree for seq in padded]), non_blocking=True)
        wanted = [row for row in logit_rows if row < tokens] if tokens else []
        ids_np, positions_np = ids.cpu().numpy(), positions.cpu().numpy()
        g.staged.wait()  # the last replay's inputs (and table) have left the pinned twins
        staging = g.staged.array
        if key.tokens:  # padding rows: token 0 at position 0, one-row prompts on a scratch slot
            end = key.tokens
            staging[0, :tokens], staging[1, :tokens] = ids_np[:tokens], positions_np[:tokens]
            staging[:2, tokens:end] = 0
            staging[2, :tokens] = prompt_slots(prompts).numpy()
            staging[2, tokens:end] = self.scratch_pages[0] * self.shape.page_size
            staging[3, :end] = prompt_starts([seq.q_len for seq in prompts], end)
            staging[4, :len(wanted)] = wanted
            staging[4, len(wanted):MAX_PROMPT_LOGITS] = 0
        if key.size:  # padding rows: token 0 at position 0 on the scratch pages
            start, end = key.tokens, key.tokens + key.size * key.q_len
            staging[0, start:start + step_rows] = ids_np[tokens:]
            staging[1, start:start + step_rows] = positions_np[tokens:]
            staging[:2, start + step_rows:end] = 0
            if key.q_len == 1:  # the lengths and pages, read by the kernel on the device
                fill_decode_table(padded, self.shape.page_size, g.table.array,
                                  staging[2, start:end])
                g.table.send(record=False)
            else:
                staging[2, start:end] = new_token_slots(padded)
        g.staged.send()
        g.graph.replay()
        first = MAX_PROMPT_LOGITS if key.tokens else 0  # the step rows' first logit row
        return torch.cat((g.logits[:len(wanted)], g.logits[first:first + step_rows]))

    def _padding(self, count: int, q_len: int) -> list[SeqAttention]:
        """Padding rows on the scratch pages: a verify row's committed part is one slot."""
        page = self.shape.page_size
        if q_len == 1:
            return [SeqAttention(PageTable(page, self.scratch_pages[:1], 1), 1, 1)] * count
        table = PageTable(page, self.scratch_pages[: -(-(q_len + 1) // page)], q_len + 1)
        tree = torch.ones(q_len, q_len, dtype=torch.bool)
        return [SeqAttention(table, kv_len=q_len + 1, q_len=q_len, tree=tree)] * count

    def _prefix(self, size: int, q_len: int) -> TablePrefix:
        """A verify graph's prefix attention: size * q_len rows over at most max_kv_len slots."""
        pages_per_seq = -(-self.max_kv_len // self.shape.page_size)
        return TablePrefix(self.shape, self.device, size, q_len, pages_per_seq, self.scratch)

    def _capture(self, key: GraphKey) -> _Graph:
        size, q_len, capture, tokens = key
        rows, step_rows = tokens + size * q_len, size * q_len
        first = MAX_PROMPT_LOGITS if tokens else 0  # the step rows' first logit row
        # Each row starts 128-byte aligned, as a tensor of its own would: Triton kernels
        # specialise on 16-byte-aligned pointers, and rows of [5, 1] would put the
        # positions 8 bytes in.
        width = -(-max(rows, first + step_rows) // 16) * 16
        inputs = torch.zeros(5, width, dtype=torch.int64, device=self.device)
        ids, positions, write_slots, starts = inputs[:4, :rows].unbind()
        logit_rows = inputs[4, :first + step_rows]
        parts: list[tuple[AttentionBackend, AttentionMetadata]] = []
        wrapper = trees = table = None
        if tokens:  # one-row prompts on the scratch slot until replayed
            write_slots[:tokens].fill_(self.scratch_pages[0] * self.shape.page_size)
            starts[:tokens].copy_(torch.arange(tokens))
            parts.append((PromptAttention(), PromptMetadata(write_slots[:tokens],
                                                            starts[:tokens])))
        if size:
            padded = self._padding(size, q_len)
            slots = write_slots[tokens:]
            logit_rows[first:].copy_(torch.arange(tokens, rows))
            if q_len == 1:
                parts.append((DecodeTableAttention(), self._decode_table(padded, slots)))
                table = HostTwin(parts[-1][1].table)
            else:
                wrapper = self._prefix(size, q_len)
                wrapper.plan([seq.table for seq in padded],
                             [seq.kv_len - q_len for seq in padded], q_len, self.device)
                slots.copy_(torch.tensor(new_token_slots(padded)))
                trees = torch.ones(size, q_len, q_len, dtype=torch.bool, device=self.device)
                parts.append((TreeVerifyAttention(), TreeVerifyMetadata(slots, wrapper, trees)))
        backend, meta = parts[0] if len(parts) == 1 else (
            SplitAttention(), SplitMetadata(write_slots, tokens, parts[0], parts[1]))
        ctx = AttentionContext(backend, meta, self.cache)
        staged = HostTwin(inputs)
        staged.host.copy_(inputs)  # the static parts (the step rows' logit rows) go in every copy
        logits = self.logits_out[:first + step_rows]

        def forward() -> None:
            out = self.model(ids, positions, ctx, capture)  # features to the cache's, if kept
            hidden = out.hidden.index_select(0, logit_rows) if tokens else out.hidden
            logits.copy_(self.model.compute_logits(hidden))

        return _Graph(self._record(forward), wrapper, inputs, staged, trees, logits, ctx, table)

    def _decode_table(self, padding: list[SeqAttention], slots: torch.Tensor
                      ) -> DecodeTableMetadata:
        """A decode graph's attention inputs, filled for its padding rows: its table (room
        for max_kv_len slots a row), the kernel's split, its scratch (in the shared one)."""
        size, shape = len(padding), self.shape
        width = -(-self.max_kv_len // shape.page_size)
        table = np.zeros((size, 1 + width), dtype=np.int32)
        written = np.zeros(size, dtype=np.int64)
        fill_decode_table(padding, shape.page_size, table, written)
        splits, part_out, part_lse, _ = carve(self.scratch, shape, size, 1)
        slots.copy_(torch.from_numpy(written))
        return DecodeTableMetadata(slots, torch.from_numpy(table).to(self.device), splits,
                                   part_out, part_lse, block_keys(size))

    def _record(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm forward up on a side stream (lazy initialisation must not happen in capture),
        then capture it into this model's pool (its outputs are buffers it writes), and
        replay it once (:func:`replay_once`)."""
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
                forward()
            replay_once(graph)
        return graph


def replay_once(graph: torch.cuda.CUDAGraph) -> None:
    """A graph's first replay, at capture, on the inputs it was captured with (the warm-up's):
    the first launch uploads the graph to the device (0.6-1.2 ms more than a later replay
    for the 8B shape's decode, verify and draft graphs on an H200, session 34), which would
    otherwise land on a request, and a graph that cannot run fails the capture's init step."""
    graph.replay()


def _logit_rows(key: GraphKey) -> int:
    """The rows of a graph's logits: its prompts' (MAX_PROMPT_LOGITS) and every step row's."""
    return (MAX_PROMPT_LOGITS if key.tokens else 0) + key.size * key.q_len
