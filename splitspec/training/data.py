"""Training data: a code corpus, its train / held-out split by file, a BPE tokenizer, blocks.

* **Corpus.** Files under one or more folders (:class:`CorpusSource`): this
  Python's standard library (``*.py``, test folders skipped), its
  site-packages, or any folder of code and text files; read in sorted order of
  their relative paths until a byte budget is spent.
* **Split.** A file is held out when the sha256 of its relative path is 0
  modulo :data:`HELDOUT_MODULUS` (about 5% of the files). The choice depends on
  the path alone, so it is the same on every machine and for every budget;
  held-out files train nothing: not the tokenizer, not the target, not a draft.
* **Tokenizer.** A byte-level BPE (ids 0 and 1 are ``<|endoftext|>`` and
  ``<|pad|>``) that round-trips any text exactly.
* **Blocks.** Documents tokenized, each followed by the EOS id, concatenated
  and cut into fixed-length rows (the tail that does not fill a row is dropped).
* **Prompts.** Held-out snippets that start at a line start, for acceptance
  measurements.
"""

from __future__ import annotations

import hashlib
import math
import random
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from splitspec.training.files import write_json

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1
EOS_ID = 0
MODEL_MAX_LENGTH = 2048
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

HELDOUT_MODULUS = 20
DEFAULT_MAX_CORPUS_BYTES = 64 * 1024 * 1024  # holds all of the standard library
DEFAULT_MAX_FILE_BYTES = 1024 * 1024  # larger files are mostly generated tables

# Folder names whose contents never enter a Python-sources corpus.
PYTHON_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
# ... and those of a user's folder (hidden folders are skipped too).
FOLDER_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})
CODE_SUFFIXES = (
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".js",
    ".ts", ".sh", ".sql", ".html", ".css", ".txt", ".md", ".rst", ".toml", ".yaml", ".yml",
    ".json", ".cfg", ".ini",
)


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class CorpusSource:
    """Where corpus files come from: a folder, the suffixes read, the folder names skipped.

    ``label`` prefixes the relative paths of its files (empty: none), so that
    two sources never give two files the same name.
    """

    folder: Path
    suffixes: tuple[str, ...]
    skip_dirs: frozenset[str]
    label: str = ""
    skip_hidden: bool = False

    def relative(self, path: Path) -> str:
        """The corpus name of ``path``: its path below ``folder``, prefixed with the label."""
        rel = path.relative_to(self.folder).as_posix()
        return f"{self.label}/{rel}" if self.label else rel

    def files(self) -> list[Path]:
        """The files of this source, sorted by relative path."""
        found = []
        for path in self.folder.rglob("*"):
            dirs = path.relative_to(self.folder).parts[:-1]
            if (path.suffix in self.suffixes and self.skip_dirs.isdisjoint(dirs)
                    and not (self.skip_hidden and any(d.startswith(".") for d in dirs))
                    and path.is_file()):
                found.append(path)
        return sorted(found, key=self.relative)

    def describe(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "label": self.label,
                "suffixes": list(self.suffixes), "skipped_dirs": sorted(self.skip_dirs)}


def stdlib_source() -> CorpusSource:
    """This interpreter's standard library, ``*.py``, test folders and site-packages skipped."""
    return CorpusSource(Path(sysconfig.get_paths()["stdlib"]), (".py",), PYTHON_SKIPPED_DIRS)


def site_packages_source() -> CorpusSource:
    """This interpreter's site-packages, ``*.py``, test folders skipped; paths prefixed."""
    folder = Path(sysconfig.get_paths()["purelib"])
    return CorpusSource(folder, (".py",), PYTHON_SKIPPED_DIRS - {"site-packages"},
                        label="site-packages")


def folder_source(folder: Path) -> CorpusSource:
    """A user's folder: every code or text file (:data:`CODE_SUFFIXES`), hidden folders skipped."""
    if not folder.is_dir():
        raise FileNotFoundError(f"corpus folder {folder} does not exist or is not a folder")
    return CorpusSource(folder, CODE_SUFFIXES, FOLDER_SKIPPED_DIRS, skip_hidden=True)


@dataclass
class Corpus:
    """Texts with their corpus names, byte sizes and sha256 digests (one entry per file)."""

    sources: list[CorpusSource]
    files: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def sha256(self) -> str:
        """Digest over every file's name and content digest, in order."""
        lines = "".join(f"{name}\0{digest}\n" for name, digest in zip(self.files, self.digests,
                                                                      strict=True))
        return hashlib.sha256(lines.encode()).hexdigest()

    def subset(self, keep: Sequence[bool]) -> Corpus:
        """The files whose ``keep`` entry is true, in the same order."""
        picked = [i for i, k in enumerate(keep) if k]
        return Corpus(self.sources, [self.files[i] for i in picked],
                      [self.texts[i] for i in picked], [self.sizes[i] for i in picked],
                      [self.digests[i] for i in picked])

    def describe(self) -> dict[str, Any]:
        """The JSON-able description recorded in a manifest."""
        return {
            "sources": [s.describe() for s in self.sources],
            "num_files": len(self.files),
            "bytes": self.num_bytes,
            "sha256": self.sha256,
            "first_file": self.files[0] if self.files else None,
            "last_file": self.files[-1] if self.files else None,
            "python_version": sys.version.split()[0],
        }


def collect_corpus(
    sources: Sequence[CorpusSource],
    max_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    show_progress: bool = True,
) -> Corpus:
    """Read the sources' files in order until the next one would pass ``max_bytes``.

    Files over ``max_file_bytes`` and files with a NUL byte (binary) are
    skipped; text is decoded as UTF-8 (invalid bytes replaced). Raises
    ValueError when nothing was read.
    """
    corpus = Corpus(sources=list(sources))
    paths = [(source, path) for source in sources for path in source.files()]
    for source, path in tqdm(paths, desc="read corpus", unit="file", disable=not show_progress):
        data = path.read_bytes()
        if len(data) > max_file_bytes or b"\0" in data:
            continue
        if corpus.num_bytes + len(data) > max_bytes:
            break
        corpus.files.append(source.relative(path))
        corpus.texts.append(data.decode("utf-8", errors="replace"))
        corpus.sizes.append(len(data))
        corpus.digests.append(hashlib.sha256(data).hexdigest())
    if not corpus.texts:
        folders = ", ".join(str(s.folder) for s in sources)
        raise ValueError(f"no corpus files read from {folders} (suffixes "
                         f"{sorted({x for s in sources for x in s.suffixes})}, "
                         f"max_bytes={max_bytes}, max_file_bytes={max_file_bytes})")
    return corpus


def is_heldout(name: str, modulus: int = HELDOUT_MODULUS) -> bool:
    """Whether the corpus file ``name`` is held out: sha256(name) mod ``modulus`` == 0."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest(), "big") % modulus == 0


class CorpusSplit(NamedTuple):
    train: Corpus
    heldout: Corpus


def split_corpus(corpus: Corpus, modulus: int = HELDOUT_MODULUS) -> CorpusSplit:
    """Split by file with :func:`is_heldout`; raises ValueError when either part is empty."""
    held = [is_heldout(name, modulus) for name in corpus.files]
    split = CorpusSplit(corpus.subset([not h for h in held]), corpus.subset(held))
    if not split.train.files or not split.heldout.files:
        raise ValueError(f"splitting {len(corpus.files)} files (1 in {modulus} held out) left "
                         f"{len(split.train.files)} for training and {len(split.heldout.files)} "
                         f"held out; both need at least one: use a larger corpus")
    return split


def spread_sample(texts: Sequence[str], max_chars: int) -> list[str]:
    """Every k-th text, k chosen so that about ``max_chars`` characters are taken (all if fewer)."""
    total = sum(len(t) for t in texts)
    stride = max(1, math.ceil(total / max_chars))
    return list(texts[::stride])


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int, show_progress: bool = True) -> Any:
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


def load_tokenizer(model_dir: Path) -> Any:
    """The ``tokenizers.Tokenizer`` of ``model_dir``/tokenizer.json."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


# --------------------------------------------------------------------------- tokens


def tokenize(tokenizer: Any, texts: Sequence[str], show_progress: bool = True) -> list[np.ndarray]:
    """Token ids of each text (int32), without special tokens the tokenizer would add."""
    docs = []
    batch = 256
    for start in tqdm(range(0, len(texts), batch), desc="tokenize", unit="batch",
                      disable=not show_progress):
        encodings = tokenizer.encode_batch(list(texts[start:start + batch]),
                                           add_special_tokens=False)
        docs.extend(np.asarray(enc.ids, dtype=np.int32) for enc in encodings)
    return docs


def count_tokens(docs: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each id occurs in ``docs`` (int64 [vocab_size])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in docs:
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def pack_ids(docs: Sequence[np.ndarray], block_len: int, eos_id: int = EOS_ID) -> torch.Tensor:
    """Documents, each followed by ``eos_id``, concatenated and cut into rows [N, block_len].

    The tail that does not fill a row is dropped; raises ValueError when not
    even one row is filled.
    """
    eos = np.asarray([eos_id], dtype=np.int64)
    stream = np.concatenate([part for ids in docs for part in (ids.astype(np.int64), eos)])
    rows = len(stream) // block_len
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one block of {block_len}")
    return torch.from_numpy(stream[:rows * block_len].reshape(rows, block_len).copy())


def pack_blocks(tokenizer: Any, texts: Sequence[str], block_len: int, eos_id: int = EOS_ID,
                show_progress: bool = False) -> torch.Tensor:
    """Tokenize ``texts`` and pack them with :func:`pack_ids` (LongTensor [N, block_len])."""
    return pack_ids(tokenize(tokenizer, texts, show_progress), block_len, eos_id)


# --------------------------------------------------------------------------- prompts


class Prompt(NamedTuple):
    """A held-out snippet: corpus file, 1-based line it starts at, its ids and text."""

    file: str
    line: int
    ids: list[int]
    text: str


def line_starts(text: str) -> list[int]:
    """Character offsets of the lines of ``text`` that hold something besides whitespace."""
    starts, offset = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            starts.append(offset)
        offset += len(line)
    return starts


def heldout_prompts(heldout: Corpus, tokenizer: Any, num: int, prompt_len: int,
                    seed: int = 0) -> list[Prompt]:
    """``num`` snippets of exactly ``prompt_len`` tokens, each starting at a line start.

    Files are visited in a seeded shuffled order (round after round while more
    prompts are needed); in each, a seeded random non-blank line is taken, and
    the file is passed over this round when fewer than ``prompt_len`` tokens
    follow it. Deterministic for a given corpus, tokenizer and seed. Raises
    ValueError when a whole round finds nothing.
    """
    rng = random.Random(seed)
    order = list(range(len(heldout.files)))
    rng.shuffle(order)
    window = prompt_len * 16  # characters: enough for prompt_len tokens of code
    prompts: list[Prompt] = []
    visit, misses = 0, 0  # misses: files visited in a row without a prompt
    while len(prompts) < num:
        if misses == len(order):
            raise ValueError(f"no held-out file has {prompt_len} tokens after a line start")
        index = order[visit % len(order)]
        visit += 1
        text = heldout.texts[index]
        starts = [s for s in line_starts(text) if len(text) - s > prompt_len]
        start = rng.choice(starts) if starts else 0
        ids = tokenizer.encode(text[start:start + window], add_special_tokens=False).ids
        if not starts or len(ids) < prompt_len:
            misses += 1
            continue
        misses = 0
        line = text.count("\n", 0, start) + 1
        prompts.append(Prompt(heldout.files[index], line, ids[:prompt_len],
                              tokenizer.decode(ids[:prompt_len])))
    return prompts
