"""Attention backends behind one interface (see base.py)."""

import importlib.util

import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.flashinfer_backend import AttentionShape, FlashInferBackend
from splitspec.attention.torch_backend import TorchAttentionBackend

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionShape",
           "FlashInferBackend", "SeqAttention", "TorchAttentionBackend", "choose_backend",
           "make_backend"]

BACKENDS = ("torch", "flashinfer")


def make_backend(name: str, shape: AttentionShape | None = None,
                 device: str = "cpu") -> AttentionBackend:
    """The named backend; flashinfer needs the model's attention shape and a CUDA device."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flashinfer":
        if shape is None:
            raise ValueError("the flashinfer backend needs the attention shape")
        return FlashInferBackend(shape, device)
    raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")


def choose_backend(name: str, device: str, dtype: torch.dtype) -> tuple[str, str]:
    """(backend, why) for --attention-backend name: auto takes flashinfer where it can run."""
    if name != "auto":
        return name, "asked for"
    if not device.startswith("cuda"):
        return "torch", f"auto: torch on {device}"
    if dtype not in (torch.bfloat16, torch.float16):
        return "torch", f"auto: torch for {dtype} (flashinfer needs bfloat16 or float16)"
    if importlib.util.find_spec("flashinfer") is None:
        return "torch", "auto: torch, flashinfer is not installed (pip install flashinfer-python)"
    return "flashinfer", "auto"
