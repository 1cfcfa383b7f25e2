"""What the target-draft Exchange stream costs per step, apart from drafting.

A stand-in draft (a real gRPC server in its own process, the project's channel options)
answers each DraftRequest with an 8-node tree after ``--draft-ms`` of busy work (its
drafting); the target's side is the real ``target_service.draft_client.DraftLink``, which
does ``--target-ms`` of busy work (its verify forward and bookkeeping) before each
exchange. Each request carries ``--feature-bytes`` of hidden states, as the target's
catch-up does: on the stream, or through the target's shared memory (``--via memory``: the
link's FeatureRing, which the stand-in reads the way the draft service does), or so and
the requests after the first and their replies through a mailbox (``--via mailbox``: the
target's ``--exchange-memory``, splitspec/mailbox.py). Reported per setting: the median of
the exchange's wall time less the draft's work (the transit), and its two halves, timed
across the processes with the wall clock: target to draft (the request queued until the
draft's handler has it) and back (the reply built until ``exchange`` returns it).

With no work on either side the two processes ping-pong on warm cores; with work, each
waits idle while the other computes, as the services do at batch 1, and every hop wakes
a sleeping thread.

    python bench/bench_exchange.py                       # 0/0 ms and 9/10 ms, 2 repeats
    python bench/bench_exchange.py --work 0:0,2:5 --steps 500 --out-json /tmp/exchange.json
    python bench/bench_exchange.py --work 0:0 --feature-bytes 1336934 --via stream,memory
    python bench/bench_exchange.py --work 0:0,2:5 --steps 400 --via stream,mailbox
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
from bench_speculation import free_port

from draft_service.servicer import seq_input_from_pb
from splitspec.feature_memory import FeatureMap
from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.mailbox import ExchangeRequests
from splitspec.v1 import draft_pb2, draft_pb2_grpc
from target_service.draft_client import DraftLink, Features

TREE = draft_pb2.DraftTree(seq_id=1, tokens=list(range(8)), parents=[0, 1, 1, 2, 2, 3, 4, 5])


def busy(seconds: float) -> None:
    """Hold the core (and the GIL) for ``seconds``, as a CPU forward does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandInDraft(draft_pb2_grpc.DraftServicer):
    """Replies after ``work_s`` of busy work; the reply's draft_s is that work, and the
    tree's error field carries the wall-clock times the request arrived and the reply left
    (the target's side reads them back)."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    def AttachFeatureMemory(self, request, context):
        FeatureMap(request.path).close()  # (no error handling: the run fails if it cannot)
        return draft_pb2.AttachFeatureMemoryReply()

    def Exchange(self, request_iterator, context):
        memory = None
        requests = ExchangeRequests(request_iterator, lambda: not context.is_active())
        for request in requests:
            arrived = time.time()
            if request.feature_memory and memory is None:
                memory = FeatureMap(request.feature_memory)
            for item in request.seqs:  # the features as the drafter gets them
                seq_input_from_pb(item, memory)
            busy(self.work_s)
            tree = draft_pb2.DraftTree()
            tree.CopyFrom(TREE)
            reply = draft_pb2.DraftReply(step=request.step, trees=[tree],
                                         draft_s=time.time() - arrived)
            reply.trees[0].error = f"{arrived!r} {time.time()!r}"
            if (on_stream := requests.answer(reply)) is not None:
                yield on_stream
        requests.close()


def serve(port: int, work_s: float, ready: mp.Event) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    draft_pb2_grpc.add_DraftServicer_to_server(StandInDraft(work_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def measure(draft_ms: float, target_ms: float, steps: int, feature_bytes: int,
            via: str = "stream") -> dict:
    """One stand-in draft process and ``steps`` exchanges through a DraftLink (the first
    tenth not counted), the features on the stream or (``via`` "memory", "mailbox") in
    shared memory, and with "mailbox" the exchange through a mailbox."""
    port = free_port()
    ready = mp.Event()
    draft = mp.Process(target=serve, args=(port, draft_ms / 1000, ready), daemon=True)
    draft.start()
    if not ready.wait(30):
        raise RuntimeError("the stand-in draft did not start within 30 s")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    memory = 4 * feature_bytes + (1 << 20) if via in ("memory", "mailbox") else 0
    link = DraftLink(f"127.0.0.1:{port}", channel,
                     draft_pb2.DraftInfo(needs_hidden_states=bool(feature_bytes)),
                     timeout_s=5.0, feature_memory_bytes=memory,
                     exchange_memory=via == "mailbox")
    if bool(link.feature_memory) != bool(memory and feature_bytes):
        raise RuntimeError(f"the features would not go {via}")
    if bool(link.mailbox) != (via == "mailbox"):
        raise RuntimeError("no mailbox for the exchange (the log says why)")
    features = Features(np.zeros((1, feature_bytes), np.uint8), [1], feature_bytes // 2,
                        "bfloat16")
    transit, out, back = [], [], []
    try:
        for step in range(steps):
            busy(target_ms / 1000)
            request = draft_pb2.DraftRequest(step=step, seqs=[draft_pb2.SeqDraftInput(
                seq_id=1, start=step, new_tokens=[1, 2, 3])])
            sent = time.time()
            start = time.perf_counter()
            result = link.receive(link.send(request, features if feature_bytes else None))
            wall = time.perf_counter() - start
            received = time.time()
            if result.reply is None:
                raise RuntimeError(f"exchange {step} failed: {result.error}")
            arrived, left = map(float, result.reply.trees[0].error.split())
            if step >= steps // 10:
                transit.append(wall - result.reply.draft_s)
                out.append(arrived - sent)
                back.append(received - left)
    finally:
        link.close()
        draft.terminate()
        draft.join(10)
    return {"draft_ms": draft_ms, "target_ms": target_ms, "feature_bytes": feature_bytes,
            "via": via,
            "steps": len(transit), "transit_ms": 1000 * statistics.median(transit),
            "to_draft_ms": 1000 * statistics.median(out),
            "back_ms": 1000 * statistics.median(back)}


def parse_work(text: str) -> list[tuple[float, float]]:
    pairs = []
    for item in text.split(","):
        draft, _, target = item.partition(":")
        try:
            pair = (float(draft), float(target))
        except ValueError:
            raise argparse.ArgumentTypeError(f"need DRAFT_MS:TARGET_MS pairs, got {item!r}") from None
        if min(pair) < 0:
            raise argparse.ArgumentTypeError(f"work must be >= 0 ms, got {item!r}")
        pairs.append(pair)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=parse_work, default=parse_work("0:0,9:10"),
                        help="DRAFT_MS:TARGET_MS pairs: busy work on each side per step")
    parser.add_argument("--steps", type=int, default=300, help="exchanges per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting, interleaved")
    parser.add_argument("--feature-bytes", type=int, default=12288,
                        help="hidden-state bytes per request (3 captured layers, 4 tokens, "
                             "hidden 256, float32: the built-in pair's catch-up)")
    parser.add_argument("--via", default="stream",
                        help="comma-separated: how the features travel, stream, memory (the "
                             "target's shared memory) and/or mailbox (so, and the exchange "
                             "through a mailbox), interleaved in each repeat")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    if args.steps < 10 or args.repeats < 1:
        parser.error("need --steps >= 10 and --repeats >= 1")
    vias = args.via.split(",")
    if not set(vias) <= {"stream", "memory", "mailbox"}:
        parser.error(f"--via takes stream, memory and/or mailbox, got {args.via!r}")
    runs = []
    for repeat in range(args.repeats):
        for (draft_ms, target_ms), via in ((work, via) for work in args.work for via in vias):
            run = measure(draft_ms, target_ms, args.steps, args.feature_bytes, via)
            run["repeat"] = repeat
            runs.append(run)
            print(f"draft {draft_ms:g} ms, target {target_ms:g} ms, features {via}: transit "
                  f"{run['transit_ms']:.3f} ms (to the draft {run['to_draft_ms']:.3f}, back "
                  f"{run['back_ms']:.3f})", flush=True)
    if args.out_json:
        args.out_json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
