"""Where a graphed draft call's wall time goes on the host, without a profiler.

    python3 draft_split.py SCRIPT [ARGS...]     (from bench/, e.g. bench_step_costs.py)

Runs SCRIPT with five methods wrapped in perf_counter stamps (about 1 us each, no
synchronisation added): ``Drafter.draft`` (the call), ``CUDAGraph.replay`` inside it (the
launch), ``TreeSearch.run_caught_up``, ``TreeSearch._read`` (the read-back: it waits for
the graph) and ``Candidates.best_trees``. At exit it prints, over every draft call that
replayed the catch-up-and-search graph, the medians of: the host work before the launch,
the launch, the wait for the read-back, the host work after it (the pick of the best tree
included) and the whole call. torch's profiler stretches a graph launch (0.38 ms under it
against 0.01-0.04 ms without, on the H200), so this is how the call's time outside the
graph is split.
"""

from __future__ import annotations

import atexit
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from draft_service.drafter import Drafter
from draft_service.tree_search import Candidates, TreeSearch

calls: list[dict[str, float]] = []
current: dict[str, float] | None = None


def stamped(owner: type, name: str, before: str, after: str) -> None:
    static = isinstance(owner.__dict__[name], staticmethod)
    original = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        if current is None:
            return original(*args, **kwargs)
        current.setdefault(before, time.perf_counter())
        out = original(*args, **kwargs)
        current[after] = time.perf_counter()
        return out

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def draft_wrapper(original: Callable[..., object]) -> Callable[..., object]:
    def draft(*args: object, **kwargs: object) -> object:
        global current
        current = {"start": time.perf_counter()}
        try:
            return original(*args, **kwargs)
        finally:
            current["end"] = time.perf_counter()
            calls.append(current)
            current = None

    return draft


def report() -> None:
    graphed = [c for c in calls if {"caught", "launch", "read", "read_back"} <= c.keys()]
    if not graphed:
        print(f"draft_split: none of {len(calls)} draft calls replayed a graph")
        return
    parts = {"before the launch": ("start", "launch"), "the launch": ("launch", "launched"),
             "launched to the read": ("launched", "read"),
             "the read-back (waits for the graph)": ("read", "read_back"),
             "after the read-back": ("read_back", "end"), "the call": ("start", "end")}
    print(f"draft_split: {len(graphed)} graphed draft calls (of {len(calls)}), medians in ms")
    for label, (a, b) in parts.items():
        values = [1e3 * (c[b] - c[a]) for c in graphed]
        print(f"  {label:38s} {statistics.median(values):7.3f}")
    picks = [1e3 * (c["picked"] - c["pick"]) for c in graphed if "picked" in c]
    if picks:
        print(f"  {'of which the best-tree pick':38s} {statistics.median(picks):7.3f}")


def main() -> None:
    script = Path(sys.argv[1])
    Drafter.draft = draft_wrapper(Drafter.draft)
    stamped(torch.cuda.CUDAGraph, "replay", "launch", "launched")
    stamped(TreeSearch, "run_caught_up", "caught", "caught_done")
    stamped(TreeSearch, "_read", "read", "read_back")
    stamped(Candidates, "best_trees", "pick", "picked")
    atexit.register(report)
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
