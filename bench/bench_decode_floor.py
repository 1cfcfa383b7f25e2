"""Plain decode at batch 1 on a Llama-3.1-8B-shaped target with RANDOM weights, against the
weight-read floor (W bytes / 4.5 TB/s on an H200, ../shared/GPU.md).

Builds the random checkpoint on the GPU (bf16), then for each --variants entry
starts the target service on it without a draft (timing start-up to SERVING
and reading its init report), decodes --new-tokens tokens from one prompt
--repeats + 1 times (the first run warms up) and reports the median decode
step (target StepStats) beside the floor. "graphs" is the default engine
(flashinfer attention, CUDA graphs of decode); "eager" the same without graphs.
Results with random weights are labelled as such: speed does not depend on
the weights' values.

    python bench/bench_decode_floor.py --out-json /tmp/floor.json --log-dir /tmp/floor-logs
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from bench_tp import Process, serve

from splitspec.builtin import BUILTIN_TARGET
from splitspec.tokenizer import TOKENIZER_FILE
from splitspec.v1 import common_pb2, target_pb2_grpc

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
BANDWIDTH_TB_S = 4.5  # measured weight-read rate of an H200 at batch 1 (../shared/GPU.md)


def random_checkpoint(folder: Path, hf_config: dict = LLAMA_31_8B, device: str = "cuda") -> int:
    """Write the random bf16 checkpoint; returns its parameter count.

    The weights are random but shaped so that greedy decoding is not a string of near-ties
    (which bf16 rounding, batch size and kernel choice would flip, so that no recorded
    continuation could be replayed): embeddings are N(0, 1), the layers' output
    projections (o_proj, down_proj) are scaled to std 1e-4 so the residual stream stays
    close to the token's embedding, and lm_head's rows are the embeddings in a fixed
    random order. The next token is then a fixed map of the current one, by a wide
    margin. Speed does not depend on the values: every layer runs and every weight is read.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf_config))
        with torch.no_grad():
            embed = model.model.embed_tokens.weight
            embed.normal_(0.0, 1.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.005)
                layer.mlp.down_proj.weight.mul_(0.005)
            order = torch.randperm(embed.shape[0], device=device)
            model.lm_head.weight.copy_(embed[order])
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    shutil.copy(BUILTIN_TARGET / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    count = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return count


VARIANTS = {"graphs": [], "eager": ["--no-cuda-graphs"], "torch": ["--attention-backend", "torch",
                                                                  "--no-cuda-graphs"]}


def run_variant(model: Path, name: str, args: argparse.Namespace) -> dict:
    """Start the target with one engine variant; its start-up, init steps and decode steps."""
    started = time.perf_counter()
    with Process("target_service", ["--model", str(model), "--device", args.device, "--dtype",
                                    args.dtype, "--max-running", "4", "--max-context", "1024",
                                    *VARIANTS[name]], args.log_dir / f"target-{name}.log") as target:
        serving_s = time.perf_counter() - started
        with grpc.insecure_channel(target.address) as channel:
            report = target_pb2_grpc.TargetStub(channel).GetInitReport(
                common_pb2.GetInitReportRequest())
        steps = {step.name: {"s": round(step.duration_s, 2), "detail": step.detail}
                 for step in report.steps}
        runs, forwards = [], []
        for _ in range(args.repeats + 1):  # the first run warms up
            _, stats = serve(target.address, [list(range(10, 74))], args.new_tokens,
                             common_pb2.SPECULATION_MODE_OFF)
            decode = [s for s in stats if s.prefill_tokens == 0 and s.batch_size == 1]
            runs.append(1000 * statistics.median(s.total_s for s in decode))
            forwards.append(1000 * statistics.median(s.forward_s for s in decode))
    result = {"serving_s": serving_s, "init_steps": steps, "step_ms": statistics.median(runs[1:]),
              "forward_ms": statistics.median(forwards[1:]), "runs_ms": runs[1:]}
    print(f"{name}: SERVING after {serving_s:.1f} s; decode step {result['step_ms']:.2f} ms "
          f"(forward {result['forward_ms']:.2f} ms)", flush=True)
    return result


def checkpoint_parameters(model: Path) -> int:
    """Parameters of a checkpoint folder, from its safetensors headers."""
    from safetensors import safe_open

    from splitspec.model.loader import safetensors_files

    count = 0
    for path in safetensors_files(model):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                count += math.prod(f.get_slice(name).get_shape())
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="graphs,eager",
                        help=f"comma-separated engine variants: {', '.join(VARIANTS)}")
    parser.add_argument("--log-dir", type=Path, help="where the target logs go (default: a "
                        "temporary folder)")
    parser.add_argument("--out-json", type=Path)
    parser.add_argument("--model", type=Path, help="time this checkpoint instead of a random "
                        "8B one (for example on CPU, to try the script)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="decode_floor_"))
    args.log_dir = args.log_dir or work
    args.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = args.model or work / "llama-8b-random"
    params = checkpoint_parameters(model) if args.model else random_checkpoint(model)
    floor_ms = 1000 * 2 * params / (BANDWIDTH_TB_S * 1e12)
    print(f"{model.name}: {params / 1e9:.2f} B parameters, ready in "
          f"{time.perf_counter() - started:.0f} s; floor {floor_ms:.2f} ms", flush=True)
    label = f"{model.name} ({args.dtype})" if args.model else "Llama-3.1-8B shape, RANDOM bf16 weights"
    result: dict = {"label": label, "parameters": params,
                    "floor_ms": floor_ms, "command": " ".join(sys.argv), "variants": {}}
    for name in args.variants.split(","):
        found = run_variant(model, name, args)
        found["share_of_floor_speed"] = floor_ms / found["step_ms"]
        result["variants"][name] = found
        if args.out_json:  # partial results survive a later variant's failure
            args.out_json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    shutil.rmtree(work / "llama-8b-random", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
