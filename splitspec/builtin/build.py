"""Build the built-in models: ``python -m splitspec.builtin.build`` trains them.

The command runs the training pipeline's ``builtin`` preset
(:mod:`splitspec.training.pipeline`) into ``splitspec/builtin/models``:

* ``target/``: a Llama target (6 layers, hidden 256, vocab 2048) trained on the
  standard library's ``*.py`` files (held-out files excepted), bf16, with the
  byte-level BPE tokenizer trained on the same files;
* ``eagle3/``: an EAGLE-3 head trained on the target's features (SGLang / vLLM
  layout, draft vocabulary = the 1024 most frequent train ids);
* ``draft/``: a standalone draft (2 layers, hidden 128) distilled from the target;
* ``manifest.json``: the command, corpus, held-out files, settings, timings,
  held-out quality, and the sha256 and size of every file.

Flags: ``--device cuda`` (about 3 minutes on one H200; on CPU it takes hours),
``--seed``, ``--corpus``, ``--steps-scale`` (e.g. 0.001 for a smoke run),
``--out`` (default: the committed folder). ``--help`` lists them.

The functions below write *random-weight* checkpoints: tests use them to build
small or deliberately mismatched targets and heads in temporary folders
(:func:`write_llama`, :func:`write_eagle3_head`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from splitspec.training import lm
from splitspec.training.files import write_json

DEFAULT_OUT = Path(__file__).resolve().parent / "models"
DEFAULT_SEED = 0
TOKENIZER_VOCAB_SIZE = 2048

INIT_STD = 0.05  # wide, so that random models' greedy choices are not near-ties

# The random test target (the shapes of the first, untrained built-in pair).
TARGET_CONFIG: dict[str, Any] = {
    **lm.BASE_LLAMA_CONFIG,
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "initializer_range": INIT_STD,
}

EAGLE3_DRAFT_VOCAB_SIZE = 1024
EAGLE3_SEED_OFFSET = 1


# --------------------------------------------------------------------------- llama


def llama_config_dict(config_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the random test target's config values with ``config_overrides`` applied."""
    return {**TARGET_CONFIG, **(config_overrides or {})}


def write_llama(
    out_dir: Path,
    config_overrides: dict[str, Any] | None = None,
    seed: int = DEFAULT_SEED,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` (bfloat16 safetensors) into ``out_dir``.

    The config is :data:`TARGET_CONFIG` with ``config_overrides`` applied (any
    ``LlamaConfig`` field, e.g. ``{"vocab_size": 1000}``); weights are drawn
    after seeding with ``seed``. When ``tokenizer_dir`` is given its tokenizer
    files are copied alongside. Returns ``out_dir``.
    """
    model = lm.build_llama(llama_config_dict(config_overrides), seed)
    return lm.save_llama(model, out_dir, tokenizer_dir)


# --------------------------------------------------------------------------- eagle-3


def choose_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Return the ``draft_vocab_size`` most frequent ids (ties by id), id 0 always in, ascending."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} not in 1..{len(counts)}")
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))
    order = order[order != 0]
    return np.sort(np.concatenate([[0], order[: draft_vocab_size - 1]])).astype(np.int64)


def draft_maps(draft_ids: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``d2t`` (int64, target id = draft id + d2t) and ``t2d`` (bool [vocab_size])."""
    ids = torch.as_tensor(draft_ids, dtype=torch.int64)
    d2t = ids - torch.arange(len(ids), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def eagle3_config(
    target: dict[str, Any],
    draft_vocab_size: int = EAGLE3_DRAFT_VOCAB_SIZE,
    config_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return an EAGLE-3 config.json for the target whose config is ``target``.

    The head copies the target's attention shapes unless overridden; no
    ``eagle_config`` is written unless given in ``config_overrides``, so the
    engines' default captured layers (inputs of 2, N//2, N-3) apply.
    """
    hidden = target["hidden_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target.get("intermediate_size", 3 * hidden),
        "num_hidden_layers": 1,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim", hidden // target["num_attention_heads"]),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": target.get("rope_theta", 10000.0),
        "rms_norm_eps": target["rms_norm_eps"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id", 0),
        "eos_token_id": target.get("eos_token_id", 0),
        "torch_dtype": "bfloat16",
    }
    config.update(config_overrides or {})
    return config


def eagle3_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Return name -> shape of every floating-point tensor of an EAGLE-3 head with ``config``."""
    h, ht = config["hidden_size"], config["target_hidden_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    inter = config["intermediate_size"]
    return {
        "fc.weight": (h, 3 * ht),
        "embed_tokens.weight": (config["vocab_size"], h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (config["draft_vocab_size"], h),
    }


def eagle3_tensors(
    config: dict[str, Any], seed: int, embed: torch.Tensor | None = None, embedding: bool = True
) -> dict[str, torch.Tensor]:
    """Return the head's float tensors in bfloat16: normal(0, 0.05) matrices, ones for norms.

    ``embed`` (the target's embedding) is used for ``embed_tokens.weight`` when
    its shape fits; otherwise that tensor is drawn at random too. Without
    ``embedding`` there is none (a draft loading the head reads the target's).
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in eagle3_shapes(config).items():
        if name == "embed_tokens.weight" and not embedding:
            continue
        if len(shape) == 1:
            value = torch.ones(shape)
        elif name == "embed_tokens.weight" and embed is not None and embed.shape == shape:
            value = embed.float()
        else:
            value = torch.randn(shape, generator=gen) * INIT_STD
        tensors[name] = value.to(torch.bfloat16).contiguous()
    return tensors


def write_eagle3_head(
    out_dir: Path,
    target_dir: Path,
    token_counts: np.ndarray | None = None,
    seed: int = DEFAULT_SEED + EAGLE3_SEED_OFFSET,
    draft_vocab_size: int = EAGLE3_DRAFT_VOCAB_SIZE,
    config_overrides: dict[str, Any] | None = None,
    embedding: bool = True,
) -> Path:
    """Save an EAGLE-3 head (config.json + model.safetensors) for the target in ``target_dir``.

    The draft vocabulary is chosen by :func:`choose_draft_vocab` from
    ``token_counts`` (without counts: ids 0..draft_vocab_size-1). The
    embedding is a copy of the target's. ``config_overrides`` change the
    head's config (e.g. ``hidden_size``, ``target_hidden_size``,
    ``eagle_config``) and so the tensor shapes. Without ``embedding`` the head
    has no ``embed_tokens`` (a draft loading it reads the target's; the
    target's weights are not read here). Returns ``out_dir``.
    """
    target = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    config = eagle3_config(target, draft_vocab_size, config_overrides)
    vocab = config["vocab_size"]
    counts = np.zeros(vocab, dtype=np.int64) if token_counts is None else token_counts
    if len(counts) != vocab:
        raise ValueError(f"token_counts has {len(counts)} entries, vocab_size is {vocab}")
    embed = (load_file(target_dir / "model.safetensors").get("model.embed_tokens.weight")
             if embedding else None)
    tensors = eagle3_tensors(config, seed, embed, embedding)
    tensors["d2t"], tensors["t2d"] = draft_maps(
        choose_draft_vocab(counts, config["draft_vocab_size"]), vocab
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Train the built-in models (the pipeline's ``builtin`` preset) from the command line."""
    from splitspec.training import pipeline

    return pipeline.main(argv, prog="python -m splitspec.builtin.build", preset="builtin",
                         default_out=DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
