"""The built-in model pair: a small Llama target and drafts for it, in Hugging Face format.

Built by ``python -m splitspec.builtin.build`` (see its docstring); the files are
committed under models/ so that everything runs with no download.
"""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
BUILTIN_TARGET = MODELS_DIR / "target"
BUILTIN_EAGLE3 = MODELS_DIR / "eagle3"
BUILTIN_DRAFT = MODELS_DIR / "draft"
