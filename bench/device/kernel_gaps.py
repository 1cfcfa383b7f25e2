"""Where a CUDA graph's device time goes between its kernels.

Two uses:

    python3 kernel_gaps.py run DIR SCRIPT [ARGS...]
        Runs SCRIPT (a bench script, from its own directory) with torch.profiler patched so
        that every profiling session it opens also writes its Chrome trace to DIR (1.json,
        2.json, ... in the order they close). Works on any commit's bench scripts, since
        nothing in them changes.

    python3 kernel_gaps.py report TRACE [TRACE...] [--cut US]
        For each trace: the device's busy time (the sum of its kernels, copies and sets),
        its span from the first start to the last end, and the idle time between
        consecutive device operations, split into gaps under --cut (default 50 µs: between
        a graph's kernels) and the rest (between calls: the host's time). The gaps under
        the cut are summed by the pair of operations either side, largest first, so two
        commits' traces show which transitions got slower.

bench/device/ab.sh runs it with TRACE=1: each tree's profiled run of bench_step_costs.py
(1.json its decode calls, 2.json its verify calls, then the eager ones and the draft's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import runpy
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def run(out: Path, script: Path, args: list[str]) -> None:
    """SCRIPT under the patch, as ``python3 SCRIPT ARGS`` would run it."""
    from torch import profiler

    out.mkdir(parents=True, exist_ok=True)
    count = itertools.count(1)
    close = profiler.profile.__exit__

    def exit_and_export(self: profiler.profile, *exc: object) -> object:
        result = close(self, *exc)
        self.export_chrome_trace(str(out / f"{next(count)}.json"))
        return result

    profiler.profile.__exit__ = exit_and_export
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


def short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


class Gaps(NamedTuple):
    """One trace's device time: operations, busy and span (µs), idle time in gaps under the
    cut and in longer ones, and the short gaps by the pair of operations either side."""

    operations: int
    busy_us: float
    span_us: float
    inside_us: float
    between_us: float
    pairs: dict[tuple[str, str], list[float]]


def gaps(events: list[dict], cut_us: float) -> Gaps:
    """The device operations of a Chrome trace's events, in start order, and the time the
    device sat idle before each (from the latest end of those before it)."""
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e),
                 key=lambda e: e["ts"])
    if not ops:
        return Gaps(0, 0.0, 0.0, 0.0, 0.0, {})
    inside, between = 0.0, 0.0
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    last = ops[0]  # of the operations so far, the one that ends last (they may overlap)
    for after in ops[1:]:
        gap = after["ts"] - (last["ts"] + last["dur"])
        if 0 < gap < cut_us:
            inside += gap
            pairs[(short(last["name"]), short(after["name"]))].append(gap)
        elif gap > 0:
            between += gap
        if after["ts"] + after["dur"] > last["ts"] + last["dur"]:
            last = after
    span = max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]
    return Gaps(len(ops), sum(e["dur"] for e in ops), span, inside, between, dict(pairs))


def report(trace: Path, cut_us: float, top: int) -> None:
    events = json.loads(trace.read_text())
    found = gaps(events.get("traceEvents", []) if isinstance(events, dict) else events, cut_us)
    if not found.operations:
        print(f"{trace}: no device operations")
        return
    print(f"{trace}: {found.operations} device operations, busy {found.busy_us / 1000:.3f} ms, "
          f"span {found.span_us / 1000:.3f} ms; idle between operations: "
          f"{found.inside_us / 1000:.3f} ms in gaps under {cut_us:g} us, "
          f"{found.between_us / 1000:.3f} ms in longer ones")
    ranked = sorted(found.pairs.items(), key=lambda item: -sum(item[1]))[:top]
    for (before, after), times in ranked:
        print(f"  {sum(times):9.1f} us over {len(times):5d} gaps (mean "
              f"{sum(times) / len(times):5.2f})  {before}  ->  {after}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        if len(sys.argv) < 4:
            sys.exit("usage: kernel_gaps.py run DIR SCRIPT [ARGS...]")
        run(Path(sys.argv[2]), Path(sys.argv[3]).resolve(), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["report"])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--cut", type=float, default=50.0, help="gaps shorter than this (µs) "
                        "are inside a call; longer ones are between calls (default 50)")
    parser.add_argument("--top", type=int, default=12, help="pairs of operations listed")
    args = parser.parse_args()
    for trace in args.traces:
        report(trace, args.cut, args.top)


if __name__ == "__main__":
    main()
