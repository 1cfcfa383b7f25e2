"""The drafter in-process: tree shapes, catch-up vs rebuild, exactness against plain references,
per-sequence errors, and the servicer over an in-process gRPC server."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from unittest import mock

import grpc
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from draft_service import tree_search
from draft_service.config import DraftConfig
from draft_service.drafter import (
    Drafter,
    DrafterLimits,
    SeqInput,
    TreeShape,
    encode_features,
    sampled_topology,
)
from draft_service.models import EAGLE3, STANDALONE, DraftModel, load_draft_model, read_spec
from draft_service.servicer import DRAFT_FAULT_ENV, DraftServicer, draft_fault_from_env, draft_info
from draft_service.startup import allocate_kv_cache, warmup
from draft_service.tree_search import Candidates
from splitspec.attention import TorchAttentionBackend
from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import InitReport
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.model.config import read_hf_config
from splitspec.model.eagle3 import Eagle3Head
from splitspec.sampling import SamplingParams, proposals
from splitspec.tree import Tree, depths, first_child_run, tree_error
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.stats import chi_square, critical

TREE = TreeShape(num_draft_tokens=8, topk=4, num_steps=4)
CHAIN = TreeShape(num_draft_tokens=5, topk=1, num_steps=5)
NO_TREE = TreeShape(0, 0, 0)


def make_drafter(model_dir, max_context: int = 128, max_running: int = 8, page_size: int = 4,
                 num_pages: int | None = None) -> Drafter:
    cfg = DraftConfig(model=model_dir, max_context=max_context, max_running=max_running,
                      page_size=page_size)
    spec = read_spec(model_dir, "auto", cfg.target_dir)
    model = load_draft_model(spec, torch.float32, "cpu")
    if num_pages is None:
        cache, pool = allocate_kv_cache(cfg, model).value
    else:
        cache = KVCache(model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim,
                        torch.float32, "cpu")
        pool = PagePool(num_pages)
    limits = DrafterLimits(max_running, max_context, cfg.max_tree_nodes)
    return Drafter(model, cache, pool, TorchAttentionBackend(), limits)


@pytest.fixture(scope="module")
def eagle():
    return make_drafter(BUILTIN_EAGLE3)


@pytest.fixture(scope="module")
def standalone():
    return make_drafter(BUILTIN_DRAFT)


@pytest.fixture(params=[EAGLE3, STANDALONE])
def drafter(request, eagle, standalone):
    return eagle if request.param == EAGLE3 else standalone


def fake_tokens(n: int, seed: int = 0, vocab: int = 2048) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fake_features(model: DraftModel, rows: int, seed: int = 0) -> torch.Tensor:
    """Target features of positions 0..rows-1 (fixed seed: the same for every path)."""
    return torch.randn(rows, model.feature_dim, generator=torch.Generator().manual_seed(seed))


def seq_input(model: DraftModel, seq_id: int, start: int, tokens: list[int], shape: TreeShape,
              features: torch.Tensor | None = None, sampling: SamplingParams | None = None
              ) -> SeqInput:
    """new_tokens = tokens[start:], with the feature rows the target would send."""
    new = tokens[start:]
    if not model.feature_dim:
        return SeqInput(seq_id, start, new, shape, sampling=sampling)
    lo, hi = max(start - 1, 0), len(tokens) - 1
    data, dim, dtype = encode_features(features[lo:hi])
    return SeqInput(seq_id, start, new, shape, data, dim, dtype, sampling)


def draft_one(drafter: Drafter, tokens: list[int], shape: TreeShape, seed: int = 0,
              sampling: SamplingParams | None = None) -> Tree:
    """A fresh session, one exchange from 0; returns the tree."""
    features = fake_features(drafter.model, len(tokens), seed) if drafter.model.feature_dim else None
    session = drafter.open_session()
    try:
        (result,) = drafter.draft(session, [seq_input(drafter.model, 1, 0, tokens, shape, features,
                                                      sampling)])
    finally:
        drafter.close_session(session)
    assert result.error == ""
    return result.tree


# ---- references: plain torch, no cache ----------------------------------------------------


def causal_attention(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A LlamaAttention module applied with plain causal attention over the whole sequence."""
    t = x.shape[0]
    q = attn.q_proj(x).view(t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    q, k = attn.rotary(q, k, positions)
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return attn.o_proj(out.transpose(0, 1).reshape(t, -1))


def eagle3_reference(head, token_ids: torch.Tensor, hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 head over rows (token, hidden [H]) at positions 0..T-1: (logits, g)."""
    layer = head.midlayer
    x = torch.cat((layer.input_layernorm(head.embed_tokens(token_ids)), layer.hidden_norm(hidden)), -1)
    h = hidden + causal_attention(layer.self_attn, x, torch.arange(len(token_ids)))
    g = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.lm_head(head.norm(g)).float(), g


def llama_reference(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of our Llama over token_ids with plain causal attention."""
    h = model.model.embed_tokens(torch.tensor(token_ids))
    positions = torch.arange(len(token_ids))
    for layer in model.model.layers:
        h = h + causal_attention(layer.self_attn, layer.input_layernorm(h), positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.compute_logits(model.model.norm(h))


def reference_logprobs(model: DraftModel, tokens: list[int], features: torch.Tensor | None,
                       path: list[int]) -> torch.Tensor:
    """Draft log-probs after the committed tokens and a path of drafted tokens, uncached."""
    with torch.inference_mode():
        if not model.feature_dim:
            logits = llama_reference(model.model, tokens + path)[-1]
        else:  # entries (fc(h_i), t_{i+1}), then nodes (g of the parent, node token)
            head = model.head
            ids = torch.tensor(tokens[1:] + path)
            hidden = head.fuse(features[: len(tokens) - 1])
            for _ in path:  # each node's hidden is the g its parent produced
                _, g = eagle3_reference(head, ids[: len(hidden)], hidden)
                hidden = torch.cat((hidden, g[-1:]))
            logits, _ = eagle3_reference(head, ids, hidden)
            logits = logits[-1]
    return torch.log_softmax(logits, dim=-1)


def reference_tree(model: DraftModel, tokens: list[int], features: torch.Tensor | None,
                   shape: TreeShape) -> Tree:
    """EAGLE-2 drafting with one uncached forward per expanded node (see drafter.py)."""
    k, steps, budget = shape.topk, shape.num_steps, shape.num_draft_tokens

    def next_logprobs(path: list[int]) -> torch.Tensor:
        return reference_logprobs(model, tokens, features, path)

    cands: list[tuple[list[int], float]] = []  # (path of target ids, score), generation order
    parent_of: list[int] = []

    def expand(parent: int) -> list[int]:
        path, score = ([], 0.0) if parent < 0 else cands[parent]
        top = next_logprobs(path).topk(k)
        ids = model.to_target_ids(top.indices).tolist()
        made = []
        for tok, lp in zip(ids, top.values.tolist(), strict=True):
            cands.append(([*path, tok], score + lp))
            parent_of.append(parent)
            made.append(len(cands) - 1)
        return made

    frontier = expand(-1)
    for _ in range(steps - 1):
        children = [c for f in frontier for c in expand(f)]
        frontier = sorted(children, key=lambda c: -cands[c][1])[:k]
    order = sorted(range(len(cands)), key=lambda c: (-cands[c][1], len(cands[c][0]), c))
    kept: list[int] = []
    for c in order:
        if len(kept) < budget and (parent_of[c] < 0 or parent_of[c] in kept):
            kept.append(c)
    kept.sort(key=lambda c: (len(cands[c][0]), c))
    index = {c: i + 1 for i, c in enumerate(kept)}
    return Tree([cands[c][0][-1] for c in kept], [index.get(parent_of[c], 0) for c in kept])


# ---- tree shape ---------------------------------------------------------------------------


def with_sampled_trees(drafter: Drafter) -> Drafter:
    """The same model, cache and pages, drafting sampled trees for sequences that sample."""
    return Drafter(drafter.model, drafter.cache, drafter.pool, drafter.backend,
                   dataclasses.replace(drafter.limits, sampled_trees=True, proposal_support=16))


SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=5)


def child_profile(children: dict[int, list[int]], depth_of: list[int]) -> list[tuple[int, int]]:
    """Sorted (depth, number of children) of every node that has children."""
    return sorted((depth_of[node], len(kids)) for node, kids in children.items() if kids)


def test_sampled_tree_has_the_topology_and_the_draft_distribution(drafter):
    """A sampled tree: the fixed topology of its shape, siblings distinct, and each node's
    proposal the draft's own distribution at that node (checked against uncached drafting),
    reproducible for a seed."""
    sampler = with_sampled_trees(drafter)
    model = drafter.model
    tokens = fake_tokens(14, seed=4)
    features = fake_features(model, 14, seed=4) if model.feature_dim else None
    for shape in (TREE, CHAIN, TreeShape(6, 3, 3)):
        tree = draft_one(sampler, tokens, shape, seed=4, sampling=SAMPLED)
        topology = sampled_topology(shape)
        assert tree.num_nodes == len(topology) - 1, shape
        assert tree_error(tree, model.vocab_size, shape.num_draft_tokens) is None
        topo_depths = [0] * len(topology)
        for node, kids in enumerate(topology):
            for kid in kids:
                topo_depths[kid] = topo_depths[node] + 1
        assert child_profile(tree.children(), depths(tree.parents)) == \
            child_profile(dict(enumerate(topology)), topo_depths)
        paths = [[]]
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            paths.append([*paths[parent], token])
        for index in tree.children():
            logprobs = reference_logprobs(model, tokens, features, paths[index])
            ids, probs = proposals(logprobs[None], SAMPLED, 16, model.to_target_ids)
            got = tree.proposals[index]
            assert got.tokens == ids[0], (shape, index)
            torch.testing.assert_close(torch.tensor(got.probs), torch.tensor(probs[0]),
                                       atol=2e-4, rtol=0)
        assert draft_one(sampler, tokens, shape, seed=4, sampling=SAMPLED) == tree
    other = draft_one(sampler, tokens, TREE, seed=4, sampling=dataclasses.replace(SAMPLED, seed=6))
    assert other.tokens != draft_one(sampler, tokens, TREE, seed=4, sampling=SAMPLED).tokens


def test_sampled_draws_follow_the_distribution_sent(standalone):
    """Over seeds, the root's first two draws are distributed as the q the tree carries
    (first ~ q, second ~ q without the first): the draft draws from what it claims."""
    sampler = with_sampled_trees(standalone)
    tokens = fake_tokens(10, seed=8)
    params = SamplingParams(temperature=1.0, top_k=6)
    shape = TreeShape(2, 2, 1)
    pairs: Counter = Counter()
    q = None
    for seed in range(3000):
        tree = draft_one(sampler, tokens, shape, sampling=dataclasses.replace(params, seed=seed))
        q = dict(zip(*tree.proposals[0], strict=True))
        pairs[tuple(tree.tokens)] += 1
    exact = {(a, b): qa * qb / (1 - qa) for a, qa in q.items() for b, qb in q.items() if a != b}
    stat, df = chi_square(pairs, exact, 3000)
    assert set(pairs) <= set(exact) and len(exact) == 30
    assert stat < critical(df), (stat, df, pairs.most_common(5))


def test_sampled_trees_only_for_sequences_that_sample(standalone):
    sampler = with_sampled_trees(standalone)
    tokens = fake_tokens(12, seed=9)
    greedy = draft_one(sampler, tokens, TREE, sampling=SamplingParams())
    assert greedy == draft_one(standalone, tokens, TREE) and not greedy.proposals
    assert draft_one(standalone, tokens, TREE, sampling=SAMPLED).proposals == ()  # option off
    session = sampler.open_session()
    try:
        (result,) = sampler.draft(session, [seq_input(sampler.model, 1, 0, tokens, TREE,
                                                      sampling=SamplingParams(temperature=1.0))])
    finally:
        sampler.close_session(session)
    assert "seed" in result.error


def test_topk1_is_a_chain_of_num_steps(drafter):
    tree = draft_one(drafter, fake_tokens(20), TreeShape(num_draft_tokens=9, topk=1, num_steps=5))
    assert tree.parents == [0, 1, 2, 3, 4]
    assert tree_error(tree, drafter.model.vocab_size, 5) is None


def test_a_trees_first_child_path_is_the_chain_the_draft_would_send(drafter):
    """Children come likeliest first, so a tree's first-child path is the topk-1 chain drafted
    from the same state: the target reads what a chain budget would have accepted off that
    path (StepStats.first_child_accepted), and the adaptive policy trusts it."""
    for seed in range(6):
        tokens = fake_tokens(20, seed=seed)
        tree = draft_one(drafter, tokens, TREE, seed=seed)
        chain = draft_one(drafter, tokens, TreeShape(3, 1, 3), seed=seed)
        first: dict[int, int] = {}
        for index, parent in enumerate(tree.parents, start=1):
            first.setdefault(parent, index)
        path = [first[0]]
        while path[-1] in first and len(path) < 3:
            path.append(first[path[-1]])
        assert len(path) >= 2, tree  # the likeliest child of the likeliest child is kept
        assert [tree.tokens[i - 1] for i in path] == chain.tokens[:len(path)], seed
        # ... so accepting the chain's tokens walks the first-child path.
        assert first_child_run(tree, path) == len(path)


def test_best_tree_keeps_the_best_candidates_closed_under_parents():
    """Candidates.best_tree (each searched tree's selection) against the rule written out
    plainly, as reference_tree has it: by score, then depth, then generation order; a
    candidate whose parent was passed over is passed over too; parents first. Scores on a
    coarse grid, so that equal scores, within a level and across levels, are common; some
    children score above their parents (a real search never has them) so that the closure
    rule is used."""
    def plain(tokens, parents, scores, depths, size):
        order = sorted(range(len(tokens)), key=lambda c: (-scores[c], depths[c], c))
        kept = []
        for c in order:
            if len(kept) < size and (parents[c] < 0 or parents[c] in kept):
                kept.append(c)
        kept.sort(key=lambda c: (depths[c], c))
        index = {c: i + 1 for i, c in enumerate(kept)}
        return Tree([tokens[c] for c in kept], [index.get(parents[c], 0) for c in kept])

    gen = np.random.default_rng(7)
    skipped = ties = 0
    for k, levels, size in ((2, 3, 5), (3, 3, 8), (4, 4, 8), (1, 4, 3), (4, 2, 20)):
        columns = k + (levels - 1) * k * k
        packed = np.zeros((3, 6, columns))
        for row in range(6):
            parents = [-1] * k
            for level in range(levels - 1):  # each level's children of k frontier nodes
                first = k + (level - 1) * k * k if level else 0
                frontier = gen.choice(np.arange(first, len(parents)), size=k, replace=False)
                parents += [int(f) for f in frontier for _ in range(k)]
            packed[0, row] = gen.integers(0, 1000, columns)
            packed[1, row] = parents
            packed[2, row] = -gen.integers(0, 6, columns) / 2  # a coarse grid
        found = Candidates.of_packed(packed)
        depths_ = [1] * k + [2 + c // (k * k) for c in range(columns - k)]
        for row in range(6):
            tokens, parents = found.tokens[row].tolist(), found.parents[row].tolist()
            scores = found.scores[row].tolist()
            want = plain(tokens, parents, scores, depths_, size)
            assert found.best_tree(row, size) == want, (k, levels, row)
            ranked = sorted(range(columns), key=lambda c: (-scores[c], depths_[c], c))[:size]
            skipped += any(parents[c] >= 0 and parents[c] not in ranked for c in ranked)
            ties += len(set(scores)) < columns
        # all rows at once (the graphed path's pick; BATCHED_ROWS 1: even for 6 rows): the
        # same trees
        rows_at_once = mock.patch.object(tree_search, "BATCHED_ROWS", 1)
        with rows_at_once:
            assert found.best_trees(size) == [found.best_tree(row, size) for row in range(6)]
        # ... and, where every child scores at most its parent (as in a search), without
        # falling back to best_tree row by row
        for row in range(6):
            for column in range(k, columns):  # parents come first in generation order
                parent = int(packed[1, row, column])
                packed[2, row, column] = packed[2, row, parent] - gen.integers(0, 2) / 2
        searched = Candidates.of_packed(packed)
        want = [searched.best_tree(row, size) for row in range(6)]
        with rows_at_once, mock.patch.object(Candidates, "best_tree",
                                             side_effect=AssertionError("fell back")):
            assert searched.best_trees(size) == want
    assert skipped and ties  # the closure rule and the ties were met


def test_tree_is_well_formed_full_and_deterministic(drafter):
    tokens = fake_tokens(20)
    tree = draft_one(drafter, tokens, TREE)
    assert tree.num_nodes == 8
    assert tree_error(tree, drafter.model.vocab_size, 8) is None
    assert all(p <= i for i, p in enumerate(tree.parents))
    tree_depths = depths(tree.parents)
    assert max(tree_depths) <= TREE.num_steps
    assert tree_depths[1:] == sorted(tree_depths[1:])  # sorted by depth
    assert sum(1 for p in tree.parents if p == 0) <= TREE.topk
    assert draft_one(drafter, tokens, TREE) == tree
    assert drafter.num_held == 0


def test_tree_matches_reference_drafting_without_cache(drafter):
    """The batched, paged, masked drafting equals EAGLE-2 drafting done the slow way: one full
    causal forward (no cache, no mask) per expanded node."""
    model = drafter.model
    tokens = fake_tokens(16, seed=3)
    features = fake_features(model, 16, seed=3) if model.feature_dim else None
    for shape in (TREE, TreeShape(6, 3, 3), TreeShape(10, 2, 5), CHAIN):
        expected = reference_tree(model, tokens, features, shape)
        assert draft_one(drafter, tokens, shape, seed=3) == expected, shape


def test_batched_sequences_get_the_trees_they_get_alone(drafter):
    """One request, sequences of different lengths and shapes (sequences of one shape are drafted
    as one batch, padded to the longest): each tree equals its solo draft."""
    model = drafter.model
    shapes = [TREE, CHAIN, TreeShape(10, 2, 5), NO_TREE, TreeShape(3, 3, 1), TreeShape(7, 4, 2),
              TREE, TREE]
    seqs, solo = [], []
    for i, shape in enumerate(shapes):
        tokens = fake_tokens(9 + 3 * i, seed=20 + i)
        features = fake_features(model, len(tokens), seed=20 + i) if model.feature_dim else None
        seqs.append(seq_input(model, 100 + i, 0, tokens, shape, features))
        solo.append(draft_one(drafter, tokens, shape, seed=20 + i) if shape.num_draft_tokens
                    else Tree([], []))
    session = drafter.open_session()
    try:
        results = drafter.draft(session, seqs)
    finally:
        drafter.close_session(session)
    assert [r.error for r in results] == [""] * len(shapes)
    assert [r.tree for r in results] == solo


def test_cap_at_max_tree_nodes(standalone):
    shape = TreeShape(num_draft_tokens=500, topk=2, num_steps=100)
    assert standalone.capped(shape) == TreeShape(64, 2, 64)
    tree = draft_one(standalone, fake_tokens(10), TreeShape(num_draft_tokens=500, topk=2, num_steps=3))
    assert tree.num_nodes == 2 + 2 * 4  # every candidate: k + (S - 1) * k * k
    assert tree_error(tree, standalone.model.vocab_size, 64) is None


# ---- catch-up ------------------------------------------------------------------------------


def test_incremental_catch_up_equals_rebuild(drafter):
    model = drafter.model
    tokens = fake_tokens(30, seed=1)
    features = fake_features(model, 30, seed=1) if model.feature_dim else None
    whole = draft_one(drafter, tokens, TREE, seed=1)
    session = drafter.open_session()
    try:
        for start, end, shape in ((0, 7, NO_TREE), (7, 8, TREE), (8, 19, CHAIN), (19, 30, TREE)):
            (result,) = drafter.draft(session, [seq_input(model, 5, start, tokens[:end], shape,
                                                          features)])
            assert result.error == ""
        assert result.tree == whole
        assert session.seqs[5].num_tokens == 30
    finally:
        drafter.close_session(session)


def test_catch_up_in_the_search_pass_matches_catching_up_first():
    """The steady state on a GPU (TreeSearch.run_caught_up, in one graph there) run eagerly:
    three sequences of different lengths take 1 .. depth + 1 new entries a call, a rollback
    and a long catch-up (which go the two-pass way) in between; trees, the cached K/V of
    every entry and each sequence's last state match a drafter that catches up first."""
    for directory in (BUILTIN_EAGLE3, BUILTIN_DRAFT):
        plain, fused = make_drafter(directory), make_drafter(directory)
        fused.search.use_pad_page(fused.pool.allocate(1)[0])
        calls = []

        def can_catch_up(num_new, firsts, shape, calls=calls):  # as if captured
            ok = all(1 <= n <= shape.num_steps + 1 for n in num_new) and min(firsts) >= 1
            calls.append(ok)
            return ok

        fused.search.can_catch_up = can_catch_up
        model = plain.model
        streams = {i: fake_tokens(60, seed=40 + i) for i in range(3)}
        features = {i: fake_features(model, 60, seed=40 + i) if model.feature_dim else None
                    for i in range(3)}
        # (seq -> (start, end)) per call: prompts, steps of 1 .. 5, a rollback, a long catch-up
        rounds = [{0: (0, 9), 1: (0, 14), 2: (0, 20)},
                  {0: (9, 10), 1: (14, 19), 2: (20, 23)},
                  {0: (10, 15), 1: (19, 21), 2: (23, 24)},
                  {0: (13, 16), 1: (21, 22), 2: (24, 28)},   # seq 0 rolls back two tokens
                  {0: (16, 30), 1: (22, 25), 2: (28, 29)},   # seq 0 catches up 14
                  {0: (30, 33), 1: (25, 30), 2: (29, 31)}]
        sessions = {d: d.open_session() for d in (plain, fused)}
        for spans in rounds:
            got = {}
            for d in (plain, fused):
                items = [seq_input(model, seq, start, streams[seq][:end], TREE, features[seq])
                         for seq, (start, end) in spans.items()]
                results = d.draft(sessions[d], items)
                assert [r.error for r in results] == [""] * 3
                got[d] = [r.tree for r in results]
            assert got[plain] == got[fused]
        assert calls == [False, True, True, True, False, True]  # prompts, the long catch-up
        for seq in range(3):
            a, b = sessions[plain].seqs[seq], sessions[fused].seqs[seq]
            assert a.num_entries == b.num_entries
            torch.testing.assert_close(a.last_state, b.last_state, atol=1e-5, rtol=1e-5)
            for layer in range(model.num_layers):
                ka, va = plain.cache.read(layer, a.table.global_slots(0, a.num_entries))
                kb, vb = fused.cache.read(layer, b.table.global_slots(0, b.num_entries))
                torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
        for d, session in sessions.items():
            d.close_session(session)


def test_rollback_truncates_to_start(drafter):
    """Hold 32 tokens, then resend from 22 with other tokens: as if built from 0 with those."""
    model = drafter.model
    held = fake_tokens(32, seed=2)
    other = held[:22] + fake_tokens(8, seed=9)
    held_features = other_features = None
    if model.feature_dim:  # the same target features up to position 21, then others
        held_features = fake_features(model, 32, seed=2)
        other_features = torch.cat((held_features[:22], fake_features(model, 8, seed=9)))
    session = drafter.open_session()
    try:
        drafter.draft(session, [seq_input(model, 1, 0, held, TREE, held_features)])
        (result,) = drafter.draft(session, [seq_input(model, 1, 22, other, TREE, other_features)])
        assert result.error == ""
        assert session.seqs[1].num_tokens == 30
        assert session.seqs[1].num_entries == model.num_entries(30)
    finally:
        drafter.close_session(session)
    assert result.tree == draft_with_features(drafter, other, other_features)


def draft_with_features(drafter: Drafter, tokens: list[int], features: torch.Tensor | None) -> Tree:
    session = drafter.open_session()
    try:
        (result,) = drafter.draft(session, [seq_input(drafter.model, 1, 0, tokens, TREE, features)])
    finally:
        drafter.close_session(session)
    return result.tree


def test_rollback_without_new_tokens_is_an_error_then_resend_works(standalone):
    model = standalone.model
    tokens = fake_tokens(12)
    session = standalone.open_session()
    try:
        standalone.draft(session, [seq_input(model, 1, 0, tokens, NO_TREE)])
        (result,) = standalone.draft(session, [SeqInput(1, 6, [], TREE)])
        assert "resend from 0" in result.error
        assert 1 not in session.seqs
        (result,) = standalone.draft(session, [seq_input(model, 1, 0, tokens, TREE)])
        assert result.error == "" and result.tree.num_nodes == 8
    finally:
        standalone.close_session(session)


# ---- exactness -----------------------------------------------------------------------------


def test_eagle3_first_token_matches_head_run_without_cache(eagle):
    model = eagle.model
    assert model.head.d2t.any(), "the built-in head should map draft ids to other target ids"
    tokens = fake_tokens(25, seed=4)
    features = fake_features(model, 25, seed=4)
    session = eagle.open_session()
    try:
        (result,) = eagle.draft(session, [seq_input(model, 1, 0, tokens, TREE, features)])
        state = session.seqs[1].last_state
    finally:
        eagle.close_session(session)
    # Entries: (h_i, t_{i+1}) at position i, i = 0..23.
    head = model.head
    with torch.inference_mode():
        logits, g = eagle3_reference(head, torch.tensor(tokens[1:]), head.fuse(features[:24]))
    torch.testing.assert_close(state, g[-1], atol=1e-4, rtol=1e-4)
    assert result.tree.tokens[0] == head.to_target_ids(logits[-1].argmax()).item()


def test_standalone_target_chain_equals_transformers_greedy():
    drafter = make_drafter(BUILTIN_TARGET)
    hf = HFLlama.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()
    prompt = fake_tokens(14, seed=5)
    steps = 6
    tree = draft_one(drafter, prompt, TreeShape(steps, 1, steps))
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(hf(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert tree.tokens == ids[len(prompt):]
    assert tree.parents == list(range(steps))


# ---- per-sequence errors -------------------------------------------------------------------


def test_per_sequence_errors_leave_other_sequences_served(eagle):
    model = eagle.model
    tokens = fake_tokens(20, seed=6)
    features = fake_features(model, 20, seed=6)
    good = seq_input(model, 1, 0, tokens, TREE, features)
    unknown = seq_input(model, 2, 5, tokens, TREE, features)
    data, _, dtype = encode_features(torch.zeros(19, model.feature_dim + 1))
    wide = SeqInput(3, 0, tokens, TREE, data, model.feature_dim + 1, dtype)
    short = seq_input(model, 4, 0, tokens, TREE, features)
    short = SeqInput(4, 0, tokens, TREE, short.hidden_states[:-4], short.hidden_dim, short.dtype)
    long_tokens = fake_tokens(eagle.limits.max_context + 1)
    too_long = seq_input(model, 5, 0, long_tokens, TREE, fake_features(model, len(long_tokens)))
    bad_token = SeqInput(6, 0, [1, model.vocab_size], TREE, good.hidden_states[:model.feature_dim * 4],
                         model.feature_dim, "float32")
    bad_dtype = SeqInput(7, 0, tokens, TREE, good.hidden_states, good.hidden_dim, "int8")
    session = eagle.open_session()
    try:
        results = eagle.draft(session, [unknown, good, wide, short, too_long, bad_token, bad_dtype])
        assert [r.seq_id for r in results] == [2, 1, 3, 4, 5, 6, 7]
        errors = {r.seq_id: r.error for r in results}
        assert errors[1] == "" and results[1].tree == draft_one(eagle, tokens, TREE, seed=6)
        assert errors[2] == "unknown sequence, resend from 0"
        assert "hidden_dim" in errors[3]
        assert "bytes" in errors[4]
        assert "max-context" in errors[5]
        assert "vocabulary" in errors[6]
        assert "dtype" in errors[7]
        assert all(r.tree.num_nodes == 0 for r in results if r.error)
        assert set(session.seqs) == {1}
        # The stream goes on: the good sequence continues, a failed one is resent from 0.
        more = tokens + fake_tokens(3, seed=8)
        more_features = torch.cat((features, fake_features(model, 3, seed=8)))
        results = eagle.draft(session, [seq_input(model, 1, 20, more, TREE, more_features),
                                        seq_input(model, 2, 0, tokens, TREE, features)])
        assert [r.error for r in results] == ["", ""]
        assert results[1].tree == draft_one(eagle, tokens, TREE, seed=6)
    finally:
        eagle.close_session(session)
    assert eagle.num_held == 0


def test_out_of_pages_and_max_running_fail_only_that_sequence():
    drafter = make_drafter(BUILTIN_DRAFT, max_running=2, page_size=4, num_pages=8)
    model = drafter.model
    session = drafter.open_session()
    try:
        results = drafter.draft(session, [
            seq_input(model, 1, 0, fake_tokens(10), CHAIN),       # 3 pages + 1 scratch page
            seq_input(model, 2, 0, fake_tokens(40, seed=1), CHAIN),  # 10 pages: out of pages
            seq_input(model, 3, 0, fake_tokens(8), CHAIN),
            seq_input(model, 4, 0, fake_tokens(8), CHAIN),        # a third sequence held
        ])
        errors = [r.error for r in results]
        assert errors[0] == "" and errors[2] == ""
        assert "out of draft KV-cache pages" in errors[1]
        assert "max-running" in errors[3]
        assert results[0].tree.num_nodes == 5 and results[2].tree.num_nodes == 5
        assert drafter.pool.num_free == 8 - 3 - 2  # tree scratch pages were given back
        drafter.draft(session, [], release_ids=[1, 3, 99])
        assert drafter.num_held == 0 and drafter.pool.num_free == 8
    finally:
        drafter.close_session(session)


def test_tree_scratch_out_of_pages_is_a_sequence_error():
    """A sampled tree's scratch takes pages; a top-k tree's lives off the paged cache, so it
    drafts wherever the entries fit."""
    for sampling, error in ((SAMPLED, "tree scratch"), (None, "")):
        drafter = with_sampled_trees(make_drafter(BUILTIN_DRAFT, page_size=4, num_pages=4))
        session = drafter.open_session()
        try:
            (result,) = drafter.draft(session, [seq_input(drafter.model, 1, 0, fake_tokens(12), TREE,
                                                          sampling=sampling)])
            assert (error in result.error) if error else result.error == ""
            assert drafter.pool.num_free == (4 if error else 1)  # 12 entries hold 3 pages
        finally:
            drafter.close_session(session)


def test_warmup_passes_and_releases(drafter):
    assert "tree of 8 nodes" in warmup(drafter).detail
    assert drafter.num_held == 0


def test_warmup_puts_one_row_and_a_few_through_the_heads_fc(eagle, monkeypatch):
    """The rows fc sees in warmup: a few (a prompt) and one (a two-token prompt), each a
    kernel variant on the GPU (gemv for one row, few_rows for 2 to 16) that would otherwise
    first compile in a request: a one-entry catch-up outside the graphs met fc's one-row
    variant only while serving (docs/benchmarks.md, twentieth part)."""
    rows = []
    fuse = Eagle3Head.fuse

    def counted(head, features):
        rows.append(features.shape[0])
        return fuse(head, features)

    monkeypatch.setattr(Eagle3Head, "fuse", counted)
    warmup(eagle)
    assert 1 in rows and any(2 <= n <= 16 for n in rows), rows
    assert eagle.num_held == 0


# ---- servicer ------------------------------------------------------------------------------


@pytest.fixture
def served(standalone):
    def start(fault: str = ""):
        spec = read_spec(BUILTIN_DRAFT, "auto", None)
        info = draft_info(spec, standalone.limits.max_context)
        server = ServiceServer("127.0.0.1:0", 4, ["splitspec.v1.Draft"])
        draft_pb2_grpc.add_DraftServicer_to_server(
            DraftServicer(standalone, info, InitReport("draft"), fault), server.server)
        server.start()
        started.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        return draft_pb2_grpc.DraftStub(channel)

    started: list[ServiceServer] = []
    yield start
    for server in started:
        server.stop(0)


def pb_input(seq_id: int, start: int, tokens: list[int], num: int, topk: int, steps: int):
    return draft_pb2.SeqDraftInput(seq_id=seq_id, start=start, new_tokens=tokens[start:],
                                   shape=common_pb2.DraftShape(num_draft_tokens=num, topk=topk,
                                                               num_steps=steps))


def test_servicer_exchange_round_trip(served, standalone):
    stub = served()
    info = stub.GetInfo(draft_pb2.GetDraftInfoRequest())
    assert (info.kind, info.model_name, info.vocab_size) == ("standalone", "draft", 2048)
    assert len(info.tokenizer_sha256) == 64 and not info.needs_hidden_states
    tokens = fake_tokens(20)
    requests = [
        draft_pb2.DraftRequest(step=7, seqs=[pb_input(1, 0, tokens[:15], 8, 4, 4),
                                             pb_input(2, 3, tokens, 8, 4, 4),
                                             pb_input(3, 0, tokens, 0, 0, 0)]),
        draft_pb2.DraftRequest(step=8, seqs=[pb_input(1, 15, tokens, 5, 1, 5)], release_ids=[3]),
    ]
    replies = list(stub.Exchange(iter(requests)))
    assert [r.step for r in replies] == [7, 8]
    first = replies[0]
    assert [t.seq_id for t in first.trees] == [1, 2, 3]
    assert len(first.trees[0].tokens) == 8 and not first.trees[0].error
    assert first.trees[1].error == "unknown sequence, resend from 0"
    assert not first.trees[2].tokens and not first.trees[2].error
    assert first.draft_s > 0
    chain = replies[1].trees[0]
    assert list(chain.tokens) == draft_one(standalone, tokens, CHAIN).tokens
    deadline = time.monotonic() + 5
    while standalone.num_held and time.monotonic() < deadline:  # freed when the stream ends
        time.sleep(0.01)
    assert standalone.num_held == 0


def test_malformed_tree_fault_corrupts_every_other_tree(served, monkeypatch):
    monkeypatch.setenv(DRAFT_FAULT_ENV, "malformed_tree")
    stub = served(draft_fault_from_env())
    tokens = fake_tokens(10)
    requests = [draft_pb2.DraftRequest(step=1, seqs=[pb_input(1, 0, tokens, 4, 2, 2),
                                                     pb_input(2, 0, tokens, 0, 0, 0),
                                                     pb_input(3, 0, tokens, 4, 2, 2)]),
                draft_pb2.DraftRequest(step=2, seqs=[pb_input(1, 10, tokens, 4, 2, 2)]),
                draft_pb2.DraftRequest(step=3, seqs=[pb_input(1, 10, tokens, 4, 2, 2)])]
    trees = [pb for reply in stub.Exchange(iter(requests)) for pb in reply.trees]
    problems = [tree_error(Tree(list(pb.tokens), list(pb.parents)), 2048, 64) for pb in trees]
    assert [p is not None for p in problems] == [True, False, True, False, True]
    monkeypatch.setenv(DRAFT_FAULT_ENV, "nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        draft_fault_from_env()


def test_spec_info_kind_and_captured_layers(tmp_path):
    info = draft_info(read_spec(BUILTIN_EAGLE3, "auto", BUILTIN_TARGET), 1024)
    assert (info.kind, info.needs_hidden_states, info.vocab_size) == ("eagle3", True, 2048)
    hidden = read_hf_config(BUILTIN_TARGET)["hidden_size"]
    assert (info.target_hidden_size, info.target_num_layers, info.max_context) == (hidden, 6, 1024)
    assert list(info.aux_layer_inputs) == []  # default layers
    assert info.tokenizer_sha256 == read_spec(BUILTIN_DRAFT, "auto", None).tokenizer_sha256 != ""
    head = tmp_path / "head"
    head.mkdir()
    config = json.loads((BUILTIN_EAGLE3 / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    (head / "config.json").write_text(json.dumps(config))
    spec = read_spec(head, "auto", BUILTIN_TARGET)
    assert spec.aux_layer_inputs == (1, 3, 5)  # explicit ids name layer outputs
    assert spec.tokenizer_sha256 == info.tokenizer_sha256  # from the target: the head has none
    assert read_spec(head, "auto", None).tokenizer_sha256 == ""
    with pytest.raises(ValueError, match="kind eagle3"):
        read_spec(head, "standalone", None)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="6 layers"):
        read_spec(head, "auto", BUILTIN_TARGET)


def test_graph_trees_flag_parses_and_refuses_bad_entries():
    assert DraftConfig(graph_trees="4x4, 1x6").graph_shapes == [(4, 4), (1, 6)]
    assert DraftConfig(graph_trees="").graph_shapes == []
    for bad in ("4", "4x", "0x4", "ax4", "4x4x4"):
        with pytest.raises(ValueError, match="TOPKxDEPTH"):
            DraftConfig(graph_trees=bad).check()


def test_chain_inputs_pad_and_reset_rows_between_fills():
    """The catch-up's inputs (tree_search.ChainInputs) as a graph replays them: each
    sequence's entries at its own slots, padding rows on the padding slot with token 0 and
    zero features, and rows a longer catch-up filled before reset by a shorter one."""
    from draft_service.tree_search import CatchUp, ChainInputs

    inputs = ChainInputs(2, 4, 2, 3, torch.float32, "cpu")
    a, b = PageTable(4, [7, 2], 8), PageTable(4, [5], 4)
    feats = torch.arange(9, dtype=torch.float32).view(3, 3) + 1
    inputs.fill([CatchUp(a, 5, [11, 12, 13], feats), CatchUp(b, 2, [14], None)], pad_slot=99)
    chain = inputs.chain
    assert chain.tokens.tolist() == [11, 12, 13, 0, 14, 0, 0, 0]
    assert chain.positions.tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
    assert chain.write_slots.tolist() == [9, 10, 11, 99, 22, 99, 99, 99]  # page 2's slots 1-3
    assert chain.last_row.tolist() == [2, 0] and chain.last.tolist() == [7, 7, 2, 2]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    eye = torch.eye(4, dtype=torch.bool)
    real = torch.arange(4)[None, :] < torch.tensor([3, 1])[:, None, None]
    assert torch.equal(chain.allowed, (causal & real) | eye)
    assert torch.equal(chain.features[:3], feats) and not chain.features[3:].any()

    inputs.fill([CatchUp(a, 7, [21], None), CatchUp(b, 1, [22, 23, 24], feats)], pad_slot=98)
    assert chain.tokens.tolist() == [21, 0, 0, 0, 22, 23, 24, 0]
    assert chain.write_slots.tolist() == [11, 98, 98, 98, 21, 22, 23, 98]
    assert not chain.features[:4].any() and torch.equal(chain.features[4:7], feats)
    assert chain.last.tolist() == [7, 7, 3, 3]

    with pytest.raises(ValueError, match="1 .. 4"):
        inputs.fill([CatchUp(a, 1, [1] * 5, None), CatchUp(b, 1, [1], None)], pad_slot=0)
    with pytest.raises(ValueError, match="for 2 sequences, given 1"):
        inputs.fill([CatchUp(a, 1, [1], None)], pad_slot=0)
    with pytest.raises(IndexError, match="reserved"):  # past the pages the table holds
        inputs.fill([CatchUp(a, 7, [1, 2], None), CatchUp(b, 1, [1], None)], pad_slot=0)


def test_chain_inputs_send_what_a_fresh_fill_would():
    """After any run of ChainInputs fills (catch-ups of 1-4 entries, with and without
    features; features as a tensor, or as request bytes of the buffer's dtype or of
    another), what a graph reads is what one fill of fresh inputs would have sent: nothing
    an earlier fill wrote is left behind."""
    from draft_service.tree_search import CatchUp, ChainInputs, WireFeatures

    gen = torch.Generator().manual_seed(5)
    tables = [PageTable(4, [3 * b, 3 * b + 1, 3 * b + 2], 12) for b in range(3)]

    def as_given(rows: torch.Tensor, kind: int) -> WireFeatures | torch.Tensor | None:
        if kind == 0:
            return None
        if kind == 1:
            return rows
        dtype = torch.float32 if kind == 2 else torch.bfloat16
        data = rows.to(dtype).view(torch.uint8).numpy().tobytes()
        return WireFeatures(data, rows.shape[0], rows.shape[1], dtype)

    def fills(count: int):
        for _ in range(count):
            seqs = []
            for table in tables:
                num = int(torch.randint(1, 5, (), generator=gen))
                first = int(torch.randint(0, 12 - num + 1, (), generator=gen))
                given = torch.randn(num, 5, generator=gen)
                kind = int(torch.randint(0, 4, (), generator=gen))
                seqs.append(CatchUp(table, first, list(range(1, num + 1)),
                                    as_given(given, kind)))
            yield seqs

    inputs = ChainInputs(3, 4, 2, 5, torch.float32, "cpu")
    for seqs in fills(40):
        inputs.fill(seqs, pad_slot=40)
        fresh = ChainInputs(3, 4, 2, 5, torch.float32, "cpu")
        fresh.fill(seqs, pad_slot=40)
        assert torch.equal(inputs.sent, fresh.sent)
        for b, seq in enumerate(seqs):  # and the given features are where they belong
            rows = inputs.chain.features[4 * b:4 * b + len(seq.tokens)]
            if seq.features is None:
                assert not rows.any()
            else:
                given = seq.features
                expected = given.tensor() if isinstance(given, WireFeatures) else given
                assert torch.equal(rows, expected.float())


def test_an_eager_catch_up_takes_each_sequences_features_in_its_own_dtype(eagle):
    """Drafter._features: two sequences caught up in one eager pass, one sending float32
    features and the other bfloat16 (values exact in both) draft the trees they draft when
    both send float32; the staged bytes are read back per sequence, each in its dtype."""
    model = eagle.model
    tokens = [fake_tokens(20, seed) for seed in (1, 2)]
    exact = [fake_features(model, 20, seed).to(torch.bfloat16).float() for seed in (1, 2)]

    def trees(dtypes: tuple[torch.dtype, torch.dtype]) -> list:
        session = eagle.open_session()
        try:
            inputs = [seq_input(model, i + 1, 0, tokens[i], TREE, exact[i].to(dtype))
                      for i, dtype in enumerate(dtypes)]
            assert [item.dtype for item in inputs] == [str(d).removeprefix("torch.")
                                                       for d in dtypes]
            results = eagle.draft(session, inputs)
        finally:
            eagle.close_session(session)
        assert all(r.error == "" for r in results)
        return [r.tree for r in results]

    assert trees((torch.float32, torch.bfloat16)) == trees((torch.float32, torch.float32))
