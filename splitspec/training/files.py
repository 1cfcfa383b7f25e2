"""Files and provenance: JSON writing, sha256 digests, library versions for manifests."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline; return ``path``."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


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
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
