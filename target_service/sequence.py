"""One request inside the target: its tokens, cache pages and draft bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from splitspec.kv_cache import PageTable
from splitspec.v1 import common_pb2


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecCounters:
    """Speculation statistics of one sequence (or of the whole engine)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    rejected_trees: int = 0
    reached_by_depth: list[int] = field(default_factory=list)   # verify steps whose tree had depth > d
    accepted_by_depth: list[int] = field(default_factory=list)  # ... and accepted a node at depth d + 1

    def record_verify(self, num_drafted: int, tree_depth: int, num_accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        grow = tree_depth - len(self.reached_by_depth)
        if grow > 0:
            self.reached_by_depth.extend([0] * grow)
            self.accepted_by_depth.extend([0] * grow)
        for d in range(tree_depth):
            self.reached_by_depth[d] += 1
        for d in range(num_accepted):
            self.accepted_by_depth[d] += 1

    def merge(self, other: SpecCounters) -> None:
        self.verify_steps += other.verify_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.plain_steps += other.plain_steps
        self.rejected_trees += other.rejected_trees
        for d in range(len(other.reached_by_depth)):
            if d >= len(self.reached_by_depth):
                self.reached_by_depth.append(0)
                self.accepted_by_depth.append(0)
            self.reached_by_depth[d] += other.reached_by_depth[d]
            self.accepted_by_depth[d] += other.accepted_by_depth[d]

    def to_pb(self) -> common_pb2.SpecStats:
        return common_pb2.SpecStats(
            verify_steps=self.verify_steps,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            mean_accepted_length=self.accepted / self.verify_steps if self.verify_steps else 0.0,
            plain_steps=self.plain_steps,
            rejected_trees=self.rejected_trees,
            acceptance_by_depth=[a / r if r else 0.0 for a, r in
                                 zip(self.accepted_by_depth, self.reached_by_depth, strict=True)],
        )


class FeatureHistory:
    """Captured target features of every cached position of one sequence (for EAGLE-3 catch-up).

    Kept for the sequence's lifetime so that a draft that lost its state (restart)
    can be rebuilt from position 0.
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self._buf = torch.empty(64, width, dtype=dtype, device=device)
        self.num_rows = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.num_rows + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = torch.empty(max(need, 2 * self._buf.shape[0]), self._buf.shape[1],
                                dtype=self._buf.dtype, device=self._buf.device)
            grown[: self.num_rows] = self._buf[: self.num_rows]
            self._buf = grown
        self._buf[self.num_rows: need] = rows
        self.num_rows = need

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self._buf[start:end]


@dataclass
class Sequence:
    request_id: int
    stream_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    speculation: int  # common_pb2.SpeculationMode
    table: PageTable
    seq_id: int  # unique within this target process (the draft's key)
    arrived_at: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated
    num_cached: int = 0       # tokens whose K/V is in the cache (= len(tokens) - 1 once running)
    draft_synced: int = 0     # committed tokens the draft has seen
    features: FeatureHistory | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)
    queue_s: float = 0.0
    is_cancelled: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def is_prefilled(self) -> bool:
        return self.num_cached > 0

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append generated tokens up to the first stop condition; returns those kept.

        Sets finish_reason when a stop id is produced (kept) or max_new_tokens is reached.
        """
        kept = []
        for token in new_tokens:
            self.tokens.append(token)
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = common_pb2.FINISH_REASON_EOS
                break
            if self.num_generated >= self.max_new_tokens:
                self.finish_reason = common_pb2.FINISH_REASON_LENGTH
                break
        return kept
