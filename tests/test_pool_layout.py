"""bench/device/pool_layout.py: where a captured graph's allocations land (report side)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "device" / "pool_layout.py"
spec = importlib.util.spec_from_file_location("pool_layout", SCRIPT)
pool_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pool_layout)

SEGMENTS = [
    {"address": 0x1000, "size": 0x1000, "type": "small", "pool": [0, 0], "stream": 7},
    {"address": 0x10000, "size": 0x200000, "type": "small", "pool": [1, 2], "stream": 9},
]


def event(action, addr, size=0):
    return {"action": action, "addr": addr, "size": size, "stream": 9}


GRAPH = {"key": "GraphKey(size=1, q_len=1, capture=(), tokens=0)", "events": [
    event("alloc", 0x1000, 512),         # a warm-up buffer, outside the pool, freed
    event("free_requested", 0x1000, 512),
    event("free_completed", 0x1000, 512),
    event("alloc", 0x10000, 1024),       # freed during the capture...
    event("alloc", 0x10400, 2048),       # kept
    event("free_requested", 0x10000, 1024),
    event("alloc", 0x10000, 512),        # ...and its address reused by one the graph keeps
    event("alloc", 0x999999, 64),        # in no segment of the snapshot
]}


def test_placements_give_segment_offset_and_whether_each_allocation_was_freed():
    found = pool_layout.placements(GRAPH, SEGMENTS)
    assert [(p["addr"], p["segment"], p["offset"], p["freed"]) for p in found] == [
        (0x1000, 0, 0, True),
        (0x10000, 1, 0, True),
        (0x10400, 1, 0x400, False),
        (0x10000, 1, 0, False),
        (0x999999, None, None, False),
    ]
    assert [p["size"] for p in found] == [512, 1024, 2048, 512, 64]


def test_report_lists_each_graphs_allocations_and_their_segments(tmp_path):
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"command": ["bench_step_costs.py"], "decode_alone": True,
                                  "own_pools": False,
                                  "captures": [{"graphs": [GRAPH], "segments": SEGMENTS}]}))
    out = subprocess.run([sys.executable, str(SCRIPT), "report", str(layout)],
                         capture_output=True, text=True, check=True).stdout
    assert "[decode_alone]" in out
    assert "5 allocations, 4160 bytes" in out
    assert ("3 allocations (2 kept), 3584 B, segment 1 (small, pool [1, 2], 2097152 B at "
            "0x10000): offsets 0x0-0x400") in out
    assert "1 allocations (0 kept), 512 B, segment 0 (small, pool [0, 0]" in out
    assert "1 allocations (1 kept), 64 B, no segment" in out
    assert "at 0x10400" not in out  # one line an allocation only with --list
    listed = subprocess.run([sys.executable, str(SCRIPT), "report", str(layout), "--list"],
                            capture_output=True, text=True, check=True).stdout
    assert "2048 B at 0x10400 (segment 1 + 0x400, kept)" in listed
    assert "64 B at 0x999999 (no segment, kept)" in listed
