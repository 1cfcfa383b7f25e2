"""The target's step graphs and the draft's search graphs on CPU, with CUDA graphs emulated:
a capture runs the forward once and keeps its outputs, a replay runs it again and copies
into them; the Triton kernels run in the interpreter. Run by tests/test_graph_emulation.py
in a subprocess (this module patches torch.cuda), so that what the graphs plan on the host
(tables, padding, staging, the shared scratch) is checked against eager steps in CI; what
only real graphs can get wrong (memory a replay still uses, capture itself) is for the GPU
tests in tests/test_gpu_engine.py."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import draft_service.tree_search as tree_search
import splitspec.cuda_graphs as cuda_graphs


class _Event:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Graph:
    """A replay runs the captured work again and copies its outputs into the captured ones."""

    def __init__(self, work, outputs) -> None:
        self.work, self.outputs = work, outputs

    def replay(self) -> None:
        fresh = self.work()
        pairs = zip(self.outputs, fresh, strict=True) if isinstance(self.outputs, tuple) else [
            (self.outputs, fresh)]
        for kept, new in pairs:
            if kept is not None:
                kept.copy_(new)


def emulate_graphs() -> None:
    """Patch torch.cuda and the two capture functions for CPU (this process only)."""
    torch.cuda.Event = _Event
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.synchronize = lambda *args: None
    zeros = torch.zeros
    torch.zeros = lambda *args, pin_memory=False, **kwargs: zeros(*args, **kwargs)

    def record(self, forward):  # the step graphs' forward writes its own static buffers
        with torch.inference_mode():
            forward()
        return _Graph(forward, None)

    def capture(device, pool, work):
        with torch.inference_mode():
            outputs = work()
        return _Graph(work, outputs), outputs

    cuda_graphs.StepGraphs._record = record
    tree_search._capture = capture


def step_runs(steps: int, tree: list[int] | None, device: str, dtype: torch.dtype,
              backend_for: Callable[[Any], Any]
              ) -> dict[bool, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Three sequences (bucket 4: one padding row) decode ``steps`` steps with the built-in
    target, crossing pages, once eagerly on ``backend_for(shape)`` and once through the step graphs
    (features (2, 3) captured); each step either plain (tree None) or verifying a fixed tree
    of draft tokens below the last token (committing only the root, so the sequences
    advance one token a step). The roots are fixed tokens, not the runs' own choices, so
    both runs see the same inputs at every step. Returns per run (graphed or not) each
    step's logits and features. Shared by tests/test_gpu_engine.py (CUDA) and
    :func:`target_steps` (emulated on CPU)."""
    from splitspec.attention.base import SeqAttention, new_token_slots
    from splitspec.attention.flashinfer_backend import AttentionShape
    from splitspec.builtin import BUILTIN_TARGET
    from splitspec.kv_cache import KVCache, PagePool, PageTable
    from splitspec.model.layers import AttentionContext
    from splitspec.model.loader import load_llama
    from splitspec.tree import ancestor_mask, positions

    page = 16
    model = load_llama(BUILTIN_TARGET, dtype, device)
    cfg = model.config
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page, dtype)
    backend = backend_for(shape)
    nodes = len(tree or [])
    q = nodes + 1
    runs = {}
    for graphed in (False, True):
        cache = KVCache(cfg.num_layers, 64, page, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        cache.hold_features(2 * cfg.hidden_size, dtype)
        pool = PagePool(64)
        graphs = None
        if graphed:
            graphs = cuda_graphs.StepGraphs(model, cache, shape, pool.allocate(1), 128, device)
            graphs.capture((1, 2, 4), (1, q) if nodes else (1,), ((), (2, 3)))
        prompts = [[5, 6, 7], [9] * 12, list(range(20, 45))]
        tables = [PageTable(page) for _ in prompts]
        last, seen = [], []
        with torch.inference_mode():
            for table, prompt in zip(tables, prompts, strict=True):
                table.reserve(pool, len(prompt) + steps + q)
                attn = [SeqAttention(table, len(prompt), len(prompt))]
                ctx = AttentionContext(backend, backend.plan(attn, device), cache)
                out = model(torch.tensor(prompt, device=device),
                            torch.arange(len(prompt), device=device), ctx)
                last.append(int(model.compute_logits(out.hidden[-1:]).argmax()))
            lengths = [len(p) for p in prompts]
            for _ in range(steps):
                attn = [SeqAttention(t, n + q, q, tree=ancestor_mask(tree) if tree else None)
                        for t, n in zip(tables, lengths, strict=True)]
                ids = torch.tensor([[tok, *[(tok + 1 + i) % cfg.vocab_size for i in range(nodes)]]
                                    for tok in last], device=device).reshape(-1)
                pos = torch.cat([positions(tree, n) if tree else torch.tensor([n])
                                 for n in lengths]).to(device)
                rows = list(range(q * len(attn)))
                if graphs is not None:
                    plan = graphs.plan(attn, rows, (2, 3))
                    assert plan == ((4, q, (2, 3), 0), 0, 0), plan
                    logits = graphs.run_plan(plan, ids, pos, attn, rows)
                else:
                    ctx = AttentionContext(backend, backend.plan(attn, device), cache)
                    logits = model.compute_logits(model(ids, pos, ctx, (2, 3)).hidden)
                # the features each forward stored at its new tokens' slots
                aux = cache.features[torch.tensor(new_token_slots(attn), device=device)]
                seen.append((logits.clone(), aux.clone()))
                last = [(7 * n + 3 * i) % cfg.vocab_size for i, n in enumerate(lengths)]
                lengths = [n + 1 for n in lengths]  # keep the root; the tree is overwritten
        runs[graphed] = seen
    return runs


def target_steps(steps: int, tree: list[int] | None) -> None:
    """:func:`step_runs` on CPU in float32, eager on the torch backend: the graphs' logits
    and features agree with eager ones to float rounding."""
    from splitspec.attention.torch_backend import TorchAttentionBackend

    runs = step_runs(steps, tree, "cpu", torch.float32, lambda shape: TorchAttentionBackend())
    for step, ((logits_e, aux_e), (logits_g, aux_g)) in enumerate(
            zip(runs[False], runs[True], strict=True)):
        what = f"{'verify' if tree else 'decode'} step {step}"
        torch.testing.assert_close(logits_g, logits_e, rtol=1e-4, atol=1e-4, msg=what)
        torch.testing.assert_close(aux_g, aux_e, rtol=1e-4, atol=1e-4, msg=f"{what}: features")


def draft_search() -> None:
    """The built-in EAGLE-3 head's search graphs (buckets 1 and 4, 8/4/4 trees), alone and
    with the catch-up, against the eager search on the torch prefix (float32): the same
    trees, scores and roots to float rounding, padded buckets included."""
    from draft_service.config import DraftConfig
    from draft_service.drafter import TreeShape
    from draft_service.models import load_draft_model, read_spec
    from draft_service.startup import allocate_kv_cache
    from splitspec.attention.cascade import TorchPrefix
    from splitspec.attention.flashinfer_backend import AttentionShape
    from splitspec.builtin import BUILTIN_EAGLE3
    from splitspec.kv_cache import PageTable

    page = 16
    cfg = DraftConfig(model=BUILTIN_EAGLE3, max_context=256, max_running=8, page_size=page,
                      device="cpu", dtype="float32")
    model = load_draft_model(read_spec(BUILTIN_EAGLE3, "auto", cfg.target_dir), torch.float32,
                             "cpu")
    shape = AttentionShape(model.num_heads, model.num_kv_heads, model.head_dim, page,
                           torch.float32)
    cache, pool = allocate_kv_cache(cfg, model).value
    graphed = tree_search.TreeSearch(model, cache, TorchPrefix())
    graphed.capture(types.SimpleNamespace(shape=shape, device=torch.device("cpu")), (1, 4),
                    [(4, 4)], pool.allocate(1)[0], cfg.max_context)
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    eager = tree_search.TreeSearch(model, cache, TorchPrefix())
    eager.use_pad_page(pool.allocate(1)[0])
    gen, tree = torch.Generator().manual_seed(1), TreeShape(8, 4, 4)

    def table(n: int) -> PageTable:
        t = PageTable(page)
        t.reserve(pool, n)
        t.num_slots = n
        return t

    with torch.inference_mode():
        for n in (1, 3, 4):
            lengths = torch.randint(1, 200, (n,), generator=gen).tolist()
            tables = [table(length) for length in lengths]
            roots = torch.randn(n, model.state_width, generator=gen)
            assert graphed._key(n, tree, graphed.graphs) is not None
            got, want = (s.run(roots, tables, lengths, tree) for s in (graphed, eager))
            assert np.array_equal(got.tokens, want.tokens), n
            assert np.array_equal(got.parents, want.parents), n
            torch.testing.assert_close(torch.from_numpy(got.scores), torch.from_numpy(want.scores),
                                       rtol=1e-4, atol=1e-4)
            for t in tables:
                t.release(pool)
        for n in (1, 3, 4):
            firsts = torch.randint(1, 150, (n,), generator=gen).tolist()
            counts = torch.randint(1, 6, (n,), generator=gen).tolist()
            seqs = [tree_search.CatchUp(
                table(first + count), first,
                torch.randint(0, model.vocab_size, (count,), generator=gen).tolist(),
                torch.randn(count, model.feature_dim, generator=gen))
                for first, count in zip(firsts, counts, strict=True)]
            assert graphed.can_catch_up(counts, firsts, tree)
            (got, got_roots), (want, want_roots) = (s.run_caught_up(seqs, tree)
                                                    for s in (graphed, eager))
            assert np.array_equal(got.tokens, want.tokens), n
            assert np.array_equal(got.parents, want.parents), n
            torch.testing.assert_close(got_roots, want_roots, rtol=1e-4, atol=1e-4)
            for seq in seqs:
                seq.table.release(pool)
