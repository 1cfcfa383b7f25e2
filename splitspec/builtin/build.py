"""Build the built-in model files: tokenizer, Llama target, EAGLE-3 head, standalone draft.

Run ``python -m splitspec.builtin.build`` (``--help`` lists the flags). With the
defaults it writes, under ``splitspec/builtin/models``:

* ``target/``: a small random-weight ``LlamaForCausalLM`` (bfloat16, 6 layers,
  hidden 128) saved by ``save_pretrained``, plus the tokenizer files;
* ``eagle3/``: an EAGLE-3 head for that target in the SGLang / vLLM format
  (``LlamaForCausalLMEagle3``; ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
  ``embed_tokens``, ``d2t``, ``t2d``), draft vocabulary = the 1024 most frequent
  target ids of the tokenised corpus;
* ``draft/``: a smaller random-weight ``LlamaForCausalLM`` sharing the tokenizer;
* ``manifest.json``: command, seed, corpus, sha256 and size of every file.

The tokenizer is a byte-level BPE (vocab 2048) trained on the Python standard
library's ``*.py`` files (sorted, test folders and site-packages skipped, capped
in bytes), so the models' vocabulary fits Python source. Weights are random
(seeded); a trained pair comes with the training pipeline.

Everything is deterministic for a given seed, corpus and library versions. The
functions below are also used by tests to build small, deliberately mismatched
checkpoints into temporary folders (see :func:`write_llama` and
:func:`write_eagle3_head`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

DEFAULT_OUT = Path(__file__).resolve().parent / "models"
DEFAULT_SEED = 0
DEFAULT_MAX_CORPUS_BYTES = 8 * 1024 * 1024

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1
TOKENIZER_VOCAB_SIZE = 2048
MODEL_MAX_LENGTH = 2048
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Folder names whose contents never enter the corpus.
SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)

INIT_STD = 0.05
WEIGHTS_NOTE = "random weights (trained pair comes with the training pipeline)"

TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": INIT_STD,
    "torch_dtype": "bfloat16",
}

DRAFT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

EAGLE3_DRAFT_VOCAB_SIZE = 1024

# Seed offsets so that the three models never share a random stream.
TARGET_SEED_OFFSET = 0
EAGLE3_SEED_OFFSET = 1
DRAFT_SEED_OFFSET = 2


@dataclass
class Corpus:
    """Texts read for the tokenizer, with what is needed to describe them."""

    folder: Path
    files: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_bytes: int = 0
    sha256: str = ""

    def describe(self) -> dict[str, Any]:
        """Return the JSON-able description recorded in the manifest."""
        return {
            "folder": str(self.folder),
            "num_files": len(self.files),
            "bytes": self.num_bytes,
            "sha256": self.sha256,
            "first_file": self.files[0] if self.files else None,
            "last_file": self.files[-1] if self.files else None,
            "python_version": sys.version.split()[0],
        }


# --------------------------------------------------------------------------- corpus


def default_corpus_dir() -> Path:
    """Return the folder of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path) -> list[Path]:
    """Return the ``*.py`` files under ``folder``, sorted by relative path, test folders skipped."""
    found = []
    for path in folder.rglob("*.py"):
        rel = path.relative_to(folder)
        if SKIPPED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def collect_corpus(
    folder: Path, max_bytes: int = DEFAULT_MAX_CORPUS_BYTES, show_progress: bool = True
) -> Corpus:
    """Read files in order until the next one would pass ``max_bytes``; decode as UTF-8."""
    corpus = Corpus(folder=folder)
    digest = hashlib.sha256()
    for path in tqdm(corpus_files(folder), desc="read corpus", disable=not show_progress):
        data = path.read_bytes()
        if corpus.num_bytes + len(data) > max_bytes:
            break
        corpus.files.append(path.relative_to(folder).as_posix())
        corpus.texts.append(data.decode("utf-8", errors="replace"))
        corpus.num_bytes += len(data)
        digest.update(data)
    if not corpus.texts:
        raise ValueError(f"no *.py files read from {folder} (max_bytes={max_bytes})")
    corpus.sha256 = digest.hexdigest()
    return corpus


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(
    texts: Sequence[str], vocab_size: int = TOKENIZER_VOCAB_SIZE, show_progress: bool = True
) -> Any:
    """Train a byte-level BPE (no normaliser, no prefix space) on ``texts``; return it.

    Ids 0 and 1 are ``<|endoftext|>`` and ``<|pad|>``; every byte is in the
    initial alphabet, so any text encodes, and decoding gives the text back.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """Return tokenizer_config.json for ``AutoTokenizer`` (a plain PreTrainedTokenizerFast)."""
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
    }


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_tokenizer(tokenizer: Any, out_dir: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_path = out_dir / "tokenizer.json"
    tokenizer.save(str(tok_path), pretty=False)
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    return [
        tok_path,
        write_json(out_dir / "tokenizer_config.json", tokenizer_config()),
        write_json(out_dir / "special_tokens_map.json", special),
    ]


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> list[Path]:
    """Copy the tokenizer files from ``src_dir`` to ``dst_dir``."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(src_dir / name, dst_dir / name)) for name in TOKENIZER_FILES]


def count_tokens(tokenizer: Any, texts: Sequence[str], show_progress: bool = True) -> np.ndarray:
    """Return how often each token id occurs in ``texts`` (int64, length = vocab size)."""
    counts = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    batch = 64
    for start in tqdm(range(0, len(texts), batch), desc="count tokens", disable=not show_progress):
        for enc in tokenizer.encode_batch(list(texts[start : start + batch])):
            counts += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=len(counts))
    return counts


# --------------------------------------------------------------------------- llama


def llama_config_dict(config_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the target's config values with ``config_overrides`` applied."""
    values = dict(TARGET_CONFIG)
    values.update(config_overrides or {})
    return values


def patch_config_json(path: Path, values: dict[str, Any]) -> None:
    """Add the flat ``rope_theta`` and ``torch_dtype`` keys that older loaders read.

    transformers 5 writes ``rope_parameters`` and ``dtype`` instead; SGLang,
    vLLM and transformers 4 read the older names, and 5 accepts both.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["rope_theta"] = values["rope_theta"]
    config["torch_dtype"] = values["torch_dtype"]
    write_json(path, config)


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


def write_llama(
    out_dir: Path,
    config_overrides: dict[str, Any] | None = None,
    seed: int = DEFAULT_SEED,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` (bfloat16 safetensors) into ``out_dir``.

    The config is the built-in target's with ``config_overrides`` applied (any
    ``LlamaConfig`` field, e.g. ``{"vocab_size": 1000}``); weights are drawn
    after ``torch.manual_seed(seed)``. When ``tokenizer_dir`` is given its
    tokenizer files are copied alongside. Returns ``out_dir``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    values = llama_config_dict(config_overrides)
    kwargs = {k: v for k, v in values.items() if k not in ("torch_dtype", "model_type")}
    config = LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, values["torch_dtype"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    patch_config_json(out_dir / "config.json", values)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


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
    config: dict[str, Any], seed: int, embed: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Return the head's float tensors in bfloat16: normal(0, 0.05) matrices, ones for norms.

    ``embed`` (the target's embedding) is used for ``embed_tokens.weight`` when
    its shape fits; otherwise that tensor is drawn at random too.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in eagle3_shapes(config).items():
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
) -> Path:
    """Save an EAGLE-3 head (config.json + model.safetensors) for the target in ``target_dir``.

    The draft vocabulary is chosen by :func:`choose_draft_vocab` from
    ``token_counts`` (without counts: ids 0..draft_vocab_size-1). The
    embedding is a copy of the target's. ``config_overrides`` change the
    head's config (e.g. ``hidden_size``, ``target_hidden_size``,
    ``eagle_config``) and so the tensor shapes. Returns ``out_dir``.
    """
    target = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    config = eagle3_config(target, draft_vocab_size, config_overrides)
    vocab = config["vocab_size"]
    counts = np.zeros(vocab, dtype=np.int64) if token_counts is None else token_counts
    if len(counts) != vocab:
        raise ValueError(f"token_counts has {len(counts)} entries, vocab_size is {vocab}")
    embed = load_file(target_dir / "model.safetensors").get("model.embed_tokens.weight")
    tensors = eagle3_tensors(config, seed, embed)
    tensors["d2t"], tensors["t2d"] = draft_maps(
        choose_draft_vocab(counts, config["draft_vocab_size"]), vocab
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    return out_dir


# --------------------------------------------------------------------------- manifest


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(root: Path, folders: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Return relative path -> {sha256, bytes} for every file under ``root``/``folders``."""
    paths = sorted(p for name in folders for p in (root / name).rglob("*") if p.is_file())
    return {
        p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in paths
    }


def library_versions() -> dict[str, str]:
    """Return the versions of the libraries whose output the files depend on."""
    import safetensors
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def write_manifest(
    out_dir: Path, command: str, seed: int, corpus: Corpus, folders: Sequence[str]
) -> Path:
    """Write ``out_dir``/manifest.json describing how the files were made and their digests."""
    manifest = {
        "command": command,
        "seed": seed,
        "note": WEIGHTS_NOTE,
        "corpus": corpus.describe(),
        "versions": library_versions(),
        "files": file_digests(out_dir, folders),
    }
    return write_json(out_dir / "manifest.json", manifest)


# --------------------------------------------------------------------------- build


def build_all(
    out_dir: Path = DEFAULT_OUT,
    seed: int = DEFAULT_SEED,
    corpus_dir: Path | None = None,
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
    command: str | None = None,
    show_progress: bool = True,
) -> Path:
    """Build target/, eagle3/, draft/ and manifest.json under ``out_dir``; return ``out_dir``.

    Those three folders are removed first, so no stale file survives.
    """
    folders = ("target", "eagle3", "draft")
    for name in folders:
        if (out_dir / name).exists():
            shutil.rmtree(out_dir / name)
    corpus = collect_corpus(corpus_dir or default_corpus_dir(), max_corpus_bytes, show_progress)
    tokenizer = train_tokenizer(corpus.texts, TOKENIZER_VOCAB_SIZE, show_progress)
    target_dir = out_dir / "target"
    write_tokenizer(tokenizer, target_dir)
    counts = count_tokens(tokenizer, corpus.texts, show_progress)
    # A small --corpus may not reach the full vocabulary: size the models to the tokenizer.
    vocab = tokenizer.get_vocab_size()
    draft_vocab = min(EAGLE3_DRAFT_VOCAB_SIZE, vocab)
    with transformers_progress(show_progress):
        steps = tqdm(total=3, desc="write models", disable=not show_progress)
        write_llama(target_dir, {"vocab_size": vocab}, seed + TARGET_SEED_OFFSET)
        steps.update()
        write_eagle3_head(
            out_dir / "eagle3", target_dir, counts, seed + EAGLE3_SEED_OFFSET, draft_vocab
        )
        steps.update()
        draft_overrides = {**DRAFT_OVERRIDES, "vocab_size": vocab}
        write_llama(out_dir / "draft", draft_overrides, seed + DRAFT_SEED_OFFSET, target_dir)
        steps.update()
        steps.close()
    command = command or f"build_all(out_dir={str(out_dir)!r}, seed={seed})"
    write_manifest(out_dir, command, seed, corpus, folders)
    return out_dir


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m splitspec.builtin.build",
        description="Build the built-in tokenizer, Llama target, EAGLE-3 head and standalone "
        "draft (random weights) and a manifest of their sha256 digests.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output folder; its target/, eagle3/ and draft/ subfolders are replaced "
        "(default: splitspec/builtin/models)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="base random seed; target, EAGLE-3 head and draft use seed+0, +1, +2 (default: 0)",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="folder of *.py files to train the tokenizer on and to count tokens for the "
        "EAGLE-3 draft vocabulary (default: this Python's standard library)",
    )
    parser.add_argument(
        "--max-corpus-bytes",
        type=int,
        default=DEFAULT_MAX_CORPUS_BYTES,
        help="stop reading corpus files before this many bytes (default: 8 MiB)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the build from the command line."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_list)
    command = shlex.join(["python", "-m", "splitspec.builtin.build", *args_list])
    out = build_all(
        args.out, args.seed, args.corpus, args.max_corpus_bytes, command, not args.quiet
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
