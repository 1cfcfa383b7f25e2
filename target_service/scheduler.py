"""Waiting and running sequences, and their KV-cache pages. Never touches a tensor.

A sequence is admitted only when pages for its whole life fit (prompt,
max_new_tokens and the largest tree), so a running sequence never runs out of
cache and nothing is ever preempted.
"""

from __future__ import annotations

import time
from collections import deque

from splitspec.kv_cache import PagePool
from target_service.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, pool: PagePool, max_running: int, max_tree_nodes: int) -> None:
        self.pool = pool
        self.max_running = max_running
        self.max_tree_nodes = max_tree_nodes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def slots_needed(self, seq: Sequence) -> int:
        return len(seq.prompt_ids) + seq.max_new_tokens + self.max_tree_nodes + 1

    def can_ever_fit(self, seq: Sequence) -> bool:
        return seq.table.pages_needed(self.slots_needed(seq)) <= self.pool.num_pages

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, first come first served, while cache and slots allow."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.pool.can_allocate(seq.table.pages_needed(self.slots_needed(seq))):
                break
            self.waiting.popleft()
            seq.table.reserve(self.pool, self.slots_needed(seq))
            seq.status = SeqStatus.RUNNING
            seq.queue_s = time.monotonic() - seq.arrived_at
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_batch(self, max_tokens: int) -> list[Sequence]:
        """Running sequences not yet prefilled, up to max_tokens prompt tokens (at least one)."""
        batch, total = [], 0
        for seq in self.running:
            if seq.is_prefilled:
                continue
            if batch and total + len(seq.prompt_ids) > max_tokens:
                break
            batch.append(seq)
            total += len(seq.prompt_ids)
        return batch

    def decode_batch(self) -> list[Sequence]:
        return [seq for seq in self.running if seq.is_prefilled]

    def finish(self, seq: Sequence) -> None:
        """Free a sequence's pages and drop it (running or waiting)."""
        seq.status = SeqStatus.FINISHED
        seq.table.release(self.pool)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
