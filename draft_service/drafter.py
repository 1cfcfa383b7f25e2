"""The draft's model-side logic: per-sequence draft KV state, catch-up, EAGLE-2 tree drafting.

State. Each Exchange stream owns a :class:`Session`: its sequences' page tables
in the one process-wide KV cache, how many committed tokens each holds, and
the *state* of each sequence's last committed entry (see models.py for entries
and states), from which the next tree starts. :meth:`Drafter.draft` serves one
request:

1. ``release_ids`` are freed.
2. Catch-up: for every sequence, what the draft holds from ``start`` on is
   dropped and the new tokens' entries are appended, all sequences in ONE
   forward pass (causal, over each sequence's page table).
3. Trees: for the sequences that ask for one, EAGLE-2 top-k drafting on the
   device, batched over the sequences of each tree shape, one forward per
   tree level and one read back (:class:`TreeSearch`, CUDA graphs on GPUs);
   the host then keeps each tree's best nodes (:meth:`Candidates.best_trees`).
   In the steady state (every sequence a top-k tree of one captured shape,
   1 .. depth + 1 new tokens each) steps 2 and 3 are one graph replay
   (:meth:`TreeSearch.run_caught_up`).
   With ``sampled_trees`` on, a sequence that samples gets a *sampled* tree
   instead: a fixed topology (:func:`sampled_topology`) whose nodes' children
   are drawn from the draft's own distribution without replacement, sent with
   that distribution (see :class:`_SampledCandidates`), drafted level by level
   from the host (:meth:`Drafter._grow`).

A problem with one sequence (unknown, bad features, over the context, out of
pages) becomes that sequence's ``error`` and the draft forgets the sequence
(the target resends it from 0); the other sequences are served as usual.

What does not depend on a model (sessions, the checks of each input, release,
the ``max_running`` limit, draft-side acceptance, the tree-shape cap) lives in
:class:`BaseDrafter`, which the replay draft (``draft_service/replay.py``)
shares. Nothing here knows about protobuf.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from draft_service.models import DraftModel, EntrySpan
from draft_service.tree_search import CatchUp, FeatureBytes, TreeSearch, WireFeatures
from splitspec.attention.base import AttentionBackend, SeqAttention
from splitspec.attention.decode_table import prefix_attention_for
from splitspec.kv_cache import KVCache, OutOfPages, PagePool, PageTable
from splitspec.model.layers import AttentionContext
from splitspec.model.loader import DTYPES
from splitspec.sampling import SamplingParams, draw_without_replacement, proposals, uniform
from splitspec.spec_stats import SpecCounters
from splitspec.staging import RowStaging
from splitspec.tree import EMPTY_TREE, Proposal, Tree, depths, match_length

log = logging.getLogger(__name__)

ROOT = -1  # parent of a depth-1 candidate


class SeqError(Exception):
    """This sequence cannot be served; the message goes into its tree's ``error``."""


@dataclass(frozen=True)
class TreeShape:
    num_draft_tokens: int  # nodes wanted, root excluded; 0 = catch up only
    topk: int              # branching per level (1 = chain)
    num_steps: int         # depth


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a request (the fields of draft.proto's SeqDraftInput)."""

    seq_id: int
    start: int                  # position of new_tokens[0]
    new_tokens: list[int]
    shape: TreeShape
    hidden_states: FeatureBytes = b""  # EAGLE-3: row-major [rows, hidden_dim] target features
    hidden_dim: int = 0
    dtype: str = ""
    sampling: SamplingParams | None = None  # the request's, when it samples


class SeqResult(NamedTuple):
    seq_id: int
    tree: Tree
    error: str  # "" when served


@dataclass(frozen=True)
class DrafterLimits:
    max_running: int     # sequences held over all sessions
    max_context: int     # committed tokens per sequence
    max_tree_nodes: int  # cap on num_draft_tokens
    sampled_trees: bool = False  # sampled trees for sequences that sample (else top-k trees)
    proposal_support: int = 64   # tokens kept in a sampled tree's proposal distributions


@dataclass(kw_only=True)
class SeqBase:
    """What every drafter keeps of a sequence."""

    num_tokens: int = 0                    # committed tokens seen
    last_tree: Tree | None = None          # the last tree sent, rooted at token num_tokens - 1
    spec: SpecCounters = field(default_factory=SpecCounters)  # how much of each tree was committed


@dataclass
class SeqState(SeqBase):
    table: PageTable                       # logical slot i holds entry i
    last_state: torch.Tensor | None = None  # [X] state of the last entry; None = nothing to draft from

    @property
    def num_entries(self) -> int:
        return self.table.num_slots


@dataclass
class Session:
    """The sequences of one Exchange stream; freed by :meth:`BaseDrafter.close_session`."""

    seqs: dict[int, Any] = field(default_factory=dict)  # seq_id -> the drafter's SeqBase subclass


class _Extend(NamedTuple):
    state: SeqState
    span: EntrySpan
    features: WireFeatures | None  # [len(span.tokens), feature_dim]


def encode_features(features: torch.Tensor) -> tuple[bytes, int, str]:
    """Target features [rows, width] as (row-major bytes, width, dtype name): the wire form."""
    rows = features.detach().contiguous().cpu()
    return (rows.view(torch.uint8).numpy().tobytes(), rows.shape[1],
            str(rows.dtype).removeprefix("torch."))


def wire_features(data: FeatureBytes, rows: int, width: int, hidden_dim: int, dtype: str
                  ) -> WireFeatures:
    """Target features [rows, width] in raw row-major bytes, checked (not copied); SeqError
    when they do not fit."""
    if dtype not in DTYPES:
        raise SeqError(f"hidden_states dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if hidden_dim != width:
        raise SeqError(f"hidden_dim {hidden_dim} != {width} (3 x the target hidden size the "
                       "EAGLE-3 head was trained on)")
    torch_dtype = DTYPES[dtype]
    itemsize = torch_dtype.itemsize
    if len(data) != rows * width * itemsize:
        raise SeqError(f"hidden_states has {len(data)} bytes; {rows} rows of {width} {dtype} "
                       f"need {rows * width * itemsize}")
    return WireFeatures(data, rows, width, torch_dtype)


class _Candidates:
    """The nodes generated while drafting one sequence's sampled tree, in generation order."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self.tokens: list[int] = []   # target ids
        self.parents: list[int] = []  # candidate index, or ROOT
        self.scores: list[float] = []  # cumulative log-prob
        self.depths: list[int] = []

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        return len(self.tokens) - 1


# Prior weight of a node's r-th draw in a sampled tree (how likely it is to be the one
# accepted, roughly): it shapes the fixed topology, never depends on what is drawn.
def _draw_weight(rank: int) -> float:
    return 0.6 * 0.4**rank


@functools.lru_cache(maxsize=64)  # a pure function of the shape, asked for per sequence per step
def sampled_topology(shape: TreeShape) -> list[list[int]]:
    """The fixed topology of a sampled tree: children[t] lists the nodes drawn at node t
    (0 = the root), in draw order; nodes are numbered in creation order.

    Best-first by prior weight (the product of :func:`_draw_weight` along the
    path) under the shape: num_draft_tokens nodes, depth at most num_steps, at
    most topk draws per node and at most topk nodes with children per depth
    (the draft's frontier). It depends on the shape alone, so how many children
    a node gets never depends on what was drawn there, which keeps recursive
    rejection sampling exact. Cached: callers must not modify the lists.
    """
    children: list[list[int]] = [[]]
    weight, depth = [1.0], [0]
    expanded_per_depth: dict[int, int] = {}
    heap = [(-_draw_weight(0), 0, 0, 0)]  # (-weight, tie, parent, rank)
    tie = 1
    while heap and len(children) - 1 < shape.num_draft_tokens:
        neg_weight, _, parent, rank = heapq.heappop(heap)
        if rank == 0:
            if expanded_per_depth.get(depth[parent], 0) >= shape.topk:
                continue
            expanded_per_depth[depth[parent]] = expanded_per_depth.get(depth[parent], 0) + 1
        node = len(children)
        children.append([])
        children[parent].append(node)
        weight.append(-neg_weight)
        depth.append(depth[parent] + 1)
        if rank + 1 < shape.topk:
            heapq.heappush(heap, (-weight[parent] * _draw_weight(rank + 1), tie, parent, rank + 1))
            tie += 1
        if depth[node] < shape.num_steps:
            heapq.heappush(heap, (-weight[node] * _draw_weight(0), tie, node, 0))
            tie += 1
    return children


class _SampledCandidates(_Candidates):
    """A sampled tree: the topology's nodes, each node's children drawn without replacement
    from the draft's distribution under the request's sampling parameters.

    The i-th draw at topology node t, for the token at position n, uses
    u(seed, n, "draft", t, i): reproducible for a seed, and independent of the
    numbers the target verifies with.
    """

    def __init__(self, shape: TreeShape, num_entries: int, sampling: SamplingParams,
                 first_position: int) -> None:
        super().__init__(shape)
        self.num_entries = num_entries
        self.frontier: list[int] = []
        self.slot: dict[int, int] = {}  # candidate -> logical cache slot, for those that ran
        self.sampling = sampling
        self.first_position = first_position  # position of the depth-1 nodes
        self.topology = sampled_topology(shape)
        self.topo: dict[int, int] = {ROOT: 0}  # candidate -> topology node
        self.proposal: dict[int, Proposal] = {}  # candidate (or ROOT) -> what its children came from

    def frontier_mask(self, step: int) -> torch.Tensor:
        """[f, E + (step - 1) * k + f] bool: each of the f frontier nodes sees the entries, its
        ancestors and itself.

        The frontier of step j (its nodes have depth j) is written to logical
        slots E + (j - 1) * k ... E + (j - 1) * k + f - 1.
        """
        f, first = len(self.frontier), self.num_entries + (step - 1) * self.shape.topk
        mask = torch.zeros(f, first + f, dtype=torch.bool)
        mask[:, : self.num_entries] = True
        for row, node in enumerate(self.frontier):
            self.slot[node] = first + row
            while node != ROOT:
                mask[row, self.slot[node]] = True
                node = self.parents[node]
        return mask

    def grow(self, parent: int, proposal: Proposal) -> list[int]:
        """Draw parent's (ROOT or a candidate) children from proposal, as its topology node
        asks; returns them."""
        slots = self.topology[self.topo[parent]]
        if not slots:
            return []
        position = self.first_position + (0 if parent == ROOT else self.depths[parent])
        uniforms = [uniform(self.sampling.seed, position, "draft", self.topo[parent], i)
                    for i in range(len(slots))]
        self.proposal[parent] = proposal
        born = []
        for slot, pick in zip(slots, draw_without_replacement(proposal.probs, uniforms),
                              strict=False):
            base = 0.0 if parent == ROOT else self.scores[parent]
            child = self.add(proposal.tokens[pick], parent, base + math.log(proposal.probs[pick]))
            self.topo[child] = slot
            born.append(child)
        return born

    def set_frontier(self, candidates: list[int]) -> None:
        self.frontier = [c for c in candidates if self.topology[self.topo[c]]]

    def best_tree(self) -> Tree:
        """Every drawn node, parents first; siblings keep their draw order."""
        kept = sorted(range(len(self.tokens)), key=lambda c: (self.depths[c], c))
        index = {c: i + 1 for i, c in enumerate(kept)}
        empty = Proposal([], [])
        return Tree([self.tokens[c] for c in kept],
                    [0 if self.parents[c] == ROOT else index[self.parents[c]] for c in kept],
                    tuple([self.proposal.get(ROOT, empty),
                           *(self.proposal.get(c, empty) for c in kept)]))


class _TreeJob(NamedTuple):
    index: int         # position of the sequence in the request
    state: SeqState
    cands: _SampledCandidates


class BaseDrafter(ABC):
    """Sessions of sequences, and everything serving them needs besides drafting: the checks
    of each input, release, the --max-running limit, draft-side acceptance, the shape cap.

    Thread-safe: requests of all sessions are served one at a time. A subclass keeps each
    sequence as a :class:`SeqBase` subclass (:meth:`_new_state`), gives back what a dropped
    one held (:meth:`_free`), and catches up and drafts in :meth:`_serve`, where a
    :class:`SeqError` raised by :meth:`_prepare` becomes that sequence's error.
    """

    def __init__(self, limits: DrafterLimits, vocab_size: int, max_topk: int) -> None:
        self.limits = limits
        self.vocab_size = vocab_size  # token ids in [0, vocab_size) are valid
        self.max_topk = max_topk      # the widest branching a drafted tree may have
        self._num_held = 0
        self._lock = threading.Lock()
        self.stats = SpecCounters()  # over all sequences: how much of each tree was committed next
        self.num_exchanges = 0
        self.num_trees = 0   # trees drafted since start
        self.num_misses = 0  # of those, drafted with nothing to draft from (the replay draft's misses)

    @property
    def num_held(self) -> int:
        """Sequences held over all sessions."""
        return self._num_held

    def open_session(self) -> Session:
        return Session()

    def close_session(self, session: Session) -> None:
        with self._lock:
            for seq_id in list(session.seqs):
                self._drop(session, seq_id)

    def draft(self, session: Session, seqs: list[SeqInput], release_ids: Iterable[int] = ()
              ) -> list[SeqResult]:
        """Release, catch up, draft; one result per input, in order."""
        with self._lock:
            self.num_exchanges += 1
            for seq_id in release_ids:
                self._drop(session, seq_id)
            errors: dict[int, str] = {}
            trees = self._serve(session, seqs, errors)
            self.num_trees += len(trees)
        return [SeqResult(item.seq_id, trees.get(i, EMPTY_TREE), errors.get(i, ""))
                for i, item in enumerate(seqs)]

    def capped(self, shape: TreeShape) -> TreeShape:
        """The shape actually drafted: num_draft_tokens capped at --max-tree-nodes, topk and depth
        at that budget N (and topk at max_topk). A node is kept only with all its ancestors,
        so no kept node is deeper than N, and none ranks below its siblings' N-th."""
        nodes = min(shape.num_draft_tokens, self.limits.max_tree_nodes)
        topk = min(shape.topk, nodes, self.max_topk)
        return TreeShape(nodes, topk, min(shape.num_steps, nodes))

    @abstractmethod
    def _serve(self, session: Session, seqs: list[SeqInput], errors: dict[int, str]
               ) -> dict[int, Tree]:
        """Catch every sequence up and draft the trees asked for: the trees by input index; a
        sequence that cannot be served gets its message in errors[index] instead."""

    @abstractmethod
    def _prepare(self, session: Session, item: SeqInput) -> Any:
        """Check one input and bring its sequence up to it (:meth:`_check`, :meth:`_sync`);
        returns what :meth:`_serve` needs next (None: nothing), SeqError when it cannot."""

    @abstractmethod
    def _new_state(self) -> SeqBase:
        """The state of a sequence seen for the first time."""

    @abstractmethod
    def _free(self, state: SeqBase) -> None:
        """Give back what a dropped sequence held."""

    def _fail(self, session: Session, index: int, seq_id: int, errors: dict[int, str],
              exc: SeqError) -> None:
        """Record a per-sequence error (logged) and forget the sequence."""
        log.warning("draft cannot serve sequence %d: %s", seq_id, exc)
        errors[index] = str(exc)
        self._drop(session, seq_id)

    def _prepare_all(self, session: Session, seqs: list[SeqInput], errors: dict[int, str]
                     ) -> list[Any]:
        """:meth:`_prepare` every input, once per sequence; what they return, Nones left out."""
        prepared, seen = [], set()
        for i, item in enumerate(seqs):
            if item.seq_id in seen:
                errors[i] = "sequence appears twice in one request"
                log.warning("draft request names sequence %d twice", item.seq_id)
                continue
            seen.add(item.seq_id)
            try:
                out = self._prepare(session, item)
            except SeqError as exc:  # becomes this sequence's error in the reply
                self._fail(session, i, item.seq_id, errors, exc)
                continue
            if out is not None:
                prepared.append(out)
        return prepared

    def _check(self, session: Session, item: SeqInput) -> SeqBase | None:
        """The sequence's state (None: not held yet) when the input can be served; SeqError
        saying why not otherwise."""
        state = session.seqs.get(item.seq_id)
        if state is None and item.start > 0:
            raise SeqError("unknown sequence, resend from 0")
        if state is not None and item.start > state.num_tokens:
            raise SeqError(f"start {item.start} is past the {state.num_tokens} tokens the draft "
                           "holds; resend from 0")
        end = item.start + len(item.new_tokens)
        if end > self.limits.max_context:
            raise SeqError(f"sequence of {end} tokens exceeds the draft's --max-context "
                           f"{self.limits.max_context}")
        bad = next((t for t in item.new_tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise SeqError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        shape = item.shape
        if shape.num_draft_tokens > 0 and (shape.topk < 1 or shape.num_steps < 1):
            raise SeqError(f"a tree needs topk >= 1 and num_steps >= 1, got topk {shape.topk} "
                           f"num_steps {shape.num_steps}")
        return state

    def _sync(self, session: Session, item: SeqInput, state: SeqBase | None) -> SeqBase:
        """Hold a new sequence (within --max-running), score the last tree against the tokens
        committed after it, and move the sequence's length to the end of the new tokens."""
        if state is None:
            if self._num_held >= self.limits.max_running:
                raise SeqError(f"the draft already holds --max-running {self.limits.max_running} "
                               "sequences")
            state = session.seqs[item.seq_id] = self._new_state()
            self._num_held += 1
        if state.last_tree is not None and item.start == state.num_tokens:
            self._score_tree(state, item.new_tokens)
        state.last_tree = None
        state.num_tokens = item.start + len(item.new_tokens)
        return state

    def _score_tree(self, state: SeqBase, committed: list[int]) -> None:
        """Count how much of the last tree the target committed next (draft-side acceptance)."""
        tree = state.last_tree
        if not tree.num_nodes:
            return
        accepted = match_length(tree, committed)
        depth = max(depths(tree.parents))
        state.spec.record_verify(tree.num_nodes, depth, accepted)
        self.stats.record_verify(tree.num_nodes, depth, accepted)

    def _drop(self, session: Session, seq_id: int) -> None:
        state = session.seqs.pop(seq_id, None)
        if state is not None:
            self._free(state)
            self._num_held -= 1


class Drafter(BaseDrafter):
    """Serves draft requests over one model, one KV cache and one attention backend."""

    def __init__(self, model: DraftModel, cache: KVCache, pool: PagePool, backend: AttentionBackend,
                 limits: DrafterLimits, search: TreeSearch | None = None) -> None:
        """``search``: the top-k tree search with its CUDA graphs (capture_cuda_graphs); by
        default an eager one over ``backend``."""
        super().__init__(limits, model.vocab_size, model.draft_vocab_size)
        self.model = model
        self.cache = cache
        self.pool = pool
        self.backend = backend
        self.device = model.device
        self.search = search or TreeSearch(model, cache, prefix_attention_for(backend))
        self._staging = RowStaging(self.device)  # the eager catch-up's features

    def _new_state(self) -> SeqState:
        return SeqState(PageTable(self.cache.page_size))

    def _free(self, state: SeqState) -> None:
        state.table.release(self.pool)

    def _serve(self, session: Session, seqs: list[SeqInput], errors: dict[int, str]
               ) -> dict[int, Tree]:
        with torch.inference_mode():
            extends = self._prepare_all(session, seqs, errors)
            trees = self._caught_up_trees(session, seqs, errors, extends)
            if trees is None:
                self._extend(extends)
                trees = self._draft_trees(session, seqs, errors)
            return trees

    def _caught_up_trees(self, session: Session, seqs: list[SeqInput], errors: dict[int, str],
                         extends: list[_Extend]) -> dict[int, Tree] | None:
        """The steady state in one graph replay (:meth:`TreeSearch.run_caught_up`): when every
        input served is a top-k tree of one shape whose catch-up and search were captured
        together, with 1 .. depth + 1 new entries after at least one; None otherwise (the
        eager catch-up, then the search)."""
        live = [i for i in range(len(seqs)) if i not in errors]
        if not live or len(extends) != len(live):
            return None
        shapes = {self.capped(seqs[i].shape) for i in live}
        if len(shapes) != 1 or any(self._samples(seqs[i]) for i in live):
            return None
        (shape,) = shapes
        if shape.num_draft_tokens == 0 or not self.search.can_catch_up(
                [len(e.span.tokens) for e in extends], [e.span.first for e in extends], shape):
            return None
        found, roots = self.search.run_caught_up(
            [CatchUp(e.state.table, e.span.first, e.span.tokens, e.features) for e in extends],
            shape)
        trees = {}
        picked = found.best_trees(shape.num_draft_tokens)
        for row, (i, ext) in enumerate(zip(live, extends, strict=True)):
            ext.state.table.num_slots = ext.span.first + len(ext.span.tokens)
            ext.state.last_state = roots[row]
            trees[i] = ext.state.last_tree = picked[row]
        return trees

    def _samples(self, item: SeqInput) -> bool:
        """Whether the sequence's tree is a sampled one (the host-driven path)."""
        params = item.sampling
        return self.limits.sampled_trees and params is not None and not params.is_greedy

    # ---- catch-up ---------------------------------------------------------------------

    def _prepare(self, session: Session, item: SeqInput) -> _Extend | None:
        """Validate one input, truncate the state to start and reserve pages for the new entries."""
        state = self._check(session, item)
        span = self.model.entries(item.start, item.new_tokens)
        features = None
        if self.model.feature_dim:
            features = wire_features(item.hidden_states, len(span.tokens), self.model.feature_dim,
                                     item.hidden_dim, item.dtype)
        state = self._sync(session, item, state)
        if span.first < state.num_entries:  # rollback: the last entry's state is gone too
            state.last_state = None
        state.table.num_slots = span.first
        try:
            state.table.reserve(self.pool, span.first + len(span.tokens))
        except OutOfPages as exc:
            raise SeqError(f"out of draft KV-cache pages ({exc}); the cache holds --max-running "
                           "sequences of --max-context tokens: raise one of them") from exc
        return _Extend(state, span, features) if span.tokens else None

    def _features(self, extends: list[_Extend]) -> torch.Tensor | None:
        """The new entries' features, one sequence after another, on the device in the
        model's dtype: as received, through the reused staging buffer in one copy."""
        given = [ext.features for ext in extends if ext.features is not None]
        if not given:
            return None
        wire = {features.dtype for features in given}
        if len(wire) != 1:  # (a target sends one dtype; kept correct all the same)
            return torch.cat([f.tensor().to(self.model.dtype) for f in given]).to(self.device)
        raw = self._staging.send([features.array() for features in given])
        return raw.view(wire.pop()).view(-1, self.model.feature_dim).to(self.model.dtype)

    def _extend(self, extends: list[_Extend]) -> None:
        """Append every sequence's new entries in one forward pass."""
        if not extends:
            return
        ids, pos, attn = [], [], []
        for ext in extends:
            first, num = ext.span.first, len(ext.span.tokens)
            ids.append(torch.tensor(ext.span.tokens, dtype=torch.int64))
            pos.append(torch.arange(first, first + num))
            attn.append(SeqAttention(ext.state.table, kv_len=first + num, q_len=num))
        meta = self.backend.plan(attn, self.device)
        ctx = AttentionContext(self.backend, meta, self.cache)
        features = self._features(extends)
        states = self.model.forward_entries(torch.cat(ids).to(self.device), features,
                                            torch.cat(pos).to(self.device), ctx)
        row = -1
        for ext, seq in zip(extends, attn, strict=True):
            row += seq.q_len
            ext.state.table.num_slots = seq.kv_len
            ext.state.last_state = states[row].clone()

    # ---- trees ------------------------------------------------------------------------

    def _draft_trees(self, session: Session, seqs: list[SeqInput], errors: dict[int, str]
                     ) -> dict[int, Tree]:
        """Top-k trees on the device (:class:`TreeSearch`), one batch per tree shape; sampled
        trees through the host-driven :meth:`_grow`, whose scratch lives in the paged cache."""
        top_k: dict[TreeShape, list[tuple[int, SeqState]]] = {}
        jobs = []
        for i, item in enumerate(seqs):
            if i in errors or item.shape.num_draft_tokens == 0:
                continue
            state = session.seqs[item.seq_id]
            shape = self.capped(item.shape)
            try:
                if state.last_state is None:
                    raise SeqError("no committed entry to draft from (needs new tokens after a "
                                   "rollback, or 2 tokens for EAGLE-3); resend from 0")
                candidates = self._sampled_candidates(item, shape, state)
                if candidates is None:
                    top_k.setdefault(shape, []).append((i, state))
                    continue
                scratch = (shape.num_steps - 1) * shape.topk
                try:
                    state.table.reserve(self.pool, state.num_entries + scratch)
                except OutOfPages as exc:
                    raise SeqError(f"out of draft KV-cache pages for a {scratch}-node tree scratch "
                                   f"({exc})") from exc
            except SeqError as exc:  # becomes this sequence's error in the reply
                self._fail(session, i, item.seq_id, errors, exc)
                continue
            jobs.append(_TreeJob(i, state, candidates))
        trees = {}
        for shape, group in top_k.items():
            states = [state for _, state in group]
            found = self.search.run(torch.stack([s.last_state for s in states]),
                                    [s.table for s in states], [s.num_entries for s in states], shape)
            trees.update(zip((i for i, _ in group), found.best_trees(shape.num_draft_tokens),
                             strict=True))
        if jobs:
            try:
                self._grow(jobs)
            finally:
                for job in jobs:
                    self._trim(job.state.table)
            trees.update((job.index, job.cands.best_tree()) for job in jobs)
        for i, tree in trees.items():
            session.seqs[seqs[i].seq_id].last_tree = tree
        return trees

    def _sampled_candidates(self, item: SeqInput, shape: TreeShape, state: SeqState
                            ) -> _SampledCandidates | None:
        """Candidates of a sampled tree for a sequence that samples when sampled trees are on;
        None for a top-k tree."""
        params = item.sampling
        if not self._samples(item):
            return None
        if params.seed is None:
            raise SeqError("a sampled tree needs the request's seed in sampling.seed")
        return _SampledCandidates(shape, state.num_entries, params, state.num_tokens)

    def _next(self, states: torch.Tensor, row_jobs: list[_TreeJob]) -> list[Proposal]:
        """Per row of states [T, X] (row i a node of row_jobs[i]'s sampled tree): the draft's
        distribution under that sequence's sampling parameters, cut to --proposal-support."""
        logits = self.model.logits(states)
        by_job: dict[int, list[int]] = {}
        for row, job in enumerate(row_jobs):
            by_job.setdefault(job.index, []).append(row)
        out: list[Proposal | None] = [None] * len(row_jobs)
        for rows in by_job.values():
            cands = row_jobs[rows[0]].cands
            ids, probs = proposals(logits[torch.tensor(rows, device=logits.device)],
                                   cands.sampling, self.limits.proposal_support,
                                   self.model.to_target_ids)
            for row, row_ids, row_probs in zip(rows, ids, probs, strict=True):
                out[row] = Proposal(row_ids, row_probs)
        return out

    def _grow(self, jobs: list[_TreeJob]) -> None:
        """Sampled trees, drafted level by level from the host, batched over sequences.

        Depth 1: the root's children, drawn from its proposal. Step j = 1 ..
        S-1: ONE forward over every sequence's frontier (the depth-j nodes that
        the topology gives children; position last entry + j, input = token
        and, for EAGLE-3, the parent's state), each node attending to its
        sequence's entries, its ancestors and itself
        (:meth:`_SampledCandidates.frontier_mask`), and each node's children
        drawn from its own proposal. Sequences with fewer steps drop out of
        later forwards; shapes may differ between sequences.
        """
        states = torch.stack([job.state.last_state for job in jobs])  # [B, X]: the roots
        nexts = self._next(states, jobs)
        parent_rows: dict[int, list[int]] = {}  # job -> row in states of each frontier node's parent
        for b, job in enumerate(jobs):
            job.cands.set_frontier(job.cands.grow(ROOT, nexts[b]))
            parent_rows[job.index] = [b] * len(job.cands.frontier)
        for step in range(1, max(job.cands.shape.num_steps for job in jobs)):
            active = [job for job in jobs if job.cands.shape.num_steps > step and job.cands.frontier]
            if not active:
                break
            states = self._forward_frontiers(active, step, states, parent_rows)
            nexts = self._next(states, [job for job in active for _ in job.cands.frontier])
            offset = 0
            for job in active:  # rows of states: each active job's frontier, in order
                cands = job.cands
                row_of, children = {}, []
                for row, node in enumerate(cands.frontier, start=offset):
                    row_of[node] = row
                    children += cands.grow(node, nexts[row])
                offset += len(cands.frontier)
                cands.set_frontier(children)
                parent_rows[job.index] = [row_of[cands.parents[c]] for c in cands.frontier]

    def _forward_frontiers(self, active: list[_TreeJob], step: int, states: torch.Tensor,
                           parent_rows: dict[int, list[int]]) -> torch.Tensor:
        """One forward over the frontier nodes of every active job; their states [T, X]."""
        ids, pos, attn, rows = [], [], [], []
        for job in active:
            cands = job.cands
            mask = cands.frontier_mask(step)  # [k, E + step * k]
            ids.extend(cands.tokens[c] for c in cands.frontier)
            pos.extend([cands.num_entries - 1 + step] * len(cands.frontier))
            attn.append(SeqAttention(job.state.table, kv_len=mask.shape[1],
                                     q_len=len(cands.frontier), mask=mask))
            rows.extend(parent_rows[job.index])
        meta = self.backend.plan(attn, self.device)
        ctx = AttentionContext(self.backend, meta, self.cache)
        parents = states[torch.tensor(rows, device=self.device)]  # [T, X]
        return self.model.forward_nodes(torch.tensor(ids, device=self.device), parents,
                                        torch.tensor(pos, device=self.device), ctx)

    def _trim(self, table: PageTable) -> None:
        """Give back the pages beyond the committed entries (the tree scratch)."""
        keep = -(-table.num_slots // table.page_size)
        self.pool.free(table.pages[keep:])
        del table.pages[keep:]
