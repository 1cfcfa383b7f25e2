"""Sampling: the distributions, and losslessness of tree verification under sampling.

Speculation must not change what is sampled: with speculation ON the generated
tokens must follow the target's own distribution (temperature, top-k, top-p
applied), whatever the draft proposes. Checked twice: on the verifier alone
against an exactly known toy target (where a deliberately wrong verifier must
fail the same test), and through the live stack against transformers.
"""

from __future__ import annotations

import functools
import queue
from collections import Counter

import pytest
import torch

from splitspec import sampling
from splitspec.sampling import (
    SamplingParams,
    accept_sampled_tree,
    choose,
    draw_without_replacement,
    probabilities,
    proposals,
    uniform,
)
from splitspec.tree import Proposal, Tree, accept_tree, depths, tree_error
from tests.stats import chi_square, critical

# ---- the distribution ------------------------------------------------------------------


def test_probabilities_apply_temperature_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    plain = probabilities(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(plain, logits.softmax(-1))
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, (logits / 2).softmax(-1))
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all()
    torch.testing.assert_close(top2[0, :2], logits[0, :2].softmax(-1))
    # top_p: keep the smallest prefix of sorted tokens whose mass reaches p.
    p = plain[0]
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(p[0] + 0.01)))
    assert (nucleus[0, 2:] == 0).all() and (nucleus[0, :2] > 0).all()
    tiny = probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert tiny[0, 0] == 1.0  # the most likely token always survives


def test_seeded_choice_depends_on_seed_and_position_only():
    logits = torch.randn(8, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    positions = list(range(10, 18))
    assert choose(logits, params, positions) == choose(logits, params, positions)
    # The same row at the same position gives the same token whatever else is in the batch.
    assert choose(logits[3:4], params, [13]) == choose(logits, params, positions)[3:4]
    other = SamplingParams(temperature=1.0, seed=8)
    assert choose(logits, params, positions) != choose(logits, other, positions)
    assert choose(logits, SamplingParams(), positions) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="seed"):
        choose(logits, SamplingParams(temperature=1.0), positions)


def test_inverse_cdf_choice_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    params = SamplingParams(temperature=1.0, top_k=4)
    p = probabilities(logits, params)[0]
    counts = Counter()
    for seed in range(4000):
        counts[(choose(logits, SamplingParams(1.0, 4, 0.0, seed), [5])[0],)] += 1
    stat, df = chi_square(counts, {(t,): float(p[t]) for t in range(5) if p[t] > 0}, 4000)
    assert counts[(4,)] == 0 and stat < critical(max(df, 5)), (stat, df, counts)
    assert params.with_seed().seed is not None


# ---- the verifier against a toy target ---------------------------------------------------

VOCAB = 6


def toy_target(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed next-token distribution for every context (a seeded function of it)."""
    gen = torch.Generator().manual_seed(hash(context) % (2**31))
    return (torch.randn(VOCAB, generator=gen) * 1.5).softmax(-1)


# A deterministic draft's tree, rooted at the last committed token: depth-1 children 0, 1, 2;
# under child 0 the chain 3 -> 4; under child 1 the node 5. And a deterministic chain.
TREE = Tree(tokens=[0, 1, 2, 3, 5, 4], parents=[0, 0, 0, 1, 2, 4])
CHAIN = Tree(tokens=[2, 0, 5], parents=[0, 1, 2])


def node_contexts(tree: Tree) -> list[tuple[int, ...]]:
    contexts = [()]
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        contexts.append((*contexts[parent], token))
    return contexts


def children_of(tree: Tree, index: int) -> list[int]:
    return [tree.tokens[i] for i, parent in enumerate(tree.parents) if parent == index]


def wrong_choice(p: torch.Tensor, children: list[int], gen: torch.Generator) -> int:
    """A classic bug: try each child with probability p(child), and when all are rejected
    sample from p itself instead of from p with the rejected children's mass removed."""
    for child in children:
        if float(torch.rand((), generator=gen)) < float(p[child]):
            return child
    return int(torch.multinomial(p, 1, generator=gen))


def speculative_pair(tree: Tree, gen: torch.Generator, wrong: bool) -> tuple[int, int]:
    """The first two tokens generated with speculation: one verify step, then a plain step
    if the step committed only one token."""
    chosen = []
    for index, context in enumerate(node_contexts(tree)):
        p = toy_target(context)
        if wrong:
            chosen.append(wrong_choice(p, children_of(tree, index), gen))
        else:
            chosen.append(int(torch.multinomial(p, 1, generator=gen)))
    tokens = accept_tree(tree, chosen).tokens
    if len(tokens) < 2:
        tokens.append(int(torch.multinomial(toy_target((tokens[0],)), 1, generator=gen)))
    return tokens[0], tokens[1]


def exact_toy_pairs(target=toy_target) -> dict[tuple[int, int], float]:
    return {(a, b): float(target(())[a] * target((a,))[b]) for a in range(VOCAB)
            for b in range(VOCAB)}


@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("wrong", [False, True])
def test_tree_verification_under_sampling_is_lossless(tree, wrong):
    gen = torch.Generator().manual_seed(0)
    trials = 20000
    observed = Counter(speculative_pair(tree, gen, wrong) for _ in range(trials))
    stat, df = chi_square(observed, exact_toy_pairs(), trials)
    if wrong:
        assert stat > critical(df), "the test cannot tell a wrong verifier from a right one"
    else:
        assert stat < critical(df), (stat, df)
    assert max(depths(TREE.parents)) == 3


# ---- sampled drafts: recursive rejection sampling against the draft's own q -----------------

TOY_PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "top-k+top-p": SamplingParams(temperature=0.9, top_k=4, top_p=0.9),
}
# Tree topologies as children lists per topology node (0 = root), draws in order: a chain of
# 3, and a tree with three draws at the root, two under the first, one under the second.
CHAIN_TOPOLOGY = [[1], [2], [3], []]
TREE_TOPOLOGY = [[1, 2, 3], [4, 5], [6], [], [], [], []]


@functools.cache
def toy_logits(context: tuple[int, ...], salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((hash(context) + salt) % (2**31))
    return torch.randn(VOCAB, generator=gen) * 1.5


@functools.cache
def toy_proposal(context: tuple[int, ...], params: SamplingParams, support: int = 4
                 ) -> Proposal:
    """The toy draft's q after context: its distribution under params, cut to support."""
    ids, probs = proposals(toy_logits(context, salt=7)[None], params, support)
    return Proposal(ids[0], probs[0])


@functools.cache
def toy_p(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The toy target's p after context under params."""
    return probabilities(toy_logits(context, salt=0)[None], params)[0]


def sampled_tree(topology: list[list[int]], params: SamplingParams, gen: torch.Generator) -> Tree:
    """A draft's sampled tree: at every topology node its children are drawn without
    replacement from the toy draft's q."""
    tokens, parents, props = [], [], [Proposal([], [])]
    contexts, index_of = [()], {0: 0}
    for node, slots in enumerate(topology):
        if node not in index_of or not slots:
            continue
        here = index_of[node]
        props[here] = q = toy_proposal(contexts[here], params)
        u = torch.rand(len(slots), generator=gen).tolist()
        for slot, pick in zip(slots, draw_without_replacement(q.probs, u), strict=False):
            tokens.append(q.tokens[pick])
            parents.append(here)
            props.append(Proposal([], []))
            contexts.append((*contexts[here], q.tokens[pick]))
            index_of[slot] = len(tokens)
    return Tree(tokens, parents, tuple(props))


def target_rows(tree: Tree, params: SamplingParams) -> torch.Tensor:
    return torch.stack([toy_p(c, params) for c in node_contexts(tree)])


def sampled_pair(topology, params, gen: torch.Generator, seed: int) -> tuple[int, int]:
    tree = sampled_tree(topology, params, gen)
    assert tree_error(tree, VOCAB, 16) is None
    tokens = accept_sampled_tree(tree, target_rows(tree, params), seed, root_position=10).tokens
    if len(tokens) < 2:
        tokens.append(int(torch.multinomial(toy_p((tokens[0],), params), 1, generator=gen)))
    return tokens[0], tokens[1]


def keep_p_on_rejection(p, proposal, drawn, seed, position):
    """Wrong: after rejecting a child, keep testing against p instead of norm(max(0, p - q))."""
    q = torch.zeros_like(p)
    q[proposal.tokens] = torch.tensor(proposal.probs, dtype=p.dtype)
    for i, token in enumerate(drawn):
        if uniform(seed, position, "accept", i) * float(q[token]) < float(p[token]):
            return p, i
    return p, None


def keep_q_on_rejection(p, proposal, drawn, seed, position):
    """Wrong: the with-replacement rule on children drawn without replacement (q keeps the
    rejected child's mass)."""
    q = torch.zeros_like(p)
    q[proposal.tokens] = torch.tensor(proposal.probs, dtype=p.dtype)
    for i, token in enumerate(drawn):
        if uniform(seed, position, "accept", i) * float(q[token]) < float(p[token]):
            return p, i
        residual = (p - q).clamp_min(0.0)
        p = residual / residual.sum()
    return p, None


@pytest.mark.parametrize("params", list(TOY_PARAMS.values()), ids=list(TOY_PARAMS))
@pytest.mark.parametrize("topology", [CHAIN_TOPOLOGY, TREE_TOPOLOGY], ids=["chain", "tree"])
@pytest.mark.parametrize("bug", [None, keep_p_on_rejection, keep_q_on_rejection],
                         ids=["right", "keep-p", "keep-q"])
def test_sampled_tree_verification_is_lossless(topology, params, bug, monkeypatch):
    """Children drawn from the draft's q (not p): the first two committed tokens still follow
    the target's p(a) p(b | a) exactly; each wrong verifier fails the same test."""
    if bug is not None and (topology is CHAIN_TOPOLOGY) and bug is keep_q_on_rejection:
        pytest.skip("a chain draws one child per node: q never matters after a rejection")
    if bug is not None:
        monkeypatch.setattr(sampling, "_try_children", bug)
    gen = torch.Generator().manual_seed(1)
    trials = 12000
    observed = Counter(sampled_pair(topology, params, gen, seed) for seed in range(trials))
    exact = exact_toy_pairs(lambda ctx: toy_p(ctx, params))
    exact = {k: v for k, v in exact.items() if v > 0}
    stat, df = chi_square(observed, exact, trials)
    if bug is not None:
        assert stat > critical(df), "the test cannot tell this wrong verifier from the right one"
    else:
        assert stat < critical(df), (stat, df)


def test_draws_without_replacement_follow_q():
    q = [0.5, 0.3, 0.15, 0.05]
    gen = torch.Generator().manual_seed(2)
    pairs = Counter(tuple(draw_without_replacement(q, torch.rand(2, generator=gen).tolist()))
                    for _ in range(6000))
    exact = {(a, b): q[a] * q[b] / (1 - q[a]) for a in range(4) for b in range(4) if a != b}
    stat, df = chi_square(pairs, exact, 6000)
    assert stat < critical(df), (stat, df)
    assert draw_without_replacement([0.0, 1.0], [0.3, 0.9]) == [1]  # stops when q is spent


def test_sampled_tree_without_children_draws_like_plain_sampling():
    """A leaf's token is the same draw u(seed, n) plain sampling makes, so a tree whose
    children are all rejected or absent costs no change of random stream."""
    logits = toy_logits((), salt=0)[None]
    params = SamplingParams(temperature=1.0, seed=3)
    tree = Tree([], [], (Proposal([], []),))
    for seed in range(50):
        params = SamplingParams(temperature=1.0, seed=seed)
        got = accept_sampled_tree(tree, probabilities(logits, params), seed, root_position=4)
        assert got.tokens == choose(logits, params, [5])


def test_malformed_proposals_are_rejected():
    ok = Tree([1, 2], [0, 0], (Proposal([1, 2, 3], [0.5, 0.25, 0.25]), Proposal([], []),
                               Proposal([], [])))
    assert tree_error(ok, VOCAB, 8) is None
    bad = {
        "proposals for": ok._replace(proposals=ok.proposals[:2]),
        "not a distribution": ok._replace(proposals=(Proposal([1, 2], [0.5, 0.25]),
                                                     *ok.proposals[1:])),
        "not distinct draws": ok._replace(tokens=[1, 4]),
        "repeats a token": ok._replace(proposals=(Proposal([1, 1], [0.5, 0.5]),
                                                  *ok.proposals[1:])),
    }
    for words, tree in bad.items():
        assert words in (tree_error(tree, VOCAB, 8) or ""), (words, tree_error(tree, VOCAB, 8))
    assert "not distinct" in tree_error(ok._replace(tokens=[1, 1]), VOCAB, 8)


# ---- through the live stack ----------------------------------------------------------------

PREFIX = "    def "
SAMPLES = 3000
TREE_POLICY_SHAPE = (8, 4, 4)  # num_draft_tokens, topk, num_steps


def start_pair(logs, draft_args: list[str]):
    from tests.stack import Service

    draft = Service("draft_service", draft_args, logs).wait_serving()
    target = Service("target_service", ["--draft", draft.address, "--max-running", "64"],
                     logs).wait_serving()
    return draft, target


@pytest.fixture(scope="module")
def live_target(tmp_path_factory):
    """Draft (top-k trees) and target as real processes."""
    draft, target = start_pair(tmp_path_factory.mktemp("sampling"), [])
    yield target
    target.stop()
    draft.stop()


@pytest.fixture(scope="module")
def live_target_sampled(tmp_path_factory):
    """The same with a draft that draws sampled trees and sends its distribution."""
    draft, target = start_pair(tmp_path_factory.mktemp("sampled"), ["--sampled-trees"])
    yield target
    target.stop()
    draft.stop()


def sample_triples(target, prompt: list[int], params, speculate: bool,
                   samples: int = SAMPLES) -> dict[int, tuple[int, ...]]:
    """Three-token continuations of prompt on one Serve stream, by seed (0..samples-1).

    The first token comes from the prefill step; the second and third from the
    first verify step (the third only when the tree's node was accepted) or the
    next step, so (t2, t3) is where a verification error would show."""
    import grpc

    from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

    requests: queue.Queue = queue.Queue()
    num, topk, steps = TREE_POLICY_SHAPE
    entries = [target_pb2.SpecPolicy.Entry(max_batch_size=2**32 - 1, shape=common_pb2.DraftShape(
        num_draft_tokens=num, topk=topk, num_steps=steps))] if speculate else []
    requests.put(target_pb2.ServeRequest(policy=target_pb2.SpecPolicy(entries=entries)))
    for seed in range(samples):
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=seed, prompt_ids=prompt, max_new_tokens=3, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_AUTO,
            sampling=common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                               top_p=params.top_p, seed=seed))))
    out = {seed: [] for seed in range(samples)}
    done, verified = 0, 0
    with grpc.insecure_channel(target.address) as channel:
        call = target_pb2_grpc.TargetStub(channel).Serve(iter(requests.get, None), timeout=300)
        for event in call:
            for delta in event.deltas:
                out[delta.request_id].extend(delta.token_ids)
                if delta.finish_reason:
                    done += 1
                    verified += delta.spec.verify_steps
            if done == samples:
                break
        call.cancel()
    assert (verified > 0) == speculate
    return {seed: tuple(tokens) for seed, tokens in out.items()}


@pytest.fixture(scope="module")
def hf_target():
    from transformers import LlamaForCausalLM

    from splitspec.builtin import BUILTIN_TARGET

    return LlamaForCausalLM.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()


def exact_next(model, prompt: list[int], params) -> torch.Tensor:
    """The target's next-token distribution after prompt, from transformers' logits."""
    with torch.inference_mode():
        return probabilities(model(torch.tensor([prompt])).logits[0, -1:], params)[0]


def exact_pairs(model, prompt: list[int], params, num: int) -> dict[tuple[int, int], float]:
    """p(a) p(b | a) after prompt; second tokens only after the a likely enough to be seen
    among num samples."""
    first = exact_next(model, prompt, params)
    likely = [t for t in range(first.shape[0]) if first[t] * num >= 1]
    with torch.inference_mode():
        batch = torch.tensor([[*prompt, t] for t in likely])
        second = probabilities(model(batch).logits[:, -1], params)
    return {(a, b): float(first[a] * second[i, b])
            for i, a in enumerate(likely) for b in range(second.shape[1]) if second[i, b] > 0}


@pytest.mark.slow
@pytest.mark.parametrize(("params", "speculate", "trees"), [
    (SamplingParams(temperature=1.0), True, "topk"),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9), True, "topk"),
    (SamplingParams(temperature=1.0), False, "topk"),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9), True, "sampled"),
])
def test_live_stack_samples_follow_the_target_distribution(request, hf_target, params, speculate,
                                                           trees):
    from splitspec.builtin import BUILTIN_TARGET
    from splitspec.tokenizer import load_tokenizer

    target = request.getfixturevalue("live_target" if trees == "topk" else "live_target_sampled")
    prompt = load_tokenizer(BUILTIN_TARGET).encode(PREFIX)
    triples = Counter(sample_triples(target, prompt, params, speculate).values())
    # The prefill's token against p(t1) ...
    firsts = Counter()
    for (t1, _, _), n in triples.items():
        firsts[(t1,)] += n
    p1 = exact_next(hf_target, prompt, params)
    stat, df = chi_square(firsts, {(t,): float(p) for t, p in enumerate(p1) if p > 0}, SAMPLES)
    assert stat < critical(df), ("first token", stat, df, firsts.most_common(5))
    # ... then (t2, t3) after the most common t1, where verification decides, against
    # p(t2) p(t3 | t2).
    t1 = firsts.most_common(1)[0][0][0]
    given = Counter({(t2, t3): n for (a, t2, t3), n in triples.items() if a == t1})
    num = sum(given.values())
    stat, df = chi_square(given, exact_pairs(hf_target, [*prompt, t1], params, num), num)
    assert df >= 2, "too few likely pairs for a meaningful test"
    assert stat < critical(df), ("tokens 2-3", stat, df, given.most_common(5))


@pytest.mark.slow
@pytest.mark.parametrize("trees", ["topk", "sampled"])
def test_live_stack_seeded_requests_are_reproducible(request, trees):
    """A seed fixes the output for a speculation mode. With top-k trees speculation ON gives
    exactly the OFF text (the same draw per position); sampled trees draw from the draft's
    distribution too, so some seeds differ from OFF (which shows they were used), and a
    second run repeats the first."""
    from splitspec.builtin import BUILTIN_TARGET
    from splitspec.tokenizer import load_tokenizer

    target = request.getfixturevalue("live_target" if trees == "topk" else "live_target_sampled")
    prompt = load_tokenizer(BUILTIN_TARGET).encode(PREFIX)
    params = SamplingParams(temperature=1.0)
    off = sample_triples(target, prompt, params, speculate=False, samples=200)
    on = sample_triples(target, prompt, params, speculate=True, samples=200)
    assert sample_triples(target, prompt, params, speculate=True, samples=200) == on
    differ = sum(on[seed] != off[seed] for seed in on)
    if trees == "topk":
        assert differ == 0
    else:
        assert differ > 0, "sampled trees never changed a draw: were they verified at all?"
