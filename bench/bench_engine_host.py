"""The target engine's host time per step, apart from the model: ``Engine.step`` over a
stand-in runner whose forward costs (almost) nothing, per request mode and batch size.

On a GPU a step's host work (scheduling, the draft request, acceptance, compaction,
emitting) runs while the device is idle at small batches, so every microsecond of it is
a microsecond of the step; on the 169M benchmark pair a plain step is 0.6 ms
(docs/benchmarks.md, twenty-first part). This bench measures that work on the CPU, with
no device, where a change to the engine can be weighed before a GPU call.

The stand-in runner returns logits whose argmax is token 0 and keeps the features of an
EAGLE-3 draft in a real ``KVCache`` (its compaction and feature reads are
``ModelRunner``'s own, so their torch calls are timed; on CUDA each is also a launch).
It does not write features: on the GPU a CUDA graph does, with no host work. The modes:

- ``off``: requests with speculation OFF;
- ``auto-off``: speculation-capable requests under a policy that never speculates (the
  adaptive policy settled on off);
- ``tree``: every step verifies a stand-in draft's 4-node tree, two of whose nodes are
  accepted at places the compaction moves them from (the draft answers at once: the
  exchange's transit is bench_exchange.py's).

``--sink grpc`` sends each step's events the way the served target does: the stream's
outbox is read by the real ``TargetServicer.Serve`` in a real gRPC server in this process,
and a client in another process receives them. Without it nothing reads the outbox. The
difference is what the sending threads cost the engine's thread: every torch call
releases the GIL, and while they hold it the step waits (docs/benchmarks.md,
twenty-seventh part; the wall time above the CPU time), and the engine's own code runs
slower after them (its CPU time above the memory sink's: forty-seventh part). ``--sink
pipe`` is how the events could leave an engine process that runs no other Python thread
(the gRPC server in a process of its own): each event is serialized on the engine's thread
and written to a pipe, which another process reads. Each line gives the engine thread's
own CPU time a step beside the wall time.

    python bench/bench_engine_host.py                      # batch 1, 8, 64; 3 repeats
    python bench/bench_engine_host.py --batch 1,64 --steps 400 --out-json /tmp/host.json
    python bench/bench_engine_host.py --modes off --batch 1,8 --sinks memory,grpc
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graph_timing import parse_ints

from splitspec.grpc_server import CHANNEL_OPTIONS, ServiceServer
from splitspec.init_report import InitReport
from splitspec.kv_cache import KVCache, PagePool
from splitspec.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from target_service.draft_client import ExchangeResult, Sent
from target_service.engine import Engine, EngineLimits
from target_service.runner import ModelRunner
from target_service.scheduler import Scheduler
from target_service.servicer import TargetServicer

PAGE = 16
VOCAB = 64
FEATURES = 768  # the built-in target's three captured layers of 256
TREE = common_pb2.DraftShape(num_draft_tokens=4, topk=2, num_steps=2)
MAX_TREE_NODES = 8  # the scheduler reserves room for the largest tree
MODES = ("off", "auto-off", "tree")
SINKS = ("memory", "grpc", "pipe")
CONNECT_S = 30.0


class StandInRunner:
    """Logits whose argmax is 0 for every row; a one-layer cache that keeps features."""

    device = "cpu"
    last_graphed = True
    copy_slots = ModelRunner.copy_slots
    read_features = ModelRunner.read_features
    feature_row_bytes = ModelRunner.feature_row_bytes

    def __init__(self, num_pages: int, launch_calls: int = 0, device_s: float = 0.0) -> None:
        self.cache = KVCache(1, num_pages, PAGE, 1, 8, torch.bfloat16, "cpu")
        self.cache.hold_features(FEATURES, torch.bfloat16)
        self._logits = torch.zeros(4096, VOCAB)
        self._logits[:, 0] = 1.0
        self.launch_calls, self.device_s = launch_calls, device_s
        self._staged, self._staging = torch.zeros(4, 64), torch.ones(4, 64)

    def forward(self, batch: object) -> torch.Tensor:
        for _ in range(self.launch_calls):  # a graph's input copies and replay, on a GPU
            self._staged.copy_(self._staging)  # (each call gives the GIL up, as they do)
        self.ready_at = time.perf_counter() + self.device_s  # its logits, on a GPU
        return self._logits[:len(batch.logit_rows)]

    def stop(self) -> None:
        pass


class StandInDraft:
    """Answers at once, for every sequence, with a tree whose root has children 5 and 0, and
    0's children 0 and 5: the argmax (0) accepts nodes 2 and 3, which the compaction moves."""

    down = False  # its stream never breaks
    report = None  # (DraftLink.report: no start-up report to tell)

    def __init__(self) -> None:
        self._replies: list[draft_pb2.DraftReply] = []

    def feature_slot(self, size: int) -> None:
        """No feature memory: a stand-in takes what features it is sent with the request."""

    def send(self, request: draft_pb2.DraftRequest, features: object = None) -> Sent:
        self._replies.append(draft_pb2.DraftReply(step=request.step, trees=[
            draft_pb2.DraftTree(seq_id=s.seq_id, tokens=[5, 0, 0, 5], parents=[0, 0, 2, 2])
            for s in request.seqs]))
        return Sent(request.step, time.monotonic() + 60, "", False)

    def receive(self, sent: Sent) -> ExchangeResult:
        return ExchangeResult(self._replies.pop(0), "", False)

    def owes(self) -> bool:
        return False  # every reply is in as soon as its request is sent


class GrpcSink:
    """The served target's sending path for the bench's engine stream: the real
    ``TargetServicer.Serve`` yields its events from a real gRPC server in this process, and a
    client in another process (this script, ``--client``) receives them and counts them."""

    def __init__(self, engine: Engine, stream_id: int, outbox: queue.Queue) -> None:
        self.outbox = outbox
        opened = threading.Event()

        def open_stream() -> tuple[int, queue.Queue]:  # Serve takes the bench's stream
            opened.set()
            return stream_id, outbox

        engine.open_stream = open_stream
        self.server = ServiceServer("127.0.0.1:0", 4, [])
        target_pb2_grpc.add_TargetServicer_to_server(
            TargetServicer(engine, target_pb2.TargetInfo(), InitReport("target")),
            self.server.server)
        self.server.start()
        self.client = subprocess.Popen(
            [sys.executable, __file__, "--client", f"127.0.0.1:{self.server.port}"],
            stdout=subprocess.PIPE, text=True)
        if not opened.wait(CONNECT_S):
            self.client.kill()
            self.server.stop(0)
            raise RuntimeError(f"the client did not open its Serve stream in {CONNECT_S} s")

    def close(self) -> int:
        """End the stream; the number of events the client received."""
        self.outbox.put(None)
        try:
            return counted(self.client, "the client")
        finally:
            self.server.stop(0)


class PipeSink:
    """Each event serialized on the engine's thread, where ``Engine._flush`` hands it over,
    and written length-first to a pipe that another process (this script, ``--pipe-reader``)
    reads and counts: no other thread of this process does any work for it."""

    def __init__(self, outbox: queue.Queue) -> None:
        read, self._write = os.pipe()
        self.reader = subprocess.Popen([sys.executable, __file__, "--pipe-reader", str(read)],
                                       pass_fds=(read,), stdout=subprocess.PIPE, text=True)
        os.close(read)
        outbox.put = self.put  # (this queue's own put: the engine's stream hands events here)

    def put(self, event: target_pb2.ServeEvent) -> None:
        data = event.SerializeToString()
        frame = memoryview(len(data).to_bytes(4, "little") + data)
        while frame:
            frame = frame[os.write(self._write, frame):]

    def close(self) -> int:
        """End the pipe; the number of events the reader received."""
        os.close(self._write)
        return counted(self.reader, "the pipe's reader")


def counted(process: subprocess.Popen, what: str) -> int:
    """The number of events a receiving process printed last, once it has ended."""
    out, _ = process.communicate(timeout=CONNECT_S)
    if process.returncode:
        raise RuntimeError(f"{what} failed (exit {process.returncode})")
    return int(out.split()[-1])


def pipe_reader_main(fd: int) -> None:
    """Read length-first ServeEvents from pipe ``fd`` until it ends; print how many came."""
    events, buffered = 0, b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            buffered += chunk
            at = 0  # (frames parsed in place: the reader must keep up, or the writes block)
            while len(buffered) - at >= 4 and len(buffered) - at >= 4 + (
                    size := int.from_bytes(buffered[at:at + 4], "little")):
                target_pb2.ServeEvent.FromString(buffered[at + 4:at + 4 + size])
                at, events = at + 4 + size, events + 1
            buffered = buffered[at:]
    print(events, flush=True)


def client_main(address: str) -> None:
    """Receive every event of one Serve stream, sending nothing; print how many came."""
    blocked = threading.Event()

    def requests() -> object:  # the stream stays open until the server ends it
        blocked.wait()
        yield target_pb2.ServeRequest()

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        events = sum(1 for _ in target_pb2_grpc.TargetStub(channel).Serve(requests()))
    print(events, flush=True)
    os._exit(0)  # gRPC's thread still waits on the request iterator


class HostTime(NamedTuple):
    """Median microseconds a step: wall time, and the engine thread's own CPU time (less
    than the wall where the thread waited: for the GIL, a sleep, the stand-in device)."""

    wall_us: float
    cpu_us: float


def host_us_per_step(mode: str, batch: int, steps: int, prompt_len: int = 64,
                     sink: str = "memory", launch_calls: int = 0, device_s: float = 0.0,
                     idle_s: float = 0.0) -> HostTime:
    """``Engine.step`` over ``steps`` decode steps of ``batch`` sequences (the prompts' step
    and the first decode step are not timed), with the events left in the outbox (``sink``
    memory), sent over gRPC (``grpc``: ``GrpcSink``) or written to a pipe (``pipe``:
    ``PipeSink``), each step after an untimed sleep of ``idle_s`` when given."""
    new_tokens = (steps + 2) * (3 if mode == "tree" else 1)
    per_seq = -(-(prompt_len + new_tokens + MAX_TREE_NODES + 1) // PAGE)
    runner = StandInRunner(batch * per_seq, launch_calls, device_s)
    limits = EngineLimits(VOCAB, prompt_len + new_tokens + MAX_TREE_NODES, batch * prompt_len,
                          MAX_TREE_NODES, TREE, frozenset(), skip_owed=True)  # as served
    engine = Engine(runner, Scheduler(PagePool(runner.cache.num_pages), batch, MAX_TREE_NODES),
                    limits,
                    StandInDraft(), (2, 3, 4))
    if device_s:  # the engine's first read of the logits waits for the device
        choose = engine._choose

        def wait_then_choose(*args: object) -> object:
            time.sleep(max(runner.ready_at - time.perf_counter(), 0.0))  # the GIL given up
            return choose(*args)

        engine._choose = wait_then_choose
    stream, outbox = engine.open_stream()
    sending = (GrpcSink(engine, stream, outbox) if sink == "grpc" else
               PipeSink(outbox) if sink == "pipe" else None)
    speculation = {"off": common_pb2.SPECULATION_MODE_OFF, "auto-off": common_pb2.SPECULATION_MODE_AUTO,
                   "tree": common_pb2.SPECULATION_MODE_ON}[mode]
    if mode == "auto-off":
        engine.submit(stream, target_pb2.ServeRequest(policy=target_pb2.SpecPolicy()))
    for rid in range(batch):
        engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=rid, prompt_ids=[1 + (rid + i) % (VOCAB - 1) for i in range(prompt_len)],
            max_new_tokens=new_tokens, ignore_eos=True, speculation=speculation)))
    engine._drain_inbox(block=False)  # the loop's own intake, without its thread
    engine.step()  # the prompts
    engine.step()  # the first decode step (the draft's first request carries the prompts)
    times, cpu_times = [], []
    for _ in range(steps):
        if idle_s:
            time.sleep(idle_s)
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - start_cpu)
    if sending is not None and (received := sending.close()) < steps:
        raise RuntimeError(f"the receiving process got {received} events of {steps}+ steps")
    last = engine.last_stats
    if last.batch_size != batch or last.speculated != (mode == "tree"):
        raise RuntimeError(f"{mode}: the last step decoded {last.batch_size} sequences (not "
                           f"{batch}), speculated: {last.speculated}")
    if mode == "tree" and last.accepted_tokens != 2 * batch:
        raise RuntimeError(f"tree: {last.accepted_tokens} nodes accepted, not 2 a sequence")
    return HostTime(1e6 * statistics.median(times), 1e6 * statistics.median(cpu_times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=parse_ints, default=[1, 8, 64], help="batch sizes")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {MODES}")
    parser.add_argument("--steps", type=int, default=300, help="timed steps a run")
    parser.add_argument("--repeats", type=int, default=3, help="runs a setting, alternated")
    parser.add_argument("--sinks", default="memory",
                        help=f"comma-separated, where the events go: {SINKS}")
    parser.add_argument("--out-json", type=Path, help="write every run's figures here")
    parser.add_argument("--launch-calls", type=int, default=0,
                        help="tiny torch copies in each forward, standing in for the launches "
                             "of a CUDA graph's inputs and replay (each gives the GIL up)")
    parser.add_argument("--device-us", type=float, default=0.0,
                        help="a wait from each forward's launch to the first read of its logits, "
                             "standing in for the device's work (timed with the step)")
    parser.add_argument("--idle-us", type=float, default=0.0,
                        help="a sleep before each timed step, not timed: a served step starts "
                             "after its thread waited (for a request, the draft or the device), "
                             "and host code runs slower right after a wait than in a loop")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # GrpcSink's receiving process
    parser.add_argument("--pipe-reader", type=int, help=argparse.SUPPRESS)  # PipeSink's
    args = parser.parse_args()
    if args.client:
        client_main(args.client)
    if args.pipe_reader is not None:
        pipe_reader_main(args.pipe_reader)
        return 0
    modes, sinks = args.modes.split(","), args.sinks.split(",")
    for given, known, what in ((modes, MODES, "modes"), (sinks, SINKS, "sinks")):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"unknown {what} {unknown}; choose from {known}")
    torch.set_num_threads(1)
    settings = [(m, k, m if k == "memory" else f"{m} {k}") for m in modes for k in sinks]
    runs: dict[str, list[float]] = {f"{x} {b}": [] for b in args.batch for *_, x in settings}
    cpu_runs: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for batch in args.batch:
            for mode, sink, label in settings:  # alternated, so drift hits all alike
                took = host_us_per_step(
                    mode, batch, args.steps, sink=sink, launch_calls=args.launch_calls,
                    device_s=args.device_us / 1e6, idle_s=args.idle_us / 1e6)
                runs[f"{label} {batch}"].append(took.wall_us)
                cpu_runs[f"{label} {batch}"].append(took.cpu_us)
    waits = f", a {args.device_us:g} us device wait included" if args.device_us else ""
    waits += f", each after an untimed {args.idle_us:g} us sleep" if args.idle_us else ""
    print(f"Engine.step host time, stand-in model, {args.steps} steps a run, median of "
          f"{args.repeats} runs (us a step; us a sequence; the engine thread's own CPU time "
          f"a step){waits}")
    first = settings[0][2]
    for batch in args.batch:
        base = statistics.median(runs[f"{first} {batch}"])
        for *_, label in settings:
            us = statistics.median(runs[f"{label} {batch}"])
            cpu = statistics.median(cpu_runs[f"{label} {batch}"])
            print(f"  batch {batch:3d} {label:13s}: {us:8.1f} us ({us / batch:6.1f} a "
                  f"sequence), {us - base:+7.1f} vs {first}; CPU {cpu:8.1f} us; runs "
                  + ", ".join(f"{r:.1f}" for r in runs[f"{label} {batch}"]))
    if args.out_json:
        args.out_json.write_text(json.dumps({"steps": args.steps, "runs_us": runs,
                                             "runs_cpu_us": cpu_runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
