"""Where each captured step graph's buffers land in the graphs' memory pool.

Session 19 found the decode graph of `07a707f` 0.18 ms faster (device time) when it was
captured after that commit's verify graph than when captured alone or first, while the
decode graph of main took the same time in any order (docs/benchmarks.md, sixteenth part).
The graphs share one pool, so what the decode graph gets there is the first suspect. Two
uses:

    python3 pool_layout.py run OUT [--decode-alone] [--own-pools] SCRIPT [ARGS...]
        Runs SCRIPT (a bench script, from its own directory, of any commit whose StepGraphs
        has ``capture`` and ``_capture``) with the CUDA caching allocator's history
        recorded, and writes OUT (JSON): for each StepGraphs.capture, each graph's
        allocation events in capture order and the segments just after. --decode-alone
        captures the decode graphs only (q_len 1: the slow case above); --own-pools gives
        each graph a pool of its own.

    python3 pool_layout.py report LAYOUT [LAYOUT...] [--list]
        For each graph: its allocations by the segment they lie in (how many, how many
        kept to the capture's end, bytes, offsets in the segment; the segment's type, pool
        and size); with --list each allocation (size, address, offset, freed or kept).

bench/device/ab.sh runs both with LAYOUT=1.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

HISTORY = 5_000_000  # allocator events kept: far more than a bench's captures make


def run(out: Path, script: Path, args: list[str], decode_alone: bool, own_pools: bool) -> None:
    """SCRIPT under the patches, as ``python3 SCRIPT ARGS`` would run it."""
    import torch

    sys.path.insert(0, str(script.parent))
    from splitspec.cuda_graphs import StepGraphs

    memory = torch.cuda.memory
    memory._record_memory_history(enabled="all", context=None, max_entries=HISTORY)
    captures: list[dict[str, Any]] = []
    graphs: list[dict[str, Any]] = []
    original_capture, original_one = StepGraphs.capture, StepGraphs._capture

    def events() -> list[dict[str, Any]]:
        return memory._snapshot()["device_traces"][torch.cuda.current_device()]

    def capture_one(self: StepGraphs, key: Any) -> Any:
        if own_pools:
            self.pool = torch.cuda.graph_pool_handle()
        first = len(events())
        graph = original_one(self, key)
        graphs.append({"key": str(key), "first": first, "last": len(events())})
        return graph

    def capture(self: StepGraphs, buckets: Any, q_lens: tuple[int, ...], *rest: Any,
                **named: Any) -> Any:
        graphs.clear()
        result = original_capture(self, buckets, (1,) if decode_alone else q_lens, *rest,
                                  **named)
        snapshot = memory._snapshot()
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        captures.append({
            "graphs": [{"key": g["key"], "events": [_event(e) for e in
                                                    trace[g["first"]:g["last"]]]}
                       for g in graphs],
            "segments": [_segment(s) for s in snapshot["segments"]
                         if s["device"] == torch.cuda.current_device()]})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": [str(script), *args],
                                   "decode_alone": decode_alone, "own_pools": own_pools,
                                   "captures": captures}))
        return result

    StepGraphs.capture, StepGraphs._capture = capture, capture_one
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def _event(event: dict[str, Any]) -> dict[str, Any]:
    return {"action": event.get("action"), "addr": event.get("addr"), "size": event.get("size"),
            "stream": event.get("stream")}


def _segment(segment: dict[str, Any]) -> dict[str, Any]:
    return {"address": segment["address"], "size": segment["total_size"],
            "type": segment.get("segment_type"), "pool": list(segment.get("segment_pool_id")
                                                             or ()),
            "stream": segment.get("stream")}


def placements(graph: dict[str, Any], segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A graph's allocations in order: address, size, its segment's index in ``segments``
    (None where none holds it), the offset in that segment, and whether it was freed before
    the capture ended (a buffer the graph reuses) or not (one the graph keeps)."""
    found: list[dict[str, Any]] = []
    live: dict[int, dict[str, Any]] = {}  # address -> its latest allocation not yet freed
    for event in graph["events"]:
        addr = event["addr"]
        if event["action"] == "free_requested" and addr in live:
            live.pop(addr)["freed"] = True
        elif event["action"] == "alloc":
            index = next((i for i, s in enumerate(segments)
                          if s["address"] <= addr < s["address"] + s["size"]), None)
            found.append({"addr": addr, "size": event["size"], "segment": index,
                          "offset": None if index is None else addr - segments[index]["address"],
                          "freed": False})
            live[addr] = found[-1]
    return found


def report(path: Path, listed: bool) -> None:
    layout = json.loads(path.read_text())
    flags = [flag for flag in ("decode_alone", "own_pools") if layout.get(flag)]
    print(f"{path}: {' '.join(layout['command'])}" + (f" [{', '.join(flags)}]" if flags else ""))
    for number, capture in enumerate(layout["captures"], 1):
        segments = capture["segments"]
        print(f" capture {number}:")
        for graph in capture["graphs"]:
            found = placements(graph, segments)
            print(f"  graph {graph['key']}: {len(found)} allocations, "
                  f"{sum(p['size'] for p in found)} bytes")
            by_segment: dict[int | None, list[dict[str, Any]]] = {}
            for p in found:
                by_segment.setdefault(p["segment"], []).append(p)
            for index, mine in sorted(by_segment.items(), key=lambda item: (item[0] is None,
                                                                           item[0] or 0)):
                kept = sum(not p["freed"] for p in mine)
                where = "no segment" if index is None else (
                    f"segment {index} ({segments[index]['type']}, pool "
                    f"{segments[index]['pool']}, {segments[index]['size']} B at "
                    f"{segments[index]['address']:#x}): offsets "
                    f"{min(p['offset'] for p in mine):#x}-{max(p['offset'] for p in mine):#x}")
                print(f"    {len(mine):5d} allocations ({kept} kept), "
                      f"{sum(p['size'] for p in mine)} B, {where}")
            if listed:
                for p in found:
                    where = ("no segment" if p["segment"] is None else
                             f"segment {p['segment']} + {p['offset']:#x}")
                    print(f"      {p['size']:>10} B at {p['addr']:#x} ({where}, "
                          f"{'freed' if p['freed'] else 'kept'})")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        parser = argparse.ArgumentParser(prog="pool_layout.py run")
        parser.add_argument("out", type=Path)
        parser.add_argument("--decode-alone", action="store_true")
        parser.add_argument("--own-pools", action="store_true")
        parser.add_argument("script", type=Path)
        parser.add_argument("args", nargs=argparse.REMAINDER)
        args = parser.parse_args(sys.argv[2:])
        run(args.out, args.script.resolve(), args.args, args.decode_alone, args.own_pools)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["report"])
    parser.add_argument("layouts", nargs="+", type=Path)
    parser.add_argument("--list", action="store_true", help="every allocation, one a line")
    args = parser.parse_args()
    for path in args.layouts:
        report(path, args.list)


if __name__ == "__main__":
    main()
