"""Which flashinfer kernel should attend a decode step's one-token queries? (CUDA)

A Llama-3.1-8B-shaped decode step (32 layers, 32 query heads, 8 KV heads, head dim 128,
bf16, pages of 16 slots) spends about 8 % of its device time in attention at batch 1,
512 tokens of context: flashinfer's tensor-core decode (its prefill kernel run for a
one-token query) plus the merge of its KV splits. This bench times the candidates the
way the engine runs them, one CUDA graph replaying every layer's attention:

- ``tc``: the tensor-core decode the engine used (``use_tensor_cores=True``, fa2, KV split
  chosen by flashinfer's planner);
- ``tc-nosplit``: the same with ``disable_split_kv=True`` (no merge kernel);
- ``cuda``: flashinfer's CUDA-core decode kernel (``use_tensor_cores=False``);
- ``tc-fa3``: the tensor-core decode through flashinfer's SM90 (FA3) prefill kernels;
- ``triton``, ``triton16``, ``triton64``: splitspec/kernels/paged_decode.py (no host plan;
  blocks of 32, 16 or 64 keys), split in ``splits_for`` shares;
- ``triton-s4``, ``triton-s8``, ``triton-s16``: the same in 4, 8 or 16 shares per sequence
  and KV head (fewer partial results to merge; at batch 1 ``splits_for`` takes 32, a page
  each at 512 keys).

For each batch size and context length: the median device time of a replay of the
all-layer graph (replays queued back to back, timed with CUDA events), per layer, and the
largest difference of each variant's output from ``tc``'s (all must agree to bf16
rounding). The weight-read floor of the whole step is 3.57 ms (bench_decode_floor.py).

    python bench/bench_decode_attention.py --out-json /tmp/attn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from graph_timing import graph_of, parse_ints, time_graph

from splitspec.attention.decode_table import splits_for
from splitspec.attention.flashinfer_backend import WORKSPACE_BYTES, import_flashinfer
from splitspec.kernels.paged_decode import paged_decode_attention

VARIANTS = {  # name: (wrapper options, plan options) for flashinfer; None for Triton
    "tc": ({"use_tensor_cores": True}, {}),
    "tc-nosplit": ({"use_tensor_cores": True}, {"disable_split_kv": True}),
    "cuda": ({"use_tensor_cores": False}, {}),
    "tc-fa3": ({"use_tensor_cores": True, "backend": "fa3"}, {}),
    "triton": None,
    "triton16": None,
    "triton64": None,
    "triton-s4": None,
    "triton-s8": None,
    "triton-s16": None,
}


def triton_settings(variant: str) -> tuple[int, int | None]:
    """A Triton variant's keys per block and its split (None: ``splits_for``'s)."""
    name, _, split = variant.partition("-s")
    return int(name.removeprefix("triton") or 32), int(split) if split else None


def attention(variant: str, batch: int, context: int, args: argparse.Namespace,
              q: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """One layer's attention of the variant, planned for this shape: cache layer -> out."""
    page = args.page_size
    pages_per_seq = -(-context // page)
    device = q.device
    if VARIANTS[variant] is None:  # no plan: lengths and pages are read on the device
        table = torch.cat((torch.full((batch, 1), context, dtype=torch.int32),
                           torch.arange(batch * pages_per_seq, dtype=torch.int32).view(
                               batch, pages_per_seq)), dim=1).to(device)
        block_n, splits = triton_settings(variant)
        splits = splits or splits_for(
            batch, args.kv_heads, torch.cuda.get_device_properties(device).multi_processor_count)
        part_out = torch.empty(batch, args.heads, splits, args.head_dim, device=device)
        part_lse = torch.empty(batch, args.heads, splits, device=device)
        return lambda layer: paged_decode_attention(q, layer, table, splits, part_out, part_lse,
                                                    block_n=block_n)
    wrapper_opts, plan_opts = VARIANTS[variant]
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    indices = torch.arange(batch * pages_per_seq, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_seq - 1) * page, dtype=torch.int32)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def int32(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=device)

    wrapper = import_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=int32(batch + 1),
        paged_kv_indices_buffer=int32(batch * pages_per_seq),
        paged_kv_last_page_len_buffer=int32(batch), **wrapper_opts)
    wrapper.plan(indptr, indices, last, args.heads, args.kv_heads, args.head_dim, page,
                 pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, **plan_opts)
    return lambda layer: wrapper.run(q, layer)


def measure(variant: str, batch: int, context: int, args: argparse.Namespace,
            cache: torch.Tensor, q: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One variant at one shape: (ms per all-layer replay, the last layer's output)."""
    run = attention(variant, batch, context, args, q)
    outs = [torch.empty_like(q) for _ in range(args.layers)]

    def forward() -> None:
        for layer in range(args.layers):
            outs[layer].copy_(run(cache[layer]))

    graph = graph_of(forward)
    for _ in range(args.warmup):
        graph.replay()
    torch.cuda.synchronize()
    return time_graph(graph, args.replays, args.rounds), outs[-1].clone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=parse_ints, default=[1, 8, 32], help="batch sizes")
    parser.add_argument("--context", type=parse_ints, default=[512, 2048],
                        help="tokens each sequence attends to")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays")
    parser.add_argument("--replays", type=int, default=50, help="replays queued per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA device")
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    for context in args.context:
        for batch in args.batch:
            pages = batch * -(-context // args.page_size)
            cache = torch.randn(args.layers, pages, 2, args.page_size, args.kv_heads,
                                args.head_dim, dtype=torch.bfloat16, device=device)
            q = torch.randn(batch, args.heads, args.head_dim, dtype=torch.bfloat16, device=device)
            reference = None
            for variant in variants:
                ms, out = measure(variant, batch, context, args, cache, q)
                reference = out if reference is None else reference
                diff = (out.float() - reference.float()).abs().max().item()
                row = {"variant": variant, "batch": batch, "context": context,
                       "ms_all_layers": round(ms, 5), "us_per_layer": round(ms * 1e3 / args.layers, 3),
                       "max_abs_diff_vs_first": diff}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del cache
    if args.out_json:
        args.out_json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()
                                                         if k != "out_json"},
                                             "device": torch.cuda.get_device_name(),
                                             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
