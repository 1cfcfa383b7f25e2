"""The target's start-up steps. Each returns a finished part; the engine is built from them.

Steps, in order: load_config, bind_port, init_distributed, load_model,
allocate_kv_cache, init_attention_backend, connect_draft, capture_cuda_graphs,
warmup, start_server. Health turns SERVING in __main__ only after all of them.
The port is bound second, so a taken port fails start-up in seconds, not after
the model is loaded; nothing is served on it before start_server. The draft is
connected before the graphs are captured because they capture the layer inputs
that draft reads (and no others).

With tensor parallelism every rank runs load_config and then init_distributed
to capture_cuda_graphs (:func:`build_rank`) on its shard, ranks 1..N-1 skipping
bind_port and connect_draft (only rank 0 serves the gateway and talks to the
draft); they then skip the last two and serve rank 0's calls (:func:`run_rank`),
while rank 0 waits for all of them in its warmup step before driving any call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from splitspec import telemetry
from splitspec.attention import (
    AttentionBackend,
    AttentionShape,
    FlashInferBackend,
    choose_backend,
    make_backend,
)
from splitspec.cuda_graphs import PROMPT_BUCKETS, StepGraphs, buckets_up_to
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import Detailed, InitFailed, InitReport, Startup, fail_startup
from splitspec.kv_cache import KVCache, PagePool, memory_shortfall
from splitspec.model.config import LlamaConfig
from splitspec.model.llama import LlamaForCausalLM
from splitspec.model.loader import check_device, load_llama, parse_dtype, use_cpu_threads
from splitspec.model.parallel import SINGLE, TPGroup, layout, tp_error
from splitspec.tokenizer import tokenizer_sha256
from splitspec.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.draft_client import DraftLink
from target_service.engine import Engine, EngineLimits, always_speculate
from target_service.ranks import die_with_parent, send
from target_service.runner import ModelRunner, TPRunner, serve_calls
from target_service.scheduler import Scheduler
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)

STEPS = ["load_config", "bind_port", "init_distributed", "load_model", "allocate_kv_cache",
         "init_attention_backend", "connect_draft", "capture_cuda_graphs", "warmup", "start_server"]
# What ranks 1..N-1 do not run, and why.
RANK_SKIPS = {"bind_port": "only rank 0 serves gRPC",
              "warmup": "rank 0 drives warmup; this rank runs its calls",
              "start_server": "only rank 0 serves gRPC"}
WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
WARMUP_NEW_TOKENS = 8
DEFER_CHECK = 4  # tokens: the deferral limit warmup's check of a deferred return runs with
DEFER_CHECK_TOKENS = 128  # the most tokens that check's longer request may take to verify a
                          # tree after the return (it is cancelled once it has; fewer where
                          # the context is shorter)


class ModelSpec(NamedTuple):
    config: LlamaConfig
    tokenizer_sha256: str


class Draft(NamedTuple):
    link: DraftLink
    capture: tuple[int, ...]  # target layer inputs to capture for the draft (empty: none)


class Placement(NamedTuple):
    """Where this process sits: its rank, the group size and the rendezvous address."""

    rank: int = 0
    size: int = 1
    address: str = ""        # host:port of rank 0's rendezvous ("" for one rank)
    torchrun: bool = False   # the ranks were started by torchrun, not by rank 0

    def device(self, device: str) -> str:
        """This rank's torch device: "cuda" means cuda:<local rank> with several ranks."""
        if self.size > 1 and device == "cuda":
            return f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank))}"
        return device


ONE_RANK = Placement()


class TP(NamedTuple):
    group: TPGroup   # the model's collectives
    control: object  # a gloo group for rank 0's calls (None for one rank)


def load_config(cfg: TargetConfig, where: Placement = ONE_RANK) -> Detailed:
    model_cfg = LlamaConfig.read(cfg.model)
    parse_dtype(cfg.dtype)
    problem = tp_error(model_cfg, where.size)
    if problem:
        raise ValueError(problem)
    if where.size > 1 and cfg.device.startswith("cuda:"):
        raise ValueError(f"--device {cfg.device} names one GPU: with --tp {where.size} use "
                         "--device cuda (rank r takes cuda:r)")
    check_device(cfg.device, where.size)
    if cfg.max_context > model_cfg.max_position:
        raise ValueError(f"--max-context {cfg.max_context} exceeds the model's "
                         f"max_position_embeddings {model_cfg.max_position}; lower --max-context")
    if cfg.max_context < len(WARMUP_PROMPT) + WARMUP_NEW_TOKENS:
        raise ValueError(f"--max-context {cfg.max_context} is below the "
                         f"{len(WARMUP_PROMPT) + WARMUP_NEW_TOKENS} tokens the start-up's warmup "
                         f"generates (a {len(WARMUP_PROMPT)}-token prompt and "
                         f"{WARMUP_NEW_TOKENS} new tokens); raise --max-context")
    if cfg.num_draft_tokens > cfg.max_tree_nodes or cfg.topk < 1 or cfg.num_steps < 1:
        raise ValueError("--num-draft-tokens, --topk and --num-steps must be positive")
    cfg.verify_graph_sizes  # noqa: B018 (a bad --graph-tree-sizes fails here, not at capture)
    if cfg.defer_catch_up < 0:
        raise ValueError(f"--defer-catch-up {cfg.defer_catch_up}: give tokens, or 0 for a "
                         "return to speculation that waits for the draft's catch-up")
    if cfg.feature_memory_dir and not Path(cfg.feature_memory_dir).is_dir():
        raise ValueError(f"--feature-memory-dir {cfg.feature_memory_dir} is not a directory "
                         "(mount the volume the draft sees there, or leave the flag out)")
    if cfg.profile_out is not None and not cfg.profile_out.parent.is_dir():
        raise ValueError(f"--profile-out {cfg.profile_out}: {cfg.profile_out.parent} is not a "
                         "directory (the profile is written there when the target stops)")
    spec = ModelSpec(model_cfg, tokenizer_sha256(cfg.model))
    eos = ", ".join(map(str, model_cfg.eos_token_ids)) or "none"
    return Detailed(spec, f"{cfg.model.name}: {model_cfg.num_layers} layers, vocab "
                          f"{model_cfg.vocab_size}, EOS ids {eos}")


def init_distributed(cfg: TargetConfig, where: Placement) -> Detailed:
    """Join the ranks' process group (NCCL on GPUs, gloo on CPU) and a gloo control group."""
    if where.size == 1:
        return Detailed(TP(SINGLE, None), "single rank")
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(where.device(cfg.device)))
    dist.init_process_group(backend, init_method=f"tcp://{where.address}", rank=where.rank,
                            world_size=where.size, timeout=timedelta(seconds=cfg.dist_timeout_s))
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return Detailed(TP(TPGroup(where.rank, where.size, dist.group.WORLD), control),
                    f"rank {where.rank} of {where.size} ({backend}, {where.address})")


def load_model(cfg: TargetConfig, tp: TPGroup, device: str) -> Detailed:
    threads = use_cpu_threads(cfg.cpu_threads)
    model = load_llama(cfg.model, parse_dtype(cfg.dtype), device, tp)
    params = sum(p.numel() for p in model.parameters())
    shard = f", shard {tp.rank} of {tp.size}" if tp.size > 1 else ""
    return Detailed(model, f"{params / 1e6:.1f}M parameters{shard}, {cfg.dtype} on {device}, "
                    f"{threads}")


LESS_MEMORY = "lower --max-running or --max-context, or set --num-pages"


def allocate_kv_cache(cfg: TargetConfig, model_cfg: LlamaConfig, tp: TP, device: str) -> Detailed:
    """This rank's KV heads for every page; every rank ends with the same page count."""
    per_seq = cfg.max_context + cfg.max_tree_nodes + 1
    # Room for max_running full sequences, and for the CUDA graphs' padding rows.
    scratch = -(-(cfg.max_tree_nodes + 1) // cfg.page_size)
    num_pages = cfg.num_pages or cfg.max_running * -(-per_seq // cfg.page_size) + scratch
    dtype = parse_dtype(cfg.dtype)
    kv_heads = layout(model_cfg, tp.group).kv_heads if tp.group.size > 1 else model_cfg.num_kv_heads
    need = KVCache.bytes_needed(model_cfg.num_layers, num_pages, cfg.page_size,
                                kv_heads, model_cfg.head_dim, dtype)
    if short := memory_shortfall(need, device, "KV cache"):
        raise MemoryError(f"{short}; {LESS_MEMORY}")
    if tp.group.size > 1:  # the ranks must agree (rank 0 allocates pages for all of them)
        agreed = torch.tensor([num_pages])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.control)
        num_pages = int(agreed)
    cache = KVCache(model_cfg.num_layers, num_pages, cfg.page_size, kv_heads,
                    model_cfg.head_dim, dtype, device)
    return Detailed((cache, PagePool(num_pages)), f"{num_pages} pages of {cfg.page_size}, "
                    f"{kv_heads} KV heads ({need / 2**20:.1f} MiB)")


def attention_shape(cfg: TargetConfig, model_cfg: LlamaConfig, tp: TPGroup) -> AttentionShape:
    """This rank's heads and the cache's pages, as the attention backend plans them."""
    heads, kv_heads = model_cfg.num_heads, model_cfg.num_kv_heads
    if tp.size > 1:
        lay = layout(model_cfg, tp)
        heads, kv_heads = lay.heads, lay.kv_heads
    return AttentionShape(heads, kv_heads, model_cfg.head_dim, cfg.page_size, parse_dtype(cfg.dtype))


def init_attention_backend(cfg: TargetConfig, shape: AttentionShape, device: str) -> Detailed:
    """The backend, with its kernels compiled (tree masks only where a draft sends trees)."""
    name, why = choose_backend(cfg.attention_backend, device, shape.dtype)
    backend = make_backend(name, shape, device)
    ready = ""
    if isinstance(backend, FlashInferBackend):
        ready = f"; kernels ready in {backend.compile_kernels(masked=bool(cfg.draft)):.1f}s"
    return Detailed(backend, f"{name} ({why}){ready}")


def default_capture(num_layers: int) -> tuple[int, ...]:
    """The target layer inputs an EAGLE-3 head reads unless it names others: low, mid, high."""
    return (2, num_layers // 2, num_layers - 3)


def capture_cuda_graphs(cfg: TargetConfig, runner: ModelRunner, pool: PagePool,
                        shape: AttentionShape, capture: tuple[int, ...], control: object = None
                        ) -> Detailed:
    """Step graphs for every batch-size bucket up to --max-running: plain decode and, with a
    draft, verification of trees of each --graph-tree-sizes node count; prefill graphs of fresh
    prompts for token counts up to --prefill-graph-tokens (at most --max-prefill-tokens);
    and each step after each prompt count (mixed steps). All capture the layer inputs the
    draft reads (``capture``, from connect_draft). The runner replays them. With --tp, every
    rank captures the same graphs, their collectives included, and replays them in step."""
    device = str(runner.device)
    if not device.startswith("cuda"):
        return Detailed(None, f"no-op on {device}")
    if not cfg.cuda_graphs:
        return Detailed(None, "off (--no-cuda-graphs): eager decode")
    if not isinstance(runner.backend, FlashInferBackend):
        return Detailed(None, "none: graphs need the flashinfer backend; eager decode")
    if runner.model.tp.size > 1:
        # Only rank 0 connects the draft: it tells the others which layer inputs to capture,
        # so that the ranks replay the same graph for each call.
        box = [capture]
        dist.broadcast_object_list(box, src=0, group=control)
        capture = box[0]
    sizes = cfg.verify_graph_sizes
    q_lens = (1, *(n + 1 for n in sizes)) if cfg.draft else (1,)
    # The padding rows' pages (a verify row's committed slot too); every rank takes the same.
    scratch = pool.allocate(-(-(max(q_lens) + 1) // cfg.page_size))
    graphs = StepGraphs(runner.model, runner.cache, shape, scratch,
                        cfg.max_context + cfg.max_tree_nodes + 1, device)
    buckets = buckets_up_to(cfg.max_running)
    prompt_tokens = min(cfg.prefill_graph_tokens, cfg.max_prefill_tokens)
    prompt_buckets = buckets_up_to(prompt_tokens, PROMPT_BUCKETS) if prompt_tokens > 0 else ()
    seconds = graphs.capture(buckets, q_lens, (capture,), prompt_buckets)
    runner.graphs = graphs
    steps = (f"decode and {', '.join(map(str, sizes))}-node verify" if cfg.draft
             else "decode")
    prompts = (f", each alone and after prompts of {', '.join(map(str, prompt_buckets))} tokens"
               if prompt_buckets else "; prompts eager")
    features = f"capturing layer inputs {list(capture)}" if capture else "no features"
    return Detailed(graphs, f"{len(graphs.graphs)} graphs ({steps} for batch sizes "
                    f"{', '.join(map(str, buckets))}{prompts}; {features}) in {seconds:.1f}s")


def connect_draft(cfg: TargetConfig, spec: ModelSpec, cache: KVCache) -> Detailed:
    """The draft's link, checked against this target; when the draft reads the target's
    captured layer inputs (EAGLE-3), ``cache`` keeps them for every slot from now on."""
    link = DraftLink.connect(cfg.draft, cfg.connect_timeout_s, cfg.draft_timeout_s,
                             cfg.feature_memory_mb * 2**20,
                             pin_features=cache.data.device.type == "cuda",
                             feature_memory_dir=cfg.feature_memory_dir,
                             exchange_memory=cfg.exchange_memory)
    info = link.info
    problems = draft_mismatches(info, spec, cfg.max_context)
    if problems:
        link.close()
        raise ValueError(f"draft {info.model_name} at {cfg.draft} does not fit target "
                         f"{cfg.model.name}: " + "; ".join(problems))
    capture: tuple[int, ...] = ()
    if info.needs_hidden_states:
        capture = tuple(info.aux_layer_inputs) or default_capture(spec.config.num_layers)
    held = ""
    if capture:
        width = len(capture) * spec.config.hidden_size
        need = cache.num_pages * cache.page_size * width * cache.data.element_size()
        if short := memory_shortfall(need, cache.data.device, "the draft's features (beside "
                                     "the KV cache)"):
            link.close()
            raise MemoryError(f"{short}; {LESS_MEMORY}")
        held = f" ({cache.hold_features(width, cache.data.dtype) / 2**20:.1f} MiB)"
        held += (f", sent through shared memory {link.feature_memory}" if link.feature_memory
                 else ", sent on the stream")
    if link.mailbox:
        held += f"; the exchange through the mailbox {link.mailbox}"
    link.init_report()  # (kept: TargetInfo.draft_report)
    draft = Draft(link, capture)
    return Detailed(draft, f"{info.kind} draft {info.model_name}, capture layer inputs "
                    f"{capture}{held}")


def draft_mismatches(info: object, spec: ModelSpec, max_context: int) -> list[str]:
    """What makes the draft unfit for this target (whose sequences reach ``max_context``
    tokens), each with what to change."""
    cfg = spec.config
    problems = []
    if info.max_context < max_context:  # (past it every step would go without a tree)
        problems.append(f"the draft holds sequences of up to {info.max_context} tokens, the "
                        f"target's reach {max_context}; give the draft --max-context "
                        f"{max_context} or more, or the target a lower --max-context")
    if info.vocab_size != cfg.vocab_size:
        problems.append(f"draft vocabulary size {info.vocab_size} != target vocabulary size "
                        f"{cfg.vocab_size}; use a draft trained for this target")
    if info.tokenizer_sha256 and info.tokenizer_sha256 != spec.tokenizer_sha256:
        problems.append(f"draft tokenizer (sha256 {info.tokenizer_sha256[:12]}) differs from the "
                        f"target's ({spec.tokenizer_sha256[:12]})")
    if info.needs_hidden_states:
        if info.target_hidden_size != cfg.hidden_size:
            problems.append(f"EAGLE-3 head expects target hidden size {info.target_hidden_size}, "
                            f"target has {cfg.hidden_size}")
        if info.target_num_layers and info.target_num_layers != cfg.num_layers:
            problems.append(f"EAGLE-3 head was configured for a {info.target_num_layers}-layer "
                            f"target, target has {cfg.num_layers}")
        bad = [i for i in info.aux_layer_inputs if i > cfg.num_layers]
        if bad or (not info.aux_layer_inputs and cfg.num_layers < 4):
            problems.append(f"EAGLE-3 captured layers {list(info.aux_layer_inputs) or 'default'} do "
                            f"not exist in a {cfg.num_layers}-layer target")
    return problems


NEAR_TIE = 0.02  # low precision: ON may part from OFF only where OFF's top logits are this
                 # close (relative to the row's largest logit magnitude)


def parting(engine: Engine, name: str, tokens: list[int], plain: list[int], exact: bool) -> str:
    """'' when a speculative greedy run gave plain decoding's tokens. Otherwise in float32 it
    is a broken verifier; in bf16/fp16 the two paths round differently, so the first token
    where they part must be a near-tie of OFF's logits there (the note says where), or
    verification is broken. Raises RuntimeError saying which."""
    if tokens == plain:
        return ""
    k = next((i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b),
             min(len(tokens), len(plain)))
    broken = (f"speculative decoding ({name}) produced {tokens}, plain decoding {plain}: "
              "verification is broken")
    if exact or k >= min(len(tokens), len(plain)):
        raise RuntimeError(broken)
    logits = engine.last_logits([*WARMUP_PROMPT, *plain[:k]])
    ours, theirs = float(logits[plain[k]]), float(logits[tokens[k]])
    scale = float(logits.abs().max())
    if abs(ours - theirs) > NEAR_TIE * scale:
        raise RuntimeError(f"{broken} (they part at token {k}, where plain decoding's logit "
                           f"{ours:.3f} is far from that of the speculative token {theirs:.3f})")
    return f"; {name} parted from plain at token {k} on a near-tie ({abs(ours - theirs):.2g})"


def warmup(engine: Engine, draft_info: draft_pb2.DraftInfo | None,
           default_shape: common_pb2.DraftShape, wait_ranks: Callable[[], str],
           exact: bool = True, defer_catch_up: int = 0) -> Detailed:
    """Real generations through every path: plain, and with a draft tree and a chain, greedy
    and sampled; then, with ``defer_catch_up``, a return to speculation whose catch-up is
    deferred (:func:`deferred_return`). Last, the serving limits that let steps decode on
    without the draft: deferred catch-ups and EngineLimits.skip_owed (the checks before need
    every step to wait for the draft: see Engine.set_limits).

    Speculation must reproduce plain decoding, greedy and seeded-sampled alike (a seeded
    request draws the same number for the same position either way); a mismatch fails
    start-up. That is exact in float32 (``exact``). In bf16/fp16 decode and verify round
    differently: a greedy run may part from plain decoding only at a near-tie of the
    logits (:func:`parting`), and a seeded sampled run must be reproducible rather than
    equal. A draft with sampled trees changes which numbers a seeded request uses, so
    there too the check is that the request is reproducible and its trees verified.
    With several ranks it first waits until every rank serves rank 0's calls.
    """
    ranks = wait_ranks()
    plain, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS, common_pb2.SPECULATION_MODE_OFF)
    sampled = common_pb2.SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1)
    sampled_plain, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                       common_pb2.SPECULATION_MODE_OFF, sampling=sampled)
    if draft_info is None:
        return Detailed(None, f"{ranks}plain decoding ran (no draft)")
    sampled_spec, stats = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                          common_pb2.SPECULATION_MODE_ON, sampling=sampled)
    if draft_info.sampled_trees or not exact:
        again, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                   common_pb2.SPECULATION_MODE_ON, sampling=sampled)
        if again != sampled_spec or stats.verify_steps == 0:
            raise RuntimeError(f"a seeded sampled request with speculation gave {sampled_spec}, "
                               f"then {again} ({stats.verify_steps} trees verified): it must be "
                               "reproducible and verify its trees")
    elif sampled_spec != sampled_plain:
        raise RuntimeError(f"a seeded sampled request gave {sampled_spec} with speculation "
                           f"and {sampled_plain} without: verification is broken")
    chain = common_pb2.DraftShape(num_draft_tokens=default_shape.num_steps, topk=1,
                                  num_steps=default_shape.num_steps)
    notes = ""
    for name, shape in (("tree", default_shape), ("chain", chain)):
        tokens, stats = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                        common_pb2.SPECULATION_MODE_AUTO, always_speculate(shape))
        notes += parting(engine, name, tokens, plain, exact)
        if stats.verify_steps == 0:
            raise RuntimeError(f"warmup with a {name} never verified a draft tree "
                               f"(plain steps {stats.plain_steps}, rejected {stats.rejected_trees})")
    agree = "agree" if exact else "agree up to rounding"
    if defer_catch_up:
        notes += deferred_return(engine, default_shape, exact)
        notes += f"; from now on a catch-up of over {defer_catch_up} tokens is deferred"
    engine.set_limits(defer_catch_up=defer_catch_up, skip_owed=True)
    return Detailed(None, f"{ranks}plain, tree and chain {agree}, greedy and sampled{notes}")


def deferred_return(engine: Engine, shape: common_pb2.DraftShape, exact: bool) -> str:
    """--defer-catch-up's path run once for real: two requests of the warmup prompt under a
    policy that speculates at batch 1 alone. Beside the shorter one (DEFER_CHECK + 2
    tokens) the longer decodes plainly; alone, it returns to speculation with that many
    tokens the draft has not seen, whose catch-up the engine, deferring over DEFER_CHECK,
    sends alone and decodes beside. Once the longer request has verified a tree after that
    catch-up it is cancelled: its tokens must be plain decoding's (up to a near-tie, as
    :func:`parting`). Raises RuntimeError when no catch-up was deferred or no tree verified
    after it within DEFER_CHECK_TOKENS tokens (a draft that stays slow: the deferral itself
    did nothing wrong, but it cannot be said to work)."""
    engine.set_limits(defer_catch_up=DEFER_CHECK)
    policy = target_pb2.SpecPolicy(entries=[  # larger batches: no entry, no speculation
        target_pb2.SpecPolicy.Entry(max_batch_size=1, shape=shape)])
    longer = min(DEFER_CHECK_TOKENS, engine.limits.max_context - len(WARMUP_PROMPT))
    tokens: list[int] = []
    seen = {"catching_up": 0, "after": 0}

    def until(event: target_pb2.ServeEvent) -> bool:
        for delta in event.deltas:
            if delta.request_id != 1:
                continue
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                raise RuntimeError(
                    f"a return to speculation after {DEFER_CHECK + 2} plain tokens "
                    + (f"deferred its catch-up ({seen['catching_up']} steps decoded beside "
                       f"it) but verified no tree before the request's end ({len(tokens)} tokens)"
                       if seen["catching_up"] else "deferred no catch-up"))
        seen["catching_up"] += event.stats.catching_up
        seen["after"] += bool(seen["catching_up"]) and event.stats.speculated
        return bool(seen["after"])

    engine.run_stream([target_pb2.Admit(request_id=rid, prompt_ids=WARMUP_PROMPT,
                                        max_new_tokens=n, ignore_eos=True,
                                        speculation=common_pb2.SPECULATION_MODE_AUTO)
                       for rid, n in ((1, longer), (2, DEFER_CHECK + 2))],
                      policy, until)
    plain, _ = engine.generate(WARMUP_PROMPT, len(tokens), common_pb2.SPECULATION_MODE_OFF)
    steps = seen["catching_up"]
    return (f"; a return to speculation decoded {steps} step{'s' * (steps != 1)} beside its "
            f"deferred catch-up and verified trees"
            + parting(engine, "the deferred return", tokens, plain, exact))


def bind_port(cfg: TargetConfig) -> Detailed:
    """Rank 0's gRPC server, its port bound (a taken port fails here) but not yet served."""
    server = ServiceServer(cfg.address, max_workers=16,
                           service_names=[target_pb2.DESCRIPTOR.services_by_name["Target"].full_name])
    return Detailed(server, f"{cfg.address} held; served from start_server on")


def start_server(server: ServiceServer, servicer: TargetServicer) -> Detailed:
    target_pb2_grpc.add_TargetServicer_to_server(servicer, server.server)
    server.start()
    return Detailed(server, f"listening on {server.address}")


class Built(NamedTuple):
    engine: Engine
    server: ServiceServer
    draft: Draft | None


class RankParts(NamedTuple):
    spec: ModelSpec
    tp: TP
    runner: ModelRunner
    pool: PagePool
    draft: Draft | None


def build_rank(cfg: TargetConfig, startup: Startup, where: Placement,
               connect: Callable[[ModelSpec, KVCache], Draft | None] | None = None,
               bind: Callable[[], object] | None = None) -> RankParts:
    """The steps every rank runs: config, process group, its shard, its cache, attention,
    graphs. Rank 0's ``bind`` runs bind_port right after the config, and its ``connect``
    connect_draft before the graphs, which capture the layer inputs that draft reads; the
    other ranks skip both."""
    spec: ModelSpec = startup.step("load_config", load_config, cfg, where)
    if bind is not None:
        bind()
    tp: TP = startup.step("init_distributed", init_distributed, cfg, where)
    device = where.device(cfg.device)
    model: LlamaForCausalLM = startup.step("load_model", load_model, cfg, tp.group, device)
    cache, pool = startup.step("allocate_kv_cache", allocate_kv_cache, cfg, spec.config, tp,
                               device)
    shape = attention_shape(cfg, spec.config, tp.group)
    backend: AttentionBackend = startup.step("init_attention_backend", init_attention_backend, cfg,
                                             shape, device)
    # Rank 0 of several announces every call; the other ranks run what it announces.
    runner = (TPRunner(model, cache, backend, device, tp.control)
              if where.size > 1 and where.rank == 0 else ModelRunner(model, cache, backend, device))
    if connect is None:
        startup.skip("connect_draft", "rank 0 talks to the draft")
        draft = None
    else:
        draft = connect(spec, cache)
    startup.step("capture_cuda_graphs", capture_cuda_graphs, cfg, runner, pool, shape,
                 draft.capture if draft else (), tp.control)
    return RankParts(spec, tp, runner, pool, draft)


def run_rank(rank: int, conn: Connection | None, cfg: TargetConfig, where: Placement) -> None:
    """Ranks 1..N-1 (a process of their own): init steps, then rank 0's calls until it stops."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    if where.torchrun:  # torchrun passes its SIGTERM on to every rank: rank 0 drains its
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # requests, then stops us
    logging.basicConfig(level=cfg.log_level,
                        format=f"%(asctime)s target[rank {rank}] %(levelname)s %(message)s")
    telemetry.setup("target")
    where = where._replace(rank=rank)
    startup = Startup("target", STEPS, rank, on_change=lambda report: send(conn, "report", report))
    try:
        parts = build_rank(cfg, startup, where)
        for name, why in RANK_SKIPS.items():
            startup.skip(name, why)
    except InitFailed as failed:
        send(conn, "failed", failed.report)
        sys.exit(fail_startup(failed, None))
    send(conn, "ready", startup.report)
    if where.torchrun:  # rank 0 gathers the reports in its warmup step
        dist.gather_object(startup.report.to_pb().SerializeToString(), None, dst=0,
                           group=parts.tp.control)
    serve_calls(parts.runner, parts.tp.control)


def gather_torchrun_reports(report: InitReport, tp: TP) -> None:
    """Rank 0 under torchrun: every other rank's report, once all are ready."""
    gathered: list[bytes | None] = [None] * tp.group.size
    dist.gather_object(b"", gathered, dst=0, group=tp.control)
    report.ranks = [InitReport.from_pb(common_pb2.InitReport.FromString(data))
                    for data in gathered[1:]]


def build(cfg: TargetConfig, startup: Startup, start_engine: Callable[[Engine], None],
          where: Placement = ONE_RANK, wait_ranks: Callable[[], None] = lambda: None) -> Built:
    """Run every step of rank 0; returns the running parts. Raises InitFailed on the first
    failure. ``wait_ranks`` returns when ranks 1..N-1 serve calls (their reports in hand)."""
    def connect(spec: ModelSpec, cache: KVCache) -> Draft | None:
        if cfg.draft:
            return startup.step("connect_draft", connect_draft, cfg, spec, cache)
        startup.skip("connect_draft", "no --draft given: plain decoding only")
        return None

    bound: list[ServiceServer] = []
    with contextlib.ExitStack() as cleanup:  # start-up failed after bind_port: the port goes back
        def bind() -> None:
            bound.append(startup.step("bind_port", bind_port, cfg))
            cleanup.callback(bound[0].release)

        parts = build_rank(cfg, startup, where, connect, bind)
        built = start_rank0(cfg, startup, parts, bound[0], start_engine, where, wait_ranks)
        cleanup.pop_all()
    return built


def start_rank0(cfg: TargetConfig, startup: Startup, parts: RankParts, server: ServiceServer,
                start_engine: Callable[[Engine], None], where: Placement,
                wait_ranks: Callable[[], None]) -> Built:
    """Rank 0's steps after the graphs: the engine, warmup, then serving on ``server``."""
    spec, draft = parts.spec, parts.draft

    def ranks_ready() -> str:
        if where.size == 1:
            return ""
        if where.torchrun:
            gather_torchrun_reports(startup.report, parts.tp)
        else:
            wait_ranks()
        return f"{where.size} ranks ready; "

    default_shape = common_pb2.DraftShape(num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk,
                                          num_steps=cfg.num_steps)
    limits = EngineLimits(vocab_size=spec.config.vocab_size, max_context=cfg.max_context,
                          max_prefill_tokens=cfg.max_prefill_tokens,
                          max_tree_nodes=cfg.max_tree_nodes, default_shape=default_shape,
                          eos_ids=frozenset(spec.config.eos_token_ids),
                          early_exchange=cfg.early_exchange)
    engine = Engine(parts.runner, Scheduler(parts.pool, cfg.max_running, cfg.max_tree_nodes),
                    limits, draft.link if draft else None, draft.capture if draft else ())
    start_engine(engine)
    startup.step("warmup", warmup, engine, draft.link.info if draft else None, default_shape,
                 ranks_ready, cfg.dtype == "float32", cfg.defer_catch_up)
    info = target_pb2.TargetInfo(
        model_name=cfg.model.name, vocab_size=spec.config.vocab_size,
        tokenizer_sha256=spec.tokenizer_sha256, eos_token_ids=list(spec.config.eos_token_ids),
        max_context=cfg.max_context, max_running=cfg.max_running, has_draft=draft is not None,
        default_shape=default_shape, tp_size=where.size,
        draft_report=draft.link.report if draft else None,
        draft_model_name=draft.link.info.model_name if draft else "")
    servicer = TargetServicer(engine, info, startup.report)
    server = startup.step("start_server", start_server, server, servicer)
    return Built(engine, server, draft)
