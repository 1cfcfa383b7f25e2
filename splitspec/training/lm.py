"""Llama causal LMs trained from scratch: one training loop, two losses, evaluation, saving.

* :func:`train_causal_lm`: next-token cross-entropy on packed blocks (a target).
* :func:`distill_causal_lm`: KL(teacher ‖ student) on the teacher's next-token
  distributions, teacher frozen (a standalone draft that imitates the target).

Both run :func:`train_loop`: AdamW (no weight decay on norms), linear warmup
then cosine decay to ``min_lr_ratio`` of the peak, gradient clipping, bf16
autocast on CUDA (fp32 master weights) and plain fp32 on CPU, batches drawn
from seeded per-epoch permutations of the blocks. Same seed, device and
library versions, same weights (on CPU bit for bit; CUDA kernels may differ in
the last bits). Models are transformers' ``LlamaForCausalLM`` (a training-only
dependency: the services use :mod:`splitspec.model`).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from splitspec.training.data import copy_tokenizer
from splitspec.training.files import write_json

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

# Config values every model of this project shares; presets add the sizes.
BASE_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}

LOG_EVERY = 10  # steps between progress-bar loss updates (each one waits for the GPU)


@dataclass(frozen=True)
class TrainConfig:
    """How to train one model (shared by next-token training and distillation)."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    show_progress: bool = True
    desc: str = "train"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16 on CUDA; None (fp32) elsewhere."""
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else None


class TrainResult(NamedTuple):
    model: LlamaForCausalLM
    final_loss: float      # mean loss over the last 5% of the steps
    seconds: float
    tokens: int            # tokens of the batches seen (steps x batch x block length)


LossFn = Callable[["LlamaForCausalLM", torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- models


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def llama_config(values: dict[str, Any]) -> Any:
    """A transformers ``LlamaConfig`` from config.json-style ``values``."""
    from transformers import LlamaConfig

    kwargs = {k: v for k, v in values.items() if k not in ("torch_dtype", "model_type")}
    return LlamaConfig(**kwargs)


def build_llama(values: dict[str, Any], seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 ``LlamaForCausalLM`` (weights drawn after seeding)."""
    from transformers import LlamaForCausalLM

    config = llama_config(values)
    seed_everything(seed)
    return LlamaForCausalLM(config)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- losses


def next_token_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ids[:, 1:] from ids[:, :-1] (ids [B, T])."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def distillation_loss(teacher: LlamaForCausalLM) -> LossFn:
    """KL(teacher ‖ student) per position, summed over the vocabulary, averaged over positions."""

    def loss(student: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logp = F.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
        logp = F.log_softmax(student(input_ids=ids).logits.float(), dim=-1)  # [B, T, V]
        return F.kl_div(logp, target_logp, log_target=True, reduction="none").sum(-1).mean()

    return loss


# --------------------------------------------------------------------------- training


class Schedule(Protocol):
    """What a learning-rate schedule reads from a training config."""

    steps: int
    warmup_steps: int
    min_lr_ratio: float


def lr_factor(step: int, cfg: Schedule) -> float:
    """Multiplier of the peak lr at ``step``: linear warmup, then cosine to ``min_lr_ratio``."""
    warmup = min(cfg.warmup_steps, cfg.steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_rows(num_blocks: int, batch_size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Row indices of successive batches: a fresh seeded permutation each epoch."""
    order = torch.empty(0, dtype=torch.int64)
    while True:
        while len(order) < batch_size:
            order = torch.cat((order, torch.randperm(num_blocks, generator=gen)))
        yield order[:batch_size]
        order = order[batch_size:]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = torch.device(cfg.device).type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def train_loop(model: LlamaForCausalLM, train_blocks: torch.Tensor, cfg: TrainConfig,
               loss_fn: LossFn) -> TrainResult:
    """Train ``model`` in place on ``train_blocks`` [N, T] for ``cfg.steps`` steps of ``loss_fn``."""
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ValueError(f"steps ({cfg.steps}) and batch_size ({cfg.batch_size}) must be >= 1")
    device = torch.device(cfg.device)
    seed_everything(cfg.seed)
    model.to(device).train()
    blocks = train_blocks.to(device)
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    rows = batch_rows(len(blocks), cfg.batch_size, torch.Generator().manual_seed(cfg.seed))
    losses = torch.zeros(cfg.steps, device=device)
    autocast = cfg.autocast_dtype
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=cfg.desc, disable=not cfg.show_progress)
    for step in bar:
        ids = blocks[next(rows).to(device)]
        with torch.autocast(device.type, dtype=autocast or torch.float32,
                            enabled=autocast is not None):
            loss = loss_fn(model, ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        losses[step] = loss.detach()
        if (step + 1) % LOG_EVERY == 0 or step + 1 == cfg.steps:
            recent = losses[max(0, step + 1 - LOG_EVERY):step + 1].mean().item()
            bar.set_postfix(loss=f"{recent:.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
    tail = losses[-max(1, cfg.steps // 20):].mean().item()  # waits for the GPU
    seconds = time.perf_counter() - start
    model.eval()
    return TrainResult(model, tail, seconds, cfg.steps * cfg.batch_size * train_blocks.shape[1])


def train_causal_lm(model_config: dict[str, Any], train_blocks: torch.Tensor,
                    cfg: TrainConfig) -> TrainResult:
    """A ``LlamaForCausalLM`` with ``model_config`` trained from scratch on next-token loss."""
    model = build_llama(model_config, cfg.seed)
    return train_loop(model, train_blocks, cfg, next_token_loss)


def distill_causal_lm(student_config: dict[str, Any], teacher: LlamaForCausalLM,
                      train_blocks: torch.Tensor, cfg: TrainConfig) -> TrainResult:
    """A ``LlamaForCausalLM`` with ``student_config`` trained to match ``teacher`` (frozen).

    The teacher is moved to ``cfg.device``, put in eval mode and its
    parameters stop requiring gradients; it must share the student's vocabulary.
    """
    if teacher.config.vocab_size != student_config["vocab_size"]:
        raise ValueError(f"student vocab_size {student_config['vocab_size']} differs from the "
                         f"teacher's {teacher.config.vocab_size}")
    teacher.to(cfg.device).eval().requires_grad_(False)
    student = build_llama(student_config, cfg.seed)
    return train_loop(student, train_blocks, cfg, distillation_loss(teacher))


# --------------------------------------------------------------------------- evaluation


@contextmanager
def evaluating(device: torch.device) -> Iterator[None]:
    """No gradients; bf16 autocast on CUDA."""
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=device.type == "cuda"):
        yield


def batches(blocks: torch.Tensor, batch_size: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Successive rows of ``blocks`` [N, T], ``batch_size`` at a time, on ``device``."""
    for lo in range(0, len(blocks), batch_size):
        yield blocks[lo:lo + batch_size].to(device)


def perplexity(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int,
               device: str) -> float:
    """exp of the mean next-token cross-entropy over every position of ``blocks`` [N, T]."""
    dev = torch.device(device)
    model.to(dev).eval()
    total, count = 0.0, 0
    with evaluating(dev):
        for ids in batches(blocks, batch_size, dev):
            logits = model(input_ids=ids).logits[:, :-1].float()  # [b, T-1, V]
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(),
                                     reduction="sum").item()
            count += ids[:, 1:].numel()
    return math.exp(total / count)


def agreement(student: LlamaForCausalLM, teacher: LlamaForCausalLM, blocks: torch.Tensor,
              batch_size: int, device: str) -> float:
    """Fraction of positions of ``blocks`` where the two models' argmax tokens are equal."""
    dev = torch.device(device)
    student.to(dev).eval()
    teacher.to(dev).eval()
    same, count = 0, 0
    with evaluating(dev):
        for ids in batches(blocks, batch_size, dev):
            picked = student(input_ids=ids).logits.argmax(-1)  # [b, T]
            same += int((picked == teacher(input_ids=ids).logits.argmax(-1)).sum())
            count += picked.numel()
    return same / count


# --------------------------------------------------------------------------- files


@contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars on or off for the block, then restore them."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if before:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def patch_config_json(path: Path, rope_theta: float, dtype: str) -> None:
    """Add the flat ``rope_theta`` and ``torch_dtype`` keys that older loaders read.

    transformers 5 writes ``rope_parameters`` and ``dtype`` instead; SGLang,
    vLLM and transformers 4 read the older names, and 5 accepts both.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["rope_theta"] = rope_theta
    config["torch_dtype"] = dtype
    write_json(path, config)


def save_llama(model: LlamaForCausalLM, out_dir: Path, tokenizer_dir: Path | None = None,
               show_progress: bool = False) -> Path:
    """Save a bf16 copy of ``model`` (safetensors, config with the flat keys) into ``out_dir``.

    ``model`` itself is left as it is. When ``tokenizer_dir`` is given its
    tokenizer files are copied alongside. Returns ``out_dir``.
    """
    rope = getattr(model.config, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta") or getattr(model.config, "rope_theta", 10000.0))
    bf16 = copy.deepcopy(model).to("cpu", torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    with transformers_progress(show_progress):
        bf16.save_pretrained(out_dir)
    patch_config_json(out_dir / "config.json", rope_theta, "bfloat16")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def load_llama(model_dir: Path, device: str) -> LlamaForCausalLM:
    """A saved checkpoint as an fp32 model in eval mode on ``device`` (bf16 weights widened)."""
    from transformers import LlamaForCausalLM

    with transformers_progress(False):
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()
