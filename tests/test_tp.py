"""Tensor parallelism on CPU (gloo): shards, exactness against one rank, and rank faults.

- The sharded model (2 and 4 ranks, KV heads split or replicated) computes the
  logits of the whole model, and each rank loads only its shard.
- Rank 0's calls (a forward with causal, tree and dense-mask rows, a KV copy,
  stop) come out of their packed words as they went in, and reach rank 1 over
  gloo, one larger than the fixed buffer too.
- The target service with --tp 2 gives greedy output identical to --tp 1,
  speculation ON and OFF; under torchrun it serves, with rank 1's report.
- A fault injected on rank 1 only, at every init step, fails start-up within
  seconds, naming rank 1 and the step, with every process gone.
- Rank 1 killed mid-generation: the streams in flight end with UNAVAILABLE,
  the target exits, nothing is left running, and the gateway recovers when a
  new target comes up.
- On GPUs (marked): TP=2 and TP=4 over NCCL against TP=1 in bf16, every rank
  replaying the same graphs, where every output that leaves TP=1's must do so
  at a near tie of the float32 model (on CPU: that this score tells a near tie
  from a flip where the model is sure); a capture fault on the last rank only
  fails start-up naming it.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitspec.attention import TorchAttentionBackend
from splitspec.attention.base import SeqAttention
from splitspec.builtin import BUILTIN_TARGET
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.model.config import LlamaConfig, read_hf_config
from splitspec.model.layers import AttentionContext
from splitspec.model.loader import load_llama
from splitspec.model.parallel import SINGLE, TPGroup, tp_error
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import calls
from target_service.calls import ForwardBatch
from tests.stack import Service, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_tp

PROMPT_IDS = list(range(5, 45))


# ---- the sharded model --------------------------------------------------------------------


def logits_of(tp: TPGroup, ids: list[int]) -> tuple[torch.Tensor, dict[str, tuple[int, ...]]]:
    """The model's logits over ids (one prefill), and its parameter shapes on this rank."""
    model = load_llama(BUILTIN_TARGET, torch.float32, "cpu", tp)
    attn = model.model.layers[0].self_attn
    cache = KVCache(model.config.num_layers, 8, 16, attn.num_kv_heads, attn.head_dim,
                    torch.float32, "cpu")
    table = PageTable(16)
    table.reserve(PagePool(8), len(ids))
    backend = TorchAttentionBackend()
    meta = backend.plan([SeqAttention(table, kv_len=len(ids), q_len=len(ids))], "cpu")
    with torch.inference_mode():
        out = model(torch.tensor(ids), torch.arange(len(ids)), AttentionContext(backend, meta, cache))
        logits = model.compute_logits(out.hidden)
    return logits, {name: tuple(p.shape) for name, p in model.named_parameters()}


def _rank(rank: int, size: int, address: str, out: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size)
    try:
        logits, shapes = logits_of(TPGroup(rank, size, dist.group.WORLD), PROMPT_IDS)
        out.put((rank, logits.numpy().copy(), shapes))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_model_computes_the_whole_models_logits(size):
    reference, full = logits_of(SINGLE, PROMPT_IDS)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, size, address, out)) for r in range(size)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in range(size):
        rank, logits, shapes = out.get(timeout=120)
        results[rank] = (torch.from_numpy(logits), shapes)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    cfg = LlamaConfig.from_hf(read_hf_config(BUILTIN_TARGET))
    hd = cfg.head_dim
    for logits, shapes in results.values():
        # float32 summed in other orders: TP=2 differs from TP=1 by 1.2e-5 in most runs, but
        # in about one run in twenty by up to 4e-4 in some rows (logits up to 13; both ranks
        # alike; different rows each time: the CPU BLAS's own choices), which failed CI at
        # atol 1e-4. A wrong shard is off by whole units, and moves the argmax (top-2 gap 0.11)
        torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))
        # Only the shard is held: heads, KV heads (replicated past their count), MLP, vocab.
        layer = "model.layers.0."
        assert shapes[layer + "self_attn.q_proj.weight"] == (cfg.num_heads // size * hd,
                                                            cfg.hidden_size)
        assert shapes[layer + "self_attn.k_proj.weight"] == (
            max(cfg.num_kv_heads // size, 1) * hd, cfg.hidden_size)
        assert shapes[layer + "mlp.down_proj.weight"] == (cfg.hidden_size,
                                                         cfg.intermediate_size // size)
        assert shapes["model.embed_tokens.weight"] == (cfg.vocab_size // size, cfg.hidden_size)
        assert shapes["lm_head.weight"][0] == cfg.vocab_size // size
        assert sum(map(_numel, shapes.values())) < sum(map(_numel, full.values()))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_sizes_that_do_not_divide_the_heads_are_refused():
    cfg = LlamaConfig.from_hf(read_hf_config(BUILTIN_TARGET))  # 4 heads, 2 KV heads
    assert tp_error(cfg, 1) is None and tp_error(cfg, 2) is None and tp_error(cfg, 4) is None
    assert "does not divide the 4 attention heads" in tp_error(cfg, 3)
    assert "[1, 2, 4]" in tp_error(cfg, 3)


# ---- rank 0's calls -----------------------------------------------------------------------


def sample_calls(pages_each: int = 3) -> list[tuple[str, object]]:
    """A forward with a prompt (causal), a verify row (tree) and a dense mask; a KV copy; stop."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    attn = [SeqAttention(PageTable(16, list(range(pages_each)), 5), kv_len=5, q_len=5),
            SeqAttention(PageTable(16, [7, 3], 20), kv_len=23, q_len=3, tree=tree),
            SeqAttention(PageTable(16, [9], 4), kv_len=4, q_len=2, mask=mask)]
    batch = ForwardBatch(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14]),
                         torch.tensor([0, 1, 2, 3, 4, 20, 21, 21, 2, 3]), attn,
                         [4, 5, 6, 7, 8, 9], (2, 3, 3))
    return [("forward", batch), ("copy_slots", (torch.tensor([3, 4]), torch.tensor([1, 2]))),
            ("stop", None)]


def assert_same_call(got: tuple[str, object], want: tuple[str, object]) -> None:
    assert got[0] == want[0]
    if want[0] == "forward":
        a, b = got[1], want[1]
        assert torch.equal(a.ids, b.ids) and torch.equal(a.positions, b.positions)
        assert (a.logit_rows, a.capture) == (b.logit_rows, b.capture)
        assert len(a.attn) == len(b.attn)
        for x, y in zip(a.attn, b.attn, strict=True):
            assert (x.table, x.kv_len, x.q_len) == (y.table, y.kv_len, y.q_len)
            for m, n in ((x.mask, y.mask), (x.tree, y.tree)):
                assert (m is None and n is None) or (m.dtype == torch.bool and torch.equal(m, n))
    elif want[0] == "copy_slots":
        assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))
    else:
        assert got[1] is None


def test_calls_round_trip_through_their_words():
    for call in sample_calls():
        assert_same_call(calls.decode(calls.encode(*call)), call)
    words = calls.encode(*sample_calls()[0])
    with pytest.raises(ValueError, match="decoded as"):
        calls.decode([words[0] + 1, *words[1:]])


def _receive_calls(rank: int, address: str, count: int, out: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
    try:
        channel = calls.CallChannel(dist.group.WORLD)
        if rank == 0:
            for call in [*sample_calls(), *sample_calls(pages_each=calls.CAPACITY)][:count]:
                channel.send(*call)
        else:  # pickled here: a tensor put as it is travels as a file descriptor that this
            # process must still hold when the test reads it, and it may have exited by then
            for _ in range(count):
                out.put(pickle.dumps(channel.receive()))
        dist.barrier()  # rank 0 must not close its sockets before rank 1 has read every call
    finally:
        dist.destroy_process_group()


def test_calls_reach_the_other_rank_whatever_their_size():
    """Over gloo: calls that fit the buffer, and a forward larger than it (two broadcasts)."""
    want = [*sample_calls(), *sample_calls(pages_each=calls.CAPACITY)][:4]
    assert len(calls.encode(*want[3])) > calls.CAPACITY >= len(calls.encode(*want[0]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_receive_calls, args=(r, address, len(want), out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    got = [pickle.loads(out.get(timeout=60)) for _ in want]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    for g, w in zip(got, want, strict=True):
        assert_same_call(g, w)


# ---- the service --------------------------------------------------------------------------

NEW_TOKENS = 20
TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n",
         "for i in range(10):\n    print(", "with open(path) as f:\n", "raise ValueError(\"",
         "from collections import ", "while True:\n    line = "]


def tagged_env(tag: str) -> dict[str, str]:
    """An environment variable every process of one target (and its ranks) inherits."""
    return {"SPLITSPEC_TEST_TAG": tag}


def processes_tagged(tag: str) -> list[int]:
    """Live processes whose environment holds the tag."""
    pids = []
    needle = f"SPLITSPEC_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended while we looked, or a process this user may not inspect (not ours)
        if needle in environ.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def generate_on_target(address: str, prompts: list[list[int]], mode: int) -> list[list[int]]:
    """Greedy continuations through the target's Serve stream, all prompts at once."""
    return bench_tp.serve(address, prompts, NEW_TOKENS, mode)[0]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    service = Service("draft_service", [], tmp_path_factory.mktemp("tp-draft")).wait_serving()
    yield service
    service.stop()


@pytest.mark.slow
def test_tp2_greedy_output_equals_tp1_with_and_without_speculation(draft, tmp_path):
    prompts = [load_tokenizer(BUILTIN_TARGET).encode(t) for t in TEXTS]
    outputs = {}
    for tp in (1, 2):
        report = tmp_path / f"tp{tp}.json"
        target = Service("target_service", ["--draft", draft.address, "--tp", str(tp),
                                            "--init-report", str(report)], tmp_path)
        try:
            target.wait_serving(120)
            for mode in (common_pb2.SPECULATION_MODE_OFF, common_pb2.SPECULATION_MODE_ON):
                outputs[tp, mode] = generate_on_target(target.address, prompts, mode)
        finally:
            target.stop()
        data = json.loads(report.read_text())
        assert data["ok"] and [r["rank"] for r in data["ranks"]] == list(range(1, tp))
    reference = outputs[1, common_pb2.SPECULATION_MODE_OFF]
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    for key, tokens in outputs.items():
        assert tokens == reference, key


STEPS = ["load_config", "bind_port", "init_distributed", "load_model", "allocate_kv_cache",
         "init_attention_backend", "connect_draft", "capture_cuda_graphs", "warmup",
         "start_server"]


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_fault_on_rank_1_fails_startup_naming_rank_and_step(step, tmp_path):
    assert_fault_fails_startup(step, 1, ["--tp", "2"], tmp_path)


def assert_fault_fails_startup(step: str, rank: int, args: list[str], tmp_path: Path) -> None:
    """A fault injected at step on one rank only: the target exits within seconds, never
    SERVING, its report and log name that rank and step, and no process is left."""
    tag = uuid.uuid4().hex
    report_path = tmp_path / "report.json"
    started = time.monotonic()
    target = Service("target_service", [*args, "--init-report", str(report_path)], tmp_path,
                     env={"SPLITSPEC_INJECT_INIT_FAULT": f"{step}@{rank}", **tagged_env(tag)})
    code, seen = target.wait_exit(timeout_s=60)
    elapsed = time.monotonic() - started
    assert code != 0, target.log
    assert 1 not in seen  # health never said SERVING
    report = json.loads(report_path.read_text())
    assert not report["ok"]
    ours = [r for r in report["ranks"] if r["rank"] == rank]
    assert ours, report
    failed = [s for s in ours[0]["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == [step], ours
    assert failed[0]["error_type"] == "InjectedFault"
    assert f"target rank {rank} failed to start at step '{step}'" in target.log
    assert elapsed < 45, f"start-up took {elapsed:.0f}s to fail"
    deadline = time.monotonic() + 5
    while processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_tagged(tag) == [], "a rank outlived the failed start-up"


@pytest.mark.slow
def test_rank_killed_mid_generation(draft, tmp_path):
    """Every stream in flight ends with UNAVAILABLE naming the dead rank, the target exits,
    no rank is left, and the gateway serves again once a new target is up."""
    tag = uuid.uuid4().hex
    port = free_port()
    target = Service("target_service", ["--draft", draft.address, "--tp", "2"], tmp_path,
                     env=tagged_env(tag), port=port).wait_serving(120)
    gateway = Service("gateway", ["--target", target.address], tmp_path).wait_serving(120)
    try:
        ranks = [pid for pid in processes_tagged(tag)
                 if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1, ranks  # rank 1 (the other spawned one is the resource tracker)
        prompt = load_tokenizer(BUILTIN_TARGET).encode(TEXTS[0])
        requests: queue.Queue = queue.Queue()
        for i in range(4):
            requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=i, prompt_ids=prompt, max_new_tokens=400, ignore_eos=True)))
        with grpc.insecure_channel(target.address) as channel:
            call = target_pb2_grpc.TargetStub(channel).Serve(iter(requests.get, None), timeout=60)
            first = next(call)  # generation is under way
            assert first.deltas
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            requests.put(None)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "rank 1" in err.value.details()
        code, _ = target.wait_exit(timeout_s=30)
        assert code != 0
        assert time.monotonic() - killed < 20
        deadline = time.monotonic() + 5
        while processes_tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_tagged(tag) == []
        # The gateway says it cannot serve, then recovers with a new target on the same port.
        deadline = time.monotonic() + 15
        while gateway.health() == 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gateway.health() != 1
        target = Service("target_service", ["--draft", draft.address, "--tp", "2"], tmp_path,
                         port=port).wait_serving(120)
        gateway.wait_serving(60)
        with grpc.insecure_channel(gateway.address) as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                text=TEXTS[1], stopping=gateway_pb2.StoppingParams(max_new_tokens=8,
                                                                   ignore_eos=True)), timeout=60)
        assert reply.usage.completion_tokens == 8
    finally:
        gateway.stop()
        target.stop()


# ---- on GPUs: NCCL, bf16 ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_nccl_tp_greedy_agrees_with_one_rank(size, tmp_path):
    """bench/bench_tp.py's agreement run: TP=size against TP=1, bf16, speculation OFF and ON,
    every rank replaying its CUDA graphs (NCCL collectives captured in them).
    Sums reordered across ranks can flip a near-tie in bf16, after which greedy text
    diverges, so the text need not be identical (the CPU test above is exact): every output
    must leave TP=1's only where the float32 model finds the two tokens within bf16's error."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, "bench/bench_tp.py", "--tp", f"1,{size}", "--device", "cuda",
                    "--dtype", "bfloat16", "--skip-timing", "--out-json", str(out)],
                   cwd=Path(__file__).resolve().parent.parent, check=True, timeout=900)
    result = json.loads(out.read_text())
    # Every rank captured the same step graphs (a rank left eager would still agree, slowly).
    details = result["graphs"][f"tp{size}"]
    assert len(details) == size and details[0].split()[0].isdigit(), details
    assert len({d.rsplit(" in ", 1)[0] for d in details}) == 1, details  # all but the seconds
    runs = result["agreement"]
    assert runs["tp1 OFF"]["identical_tokens"] == 1.0
    for mode in ("OFF", "ON"):
        run = runs[f"tp{size} {mode}"]
        assert run["max_margin"] < bench_tp.NEAR_TIE, run["divergences"]


def test_divergences_are_scored_by_the_float32_model():
    """The check above has teeth: the float32 oracle's greedy text against itself has no
    divergence, a flip to the runner-up at its closest call is a near tie, and a flip where
    it is sure is not."""
    oracle = bench_tp.float32_oracle(BUILTIN_TARGET)
    prompts = [load_tokenizer(BUILTIN_TARGET).encode(t) for t in TEXTS[:4]]
    reference, gaps = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(12):
                top = oracle(torch.tensor([ids])).logits[0, -1].topk(2)
                gaps.append((float(top.values[0] - top.values[1]), len(reference), len(ids) - len(prompt),
                             int(top.indices[1])))
                ids.append(int(top.indices[0]))
            reference.append(ids[len(prompt):])
    assert bench_tp.first_divergences(prompts, reference, reference, oracle) == []
    for gap, row, at, runner_up in (min(gaps), max(gaps)):
        out = [list(r) for r in reference]
        out[row][at] = runner_up
        (found,) = bench_tp.first_divergences(prompts, out, reference, oracle)
        assert (found["prompt"], found["position"], found["output"]) == (row, at, runner_up)
        assert found["margin"] == pytest.approx(gap, abs=1e-4)
        assert (abs(found["margin"]) < bench_tp.NEAR_TIE) == (gap < bench_tp.NEAR_TIE)
    assert min(gaps)[0] < bench_tp.NEAR_TIE < max(gaps)[0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_nccl_capture_fault_on_the_last_rank_fails_startup(size, tmp_path):
    """The seed's bug on N GPUs: graph capture fails on one rank while the others capture
    theirs (and then wait in a collective for it). The service must not start."""
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    assert_fault_fails_startup("capture_cuda_graphs", size - 1,
                               ["--tp", str(size), "--device", "cuda", "--dtype", "bfloat16"],
                               tmp_path)


@pytest.mark.slow
def test_runs_under_torchrun(tmp_path):
    """torchrun starts the ranks: rank 0 serves, gathers rank 1's report, and generates."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitspec.v1 import common_pb2 as common

    port = free_port()
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "target_service", "--port", str(port)],
        cwd=Path(__file__).resolve().parent.parent, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(address) as channel:
            while True:
                assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=1).status
                except grpc.RpcError:  # not listening yet
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
                time.sleep(0.2)
            stub = target_pb2_grpc.TargetStub(channel)
            assert stub.GetInfo(target_pb2.GetTargetInfoRequest(), timeout=5).tp_size == 2
            report = stub.GetInitReport(common.GetInitReportRequest(), timeout=5)
            assert report.ok and [r.rank for r in report.ranks] == [1]
        prompt = load_tokenizer(BUILTIN_TARGET).encode(TEXTS[0])
        (tokens,) = generate_on_target(address, [prompt], common.SPECULATION_MODE_OFF)
        assert len(tokens) == NEW_TOKENS
        # SIGTERM with a generation in flight: torchrun passes it to both ranks; rank 1 leaves
        # it to rank 0, which drains (the generation gets every token), then stops rank 1
        outcome: list[object] = []

        def long_generation() -> None:
            try:
                outcome.append(bench_tp.serve(address, [prompt], 300,
                                              common.SPECULATION_MODE_OFF)[0][0])
            except (grpc.RpcError, RuntimeError) as exc:  # the stream cut: the test fails below
                outcome.append(exc)

        generating = threading.Thread(target=long_generation)
        generating.start()
        time.sleep(0.5)
        proc.terminate()
        generating.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], list), outcome
        assert len(outcome[0]) == 300
        proc.wait(30)
        assert "the requests in flight finished" in (tmp_path / "torchrun.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
