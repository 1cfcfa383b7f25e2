"""The draft's top k with log-probabilities: torch's log_softmax + topk against
splitspec/kernels/top_logprobs.py (CUDA).

For each vocabulary size (--vocab; 32000 is the EAGLE-3 heads' for Llama-3.1-8B, 128256
Llama-3's own), each row count (--rows: a tree level is topk rows a sequence) and each k:
bf16 logits as the head's lm_head leaves them, one CUDA graph of --calls calls on as many
copies of them, the replays queued back to back and timed with CUDA events; the median of
--repeats timings per call. Variants: ``torch`` (the cast to float32, log_softmax, topk: what
the tree search ran before) and the kernels for each --blocks x --warps. Each kernel's
tokens must equal a stable descending sort's and its log-probabilities torch's (to 2e-6),
or the script fails. At the end: the fastest config per shape, its speed-up over torch.

    python bench/bench_top_logprobs.py --out-json /tmp/top.json

``--device cpu`` runs it on CPU (TRITON_INTERPRET=1, eager calls timed on the host): a
check of the script, not a measurement (tests/test_gpu_benches.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from graph_timing import graph_of, time_graph
from graph_timing import parse_ints as ints

from splitspec.kernels.top_logprobs import top_logprobs_kernels, top_logprobs_torch


def check(logits: torch.Tensor, k: int, got: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    lp, ids = got
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    if not torch.equal(ids, order):
        raise AssertionError(f"{what}: tokens differ from a stable sort's")
    want = torch.log_softmax(logits.float(), dim=-1).gather(1, ids)
    torch.testing.assert_close(lp, want, rtol=0, atol=2e-6, msg=what)


def timed(calls: Callable[[], None], args: argparse.Namespace) -> float:
    """Milliseconds per call: a graph of them on CUDA, eager on the host otherwise."""
    if args.device == "cuda":
        return time_graph(graph_of(calls), args.replays, args.repeats) / args.calls
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        calls()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) / args.calls


def run(args: argparse.Namespace) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            copies = [(torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
                      .to(args.device) for _ in range(args.calls)]
            for k in args.k:
                variants: dict[str, Callable[[torch.Tensor], object]] = {
                    "torch": lambda x, k=k: top_logprobs_torch(x, k)}
                for block in args.blocks:
                    for warps in args.warps:
                        variants[f"b{block} w{warps}"] = (
                            lambda x, k=k, b=block, w=warps: top_logprobs_kernels(x, k, b, w))
                for name, fn in variants.items():
                    if name != "torch":
                        check(copies[0], k, fn(copies[0]), f"{name} V={vocab} rows={rows} k={k}")
                    ms = timed(lambda fn=fn, xs=copies: [fn(x) for x in xs], args)
                    result = {"vocab": vocab, "rows": rows, "k": k, "variant": name,
                              "us_per_call": ms * 1e3}
                    results.append(result)
                    print(f"V={vocab:<7} rows {rows:>3} k {k:>2} {name:<12} "
                          f"{result['us_per_call']:8.2f} us", flush=True)
    return results


def best(results: list[dict]) -> list[str]:
    lines = []
    shapes = sorted({(r["vocab"], r["rows"], r["k"]) for r in results})
    for vocab, rows, k in shapes:
        here = [r for r in results if (r["vocab"], r["rows"], r["k"]) == (vocab, rows, k)]
        torch_us = next(r["us_per_call"] for r in here if r["variant"] == "torch")
        top = min((r for r in here if r["variant"] != "torch"), key=lambda r: r["us_per_call"])
        lines.append(f"V={vocab:<7} rows {rows:>3} k {k:>2}: torch {torch_us:8.2f} us, best "
                     f"{top['variant']:<12} {top['us_per_call']:8.2f} us: "
                     f"{torch_us / top['us_per_call']:.2f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=ints, default=[32000, 128256])
    parser.add_argument("--rows", type=ints, default=[1, 4, 16, 64])
    parser.add_argument("--k", type=ints, default=[4, 8])
    parser.add_argument("--blocks", type=ints, default=[1024, 2048, 4096])
    parser.add_argument("--warps", type=ints, default=[4, 8])
    parser.add_argument("--calls", type=int, default=16, help="calls a graph (copies of logits)")
    parser.add_argument("--replays", type=int, default=20, help="graph replays a timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings (the median is kept)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (--device cpu checks the script)")
    bad = [b for b in args.blocks if b < 16 or b & (b - 1)]
    if bad or min(args.calls, args.replays, args.repeats) < 1:
        parser.error(f"--blocks must be powers of two of at least 16 (got {bad}); --calls, "
                     "--replays and --repeats at least 1")
    results = run(args)
    print("\nbest per shape:")
    for line in best(results):
        print(line)
    if args.out_json:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        args.out_json.write_text(json.dumps({"command": " ".join(sys.argv), "device": device,
                                             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
