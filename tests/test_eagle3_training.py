"""EAGLE-3 training-time test: the unrolled training forward is the drafter's inference.

Step j at entry i of the TTT forward must equal running the head with a paged
cache over committed entries 0..i-j and then a chain of j drafted nodes fed
with the true tokens: if the two disagree, the head is trained for a task it
never performs.
"""

import numpy as np
import pytest
import torch

from splitspec.attention import SeqAttention, TorchAttentionBackend
from splitspec.builtin import BUILTIN_TARGET
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.model.config import Eagle3Config, read_hf_config
from splitspec.model.layers import AttentionContext
from splitspec.training.eagle3 import (
    Eagle3TrainConfig,
    _init_head,
    _TTTBatch,
    choose_draft_vocab,
    evaluate_eagle3,
    head_config,
    train_eagle3,
    ttt_forward,
)


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head(target):
    cfg = head_config(read_hf_config(BUILTIN_TARGET), 2048, {})
    head = _init_head(cfg, target, torch.arange(2048), seed=1)
    with torch.no_grad():  # make the layer matter: larger random weights than the init
        for p in head.midlayer.parameters():
            if p.dim() == 2:
                p.normal_(std=0.08)
    return head.eval()


def paged_chain_logits(head, features, ids, committed, tokens):
    """Head over committed entries 0..committed-1, then a chain over `tokens` (one per depth)."""
    cfg = head.config.layer
    cache = KVCache(1, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = PageTable(4)
    table.reserve(PagePool(16), 64)
    backend = TorchAttentionBackend()

    def run(tok, hidden, pos, kv_len):
        meta = backend.plan([SeqAttention(table, kv_len, len(tok))], "cpu")
        return head(torch.tensor(tok), hidden, pos, AttentionContext(backend, meta, cache))

    out = run(ids[1:committed + 1], head.fuse(features[:committed]), torch.arange(committed),
              committed)
    g = out.g[-1:]
    logits = out.logits[-1]
    for depth, token in enumerate(tokens, start=1):
        out = run([token], g, torch.tensor([committed - 1 + depth]), committed + depth)
        g, logits = out.g, out.logits[0]
    return logits


def test_ttt_steps_equal_paged_drafting(target, head):
    ids = torch.randint(2, 2048, (1, 24), generator=torch.Generator().manual_seed(0))
    layers = read_hf_config(BUILTIN_TARGET)["num_hidden_layers"]
    capture = Eagle3Config.from_hf(head_config(read_hf_config(BUILTIN_TARGET), 2048, {})
                                   ).aux_layer_inputs(layers)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in capture], dim=-1)[0]
        batch = _TTTBatch(features[None, :-1], ids[:, 1:], torch.zeros(1, 23, 2048))
        steps = ttt_forward(head, batch, num_steps=4)
        flat = ids[0].tolist()
        for step in range(4):
            for i in (step + 2, 10, 22):
                committed = i - step + 1  # entries 0..i-step
                chain = flat[committed + 1: i + 2]  # tokens of depth 1..step at entries
                ref = paged_chain_logits(head, features, flat, committed, chain)
                torch.testing.assert_close(steps[step][0, i], ref, atol=2e-4, rtol=2e-4)


def test_draft_vocabulary_is_the_most_frequent_ids():
    counts = np.array([5, 1, 9, 9, 0, 3])
    assert choose_draft_vocab(counts, 6, 3).tolist() == [0, 2, 3]
    assert choose_draft_vocab(None, 6, 0).tolist() == list(range(6))


def test_training_reduces_loss_and_writes_a_loadable_head(tmp_path, target):
    from splitspec.model.loader import load_eagle3

    # Repetitive data, so that a few steps can learn something.
    base = torch.randint(2, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    blocks = base.repeat(8, 1)
    counts = np.bincount(blocks.flatten().numpy(), minlength=2048)
    untrained = train_eagle3(BUILTIN_TARGET, blocks, tmp_path / "untrained", Eagle3TrainConfig(
        steps=1, batch_size=8, lr=1e-9, ttt_steps=3, draft_vocab_size=512, show_progress=False),
        counts)
    cfg = Eagle3TrainConfig(steps=60, batch_size=8, lr=3e-3, ttt_steps=3, draft_vocab_size=512,
                            warmup_steps=5, show_progress=False)
    result = train_eagle3(BUILTIN_TARGET, blocks, tmp_path / "head", cfg, counts)
    head = load_eagle3(result.out_dir, torch.float32, "cpu")
    assert head.config.draft_vocab_size == 512
    assert int(head.t2d.sum()) == 512
    before = evaluate_eagle3(untrained.out_dir, BUILTIN_TARGET, blocks[:16], 3)
    after = evaluate_eagle3(result.out_dir, BUILTIN_TARGET, blocks[:16], 3)
    assert all(a > b + 0.2 for a, b in zip(after, before, strict=True)), (before, after)


def test_training_features_are_what_the_serving_target_captures(target):
    """Every captured index, the last layer's output (index N) included, matches the serving
    model's capture: the head is trained on the features it is served."""
    from splitspec.model.loader import load_llama
    from splitspec.training.eagle3 import target_features
    from tests.test_model import Runner

    ours = load_llama(BUILTIN_TARGET, torch.float32, "cpu")
    n = ours.config.num_layers
    ids = list(range(200, 216))
    capture = (0, 2, n)
    _, aux = Runner(ours).run(ids, torch.arange(16), 16, capture=capture)
    with torch.no_grad():
        features, _ = target_features(target, torch.tensor([ids]), capture)
    torch.testing.assert_close(features[0], aux, atol=1e-4, rtol=1e-4)
