"""Load Hugging Face checkpoint folders (config.json + *.safetensors) into our modules."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from splitspec.kernels import HAS_TRITON
from splitspec.model.config import Eagle3Config, LlamaConfig
from splitspec.model.eagle3 import Eagle3Head
from splitspec.model.layers import (
    LlamaAttention,
    LlamaMLP,
    Rotary,
    rope_inv_freq,
    use_fused_kernels,
)
from splitspec.model.llama import LlamaForCausalLM
from splitspec.model.parallel import SINGLE, WHOLE, Shard, TPGroup, shard_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_device(device: str, ranks: int = 1) -> None:
    """Fail at load_config, before any weights are read, on a --device this process cannot
    use: not a torch device, a GPU where torch has none, or fewer GPUs than it needs
    (``ranks`` tensor-parallel ranks take cuda:0 .. cuda:ranks-1)."""
    try:
        where = torch.device(device)
    except RuntimeError as exc:  # (torch's own message names what it expected)
        raise ValueError(f"--device {device!r} is not a torch device: {exc}") from exc
    if where.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"--device {device}: torch {torch.__version__} ({build}) sees no GPU "
                         "here; use --device cpu, or a CUDA build of torch on a GPU host")
    needed = where.index + 1 if where.index is not None else ranks
    if needed > (count := torch.cuda.device_count()):
        raise ValueError(f"--device {device}" + (f" with --tp {ranks}" if ranks > 1 else "")
                         + f" needs {needed} GPU(s); torch sees {count}")


# A service's torch threads for its CPU ops. One: the draft and the target (and each tensor-
# parallel rank) are separate processes on one host, and the built-in pair's ops are small;
# with torch's default of a thread per core in every process, plain decoding on 2 cores ran
# up to 3.3x slower (docs/benchmarks.md, "Threads"). vLLM's GPU workers use one thread for
# the same reason.
DEFAULT_CPU_THREADS = 1
CPU_THREADS_HELP = ("torch threads for this process's CPU ops (intra-op); 0 = torch's default, "
                    "one per core. Raise it for a large model on a CPU host the process has to "
                    "itself")


def use_cpu_threads(threads: int) -> str:
    """Set torch's intra-op threads (0 leaves torch's default); returns them for an init report."""
    if threads < 0:
        raise ValueError(f"--cpu-threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    count = torch.get_num_threads()
    return f"{count} CPU thread{'s' if count != 1 else ''}"


def safetensors_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_tensors(model_dir: Path, desc: str, plan: dict[str, Shard] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time; with a shard plan only each tensor's
    slice is read."""
    files = safetensors_files(model_dir)
    plan = plan or {}
    for path in tqdm(files, desc=desc, unit="file", disable=len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shard = plan.get(name, WHOLE)
                if shard.dim is None:
                    yield name, f.get_tensor(name)
                else:
                    part = f.get_slice(name)
                    index = [slice(None)] * len(part.get_shape())
                    index[shard.dim] = slice(shard.start, shard.stop)
                    yield name, part[tuple(index)]


def allocate(module: nn.Module, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Storage for a module built on the meta device, already in its final dtype and place,
    so a checkpoint is copied into it tensor by tensor (no full copy in host memory)."""
    return module.to(dtype=dtype).to_empty(device=device)


def _load_into(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], model_dir: Path,
               optional: set[str]) -> set[str]:
    """Copy each (name, tensor) into the module's tensor of that name (casting, and moving
    to its device); returns the names loaded. ValueError when the checkpoint does not fit."""
    expected = module.state_dict()  # detached views of the module's own storage
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, value in tensors:
            if name not in expected:
                unexpected.append(name)
                continue
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"{model_dir}: tensor {name} has shape {tuple(value.shape)}, "
                                 f"the config implies {tuple(expected[name].shape)}")
            expected[name].copy_(value)
            loaded.add(name)
    missing = sorted(set(expected) - loaded - optional)
    if missing or unexpected:
        unexpected.sort()
        raise ValueError(f"checkpoint {model_dir} does not fit the model: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    return loaded


def load_llama(model_dir: Path, dtype: torch.dtype, device: str | torch.device,
               tp: TPGroup = SINGLE) -> LlamaForCausalLM:
    """The model, or with tp > 1 this rank's shard of it (only the shard is read)."""
    cfg = LlamaConfig.read(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    model = allocate(model, dtype, device)
    where = f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else ""
    tensors = iter_tensors(model_dir, f"loading {Path(model_dir).name}{where}", shard_plan(cfg, tp))
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    loaded = _load_into(model, tensors, model_dir, optional)
    if "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
    return finish(model, dtype, device)


def load_eagle3(model_dir: Path, dtype: torch.dtype, device: str | torch.device,
                target_embedding: torch.Tensor | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head; a head without embed_tokens needs target_embedding."""
    cfg = Eagle3Config.read(model_dir)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head = allocate(head, dtype, device)

    def renamed() -> Iterator[tuple[str, torch.Tensor]]:
        has_embedding = False
        for name, value in iter_tensors(model_dir, f"loading {Path(model_dir).name}"):
            has_embedding |= name == "embed_tokens.weight"
            yield (name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.")
                   else name), value
        if not has_embedding:
            if target_embedding is None:
                raise ValueError(f"{model_dir} has no embed_tokens.weight: pass the target "
                                 "checkpoint (--target-model) so the head can use the target's "
                                 "embedding")
            yield "embed_tokens.weight", target_embedding

    loaded = _load_into(head, renamed(), model_dir, optional={"d2t", "t2d"})
    vocab, draft_vocab = cfg.layer.vocab_size, cfg.draft_vocab_size
    if "d2t" not in loaded:  # draft vocabulary == target vocabulary
        if draft_vocab != vocab:
            raise ValueError(f"{model_dir} drafts from {draft_vocab} ids (draft_vocab_size) of "
                             f"the target's {vocab} but has no d2t tensor to map them to "
                             f"target ids")
        head.d2t.zero_()
    targets = torch.arange(draft_vocab, device=head.d2t.device) + head.d2t
    if not (int(targets.min()) >= 0 and int(targets.max()) < vocab):
        raise ValueError(f"{model_dir}: d2t maps draft ids to target ids "
                         f"{int(targets.min())}..{int(targets.max())}, outside the target's "
                         f"vocabulary of {vocab}")
    if "t2d" not in loaded:  # (only training reads it) the draft ids' target ids
        head.t2d.zero_()
        head.t2d[targets] = True
    return finish(head, dtype, device)


def finish(module: nn.Module, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Cast and move; recompute rotary frequencies in float32 (meta construction left them
    empty); fuse the q/k/v and gate/up weights into one GEMM each; and on CUDA run norms,
    rotary and the MLP activation as Triton kernels (use_fused_kernels turns them off)."""
    module = module.to(device=device, dtype=dtype).eval()
    cfg = _owner_config(module)
    for sub in module.modules():
        if isinstance(sub, Rotary):
            sub.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
        if isinstance(sub, (LlamaAttention, LlamaMLP)):
            sub.fuse_weights()
    use_fused_kernels(module, str(device).startswith("cuda") and HAS_TRITON)
    return module


def _owner_config(module: nn.Module) -> LlamaConfig:
    cfg = module.config
    return cfg.layer if isinstance(cfg, Eagle3Config) else cfg
