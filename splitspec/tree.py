"""Token trees: validation, attention masks, positions, and greedy acceptance.

A tree travels as ``(tokens, parents)`` (draft.proto ``DraftTree``): node i of
``tokens`` has tree index i + 1, index 0 is the root (the last committed token),
and ``parents[i]`` is the tree index of node i's parent, so
``0 <= parents[i] <= i``: parents precede children. Everything else (depths,
masks, positions, the accepted path) is derived here by pure functions.

A *sampled* tree also carries ``proposals``: for every tree index, the sparse
distribution q its children were drawn from (without replacement, in index
order). It is verified by :func:`splitspec.sampling.accept_sampled_tree`.

Only the masks and positions are tensors; this module imports torch for them alone, when
they are first built, so that what reads trees without building one (the gateway's policy,
the ``splitspec`` client commands) starts without loading torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

PROPOSAL_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed for a proposal sent as float32
# The small budget, a chain of this many nodes, that the gateway's adaptive policy tries
# besides the draft's own shape (under load a verify step's cost grows with its rows); the
# target captures verify graphs for it by default.
SMALL_CHAIN = 3


class Proposal(NamedTuple):
    """A sparse distribution: probs[i] = q(tokens[i]); empty for a node without children."""

    tokens: list[int]
    probs: list[float]


class Tree(NamedTuple):
    tokens: list[int]   # drafted nodes, tree indices 1..len(tokens)
    parents: list[int]  # tree index of each node's parent (0 = root)
    proposals: tuple[Proposal, ...] = ()  # sampled trees: one per tree index; () = top-k tree

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        """Tree index -> its children's tree indices, in index order."""
        out: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents, start=1):
            out.setdefault(parent, []).append(i)
        return out


EMPTY_TREE = Tree([], [])


def tree_error(tree: Tree, vocab_size: int, max_nodes: int) -> str | None:
    """Why the tree must not be verified, or None when it is well formed and within budget."""
    if len(tree.tokens) != len(tree.parents):
        return f"{len(tree.tokens)} tokens but {len(tree.parents)} parents"
    if len(tree.tokens) > max_nodes:
        return f"{len(tree.tokens)} nodes exceed the budget of {max_nodes}"
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        if not 0 <= token < vocab_size:
            return f"node {i + 1} has token {token} outside the vocabulary [0, {vocab_size})"
        if not 0 <= parent <= i:
            return f"node {i + 1} has parent {parent}; parents must precede children (0 <= parent <= {i})"
    return _proposals_error(tree, vocab_size) if tree.proposals else None


def _proposals_error(tree: Tree, vocab_size: int) -> str | None:
    """Why a sampled tree's proposals cannot be verified against: each node with children
    needs a distribution (non-negative, summing to 1, over distinct in-vocabulary ids) in
    which its children are distinct tokens of positive probability."""
    if len(tree.proposals) != tree.num_nodes + 1:
        return f"{len(tree.proposals)} proposals for {tree.num_nodes + 1} tree indices"
    for index, kids in tree.children().items():
        tokens, probs = tree.proposals[index]
        where = f"proposal of tree index {index}"
        if len(tokens) != len(probs):
            return f"{where} has {len(tokens)} tokens but {len(probs)} probabilities"
        if len(set(tokens)) != len(tokens) or any(not 0 <= t < vocab_size for t in tokens):
            return f"{where} repeats a token or leaves the vocabulary [0, {vocab_size})"
        if any(not math.isfinite(p) or p < 0 for p in probs) or \
                abs(math.fsum(probs) - 1) > PROPOSAL_SUM_TOLERANCE:
            return f"{where} is not a distribution (sum {math.fsum(probs):.6f})"
        q = dict(zip(tokens, probs, strict=True))
        drawn = [tree.tokens[c - 1] for c in kids]
        if len(set(drawn)) != len(drawn) or any(q.get(t, 0.0) <= 0 for t in drawn):
            return (f"children {drawn} of tree index {index} are not distinct draws from its "
                    "proposal")
    return None


def depths(parents: list[int]) -> list[int]:
    """Depth of every tree index (root = 0), length len(parents) + 1."""
    out = [0]
    for parent in parents:
        out.append(out[parent] + 1)
    return out


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool: entry (i, j) is True when j is i itself or an ancestor of i.
    Built as host lists, one tensor at the end: the engine builds one per sequence per step."""
    import torch  # (see the module's note)

    n = len(parents) + 1
    rows = [[j == 0 for j in range(n)]]
    for i, parent in enumerate(parents, start=1):
        row = rows[parent].copy()
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def with_prefix(tree: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """A [q, q] table among new tokens spelled out over a cached prefix that every row sees:
    [q, prefix_len + q]."""
    import torch  # (see the module's note)

    prefix = torch.ones(tree.shape[0], prefix_len, dtype=torch.bool)
    return torch.cat((prefix, tree.to(device="cpu", dtype=torch.bool)), dim=1)


def verify_mask(parents: list[int], prefix_len: int) -> torch.Tensor:
    """Attention mask [n + 1, prefix_len + n + 1] for the root and nodes over a cached prefix."""
    return with_prefix(ancestor_mask(parents), prefix_len)


def positions(parents: list[int], root_position: int) -> torch.Tensor:
    """Rope position of every tree index: the root's plus its depth."""
    import torch  # (see the module's note)

    return torch.tensor(depths(parents), dtype=torch.int64) + root_position


class Acceptance(NamedTuple):
    path: list[int]   # accepted tree indices, root excluded, in order
    tokens: list[int]  # the tokens to commit: accepted nodes' tokens then the bonus token


def accept_tree(tree: Tree, chosen: list[int]) -> Acceptance:
    """Walk from the root, accepting the child whose token is the target's choice at its parent.

    ``chosen[i]`` is the token the target picks after tree index i: its argmax
    (greedy), or ONE independent sample from its distribution at that node
    (sampling). The last token committed is the choice at the last accepted
    node, so at least one token is always committed.

    Why this is exact for a deterministic (top-k) draft: every committed token
    is the target's own choice in exactly the context it is committed in; the
    draft only decides which of those choices were computed in this forward
    pass. (Accepting child x when the sample lands on it is the "sample from p,
    accept the child it lands on, else keep the sample" rule; REFERENCE.md.)
    """
    children = tree.children()
    path, out, node = [], [], 0
    while True:
        want = chosen[node]
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c - 1] == want), None)
        out.append(want)
        if nxt is None:
            return Acceptance(path, out)
        path.append(nxt)
        node = nxt


def first_child_run(tree: Tree, path: list[int]) -> int:
    """How many of the accepted nodes ``path`` (root excluded, in order), from the root, are
    each their parent's first child: what a chain along the tree's first-child path would
    have accepted. A top-k draft lists children likeliest first, so that path is the chain
    the same draft sends for a budget of topk 1; where the path leaves the tree before the
    chain's depth, the count is a lower bound (the chain's next node was never verified)."""
    first: dict[int, int] = {}
    for i, parent in enumerate(tree.parents, start=1):
        first.setdefault(parent, i)
    run, node = 0, 0
    for nxt in path:
        if first.get(node) != nxt:
            break
        run, node = run + 1, nxt
    return run


def match_length(tree: Tree, tokens: list[int]) -> int:
    """How many leading tokens follow a path of the tree from the root (the draft's view of
    how much of its tree the target went on to commit)."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True), start=1):
        children.setdefault(parent, {}).setdefault(token, i)
    node, matched = 0, 0
    for token in tokens:
        nxt = children.get(node, {}).get(token)
        if nxt is None:
            break
        node, matched = nxt, matched + 1
    return matched
