"""The replay draft: its trees (shape, the recorded path, the corruption rate, determinism),
how it follows a sequence's tokens, its records file and flags, and end to end: records made
through the built-in target with speculation OFF, replayed at corruption 0 and 1."""

from __future__ import annotations

import json
import logging
import math
import random
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2

from draft_service.__main__ import parse_args
from draft_service.drafter import DrafterLimits, SeqInput, TreeShape
from draft_service.models import read_spec
from draft_service.replay import ReplayBook, ReplayDrafter, read_replay_spec, replay_topology
from draft_service.servicer import draft_info
from draft_service.startup import STEPS, build
from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.init_report import InitFailed, Startup, StepState
from splitspec.model.config import LlamaConfig, read_hf_config
from splitspec.replay import ReplayRecord, read_records, serve, write_records
from splitspec.replay import main as replay_main
from splitspec.tokenizer import load_tokenizer
from splitspec.tree import depths, first_child_run, match_length, tree_error
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.stack import Service
from tests.test_drafter import fake_features, seq_input
from tests.test_drafter import make_drafter as make_model_drafter

VOCAB = 1000
SHAPES = [TreeShape(8, 4, 4), TreeShape(4, 1, 4), TreeShape(8, 1, 4), TreeShape(64, 8, 6),
          TreeShape(16, 4, 10), TreeShape(10, 2, 3), TreeShape(3, 3, 3), TreeShape(1, 1, 1),
          TreeShape(100, 5, 5)]
CHAIN = TreeShape(4, 1, 4)
NO_TREE = TreeShape(0, 0, 0)
BUILTIN_VOCAB = 2048


def make_records(num: int = 3, length: int = 400, seed: int = 0) -> list[ReplayRecord]:
    rng = random.Random(seed)
    return [ReplayRecord([rng.randrange(VOCAB) for _ in range(8)],
                         [rng.randrange(VOCAB) for _ in range(length)]) for _ in range(num)]


def make_drafter(records: list[ReplayRecord], rate: float, max_tree_nodes: int = 64) -> ReplayDrafter:
    return ReplayDrafter(ReplayBook(records), rate, VOCAB, DrafterLimits(8, 4096, max_tree_nodes))


def draft_at(drafter: ReplayDrafter, tokens: list[int], shape: TreeShape, seq_id: int = 1):
    """The tree for a sequence of these committed tokens (sent whole, as a new sequence)."""
    session = drafter.open_session()
    (result,) = drafter.draft(session, [SeqInput(seq_id, 0, tokens, shape)])
    drafter.close_session(session)
    assert not result.error, result.error
    return result.tree


def path_nodes(tree) -> list[int]:
    """Tree indices of the main path: the first node at each depth."""
    first = {}
    for index, d in enumerate(depths(tree.parents)[1:], start=1):
        first.setdefault(d, index)
    return [first[d] for d in sorted(first)]


# ---- trees ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_trees_are_valid_and_as_large_as_the_model_drafters(rate):
    """Every shape: a valid tree, depth <= D, at most K children per node and K nodes with
    children per depth, distinct siblings, and min(N, K + (D-1) K^2) nodes (what EAGLE-2
    drafting gives) after the --max-tree-nodes cap."""
    rec = make_records(1)[0]
    drafter = make_drafter([rec], rate, max_tree_nodes=32)
    for shape in SHAPES:
        capped = drafter.capped(shape)
        n, k, d = capped.num_draft_tokens, capped.topk, capped.num_steps
        tree = draft_at(drafter, rec.full[:20], shape)
        assert tree_error(tree, VOCAB, n) is None, shape
        assert tree.num_nodes == min(n, k + (d - 1) * k * k), shape
        node_depths = depths(tree.parents)
        assert max(node_depths) == min(d, n), shape  # the main path reaches full depth
        children = tree.children()
        assert all(len(kids) <= k for kids in children.values()), shape
        for kids in children.values():
            tokens = [tree.tokens[c - 1] for c in kids]
            assert len(set(tokens)) == len(tokens), (shape, tokens)
        expanded = Counter(node_depths[p] for p in children)
        assert all(count <= k for count in expanded.values()), shape


def test_no_corruption_drafts_the_recorded_path_and_only_it():
    rec = make_records(1)[0]
    drafter = make_drafter([rec], 0.0)
    for shape in SHAPES:
        for n in (8, 9, 57, 200):
            tree = draft_at(drafter, rec.full[:n], shape)
            truth = rec.full[n:n + 16]
            length = min(shape.num_steps, shape.num_draft_tokens, 64)
            assert match_length(tree, truth) == length, (shape, n)
            node_depths = depths(tree.parents)
            on_truth = [i for i, t in enumerate(tree.tokens, start=1) if t == truth[node_depths[i] - 1]]
            assert on_truth == path_nodes(tree)[:length], (shape, n)


def test_the_main_path_is_the_first_child_path_and_the_chain():
    """The main path (the only nodes that may carry true tokens) runs through each node's
    first child, and a chain of the same depth drafts it: what the target reads off a tree's
    first-child path (StepStats.first_child_accepted) is what a chain would have accepted."""
    rec = make_records(1)[0]
    drafter = make_drafter([rec], 0.0)
    for shape in (TreeShape(8, 4, 4), TreeShape(64, 8, 6), TreeShape(10, 2, 3)):
        tree = draft_at(drafter, rec.full[:50], shape)
        main = path_nodes(tree)
        assert first_child_run(tree, main) == len(main) == shape.num_steps, shape
        chain = draft_at(drafter, rec.full[:50], TreeShape(3, 1, 3))
        assert [tree.tokens[i - 1] for i in main[:3]] == chain.tokens, shape


def test_full_corruption_never_drafts_the_true_token():
    rec = make_records(1, length=600)[0]
    drafter = make_drafter([rec], 1.0)
    for n in range(8, 600):
        tree = draft_at(drafter, rec.full[:n], TreeShape(8, 4, 4))
        truth = rec.full[n:n + 4]
        node_depths = depths(tree.parents)
        assert all(t != truth[node_depths[i] - 1] for i, t in enumerate(tree.tokens, start=1)
                   if node_depths[i] <= len(truth)), n
        assert match_length(tree, truth) == 0


def test_acceptance_matches_the_corruption_rate():
    """Depth-1 acceptance over many positions is binomial with p = 1 - R, and a chain's
    accepted length has mean sum_{k=1..D} (1-R)^k (4 standard deviations; a corruption drawn
    once per record, or at the wrong rate, fails)."""
    rate, steps = 0.3, 4
    records = make_records(4, length=1000)
    drafter = make_drafter(records, rate)
    accepted = []
    for rec in records:
        for n in range(8, len(rec.full) - steps):
            tree = draft_at(drafter, rec.full[:n], TreeShape(steps, 1, steps))
            accepted.append(match_length(tree, rec.full[n:n + steps]))
    m, p = len(accepted), 1 - rate
    first = sum(a >= 1 for a in accepted)
    assert abs(first / m - p) <= 4 * math.sqrt(p * (1 - p) / m), first / m
    # Accepted length X: P(X >= k) = p^k for k <= steps.
    probs = [p**k * (1 - p) for k in range(steps)] + [p**steps]
    mean = sum(k * q for k, q in enumerate(probs))
    var = sum((k - mean) ** 2 * q for k, q in enumerate(probs))
    assert mean == pytest.approx(sum(p**k for k in range(1, steps + 1)))
    assert abs(sum(accepted) / m - mean) <= 4 * math.sqrt(var / m), (sum(accepted) / m, mean)


def test_trees_are_deterministic():
    records = make_records(2)
    inputs = [SeqInput(1, 0, records[0].full[:30], TreeShape(8, 4, 4)),
              SeqInput(2, 0, records[1].full[:50], TreeShape(16, 4, 5)),
              SeqInput(3, 0, [5, 6, 7, 8], TreeShape(8, 4, 4))]  # a miss
    runs = []
    for _ in range(2):
        drafter = make_drafter(records, 0.5)
        runs.append([r.tree for r in drafter.draft(drafter.open_session(), inputs)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][2]


def test_topology_depends_on_the_shape_alone():
    assert replay_topology(TreeShape(8, 4, 4)) is replay_topology(TreeShape(8, 4, 4))
    assert [(n.parent, n.depth, n.on_path) for n in replay_topology(TreeShape(8, 4, 4))] == [
        (0, 1, True), (0, 1, False), (0, 1, False), (0, 1, False),
        (1, 2, True), (1, 2, False), (5, 3, True), (7, 4, True)]


# ---- following a sequence -------------------------------------------------------------------

def test_truncate_then_append_follows_the_record_again():
    rec = make_records(1)[0]
    drafter = make_drafter([rec], 0.0)
    session = drafter.open_session()

    def step(start, new, shape=CHAIN):
        (result,) = drafter.draft(session, [SeqInput(1, start, new, shape)])
        return result

    full = rec.full
    assert step(0, full[:10]).tree.tokens == full[10:14]
    assert step(10, full[10:13]).tree.tokens == full[13:17]  # appended
    wrong = (full[13] + 1) % VOCAB
    misses = drafter.num_misses
    miss = step(13, [wrong])  # leaves the record
    assert miss.tree.num_nodes == 4 and drafter.num_misses == misses + 1
    assert match_length(miss.tree, full[14:18]) == 0
    assert step(12, full[12:15]).tree.tokens == full[15:19]  # rolled back onto the record
    assert drafter.num_misses == misses + 1
    assert step(5, []).tree.tokens == full[5:9]  # truncated, nothing appended
    assert step(5, full[5:7], NO_TREE).tree.num_nodes == 0
    assert "past the 7 tokens" in step(9, [1]).error  # start past what is held
    assert drafter.num_held == 0  # ... and the sequence was forgotten
    assert "unknown sequence" in step(3, [1]).error


def test_off_record_sequences_get_wrong_tokens_and_count_misses():
    records = make_records(2, length=30)
    drafter = make_drafter(records, 0.0)
    session = drafter.open_session()
    full = records[0].full
    past_end = full + [7]
    inputs = [SeqInput(1, 0, full[:20], TreeShape(8, 4, 4)),        # follows
              SeqInput(2, 0, [3, 1, 4, 1, 5], TreeShape(8, 4, 4)),  # no record begins so
              SeqInput(3, 0, full, TreeShape(8, 4, 4)),             # at the record's end
              SeqInput(4, 0, past_end, TreeShape(8, 4, 4))]         # past it
    results = drafter.draft(session, inputs)
    assert [r.error for r in results] == [""] * 4
    assert [r.tree.num_nodes for r in results] == [8] * 4  # a miss costs the target the same
    assert drafter.num_misses == 3
    assert match_length(results[0].tree, full[20:24]) == 4
    # The stats the draft keeps of its trees: the next exchange commits the path.
    drafter.draft(session, [SeqInput(1, 20, full[20:25], NO_TREE)])
    assert drafter.stats.accepted == 4 and drafter.stats.verify_steps == 1


def test_near_the_end_the_known_depths_carry_the_record():
    rec = make_records(1, length=30)[0]
    drafter = make_drafter([rec], 0.0)
    n = len(rec.full) - 2
    tree = draft_at(drafter, rec.full[:n], CHAIN)
    assert tree.tokens[:2] == rec.full[n:] and tree.num_nodes == 4
    assert drafter.num_misses == 0


def test_the_longest_record_a_sequence_begins_is_followed():
    short = ReplayRecord([1, 2, 3], [4, 5])
    long = ReplayRecord([1, 2, 3], [4, 5, 6, 7, 8, 9])
    other = ReplayRecord([1, 2, 9], [9, 9])
    book = ReplayBook([short, other, long])
    assert book.find([1, 2, 3, 4]) == 2
    assert book.find([1, 2, 9]) == 1
    assert book.find([1, 2]) == 2
    assert book.find([1, 3]) is None
    assert book.find([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) is None


# ---- records and flags ----------------------------------------------------------------------

def test_records_round_trip_and_broken_files_name_the_line(tmp_path):
    path = tmp_path / "records.jsonl"
    records = make_records(2, length=5)
    write_records(path, records)
    assert read_records(path, VOCAB) == records
    broken = {
        "": "holds no records",
        "\n\n": "holds no records",
        '{"prompt": [1], "tokens": [2]}\n{"prompt": [1], "tokens": [2]\n': "line 2: not JSON",
        '{"prompt": [1]}\n': 'line 1: expected an object with "prompt" and "tokens"',
        '{"prompt": [1], "tokens": [2]}\n\n{"prompt": [1], "tokens": [1000]}\n':
            'line 3: "tokens" holds 1000, not a token id in [0, 1000)',
        '{"prompt": [], "tokens": [2]}\n': 'line 1: "prompt" must be a non-empty list',
        '{"prompt": [1], "tokens": [true]}\n': 'line 1: "tokens" holds True',
        "[1, 2]\n": "line 1: expected an object",
    }
    for text, message in broken.items():
        path.write_text(text)
        with pytest.raises(ValueError, match="records.jsonl") as caught:
            read_records(path, VOCAB)
        assert message in str(caught.value), (text, str(caught.value))


@pytest.mark.parametrize(("flags", "message"), [
    ([], "--kind replay needs --replay-file"),
    (["--replay-file", "nowhere.jsonl"], "--replay-file nowhere.jsonl is not a file"),
    (["--replay-file", "{records}", "--target-model", ""], "needs --target-model"),
    (["--replay-file", "{records}", "--replay-corrupt-rate", "1.5"], "must be in [0, 1], got 1.5"),
    (["--replay-file", "{records}", "--replay-corrupt-rate", "nan"], "must be in [0, 1], got nan"),
    (["--replay-file", "{records}", "--sampled-trees"], "--sampled-trees does not apply"),
])
def test_bad_replay_flags_fail_load_config(flags, message, tmp_path):
    records = tmp_path / "records.jsonl"
    write_records(records, make_records(1))
    args = ["--kind", "replay", "--target-model", str(BUILTIN_TARGET)]
    cfg = parse_args(args + [f.format(records=records) for f in flags])
    with pytest.raises(InitFailed) as caught:
        build(cfg, Startup("draft", STEPS))
    step = caught.value.report.failed_step
    assert step.name == "load_config" and message in step.error_message, step.error_message


def test_replay_file_without_kind_replay_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--replay-file is only read by --kind replay"):
        parse_args(["--replay-file", str(tmp_path / "x.jsonl")]).check()
    with pytest.raises(ValueError, match="--replay-features is only read by --kind replay"):
        parse_args(["--replay-features"]).check()


def test_with_features_each_request_must_carry_an_eagle3_heads_features():
    """--replay-features: every sequence's new tokens come with an EAGLE-3 head's feature
    rows (one fewer than the tokens from position 0, as many after), checked and copied; a
    request without them, or with too few, fails; the trees are those drafted without."""
    records = make_records(1)
    tokens = records[0].full[:40]
    width = 3 * 16
    drafter = ReplayDrafter(ReplayBook(records), 0.0, VOCAB, DrafterLimits(8, 4096, 64), width)
    session = drafter.open_session()

    def rows(n: int) -> tuple[bytes, int, str]:
        return bytes(4 * width * n), width, "float32"

    (missing,) = drafter.draft(session, [SeqInput(1, 0, tokens[:30], CHAIN)])
    assert "hidden_states dtype '' is not one of" in missing.error
    (short,) = drafter.draft(session, [SeqInput(2, 0, tokens[:30], CHAIN, *rows(28))])
    assert "hidden_states has" in short.error
    (first,) = drafter.draft(session, [SeqInput(3, 0, tokens[:30], CHAIN, *rows(29))])
    (later,) = drafter.draft(session, [SeqInput(3, 30, tokens[30:40], CHAIN, *rows(10))])
    assert not first.error and not later.error
    assert drafter.feature_bytes == 4 * width * (29 + 10)
    assert later.tree.tokens == draft_at(make_drafter(records, 0.0), tokens, CHAIN).tokens
    drafter.close_session(session)


def costed_drafter(records: list[ReplayRecord], rate: float = 0.0) -> ReplayDrafter:
    """A replay drafter over the built-in target's vocabulary that also runs the built-in
    EAGLE-3 head on every request (--replay-cost-model)."""
    return ReplayDrafter(ReplayBook(records), rate, BUILTIN_VOCAB, DrafterLimits(8, 128, 64),
                         cost=make_model_drafter(BUILTIN_EAGLE3))


def builtin_records(num: int = 2, length: int = 60) -> list[ReplayRecord]:
    rng = random.Random(1)
    return [ReplayRecord([rng.randrange(BUILTIN_VOCAB) for _ in range(8)],
                         [rng.randrange(BUILTIN_VOCAB) for _ in range(length)])
            for _ in range(num)]


def test_a_cost_model_runs_every_request_and_leaves_the_trees_the_replays():
    """--replay-cost-model: the head catches up on the same tokens and drafts a tree of the
    shape asked each time (its trees thrown away); the trees sent are those the replay
    draws without it; releasing and closing free the head's sequences too."""
    records = builtin_records()
    drafter = costed_drafter(records)
    head = drafter.cost.model
    plain = ReplayDrafter(ReplayBook(records), 0.0, BUILTIN_VOCAB, DrafterLimits(8, 128, 64))
    tokens = records[0].full[:40]
    features = fake_features(head, len(tokens))
    session, plain_session = drafter.open_session(), plain.open_session()
    for start, end, shape in ((0, 20, TreeShape(8, 4, 4)), (20, 23, CHAIN), (23, 40, NO_TREE)):
        sent = seq_input(head, 5, start, tokens[:end], shape, features)
        (got,) = drafter.draft(session, [sent])
        (want,) = plain.draft(plain_session, [SeqInput(5, start, tokens[start:end], shape)])
        assert not got.error, got.error
        assert got.tree == want.tree
    assert drafter.cost.num_trees == 2 and drafter.cost.num_held == 1
    assert session.cost.seqs[5].num_tokens == 40  # the head caught up on every token
    drafter.draft(session, [], release_ids=[5])
    assert drafter.num_held == 0 and drafter.cost.num_held == 0
    drafter.draft(session, [seq_input(head, 6, 0, tokens[:10], CHAIN, features)])
    drafter.close_session(session)
    assert drafter.num_held == 0 and drafter.cost.num_held == 0


def test_a_sequence_the_cost_model_cannot_serve_fails_in_both(caplog):
    """A request without the head's features: the head refuses the sequence, so the replay
    drops it too and says why, in one log line; the target then resends it from 0, which
    both take."""
    records = builtin_records()
    drafter = costed_drafter(records)
    tokens = records[0].full[:30]
    session = drafter.open_session()
    with caplog.at_level(logging.WARNING):
        (bad,) = drafter.draft(session, [SeqInput(1, 0, tokens, CHAIN)])
    assert bad.error.startswith("cost model: ") and "hidden_states" in bad.error, bad.error
    refusals = [r.getMessage() for r in caplog.records if "sequence 1" in r.getMessage()]
    assert len(refusals) == 1 and "hidden_states" in refusals[0], refusals
    assert drafter.num_held == 0 and not bad.tree.num_nodes
    head = drafter.cost.model
    (good,) = drafter.draft(session, [seq_input(head, 1, 0, tokens, CHAIN,
                                                fake_features(head, len(tokens)))])
    assert not good.error and good.tree.num_nodes == CHAIN.num_draft_tokens
    drafter.close_session(session)


def test_a_cost_model_is_loaded_and_built_by_the_replays_start_up_steps(tmp_path):
    """The steps a model's draft runs, under the replay's names; DraftInfo asks for the
    head's features (its layers) and names the records and the cost model."""
    records = tmp_path / "records.jsonl"
    write_records(records, builtin_records())
    cfg = parse_args(["--kind", "replay", "--replay-file", str(records), "--port", "0",
                      "--target-model", str(BUILTIN_TARGET),
                      "--replay-cost-model", str(BUILTIN_EAGLE3)])
    startup = Startup("draft", STEPS)
    built = build(cfg, startup)
    try:
        details = {s.name: s.detail for s in startup.report.steps}
        assert "cost model eagle3 eagle3: 1.7M parameters" in details["load_model"]
        assert "pages of 16" in details["allocate_kv_cache"]
        assert details["warmup"].startswith("tree of 8 nodes, chain of 4")
        assert built.drafter.cost.num_trees >= 2  # the warmup ran the head too
        spec = read_replay_spec(records, 0.0, BUILTIN_TARGET, cost_model=BUILTIN_EAGLE3)
        head = read_spec(BUILTIN_EAGLE3, "auto", BUILTIN_TARGET)
        info = draft_info(spec, 1024)
        assert info.model_name == "replay(records.jsonl, corrupt 0.00, cost eagle3)"
        assert info.needs_hidden_states and info.kind == "replay"
        assert info.target_hidden_size == head.target_hidden_size
        assert tuple(info.aux_layer_inputs) == head.aux_layer_inputs
    finally:
        built.server.stop(0)


def test_bad_cost_model_flags_are_refused(tmp_path):
    records = tmp_path / "records.jsonl"
    write_records(records, builtin_records())
    args = ["--kind", "replay", "--replay-file", str(records), "--target-model",
            str(BUILTIN_TARGET)]
    with pytest.raises(FileNotFoundError, match="nowhere is not a folder"):
        parse_args(args + ["--replay-cost-model", str(tmp_path / "nowhere")]).check()
    with pytest.raises(ValueError, match="--replay-cost-model is only read by --kind replay"):
        parse_args(["--replay-cost-model", str(BUILTIN_EAGLE3)]).check()
    with pytest.raises(ValueError, match="asks for its features itself"):
        parse_args(args + ["--replay-cost-model", str(BUILTIN_EAGLE3),
                           "--replay-features"]).check()
    # the model's --quantize is allowed with a cost model (its weights), not without
    parse_args(args + ["--replay-cost-model", str(BUILTIN_EAGLE3), "--quantize", "fp8"]).check()


def test_a_cost_model_of_another_vocabulary_is_refused(tmp_path):
    records = tmp_path / "records.jsonl"
    write_records(records, builtin_records())
    other = tmp_path / "target"
    other.mkdir()
    config = json.loads((BUILTIN_TARGET / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    with pytest.raises(ValueError, match="reads a vocabulary of 2048 tokens, the target 4096"):
        read_replay_spec(records, 0.0, other, cost_model=BUILTIN_EAGLE3)


@pytest.mark.parametrize(("text", "message"), [
    ("", "holds no records"),
    ('{"prompt": [1, 2], "tokens": [3]}\nnot json\n', "line 2: not JSON"),
])
def test_broken_records_fail_load_model(text, message, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(text)
    cfg = parse_args(["--kind", "replay", "--replay-file", str(records),
                      "--target-model", str(BUILTIN_TARGET)])
    startup = Startup("draft", STEPS)
    with pytest.raises(InitFailed):
        build(cfg, startup)
    states = {s.name: s.state for s in startup.report.steps}
    assert states["load_config"] is StepState.OK
    step = startup.report.failed_step
    assert step.name == "load_model", step
    assert str(records) in step.error_message and message in step.error_message


# ---- end to end -----------------------------------------------------------------------------

NEW_TOKENS = 24
TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n"]
TARGET_CHAIN = ["--num-draft-tokens", "4", "--topk", "1", "--num-steps", "4"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Continuations of the built-in target with speculation OFF, recorded by the command line
    from prompts given as text and as token ids."""
    logs = tmp_path_factory.mktemp("replay")
    tokenizer = load_tokenizer(BUILTIN_TARGET)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    prompts_file = logs / "prompts.jsonl"
    prompts_file.write_text(f"{json.dumps(TEXTS[0])}\n{json.dumps(TEXTS[1])}\n\n{prompts[2]}\n")
    path = logs / "records.jsonl"
    target = Service("target_service", [], logs).wait_serving()
    try:
        assert replay_main(["--target", target.address, "--prompts", str(prompts_file),
                            "--tokenizer", str(BUILTIN_TARGET), "--max-new-tokens", str(NEW_TOKENS),
                            "--out", str(path)]) == 0
    finally:
        target.stop()
    vocab = LlamaConfig.from_hf(read_hf_config(BUILTIN_TARGET)).vocab_size
    records = read_records(path, vocab)
    assert [r.prompt for r in records] == prompts
    assert all(len(r.tokens) == NEW_TOKENS for r in records)
    return path, records, logs


def draft_status(address: str) -> draft_pb2.DraftStatus:
    with grpc.insecure_channel(address) as channel:
        return draft_pb2_grpc.DraftStub(channel).GetStatus(draft_pb2.GetDraftStatusRequest(),
                                                           timeout=10)


@pytest.mark.slow
def test_replayed_generation_is_exact_at_the_chosen_acceptance(recorded):
    path, records, logs = recorded
    # "0 features": --replay-features, so the target sends an EAGLE-3 head's features, which
    # the draft checks (a request without them, or of the wrong size, fails its trees); through
    # shared memory, and with "on the stream" (the target's --feature-memory-mb 0) in requests
    # "0 features cost": the built-in head as --replay-cost-model, which asks for them itself
    labels = ("0", "1", "0 features", "0 features on the stream", "0 features cost")
    drafts = {label: Service("draft_service", [
        "--kind", "replay", "--replay-file", str(path), "--replay-corrupt-rate", label.split()[0],
        "--target-model", str(BUILTIN_TARGET),
        *(["--replay-cost-model", str(BUILTIN_EAGLE3)] if label.endswith("cost") else
          ["--replay-features"] if "features" in label else [])], logs)
        for label in labels}
    services = list(drafts.values())
    try:
        for draft in drafts.values():
            draft.wait_serving()
        targets = {rate: Service("target_service", [
            "--draft", draft.address, *TARGET_CHAIN,
            *(["--feature-memory-mb", "0"] if rate.endswith("stream") else [])], logs)
            for rate, draft in drafts.items()}
        services += targets.values()
        for target in targets.values():
            target.wait_serving()
        prompts = [r.prompt for r in records]
        for rate, target in targets.items():
            with grpc.insecure_channel(target.address) as channel:
                stub = target_pb2_grpc.TargetStub(channel)
                info = stub.GetInfo(target_pb2.GetTargetInfoRequest(), timeout=10)
                report = stub.GetInitReport(common_pb2.GetInitReportRequest(), timeout=10)
            link = next(s.detail for s in report.steps if s.name == "connect_draft")
            if "features" in rate:
                how = "on the stream" if rate.endswith("stream") else "through shared memory"
                assert f"sent {how}" in link, (rate, link)
            features = (", cost eagle3" if rate.endswith("cost") else
                        ", features" if "features" in rate else "")
            assert info.draft_model_name == (f"replay(records.jsonl, corrupt "
                                             f"{float(rate.split()[0]):.2f}{features})")
            before = draft_status(drafts[rate].address)
            outputs, steps = serve(target.address, prompts, NEW_TOKENS, common_pb2.SPECULATION_MODE_ON)
            after = draft_status(drafts[rate].address)
            assert outputs == [r.tokens for r in records], f"corrupt {rate}: output differs from OFF"
            drafted = sum(s.drafted_tokens for s in steps)
            accepted = sum(s.accepted_tokens for s in steps)
            assert drafted > 0
            assert after.trees > before.trees
            assert after.replay_misses == before.replay_misses, "a recorded sequence left its record"
            if rate.startswith("0"):
                # Every verify step accepts the whole chain of 4, but a request's last one
                # (fewer tokens left than the chain is long) may lose up to 3.
                assert accepted >= drafted - 3 * len(records), (accepted, drafted)
            else:
                assert accepted == 0, (accepted, drafted)
    finally:
        for service in services:
            service.stop()


@pytest.mark.slow
def test_malformed_records_fail_the_draft_process_at_load_model(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt": [1, 2], "tokens": [3]}\n{"prompt": [1, 2], "tokens": "x"}\n')
    report = tmp_path / "report.json"
    service = Service("draft_service", ["--kind", "replay", "--replay-file", str(records),
                                        "--target-model", str(BUILTIN_TARGET),
                                        "--init-report", str(report)], tmp_path)
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and health_pb2.HealthCheckResponse.SERVING not in seen
    failed = [s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == ["load_model"]
    assert f"{records} line 2" in failed[0]["error_message"]
    assert '"tokens" must be a non-empty list of token ids' in failed[0]["error_message"]


def test_quantize_flag_is_refused_where_it_cannot_work(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt": [1, 2], "tokens": [3]}\n')
    with pytest.raises(ValueError, match="replay draft has no weights"):
        parse_args(["--kind", "replay", "--replay-file", str(records), "--quantize", "fp8"]).check()
    with pytest.raises(ValueError, match="needs --dtype bfloat16 or float16"):
        parse_args(["--quantize", "fp8", "--device", "cuda"]).check()
