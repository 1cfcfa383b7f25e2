"""The draft's start-up steps. Each returns a finished part; the drafter is built from them.

Steps, in order: load_config, bind_port, load_model, allocate_kv_cache,
init_attention_backend, capture_cuda_graphs, warmup, start_server. Health
turns SERVING in __main__ only after all of them. The port is bound second, so
a taken port fails start-up in seconds, not after the model is loaded; nothing
is served on it before start_server. The replay draft runs the
same steps (:func:`build_replay`): load_model reads its records, and the steps
for a model's cache, attention and graphs do nothing, unless it has a
``--replay-cost-model``, which load_model loads and those steps then build.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from draft_service.config import DraftConfig
from draft_service.drafter import (
    BaseDrafter,
    Drafter,
    DrafterLimits,
    SeqInput,
    SeqResult,
    TreeShape,
    encode_features,
    sampled_topology,
)
from draft_service.models import (
    REPLAY,
    DraftModel,
    DraftSpec,
    eagle3_entries,
    load_draft_model,
    read_spec,
)
from draft_service.replay import ReplayBook, ReplayDrafter, read_replay_spec
from draft_service.servicer import DraftServicer, draft_fault_from_env, draft_info
from draft_service.tree_search import TreeSearch
from splitspec.attention import (
    AttentionBackend,
    AttentionShape,
    FlashInferBackend,
    choose_backend,
    make_backend,
)
from splitspec.attention.decode_table import prefix_attention_for
from splitspec.cuda_graphs import buckets_up_to
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import Detailed, Startup
from splitspec.kv_cache import KVCache, PagePool, memory_shortfall
from splitspec.model.layers import quantize_projections
from splitspec.model.loader import check_device, parse_dtype, use_cpu_threads
from splitspec.replay import read_records
from splitspec.sampling import SamplingParams
from splitspec.tree import tree_error
from splitspec.v1 import draft_pb2, draft_pb2_grpc

STEPS = ["load_config", "bind_port", "load_model", "allocate_kv_cache", "init_attention_backend",
         "capture_cuda_graphs", "warmup", "start_server"]
WARMUP_TOKENS = 12
WARMUP_TREE = TreeShape(num_draft_tokens=8, topk=4, num_steps=4)
WARMUP_CHAIN = TreeShape(num_draft_tokens=4, topk=1, num_steps=4)
WARMUP_SAMPLING = SamplingParams(temperature=1.0, seed=0)
GRPC_WORKERS = 16  # each open Exchange stream holds one


class Built(NamedTuple):
    drafter: BaseDrafter
    server: ServiceServer


def load_config(cfg: DraftConfig) -> Detailed:
    cfg.check()
    parse_dtype(cfg.dtype)
    check_device(cfg.device)
    if cfg.kind == REPLAY:
        spec = read_replay_spec(Path(cfg.replay_file), cfg.replay_corrupt_rate, cfg.target_dir,
                                cfg.replay_features, cfg.replay_cost_model)
    else:
        spec = read_spec(Path(cfg.model), cfg.kind, cfg.target_dir)
    target = f", target {spec.target_dir.name} ({spec.target_num_layers} layers)" if spec.target_dir else ""
    return Detailed(spec, f"{spec.kind} draft {spec.name}, vocab {spec.vocab_size}{target}")


def load_model(cfg: DraftConfig, spec: DraftSpec) -> Detailed:
    threads = use_cpu_threads(cfg.cpu_threads)
    model = load_draft_model(spec, parse_dtype(cfg.dtype), cfg.device)
    quantized = ""
    if cfg.quantize == "fp8":
        quantized = f", {quantize_projections(model.module)} projections also in fp8"
    return Detailed(model, f"{model.num_parameters / 1e6:.1f}M parameters, {cfg.dtype} on "
                    f"{cfg.device}{quantized}, {threads}")


def allocate_kv_cache(cfg: DraftConfig, model: DraftModel) -> Detailed:
    num_pages = cfg.num_pages
    dtype = parse_dtype(cfg.dtype)
    need = KVCache.bytes_needed(model.num_layers, num_pages, cfg.page_size, model.num_kv_heads,
                                model.head_dim, dtype)
    if short := memory_shortfall(need, cfg.device, "draft KV cache"):
        raise MemoryError(f"{short}; lower --max-running or --max-context")
    cache = KVCache(model.num_layers, num_pages, cfg.page_size, model.num_kv_heads, model.head_dim,
                    dtype, cfg.device)
    return Detailed((cache, PagePool(num_pages)),
                    f"{num_pages} pages of {cfg.page_size} ({need / 2**20:.1f} MiB)")


def init_attention_backend(cfg: DraftConfig, model: DraftModel) -> Detailed:
    shape = AttentionShape(model.num_heads, model.num_kv_heads, model.head_dim, cfg.page_size,
                           model.dtype)
    name, why = choose_backend(cfg.attention_backend, cfg.device, model.dtype)
    backend = make_backend(name, shape, cfg.device)
    ready = ""
    if isinstance(backend, FlashInferBackend):
        ready = f"; kernels ready in {backend.compile_kernels(masked=True):.1f}s"
    return Detailed(backend, f"{name} ({why}){ready}")


def capture_cuda_graphs(cfg: DraftConfig, model: DraftModel, cache: KVCache, pool: PagePool,
                        backend: AttentionBackend) -> Detailed:
    """The top-k tree search captured per batch bucket and --graph-trees shape, alone and
    with the call's catch-up (CUDA with flashinfer); None (the drafter searches eagerly)
    elsewhere."""
    if not isinstance(backend, FlashInferBackend):
        return Detailed(None, f"no-op: drafting runs eagerly on {cfg.device} with this backend")
    shapes = [(min(topk, model.draft_vocab_size), depth) for topk, depth in cfg.graph_shapes]
    if not shapes:
        return Detailed(None, "no-op: --graph-trees is empty")
    search = TreeSearch(model, cache, prefix_attention_for(backend))
    (pad_page,) = pool.allocate(1)  # the padding rows' page, never given back
    buckets = buckets_up_to(cfg.max_running)
    took = search.capture(backend, buckets, shapes, pad_page, cfg.max_context)
    names = ", ".join(f"{topk}x{depth}" for topk, depth in shapes)
    return Detailed(search, f"{len(search.graphs) + len(search.caught_up)} graphs (the search "
                    f"alone and with the catch-up; trees {names}; buckets "
                    f"{', '.join(map(str, buckets))}) in {took:.1f}s")


def warmup_inputs(model: DraftModel | None, seq_id: int, start: int, tokens: list[int], shape: TreeShape,
                  generator: torch.Generator, sampling: SamplingParams | None = None,
                  feature_dim: int = 0) -> SeqInput:
    """A SeqInput for tokens at start, with random target features when the model needs them
    (without a model: ``feature_dim`` wide, an EAGLE-3 head's rows, float32)."""
    width = model.feature_dim if model is not None else feature_dim
    if not width:
        return SeqInput(seq_id, start, tokens, shape, sampling=sampling)
    rows = len((model.entries if model is not None else eagle3_entries)(start, tokens).tokens)
    features = torch.randn(rows, width, generator=generator)
    # as a target of the model's dtype sends them
    data, dim, dtype = encode_features(features.to(model.dtype) if model is not None else features)
    return SeqInput(seq_id, start, tokens, shape, data, dim, dtype, sampling)


def warmup(drafter: BaseDrafter) -> Detailed:
    """Catch a fake sequence up in two exchanges, draft a tree and a chain (and a sampled tree
    when sampled trees are on), check them; prefill a second sequence from a two-token prompt
    (one entry of an EAGLE-3 head); release both.

    The second sequence puts one row through every projection on the eager path, as a
    short prompt or a one-entry catch-up that no graph takes (a shape not captured) does
    while serving. Only a catch-up runs the head's ``fc``: without it, the GEMV kernel's
    one-row variant for ``fc`` was first compiled in a request (docs/benchmarks.md,
    twentieth part)."""
    inner = drafter.cost if isinstance(drafter, ReplayDrafter) and drafter.cost else drafter
    model = inner.model if isinstance(inner, Drafter) else None  # (a replay's cost model's)
    feature_dim = drafter.feature_dim if isinstance(drafter, ReplayDrafter) else 0
    started = time.perf_counter()
    tokens = [(7 * i + 3) % drafter.vocab_size for i in range(WARMUP_TOKENS)]
    generator = torch.Generator().manual_seed(0)
    half = WARMUP_TOKENS // 2
    session = drafter.open_session()
    found = []

    def draft_one(item: SeqInput) -> SeqResult:
        (result,) = drafter.draft(session, [item])
        if result.error:
            raise RuntimeError(f"warmup draft failed: {result.error}")
        return result

    try:
        exchanges = [(0, tokens[:half], TreeShape(0, 0, 0), None),
                     (half, tokens[half:], WARMUP_TREE, None),
                     (WARMUP_TOKENS, [], WARMUP_CHAIN, None)]
        if drafter.limits.sampled_trees:
            exchanges.append((WARMUP_TOKENS, [], WARMUP_TREE, WARMUP_SAMPLING))
        for start, new, shape, sampling in exchanges:
            result = draft_one(warmup_inputs(model, 1, start, new, shape, generator, sampling,
                                             feature_dim))
            if shape.num_draft_tokens:
                want = drafter.capped(shape).num_draft_tokens
                problem = tree_error(result.tree, drafter.vocab_size, want)
                if sampling is not None:
                    want = len(sampled_topology(drafter.capped(shape))) - 1
                    if not result.tree.proposals:
                        problem = "a sampled tree without proposals"
                if problem or result.tree.num_nodes != want:
                    raise RuntimeError(f"warmup drafted a bad tree ({problem or 'size'}): {result.tree}")
                found.append(result.tree.num_nodes)
        draft_one(warmup_inputs(model, 2, 0, tokens[:2], TreeShape(0, 0, 0), generator,
                                feature_dim=feature_dim))
        drafter.draft(session, [], release_ids=[1, 2])
    finally:
        drafter.close_session(session)
    if drafter.num_held:
        raise RuntimeError(f"warmup left {drafter.num_held} sequences held after release")
    sampled = f", sampled tree of {found[2]}" if len(found) > 2 else ""
    return Detailed(None, f"tree of {found[0]} nodes, chain of {found[1]}{sampled} in "
                    f"{time.perf_counter() - started:.2f}s")


def bind_port(cfg: DraftConfig) -> Detailed:
    """The gRPC server, its port bound (a taken port fails here, in seconds, not after the
    model is loaded) but not served before start_server."""
    name = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
    server = ServiceServer(cfg.address, GRPC_WORKERS, [name])
    return Detailed(server, f"{cfg.host}:{server.port} held; served from start_server on")


def start_server(server: ServiceServer, cfg: DraftConfig, spec: DraftSpec, drafter: BaseDrafter,
                 startup: Startup) -> Detailed:
    servicer = DraftServicer(drafter, draft_info(spec, cfg.max_context, cfg.sampled_trees), startup.report,
                             draft_fault_from_env())
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server.server)
    server.start()
    fault = f" (injecting {servicer.fault})" if servicer.fault else ""
    return Detailed(server, f"listening on {cfg.host}:{server.port}{fault}")


def build(cfg: DraftConfig, startup: Startup) -> Built:
    """Run every step; raises InitFailed at the first that fails."""
    spec = startup.step("load_config", load_config, cfg)
    server: ServiceServer = startup.step("bind_port", bind_port, cfg)
    with contextlib.ExitStack() as cleanup:  # start-up failed after bind_port: the port goes back
        cleanup.callback(server.release)
        built = (build_replay if spec.kind == REPLAY else build_model)(cfg, spec, startup, server)
        cleanup.pop_all()
    return built


def build_model(cfg: DraftConfig, spec: DraftSpec, startup: Startup, server: ServiceServer
                ) -> Built:
    """The steps after bind_port for a draft model (EAGLE-3 head or standalone)."""
    model = startup.step("load_model", load_model, cfg, spec)
    drafter = startup.step("warmup", built_and_warm, model_steps(cfg, model, startup))
    startup.step("start_server", start_server, server, cfg, spec, drafter, startup)
    return Built(drafter, server)


def model_steps(cfg: DraftConfig, model: DraftModel, startup: Startup
                ) -> Callable[[], Drafter]:
    """allocate_kv_cache, init_attention_backend and capture_cuda_graphs for a loaded model;
    what then builds its drafter."""
    cache, pool = startup.step("allocate_kv_cache", allocate_kv_cache, cfg, model)
    backend: AttentionBackend = startup.step("init_attention_backend", init_attention_backend, cfg, model)
    search = startup.step("capture_cuda_graphs", capture_cuda_graphs, cfg, model, cache, pool, backend)
    limits = drafter_limits(cfg)
    return lambda: Drafter(model, cache, pool, backend, limits, search)


def drafter_limits(cfg: DraftConfig) -> DrafterLimits:
    return DrafterLimits(cfg.max_running, cfg.max_context, cfg.max_tree_nodes, cfg.sampled_trees,
                         cfg.proposal_support)


def built_and_warm(make_drafter: Callable[[], BaseDrafter]) -> Detailed:
    """The warmup step: build the drafter and warm it up."""
    drafter = make_drafter()
    return Detailed(drafter, warmup(drafter).detail)


def load_records(spec: DraftSpec) -> Detailed:
    """The replay draft's load_model: its records (ValueError naming the file and line of a
    broken one)."""
    book = ReplayBook(read_records(spec.model_dir, spec.vocab_size))
    num_tokens = sum(len(full) for full in book.full)
    return Detailed(book, f"{len(book)} records, {num_tokens} tokens from {spec.model_dir}")


def no_op(why: str) -> Detailed:
    return Detailed(None, f"no-op: {why}")


def load_records_and_model(cfg: DraftConfig, spec: DraftSpec) -> Detailed:
    """The load_model step of a replay draft with a cost model: the records, then the model."""
    records, model = load_records(spec), load_model(cfg, spec.cost)
    return Detailed((records.value, model.value), f"{records.detail}; cost model "
                    f"{spec.cost.kind} {spec.cost.name}: {model.detail}")


def build_replay(cfg: DraftConfig, spec: DraftSpec, startup: Startup, server: ServiceServer
                 ) -> Built:
    """The steps after bind_port for the replay draft: the same names as a model's (a cost
    model's steps where it has one)."""
    limits = drafter_limits(cfg)
    if spec.cost is None:
        book = startup.step("load_model", load_records, spec)
        startup.step("allocate_kv_cache", no_op, "the replay draft holds no KV cache")
        startup.step("init_attention_backend", no_op, "the replay draft runs no attention")
        startup.step("capture_cuda_graphs", no_op, "the replay draft runs no model")
        make_cost, feature_dim = lambda: None, spec.feature_dim
    else:
        book, model = startup.step("load_model", load_records_and_model, cfg, spec)
        make_cost, feature_dim = model_steps(cfg, model, startup), 0  # the model takes them
    drafter = startup.step("warmup", built_and_warm, lambda: ReplayDrafter(
        book, cfg.replay_corrupt_rate, spec.vocab_size, limits, feature_dim, make_cost()))
    startup.step("start_server", start_server, server, cfg, spec, drafter, startup)
    return Built(drafter, server)
