"""The draft's host time per call, apart from the device: ``Drafter.draft`` for --seqs
sequences (each one committed token with its features, then an EAGLE-3 tree) on the CPU,
over the path a captured catch-up-and-search graph takes, with the graph's replay stubbed.

On the H200 the call's host work runs while the device is idle, so every microsecond of it
is a microsecond of the draft's step: at the 8B shape, 0.14-0.32 ms before the graph's launch
and 0.05-0.14 ms after the read-back, against a graph of 1.28 ms (docs/benchmarks.md,
twenty-fifth part; ``bench/device/draft_split.py``). This bench measures that work with no
device, where a change can be weighed before a GPU call.

The stand-in graph is the captured one less its device work: a real ``TablePrefix`` (its
table filled on the host), real ``ChainInputs`` (filled and copied), and a packed read-back
taken from one eager search of the same head, so the pick of the best tree has real
candidates. The head has random weights (the eager search needs some); ``--shape 8b`` is
the EAGLE-3 head of a Llama-3.1-8B-shaped target in bfloat16 (1.3 GB of memory).

    python bench/bench_draft_host.py                          # built-in shape, 5 repeats
    python bench/bench_draft_host.py --shape 8b --calls 2000 --out-json /tmp/draft_host.json
    python bench/bench_draft_host.py --seqs 64 --context 16   # a 64-sequence bucket
    python bench/bench_draft_host.py --profile                # cProfile of one repeat
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_step_costs import configs, random_module

from draft_service.drafter import Drafter, DrafterLimits, SeqInput, Session, TreeShape
from draft_service.models import Eagle3Draft
from draft_service.startup import warmup_inputs
from draft_service.tree_search import ChainInputs, GraphKey, TreeSearch, _Graph
from splitspec.attention import AttentionShape, make_backend
from splitspec.attention.decode_table import TablePrefix, prefix_attention_for
from splitspec.kv_cache import KVCache, PagePool
from splitspec.model.config import Eagle3Config
from splitspec.model.eagle3 import Eagle3Head
from splitspec.model.loader import parse_dtype

PAGE = 16


class StubGraph:
    """A captured graph's stand-in: replaying it does nothing but count."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def build(args: argparse.Namespace) -> tuple[Drafter, TreeShape, AttentionShape]:
    """A drafter over a random head whose search holds a stand-in catch-up graph of one
    sequence and the tree's shape; one sequence already prefilled (--context tokens)."""
    _, eagle_hf = configs(args.shape)
    cfg = Eagle3Config.from_hf(eagle_hf)
    dtype = parse_dtype(args.dtype)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head = random_module(head, dtype, "cpu")
    head.d2t.zero_()  # draft id i is target id i (as bench_step_costs.py)
    head.t2d.fill_(True)
    model = Eagle3Draft(head)
    layer = cfg.layer
    max_context = args.context + args.calls * (args.repeats + 1) + 64
    pages = 2 * -(-max_context // PAGE) * args.seqs
    cache = KVCache(1, pages, PAGE, layer.num_kv_heads, layer.head_dim, dtype, "cpu")
    shape = AttentionShape(layer.num_heads, layer.num_kv_heads, layer.head_dim, PAGE, dtype)
    backend = make_backend("torch", shape, "cpu")
    pool = PagePool(pages)
    search = TreeSearch(model, cache, prefix_attention_for(backend))
    limits = DrafterLimits(max_running=args.seqs, max_context=max_context, max_tree_nodes=64)
    drafter = Drafter(model, cache, pool, backend, limits, search)
    tree = TreeShape(args.tree_nodes, args.topk, args.depth)
    return drafter, tree, shape


def stand_in_graph(drafter: Drafter, session: Session, tree: TreeShape, shape: AttentionShape,
                   context: int, seqs: int) -> StubGraph:
    """Prefill sequences 1 .. seqs of session with context tokens each (eagerly), keep the
    search's packed candidates, and give the search a stand-in catch-up graph of that many
    sequences that "writes" them."""
    model, search = drafter.model, drafter.search
    read = TreeSearch._read
    packed: list[torch.Tensor] = []
    TreeSearch._read = staticmethod(lambda p: (packed.append(p.clone()), read(p))[1])
    try:
        generator = torch.Generator().manual_seed(0)
        drafter.draft(session, [warmup_inputs(model, seq, 0, list(range(seq, seq + context)),
                                              tree, generator) for seq in range(1, seqs + 1)])
    finally:
        TreeSearch._read = staticmethod(read)
    search.use_pad_page(drafter.pool.allocate(1)[0])
    width, k = tree.num_steps + 1, tree.topk
    max_context = drafter.limits.max_context
    prefix = TablePrefix(shape, "cpu", seqs, max(width, k), -(-max_context // PAGE))
    chain = ChainInputs(seqs, width, k, model.feature_dim, model.dtype, "cpu")
    roots = torch.zeros(seqs, model.state_width, dtype=model.dtype)
    graph = StubGraph()
    search.caught_up[GraphKey(seqs, k, tree.num_steps)] = _Graph(
        graph, prefix, roots, chain.chain.last, packed[-1], chain)
    search._buckets = (seqs,)
    return graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["8b", "builtin"], default="builtin")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 at 8b, float32 builtin")
    parser.add_argument("--context", type=int, default=512, help="tokens before the timed calls")
    parser.add_argument("--seqs", type=int, default=1, help="sequences a call (the bucket)")
    parser.add_argument("--tree-nodes", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="timed calls a repeat (each "
                        "commits a token, so the sequence grows by calls x repeats)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-us", type=float, default=0.0,
                        help="a sleep before each timed call, not timed: a served call comes "
                             "after its thread waited for the request, and host code runs "
                             "slower right after a wait than in a loop")
    parser.add_argument("--profile", action="store_true", help="cProfile one more repeat")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.shape == "8b" else "float32")
    torch.set_num_threads(1)
    with torch.inference_mode():
        drafter, tree, shape = build(args)
        session = drafter.open_session()
        graph = stand_in_graph(drafter, session, tree, shape, args.context, args.seqs)
        model = drafter.model
        generator = torch.Generator().manual_seed(1)
        start = args.context

        def calls(n: int) -> list[list[SeqInput]]:  # a committed token a sequence, with features
            nonlocal start
            items = [[warmup_inputs(model, seq, start + i, [(start + i) % model.vocab_size], tree,
                                    generator) for seq in range(1, args.seqs + 1)]
                     for i in range(n)]
            start += n
            return items

        per_call = []
        for _ in range(args.repeats):
            items = calls(args.calls)
            took = 0.0
            for item in items:
                if args.idle_us:
                    time.sleep(args.idle_us / 1e6)  # (untimed)
                began = time.perf_counter()
                results = drafter.draft(session, item)
                took += time.perf_counter() - began
            per_call.append(1e6 * took / args.calls)
            for result in results:  # the last call's, one a sequence
                if result.error or result.tree.num_nodes != args.tree_nodes:
                    raise RuntimeError(f"drafting failed: {result.error or result.tree}")
            if graph.replays != len(per_call) * args.calls:  # else it timed the eager path
                raise RuntimeError(f"{graph.replays} of {len(per_call) * args.calls} calls "
                                   "took the stand-in graph")
            print(f"{args.calls} calls: {per_call[-1]:.1f} us a call", flush=True)
        if args.profile:
            items = calls(args.calls)
            profiler = cProfile.Profile()
            profiler.enable()
            for item in items:
                drafter.draft(session, item)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    runs = ", ".join(f"{t:.1f}" for t in per_call)
    idle = f", each after an untimed {args.idle_us:g} us sleep" if args.idle_us else ""
    print(f"draft call host work, {args.shape} shape, {args.seqs} sequence(s), {tree}{idle}: "
          f"median {statistics.median(per_call):.1f} us ({runs})")
    if args.out_json:
        args.out_json.write_text(json.dumps({"command": " ".join(sys.argv), "shape": args.shape,
                                             "seqs": args.seqs, "us_per_call": per_call},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
