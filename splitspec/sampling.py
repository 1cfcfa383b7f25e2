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

Sampled drafts. A draft may instead draw each node's children from its own
distribution q, without replacement (:func:`draw_without_replacement`), and
send q with the tree. :func:`accept_sampled_tree` then verifies by recursive
rejection sampling: at a node with target distribution p, child x_i is
accepted with probability min(1, p(x_i) / q(x_i)); on rejection p becomes
norm(max(0, p - q)) and x_i leaves q (renormalised); when every child is
rejected the token is drawn from what is left of p. The committed token
follows p exactly, whatever q is, provided the children really were drawn
from q in that order (REFERENCE.md). Its random numbers are u(seed, n, ...)
under tags of their own, so a seeded request is reproducible here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitspec.tree import Acceptance, Proposal, Tree, depths
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

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                         top_p=self.top_p, seed=self.seed)

    def with_seed(self) -> SamplingParams:
        """The same parameters with a seed (a random one when none was given)."""
        if self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p,
                              random.SystemRandom().getrandbits(63))


def uniform(seed: int, position: int, *tags: object) -> float:
    """The request's uniform number for the token at ``position`` (deterministic); tags give
    independent streams for other uses at the same position."""
    return random.Random(":".join(str(part) for part in (seed, position, *tags))).random()


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
    return _inverse_cdf(probabilities(logits, params),
                        [uniform(params.seed, pos) for pos in positions])


def _inverse_cdf(probs: torch.Tensor, u: list[float]) -> list[int]:
    """Per row of probs [N, V] (not necessarily normalised), the token whose CDF interval
    holds u[i] times the row's mass."""
    cdf = probs.cumsum(dim=-1)
    point = torch.tensor(u, dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    picks = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    # Rounding can put u past the last non-zero entry: take the last token with mass.
    last = (cdf < cdf[:, -1:]).sum(dim=-1)
    return torch.minimum(picks, last).tolist()


# ---- sampled drafts --------------------------------------------------------------------


def accept_sampled_tree(tree: Tree, target_probs: torch.Tensor, seed: int,
                        root_position: int) -> Acceptance:
    """Recursive rejection sampling of a sampled tree (see the module docstring).

    ``target_probs`` [n + 1, V] is the target's distribution after every tree
    index (temperature, top-k, top-p applied); ``root_position`` is the root
    token's position, so the token chosen after tree index i takes position
    root_position + 1 + depth(i). Child i of a node at position n is tested
    with u(seed, n, "accept", i); the token drawn from the residual (or after a
    leaf) is the inverse-CDF pick of u(seed, n), as plain sampling draws it.
    The tree must have passed :func:`splitspec.tree.tree_error`.
    """
    children = tree.children()
    depth = depths(tree.parents)
    path: list[int] = []
    node = 0
    while True:
        position = root_position + 1 + depth[node]
        p = target_probs[node]
        kids = children.get(node, [])
        if kids:
            p, accepted = _try_children(p.double(), tree.proposals[node],
                                        [tree.tokens[c - 1] for c in kids], seed, position)
            if accepted is not None:
                node = kids[accepted]
                path.append(node)
                continue
        token = _inverse_cdf(p[None], [uniform(seed, position)])[0]
        return Acceptance(path, [tree.tokens[i - 1] for i in path] + [token])


def _try_children(p: torch.Tensor, proposal: Proposal, drawn: list[int], seed: int,
                  position: int) -> tuple[torch.Tensor, int | None]:
    """Test the children drawn from q in order; (what is left of p, index of the accepted one)."""
    q = torch.zeros_like(p)
    q[torch.tensor(proposal.tokens, dtype=torch.int64, device=p.device)] = torch.tensor(
        proposal.probs, dtype=p.dtype, device=p.device)
    q = q / q.sum()
    for i, token in enumerate(drawn):
        if uniform(seed, position, "accept", i) * float(q[token]) < float(p[token]):
            return p, i
        # Rejected, so p(token) < q(token): the residual has no mass on it.
        residual = (p - q).clamp_min(0.0)
        if residual.sum() > 0:  # zero only when p == q, where rejection cannot happen
            p = residual / residual.sum()
        q[token] = 0.0
        if q.sum() > 0:
            q = q / q.sum()
    return p, None


def proposals(logits: torch.Tensor, params: SamplingParams, support: int,
              to_ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
              ) -> tuple[list[list[int]], list[list[float]]]:
    """A draft's sparse proposal per row of logits [N, V]: its distribution under params
    (temperature, top-k, top-p), cut to the ``support`` most likely tokens and renormalised.
    Returns (row ids, row probabilities), ids the logits' columns mapped by ``to_ids``."""
    probs = probabilities(logits, params)
    values, ids = probs.topk(min(support, probs.shape[-1]), dim=-1)
    values = values / values.sum(dim=-1, keepdim=True)
    out_ids, out_probs = [], []
    for row_ids, row_probs in zip(to_ids(ids).tolist(), values.tolist(), strict=True):
        keep = [i for i, q in enumerate(row_probs) if q > 0]
        out_ids.append([row_ids[i] for i in keep])
        out_probs.append([row_probs[i] for i in keep])
    return out_ids, out_probs


def draw_without_replacement(probs: list[float], uniforms: list[float]) -> list[int]:
    """Indices drawn one per uniform from probs without replacement (each draw by inverse CDF
    over what is left); stops early when no mass is left."""
    left = list(probs)
    picks: list[int] = []
    for u in uniforms:
        total = sum(left)
        if total <= 0:
            break
        point, acc, pick = u * total, 0.0, None
        for i, w in enumerate(left):
            if w > 0:
                acc += w
                pick = i
                if point < acc:
                    break
        picks.append(pick)
        left[pick] = 0.0
    return picks
