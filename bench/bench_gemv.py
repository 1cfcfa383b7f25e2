"""Projections of one row and of a few: torch's linear against splitspec/kernels/gemv.py (CUDA).

For each projection shape (by default a Llama-3.1-8B-shaped step's: qkv, o_proj, gate_up,
down, the fused weights the model multiplies by, and lm_head; and its EAGLE-3 head's
draft_qkv, draft_fc, draft_lm_head; or ``--model DIR``'s, or ``--shape NAME=N,K``) and each
row count of ``--rows``: one CUDA graph of a call per copy of the weight (up to 32 copies,
so that no call finds its weight in L2, as none does in a real step); the replays are queued
back to back and timed with CUDA events. Per call: the median time over --repeats timings,
its share of the weight-read rate (4.5 TB/s, bench_decode_floor.py), and the largest
difference from torch's output in units of the output's bf16 rounding step. Variants:
``torch`` (``nn.functional.linear``, cuBLAS) and the Triton kernel for each config of the
grid (--block-n x --block-k x --warps x --stages): ``gemv`` at one row, ``few_rows`` at more.
At the end it prints the CONFIGS and ROW_CONFIGS lines for gemv.py. ``--fp8`` also times
``fp8_rows`` (the weight in fp8, a byte each: its share counts one byte a weight; its
difference is from its own rounded weight's product) over the grid and ``--split-k``, and
prints the FP8_CONFIGS lines.

    python bench/bench_gemv.py --out-json /tmp/gemv.json
    python bench/bench_gemv.py --rows 4,9,16 --shapes qkv,o_proj,gate_up,down
    python bench/bench_gemv.py --fp8 --skip-bf16 --rows 4 --split-k 1,2,4 \
        --shapes draft_qkv,o_proj,gate_up,down,draft_fc,draft_lm_head

``--device cpu --shrink 64`` runs it on CPU (the kernel in Triton's interpreter, with
TRITON_INTERPRET=1; every dimension divided by 64, two copies, eager calls timed on the
host): a check of the script, not a measurement (tests/test_gpu_benches.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from graph_timing import graph_of, time_graph
from graph_timing import parse_ints as ints

from splitspec.kernels import fp8_linear_torch, quantize_fp8
from splitspec.kernels.gemv import (
    MAX_ROWS,
    SHARED_BYTES,
    GemvConfig,
    few_rows,
    fp8_rows,
    fp8_shared_bytes,
    gemv,
    padded_rows,
)
from splitspec.model.config import (
    EAGLE3_ARCHITECTURES,
    Eagle3Config,
    LlamaConfig,
    read_hf_config,
)

BANDWIDTH_TB_S = 4.5  # as bench_decode_floor.py
COPIES_BYTES = 8e9  # each shape's weight copies, at most (and at most 32 copies)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256
DRAFT_VOCAB = 32000  # the EAGLE-3 heads published for Llama-3.1-8B (REFERENCE.md)
SHAPES = {  # name: (N, K)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
    # the head's layer reads [embedding | hidden] (2H); fc fuses three target features (3H);
    # its o_proj, gate_up and down are the target's shapes
    "draft_qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, 2 * HIDDEN),
    "draft_fc": (HIDDEN, 3 * HIDDEN),
    "draft_lm_head": (DRAFT_VOCAB, HIDDEN),
}
ONE_ROW_GRID = ([4, 8, 16, 32], [256, 512, 1024], [4, 8], [3])  # block_n, block_k, warps, stages
ROWS_GRID = ([16, 32, 64], [64, 128, 256], [4, 8], [3, 4])  # few_rows: tl.dot's tiles, >= 16
QUEUED = 10  # replays a timing


def copies_of(n: int, k: int) -> int:
    """Copies of an [N, K] bf16 weight a graph cycles through: 32 (the 8B's layers), fewer
    where 32 would pass 8 GB (7 of lm_head), at least 2. Each copy is read once a cycle, so
    none stays in the 50 MB L2 unless all of them fit there (shapes far below the 8B's)."""
    return max(2, min(32, int(COPIES_BYTES // (n * k * 2))))


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """The projections a checkpoint's model multiplies by (fused q/k/v and gate/up), named
    after the checkpoint's folder: a Llama target's or an EAGLE-3 head's."""
    raw = read_hf_config(model_dir)
    head = (Eagle3Config.from_hf(raw)
            if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or []) else None)
    cfg = head.layer if head else LlamaConfig.from_hf(raw)
    h = cfg.hidden_size
    shapes = {
        "qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, 2 * h if head else h),
        "o_proj": (h, cfg.num_heads * cfg.head_dim),
        "gate_up": (2 * cfg.intermediate_size, h),
        "down": (h, cfg.intermediate_size),
    }
    if head:  # its layer reads [embedding | hidden]; fc fuses three target features
        shapes |= {"fc": (h, 3 * head.target_hidden_size), "lm_head": (head.draft_vocab_size, h)}
    else:
        shapes["lm_head"] = (cfg.vocab_size, h)
    return {f"{Path(model_dir).name}_{name}": shape for name, shape in shapes.items()}


def parse_shape(text: str) -> tuple[str, tuple[int, int]]:
    found = re.fullmatch(r"([\w.-]+)=([1-9]\d*),([1-9]\d*)", text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"need NAME=N,K with positive N and K, got {text!r}")
    return found[1], (int(found[2]), int(found[3]))


def time_eager(calls: Callable[[], None], repeats: int) -> list[float]:
    """ms per call of ``calls`` on the host (CPU runs: a check, not a measurement)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls()
        times.append(1000 * (time.perf_counter() - start))
    return times


def label_of(config: GemvConfig) -> str:
    split = f" split{config.split_k}" if config.split_k != 1 else ""
    return (f"triton n{config.block_n} k{config.block_k} w{config.num_warps} "
            f"s{config.num_stages}{split}")


def measure(name: str, shape: tuple[int, int], rows: int, configs: list[GemvConfig],
            repeats: int, device: str, shrink: int, fp8_splits: tuple[int, ...] = (),
            bf16: bool = True) -> list[dict]:
    """Torch's linear, the bfloat16 kernels over ``configs`` (unless not ``bf16``) and
    fp8_rows over ``configs`` times ``fp8_splits`` (its split_k values; none: not timed)."""
    n, k = shape
    copies = copies_of(n, k)
    if shrink > 1:
        n, k, copies = max(1, n // shrink), max(1, k // shrink), 2
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) / k ** 0.5
               for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
    want = torch.nn.functional.linear(x, weights[0])
    kernel = gemv if rows == 1 else few_rows
    variants: list[tuple[str, GemvConfig | None, bool]] = [("torch", None, False)]
    variants += [(label_of(c), c, False) for c in configs if bf16]
    # configs over a block's shared memory would fail at launch (fp8_rows would cut their
    # stages: those are other configs' times)
    fits = [c for c in configs if min(c.block_n, c.block_k) >= 16
            and fp8_shared_bytes(c, rows) <= SHARED_BYTES] if fp8_splits else []
    if fp8_splits and len(fits) < len(configs):
        print(f"{name:14s} rows {rows:2d} fp8: {len(configs) - len(fits)} configs left out "
              f"(blocks under 16, or over {SHARED_BYTES} B of shared memory)", flush=True)
    variants += [(label_of(c._replace(split_k=split)).replace("triton", "fp8"),
                  c._replace(split_k=split), True) for c in fits for split in fp8_splits]
    quantized = [quantize_fp8(w) for w in weights] if fp8_splits else []
    if fp8_splits:  # the fp8 variants are compared with the product of their own rounded weights
        want_fp8 = fp8_linear_torch(x, quantized[0])
        quant_error = float((want_fp8.float() - want.float()).norm() / want.float().norm())
    results = []
    for label, config, in_fp8 in variants:
        reference = want_fp8 if in_fp8 else want
        step = torch.finfo(torch.bfloat16).eps * reference.float().abs().clamp_min(1e-2)

        def one(i: int, config: GemvConfig | None = config, in_fp8: bool = in_fp8
                ) -> torch.Tensor:
            if in_fp8:
                return fp8_rows(x, quantized[i], config)
            if config is None:
                return torch.nn.functional.linear(x, weights[i])
            return kernel(x, weights[i], config)

        def calls(one: Callable[[int], torch.Tensor] = one) -> None:
            for i in range(len(weights)):  # outputs left in the graph's pool: no copy timed
                one(i)

        if device == "cuda":
            graph = graph_of(calls)
            graph.replay()  # the first replay uploads the graph: not timed
            ms = time_graph(graph, QUEUED, repeats) / copies
        else:
            calls()  # compiles (or interprets) once before the timings
            ms = statistics.median(time_eager(calls, repeats)) / copies
        diff = float(((one(0).float() - reference.float()).abs() / step).max())
        share = n * k * (1 if in_fp8 else 2) / (ms * 1e-3) / (BANDWIDTH_TB_S * 1e12)
        results.append({"shape": name, "n": n, "k": k, "rows": rows, "variant": label,
                        "config": None if config is None else config._asdict(),
                        "fp8": in_fp8, "us_per_call": 1000 * ms,
                        "share_of_bandwidth": share, "max_diff_steps": diff}
                       | ({"fp8_relative_error": quant_error} if in_fp8 else {}))
        print(f"{name:14s} rows {rows:2d} {label:36s} {1000 * ms:8.2f} us  {share:5.3f} of "
              f"4.5 TB/s  max diff {diff:.1f} steps", flush=True)
    return results


def config_text(c: dict) -> str:
    split = f", {c['split_k']}" if c.get("split_k", 1) != 1 else ""
    return (f"GemvConfig({c['block_n']}, {c['block_k']}, {c['num_warps']}, "
            f"{c['num_stages']}{split})")


def best_of(results: list[dict]) -> tuple[dict, dict]:
    """One (shape, rows)'s torch result and its fastest Triton one."""
    return (next(r for r in results if r["variant"] == "torch"),
            min((r for r in results if r["config"]), key=lambda r: r["us_per_call"]))


def row_configs(results: list[dict]) -> dict[tuple[int, int, int], tuple[dict | None, str]]:
    """(rows padded, N, K) -> the few_rows config with the least total time over that pad's
    measured row counts, or None unless it beat torch at every one of them; and the names."""
    by_pad: dict[tuple[int, int, int], list[dict]] = {}
    for r in results:
        if r["rows"] > 1:
            by_pad.setdefault((padded_rows(r["rows"]), r["n"], r["k"]), []).append(r)
    chosen = {}
    for key, mine in by_pad.items():
        us = {(r["variant"], r["rows"]): r["us_per_call"] for r in mine}
        counts = sorted({r["rows"] for r in mine})
        configs = {r["variant"]: r["config"] for r in mine if r["config"]}
        label = min(configs, key=lambda v: sum(us[v, c] for c in counts))
        wins = all(us[label, c] < us["torch", c] for c in counts)
        note = f"{mine[0]['shape']}, rows {','.join(map(str, counts))}"
        chosen[key] = (configs[label] if wins else None, note)
    return chosen


def report_fp8(results: list[dict]) -> None:
    """Per shape and row count: torch's time in bfloat16 against fp8_rows's best config, and
    the relative error that rounding the weights to fp8 costs; then FP8_CONFIGS' lines."""
    print("\nfp8 weights (fp8_rows) against torch in bfloat16:")
    best = {}
    for key in dict.fromkeys((r["shape"], r["rows"]) for r in results):
        mine = [r for r in results if (r["shape"], r["rows"]) == key]
        torch_us = next(r for r in mine if r["variant"] == "torch")["us_per_call"]
        row = best[key] = min((r for r in mine if r["fp8"]), key=lambda r: r["us_per_call"])
        print(f"{key[0]:14s} rows {key[1]:2d} torch {torch_us:7.2f} us, fp8 "
              f"{row['us_per_call']:7.2f} us ({row['share_of_bandwidth']:.3f} of the fp8 "
              f"weight's rate, {torch_us / row['us_per_call']:.2f}x, {row['variant']}); the "
              f"weights' rounding: relative error {row['fp8_relative_error']:.4f}")
    print("\nsplitspec/kernels/gemv.py FP8_CONFIGS (the best config at the fewest rows timed):")
    for (name, rows), row in best.items():
        if rows == min(r for s, r in best if s == name):
            print(f"FP8_CONFIGS ({row['n']}, {row['k']}): {config_text(row['config'])},  "
                  f"# {name}, rows {rows}")


def report(results: list[dict]) -> None:
    """The best variant per shape and row count, then the lines to paste into gemv.py (the
    bfloat16 kernels'); then fp8_rows's, where measured."""
    if any(r["fp8"] for r in results):
        report_fp8(results)
    results = [r for r in results if not r["fp8"]]
    if not any(r["config"] for r in results):
        return
    print("\nbest per shape and row count:")
    keys = list(dict.fromkeys((r["shape"], r["rows"]) for r in results))
    best = {key: best_of([r for r in results if (r["shape"], r["rows"]) == key])
            for key in keys}
    for (name, rows), (torch_row, row) in best.items():
        print(f"{name:14s} rows {rows:2d} torch {torch_row['us_per_call']:7.2f} us "
              f"({torch_row['share_of_bandwidth']:.3f}), best {row['variant']} "
              f"{row['us_per_call']:7.2f} us ({row['share_of_bandwidth']:.3f}): "
              f"{torch_row['us_per_call'] / row['us_per_call']:.3f}x")
    one_row = {key: value for key, value in best.items() if key[1] == 1}
    if one_row:
        print("\nsplitspec/kernels/gemv.py CONFIGS (one row): each shape's best config, None "
              "where torch won:")
        for (name, _), (torch_row, row) in one_row.items():
            config = (config_text(row["config"])
                      if row["us_per_call"] < torch_row["us_per_call"] else "None")
            print(f"CONFIGS     ({row['n']}, {row['k']}): {config},  # {name}")
    chosen = row_configs(results)
    if chosen:
        print("\nsplitspec/kernels/gemv.py ROW_CONFIGS (rows padded to 16/32/64): the config "
              "that beat torch at every row count of the pad (shapes where it did not are "
              "left out):")
        for (pad, n, k), (config, note) in chosen.items():
            if config is None:
                print(f"# ROW_CONFIGS ({pad}, {n}, {k}): torch won,  # {note}")
            else:
                print(f"ROW_CONFIGS ({pad}, {n}, {k}): {config_text(config)},  # {note}")


def grid(args: argparse.Namespace, rows: int) -> list[GemvConfig]:
    """The configs tried at ``rows``: the options' grid, or the default one of its kernel
    (few_rows keeps only blocks of 16 or more, tl.dot's smallest tile)."""
    default = ONE_ROW_GRID if rows == 1 else ROWS_GRID
    block_n, block_k, warps, stages = (given or fallback for given, fallback in zip(
        (args.block_n, args.block_k, args.warps, args.stages), default, strict=True))
    least = 1 if rows == 1 else 16
    return [GemvConfig(bn, bk, w, st) for bn in block_n for bk in block_k for w in warps
            for st in stages if bn >= least and bk >= least]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(list(SHAPES)[:5]),
                        help=f"of {','.join(SHAPES)} (default: the target's); '' for none")
    parser.add_argument("--shape", type=parse_shape, action="append", default=[],
                        metavar="NAME=N,K", help="one more shape (repeatable)")
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="a checkpoint folder (Llama target or EAGLE-3 head): its projections "
                        "(repeatable)")
    parser.add_argument("--rows", type=ints, default=[1],
                        help=f"row counts to time (1: gemv; 2 to {MAX_ROWS}: few_rows)")
    parser.add_argument("--block-n", type=ints, help=f"default {ONE_ROW_GRID[0]} at one row, "
                        f"{ROWS_GRID[0]} at more")
    parser.add_argument("--block-k", type=ints, help=f"default {ONE_ROW_GRID[1]} at one row, "
                        f"{ROWS_GRID[1]} at more")
    parser.add_argument("--warps", type=ints, help=f"default {ONE_ROW_GRID[2]}")
    parser.add_argument("--stages", type=ints, help=f"default {ONE_ROW_GRID[3]} at one row, "
                        f"{ROWS_GRID[3]} at more")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shrink", type=int, default=1, help="divide every dimension by this "
                        "(and keep two copies of each weight): for a check on CPU")
    parser.add_argument("--fp8", action="store_true",
                        help="also time fp8_rows (weights in float8 e4m3, a scale a row) over "
                        "the same grid (blocks of 16 or more)")
    parser.add_argument("--split-k", type=ints, default=[1],
                        help="with --fp8: fp8_rows's split_k values to try (programs a block "
                        "of W's rows is shared by)")
    parser.add_argument("--skip-bf16", action="store_true",
                        help="time no bfloat16 Triton kernel (torch's linear stays, the baseline)")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: bench_gemv measures on one (--device cpu only checks the script)",
              file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
    too_many = [r for r in args.rows if r > MAX_ROWS]
    if too_many:
        parser.error(f"--rows {too_many}: the kernels take at most {MAX_ROWS} rows")
    shapes = {name: SHAPES[name] for name in names} | dict(args.shape)
    for model_dir in args.model:
        shapes |= checkpoint_shapes(model_dir)
    if not shapes:
        parser.error("no shapes: give --shapes, --shape or --model")
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            configs = grid(args, rows)
            if not configs:
                parser.error(f"no config of the grid fits {rows} rows (few_rows needs blocks of "
                             "16 or more)")
            for name, shape in shapes.items():
                results += measure(name, shape, rows, configs, args.repeats, args.device,
                                   args.shrink, tuple(args.split_k) if args.fp8 else (),
                                   not args.skip_bf16)
                if args.device == "cuda":
                    torch.cuda.empty_cache()  # this shape's weights
    report(results)
    if args.out_json:
        args.out_json.write_text(json.dumps({"command": " ".join(sys.argv),
                                             "device": torch.cuda.get_device_name()
                                             if args.device == "cuda" else "cpu",
                                             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
