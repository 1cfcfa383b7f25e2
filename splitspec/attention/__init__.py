"""Attention backends behind one interface (see base.py)."""

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention
from splitspec.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "SeqAttention", "TorchAttentionBackend",
           "make_backend"]


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
