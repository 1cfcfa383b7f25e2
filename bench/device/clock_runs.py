"""The GPU's clocks, power and temperature over each run of a bench_concurrency.py log whose
lines carry the seconds since the epoch in front (bench/device/pinning.sh writes them so,
with the samples in clocks.csv; either may be gzipped, its name ending in .gz): whether a
mode runs at other clocks than another, apart from its host work.

A run spans from the line that ended the run before it (a timed run's ``[k/n] concurrency
..., MODE, run r/R: ...`` or a warm-up's ``warm-up: concurrency ..., MODE: ...``) to its own;
the first run of a log, which holds the stack's start, is left out. Per timed run, the
median of the samples inside it; then per log, concurrency and mode, the median over its
runs (``--runs``: each run too, with the mode run before it; ``--first-s``: only the samples in
each run's first seconds)::

    python bench/device/clock_runs.py clocks.csv conc_8b_pin_*.log
    python bench/device/clock_runs.py clocks.csv conc_64.log --runs --first-s 0.7
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

RUN_END = re.compile(r"^(\d+\.\d+) (?:\[\d+/\d+\] concurrency (\d+), (\w+), run (\d+)/\d+:"
                     r"|warm-up: concurrency (\d+), (\w+):)")


class Sample(NamedTuple):
    time: float  # seconds since the epoch
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temperature_c: float


class Run(NamedTuple):
    concurrency: int
    mode: str
    run: int  # -1: a warm-up
    start: float
    end: float
    before: str  # the mode of the run before it


def _text(path: Path) -> str:
    """A file's text, gunzipped where its name ends in .gz."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def _number(text: str) -> bool:
    return re.fullmatch(r"\d+(?:\.\d+)?", text) is not None


def read_samples(path: Path) -> list[Sample]:
    """nvidia-smi's CSV (timestamp, clocks.sm, clocks.mem, power.draw, temperature.gpu),
    its timestamps taken as UTC (the device machine's clock); lines it could not read (its
    header, a failed query, a value it did not have: ``[N/A]``) are left out."""
    samples = []
    for line in _text(path).splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        values = [cell.split()[0] if cell else "" for cell in cells[1:]]
        if len(cells) != 5 or not all(_number(v) for v in values):
            continue
        stamp = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=UTC)
        sm, mem, power, temperature = (float(v) for v in values)
        samples.append(Sample(stamp.timestamp(), sm, mem, power, temperature))
    return samples


def read_runs(path: Path) -> list[Run]:
    """The runs of one stamped log, in order, the first (with the stack's start) left out."""
    runs, last, before = [], None, ""
    for line in _text(path).splitlines():
        match = RUN_END.match(line)
        if not match:
            continue
        end = float(match[1])
        timed = match[2] is not None
        concurrency, mode = (match[2], match[3]) if timed else (match[5], match[6])
        if last is not None:
            runs.append(Run(int(concurrency), mode, int(match[4]) - 1 if timed else -1, last,
                            end, before))
        last, before = end, mode
    return runs


def inside(samples: list[Sample], run: Run, first_s: float | None = None) -> list[Sample]:
    """The samples in ``run`` (in its first ``first_s`` seconds, when given)."""
    end = run.end if first_s is None else min(run.end, run.start + first_s)
    return [s for s in samples if run.start <= s.time < end]


def _median_of_runs(runs: list[list[Sample]], field: str) -> float:
    """The median over the runs of each run's median ``field``."""
    return statistics.median(statistics.median(getattr(s, field) for s in run) for run in runs)


FIELDS = (("SM MHz", "sm_mhz"), ("memory MHz", "mem_mhz"), ("W", "power_w"),
          ("C", "temperature_c"))


def lines(samples: list[Sample], logs: list[Path], first_s: float | None = None,
          each_run: bool = False) -> list[str]:
    """Per log, concurrency and mode, the medians over its timed runs; with ``each_run``,
    first a line for each timed run (with the mode of the run before it)."""
    out = []
    for log in logs:
        by_mode: dict[tuple[int, str], list[list[Sample]]] = {}
        for run in read_runs(log):
            mine = inside(samples, run, first_s)
            if run.run < 0 or not mine:
                continue
            by_mode.setdefault((run.concurrency, run.mode), []).append(mine)
            if each_run:
                figures = [f"{name} {_median_of_runs([mine], field):.0f}"
                           for name, field in FIELDS]
                out.append(f"{log.name}: concurrency {run.concurrency}, {run.mode} run "
                           f"{run.run + 1} (after {run.before}, {run.end - run.start:.1f} s): "
                           f"{len(mine)} samples; " + ", ".join(figures))
        for (concurrency, mode), runs in sorted(by_mode.items()):
            figures = [f"{name} {_median_of_runs(runs, field):.0f}" for name, field in FIELDS]
            out.append(f"{log.name}: concurrency {concurrency}, {mode}: {len(runs)} runs, "
                       f"{sum(len(r) for r in runs)} samples; " + ", ".join(figures))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clocks", type=Path, help="nvidia-smi's samples (pinning.sh's clocks.csv)")
    parser.add_argument("logs", type=Path, nargs="+", help="stamped bench_concurrency.py logs")
    parser.add_argument("--first-s", type=float, default=None,
                        help="only the samples in each run's first this many seconds")
    parser.add_argument("--runs", action="store_true",
                        help="also a line for each timed run, with the mode run before it")
    args = parser.parse_args(argv)
    samples = read_samples(args.clocks)
    if not samples:
        print(f"{args.clocks}: no samples", file=sys.stderr)
        return 1
    for line in lines(samples, args.logs, args.first_s, args.runs):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
