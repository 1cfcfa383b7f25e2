"""The cost of tracing: tokens/s of the same stack with and without an OTLP exporter.

Starts two draft+target stacks: one with no OTEL_* variables (the no-op
path), one exporting traces and metrics over OTLP/gRPC to a receiver started
here (tests/otlp_receiver.py, which keeps everything it gets). Runs are
interleaved between the two, speculation OFF and ON, and the ratio is taken
per repeat, so drift hits both alike.

    python bench/bench_telemetry.py --repeats 5 --concurrency 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_speculation import SHAPES, load_prompts, run_target, start_stack  # noqa: E402

from splitspec.builtin import BUILTIN_TARGET  # noqa: E402
from splitspec.grpc_server import wait_for_serving  # noqa: E402
from splitspec.v1 import target_pb2_grpc  # noqa: E402
from tests.otlp_receiver import OTLPReceiver  # noqa: E402


def wait_up(address: str, procs: list[subprocess.Popen], what: str) -> object:
    """A channel once the target is SERVING; fails at once when one of its processes exits."""
    deadline = time.monotonic() + 300
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: {proc.args[2]} exited with {proc.returncode}")
        try:
            return wait_for_serving(address, 5, what)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    receiver = OTLPReceiver()
    models = BUILTIN_TARGET.parent
    procs = []
    try:
        plain, address_plain = start_stack("eagle3", models, args.device, args.dtype)
        procs += plain
        traced, address_traced = start_stack("eagle3", models, args.device, args.dtype,
                                             env=receiver.env())
        procs += traced
        stubs = {name: target_pb2_grpc.TargetStub(wait_up(address, group, name))
                 for name, address, group in (("no exporter", address_plain, plain),
                                              ("OTLP exporter", address_traced, traced))}
        prompts = load_prompts("heldout", models / "target", args.num_prompts, 64)
        rates: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for mode, shape in (("OFF", None), ("ON", SHAPES["tree"])):
                for name, stub in stubs.items():
                    stats = run_target(stub, prompts, args.max_new_tokens, shape, args.concurrency)
                    if repeat:
                        rates.setdefault((name, mode), []).append(stats.tokens_per_s)
                        print(f"  run {repeat}: {name:13s} {mode}: {stats.tokens_per_s:.1f} tok/s",
                              file=sys.stderr, flush=True)
        print(f"{args.num_prompts} held-out prompts x {args.max_new_tokens} tokens, concurrency "
              f"{args.concurrency}, {args.repeats} interleaved runs, medians; "
              f"{len(receiver.spans)} spans received")
        print("| speculation | no exporter tok/s | OTLP exporter tok/s | exporter / none |")
        print("|---|---:|---:|---:|")
        for mode in ("OFF", "ON"):
            none, otlp = rates["no exporter", mode], rates["OTLP exporter", mode]
            ratio = statistics.median(b / a for a, b in zip(none, otlp, strict=True))
            print(f"| {mode} | {statistics.median(none):.1f} | {statistics.median(otlp):.1f} | "
                  f"{ratio:.3f} |")
    finally:
        for proc in procs:
            proc.terminate()
        receiver.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
