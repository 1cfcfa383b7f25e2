"""The target's start-up steps. Each returns a finished part; the engine is built from them.

Steps, in order: load_config, init_distributed, load_model, allocate_kv_cache,
init_attention_backend, capture_cuda_graphs, connect_draft, warmup,
start_server. Health turns SERVING in __main__ only after all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from splitspec.attention import AttentionBackend, make_backend
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import Detailed, Startup
from splitspec.kv_cache import KVCache, PagePool
from splitspec.model.config import LlamaConfig, read_hf_config
from splitspec.model.llama import LlamaForCausalLM
from splitspec.model.loader import load_llama, parse_dtype
from splitspec.tokenizer import tokenizer_sha256
from splitspec.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.draft_client import DraftLink
from target_service.engine import Engine, EngineLimits, always_speculate
from target_service.scheduler import Scheduler
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)

STEPS = ["load_config", "init_distributed", "load_model", "allocate_kv_cache",
         "init_attention_backend", "capture_cuda_graphs", "connect_draft", "warmup", "start_server"]
WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
WARMUP_NEW_TOKENS = 8


class ModelSpec(NamedTuple):
    config: LlamaConfig
    tokenizer_sha256: str


class Draft(NamedTuple):
    link: DraftLink
    capture: tuple[int, ...]  # target layer inputs to capture for the draft (empty: none)
    report: common_pb2.InitReport


def load_config(cfg: TargetConfig) -> Detailed:
    model_cfg = LlamaConfig.from_hf(read_hf_config(cfg.model))
    parse_dtype(cfg.dtype)
    if cfg.max_context > model_cfg.max_position:
        raise ValueError(f"--max-context {cfg.max_context} exceeds the model's "
                         f"max_position_embeddings {model_cfg.max_position}; lower --max-context")
    if cfg.num_draft_tokens > cfg.max_tree_nodes or cfg.topk < 1 or cfg.num_steps < 1:
        raise ValueError("--num-draft-tokens, --topk and --num-steps must be positive")
    spec = ModelSpec(model_cfg, tokenizer_sha256(cfg.model))
    return Detailed(spec, f"{cfg.model.name}: {model_cfg.num_layers} layers, vocab {model_cfg.vocab_size}")


def init_distributed(cfg: TargetConfig) -> Detailed:
    return Detailed(1, "single rank (tensor parallelism: --tp comes with the TP issue)")


def load_model(cfg: TargetConfig) -> Detailed:
    model = load_llama(cfg.model, parse_dtype(cfg.dtype), cfg.device)
    params = sum(p.numel() for p in model.parameters())
    return Detailed(model, f"{params / 1e6:.1f}M parameters, {cfg.dtype} on {cfg.device}")


def allocate_kv_cache(cfg: TargetConfig, model_cfg: LlamaConfig) -> Detailed:
    per_seq = cfg.max_context + cfg.max_tree_nodes + 1
    num_pages = cfg.num_pages or cfg.max_running * -(-per_seq // cfg.page_size)
    dtype = parse_dtype(cfg.dtype)
    need = KVCache.bytes_needed(model_cfg.num_layers, num_pages, cfg.page_size,
                                model_cfg.num_kv_heads, model_cfg.head_dim, dtype)
    if cfg.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
        if need > free:
            raise MemoryError(f"KV cache needs {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is "
                              "free; lower --max-running or --max-context, or set --num-pages")
    cache = KVCache(model_cfg.num_layers, num_pages, cfg.page_size, model_cfg.num_kv_heads,
                    model_cfg.head_dim, dtype, cfg.device)
    return Detailed((cache, PagePool(num_pages)), f"{num_pages} pages of {cfg.page_size} "
                    f"({need / 2**20:.1f} MiB)")


def init_attention_backend(cfg: TargetConfig) -> Detailed:
    return Detailed(make_backend(cfg.attention_backend), cfg.attention_backend)


def capture_cuda_graphs(cfg: TargetConfig) -> Detailed:
    if not cfg.device.startswith("cuda"):
        return Detailed(None, f"no-op on {cfg.device}")
    return Detailed(None, "no graphs yet: eager decode (CUDA graphs come with the GPU engine)")


def connect_draft(cfg: TargetConfig, spec: ModelSpec) -> Detailed:
    link = DraftLink.connect(cfg.draft, cfg.connect_timeout_s, cfg.draft_timeout_s)
    info = link.info
    problems = draft_mismatches(info, spec)
    if problems:
        link.close()
        raise ValueError(f"draft {info.model_name} at {cfg.draft} does not fit target "
                         f"{cfg.model.name}: " + "; ".join(problems))
    capture: tuple[int, ...] = ()
    if info.needs_hidden_states:
        n = spec.config.num_layers
        capture = tuple(info.aux_layer_inputs) or (2, n // 2, n - 3)
    draft = Draft(link, capture, link.init_report())
    return Detailed(draft, f"{info.kind} draft {info.model_name}, capture layer inputs {capture}")


def draft_mismatches(info: object, spec: ModelSpec) -> list[str]:
    """What makes the draft unfit for this target, each with what to change."""
    cfg = spec.config
    problems = []
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


def warmup(engine: Engine, draft_info: draft_pb2.DraftInfo | None,
           default_shape: common_pb2.DraftShape) -> Detailed:
    """Real generations through every path: plain, and with a draft tree and a chain, greedy
    and sampled.

    Speculation must reproduce plain decoding exactly, greedy and seeded-sampled alike (a
    seeded request draws the same number for the same position either way); a mismatch
    fails start-up. A draft with sampled trees changes which numbers a seeded request
    uses, so there the check is that the request is reproducible and its trees verified.
    """
    plain, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS, common_pb2.SPECULATION_MODE_OFF)
    sampled = common_pb2.SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1)
    sampled_plain, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                       common_pb2.SPECULATION_MODE_OFF, sampling=sampled)
    if draft_info is None:
        return Detailed(None, "plain decoding ran (no draft)")
    sampled_spec, stats = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                          common_pb2.SPECULATION_MODE_ON, sampling=sampled)
    if draft_info.sampled_trees:
        again, _ = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                   common_pb2.SPECULATION_MODE_ON, sampling=sampled)
        if again != sampled_spec or stats.verify_steps == 0:
            raise RuntimeError(f"a seeded request with sampled trees gave {sampled_spec}, then "
                               f"{again} ({stats.verify_steps} trees verified): it must be "
                               "reproducible and verify its trees")
    elif sampled_spec != sampled_plain:
        raise RuntimeError(f"a seeded sampled request gave {sampled_spec} with speculation "
                           f"and {sampled_plain} without: verification is broken")
    chain = common_pb2.DraftShape(num_draft_tokens=default_shape.num_steps, topk=1,
                                  num_steps=default_shape.num_steps)
    for name, shape in (("tree", default_shape), ("chain", chain)):
        tokens, stats = engine.generate(WARMUP_PROMPT, WARMUP_NEW_TOKENS,
                                        common_pb2.SPECULATION_MODE_AUTO, always_speculate(shape))
        if tokens != plain:
            raise RuntimeError(f"speculative decoding ({name}) produced {tokens}, plain decoding "
                               f"{plain}: verification is broken")
        if stats.verify_steps == 0:
            raise RuntimeError(f"warmup with a {name} never verified a draft tree "
                               f"(plain steps {stats.plain_steps}, rejected {stats.rejected_trees})")
    return Detailed(None, "plain, tree and chain agree, greedy and sampled")


def start_server(cfg: TargetConfig, servicer: TargetServicer) -> Detailed:
    server = ServiceServer(cfg.address, max_workers=16,
                           service_names=[target_pb2.DESCRIPTOR.services_by_name["Target"].full_name])
    target_pb2_grpc.add_TargetServicer_to_server(servicer, server.server)
    server.start()
    return Detailed(server, f"listening on {cfg.address}")


class Built(NamedTuple):
    engine: Engine
    server: ServiceServer
    draft: Draft | None


def build(cfg: TargetConfig, startup: Startup, start_engine: Callable[[Engine], None]) -> Built:
    """Run every step; returns the running parts. Raises InitFailed on the first failure."""
    spec: ModelSpec = startup.step("load_config", load_config, cfg)
    startup.step("init_distributed", init_distributed, cfg)
    model: LlamaForCausalLM = startup.step("load_model", load_model, cfg)
    cache, pool = startup.step("allocate_kv_cache", allocate_kv_cache, cfg, spec.config)
    backend: AttentionBackend = startup.step("init_attention_backend", init_attention_backend, cfg)
    startup.step("capture_cuda_graphs", capture_cuda_graphs, cfg)
    draft: Draft | None = None
    if cfg.draft:
        draft = startup.step("connect_draft", connect_draft, cfg, spec)
    else:
        startup.skip("connect_draft", "no --draft given: plain decoding only")
    default_shape = common_pb2.DraftShape(num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk,
                                          num_steps=cfg.num_steps)
    limits = EngineLimits(vocab_size=spec.config.vocab_size, max_context=cfg.max_context,
                          max_prefill_tokens=cfg.max_prefill_tokens,
                          max_tree_nodes=cfg.max_tree_nodes, default_shape=default_shape,
                          eos_ids=frozenset(spec.config.eos_token_ids))
    engine = Engine(model, cache, backend, Scheduler(pool, cfg.max_running, cfg.max_tree_nodes),
                    limits, draft.link if draft else None, draft.capture if draft else (), cfg.device)
    start_engine(engine)
    startup.step("warmup", warmup, engine, draft.link.info if draft else None, default_shape)
    info = target_pb2.TargetInfo(
        model_name=cfg.model.name, vocab_size=spec.config.vocab_size,
        tokenizer_sha256=spec.tokenizer_sha256, eos_token_ids=list(spec.config.eos_token_ids),
        max_context=cfg.max_context, max_running=cfg.max_running, has_draft=draft is not None,
        default_shape=default_shape, tp_size=1,
        draft_report=draft.report if draft else None,
        draft_model_name=draft.link.info.model_name if draft else "")
    servicer = TargetServicer(engine, info, startup.report)
    server = startup.step("start_server", start_server, cfg, servicer)
    return Built(engine, server, draft)
