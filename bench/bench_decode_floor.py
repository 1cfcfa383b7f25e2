"""Plain decode at batch 1 on a Llama-3.1-8B-shaped target with RANDOM weights, against the
weight-read floor (W bytes / 4.5 TB/s on an H200, ../shared/GPU.md).

Builds the random checkpoint on the GPU (bf16), starts the target service on it
without a draft, decodes --new-tokens tokens from one prompt and reports the
median decode step (target StepStats) beside the floor.

    python bench/bench_decode_floor.py --out-json /tmp/floor.json

Not yet run to the end: on 2026-11-30 (one H200) the checkpoint was written in
34 s, but the target was not SERVING within the 7.5 minutes left of the call
(the loader reads all 16 GB into host memory before moving it; the GPU engine
issue should load to the device directly and time start-up).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_tp import Process, serve

from splitspec.builtin import BUILTIN_TARGET
from splitspec.tokenizer import TOKENIZER_FILE
from splitspec.v1 import common_pb2

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


def random_checkpoint(folder: Path) -> int:
    """Write the random bf16 checkpoint; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_31_8B)).to(torch.bfloat16)
    model.save_pretrained(folder)
    shutil.copy(BUILTIN_TARGET / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="decode_floor_"))
    started = time.perf_counter()
    params = random_checkpoint(work / "llama-8b-random")
    floor_ms = 1000 * 2 * params / (BANDWIDTH_TB_S * 1e12)
    print(f"random 8B checkpoint: {params / 1e9:.2f} B parameters, written in "
          f"{time.perf_counter() - started:.0f} s; floor {floor_ms:.2f} ms", flush=True)
    runs = []
    with Process("target_service", ["--model", str(work / "llama-8b-random"), "--device", "cuda",
                                    "--dtype", "bfloat16", "--max-running", "4",
                                    "--max-context", "1024"], work / "target.log") as target:
        for _ in range(args.repeats + 1):  # the first run warms up
            _, steps = serve(target.address, [list(range(10, 74))], args.new_tokens,
                             common_pb2.SPECULATION_MODE_OFF)
            decode = [s for s in steps if s.prefill_tokens == 0 and s.batch_size == 1]
            runs.append(1000 * statistics.median(s.total_s for s in decode))
    step_ms = statistics.median(runs[1:])
    result = {"parameters": params, "floor_ms": floor_ms, "step_ms": step_ms, "runs_ms": runs[1:],
              "share_of_floor_speed": floor_ms / step_ms, "command": " ".join(sys.argv)}
    print(json.dumps(result, indent=1))
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
