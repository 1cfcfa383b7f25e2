"""Does host code run slower right after its thread waited? A fixed unit of Python and torch
host work (a step's kind: lists, a dict, two small tensors from lists, a slice), timed in a
tight loop and right after each kind of wait a served step has: a sleep (the mailbox's
polls), a spin on the clock, and, on CUDA, a synchronize on a queued GPU sleep (the engine's
read of its logits). The served stack's steps take about 0.3 ms more host time than the
same calls in a loop on the GPU host (docs/benchmarks.md, forty-fifth part); if the unit
is slower after a wait than in the loop, waiting itself (a core that idles, or a cold
cache) is part of that.

    python bench/device/wake_cost.py [--waits-us 200,1000] [--rounds 2000]

Prints, per wait, the unit's median microseconds right after it and once more after that
(a slow first and a fast second: the wait left the caches cold), and how long it took.
Session 61: 2.5-4.5x after a 1 ms sleep on the development VM, 1.45x on an H100 host;
session 62: 2.6x on another H100 host (docs/benchmarks.md, forty-seventh part).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def unit() -> float:
    """Seconds of one unit of step-like host work."""
    start = time.perf_counter()
    ids = [7] + list(range(40, 48))
    pos = [100 + d for d in (0, 1, 1, 2, 2, 3, 3, 4, 4)]
    table = {i: (i * 16, i * 16 + 15) for i in range(32)}
    slots = [table[i // 16][0] + i % 16 for i in range(100, 109)]
    a, b = torch.tensor(ids), torch.tensor(pos)
    _ = a[1:], b[: len(slots)]
    return time.perf_counter() - start


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(wait, rounds: int) -> tuple[float, float, float]:
    """The unit's median microseconds right after ``wait()`` and once more after that, and
    the wait's median length."""
    first, second, waits = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        wait()
        waits.append(time.perf_counter() - start)
        first.append(unit())
        second.append(unit())
    return tuple(1e6 * statistics.median(x) for x in (first, second, waits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waits-us", default="200,1000")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    waits_us = [int(w) for w in args.waits_us.split(",")]
    kinds = {"none": lambda us: (lambda: None)}
    kinds["sleep"] = lambda us: (lambda: time.sleep(us / 1e6))
    kinds["spin"] = lambda us: (lambda: spin(us / 1e6))
    if torch.cuda.is_available():
        torch.cuda.init()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rates = []  # cycles a microsecond; the first sleeps run while the clocks still rise
        for _ in range(8):
            start.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
            rates.append(1_000_000 / (start.elapsed_time(end) * 1000))
        cycles_per_us = statistics.median(rates[3:])

        def gpu(us: int):
            def wait() -> None:
                torch.cuda._sleep(int(us * cycles_per_us))
                torch.cuda.synchronize()
            return wait
        kinds["cuda sync"] = gpu
    for _ in range(200):
        unit()
    print(f"{'wait':>10} {'us':>6} {'unit us':>8} {'again us':>9} {'wait took us':>13}")
    for name, make in kinds.items():
        for us in ([0] if name == "none" else waits_us):
            took, again, waited = measure(make(us), args.rounds)
            print(f"{name:>10} {us:>6} {took:8.2f} {again:9.2f} {waited:13.1f}", flush=True)


if __name__ == "__main__":
    main()
