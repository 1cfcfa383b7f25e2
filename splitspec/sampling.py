"""Sampling: the target's next-token distribution under temperature, top-k and top-p.

Greedy (temperature 0) picks the argmax. Otherwise logits are divided by the
temperature, cut to the top_k most likely tokens (0 = off), then to the
smallest set whose probability reaches top_p (0 or 1 = off; the most likely
token is always kept), and renormalised.

The randomness of a request is a function of its seed and the position of
the token being drawn: the token at position n is the inverse-CDF pick of one
uniform number u(seed, n). So a seeded request gives the same text whether a
step speculated or not (each committed token is the same draw, in the same
context), and without a seed the request gets a random one at admission.
"""

from __future__ import annotations

import random
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

    def with_seed(self) -> SamplingParams:
        """The same parameters with a seed (a random one when none was given)."""
        if self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p,
                              random.SystemRandom().getrandbits(63))


def uniform(seed: int, position: int) -> float:
    """The request's uniform number for the token at ``position`` (deterministic)."""
    return random.Random(f"{seed}:{position}").random()


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


def choose(logits: torch.Tensor, params: SamplingParams, positions: list[int]) -> list[int]:
    """One token per row of logits [N, V]: the argmax (greedy), or the inverse-CDF pick of
    u(seed, positions[i]) from the row's distribution; positions[i] is the position the
    row's token will take in the sequence."""
    if params.is_greedy:
        return logits.argmax(dim=-1).tolist()
    if params.seed is None:
        raise ValueError("sampling needs a seed: use SamplingParams.with_seed()")
    cdf = probabilities(logits, params).cumsum(dim=-1)
    u = torch.tensor([[uniform(params.seed, pos)] for pos in positions], device=cdf.device)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    # Rounding can put u past the last non-zero entry: take the last token with mass.
    last = (cdf < cdf[:, -1:]).sum(dim=-1)
    return torch.minimum(picks, last).tolist()
