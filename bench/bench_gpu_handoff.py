"""What it costs when two processes take turns on one GPU, as the target's and the draft's
do at every speculative step on a one-GPU stack, against one process taking the same turns.

Each side owns a small piece of device work (--kernels in-place adds on --size floats; on a
GPU captured in a CUDA graph, as the services' steps are). A turn is: launch the work, wait
for it, hand over. "one": a single process runs side A's work, then side B's, each waited
for. "two": side B lives in a second process; A runs its work, waits, and hands over
through a flag in shared memory that both sides spin on (about a microsecond on the host,
so what remains is the device's switch between the two processes' contexts). The modes
alternate --repeats times; each figure is the median over --turns turns of one run.

    python bench/bench_gpu_handoff.py --out-json /tmp/handoff.json          # on the GPU
    python bench/bench_gpu_handoff.py --device cpu --turns 200 --repeats 1  # the script's check

The result's ``handoff_us`` is half of (two - one) a turn: what each switch of process adds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized

import torch
from graph_timing import graph_of

A_TURN, B_TURN, DONE = 0, 1, 2


def make_work(device: str, kernels: int, size: int) -> Callable[[], None]:
    """One side's device work, and on a GPU the same captured in a graph (replayed)."""
    torch.set_num_threads(1)  # (on the CPU: each side one core, not a pool that spins)
    x = torch.zeros(size, device=device)

    def run() -> None:
        for _ in range(kernels):
            x.add_(1.0)

    if not device.startswith("cuda"):
        return run
    graph = graph_of(run)
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def wait(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_process(args: argparse.Namespace) -> list[float]:
    """Microseconds of each turn with both sides' work in this process."""
    a = make_work(args.device, args.kernels, args.size)
    b = make_work(args.device, args.kernels, args.size)
    times = []
    for turn in range(args.warmup + args.turns):
        start = time.perf_counter()
        a()
        wait(args.device)
        b()
        wait(args.device)
        if turn >= args.warmup:
            times.append(1e6 * (time.perf_counter() - start))
    return times


def side_b(flag: Synchronized, device: str, kernels: int, size: int) -> None:
    """The second process: its work on each of its turns, until A says it is done."""
    b = make_work(device, kernels, size)
    flag.value = A_TURN  # ready
    while True:
        while (state := flag.value) == A_TURN:
            pass
        if state == DONE:
            return
        b()
        wait(device)
        flag.value = A_TURN


def two_processes(args: argparse.Namespace) -> list[float]:
    """Microseconds of each turn with side B's work in a second process."""
    spawn = mp.get_context("spawn")  # (CUDA in a child needs a fresh interpreter)
    flag = spawn.Value("i", B_TURN, lock=False)  # B_TURN until B has built its work
    child = spawn.Process(target=side_b, args=(flag, args.device, args.kernels, args.size))
    child.start()
    a = make_work(args.device, args.kernels, args.size)
    while flag.value != A_TURN:
        if not child.is_alive():
            raise RuntimeError(f"side B's process exited with {child.exitcode} before its first turn")
        time.sleep(0.001)
    times = []
    for turn in range(args.warmup + args.turns):
        start = time.perf_counter()
        a()
        wait(args.device)
        flag.value = B_TURN
        while flag.value == B_TURN:
            pass
        if turn >= args.warmup:
            times.append(1e6 * (time.perf_counter() - start))
    flag.value = DONE
    child.join(timeout=30)
    if child.exitcode != 0:
        raise RuntimeError(f"side B's process exited with {child.exitcode}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", type=int, default=40, help="kernels in each side's work")
    parser.add_argument("--size", type=int, default=1 << 16, help="floats each kernel adds to")
    parser.add_argument("--turns", type=int, default=2000, help="timed turns a run")
    parser.add_argument("--warmup", type=int, default=200, help="untimed turns before them")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternated")
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {"one": [], "two": []}
    for repeat in range(args.repeats):
        for mode, run in (("one", one_process), ("two", two_processes)):
            median = statistics.median(run(args))
            runs[mode].append(median)
            print(f"repeat {repeat + 1}: {mode} process(es): {median:.1f} us a turn", flush=True)
    one, two = statistics.median(runs["one"]), statistics.median(runs["two"])
    handoff = (two - one) / 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{name}, {args.kernels} kernels a side: one process {one:.1f} us a turn, two "
          f"{two:.1f}; each switch of process adds {handoff:.1f} us")
    if args.out_json:
        result = {"command": " ".join(sys.argv), "device": name, "kernels": args.kernels,
                  "size": args.size, "turns": args.turns, "runs_us": runs,
                  "one_us": one, "two_us": two, "handoff_us": handoff}
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
