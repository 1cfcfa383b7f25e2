"""Rank 0's calls to the other ranks, packed into int64 words for one gloo broadcast each.

A decode step's call pickled by ``broadcast_object_list`` took 2.0-2.7 ms on the 2-core
development machine (two broadcasts, and pickling its tensors), once per step and on the
critical path: the other ranks start their part of the step only when it arrives. Packed,
it takes 0.5-0.7 ms (bench/bench_tp_comm.py). Every call fills a buffer of CAPACITY
words; a larger call says its length there and follows in a second broadcast.

Layout: [length, kind, ...]. A forward: T, sequences, logit rows, captured layers; the
token ids, positions, logit rows and layers; then per sequence page size, slots in use,
kv_len, q_len, page count, mask kind (0 none, 1 mask, 2 tree), the mask's two sizes, the
pages and the mask's entries (0 or 1). A KV copy: n, then the n sources and n targets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from splitspec.attention.base import SeqAttention
from splitspec.kv_cache import PageTable

CAPACITY = 8192  # words: a verify step of 32 sequences, 40 pages and an 8-node tree each, takes 5001
FORWARD, COPY_SLOTS, STOP = 1, 2, 3
_NO_MASK, _MASK, _TREE = 0, 1, 2


class ForwardBatch(NamedTuple):
    """One forward pass, all on the host: every rank can rebuild it from these."""

    ids: torch.Tensor              # [T] token ids
    positions: torch.Tensor        # [T]
    attn: list[SeqAttention]       # per sequence: page table, lengths, optional tree mask
    logit_rows: list[int]          # rows of the T tokens whose logits are wanted
    capture: tuple[int, ...] = ()  # layer inputs to capture for the draft


def encode(call: str, payload: object) -> list[int]:
    """The words of a call (see the module's docstring), its length first."""
    words = [0]
    if call == "forward":
        batch: ForwardBatch = payload
        ids, positions = batch.ids.tolist(), batch.positions.tolist()
        words += [FORWARD, len(ids), len(batch.attn), len(batch.logit_rows), len(batch.capture),
                  *ids, *positions, *batch.logit_rows, *batch.capture]
        for seq in batch.attn:
            kind, mask = ((_TREE, seq.tree) if seq.tree is not None else
                          (_MASK, seq.mask) if seq.mask is not None else (_NO_MASK, None))
            rows, cols = mask.shape if mask is not None else (0, 0)
            words += [seq.table.page_size, seq.table.num_slots, seq.kv_len, seq.q_len,
                      len(seq.table.pages), kind, rows, cols, *seq.table.pages]
            if mask is not None:
                words += mask.reshape(-1).to(torch.int64).tolist()
    elif call == "copy_slots":
        src, dst = (t.reshape(-1).tolist() for t in payload)
        words += [COPY_SLOTS, len(src), *src, *dst]
    elif call == "stop":
        words.append(STOP)
    else:
        raise ValueError(f"no such call {call!r}")
    words[0] = len(words)
    return words


def decode(words: list[int]) -> tuple[str, object]:
    """(call, payload) from encode's words; the payload as rank 0 passed it."""
    kind = words[1]
    if kind == STOP:
        return "stop", None
    if kind == COPY_SLOTS:
        n = words[2]
        return "copy_slots", (torch.tensor(words[3:3 + n], dtype=torch.int64),
                              torch.tensor(words[3 + n:3 + 2 * n], dtype=torch.int64))
    if kind != FORWARD:
        raise ValueError(f"unknown call kind {kind} from rank 0")
    tokens, seqs, rows, layers = words[2:6]
    at = 6
    ids, at = words[at:at + tokens], at + tokens
    positions, at = words[at:at + tokens], at + tokens
    logit_rows, at = words[at:at + rows], at + rows
    capture, at = tuple(words[at:at + layers]), at + layers
    attn = []
    for _ in range(seqs):
        page_size, slots, kv_len, q_len, pages, mask_kind, mask_rows, mask_cols = words[at:at + 8]
        at += 8
        table, at = PageTable(page_size, words[at:at + pages], slots), at + pages
        mask = tree = None
        if mask_kind != _NO_MASK:
            size = mask_rows * mask_cols
            values = torch.tensor(words[at:at + size], dtype=torch.bool).view(mask_rows, mask_cols)
            at += size
            mask, tree = (values, None) if mask_kind == _MASK else (None, values)
        attn.append(SeqAttention(table, kv_len, q_len, mask=mask, tree=tree))
    if at != words[0]:
        raise ValueError(f"a forward call of {words[0]} words decoded as {at}")
    return "forward", ForwardBatch(torch.tensor(ids, dtype=torch.int64),
                                   torch.tensor(positions, dtype=torch.int64), attn, logit_rows,
                                   capture)


class CallChannel:
    """Rank 0 sends calls and the other ranks receive them, over the gloo control group."""

    def __init__(self, control: object) -> None:
        self.control = control
        self._buffer = torch.zeros(CAPACITY, dtype=torch.int64)

    def send(self, call: str, payload: object) -> None:
        words = encode(call, payload)
        if len(words) <= CAPACITY:
            self._buffer[:len(words)] = torch.tensor(words, dtype=torch.int64)
            dist.broadcast(self._buffer, src=0, group=self.control)
            return
        self._buffer[0] = len(words)  # the length alone, then the whole call
        dist.broadcast(self._buffer, src=0, group=self.control)
        dist.broadcast(torch.tensor(words, dtype=torch.int64), src=0, group=self.control)

    def receive(self) -> tuple[str, object]:
        dist.broadcast(self._buffer, src=0, group=self.control)
        length = int(self._buffer[0])
        if length <= CAPACITY:
            return decode(self._buffer[:length].tolist())
        whole = torch.empty(length, dtype=torch.int64)
        dist.broadcast(whole, src=0, group=self.control)
        return decode(whole.tolist())
