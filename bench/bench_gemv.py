"""Batch-1 projections at the 8B shape: torch's linear against splitspec/kernels/gemv.py (CUDA).

For each projection of a Llama-3.1-8B-shaped step (qkv, o_proj, gate_up, down: the
fused weights the model multiplies by; lm_head), one CUDA graph of a call per layer, each
on its own copy of the weight (32 copies; 4 of lm_head), so that no call finds its weight
in L2, as none does in a real step; the replays are queued back to back and timed with
CUDA events. Per call: the median time over --repeats timings, its share of the
weight-read rate (4.5 TB/s, bench_decode_floor.py), and the largest difference from
torch's output in units of the output's bf16 rounding step. Variants: ``torch``
(``nn.functional.linear``, cuBLAS) and the Triton kernel for each config of the grid
(--block-n x --block-k x --warps).

    python bench/bench_gemv.py --out-json /tmp/gemv.json

``--device cpu --shrink 64`` runs it on CPU (the kernel in Triton's interpreter, with
TRITON_INTERPRET=1; every dimension divided by 64, two copies, eager calls timed on the
host): a check of the script, not a measurement (tests/test_gpu_benches.py).
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
from bench_decode_attention import parse_ints as ints
from bench_decode_attention import time_graph

from splitspec.kernels.gemv import GemvConfig, gemv

BANDWIDTH_TB_S = 4.5  # as bench_decode_floor.py
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256
SHAPES = {  # name: (N, K, copies)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 32),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM, 32),
    "gate_up": (2 * INTER, HIDDEN, 32),
    "down": (HIDDEN, INTER, 32),
    "lm_head": (VOCAB, HIDDEN, 4),
}
QUEUED = 10  # replays a timing


def graph_of(calls: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def time_eager(calls: Callable[[], None], repeats: int) -> list[float]:
    """ms per call of ``calls`` on the host (CPU runs: a check, not a measurement)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls()
        times.append(1000 * (time.perf_counter() - start))
    return times


def measure(name: str, configs: list[GemvConfig], repeats: int, device: str, shrink: int
            ) -> list[dict]:
    n, k, copies = SHAPES[name]
    if shrink > 1:
        n, k, copies = n // shrink, k // shrink, 2
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) / k ** 0.5
               for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=gen)
    want = torch.nn.functional.linear(x, weights[0])
    step = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-2)
    variants: list[tuple[str, GemvConfig | None]] = [("torch", None)]
    variants += [(f"triton n{c.block_n} k{c.block_k} w{c.num_warps}", c) for c in configs]
    rows = []
    for label, config in variants:
        def one(w: torch.Tensor, config: GemvConfig | None = config) -> torch.Tensor:
            return torch.nn.functional.linear(x, w) if config is None else gemv(x, w, config)

        def calls(one: Callable[[torch.Tensor], torch.Tensor] = one) -> None:
            for w in weights:  # outputs left in the graph's pool: no copy kernel timed
                one(w)

        if device == "cuda":
            ms = time_graph(graph_of(calls), QUEUED, repeats) / copies
        else:
            calls()  # compiles (or interprets) once before the timings
            ms = statistics.median(time_eager(calls, repeats)) / copies
        diff = float(((one(weights[0]).float() - want.float()).abs() / step).max())
        share = n * k * 2 / (ms * 1e-3) / (BANDWIDTH_TB_S * 1e12)
        rows.append({"shape": name, "n": n, "k": k, "variant": label,
                     "config": None if config is None else config._asdict(),
                     "us_per_call": 1000 * ms, "share_of_bandwidth": share,
                     "max_diff_steps": diff})
        print(f"{name:8s} {label:24s} {1000 * ms:8.2f} us  {share:5.3f} of 4.5 TB/s  "
              f"max diff {diff:.1f} steps", flush=True)
    return rows


def best_of(rows: list[dict], name: str) -> tuple[dict, dict]:
    """One shape's torch row and its fastest Triton row."""
    mine = [r for r in rows if r["shape"] == name]
    return (next(r for r in mine if r["variant"] == "torch"),
            min((r for r in mine if r["config"]), key=lambda r: r["us_per_call"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    parser.add_argument("--block-n", type=ints, default=[4, 8, 16, 32])
    parser.add_argument("--block-k", type=ints, default=[256, 512, 1024])
    parser.add_argument("--warps", type=ints, default=[4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shrink", type=int, default=1, help="divide every dimension by this "
                        "(and keep two copies of each weight): for a check on CPU")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: bench_gemv measures on one (--device cpu only checks the script)",
              file=sys.stderr)
        return 2
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
    configs = [GemvConfig(bn, bk, w) for bn in args.block_n for bk in args.block_k
               for w in args.warps]
    rows = []
    with torch.inference_mode():
        for name in shapes:
            rows += measure(name, configs, args.repeats, args.device, args.shrink)
            if args.device == "cuda":
                torch.cuda.empty_cache()  # this shape's weights
    print("\nbest per shape:")
    best = {name: best_of(rows, name) for name in shapes}
    for name, (torch_row, row) in best.items():
        print(f"{name:8s} torch {torch_row['us_per_call']:7.2f} us "
              f"({torch_row['share_of_bandwidth']:.3f}), best {row['variant']} "
              f"{row['us_per_call']:7.2f} us ({row['share_of_bandwidth']:.3f}): "
              f"{torch_row['us_per_call'] / row['us_per_call']:.3f}x")
    print("\nsplitspec/kernels/gemv.py CONFIGS: each shape's best config, None where torch won:")
    for name, (torch_row, row) in best.items():
        c = row["config"]
        config = (f"GemvConfig({c['block_n']}, {c['block_k']}, {c['num_warps']})"
                  if row["us_per_call"] < torch_row["us_per_call"] else "None")
        print(f"    ({row['n']}, {row['k']}): {config},  # {name}")
    if args.out_json:
        args.out_json.write_text(json.dumps({"command": " ".join(sys.argv),
                                             "device": torch.cuda.get_device_name()
                                             if args.device == "cuda" else "cpu",
                                             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
