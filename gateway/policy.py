"""The speculation policy the gateway sends to the target.

A policy is a table: for a decode batch of size b, the first entry with
max_batch_size >= b gives the draft shape; no such entry means no speculation.
Today there is one mode, the seed's static threshold; table and adaptive modes
will be added here.
"""

from __future__ import annotations

from typing import NamedTuple

from splitspec.v1 import common_pb2, target_pb2

# The largest uint32: an entry that covers every batch size.
ANY_BATCH_SIZE = 2**32 - 1


class ShapeOverride(NamedTuple):
    """Draft-shape fields from the command line; 0 keeps the target's default for that field."""

    num_draft_tokens: int = 0
    topk: int = 0
    num_steps: int = 0


def resolve_shape(override: ShapeOverride, default: common_pb2.DraftShape) -> common_pb2.DraftShape:
    """The target's default shape with each non-zero override field put in its place."""
    return common_pb2.DraftShape(
        num_draft_tokens=override.num_draft_tokens or default.num_draft_tokens,
        topk=override.topk or default.topk,
        num_steps=override.num_steps or default.num_steps,
    )


def static_policy(disable_batch_threshold: int, shape: common_pb2.DraftShape) -> target_pb2.SpecPolicy:
    """Speculate with ``shape`` up to ``disable_batch_threshold`` sequences; 0 = at any batch size."""
    if disable_batch_threshold < 0:
        raise ValueError(f"disable_batch_threshold must be >= 0 (got {disable_batch_threshold})")
    max_batch_size = disable_batch_threshold or ANY_BATCH_SIZE
    entry = target_pb2.SpecPolicy.Entry(max_batch_size=max_batch_size, shape=shape)
    return target_pb2.SpecPolicy(entries=[entry])


def describe_policy(policy: target_pb2.SpecPolicy) -> str:
    """One line for logs and the init report, e.g. 'batch<=8: 6 nodes, topk 1, depth 6'."""
    if not policy.entries:
        return "never speculate"
    parts = []
    for entry in policy.entries:
        limit = "any batch" if entry.max_batch_size == ANY_BATCH_SIZE else f"batch<={entry.max_batch_size}"
        shape = entry.shape
        what = ("off" if shape.num_draft_tokens == 0 else
                f"{shape.num_draft_tokens} nodes, topk {shape.topk}, depth {shape.num_steps}")
        parts.append(f"{limit}: {what}")
    return "; ".join(parts)
