"""The replay draft: a benchmark draft that replays the target's own recorded continuations,
corrupted at a chosen rate, so the system's speed can be measured at a known acceptance on
production-shaped models without trained weights (a Llama-3.1-8B-shaped target with random
weights has no draft that agrees with it). Results made with it are labelled: its
DraftInfo.model_name is ``replay(<records file>, corrupt <R>)``.

Records. ``--replay-file`` holds the target's greedy continuations of prompts
(``splitspec/replay.py`` records them through the target, speculation OFF). A sequence
*follows* a record while its committed tokens t_0 .. t_{n-1} are a prefix of the record's
prompt + continuation r (of several such records, the longest); the true next tokens are
then r_n, r_{n+1}, ... The committed tokens are kept as the model drafter keeps its
entries: ``start`` below the tokens held truncates, then ``new_tokens`` are appended.

Trees. For the capped shape (N nodes, branching K, depth D) the topology is a function of
the shape alone (:func:`replay_topology`): a *main path* of L = min(D, N) nodes, one per
depth, each the first child of the one above; then the other nodes breadth-first under
EAGLE-2's limits (at most K children per node, at most K nodes with children per depth),
up to min(N, K + (D - 1) K^2) nodes: as many as the model drafter gives for the same shape,
so a replay step costs the target what a model draft's step costs. The main node at depth
d carries the true token r_{n+d-1} with probability 1 - R (R = ``--replay-corrupt-rate``)
and a random other token otherwise; every other node carries a random token that is
neither the true token at its depth nor one of its siblings' tokens.

Expected acceptance. Only the main path can be accepted, and each of its nodes
independently with probability 1 - R, so a verify step accepts at least k draft tokens with
probability (1 - R)^k (k <= L), and the mean accepted length is
sum_{k=1..L} (1 - R)^k = (1 - R)(1 - (1 - R)^L) / R (L for R = 0); acceptance at each depth
(given the depth above was accepted) is 1 - R. The bonus token is not counted.

Features. With ``--replay-features`` the draft says it needs an EAGLE-3 head's features
(DraftInfo.needs_hidden_states, the target's hidden size, the default three layer inputs):
the target captures them and sends them with every request, as it does for a head of its
shape, and the draft checks their size and copies them once. The trees do not use them;
the exchange then carries what it would with such a head (24 KiB a token at the 8B shape).

Cost. The trees cost the draft next to nothing, so alone it measures the target's side of
speculation only. With ``--replay-cost-model`` (an EAGLE-3 head of the target's shape, say,
with random weights) the draft also runs that model on every request as a draft of its kind
would (catch-up with the features it asks for, then the tree search of the shape asked,
CUDA graphs and all) and throws its trees away: the exchange then takes what that model's
drafting takes, while the trees, and so the acceptance, stay the replay's.

Randomness. Each tree draws from its own generator, seeded by the record's digest and n:
a run is reproducible, and every tree's corruption is independent of the other trees'.

Misses. A sequence that follows no record (it left every record: a sampling request,
another engine's numerics, a prompt never recorded) or has reached its record's end gets a
tree of the same shape of random tokens, so the step costs the same, and counts as a miss
(``num_misses``, DraftStatus.replay_misses; the draft's and the target's warmups make some
too). Depths past a record's end carry random tokens. Requests that sample are drafted for
like greedy ones: the target verifies losslessly either way, and their text soon leaves
the record.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from draft_service.drafter import (
    BaseDrafter,
    DrafterLimits,
    SeqBase,
    SeqError,
    SeqInput,
    SeqResult,
    Session,
    TreeShape,
    wire_features,
)
from draft_service.models import EAGLE3, REPLAY, DraftSpec, eagle3_entries, read_spec
from draft_service.tree_search import WireFeatures
from splitspec.model.config import LlamaConfig
from splitspec.replay import ReplayRecord
from splitspec.staging import reuse
from splitspec.tokenizer import TOKENIZER_FILE, tokenizer_sha256
from splitspec.tree import EMPTY_TREE, Tree

MISS_KEY_TOKENS = 8  # a miss's tree is seeded by the last this many tokens (and n)


def replay_name(records: Path, corrupt_rate: float, features: bool = False,
                cost: DraftSpec | None = None) -> str:
    """The label results made with the replay draft carry (DraftInfo.model_name)."""
    extra = (", features" if features and cost is None else "") + (
        f", cost {cost.name}" if cost is not None else "")
    return f"replay({records.name}, corrupt {corrupt_rate:.2f}{extra})"


def read_replay_spec(records: Path, corrupt_rate: float, target_dir: Path,
                     features: bool = False, cost_model: Path | None = None) -> DraftSpec:
    """The DraftInfo facts of the replay draft: the target's vocabulary, layer count and
    tokenizer fingerprint (the records are read by load_model); with ``features``, the
    target's hidden size, whose default three layer inputs it then asks for. With
    ``cost_model`` (its spec in ``cost``), an EAGLE-3 head's features instead: the head's
    hidden size and layers."""
    target = LlamaConfig.read(target_dir)
    sha = tokenizer_sha256(target_dir) if (target_dir / TOKENIZER_FILE).is_file() else ""
    hidden, aux, cost = target.hidden_size if features else 0, (), None
    if cost_model is not None:
        cost = read_spec(cost_model, "auto", target_dir)
        if cost.vocab_size != target.vocab_size:
            raise ValueError(f"--replay-cost-model {cost_model} reads a vocabulary of "
                             f"{cost.vocab_size} tokens, the target {target.vocab_size}")
        if cost.kind == EAGLE3:
            hidden, aux, features = cost.target_hidden_size, cost.aux_layer_inputs, True
    return DraftSpec(REPLAY, records, target_dir, target.vocab_size, hidden, aux,
                     target.num_layers, sha, label=replay_name(records, corrupt_rate, features, cost),
                     features=features, cost=cost)


def _digest(tokens: list[int], tag: bytes) -> int:
    """A 64-bit fingerprint of token ids (stable across runs, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(tag + array("I", tokens).tobytes(), digest_size=8)
                          .digest(), "little")


class ReplayBook:
    """The records, indexed to find the records a sequence's tokens begin."""

    def __init__(self, records: list[ReplayRecord]) -> None:
        self.full = [rec.full for rec in records]  # prompt + continuation, by record
        self.digest = [_digest(full, b"record") for full in self.full]
        self._order = sorted(range(len(self.full)), key=self.full.__getitem__)
        self._sorted = [self.full[i] for i in self._order]  # lexicographic: a prefix's records are adjacent

    def __len__(self) -> int:
        return len(self.full)

    def find(self, tokens: list[int]) -> int | None:
        """The longest record whose tokens begin with tokens, or None."""
        best = None
        n = len(tokens)
        for j in range(bisect.bisect_left(self._sorted, tokens), len(self._sorted)):
            if self._sorted[j][:n] != tokens:
                break
            if best is None or len(self._sorted[j]) > len(self._sorted[best]):
                best = j
        return None if best is None else self._order[best]


class ReplayNode(NamedTuple):
    parent: int    # tree index of the parent (0 = root)
    depth: int     # 1 for the root's children
    on_path: bool  # the main path: the only nodes that may carry a true token


@functools.lru_cache(maxsize=64)  # a pure function of the shape, asked for per sequence per step
def replay_topology(shape: TreeShape) -> tuple[ReplayNode, ...]:
    """The replay tree of a (capped) shape, nodes in tree-index order (1, 2, ...): by depth,
    then creation order, so parents come first and each depth's main node first.

    Created first: the main path of min(num_steps, num_draft_tokens) nodes. Then,
    depth by depth, the nodes of the depth above (main node first) get children until
    each has topk, at most topk of them having children, until num_draft_tokens.
    """
    parent, depth, kids = [-1], [0], [[]]  # by creation index; 0 is the root

    def add(p: int) -> None:
        parent.append(p)
        depth.append(depth[p] + 1)
        kids.append([])
        kids[p].append(len(parent) - 1)

    main_len = min(shape.num_steps, shape.num_draft_tokens)
    for d in range(1, main_len + 1):
        add(d - 1)
    for d in range(1, shape.num_steps + 1):
        above = [c for c in range(len(parent)) if depth[c] == d - 1]
        for p in above[:shape.topk]:
            while len(kids[p]) < shape.topk and len(parent) - 1 < shape.num_draft_tokens:
                add(p)
    order = sorted(range(1, len(parent)), key=lambda c: (depth[c], c))
    index = {0: 0} | {c: i + 1 for i, c in enumerate(order)}
    return tuple(ReplayNode(index[parent[c]], depth[c], c <= main_len) for c in order)


@dataclass
class ReplaySeq(SeqBase):
    tokens: list[int] = field(default_factory=list)  # the committed tokens
    record: int | None = None     # a record whose tokens begin with `tokens` (None: none known)
    unmatched: int | None = None  # no record begins with the first `unmatched` of `tokens`


@dataclass
class CostedSession(Session):
    """A replay session and the session of the same sequences in the cost model's drafter."""

    cost: Session = field(default_factory=Session)


class ReplayDrafter(BaseDrafter):
    """Drafts from the records (see the module docstring); holds no model and no cache.

    With ``cost`` (``--replay-cost-model``), a model's drafter runs every request first, as
    it would serve it, and its trees are thrown away: the exchange then takes that model's
    time. It checks and takes the features (the replay's ``feature_dim`` is then 0); a
    sequence it cannot serve fails here too, so that the target resends it to both."""

    def __init__(self, book: ReplayBook, corrupt_rate: float, vocab_size: int,
                 limits: DrafterLimits, feature_dim: int = 0,
                 cost: BaseDrafter | None = None) -> None:
        # topk at most vocab_size - 1: a node's children must avoid the true token too.
        super().__init__(limits, vocab_size, vocab_size - 1)
        self.book = book
        self.corrupt_rate = corrupt_rate
        self.feature_dim = feature_dim  # --replay-features: an EAGLE-3 head's feature width
        self.feature_bytes = 0          # features taken (and copied) since start
        self._host = torch.empty(0, dtype=torch.uint8)  # where they are copied, reused
        self.cost = cost
        if cost is not None and feature_dim:
            raise ValueError("with a cost model, the model's drafter takes the features")

    def open_session(self) -> Session:
        if self.cost is None:
            return super().open_session()
        return CostedSession(cost=self.cost.open_session())

    def close_session(self, session: Session) -> None:
        super().close_session(session)
        if isinstance(session, CostedSession):
            self.cost.close_session(session.cost)

    def draft(self, session: Session, seqs: list[SeqInput], release_ids: Iterable[int] = ()
              ) -> list[SeqResult]:
        if not isinstance(session, CostedSession):
            return super().draft(session, seqs, release_ids)
        release_ids = list(release_ids)
        costed = self.cost.draft(session.cost, seqs, release_ids)
        results = super().draft(session, seqs, release_ids)
        for i, (mine, theirs) in enumerate(zip(results, costed, strict=True)):
            if theirs.error and not mine.error:  # the cost model logged why, once
                with self._lock:
                    self._drop(session, mine.seq_id)
                results[i] = SeqResult(mine.seq_id, EMPTY_TREE, f"cost model: {theirs.error}")
        return results

    def _new_state(self) -> ReplaySeq:
        return ReplaySeq()

    def _free(self, state: ReplaySeq) -> None:
        """Nothing to give back: a replayed sequence holds only its token list."""

    def _prepare(self, session: Session, item: SeqInput) -> None:
        state = self._check(session, item)
        if self.feature_dim:  # checked as an EAGLE-3 draft checks them, and copied once
            rows = len(eagle3_entries(item.start, item.new_tokens).tokens)
            wire = wire_features(item.hidden_states, rows, self.feature_dim, item.hidden_dim,
                                 item.dtype)
            self._copy(wire)
        state = self._sync(session, item, state)
        del state.tokens[item.start:]
        state.tokens.extend(item.new_tokens)
        self._follow(state, item.start)

    def _copy(self, wire: WireFeatures) -> None:
        """Copy the features once into a reused host buffer, as a head copies them into its
        staging buffer for the device (drafter.py's ``RowStaging``)."""
        size = len(wire.data)
        self._host = reuse(self._host, size, pin=False)
        self._host.numpy()[:size] = wire.array().reshape(-1)
        self.feature_bytes += size

    def _follow(self, state: ReplaySeq, start: int) -> None:
        """Keep the record the sequence follows, or find one, after tokens changed from start."""
        tokens = state.tokens
        if state.record is not None:
            # tokens[:start] were checked against the record before.
            if self.book.full[state.record][start:len(tokens)] == tokens[start:]:
                return
            state.record = None
        if state.unmatched is not None and start >= state.unmatched:
            return  # tokens[:unmatched] did not change, and begin no record
        state.record = self.book.find(tokens)
        state.unmatched = None if state.record is not None else len(tokens)

    def _serve(self, session: Session, seqs: list[SeqInput], errors: dict[int, str]
               ) -> dict[int, Tree]:
        self._prepare_all(session, seqs, errors)
        trees = {}
        for i, item in enumerate(seqs):
            if i in errors or item.shape.num_draft_tokens == 0:
                continue
            state = session.seqs[item.seq_id]
            if not state.tokens:
                self._fail(session, i, item.seq_id, errors,
                           SeqError("no committed token to draft from; resend from 0"))
                continue
            trees[i] = state.last_tree = self.tree(state, self.capped(item.shape))
        return trees

    def tree(self, state: ReplaySeq, shape: TreeShape) -> Tree:
        """The replay tree of a sequence for a capped shape (a miss when nothing is known)."""
        n = len(state.tokens)
        topology = replay_topology(shape)
        truth: list[int] = []
        if state.record is not None:
            truth = self.book.full[state.record][n:n + shape.num_steps]
        if truth:
            key = self.book.digest[state.record]
        else:
            self.num_misses += 1
            key = _digest(state.tokens[-MISS_KEY_TOKENS:], b"miss")
        rng = random.Random((key << 32) | n)
        tokens: list[int] = []
        siblings: dict[int, set[int]] = {}  # tree index -> its children's tokens
        for node in topology:
            true = truth[node.depth - 1] if node.depth <= len(truth) else None
            taken = siblings.setdefault(node.parent, set())
            if node.on_path and true is not None and rng.random() >= self.corrupt_rate:
                token = true
            else:
                token = self._wrong(rng, taken, true)
            taken.add(token)
            tokens.append(token)
        return Tree(tokens, [node.parent for node in topology])

    def _wrong(self, rng: random.Random, taken: set[int], true: int | None) -> int:
        """A random token that is neither true nor taken (fewer than vocab_size - 1 are taken:
        topk is capped at vocab_size - 1)."""
        while True:
            token = rng.randrange(self.vocab_size)
            if token != true and token not in taken:
                return token
