"""Sampling: the target's next-token distribution under temperature, top-k and top-p.

Greedy (temperature 0) picks the argmax. Otherwise logits are divided by the
temperature, cut to the top_k most likely tokens (0 = off), then to the
smallest set whose probability reaches top_p (0 or 1 = off; the most likely
token is always kept), and renormalised. Each request draws from its own
generator, seeded from ``seed`` when given, so a seeded request is
reproducible for a given speculation mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> SamplingParams:
        return cls(pb.temperature, pb.top_k, pb.top_p, pb.seed if pb.HasField("seed") else None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """The request's random stream (None for greedy)."""
        if self.is_greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from, [N, V] float32, for logits [N, V] (not greedy)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if 0 < params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= params.top_p                  # never drops the first token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> list[int]:
    """One token per row of logits [N, V]: the argmax (greedy) or one independent sample."""
    if params.is_greedy:
        return logits.argmax(dim=-1).tolist()
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()
