"""Helpers the GPU benches share: integer-list options, and a CUDA graph captured and timed
with its replays queued back to back (the device's time, not the host's)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def graph_of(calls: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``calls`` captured in a CUDA graph, after one run on a side stream (kernels compiled
    and loaded outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, replays: int, rounds: int) -> float:
    """Median over ``rounds`` of the device milliseconds per replay, ``replays`` queued."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)
