"""Speculation statistics summed over finished requests."""

from __future__ import annotations

import threading

from splitspec.v1 import common_pb2


class SpecTotals:
    """Sums the final per-request SpecStats the target reports. Thread-safe.

    Counters add up exactly. ``acceptance_by_depth`` is averaged over requests
    weighted by their verify steps, an approximation: the per-depth counts
    behind each request's rates are not on the wire.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = common_pb2.SpecStats()
        self._depth_weighted: list[float] = []
        self._depth_weight: list[float] = []

    def add(self, spec: common_pb2.SpecStats) -> None:
        with self._lock:
            total = self._total
            total.verify_steps += spec.verify_steps
            total.drafted_tokens += spec.drafted_tokens
            total.accepted_tokens += spec.accepted_tokens
            total.plain_steps += spec.plain_steps
            total.rejected_trees += spec.rejected_trees
            for depth, rate in enumerate(spec.acceptance_by_depth):
                if depth == len(self._depth_weight):
                    self._depth_weighted.append(0.0)
                    self._depth_weight.append(0.0)
                self._depth_weighted[depth] += rate * spec.verify_steps
                self._depth_weight[depth] += spec.verify_steps

    def to_pb(self) -> common_pb2.SpecStats:
        with self._lock:
            total = common_pb2.SpecStats()
            total.CopyFrom(self._total)
            if total.verify_steps:
                total.mean_accepted_length = total.accepted_tokens / total.verify_steps
            total.acceptance_by_depth.extend(
                weighted / weight if weight else 0.0
                for weighted, weight in zip(self._depth_weighted, self._depth_weight, strict=True))
            return total
