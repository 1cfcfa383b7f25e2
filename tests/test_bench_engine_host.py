"""bench/bench_engine_host.py: the engine's host time per step over a stand-in model, for
each request mode and batch size, its setup checked by the bench itself (the batch it
meant, speculation only where meant, the tree's two moved nodes accepted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from splitspec.v1 import target_pb2

REPO = Path(__file__).resolve().parent.parent


def test_the_bench_times_each_mode_and_batch_and_writes_every_run(tmp_path):
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--batch", "1,3",
                           "--steps", "5", "--repeats", "2", "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("  batch")]
    assert [line.split(":")[0].split() for line in lines] == [
        ["batch", str(b), mode] for b in (1, 3) for mode in ("off", "auto-off", "tree")]
    assert all("; CPU " in line for line in lines)
    written = json.loads(out.read_text())
    runs = written["runs_us"]
    assert set(runs) == {f"{mode} {b}" for b in (1, 3) for mode in ("off", "auto-off", "tree")}
    assert all(len(r) == 2 and all(us > 0 for us in r) for r in runs.values())
    assert {key: len(r) for key, r in written["runs_cpu_us"].items()} == {
        key: 2 for key in runs}


def test_unknown_modes_are_refused():
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--modes", "off,on"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown modes ['on']" in done.stderr


def test_the_grpc_sink_sends_every_step_to_a_client_process(tmp_path):
    """--sinks grpc: the real Serve path in a real server, and a client process that must
    receive an event for every timed step (the bench refuses fewer)."""
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--batch", "2",
                           "--modes", "off", "--sinks", "memory,grpc", "--steps", "20",
                           "--repeats", "1", "--launch-calls", "2", "--device-us", "50",
                           "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    assert "a 50 us device wait included" in done.stdout
    written = json.loads(out.read_text())
    runs, cpu = written["runs_us"], written["runs_cpu_us"]
    assert set(runs) == set(cpu) == {"off 2", "off grpc 2"}
    assert all(us >= 50 for r in runs.values() for us in r)  # the wait is in every step
    # ... in its wall time, not in the engine thread's CPU time (the stand-in sleeps)
    assert all(0 < c < w - 25 for key in runs for w, c in zip(runs[key], cpu[key], strict=True))


def test_the_pipe_sink_writes_every_step_to_a_reading_process(tmp_path):
    """--sinks pipe: each event serialized on the engine's thread and written to a pipe; the
    reading process parses them and must count an event for every timed step (the bench
    refuses fewer)."""
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, "bench/bench_engine_host.py", "--batch", "2",
                    "--modes", "off,tree", "--sinks", "pipe", "--steps", "20",
                    "--repeats", "1", "--out-json", str(out)],
                   cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    runs = json.loads(out.read_text())["runs_us"]
    assert set(runs) == {"off pipe 2", "tree pipe 2"}
    assert all(us > 0 for r in runs.values() for us in r)


def test_a_pipe_reader_counts_the_whole_events_it_was_sent():
    """The reading process of --sinks pipe: length-first ServeEvents, split anywhere by the
    pipe's reads, each parsed; it prints how many came."""
    events = [target_pb2.ServeEvent(stats=target_pb2.StepStats(step=n, batch_size=n))
              for n in range(300)]
    data = b"".join(len(b := e.SerializeToString()).to_bytes(4, "little") + b for e in events)
    read, write = os.pipe()
    reader = subprocess.Popen([sys.executable, "bench/bench_engine_host.py", "--pipe-reader",
                               str(read)], cwd=REPO, pass_fds=(read,), stdout=subprocess.PIPE,
                              text=True)
    os.close(read)
    for start in range(0, len(data), 7):  # in small pieces: frames cut across reads
        os.write(write, data[start:start + 7])
    os.close(write)
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0 and out.split() == ["300"]


def test_unknown_sinks_are_refused():
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--sinks", "file"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown sinks ['file']" in done.stderr


def test_idle_us_sleeps_before_each_step_without_timing_it(tmp_path):
    """--idle-us: the step is timed after a wait, the wait itself is not (a 50 ms sleep
    would dwarf the step's host time if it were timed)."""
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--batch", "1",
                           "--modes", "off", "--steps", "5", "--repeats", "1",
                           "--idle-us", "50000", "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    assert "each after an untimed 50000 us sleep" in done.stdout
    (us,) = json.loads(out.read_text())["runs_us"]["off 1"]
    assert 0 < us < 50000
