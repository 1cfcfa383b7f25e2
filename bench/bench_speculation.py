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
import json
import logging
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from draft_service.config import DraftConfig
from gateway.policy import AdaptivePolicy, adaptive_shapes, static_policy
from splitspec.builtin import BUILTIN_TARGET
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


SHAPES = {  # name -> (num_draft_tokens, topk, num_steps)
    "chain3": (3, 1, 3),
    "chain5": (5, 1, 5),
    "tree": (8, 4, 4),
}


@dataclass
class RunStats:
    tokens: int = 0
    wall_s: float = 0.0
    steps: list[target_pb2.StepStats] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)  # per step: the requests admitted and
    # not yet ended once its final deltas were read (what the gateway tells the policy)
    verify_steps: int = 0
    accepted: int = 0
    reached_by_depth: list[float] = field(default_factory=list)   # weighted by verify steps
    accepted_by_depth: list[float] = field(default_factory=list)
    # per request, as the client saw it: from its admit's queueing to its first token's
    # arrival, and to its last
    first_token_s: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify step (bonus token excluded)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    def add_request(self, spec: common_pb2.SpecStats) -> None:
        self.verify_steps += spec.verify_steps
        self.accepted += spec.accepted_tokens
        rates = list(spec.acceptance_by_depth)
        while len(self.reached_by_depth) < len(rates):
            self.reached_by_depth.append(0.0)
            self.accepted_by_depth.append(0.0)
        for depth, rate in enumerate(rates):  # rate = accepted / reached; weight by verify steps
            self.reached_by_depth[depth] += spec.verify_steps
            self.accepted_by_depth[depth] += rate * spec.verify_steps

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth,
                                                    strict=True)]


class Probes:
    """A policy that probes from off on a fixed schedule: ``every`` decode steps without
    speculation, then ``steps`` speculative ones with ``shape`` (steps the target decodes
    without, e.g. while a deferred catch-up runs, do not count), and again: the adaptive
    policy's probes from off, without its judgement, so that what the returns to speculation
    cost can be compared, their catch-ups waited for or deferred
    (``--target-flag=--defer-catch-up``). Fed like the adaptive policy, it changes the
    policy once the step that ends a phase is seen (the target applies it a step or two
    later)."""

    def __init__(self, shape: common_pb2.DraftShape, every: int = 40, steps: int = 8) -> None:
        self._tables = (target_pb2.SpecPolicy(), static_policy(0, shape))
        self._phases = (every, steps)
        self._on = False
        self._left = every

    @property
    def policy(self) -> target_pb2.SpecPolicy:
        return self._tables[self._on]

    def observe(self, stats: target_pb2.StepStats,
                in_flight: int | None = None) -> target_pb2.SpecPolicy | None:
        if not stats.batch_size or (self._on and not stats.speculated):
            return None
        self._left -= 1
        if self._left > 0:
            return None
        self._on = not self._on
        self._left = self._phases[self._on]
        return self.policy


class Outbox:
    """The requests of one Serve stream, as gRPC's thread takes them (iterate it), and a way to
    wait until that thread has taken every one put so far (:meth:`wait_sent`).

    The benchmark plays the clients and the gateway in one process: a client's next request
    is put here, and the policy's ``observe`` of the step runs next on the same thread. gRPC's
    thread needs the GIL to take the request and send it, so it waited for observe. The
    target prefills a prompt that arrives while a step waits for the draft (about 1 ms with
    the replay draft) in that step; a policy that never left the tree got the next request
    into that step 14-17 points less often than ON did on this CPU, and as often without
    observe (under adaptive in the H100's traces of session 51: 26-37 points less often;
    docs/benchmarks.md, session 52). A
    client in its own process does not wait for the gateway's policy code that way, so the
    benchmark's requests leave before observe runs (in every mode alike)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[target_pb2.ServeRequest | None] = queue.Queue()
        self._drained = threading.Event()
        # held while a put clears the flag and queues, and while the taker finds the queue
        # empty and sets it: a put between those two would otherwise be reported as taken
        self._lock = threading.Lock()

    def put(self, request: target_pb2.ServeRequest | None) -> None:
        with self._lock:
            self._drained.clear()
            self._queue.put(request)

    def wait_sent(self, timeout_s: float = 0.01) -> None:
        """Return once gRPC's thread has taken every request put and asked for the next (it
        does once it has handed the last to the transport), or after ``timeout_s``."""
        self._drained.wait(timeout_s)

    def __iter__(self) -> Iterator[target_pb2.ServeRequest]:
        while True:
            with self._lock:
                if self._queue.empty():
                    self._drained.set()
            request = self._queue.get()
            if request is None:
                return
            yield request


def run_target(stub: target_pb2_grpc.TargetStub, prompts: list[list[int]], max_new: int | list[int],
               shape: tuple[int, int, int] | target_pb2.SpecPolicy | AdaptivePolicy | Probes | None,
               concurrency: int) -> RunStats:
    """Generate every prompt (`max_new` new tokens, or `max_new[i]` for prompt i), keeping
    `concurrency` in flight, on one Serve stream whose policy drafts `shape` at every batch
    size (None: speculation off), is a ready policy table, or follows an adaptive policy (or
    `Probes`) fed with every step's statistics (as the gateway does)."""
    lengths = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    if len(lengths) != len(prompts):
        raise ValueError(f"{len(lengths)} lengths for {len(prompts)} prompts")
    requests = Outbox()
    stats = RunStats()
    mode = common_pb2.SPECULATION_MODE_OFF
    adaptive = shape if isinstance(shape, AdaptivePolicy | Probes) else None
    if adaptive is not None:
        policy = adaptive.policy
    elif isinstance(shape, tuple):
        num, topk, steps = shape
        policy = static_policy(0, common_pb2.DraftShape(num_draft_tokens=num, topk=topk,
                                                        num_steps=steps))
    else:
        policy = shape
    if policy is not None:
        mode = common_pb2.SPECULATION_MODE_AUTO
        requests.put(target_pb2.ServeRequest(policy=policy))
    pending = list(enumerate(prompts))
    sent: dict[int, float] = {}      # request id -> when its admit was queued
    waiting_first: set[int] = set()  # requests whose first token has not arrived

    def admit_next() -> None:
        rid, ids = pending.pop(0)
        sent[rid] = time.perf_counter()
        waiting_first.add(rid)
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=rid, prompt_ids=ids, max_new_tokens=lengths[rid], ignore_eos=True,
            speculation=mode)))

    for _ in range(min(concurrency, len(pending))):
        admit_next()
    done = 0
    start = time.perf_counter()
    events = stub.Serve(iter(requests))
    seen_steps = set()
    for event in events:
        ended = 0
        now = time.perf_counter()
        for delta in event.deltas:
            stats.tokens += len(delta.token_ids)
            if delta.token_ids and delta.request_id in waiting_first:
                waiting_first.discard(delta.request_id)
                stats.first_token_s.append(now - sent[delta.request_id])
            if delta.finish_reason:
                stats.add_request(delta.spec)
                stats.request_s.append(now - sent[delta.request_id])
                ended += 1
        done += ended
        in_flight = len(prompts) - len(pending) - done  # after its final deltas, as the gateway
        admitted = min(ended, len(pending))  # the clients' next requests, sent before the
        for _ in range(admitted):             # policy sees the step (Outbox)
            admit_next()
        if admitted:
            requests.wait_sent()
        if event.stats.step not in seen_steps:
            seen_steps.add(event.stats.step)
            stats.steps.append(event.stats)
            stats.in_flight.append(in_flight)
            changed = adaptive.observe(event.stats, in_flight) if adaptive is not None else None
            if changed is not None:
                requests.put(target_pb2.ServeRequest(policy=changed))
        if done == len(prompts):
            break
    stats.wall_s = time.perf_counter() - start
    events.cancel()
    requests.put(None)  # ends the request iterator, so gRPC's thread consuming it exits
    return stats


def breakdown(steps: list[target_pb2.StepStats], speculated: bool) -> dict[str, float]:
    """Median milliseconds per decode step (prefill steps excluded), and the share of those
    steps whose forward replayed a CUDA graph (0 on CPU, where every step is eager)."""
    picked = [s for s in steps if s.prefill_tokens == 0 and s.speculated == speculated]
    if not picked:
        return {}
    med = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {
        "steps": len(picked),
        "draft_ms": med([s.draft_s for s in picked]),
        "draft_compute_ms": med([s.draft_compute_s for s in picked]),
        "forward_ms": med([s.forward_s for s in picked]),
        "forward_launch_ms": med([s.forward_launch_s for s in picked]),
        "forward_launch_cpu_ms": med([s.forward_launch_cpu_s for s in picked]),
        "bookkeeping_ms": med([s.total_s - s.draft_s - s.forward_s for s in picked]),
        "total_ms": med([s.total_s for s in picked]),
        "graphed_share": sum(s.graphed for s in picked) / len(picked),
    }


def time_split(steps: list[target_pb2.StepStats], wall_s: float) -> dict[str, float]:
    """Where a run's wall time went, in seconds: the target's steps of prompts alone, its plain
    decode steps and its speculative ones (each step's own time, start to end); of the
    speculative ones, those right after a plain decode step (the draft catching up on every
    token since it last drafted: a probe's first step, which the adaptive policy leaves out
    of its judgement) and their draft exchange; of the plain ones, those that sent the draft
    tokens (``--defer-catch-up``: a return to speculation's catch-up, sent while the step
    decodes without a tree; or a request sent early) and their draft wait; and the rest, time
    between steps (the loop waiting for work, e.g. the client's next request, and its own
    overhead). Counts under ``*_steps``."""
    ordered = sorted(steps, key=lambda s: s.step)
    prompts = [s for s in ordered if not s.batch_size]
    plain = [s for s in ordered if s.batch_size and not s.speculated]
    speculative = [s for s in ordered if s.speculated]
    resumed = [s for prev, s in zip(ordered, ordered[1:], strict=False)
               if s.speculated and prev.batch_size and not prev.speculated]
    sending = [s for s in plain if s.draft_input_tokens]
    return {
        "wall_s": wall_s,
        "prompts_s": sum(s.total_s for s in prompts), "prompts_steps": len(prompts),
        "plain_s": sum(s.total_s for s in plain), "plain_steps": len(plain),
        "speculative_s": sum(s.total_s for s in speculative), "speculative_steps": len(speculative),
        "resumed_s": sum(s.total_s for s in resumed), "resumed_steps": len(resumed),
        "resumed_draft_s": sum(s.draft_s for s in resumed),
        "plain_sending_s": sum(s.total_s for s in sending), "plain_sending_steps": len(sending),
        "plain_sending_draft_s": sum(s.draft_s for s in sending),
        "between_steps_s": wall_s - sum(s.total_s for s in ordered),
    }


def describe_split(split: dict[str, float]) -> str:
    return (f"wall {split['wall_s']:.3f} s = prompts alone {split['prompts_s']:.3f} "
            f"({split['prompts_steps']}) + plain steps {split['plain_s']:.3f} "
            f"({split['plain_steps']}; of which sending the draft tokens "
            f"{split['plain_sending_s']:.3f} ({split['plain_sending_steps']}), "
            f"their draft {split['plain_sending_draft_s']:.3f}) + speculative "
            f"{split['speculative_s']:.3f} "
            f"({split['speculative_steps']}; of which right after plain ones "
            f"{split['resumed_s']:.3f} ({split['resumed_steps']}), their draft "
            f"{split['resumed_draft_s']:.3f}) + between steps {split['between_steps_s']:.3f}")


def run_record(stats: RunStats) -> dict:
    """One run for ``--out-json``: its rate, acceptance, median step parts (speculative and
    plain) and the split of its wall time, so a run other than the last can be read too."""
    return {"tokens_per_s": stats.tokens_per_s, "wall_s": stats.wall_s,
            "mean_accepted": stats.mean_accepted,
            "acceptance_by_depth": stats.acceptance_by_depth,
            "step": breakdown(stats.steps, True), "plain_step": breakdown(stats.steps, False),
            "time_split": time_split(stats.steps, stats.wall_s)}


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


def add_stack_arguments(parser: argparse.ArgumentParser, extra_kinds: tuple[str, ...] = (),
                        kinds_help: str = "") -> None:
    """--target, or --start with the draft kind, models, device and dtype of a stack to start;
    `extra_kinds`: draft kinds the script starts itself besides start_stack's (described by
    `kinds_help`)."""
    parser.add_argument("--target", default="localhost:50052", help="target address")
    parser.add_argument("--start", action="store_true", help="start draft and target here")
    parser.add_argument("--draft-kind", default="eagle3",
                        choices=["eagle3", "standalone", "self", *extra_kinds],
                        help="with --start: the built-in EAGLE-3 head, the standalone draft, or "
                             "the target itself as a standalone draft (every token accepted)"
                             + kinds_help)
    parser.add_argument("--models", type=Path, default=BUILTIN_TARGET.parent,
                        help="folder holding target/, eagle3/ and draft/ (with --start)")
    parser.add_argument("--device", default="cpu", help="with --start: torch device of both services")
    parser.add_argument("--dtype", default="float32", help="with --start: dtype of both services")


def start_target(model: Path, device: str, dtype: str, args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A target on a free port (stdout discarded, stderr inherited: its init report shows
    there); `args`: more of its flags (--draft, --max-running, ...)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--port", str(port),
                             "--model", str(model), "--device", device, "--dtype", dtype, *args],
                            stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    return proc, f"127.0.0.1:{port}"


def start_stack(draft_kind: str, models: Path, device: str, dtype: str,
                max_running: int | None = None, env: dict[str, str] | None = None, *,
                target_model: Path | None = None, draft_args: Sequence[str] | None = None,
                draft_port: int | None = None, extra_args: Sequence[str] = (),
                target_args: Sequence[str] = (), draft_extra: Sequence[str] = ()
                ) -> tuple[list[subprocess.Popen], str]:
    """Draft and target on free ports; `max_running`: the target's (None: its default; the
    draft holds at least as many sequences); `env`: extra environment variables of both processes; `target_model`:
    the target checkpoint (None: models/target); `draft_args`: the draft's model flags in
    place of ``--model`` for draft_kind (for example the replay draft's); `draft_port`:
    the draft's port (None: a free one); `extra_args`:
    more flags of both services (e.g. --max-context); `target_args`: the target's alone;
    `draft_extra`: the draft's alone (e.g. --quantize fp8)."""
    draft_port = draft_port or free_port()
    target_model = target_model or models / "target"
    if draft_args is None:
        draft_dir = {"eagle3": models / "eagle3", "standalone": models / "draft",
                     "self": models / "target"}[draft_kind]
        draft_args = ["--model", str(draft_dir)]
    limits = [] if max_running is None else ["--max-running", str(max_running)]
    draft_limits = ([] if max_running is None or max_running <= DraftConfig.max_running
                    else ["--max-running", str(max_running)])
    procs = [subprocess.Popen([sys.executable, "-m", "draft_service", "--port", str(draft_port),
                               *draft_args, "--target-model", str(target_model), "--device",
                               device, "--dtype", dtype, *draft_limits, *extra_args,
                               *draft_extra],
                              stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})]
    target, address = start_target(target_model, device, dtype,
                                   ["--draft", f"127.0.0.1:{draft_port}", *limits, *extra_args,
                                    *target_args], env)
    return [*procs, target], address


def load_prompts(source: str, tokenizer_dir: Path, num: int, prompt_len: int) -> list[list[int]]:
    """Fixed code prompts, or held-out snippets (files the models never trained on)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    if source == "fixed":
        return [tokenizer.encode(p) for p in PROMPTS]
    from splitspec.training.data import (
        collect_corpus,
        heldout_prompts,
        split_corpus,
        stdlib_source,
    )
    from splitspec.training.data import load_tokenizer as load_hf_tokenizer

    corpus = collect_corpus([stdlib_source()], show_progress=False)
    heldout = split_corpus(corpus).heldout
    return [p.ids for p in heldout_prompts(heldout, load_hf_tokenizer(tokenizer_dir), num,
                                           prompt_len)]


def log_policy_decisions() -> None:
    """The adaptive policy's decisions, with the rates behind them, go to stderr with the
    progress lines: they are what explains an adaptive column."""
    policy_log = logging.getLogger("gateway.policy")
    policy_log.setLevel(logging.INFO)
    if not policy_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s policy: %(message)s"))
        policy_log.addHandler(handler)


def main() -> int:
    log_policy_decisions()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_arguments(parser)
    parser.add_argument("--gateway", default="", help="also time end to end through this gateway")
    parser.add_argument("--shapes", default="tree",
                        help=f"comma-separated draft shapes to run ON with: {', '.join(SHAPES)}; "
                             "'adaptive' runs the gateway's adaptive policy with the tree shape; "
                             "'auto-off' sends speculation-capable (AUTO) requests under a policy "
                             "that never speculates: what adaptive costs once it settles on off, "
                             "without its probes; 'probes' decodes 40 steps without speculation, "
                             "then 8 with the tree, and again: adaptive's probes from off on a "
                             "fixed schedule, what their returns to speculation cost")
    parser.add_argument("--prompts", default="fixed", choices=["fixed", "heldout"],
                        help="8 fixed code prompts, or snippets of held-out stdlib files")
    parser.add_argument("--num-prompts", type=int, default=16, help="with --prompts heldout")
    parser.add_argument("--prompt-len", type=int, default=64, help="with --prompts heldout")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode; medians reported")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed rounds of every mode first (the adaptive policy keeps "
                             "what it learns in them); --out-json records them apart")
    parser.add_argument("--target-flag", action="append", default=[],
                        help="with --start: also start a second stack whose target gets this "
                             "flag (repeatable; e.g. --target-flag=--early-exchange); each "
                             "mode runs on both stacks in turn and the second's is reported "
                             "against the first's")
    parser.add_argument("--draft-flag", action="append", default=[],
                        help="with --start: the same for the second stack's draft (e.g. "
                             "--draft-flag=--quantize --draft-flag=fp8); with --target-flag, "
                             "both go to the one second stack")
    parser.add_argument("--out-json", type=Path,
                        help="write every run's figures here (per stack and mode, in order), "
                             "not only the last run's that the report prints")
    parser.add_argument("--draft-down", action="store_true",
                        help="with --start: kill each draft (SIGKILL) once its target serves, "
                             "so that the modes run with the draft away: what asking for "
                             "speculation costs while the target reconnects")
    args = parser.parse_args()
    if (args.target_flag or args.draft_flag or args.draft_down) and not args.start:
        parser.error("--target-flag, --draft-flag and --draft-down need --start")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    names = args.shapes.split(",")
    shapes = {name: SHAPES[name] for name in names
              if name not in ("adaptive", "auto-off", "probes")}
    with_adaptive = "adaptive" in names
    procs: list[subprocess.Popen] = []
    targets = {"": args.target}  # label -> address; the first stack's label is ""
    if args.start:
        procs, targets[""] = start_stack(args.draft_kind, args.models, args.device, args.dtype)
        if args.target_flag or args.draft_flag:
            label = " ".join([*(f"target {f}" for f in args.target_flag),
                              *(f"draft {f}" for f in args.draft_flag)])
            more, targets[label] = start_stack(
                args.draft_kind, args.models, args.device, args.dtype,
                target_args=args.target_flag, draft_extra=args.draft_flag)
            procs += more
    try:
        stubs = {}
        for label, address in targets.items():
            channel = wait_for_serving(address, 300, f"target {label}".strip(),
                                       alive=(lambda: all(p.poll() is None for p in procs))
                                       if procs else None)
            stubs[label] = target_pb2_grpc.TargetStub(channel)
        if args.draft_down:
            for draft in procs[::2]:  # each stack's draft, then its target
                draft.kill()
                draft.wait()
        prompts = load_prompts(args.prompts, args.models / "target", args.num_prompts,
                               args.prompt_len)
        modes: dict[str, tuple[int, int, int] | str | target_pb2.SpecPolicy | None] = {
            "OFF": None, **shapes}
        if "auto-off" in names:
            modes["auto-off"] = target_pb2.SpecPolicy()  # no entries: never speculate
        if "probes" in names:
            modes["probes"] = "probes"
        if with_adaptive:
            modes["adaptive"] = "adaptive"
        rates: dict[tuple[str, str], list[float]] = {(t, m): [] for t in stubs for m in modes}
        last: dict[tuple[str, str], RunStats] = {}
        records: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in modes} for t in stubs}
        warmups: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in modes} for t in stubs}
        num, topk, steps = SHAPES["tree"]
        tree = common_pb2.DraftShape(num_draft_tokens=num, topk=topk, num_steps=steps)
        policies = {label: AdaptivePolicy(adaptive_shapes("", tree)) for label in stubs}
        for round_ in range(args.warmup + args.repeats):
            timed = round_ >= args.warmup
            for name, shape in modes.items():  # interleaved, so drift hits all alike
                for label, stub in stubs.items():
                    # one policy per stack: it learns
                    run_shape = (policies[label] if shape == "adaptive" else
                                 Probes(tree) if shape == "probes" else shape)
                    stats = run_target(stub, prompts, args.max_new_tokens, run_shape,
                                       args.concurrency)
                    (records if timed else warmups)[label][name].append(run_record(stats))
                    if timed:
                        last[label, name] = stats
                        rates[label, name].append(stats.tokens_per_s)
            if args.out_json:  # after every round: a run cut short keeps the rounds before
                args.out_json.write_text(json.dumps({
                    "command": " ".join(sys.argv), "targets": targets, "runs": records,
                    "warmup_runs": warmups}, indent=1))
        for label, address in targets.items():
            print(f"target {address}{f' ({label})' if label else ''}, {len(prompts)} "
                  f"{args.prompts} prompts x {args.max_new_tokens} tokens, concurrency "
                  f"{args.concurrency}, {args.repeats} runs per mode"
                  + (f" after {args.warmup} untimed round(s)" if args.warmup else ""))
            for name in modes:
                ratio = statistics.median(on / off for on, off in zip(
                    rates[label, name], rates[label, "OFF"], strict=True))
                against = "" if not label else ", x{:.3f} vs the first stack's".format(
                    statistics.median(b / a for b, a in zip(
                        rates[label, name], rates["", name], strict=True)))
                stats = last[label, name]
                print(f"  {name:7s}: {statistics.median(rates[label, name]):8.1f} tok/s "
                      "(median of " + ", ".join(f"{r:.1f}" for r in rates[label, name])
                      + f"), x{ratio:.2f} vs OFF{against}"
                      + (f", accepted/verify step {stats.mean_accepted:.2f}, by depth "
                         + " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth)
                         if name != "OFF" else ""))
                for speculated in (True, False):
                    if part := breakdown(stats.steps, speculated):
                        print(f"           {'step' if speculated else 'plain step'}: {part}")
                print(f"           time (last run): {describe_split(time_split(stats.steps, stats.wall_s))}")
        if args.gateway:
            for name, mode in (("OFF", common_pb2.SPECULATION_MODE_OFF),
                               ("ON", common_pb2.SPECULATION_MODE_ON)):
                gw = [run_gateway(args.gateway, PROMPTS, args.max_new_tokens, mode)
                      for _ in range(args.repeats)]
                print(f"  gateway {name}: {statistics.median(gw):.1f} tok/s end to end")
    finally:
        for proc in procs:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
