"""Tensor parallelism: greedy agreement with one rank, and decode step time, per --tp.

Agreement: the built-in pair (target + EAGLE-3 draft), greedy, each TP size
with speculation OFF and ON; every output is compared token by token with
TP=1 OFF (bf16 on GPUs reorders sums across ranks, so exact agreement is
not expected there; float32 on CPU gives identical text). Where an output
first leaves the reference, the float32 `transformers` model (the oracle)
scores the two tokens given the shared prefix: a rounding flip can only
happen where their margin is within bf16's error (NEAR_TIE); a wrong shard
or kernel leaves where the model is sure.

Step time: a target of the benchmark pair's shape (bench/results/
bench_pair_manifest.json: 169M parameters, 16 heads, 4 KV heads), or with
--timing-model 8b of Llama-3.1-8B's, with RANDOM weights (the trained weights
are not in the repository; speed does not depend on them), plain decoding at
batch 1: the median forward and step time per decode step, at each TP size
with CUDA graphs and at TP=1 without them.

    python bench/bench_tp.py --tp 1,2 --device cuda --dtype bfloat16 --out-json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_speculation import free_port

from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.compile_watch import WHILE_SERVING
from splitspec.grpc_server import wait_for_serving
from splitspec.replay import serve
from splitspec.tokenizer import TOKENIZER_FILE, load_tokenizer
from splitspec.v1 import common_pb2

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "bench" / "results" / "bench_pair_manifest.json"
TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n",
         "for i in range(10):\n    print(", "with open(path) as f:\n", "raise ValueError(\"",
         "from collections import ", "while True:\n    line = ", "def parse_args(argv=None):\n",
         "try:\n    import json\nexcept ImportError:\n", "x = [i * i for i in range(",
         "async def fetch(url):\n", "self.assertEqual(", "if __name__ == \"__main__\":\n",
         "return {k: v for k, v in ", "# Copyright (c) 2024\n\"\"\"Utilities for"]


class Process:
    """A service process on a free port; stopped on exit."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        self.module = module
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(self.port), *args],
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Process:
        try:
            wait_for_serving(self.address, 900, self.module, lambda: self.proc.poll() is None).close()
        except (RuntimeError, TimeoutError):
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# The largest margin (float32 logits) a bf16 rounding flip can cross on the built-in target:
# bf16 moves its logits (scale ~20) by up to 0.16 against float32 over these prompts
# (transformers, CPU), and the two runs compared may err in opposite directions.
# 12 % of its greedy positions have a top-2 gap this small, so a random flip would exceed it.
NEAR_TIE = 0.5


def graph_details(report: Path) -> list[str]:
    """Each rank's capture_cuda_graphs detail (rank 0 first), from a target's init report."""
    data = json.loads(report.read_text())
    return [next(s["detail"] for s in r["steps"] if s["name"] == "capture_cuda_graphs")
            for r in (data, *data["ranks"])]


def first_difference(out: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Share of tokens equal to the reference at the same position, and share of tokens
    before each output's first difference (greedy text diverges after one)."""
    same = prefix = total = 0
    for out, ref in zip(outputs, reference, strict=True):
        total += len(ref)
        same += sum(a == b for a, b in zip(out, ref, strict=False))
        first = first_difference(out, ref)
        prefix += min(len(out), len(ref)) if first is None else first
    return {"identical_tokens": same / total, "identical_prefix": prefix / total}


def first_divergences(prompts: list[list[int]], outputs: list[list[int]],
                      reference: list[list[int]], oracle: object) -> list[dict]:
    """Where each output first differs from its reference: the position, both tokens, and the
    oracle's logit margin of the reference's token over the output's given the shared prefix."""
    import torch

    found = []
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, reference, strict=True)):
        at = first_difference(out, ref)
        if at is None:
            continue
        with torch.inference_mode():
            logits = oracle(torch.tensor([[*prompt, *ref[:at]]])).logits[0, -1].float()
        found.append({"prompt": i, "position": at, "reference": ref[at], "output": out[at],
                      "margin": float(logits[ref[at]] - logits[out[at]])})
    return found


def float32_oracle(model: Path) -> object:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model).float().eval()  # any transformers version


def random_bench_target(folder: Path) -> Path:
    """A checkpoint of the benchmark target's shape with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads(MANIFEST.read_text())["models"]["target"]["config"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(folder)
    shutil.copy(BUILTIN_TARGET / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    return folder


def compiled_while_serving(logs: Path) -> dict[str, list[str]]:
    """Per service log in ``logs`` that has any, splitspec/compile_watch.py's warnings: the
    Triton kernel variants compiled after SERVING, which start-up did not meet."""
    found = {}
    for path in sorted(logs.glob("*.log")):
        lines = [line[line.index(WHILE_SERVING):] for line in path.read_text().splitlines()
                 if WHILE_SERVING in line]
        if lines:
            found[path.name] = lines
    return found


def measure_agreement(sizes: list[int], common: list[str], new_tokens: int, logs: Path,
                      result: dict) -> None:
    """Greedy text of the built-in pair at each TP size, ON and OFF, against TP=1 OFF; each
    rank's graphs; where each output diverges, scored by the float32 model."""
    prompts = [load_tokenizer(BUILTIN_TARGET).encode(t) for t in TEXTS]
    with Process("draft_service", ["--model", str(BUILTIN_EAGLE3), *common], logs / "draft.log") as draft:
        outputs = {}
        for tp in sizes:
            report = logs / f"target-tp{tp}.json"
            with Process("target_service", ["--draft", draft.address, "--tp", str(tp),
                                            "--init-report", str(report), *common],
                         logs / f"target-tp{tp}.log") as target:
                result["graphs"][f"tp{tp}"] = graph_details(report)
                for name, mode in (("OFF", common_pb2.SPECULATION_MODE_OFF),
                                   ("ON", common_pb2.SPECULATION_MODE_ON)):
                    outputs[tp, name], _ = serve(target.address, prompts, new_tokens, mode)
    oracle = float32_oracle(BUILTIN_TARGET)
    for (tp, name), out in outputs.items():
        found = first_divergences(prompts, out, outputs[1, "OFF"], oracle)
        entry = {**agreement(out, outputs[1, "OFF"]), "divergences": found,
                 "max_margin": max((abs(d["margin"]) for d in found), default=0.0)}
        result["agreement"][f"tp{tp} {name}"] = entry
        print(f"TP={tp} {name}: identical tokens {entry['identical_tokens']:.3f}, prefix "
              f"{entry['identical_prefix']:.3f}; {len(found)} of {len(prompts)} outputs diverge, "
              f"largest float32 margin there {entry['max_margin']:.3f} (near tie: < {NEAR_TIE})",
              flush=True)


def measure_steps(sizes: list[int], common: list[str], args: argparse.Namespace, logs: Path,
                  result: dict) -> None:
    """Batch-1 decode step time of the random target at each TP size (and TP=1 eager)."""
    prompt = load_tokenizer(BUILTIN_TARGET).encode(TEXTS[0])
    if args.timing_model == "8b":
        from bench_decode_floor import random_checkpoint  # it imports this module

        model = logs / "8b-target"
        random_checkpoint(model, device=args.device)
        common = [*common, "--max-running", "4", "--max-context", "1024"]
    else:
        model = random_bench_target(logs / "bench-target")
    runs_of = {f"tp{tp}": ["--tp", str(tp)] for tp in sizes}
    if args.device.startswith("cuda"):  # what the graphs save
        runs_of["tp1 eager"] = ["--tp", "1", "--no-cuda-graphs"]
    for key, flags in runs_of.items():
        with Process("target_service", ["--model", str(model), *flags, *common],
                     logs / f"timing-{key.replace(' ', '-')}.log") as target:
            runs = []
            for _ in range(args.repeats + 1):  # the first run warms up
                _, steps = serve(target.address, [prompt], args.step_tokens,
                                 common_pb2.SPECULATION_MODE_OFF)
                decode = [s for s in steps if s.prefill_tokens == 0 and s.batch_size == 1]
                runs.append((1000 * statistics.median(s.forward_s for s in decode),
                             1000 * statistics.median(s.total_s for s in decode)))
            forward, total = (statistics.median(r[i] for r in runs[1:]) for i in (0, 1))
            result["step_ms"][key] = {"forward": forward, "step": total, "runs": runs[1:]}
            print(f"{key}: decode step {total:.2f} ms (forward {forward:.2f} ms), median of "
                  f"{args.repeats} runs x {args.step_tokens} tokens", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes (1 first)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=32, help="per prompt, agreement runs")
    parser.add_argument("--step-tokens", type=int, default=128, help="batch-1 timing run")
    parser.add_argument("--repeats", type=int, default=3, help="timing runs per TP size")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--timing-model", choices=["bench", "8b"], default="bench",
                        help="the random target timed: the benchmark pair's shape or Llama-3.1-8B's")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.tp.split(",")]
    if sizes[0] != 1:
        raise SystemExit("--tp must start with 1: the others are compared with it")
    common = ["--device", args.device, "--dtype", args.dtype]
    logs = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    result: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                    "agreement": {}, "graphs": {}, "step_ms": {}}
    if not args.skip_agreement:
        measure_agreement(sizes, common, args.new_tokens, logs, result)
    if not args.skip_timing:
        measure_steps(sizes, common, args, logs, result)
    result["compiled_while_serving"] = compiled_while_serving(logs)
    for name, lines in result["compiled_while_serving"].items():
        print(f"{name}: {len(lines)} Triton variant(s) compiled while serving; the first: "
              f"{lines[0]}", flush=True)
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
