"""The training pipeline: corpus -> tokenizer -> target -> EAGLE-3 head -> standalone draft.

    python -m splitspec.training.pipeline --preset builtin --out /tmp/pair --device cuda
    python -m splitspec.training.pipeline --preset bench --out /tmp/bench --device cuda
    python -m splitspec.training.pipeline --preset builtin --out /tmp/smoke --steps-scale 0.01

One run, in order: read the corpus and split it by file (held-out files train
nothing); train a byte-level BPE on the train split; pack the train split into
blocks; train the target (next-token loss); train an EAGLE-3 head on the saved
target's features (training-time test); distill a standalone draft from the
saved target; measure everything on held-out blocks; write

* ``OUT/target``: bf16 safetensors, config.json (with the flat ``rope_theta`` /
  ``torch_dtype`` keys SGLang and vLLM read), tokenizer files;
* ``OUT/eagle3``: the head in the SGLang / vLLM layout;
* ``OUT/draft``: the standalone draft, bf16, tokenizer files;
* ``OUT/manifest.json``: the command, seed, preset, corpus (with the held-out
  files), library versions, training settings and timings, held-out quality,
  and the sha256 and size of every file.

Presets: ``builtin`` (the pair committed under ``splitspec/builtin/models``,
under :data:`BUILTIN_MAX_BYTES` in all; ``python -m splitspec.builtin.build``
runs it) and ``bench`` (a ~170M-parameter target for GPU benchmarks; its
weights are not committed). ``--steps-scale`` multiplies every step count
(e.g. 0.01 for a CPU smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from splitspec.training import data, lm
from splitspec.training.files import file_digests, library_versions, write_json

MODEL_FOLDERS = ("target", "eagle3", "draft")
BUILTIN_MAX_BYTES = 15 * 2**20
# Seed offsets so that the three models never share a random stream.
TARGET_SEED_OFFSET, EAGLE3_SEED_OFFSET, DRAFT_SEED_OFFSET = 0, 1, 2


@dataclass(frozen=True)
class Stage:
    """Training settings of one model."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 100

    def scaled(self, factor: float) -> Stage:
        """The same stage with ``steps`` (and warmup) multiplied by ``factor``, at least 1."""
        return dataclasses.replace(self, steps=max(1, round(self.steps * factor)),
                                   warmup_steps=max(1, round(self.warmup_steps * factor)))


@dataclass(frozen=True)
class Preset:
    """Everything a pipeline run needs besides the seed, the device and the output folder."""

    name: str
    corpus: tuple[str, ...]             # default sources: "stdlib", "site-packages"
    max_corpus_bytes: int
    tokenizer_vocab: int
    tokenizer_sample_chars: int         # the BPE is trained on about this much train text
    block_len: int
    target: dict[str, Any]              # LlamaConfig sizes of the target
    draft: dict[str, Any]               # ... and of the standalone draft
    draft_vocab_size: int               # EAGLE-3 draft vocabulary (most frequent train ids)
    ttt_steps: int
    target_train: Stage
    eagle3_train: Stage
    draft_train: Stage
    head_overrides: dict[str, Any] = field(default_factory=dict)
    eval_blocks: int = 64               # held-out blocks every quality figure is measured on
    eval_batch_size: int = 16
    max_total_bytes: int | None = None  # of target/, eagle3/ and draft/ together

    def scaled(self, factor: float) -> Preset:
        """This preset with every training stage's steps multiplied by ``factor``."""
        return dataclasses.replace(self, target_train=self.target_train.scaled(factor),
                                   eagle3_train=self.eagle3_train.scaled(factor),
                                   draft_train=self.draft_train.scaled(factor))


PRESETS: dict[str, Preset] = {
    "builtin": Preset(
        name="builtin",
        corpus=("stdlib",),
        max_corpus_bytes=data.DEFAULT_MAX_CORPUS_BYTES,
        tokenizer_vocab=2048,
        tokenizer_sample_chars=16 * 2**20,
        block_len=256,
        target={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
        draft={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
        draft_vocab_size=1024,
        ttt_steps=4,
        # One H200 (measured): target 31 ms/step, head 40 ms/step, draft 20 ms/step, the
        # rest about 15 s. The standard library is ~3.1M train tokens: 3200 target steps
        # (17 epochs) memorised it (held-out perplexity 15.8, EAGLE-3 step-0 accuracy 0.50),
        # 1600 gave 10.6 / 0.60 and 800 gave 12.1 / 0.68; 1200 sits between.
        target_train=Stage(steps=1200, batch_size=64, lr=2e-3, warmup_steps=100),
        eagle3_train=Stage(steps=2400, batch_size=32, lr=2e-3, warmup_steps=100),
        draft_train=Stage(steps=2500, batch_size=64, lr=3e-3, warmup_steps=100),
        max_total_bytes=BUILTIN_MAX_BYTES,
    ),
    "bench": Preset(
        name="bench",
        corpus=("stdlib", "site-packages"),
        max_corpus_bytes=128 * 2**20,
        tokenizer_vocab=16384,
        tokenizer_sample_chars=16 * 2**20,
        block_len=1024,
        target={"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                "max_position_embeddings": 4096},
        draft={"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
               "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
               "max_position_embeddings": 4096},
        draft_vocab_size=8192,
        ttt_steps=4,
        # One H200 (measured): target 289 ms/step, head 146 ms/step, draft 80 ms/step;
        # reading, the tokenizer and tokenizing 96 MiB took 31 s.
        target_train=Stage(steps=900, batch_size=64, lr=1e-3, warmup_steps=60),
        eagle3_train=Stage(steps=550, batch_size=16, lr=1e-3, warmup_steps=40),
        draft_train=Stage(steps=650, batch_size=32, lr=2e-3, warmup_steps=40),
        eval_blocks=64,
    ),
}


# --------------------------------------------------------------------------- pieces


def corpus_sources(preset: Preset, corpus_dir: Path | None) -> list[data.CorpusSource]:
    """``corpus_dir`` when given, else the preset's default sources."""
    if corpus_dir is not None:
        return [data.folder_source(corpus_dir)]
    makers = {"stdlib": data.stdlib_source, "site-packages": data.site_packages_source}
    return [makers[name]() for name in preset.corpus]


def model_values(preset: Preset, sizes: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """config.json values of a model of the preset."""
    return {**lm.BASE_LLAMA_CONFIG, **sizes, "vocab_size": vocab_size}


def predicted_bytes(preset: Preset, vocab_size: int) -> int:
    """bf16 weight bytes of the three models, from their configs (no weights are made)."""
    from transformers import LlamaForCausalLM

    from splitspec.model.config import Eagle3Config
    from splitspec.model.eagle3 import Eagle3Head
    from splitspec.training.eagle3 import head_config

    target = model_values(preset, preset.target, vocab_size)
    head = head_config(target, min(preset.draft_vocab_size, vocab_size), preset.head_overrides)
    with torch.device("meta"):
        models = [LlamaForCausalLM(lm.llama_config(target)),
                  LlamaForCausalLM(lm.llama_config(model_values(preset, preset.draft, vocab_size))),
                  Eagle3Head(Eagle3Config.from_hf(head))]
    return 2 * sum(lm.num_parameters(m) for m in models)


def check_size(preset: Preset, num_bytes: int, what: str) -> None:
    """Raise RuntimeError when ``num_bytes`` passes the preset's limit."""
    limit = preset.max_total_bytes
    if limit is not None and num_bytes > limit:
        raise RuntimeError(f"the {preset.name} preset's {what} is {num_bytes / 2**20:.2f} MiB, "
                           f"over its limit of {limit / 2**20:.1f} MiB: shrink the models")


def folder_bytes(out_dir: Path) -> int:
    return sum(p.stat().st_size for name in MODEL_FOLDERS for p in (out_dir / name).rglob("*")
               if p.is_file())


def describe_corpus(corpus: data.Corpus, split: data.CorpusSplit) -> dict[str, Any]:
    """The corpus, its train part and its held-out part (with the held-out file names)."""
    return {
        **corpus.describe(),
        "heldout_rule": f"sha256(relative path) % {data.HELDOUT_MODULUS} == 0",
        "train": {"num_files": len(split.train.files), "bytes": split.train.num_bytes,
                  "sha256": split.train.sha256},
        "heldout": {"num_files": len(split.heldout.files), "bytes": split.heldout.num_bytes,
                    "sha256": split.heldout.sha256, "files": split.heldout.files},
    }


def head_parameters(head_dir: Path) -> int:
    """Parameters of a saved EAGLE-3 head (its float tensors; d2t and t2d are maps)."""
    from safetensors import safe_open

    with safe_open(head_dir / "model.safetensors", "pt") as f:
        return sum(torch.Size(f.get_slice(k).get_shape()).numel()
                   for k in f.keys() if k not in ("d2t", "t2d"))  # noqa: SIM118


def train_record(stage: Stage, seed: int, final_loss: float, seconds: float) -> dict[str, Any]:
    return {**dataclasses.asdict(stage), "seed": seed, "final_loss": final_loss,
            "seconds": round(seconds, 2)}


# --------------------------------------------------------------------------- stages


class Stopwatch:
    """Seconds per named stage, printed as each one ends."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.timings: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        """Record and print the time since the previous lap under ``name``; return it."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.timings[name] = round(seconds, 2)
        tqdm.write(f"[{self.label}] {name}: {seconds:.1f}s")
        return seconds

    def total(self) -> float:
        return round(time.perf_counter() - self._start, 2)


@dataclass
class Prepared:
    """The data every model is trained and measured on."""

    corpus: data.Corpus
    split: data.CorpusSplit
    tokenizer: Any
    tokenizer_sample: list[str]
    train_blocks: torch.Tensor  # [N, block_len], train files only
    token_counts: np.ndarray    # [vocab] over the train files (picks the EAGLE-3 draft vocabulary)
    eval_blocks: torch.Tensor   # [<= eval_blocks, block_len], held-out files only

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def prepare_data(preset: Preset, corpus_dir: Path | None, show_progress: bool,
                 watch: Stopwatch) -> Prepared:
    """Corpus and split, the tokenizer (train files only, size-checked), the blocks."""
    corpus = data.collect_corpus(corpus_sources(preset, corpus_dir), preset.max_corpus_bytes,
                                 show_progress=show_progress)
    split = data.split_corpus(corpus)
    watch.lap("corpus_s")
    sample = data.spread_sample(split.train.texts, preset.tokenizer_sample_chars)
    tokenizer = data.train_tokenizer(sample, preset.tokenizer_vocab, show_progress)
    # A small --corpus may not reach the preset's vocabulary size: the models follow it.
    check_size(preset, predicted_bytes(preset, tokenizer.get_vocab_size()), "predicted size")
    watch.lap("tokenizer_s")
    docs = data.tokenize(tokenizer, split.train.texts, show_progress)
    eval_blocks = data.pack_blocks(tokenizer, split.heldout.texts, preset.block_len)
    prepared = Prepared(corpus, split, tokenizer, sample, data.pack_ids(docs, preset.block_len),
                        data.count_tokens(docs, tokenizer.get_vocab_size()),
                        eval_blocks[:preset.eval_blocks])
    watch.lap("tokenize_s")
    return prepared


def evaluate(preset: Preset, out_dir: Path, target: Any, draft: Any, eval_blocks: torch.Tensor,
             device: str) -> dict[str, Any]:
    """Held-out quality of the saved target, EAGLE-3 head and standalone draft."""
    from splitspec.training.eagle3 import evaluate_eagle3

    batch = preset.eval_batch_size
    return {
        "heldout_blocks": len(eval_blocks),
        "block_len": preset.block_len,
        "target_perplexity": lm.perplexity(target, eval_blocks, batch, device),
        "eagle3_step_accuracy": evaluate_eagle3(out_dir / "eagle3", out_dir / "target",
                                                eval_blocks, preset.ttt_steps, device, batch),
        "draft_perplexity": lm.perplexity(draft, eval_blocks, batch, device),
        "draft_agreement": lm.agreement(draft, target, eval_blocks, batch, device),
    }


def run_pipeline(preset: Preset, out_dir: Path, device: str = "cpu", seed: int = 0,
                 corpus_dir: Path | None = None, command: str = "",
                 show_progress: bool = True) -> dict[str, Any]:
    """Run every stage for ``preset`` (already scaled) into ``out_dir``; return the manifest.

    ``out_dir``'s target/, eagle3/ and draft/ folders are replaced. Raises
    RuntimeError when the models would pass the preset's size limit (before
    training, from the configs, and after, from the files).
    """
    from splitspec.training.eagle3 import Eagle3TrainConfig, train_eagle3

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    watch = Stopwatch(preset.name)
    prep = prepare_data(preset, corpus_dir, show_progress, watch)
    for name in MODEL_FOLDERS:
        if (out_dir / name).exists():
            shutil.rmtree(out_dir / name)
    target_dir, eagle3_dir, draft_dir = (out_dir / name for name in MODEL_FOLDERS)
    data.write_tokenizer(prep.tokenizer, target_dir)
    records: dict[str, Any] = {}

    target_values = model_values(preset, preset.target, prep.vocab_size)
    cfg = lm.TrainConfig(**dataclasses.asdict(preset.target_train), device=device,
                         seed=seed + TARGET_SEED_OFFSET, show_progress=show_progress,
                         desc="target")
    trained = lm.train_causal_lm(target_values, prep.train_blocks, cfg)
    lm.save_llama(trained.model, target_dir)
    records["target"] = {"config": target_values, "parameters": lm.num_parameters(trained.model),
                         "train": train_record(preset.target_train, cfg.seed, trained.final_loss,
                                               trained.seconds)}
    del trained  # the saved bf16 weights are what the drafts learn from and what is measured
    watch.lap("target_s")

    head_cfg = Eagle3TrainConfig(
        steps=preset.eagle3_train.steps, batch_size=preset.eagle3_train.batch_size,
        lr=preset.eagle3_train.lr, warmup_steps=preset.eagle3_train.warmup_steps,
        ttt_steps=preset.ttt_steps, seed=seed + EAGLE3_SEED_OFFSET, device=device,
        draft_vocab_size=min(preset.draft_vocab_size, prep.vocab_size),
        head_overrides=preset.head_overrides, show_progress=show_progress)
    head = train_eagle3(target_dir, prep.train_blocks, eagle3_dir, head_cfg, prep.token_counts)
    records["eagle3"] = {"parameters": head_parameters(eagle3_dir), "ttt_steps": preset.ttt_steps,
                         "draft_vocab_size": head_cfg.draft_vocab_size,
                         "train_step_accuracy": head.step_accuracy,
                         "train": train_record(preset.eagle3_train, head_cfg.seed, head.final_loss,
                                               watch.lap("eagle3_s"))}

    target = lm.load_llama(target_dir, device)
    draft_values = model_values(preset, preset.draft, prep.vocab_size)
    cfg = lm.TrainConfig(**dataclasses.asdict(preset.draft_train), device=device,
                         seed=seed + DRAFT_SEED_OFFSET, show_progress=show_progress,
                         desc="draft (distill)")
    distilled = lm.distill_causal_lm(draft_values, target, prep.train_blocks, cfg)
    lm.save_llama(distilled.model, draft_dir, tokenizer_dir=target_dir)
    records["draft"] = {"config": draft_values, "parameters": lm.num_parameters(distilled.model),
                        "train": train_record(preset.draft_train, cfg.seed, distilled.final_loss,
                                              distilled.seconds)}
    del distilled
    watch.lap("draft_s")

    quality = evaluate(preset, out_dir, target, lm.load_llama(draft_dir, device),
                       prep.eval_blocks, device)
    watch.lap("evaluate_s")
    manifest = {
        "command": command,
        "preset": dataclasses.asdict(preset),
        "seed": seed,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "corpus": describe_corpus(prep.corpus, prep.split),
        "tokenizer": {"vocab_size": prep.vocab_size,
                      "trained_on_files": len(prep.tokenizer_sample),
                      "trained_on_chars": sum(len(t) for t in prep.tokenizer_sample)},
        "tokens": {"train_blocks": len(prep.train_blocks), "block_len": preset.block_len,
                   "train_tokens": prep.train_blocks.numel()},
        "models": records,
        "quality": quality,
        "timings_s": {**watch.timings, "total_s": watch.total()},
        "versions": library_versions(),
        "total_bytes": folder_bytes(out_dir),
        "files": file_digests(out_dir, MODEL_FOLDERS),
    }
    write_json(out_dir / "manifest.json", manifest)
    check_size(preset, manifest["total_bytes"], "output")
    return manifest


# --------------------------------------------------------------------------- command line


def build_parser(prog: str, preset: str | None = None,
                 default_out: Path | None = None) -> argparse.ArgumentParser:
    """The flags; ``preset`` fixes the preset (no --preset flag), ``default_out`` --out's default."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a tokenizer, a Llama target, an EAGLE-3 head and a standalone draft "
                    "on a code corpus, measure them on held-out files, write a manifest.")
    if preset is None:
        parser.add_argument("--preset", choices=sorted(PRESETS), required=True,
                            help="model sizes and training budget")
    parser.set_defaults(preset=preset)
    if default_out is None:
        parser.add_argument("--out", type=Path, required=True,
                            help="output folder (its target/, eagle3/, draft/ are replaced)")
    else:
        parser.add_argument("--out", type=Path, default=default_out,
                            help="output folder (its target/, eagle3/, draft/ are replaced)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed; target, EAGLE-3 head and draft use seed+0, +1, +2")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="folder of code / text files to train on instead of the preset's "
                             "(builtin: the standard library; bench: it and site-packages)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply every training stage's steps (e.g. 0.01 for a smoke run)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m splitspec.training.pipeline",
         preset: str | None = None, default_out: Path | None = None) -> int:
    """Run the pipeline from the command line; print the quality figures."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog, preset, default_out).parse_args(args_list)
    if args.steps_scale <= 0:
        raise SystemExit(f"{prog}: --steps-scale must be positive, got {args.steps_scale}")
    chosen = PRESETS[args.preset].scaled(args.steps_scale)
    command = shlex.join([*prog.split(), *args_list])
    manifest = run_pipeline(chosen, args.out, args.device, args.seed, args.corpus, command,
                            not args.quiet)
    quality = manifest["quality"]
    print(f"wrote {args.out} ({manifest['total_bytes'] / 2**20:.2f} MiB) in "
          f"{manifest['timings_s']['total_s']:.0f}s; held-out: target perplexity "
          f"{quality['target_perplexity']:.2f}, EAGLE-3 step accuracy "
          f"{' '.join(f'{a:.3f}' for a in quality['eagle3_step_accuracy'])}, draft perplexity "
          f"{quality['draft_perplexity']:.2f}, draft agreement {quality['draft_agreement']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
