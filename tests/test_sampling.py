"""Sampling: the distributions, and losslessness of tree verification under sampling.

Speculation must not change what is sampled: with speculation ON the generated
tokens must follow the target's own distribution (temperature, top-k, top-p
applied), whatever the draft proposes. Checked twice: on the verifier alone
against an exactly known toy target (where a deliberately wrong verifier must
fail the same test), and through the live stack against transformers.
"""

from __future__ import annotations

import queue
from collections import Counter

import pytest
import torch

from splitspec.sampling import SamplingParams, choose, probabilities
from splitspec.tree import Tree, accept_tree, depths

# Chi-square critical values at significance 0.001 (from tables), by degrees of freedom.
CHI2_CRIT_0001 = {5: 20.52, 10: 29.59, 15: 37.70, 20: 45.31, 25: 52.62, 30: 59.70, 35: 66.62,
                  40: 73.40, 50: 86.66, 60: 99.61}


def chi_square(observed: Counter, expected: dict, total: int) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expected below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * total
        if e < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        cells += 1
    pooled_obs += sum(n for key, n in observed.items() if key not in expected)
    pooled_exp += max(0.0, total - sum(p * total for p in expected.values()))
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif pooled_obs > 10:
        stat = float("inf")  # mass where the target puts (almost) none
    return stat, cells - 1


def critical(df: int) -> float:
    return CHI2_CRIT_0001[min(CHI2_CRIT_0001, key=lambda d: (abs(d - df), d))] * max(1.0, df / 60)


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
# under child 0 the chain 3 -> 4; under child 1 the node 5.
TREE = Tree(tokens=[0, 1, 2, 3, 5, 4], parents=[0, 0, 0, 1, 2, 4])


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


def speculative_pair(gen: torch.Generator, wrong: bool) -> tuple[int, int]:
    """The first two tokens generated with speculation: one verify step, then a plain step
    if the step committed only one token."""
    chosen = []
    for index, context in enumerate(node_contexts(TREE)):
        p = toy_target(context)
        if wrong:
            chosen.append(wrong_choice(p, children_of(TREE, index), gen))
        else:
            chosen.append(int(torch.multinomial(p, 1, generator=gen)))
    tokens = accept_tree(TREE, chosen).tokens
    if len(tokens) < 2:
        tokens.append(int(torch.multinomial(toy_target((tokens[0],)), 1, generator=gen)))
    return tokens[0], tokens[1]


@pytest.mark.parametrize("wrong", [False, True])
def test_tree_verification_under_sampling_is_lossless(wrong):
    gen = torch.Generator().manual_seed(0)
    trials = 20000
    observed = Counter(speculative_pair(gen, wrong) for _ in range(trials))
    exact = {(a, b): float(toy_target(())[a] * toy_target((a,))[b])
             for a in range(VOCAB) for b in range(VOCAB)}
    stat, df = chi_square(observed, exact, trials)
    if wrong:
        assert stat > critical(df), "the test cannot tell a wrong verifier from a right one"
    else:
        assert stat < critical(df), (stat, df)
    assert max(depths(TREE.parents)) == 3


# ---- through the live stack ----------------------------------------------------------------

PREFIX = "    def "
SAMPLES = 3000
TREE_POLICY_SHAPE = (8, 4, 4)  # num_draft_tokens, topk, num_steps


@pytest.fixture(scope="module")
def live_target(tmp_path_factory):
    from tests.stack import Service

    logs = tmp_path_factory.mktemp("sampling")
    draft = Service("draft_service", [], logs).wait_serving()
    target = Service("target_service", ["--draft", draft.address, "--max-running", "64"],
                     logs).wait_serving()
    yield target
    target.stop()
    draft.stop()


def sample_triples(target, prompt: list[int], params, speculate: bool) -> Counter:
    """SAMPLES three-token continuations of prompt on one Serve stream (seeds 0..SAMPLES-1).

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
    for seed in range(SAMPLES):
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=seed, prompt_ids=prompt, max_new_tokens=3, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_AUTO,
            sampling=common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                               top_p=params.top_p, seed=seed))))
    out = {seed: [] for seed in range(SAMPLES)}
    done, verified = 0, 0
    with grpc.insecure_channel(target.address) as channel:
        call = target_pb2_grpc.TargetStub(channel).Serve(iter(requests.get, None), timeout=300)
        for event in call:
            for delta in event.deltas:
                out[delta.request_id].extend(delta.token_ids)
                if delta.finish_reason:
                    done += 1
                    verified += delta.spec.verify_steps
            if done == SAMPLES:
                break
        call.cancel()
    assert (verified > 0) == speculate
    return Counter(tuple(tokens) for tokens in out.values())


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
@pytest.mark.parametrize(("params", "speculate"), [
    (SamplingParams(temperature=1.0), True),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9), True),
    (SamplingParams(temperature=1.0), False),
])
def test_live_stack_samples_follow_the_target_distribution(live_target, hf_target, params,
                                                           speculate):
    from splitspec.builtin import BUILTIN_TARGET
    from splitspec.tokenizer import load_tokenizer

    prompt = load_tokenizer(BUILTIN_TARGET).encode(PREFIX)
    triples = sample_triples(live_target, prompt, params, speculate)
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
