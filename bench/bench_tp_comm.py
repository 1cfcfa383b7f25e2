"""What tensor parallelism adds to a step: the model's collectives and rank 0's broadcast.

Two ranks (NCCL on GPUs, gloo on CPU) time, per decode step of a model with
--layers layers, the 2 * layers + 2 all-reduces of one token's hidden state
(batch 1, bf16 on GPUs): replayed from a CUDA graph and run eagerly; and rank
0's announcement of a decode step's forward over the gloo control group (batch
1 and 32, 40 pages a sequence), both as target_service/calls.py packs it and
pickled by broadcast_object_list, as it was before. The numbers to set beside
bench_tp.py's step times.

    python bench/bench_tp_comm.py --device cuda --out-json /tmp/comm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from graph_timing import graph_of

from splitspec.attention.base import SeqAttention
from splitspec.kv_cache import PageTable
from target_service.calls import CallChannel, ForwardBatch
from target_service.ranks import free_address


def decode_step(batch: int, pages: int = 40, page_size: int = 16) -> ForwardBatch:
    """The forward of a plain decode step: one token per sequence, each 600 tokens long."""
    attn = [SeqAttention(PageTable(page_size, list(range(i * pages, (i + 1) * pages)), 600),
                         kv_len=600, q_len=1) for i in range(batch)]
    return ForwardBatch(torch.arange(batch), torch.full((batch,), 599), attn, list(range(batch)),
                        (2, 16, 29))


def timed(fn: object, iters: int, sync: object) -> float:
    """Milliseconds per call of fn, after a warm-up, on every rank at once."""
    for _ in range(max(iters // 10, 1)):
        fn()
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return 1000 * (time.perf_counter() - started) / iters


def rank_main(rank: int, args: argparse.Namespace, address: str, out: Path) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}",
                            rank=rank, world_size=2)
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    hidden = torch.randn(1, args.hidden, dtype=torch.bfloat16 if cuda else torch.float32,
                         device=args.device)
    count = 2 * args.layers + 2  # o_proj and down_proj per layer, the embedding, the logits

    def step() -> None:
        for _ in range(count):
            dist.all_reduce(hidden)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=control)

    result = {"all_reduces_per_step": count}
    step()  # the communicator's first use, outside any capture
    sync()
    if cuda:
        graph = graph_of(step)
        result["graph_step_ms"] = timed(graph.replay, args.iters, sync)
    result["eager_step_ms"] = timed(step, args.iters, sync)
    channel = CallChannel(control)
    for batch in (1, 32):
        call = decode_step(batch)

        def pickled(call: ForwardBatch = call) -> None:
            box = [("forward", call) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=control)

        def packed(call: ForwardBatch = call) -> None:
            if rank == 0:
                channel.send("forward", call)
            else:
                channel.receive()

        result[f"pickled_call_ms_batch{batch}"] = timed(pickled, args.iters, sync)
        result[f"packed_call_ms_batch{batch}"] = timed(packed, args.iters, sync)
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=32, help="Llama-3.1-8B: 32")
    parser.add_argument("--hidden", type=int, default=4096, help="Llama-3.1-8B: 4096")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs")
    with tempfile.TemporaryDirectory() as folder:
        rank0 = Path(folder) / "rank0.json"
        mp.spawn(rank_main, args=(args, free_address(), rank0), nprocs=2)
        measured = json.loads(rank0.read_text())
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), **measured}
    print(json.dumps(result, indent=1))
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
