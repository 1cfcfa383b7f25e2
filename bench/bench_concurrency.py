"""Tokens per second against concurrency for the speculation policies: OFF, ON, static, adaptive.

For each concurrency (requests kept in flight on one Serve stream, as the
gateway does), runs the four policies interleaved, ``--repeats`` times each:

* OFF: no speculation;
* ON: the draft shape (``--shape``, default the tree of 8 nodes, topk 4, depth 4)
  at every batch size;
* static: ``gateway.policy.static_policy`` with ``--static-threshold``
  (the gateway's ``--spec-disable-batch-threshold``: speculate up to that batch size);
* adaptive: one ``gateway.policy.AdaptivePolicy`` per concurrency, fed with every
  step's statistics and learning across the repeats.

Each concurrency starts with ``--warmup`` untimed OFF, ON and adaptive runs (adaptive
learns in them, as a long-running gateway would have): the first
runs on a fresh target are slow (2 CPU cores, 64 streams: OFF 12.4 s then
7.0 s for the same work), and a warm-up per concurrency covers new batch sizes
too. Medians are reported; a ratio is the median of the per-repeat ratios
(modes interleaved, so drift hits all alike); "best" is whichever of OFF and
ON has the higher median. Writes a markdown table (``--out-md``), the raw
numbers with the machine and command (``--out-json``) and a plot
(``--out-png``, needs ``pip install -e '.[bench]'``)::

    python bench/bench_concurrency.py --start --draft-kind eagle3 --prompts heldout \\
        --concurrency 1,2,4,8,16,32,64 --repeats 3 --max-new-tokens 48 --static-threshold 8 \\
        --out-md docs/bench/concurrency_cpu.md --out-json bench/results/concurrency_cpu.json \\
        --out-png docs/bench/concurrency_cpu.png

``--from-json`` re-renders the table and plot of a saved run without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench_speculation import (
    SHAPES,
    RunStats,
    add_stack_arguments,
    load_prompts,
    run_target,
    start_stack,
)

from gateway.policy import AdaptivePolicy, static_policy
from splitspec.grpc_server import wait_for_serving
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

MODES = ("OFF", "ON", "static", "adaptive")
AIM = 0.97  # adaptive within 3 % of the best of OFF and ON


def parse_concurrency(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; each at least 1, increasing."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1 or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(
            f"--concurrency must be increasing positive integers, e.g. 1,2,4 (got {text!r})")
    return values


def prompts_for(concurrency: int, num_prompts: int) -> int:
    """Prompts run at one concurrency: `num_prompts`, or for 0 max(16, 2 x concurrency)
    (two waves of requests at least)."""
    return num_prompts or max(16, 2 * concurrency)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def describe_machine(device: str, dtype: str, started_here: bool) -> dict[str, Any]:
    """What ran the benchmark; `label` names it in the plot's title."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    accelerator = None
    if device.startswith("cuda"):
        import torch

        accelerator = torch.cuda.get_device_name(torch.device(device))
    cpu = cpu_model()
    label = (f"{accelerator}, {dtype}" if accelerator else f"{cores} cores of {cpu}, {dtype}")
    return {"label": label, "platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cpu_count": cores, "torch": version("torch"), "device": device,
            "accelerator": accelerator, "dtype": dtype,
            "services_started_here": started_here}


def speculated_share(stats: RunStats) -> float:
    """Share of decode steps that speculated."""
    decode = [s for s in stats.steps if s.prefill_tokens == 0 and s.batch_size]
    return sum(s.speculated for s in decode) / len(decode) if decode else 0.0


def mean_decode_batch(stats: RunStats) -> float:
    decode = [s.batch_size for s in stats.steps if s.prefill_tokens == 0 and s.batch_size]
    return statistics.fmean(decode) if decode else 0.0


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios of one concurrency's raw runs (`entry` as stored in the JSON)."""
    rates = entry["tokens_per_s"]
    med = {mode: statistics.median(rates[mode]) for mode in MODES}
    per_repeat = lambda a, b: statistics.median(  # noqa: E731
        x / y for x, y in zip(rates[a], rates[b], strict=True))
    best = "ON" if med["ON"] >= med["OFF"] else "OFF"
    on_off, adaptive_best = per_repeat("ON", "OFF"), per_repeat("adaptive", best)
    adaptive_off = per_repeat("adaptive", "OFF")
    return {"concurrency": entry["concurrency"], "median": med, "best": best, "on_off": on_off,
            "adaptive_best": adaptive_best, "adaptive_off": adaptive_off,
            "aim_met": adaptive_best >= AIM and (on_off <= 1 or adaptive_off > 1)}


def markdown(report: dict[str, Any]) -> str:
    """The table of a run, with a line saying what ran and where the aim is met."""
    settings, machine = report["settings"], report["machine"]
    threshold = settings["static_threshold"]
    prompt_len = f" of {settings['prompt_len']} tokens" if settings["prompts"] == "heldout" else ""
    lines = [
        f"{machine['label']}; torch {machine['torch']}, {machine['device']}; {report['date']}. "
        f"{settings['draft']} draft, {settings['shape_name']} shape "
        f"{'/'.join(map(str, settings['shape']))} (nodes/topk/depth); {settings['prompts']} "
        f"prompts{prompt_len} x {settings['max_new_tokens']} new tokens, greedy; "
        f"{settings['repeats']} runs per mode, interleaved, medians, after "
        f"{settings.get('warmup', 0)} untimed OFF, ON and adaptive run(s) at each concurrency.",
        "",
        "| concurrency | prompts | OFF tok/s | ON tok/s | "
        f"static (<={threshold}) tok/s | adaptive tok/s | ON / OFF | adaptive / best(OFF, ON) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summaries = [summarize(entry) for entry in report["results"]]
    for entry, s in zip(report["results"], summaries, strict=True):
        m = s["median"]
        lines.append(f"| {s['concurrency']} | {entry['num_prompts']} | {m['OFF']:.1f} | "
                     f"{m['ON']:.1f} | {m['static']:.1f} | {m['adaptive']:.1f} | "
                     f"{s['on_off']:.2f}x | {s['adaptive_best']:.2f} ({s['best']}) |")
    met = [str(s["concurrency"]) for s in summaries if s["aim_met"]]
    missed = [str(s["concurrency"]) for s in summaries if not s["aim_met"]]
    lines += ["", f"Aim (adaptive >= {AIM:.2f} x best, and above OFF where ON is): met at "
              f"concurrency {', '.join(met) or 'none'}"
              + (f"; missed at {', '.join(missed)}." if missed else ".")]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s against concurrency (log2 axis), one line per mode; bars span the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    xs = [entry["concurrency"] for entry in results]
    threshold = report["settings"]["static_threshold"]
    labels = {"OFF": "OFF", "ON": "ON (always)", "static": f"static (speculate up to {threshold})",
              "adaptive": "adaptive"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in zip(MODES, "os^D", strict=True):
        runs = [entry["tokens_per_s"][mode] for entry in results]
        med = [statistics.median(r) for r in runs]
        err = [[m - min(r) for m, r in zip(med, runs, strict=True)],
               [max(r) - m for m, r in zip(med, runs, strict=True)]]
        ax.errorbar(xs, med, yerr=err, marker=marker, capsize=3, label=labels[mode])
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens / s (median)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    settings = report["settings"]
    ax.set_title(f"Speculation policy against concurrency: {report['machine']['label']}\n"
                 f"{settings['draft']} draft, shape {'/'.join(map(str, settings['shape']))}, "
                 f"{settings['max_new_tokens']} new tokens, {report['date'][:10]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_json(report: dict[str, Any], path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def render(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table; write it and the plot where asked."""
    if not report["results"]:
        raise SystemExit("the report has no results to render")
    table = markdown(report)
    print(table, end="")
    if args.out_md:
        args.out_md.parent.mkdir(parents=True, exist_ok=True)
        args.out_md.write_text(table)
    if args.out_png:
        plot(report, args.out_png)
        print(f"plot: {args.out_png}", file=sys.stderr)


def sweep(stub: target_pb2_grpc.TargetStub, all_prompts: list[list[int]],
          args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Run every concurrency, appending to report["results"] (and saving it) as each ends."""
    num, topk, steps = SHAPES[args.shape]
    shape = common_pb2.DraftShape(num_draft_tokens=num, topk=topk, num_steps=steps)
    static = static_policy(args.static_threshold, shape)
    total = len(args.concurrency) * args.repeats * len(MODES)
    done, start = 0, time.perf_counter()
    for concurrency in args.concurrency:
        prompts = all_prompts[:prompts_for(concurrency, args.num_prompts)]
        adaptive = AdaptivePolicy(shape)  # one per concurrency: it learns across the repeats
        runs: dict[str, tuple[int, int, int] | target_pb2.SpecPolicy | AdaptivePolicy | None] = {
            "OFF": None, "ON": SHAPES[args.shape], "static": static, "adaptive": adaptive}
        entry: dict[str, Any] = {"concurrency": concurrency, "num_prompts": len(prompts),
                                 **{key: {mode: [] for mode in MODES} for key in (
                                     "tokens_per_s", "wall_s", "accepted_per_verify_step",
                                     "speculated_step_share", "mean_decode_batch")},
                                 "warmup_tokens_per_s": {"OFF": [], "ON": [], "adaptive": []}}
        # Untimed: the first runs at a new batch size are slow, and the adaptive policy learns
        # here what a long-running gateway has long known.
        for _ in range(args.warmup):
            for mode in ("OFF", "ON", "adaptive"):
                stats = run_target(stub, prompts, args.max_new_tokens, runs[mode], concurrency)
                entry["warmup_tokens_per_s"][mode].append(stats.tokens_per_s)
                print(f"warm-up: concurrency {concurrency}, {mode}: {stats.tokens_per_s:.1f} "
                      f"tok/s ({stats.wall_s:.1f} s, not counted); "
                      f"{time.perf_counter() - start:.0f} s so far", file=sys.stderr, flush=True)
        for repeat in range(args.repeats):
            for mode in MODES:  # interleaved, so drift hits all alike
                stats = run_target(stub, prompts, args.max_new_tokens, runs[mode], concurrency)
                entry["tokens_per_s"][mode].append(stats.tokens_per_s)
                entry["wall_s"][mode].append(stats.wall_s)
                entry["accepted_per_verify_step"][mode].append(stats.mean_accepted)
                entry["speculated_step_share"][mode].append(speculated_share(stats))
                entry["mean_decode_batch"][mode].append(mean_decode_batch(stats))
                done += 1
                print(f"[{done}/{total}] concurrency {concurrency}, {mode}, run "
                      f"{repeat + 1}/{args.repeats}: {stats.tokens_per_s:.1f} tok/s "
                      f"({stats.wall_s:.1f} s, {speculated_share(stats):.0%} of steps "
                      f"speculated, mean batch {mean_decode_batch(stats):.1f}); "
                      f"{time.perf_counter() - start:.0f} s so far", file=sys.stderr, flush=True)
        report["results"].append(entry)
        save_json(report, args.out_json)  # partial: a long sweep that dies keeps what it ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_arguments(parser)  # --device and --dtype are also recorded with the results
    parser.add_argument("--machine", default="", help="names the machine in the plot and table "
                                                      "(default: described from this host)")
    parser.add_argument("--shape", default="tree", choices=list(SHAPES),
                        help="draft shape of ON, static and adaptive")
    parser.add_argument("--static-threshold", type=int, default=8,
                        help="static policy: speculate up to this batch size (0: at any)")
    parser.add_argument("--concurrency", type=parse_concurrency, default=[1, 2, 4, 8, 16, 32, 64],
                        help="comma-separated requests in flight, e.g. 1,2,4,8,16,32,64")
    parser.add_argument("--prompts", default="heldout", choices=["fixed", "heldout"],
                        help="snippets of held-out stdlib files, or the 8 fixed code prompts "
                             "(cycled)")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="prompts per concurrency (0: max(16, 2 x concurrency))")
    parser.add_argument("--prompt-len", type=int, default=64, help="with --prompts heldout")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed OFF, ON and adaptive runs at each concurrency before the timed ones (adaptive learns in them)")
    parser.add_argument("--out-md", type=Path, help="write the markdown table here")
    parser.add_argument("--out-json", type=Path, help="write the raw numbers here")
    parser.add_argument("--out-png", type=Path, help="write the plot here (needs matplotlib)")
    parser.add_argument("--from-json", type=Path,
                        help="render the table and plot of this saved run; run nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        render(json.loads(args.from_json.read_text()), args)
        return 0
    if args.num_prompts and args.num_prompts < max(args.concurrency):
        parser.error(f"--num-prompts {args.num_prompts} is below the concurrency "
                     f"{max(args.concurrency)}: the batch could never fill")
    if min(args.static_threshold, args.warmup) < 0 or min(args.repeats, args.max_new_tokens) < 1:
        parser.error("--static-threshold and --warmup must be >= 0, --repeats and "
                     "--max-new-tokens >= 1")
    machine = describe_machine(args.device, args.dtype, args.start)
    if args.machine:
        machine["label"] = args.machine
    report: dict[str, Any] = {
        "machine": machine, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "settings": {"target": args.target,
                     "shape_name": args.shape, "shape": list(SHAPES[args.shape]),
                     "static_threshold": args.static_threshold, "prompts": args.prompts,
                     "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                     "repeats": args.repeats, "warmup": args.warmup,
                     "concurrency": args.concurrency},
        "results": [], "complete": False}
    procs: list[subprocess.Popen] = []
    if args.start:
        procs, args.target = start_stack(args.draft_kind, args.models, args.device, args.dtype,
                                         max_running=max(32, *args.concurrency))
        report["settings"]["target"] = args.target
    try:
        channel = wait_for_serving(args.target, 300, "target")
        stub = target_pb2_grpc.TargetStub(channel)
        info = stub.GetInfo(target_pb2.GetTargetInfoRequest())
        if not info.has_draft:
            raise SystemExit(f"target {args.target} has no draft: ON would not speculate")
        if info.max_running < max(args.concurrency):
            raise SystemExit(f"target {args.target} runs at most {info.max_running} sequences at "
                             f"once, below concurrency {max(args.concurrency)}: start it with "
                             f"--max-running {max(args.concurrency)}")
        report["settings"]["target_model"] = info.model_name
        report["settings"]["draft_model"] = info.draft_model_name
        report["settings"]["draft"] = args.draft_kind if args.start else info.draft_model_name
        num = max(prompts_for(c, args.num_prompts) for c in args.concurrency)
        print(f"loading {num} {args.prompts} prompts", file=sys.stderr, flush=True)
        prompts = load_prompts(args.prompts, args.models / "target", num, args.prompt_len)
        prompts = [prompts[i % len(prompts)] for i in range(num)]  # fixed: 8 prompts, cycled
        sweep(stub, prompts, args, report)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
    report["complete"] = True
    save_json(report, args.out_json)
    render(report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
