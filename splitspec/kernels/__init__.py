"""Triton kernels, each with its torch reference (the tests compare them)."""

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def top_logprobs_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of logits: (log-probabilities [R, k] float32,
    descending; ids [R, k] int64). The draft's tree search on CPU, and the reference of
    splitspec/kernels/top_logprobs.py (here, where no Triton is needed)."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
