"""What one step's parts cost at batch 1, in process: plain decode, verifying a tree, drafting.

On a Llama-3.1-8B-shaped target with RANDOM bf16 weights (built on the device,
no checkpoint; speed does not depend on the values) and a random EAGLE-3 head
of that target's shape (one layer, draft vocabulary 32000), after a prompt of
--context tokens:

- decode: the target's plain decode step as the engine calls it
  (ModelRunner.forward: planning, copies, the CUDA graph or the eager pass,
  logits), against the weight-read floor (W bytes / 4.5 TB/s, ../shared/GPU.md);
- verify: the same call for the root plus an --tree-nodes tree;
- with graphs (flashinfer), both calls again without them (``*_eager_ms``), and the decode
  graph replayed alone: synchronised after each replay (``decode_replay_ms``), queued back
  to back so each launch overlaps the replay before (``decode_replay_queued_ms``: the
  device's time), and the host's time to launch one (``decode_launch_ms``); and the decode
  and verify calls' host time until they return, their replay launched and not waited for
  (``decode_call_host_ms``, ``verify_call_host_ms``: the in-process side of the served
  stack's ``forward_launch_s``);
- draft: the draft's Drafter.draft for one sequence: catch up one token (with
  its features) and draft a tree of --tree-nodes nodes, topk --topk, depth
  --depth, as the draft service does for every step; with graphs the catch-up
  runs inside the search's graph, and the same calls are timed again with it
  run eagerly first (``draft_two_pass_ms``), and its graph is replayed alone as the
  decode graph is (``draft_replay_ms``, ``draft_replay_queued_ms``, ``draft_launch_ms``);
  the draft's own weight-read floor (``floor_ms``: fc once, then the layer and lm_head
  once a level).

With ``--batch N`` the target's calls are made for N sequences at once (the
draft is then not timed), and ``--prompt-tokens P`` adds a mixed call: a
fresh P-token prompt prefilled in the same pass as the N sequences' decode
(with graphs: one graph of the smallest prompt bucket >= P followed by the
decode rows). Each call's ``*_graphed`` says whether it replayed graphs.

Each figure is the median wall time of --iters calls after --warmup calls, the
device synchronised after each; the first call of each kind is also timed on its own
(``*_first_ms``: with graphs, each graph's first replay, what a server's first requests
pay). The issue's aims: verify <= 1.2 x decode, draft <= 0.25 x decode.

    python bench/bench_step_costs.py --out-json /tmp/costs.json           # H200
    python bench/bench_step_costs.py --shape builtin --device cpu --dtype float32 --iters 5
    python bench/bench_step_costs.py --batch 32 --prompt-tokens 64 --context 256  # mixed steps
    python bench/bench_step_costs.py --shape bench    # the trained bench pair's sizes, random weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_decode_floor import BANDWIDTH_TB_S, LLAMA_31_8B

from draft_service.drafter import Drafter, DrafterLimits, TreeShape
from draft_service.models import Eagle3Draft
from draft_service.startup import warmup_inputs
from draft_service.tree_search import TreeSearch
from splitspec.attention import AttentionShape, SeqAttention, choose_backend, make_backend
from splitspec.attention.decode_table import prefix_attention_for
from splitspec.attention.flashinfer_backend import FlashInferBackend
from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.cuda_graphs import PROMPT_BUCKETS, StepGraphs
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.model.config import Eagle3Config, LlamaConfig, read_hf_config
from splitspec.model.eagle3 import Eagle3Head
from splitspec.model.layers import quantize_projections, use_fused_kernels
from splitspec.model.llama import LlamaForCausalLM
from splitspec.model.loader import allocate, finish, parse_dtype
from splitspec.tree import ancestor_mask, positions
from target_service.runner import ForwardBatch, ModelRunner

PAGE = 16
EAGLE3_FOR_8B = {**LLAMA_31_8B, "architectures": ["LlamaForCausalLMEagle3"],
                 "num_hidden_layers": 1, "draft_vocab_size": 32000, "target_hidden_size": 4096}
PROFILE_CALLS = 5  # calls under torch.profiler, after the timed ones (--profile)
QUEUED_REPLAYS = 20  # decode replays launched back to back per timed call (the device's time)
TREE_PARENTS = {8: [0, 0, 0, 0, 1, 1, 5, 7]}  # 4 children of the root, a branch of depth 4


def random_module(module: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Random weights (normal, std 0.02; norms 1) for a module built on the meta device,
    allocated and finished as the loader does."""
    module = allocate(module, dtype, device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return finish(module, dtype, device)


def configs(shape: str) -> tuple[dict, dict]:
    if shape == "8b":
        return LLAMA_31_8B, EAGLE3_FOR_8B
    if shape == "bench":  # the sizes `python -m splitspec.training.pipeline --preset bench` trains
        from splitspec.training.eagle3 import head_config
        from splitspec.training.pipeline import PRESETS, model_values

        preset = PRESETS["bench"]
        target = model_values(preset, preset.target, preset.tokenizer_vocab)
        return target, head_config(target, preset.draft_vocab_size, preset.head_overrides)
    return read_hf_config(BUILTIN_TARGET), read_hf_config(BUILTIN_EAGLE3)


def timed(fn: Callable[[], object], warmup: int, iters: int, device: str) -> list[float]:
    """Wall milliseconds of each of iters calls (after warmup calls), synchronised."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return times


def profiled(fn: Callable[[], object], calls: int, out: Path | None, name: str, device: str) -> None:
    """With --profile: torch.profiler over calls calls of fn, tables by device and host time."""
    if out is None:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    tables = [f"{name}: {calls} calls", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if device.startswith("cuda"):
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
    (out / f"{name}.txt").write_text("\n\n".join(tables))


def capture_graphs(model: LlamaForCausalLM, cache: KVCache, shape: AttentionShape, pool: PagePool,
                   args: argparse.Namespace) -> StepGraphs:
    """The step graphs of --batch (decode and --tree-nodes verify) and, with --prompt-tokens,
    the smallest prompt bucket that holds the prompt (alone, and before each step)."""
    scratch = pool.allocate(-(-(args.tree_nodes + 1) // PAGE))
    graphs = StepGraphs(model, cache, shape, scratch, args.context + 64, args.device)
    prompts = (next(b for b in PROMPT_BUCKETS if b >= args.prompt_tokens),) if args.prompt_tokens else ()
    graphs.capture((args.batch,), (1, args.tree_nodes + 1), ((),), prompts)
    return graphs


def device_and_launch(graph: torch.cuda.CUDAGraph, args: argparse.Namespace
                      ) -> tuple[list[float], list[float]]:
    """A captured graph's device time (ms a replay, QUEUED_REPLAYS launched back to back so
    each launch overlaps the replay before) and the host's time to launch one (not waited
    for). The replays redo the graph's last work on the same buffers."""
    def queued() -> None:
        for _ in range(QUEUED_REPLAYS):
            graph.replay()

    device = [t / QUEUED_REPLAYS for t in timed(queued, 1, max(args.iters // 5, 3), args.device)]
    return device, host_ms(graph.replay, args.iters)


def host_ms(fn: Callable[[], object], iters: int) -> list[float]:
    """The host's milliseconds in each of iters calls of fn on an idle device (synchronised
    before each call, not after: what the call leaves queued is not waited for)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return times


def draft_floor_ms(cfg: Eagle3Config, depth: int, dtype: torch.dtype, fp8: bool = False) -> float:
    """The weight-read floor of drafting a tree of ``depth`` levels: fc once (the catch-up's
    features), then the layer and lm_head once a pass, ``depth`` passes (the catch-up's gives
    the first level; each level but the last gives the next); embedding rows not counted.
    ``fp8``: the projections read as fp8 codes (a byte each; their scales not counted)."""
    layer = cfg.layer
    h, inter = layer.hidden_size, layer.intermediate_size
    qkv = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim * 2 * h
    o_proj = h * layer.num_heads * layer.head_dim
    one_pass = qkv + o_proj + 3 * h * inter + cfg.draft_vocab_size * h
    params = h * 3 * cfg.target_hidden_size + depth * one_pass
    size = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    return 1000 * params * size / (BANDWIDTH_TB_S * 1e12)


def target_costs(cfg: LlamaConfig, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = random_module(model, dtype, args.device)
    pages = (args.batch + 3) * -(-(args.context + 64) // PAGE) + -(-args.prompt_tokens // PAGE)
    cache = KVCache(cfg.num_layers, pages, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, args.device)
    pool = PagePool(pages)
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, PAGE, dtype)
    name, _ = choose_backend(args.attention_backend, args.device, dtype)
    backend = make_backend(name, shape, args.device)
    runner = ModelRunner(model, cache, backend, args.device)
    graphs = None
    batch, n, prompt_len = args.batch, args.context, args.prompt_tokens
    if isinstance(backend, FlashInferBackend):
        backend.compile_kernels(masked=True)
        if args.graphs:
            graphs = capture_graphs(model, cache, shape, pool, args)
    tables = []
    for _ in range(batch):
        tables.append(PageTable(PAGE))
        tables[-1].reserve(pool, n + 1 + args.tree_nodes)
        prompt = torch.randint(0, cfg.vocab_size, (n,))
        runner.forward(ForwardBatch(prompt, torch.arange(n), [SeqAttention(tables[-1], n, n)],
                                    [n - 1]))
    decode = ForwardBatch(torch.full((batch,), 7), torch.full((batch,), n),
                          [SeqAttention(t, n + 1, 1) for t in tables], list(range(batch)))
    parents = TREE_PARENTS.get(args.tree_nodes) or [0] * args.tree_nodes
    nodes = len(parents)
    verify = ForwardBatch(torch.randint(0, cfg.vocab_size, (batch * (nodes + 1),)),
                          positions(parents, n).repeat(batch),
                          [SeqAttention(t, n + 1 + nodes, nodes + 1, tree=ancestor_mask(parents))
                           for t in tables], list(range(batch * (nodes + 1))))
    calls = {"decode": decode, "verify": verify}
    if prompt_len:  # a prompt arriving while the batch decodes: one pass for both
        fresh = PageTable(PAGE)
        fresh.reserve(pool, prompt_len)
        calls["mixed"] = ForwardBatch(
            torch.cat((torch.randint(0, cfg.vocab_size, (prompt_len,)), decode.ids)),
            torch.cat((torch.arange(prompt_len), decode.positions)),
            [SeqAttention(fresh, prompt_len, prompt_len), *decode.attn],
            [prompt_len - 1, *range(prompt_len, prompt_len + batch)])
    params = sum(p.numel() for p in model.parameters())
    result = {"parameters": params, "backend": name, "graphs": graphs is not None,
              "floor_ms": 1000 * params * torch.empty((), dtype=dtype).element_size()
              / (BANDWIDTH_TB_S * 1e12)}
    # With graphs, the eager calls too (suffix _eager); with --torch-ops-too, graphs of the
    # model with torch's norms/rotary/activation/projections instead of the Triton kernels.
    engines = [("", graphs), ("_eager", None)] if graphs is not None else [("", None)]
    if args.torch_ops_too and graphs is not None:
        engines.append(("_torch_ops", None))
    for suffix, runner.graphs in engines:
        if suffix == "_torch_ops":
            use_fused_kernels(model, False)
            runner.graphs = capture_graphs(model, cache, shape, pool, args)
        for key, call in calls.items():
            name_ms = f"{key}{suffix}_ms"
            # the first call on its own: what the first request pays (a graph's first replay)
            result[f"{key}{suffix}_first_ms"] = timed(lambda c=call: runner.forward(c), 0, 1,
                                                      args.device)[0]
            result[name_ms] = timed(lambda c=call: runner.forward(c), args.warmup, args.iters,
                                    args.device)
            result[f"{key}{suffix}_graphed"] = runner.last_graphed
            print(f"target {key}{suffix}: median {statistics.median(result[name_ms]):.3f} ms"
                  f"{' (graphs)' if runner.last_graphed else ''} (the first call "
                  f"{result[f'{key}{suffix}_first_ms']:.3f} ms)", flush=True)
            profiled(lambda c=call: runner.forward(c), PROFILE_CALLS, args.profile, f"{key}{suffix}",
                     args.device)
    if graphs is not None:  # the device's share: the decode graph replayed alone
        graph = graphs.graphs[graphs.plan(decode.attn, decode.logit_rows, ()).key].graph
        result["decode_replay_ms"] = timed(graph.replay, args.warmup, args.iters, args.device)
        print(f"target decode graph replay alone: median "
              f"{statistics.median(result['decode_replay_ms']):.3f} ms", flush=True)

        queued, launches = device_and_launch(graph, args)
        result["decode_replay_queued_ms"], result["decode_launch_ms"] = queued, launches
        print(f"target decode graph: {statistics.median(queued):.3f} ms a replay queued back to "
              f"back (the device's time), launch {statistics.median(launches):.3f} ms of host "
              "time", flush=True)
        # the served stack's forward_launch_s counts the same host work (and the engine's
        # inputs: its two tensors, a verify's positions and mask): ModelRunner.forward until
        # it returns, with the graphs
        runner.graphs = graphs  # (the loop above left the last engine's)
        for key in ("decode", "verify"):
            result[f"{key}_call_host_ms"] = host_ms(lambda c=calls[key]: runner.forward(c),
                                                    args.iters)
            if not runner.last_graphed:
                raise RuntimeError(f"the {key} call's host time was taken without its graph")
            print(f"target {key} call: {statistics.median(result[f'{key}_call_host_ms']):.3f} "
                  "ms of host time until it returns (the replay launched, not waited for)",
                  flush=True)
    return result


def draft_costs(cfg: Eagle3Config, target_layers: int, args: argparse.Namespace,
                dtype: torch.dtype) -> dict:
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head = random_module(head, dtype, args.device)
    if args.draft_quantize == "fp8":  # as the draft service's --quantize fp8
        quantize_projections(head)
    head.d2t.zero_()
    head.t2d.fill_(True)
    model = Eagle3Draft(head)
    layer = cfg.layer
    # Every call commits a token: the first, two timed rounds (graphed, then two-pass) and
    # the profile.
    calls = 1 + 2 * (args.warmup + args.iters) + PROFILE_CALLS
    pages = 2 * -(-(args.context + calls + 128) // PAGE)
    cache = KVCache(1, pages, PAGE, layer.num_kv_heads, layer.head_dim, dtype, args.device)
    shape = AttentionShape(layer.num_heads, layer.num_kv_heads, layer.head_dim, PAGE, dtype)
    name, _ = choose_backend(args.attention_backend, args.device, dtype)
    backend = make_backend(name, shape, args.device)
    if isinstance(backend, FlashInferBackend):
        backend.compile_kernels(masked=True)
    limits = DrafterLimits(max_running=4, max_context=args.context + calls + 64,
                           max_tree_nodes=64)
    pool = PagePool(pages)
    search = None
    if isinstance(backend, FlashInferBackend) and args.graphs:  # as the draft service's start-up
        search = TreeSearch(model, cache, prefix_attention_for(backend))
        search.capture(backend, (1,), [(args.topk, args.depth)], pool.allocate(1)[0],
                       limits.max_context)
    drafter = Drafter(model, cache, pool, backend, limits, search)
    session = drafter.open_session()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, layer.vocab_size, (args.context,), generator=generator).tolist()
    tree = TreeShape(args.tree_nodes, args.topk, args.depth)
    drafter.draft(session, [warmup_inputs(model, 1, 0, tokens, TreeShape(0, 0, 0), generator)])
    # Each call's input, built before the timing: one more committed token with its features,
    # encoded as the target sends them (drawing and encoding them is the target's work, and
    # took about 45 us of each timed call on the H200 when it was done inside it).
    items = iter([warmup_inputs(model, 1, n, [n % layer.vocab_size], tree, generator)
                  for n in range(len(tokens), len(tokens) + calls)])

    def step() -> None:  # one more committed token (with its features), then a tree
        (result,) = drafter.draft(session, [next(items)])
        if result.error or result.tree.num_nodes != args.tree_nodes:
            raise RuntimeError(f"drafting failed: {result.error or result.tree}")

    first_ms = timed(step, 0, 1, args.device)[0]  # the search graph's first replay
    times = timed(step, args.warmup, args.iters, args.device)
    profiled(step, PROFILE_CALLS, args.profile, "draft", args.device)
    print(f"draft tree ({args.tree_nodes}/{args.topk}/{args.depth}): median "
          f"{statistics.median(times):.3f} ms (the first call {first_ms:.3f} ms)", flush=True)
    result = {"backend": name, "draft_ms": times, "draft_first_ms": first_ms,
              "target_layers": target_layers,
              "draft_graphs": search is not None,
              "quantize": args.draft_quantize, "floor_ms": draft_floor_ms(cfg, args.depth, dtype),
              "floor_fp8_ms": draft_floor_ms(cfg, args.depth, dtype, fp8=True)}
    if search is not None:  # the catch-up-and-search graph replayed alone, then the same
        # calls with the catch-up run eagerly before the search
        (caught_up,) = search.caught_up.values()  # one bucket, one tree shape
        result["draft_replay_ms"] = timed(caught_up.graph.replay, args.warmup, args.iters,
                                          args.device)
        print(f"draft graph replay alone: median {statistics.median(result['draft_replay_ms']):.3f}"
              " ms (the call less this is its host work and copies)", flush=True)
        queued, launches = device_and_launch(caught_up.graph, args)
        result["draft_replay_queued_ms"], result["draft_launch_ms"] = queued, launches
        floor = (f"fp8 floor {result['floor_fp8_ms']:.3f} ms" if args.draft_quantize == "fp8"
                 else f"floor {result['floor_ms']:.3f} ms")
        print(f"draft graph (catch-up and search): {statistics.median(queued):.3f} ms a replay "
              f"queued back to back (the device's time; {floor}), "
              f"launch {statistics.median(launches):.3f} ms of host time", flush=True)
        search.caught_up.clear()
        result["draft_two_pass_ms"] = timed(step, args.warmup, args.iters, args.device)
        print(f"draft tree, catch-up first (eager): median "
              f"{statistics.median(result['draft_two_pass_ms']):.3f} ms", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["8b", "builtin", "bench"], default="8b",
                        help="8b: Llama-3.1-8B shape; builtin: the built-in pair's shape; bench: "
                             "the trained benchmark pair's (169M target, 41M head)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--context", type=int, default=512, help="tokens before the timed steps")
    parser.add_argument("--batch", type=int, default=1, help="sequences per target call (the "
                        "draft is timed at batch 1 only, so not at all when this is > 1)")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="also time a mixed call: "
                        "a prompt of this many tokens prefilled in the same pass as the batch's "
                        "decode (with graphs: one graph, the prompt bucket's rows, then the decode rows)")
    parser.add_argument("--tree-nodes", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out-json", type=Path)
    parser.add_argument("--draft-quantize", choices=["none", "fp8"], default="none",
                        help="the head's projections as the draft service's --quantize")
    parser.add_argument("--torch-top-k", action="store_true", help="the draft's top k through "
                        "torch's log_softmax and topk instead of splitspec/kernels/top_logprobs.py "
                        "(top_logprobs.ROUTED off), as before the H200 measured the kernels")
    parser.add_argument("--torch-ops-too", action="store_true", help="also time the target "
                        "with torch's norms/rotary/activation/projections (graphs recaptured)")
    parser.add_argument("--profile", type=Path, help="write torch.profiler tables of each call "
                        "here (5 calls each, after the timing); the profiler slows what is timed after it "
                        "(on the H200 the 8B decode graph replayed alone took 5.20 instead of 4.75 "
                        "ms), so take the timings from a run without it")
    args = parser.parse_args()
    if args.torch_top_k:  # the draft's fused kernels (CUDA) then leave them to torch
        from splitspec.kernels import top_logprobs

        top_logprobs.ROUTED = False
    dtype = parse_dtype(args.dtype)
    target_hf, eagle_hf = configs(args.shape)
    target_cfg = LlamaConfig.from_hf(target_hf)
    with torch.inference_mode():
        result = {"command": " ".join(sys.argv), "label": f"{args.shape} shape, RANDOM weights",
                  "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
                  else args.device, "context": args.context, "batch": args.batch,
                  "prompt_tokens": args.prompt_tokens, "torch_top_k": args.torch_top_k,
                  "tree": [args.tree_nodes, args.topk, args.depth],
                  "target": target_costs(target_cfg, args, dtype)}
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if args.batch == 1:
            result["draft"] = draft_costs(Eagle3Config.from_hf(eagle_hf), target_cfg.num_layers,
                                          args, dtype)
    decode = statistics.median(result["target"]["decode_ms"])
    result["summary"] = {
        "decode_ms": decode, "floor_ms": result["target"]["floor_ms"],
        "share_of_floor_speed": result["target"]["floor_ms"] / decode,
        "verify_over_decode": statistics.median(result["target"]["verify_ms"]) / decode}
    if "draft" in result:
        draft = result["draft"]
        result["summary"]["draft_over_decode"] = statistics.median(draft["draft_ms"]) / decode
        result["summary"]["draft_floor_ms"] = draft["floor_ms"]
        result["summary"]["draft_floor_over_decode"] = draft["floor_ms"] / decode
        result["summary"]["draft_quantize"] = draft["quantize"]
        result["summary"]["draft_floor_fp8_over_decode"] = draft["floor_fp8_ms"] / decode
        if "draft_replay_queued_ms" in draft:
            result["summary"]["draft_graph_ms"] = statistics.median(
                draft["draft_replay_queued_ms"])
    for key in ("mixed", "mixed_eager", "verify_eager", "decode_eager"):
        if f"{key}_ms" in result["target"]:
            result["summary"][f"{key}_ms"] = statistics.median(result["target"][f"{key}_ms"])
    if "decode_torch_ops_ms" in result["target"]:
        result["summary"]["decode_torch_ops_over_decode"] = statistics.median(
            result["target"]["decode_torch_ops_ms"]) / decode
    print(json.dumps(result["summary"], indent=1))
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
