"""bench/device/kernel_gaps.py: a trace's device time, and the idle time between kernels."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "device" / "kernel_gaps.py"
spec = importlib.util.spec_from_file_location("kernel_gaps", SCRIPT)
kernel_gaps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_gaps)


def op(name, ts, dur, cat="kernel"):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "ph": "X"}


EVENTS = [
    op("cudaGraphLaunch", 0.0, 5.0, cat="cuda_runtime"),  # host: not the device's
    op("norm", 10.0, 2.0),
    op("gemm", 12.5, 10.0),   # 0.5 after norm
    op("norm", 23.0, 2.0),    # 0.5 after gemm
    op("Memcpy HtoD", 24.0, 0.5, cat="gpu_memcpy"),  # overlaps the norm: no gap
    op("gemm", 26.0, 10.0),   # 1.0 after the norm's end
    op("norm", 136.0, 2.0),   # 100 after: between calls
]


def test_gaps_split_at_the_cut_and_sum_by_pair():
    found = kernel_gaps.gaps(EVENTS, cut_us=50.0)
    assert found.operations == 6
    assert found.busy_us == 2 + 10 + 2 + 0.5 + 10 + 2
    assert found.span_us == 138.0 - 10.0
    assert found.inside_us == 0.5 + 0.5 + 1.0
    assert found.between_us == 100.0
    # the copy inside the norm hides nothing: the gemm waited 1.0 after the norm's end
    assert found.pairs == {("norm", "gemm"): [0.5, 1.0], ("gemm", "norm"): [0.5]}


def test_report_reads_a_chrome_trace(tmp_path):
    trace = tmp_path / "1.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    out = subprocess.run([sys.executable, str(SCRIPT), "report", str(trace), "--cut", "50"],
                         capture_output=True, text=True, check=True).stdout
    assert "6 device operations, busy 0.026 ms" in out
    assert "0.002 ms in gaps under 50 us, 0.100 ms in longer ones" in out
    assert out.splitlines()[1].split()[0] == "1.5"  # the largest pair first: norm -> gemm
    assert out.splitlines()[1].endswith("norm  ->  gemm")
