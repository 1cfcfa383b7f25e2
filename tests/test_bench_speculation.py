"""bench/bench_speculation.py's account of a run's wall time (read from the target's step
statistics), which separates the adaptive policy's probes and the catch-ups that begin
them from the time between steps."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_speculation as bs  # bench/ is a script folder, not a package

from splitspec.v1 import target_pb2


def step(n: int, speculated: bool, total_s: float, draft_s: float = 0.0,
         batch_size: int = 1) -> target_pb2.StepStats:
    return target_pb2.StepStats(step=n, batch_size=batch_size, speculated=speculated,
                                total_s=total_s, draft_s=draft_s)


def test_a_runs_time_splits_into_prompts_plain_speculative_resumed_and_between_steps():
    """A prompt alone, then a speculative step (after a prompt: not counted as resuming),
    plain steps, a probe of two speculative steps whose first resumes after plain ones (its
    draft exchange carries the catch-up), and plain again; given out of order: the split
    orders them by step number."""
    steps = [step(5, True, 0.004, draft_s=0.003), step(2, False, 0.001), step(3, False, 0.001),
             step(4, False, 0.001), step(6, True, 0.002, draft_s=0.001), step(7, False, 0.001),
             step(1, True, 0.002, draft_s=0.001), step(0, False, 0.003, batch_size=0)]
    split = bs.time_split(steps, wall_s=0.020)
    assert split["prompts_steps"] == 1 and split["prompts_s"] == pytest.approx(0.003)
    assert split["plain_steps"] == 4 and split["plain_s"] == pytest.approx(0.004)
    assert split["speculative_steps"] == 3 and split["speculative_s"] == pytest.approx(0.008)
    assert split["resumed_steps"] == 1 and split["resumed_s"] == pytest.approx(0.004)
    assert split["resumed_draft_s"] == pytest.approx(0.003)
    assert split["between_steps_s"] == pytest.approx(0.020 - 0.015)
    text = bs.describe_split(split)
    assert "prompts alone 0.003 (1) + plain steps 0.004 (4)" in text
    assert "between steps 0.005" in text
