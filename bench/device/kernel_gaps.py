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

bench/device/ab.sh runs it with TRACE=1 (base and head, one decode call's profile each).
"""

from __future__ import annotations

import argparse
import itertools
import json
import runpy
import sys
from collections import defaultdict
from pathlib import Path

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


def report(trace: Path, cut_us: float, top: int) -> None:
    events = json.loads(trace.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e),
                 key=lambda e: e["ts"])
    if not ops:
        print(f"{trace}: no device operations")
        return
    busy = sum(e["dur"] for e in ops)
    span = max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]
    inside, between = 0.0, 0.0
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for before, after in itertools.pairwise(ops):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap <= 0:
            continue
        if gap < cut_us:
            inside += gap
            pairs[(short(before["name"]), short(after["name"]))].append(gap)
        else:
            between += gap
    print(f"{trace}: {len(ops)} device operations, busy {busy / 1000:.3f} ms, span "
          f"{span / 1000:.3f} ms; idle between operations: {inside / 1000:.3f} ms in gaps under "
          f"{cut_us:g} us, {between / 1000:.3f} ms in longer ones")
    ranked = sorted(pairs.items(), key=lambda item: -sum(item[1]))[:top]
    for (before, after), gaps in ranked:
        print(f"  {sum(gaps):9.1f} us over {len(gaps):5d} gaps (mean {sum(gaps) / len(gaps):5.2f})"
              f"  {before}  ->  {after}")


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
