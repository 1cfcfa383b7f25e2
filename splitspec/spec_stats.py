"""Speculation statistics: drafted and accepted tokens, per verify step and per tree depth."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.v1 import common_pb2


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
