"""Tokens per second with speculation ON and OFF on a running target, and where a step's time goes.

Talks to the target's Serve stream directly (as the gateway does), so the
figures are the engine's and the draft exchange's, without client overhead;
``--gateway`` additionally times the same prompts end to end through a gateway.

    python bench/bench_speculation.py --target localhost:50052 [--gateway localhost:50051]

Start the stack first (``splitspec up``), or let ``--start`` launch draft and
target on free ports (``--draft-kind eagle3|standalone|self``).
"""

from __future__ import annotations

import argparse
import queue
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_TARGET
from splitspec.grpc_server import CHANNEL_OPTIONS, wait_for_serving
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_files(path):\n",
    "for i in range(10):\n    print(",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "with open(path) as f:\n    for line in f:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def __repr__(self):\n    return f\"",
]


@dataclass
class RunStats:
    tokens: int = 0
    wall_s: float = 0.0
    steps: list[target_pb2.StepStats] = field(default_factory=list)
    spec: common_pb2.SpecStats | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def run_target(stub: target_pb2_grpc.TargetStub, prompts: list[list[int]], max_new: int,
               mode: int, concurrency: int) -> RunStats:
    """Generate every prompt, keeping `concurrency` in flight; one Serve stream."""
    requests: queue.Queue = queue.Queue()
    stats = RunStats()
    pending = list(enumerate(prompts))

    def admit_next() -> None:
        rid, ids = pending.pop(0)
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=rid, prompt_ids=ids, max_new_tokens=max_new, ignore_eos=True,
            speculation=mode)))

    for _ in range(min(concurrency, len(pending))):
        admit_next()
    done = 0
    start = time.perf_counter()
    events = stub.Serve(iter(requests.get, None))
    seen_steps = set()
    for event in events:
        if event.stats.step not in seen_steps:
            seen_steps.add(event.stats.step)
            stats.steps.append(event.stats)
        for delta in event.deltas:
            stats.tokens += len(delta.token_ids)
            if delta.finish_reason:
                done += 1
                if pending:
                    admit_next()
        if done == len(prompts):
            break
    stats.wall_s = time.perf_counter() - start
    events.cancel()
    return stats


def breakdown(steps: list[target_pb2.StepStats], speculated: bool) -> dict[str, float]:
    """Median milliseconds per decode step (prefill steps excluded)."""
    picked = [s for s in steps if s.prefill_tokens == 0 and s.speculated == speculated]
    if not picked:
        return {}
    med = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {
        "steps": len(picked),
        "draft_ms": med([s.draft_s for s in picked]),
        "draft_compute_ms": med([s.draft_compute_s for s in picked]),
        "forward_ms": med([s.forward_s for s in picked]),
        "bookkeeping_ms": med([s.total_s - s.draft_s - s.forward_s for s in picked]),
        "total_ms": med([s.total_s for s in picked]),
        "tokens_per_step": statistics.mean(
            [(s.accepted_tokens + s.batch_size) / s.batch_size for s in picked]),
    }


def run_gateway(address: str, prompts: list[str], max_new: int, mode: int) -> float:
    """End-to-end tokens/s through the gateway, one request at a time."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        tokens, start = 0, time.perf_counter()
        for text in prompts:
            reply = stub.Generate(gateway_pb2.GenerateRequest(
                text=text, speculation=mode,
                stopping=gateway_pb2.StoppingParams(max_new_tokens=max_new, ignore_eos=True)))
            tokens += reply.usage.completion_tokens
        return tokens / (time.perf_counter() - start)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(draft_kind: str) -> tuple[list[subprocess.Popen], str]:
    draft_port, target_port = free_port(), free_port()
    draft_model = {"eagle3": [], "standalone": ["--model", str(BUILTIN_DRAFT)],
                   "self": ["--model", str(BUILTIN_TARGET)]}[draft_kind]
    procs = [subprocess.Popen([sys.executable, "-m", "draft_service", "--port", str(draft_port),
                               *draft_model], stdout=subprocess.DEVNULL)]
    procs.append(subprocess.Popen([sys.executable, "-m", "target_service", "--port",
                                   str(target_port), "--draft", f"127.0.0.1:{draft_port}"],
                                  stdout=subprocess.DEVNULL))
    return procs, f"127.0.0.1:{target_port}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50052", help="target address")
    parser.add_argument("--gateway", default="", help="also time end to end through this gateway")
    parser.add_argument("--start", action="store_true", help="start draft and target here")
    parser.add_argument("--draft-kind", default="eagle3", choices=["eagle3", "standalone", "self"],
                        help="with --start: the built-in EAGLE-3 head, the standalone draft, or "
                             "the target itself as a standalone draft (every token accepted)")
    parser.add_argument("--model", type=Path, default=BUILTIN_TARGET, help="for the tokenizer")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode; medians reported")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    if args.start:
        procs, args.target = start_stack(args.draft_kind)
    try:
        channel = wait_for_serving(args.target, 180, "target")
        stub = target_pb2_grpc.TargetStub(channel)
        tokenizer = load_tokenizer(args.model)
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        modes = {"OFF": common_pb2.SPECULATION_MODE_OFF, "ON": common_pb2.SPECULATION_MODE_ON}
        rates: dict[str, list[float]] = {m: [] for m in modes}
        last: dict[str, RunStats] = {}
        for _ in range(args.repeats):
            for name, mode in modes.items():  # interleaved, so drift hits both alike
                last[name] = run_target(stub, prompts, args.max_new_tokens, mode, args.concurrency)
                rates[name].append(last[name].tokens_per_s)
        print(f"target {args.target}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
              f"concurrency {args.concurrency}, {args.repeats} runs per mode")
        for name in modes:
            print(f"  {name:3s}: {statistics.median(rates[name]):8.1f} tok/s (median; runs: "
                  + ", ".join(f"{r:.1f}" for r in rates[name]) + ")")
        ratios = [on / off for on, off in zip(rates["ON"], rates["OFF"], strict=True)]
        print(f"  ON/OFF speed-up: {statistics.median(ratios):.2f}x (median of per-run ratios)")
        for name, speculated in (("speculative", True), ("plain", False)):
            source = last["ON"] if speculated else last["OFF"]
            print(f"  {name} decode step: {breakdown(source.steps, speculated)}")
        if args.gateway:
            for name, mode in modes.items():
                gw = [run_gateway(args.gateway, PROMPTS, args.max_new_tokens, mode)
                      for _ in range(args.repeats)]
                print(f"  gateway {name}: {statistics.median(gw):.1f} tok/s end to end")
    finally:
        for proc in procs:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
