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

    python bench/bench_engine_host.py                      # batch 1, 8, 64; 3 repeats
    python bench/bench_engine_host.py --batch 1,64 --steps 400 --out-json /tmp/host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graph_timing import parse_ints

from splitspec.kv_cache import KVCache, PagePool
from splitspec.v1 import common_pb2, draft_pb2, target_pb2
from target_service.draft_client import ExchangeResult, Sent
from target_service.engine import Engine, EngineLimits
from target_service.runner import ModelRunner
from target_service.scheduler import Scheduler

PAGE = 16
VOCAB = 64
FEATURES = 768  # the built-in target's three captured layers of 256
TREE = common_pb2.DraftShape(num_draft_tokens=4, topk=2, num_steps=2)
MAX_TREE_NODES = 8  # the scheduler reserves room for the largest tree
MODES = ("off", "auto-off", "tree")


class StandInRunner:
    """Logits whose argmax is 0 for every row; a one-layer cache that keeps features."""

    device = "cpu"
    last_graphed = True
    copy_slots = ModelRunner.copy_slots
    read_features = ModelRunner.read_features

    def __init__(self, num_pages: int) -> None:
        self.cache = KVCache(1, num_pages, PAGE, 1, 8, torch.bfloat16, "cpu")
        self.cache.hold_features(FEATURES, torch.bfloat16)
        self._logits = torch.zeros(4096, VOCAB)
        self._logits[:, 0] = 1.0

    def forward(self, batch: object) -> torch.Tensor:
        return self._logits[:len(batch.logit_rows)]

    def stop(self) -> None:
        pass


class StandInDraft:
    """Answers at once, for every sequence, with a tree whose root has children 5 and 0, and
    0's children 0 and 5: the argmax (0) accepts nodes 2 and 3, which the compaction moves."""

    def __init__(self) -> None:
        self._replies: list[draft_pb2.DraftReply] = []

    def send(self, request: draft_pb2.DraftRequest) -> Sent:
        self._replies.append(draft_pb2.DraftReply(step=request.step, trees=[
            draft_pb2.DraftTree(seq_id=s.seq_id, tokens=[5, 0, 0, 5], parents=[0, 0, 2, 2])
            for s in request.seqs]))
        return Sent(request.step, time.monotonic() + 60, "", False)

    def receive(self, sent: Sent) -> ExchangeResult:
        return ExchangeResult(self._replies.pop(0), "", False)

    def exchange(self, request: draft_pb2.DraftRequest) -> ExchangeResult:
        return self.receive(self.send(request))


def host_us_per_step(mode: str, batch: int, steps: int, prompt_len: int = 64) -> float:
    """Median microseconds of ``Engine.step`` over ``steps`` decode steps of ``batch``
    sequences (the prompts' step and the first decode step are not timed)."""
    new_tokens = (steps + 2) * (3 if mode == "tree" else 1)
    per_seq = -(-(prompt_len + new_tokens + MAX_TREE_NODES + 1) // PAGE)
    runner = StandInRunner(batch * per_seq)
    limits = EngineLimits(VOCAB, prompt_len + new_tokens + MAX_TREE_NODES, batch * prompt_len,
                          MAX_TREE_NODES, TREE, frozenset())
    engine = Engine(runner, Scheduler(PagePool(runner.cache.num_pages), batch, MAX_TREE_NODES),
                    limits,
                    StandInDraft(), (2, 3, 4))
    stream, _ = engine.open_stream()
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
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    last = engine.last_stats
    if last.batch_size != batch or last.speculated != (mode == "tree"):
        raise RuntimeError(f"{mode}: the last step decoded {last.batch_size} sequences (not "
                           f"{batch}), speculated: {last.speculated}")
    if mode == "tree" and last.accepted_tokens != 2 * batch:
        raise RuntimeError(f"tree: {last.accepted_tokens} nodes accepted, not 2 a sequence")
    return 1e6 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=parse_ints, default=[1, 8, 64], help="batch sizes")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {MODES}")
    parser.add_argument("--steps", type=int, default=300, help="timed steps a run")
    parser.add_argument("--repeats", type=int, default=3, help="runs a setting, alternated")
    parser.add_argument("--out-json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {MODES}")
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {f"{m} {b}": [] for b in args.batch for m in modes}
    for _ in range(args.repeats):
        for batch in args.batch:
            for mode in modes:  # alternated, so drift hits all alike
                runs[f"{mode} {batch}"].append(host_us_per_step(mode, batch, args.steps))
    print(f"Engine.step host time, stand-in model, {args.steps} steps a run, median of "
          f"{args.repeats} runs (us a step; us a sequence)")
    for batch in args.batch:
        base = statistics.median(runs[f"{modes[0]} {batch}"])
        for mode in modes:
            us = statistics.median(runs[f"{mode} {batch}"])
            print(f"  batch {batch:3d} {mode:8s}: {us:8.1f} us ({us / batch:6.1f} a sequence), "
                  f"{us - base:+7.1f} vs {modes[0]}; runs " + ", ".join(
                      f"{r:.1f}" for r in runs[f"{mode} {batch}"]))
    if args.out_json:
        args.out_json.write_text(json.dumps({"steps": args.steps, "runs_us": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
