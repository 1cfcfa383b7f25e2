"""The whole stack as real processes: exactness of speculative decoding, bad input, faults.

Greedy output with speculation ON (EAGLE-3 and standalone drafts, tree and
chain) must be token-for-token what the target alone produces, which must be
what transformers' own greedy generate produces on the same checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import pstats
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from transformers import LlamaForCausalLM

from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_TARGET
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.stack import Service

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPTS = [
    "def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n",
    "for i in range(10):\n    print(", "def parse_args(argv=None):\n", "with open(path) as f:\n",
    "try:\n    import json\nexcept ImportError:\n", "def __repr__(self):\n    return f\"",
    "    @property\n    def name(self):\n", "if __name__ == \"__main__\":\n    main()\n",
    "x = [i * i for i in range(", "raise ValueError(\"", "from collections import ",
    "async def fetch(url):\n", "lambda x: x + 1", "return {k: v for k, v in ",
    "assert isinstance(obj, ", "self.assertEqual(", "while True:\n    line = ",
    "# Copyright (c) 2024\n\"\"\"Utilities for",
]
ON, OFF = common_pb2.SPECULATION_MODE_ON, common_pb2.SPECULATION_MODE_OFF
TREE = ["--num-draft-tokens", "8", "--topk", "4", "--num-steps", "4"]
CHAIN = ["--num-draft-tokens", "4", "--topk", "1", "--num-steps", "4"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUILTIN_TARGET)


@pytest.fixture(scope="module")
def reference(tokenizer):
    """transformers' greedy continuation of every prompt (float32, CPU)."""
    model = LlamaForCausalLM.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()
    out = {}
    for text in PROMPTS:
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=1)
        out[text] = gen[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


def start_stack(logs, draft_args, target_args=(), gateway_args=()):
    services = []
    try:
        draft = Service("draft_service", list(draft_args), logs).wait_serving()
        services.append(draft)
        target = Service("target_service", ["--draft", draft.address, *target_args], logs)
        services.append(target.wait_serving())
        gateway = Service("gateway", ["--target", target.address, *gateway_args], logs)
        services.append(gateway.wait_serving())
    except BaseException:
        for service in services:
            service.stop()
        raise
    return services


@pytest.fixture(scope="module")
def eagle_stack(logs):
    services = start_stack(logs, [], gateway_args=TREE)
    yield services
    for service in reversed(services):
        service.stop()


@pytest.fixture(scope="module")
def standalone_stack(logs):
    services = start_stack(logs, ["--model", str(BUILTIN_DRAFT)], gateway_args=TREE)
    yield services
    for service in reversed(services):
        service.stop()


def gateway_stub(service: Service) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(service.address))


def generate(stub, text, mode, max_new=NEW_TOKENS, **stopping):
    return stub.Generate(gateway_pb2.GenerateRequest(
        text=text, speculation=mode, include_token_ids=True,
        stopping=gateway_pb2.StoppingParams(max_new_tokens=max_new, ignore_eos=True, **stopping)),
        timeout=120)


def generate_all(stub, mode, concurrency=20):
    with cf.ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda t: generate(stub, t, mode), PROMPTS))
    return {t: list(r.token_ids) for t, r in zip(PROMPTS, replies, strict=True)}, replies


def add_chain_gateway(stack, logs):
    target = stack[1]
    return Service("gateway", ["--target", target.address, *CHAIN], logs).wait_serving()


@pytest.mark.parametrize("stack_name", ["eagle_stack", "standalone_stack"])
def test_speculation_is_exact_tree_and_chain_concurrently(stack_name, request, reference, logs):
    stack = request.getfixturevalue(stack_name)
    tree_stub = gateway_stub(stack[2])
    off, _ = generate_all(tree_stub, OFF)
    assert off == reference, "plain decoding through the stack differs from transformers"
    on, replies = generate_all(tree_stub, ON)
    assert on == reference
    assert sum(r.spec.verify_steps for r in replies) > 0, "no tree was ever verified"
    assert all(r.spec.drafted_tokens >= r.spec.verify_steps for r in replies)
    chain = add_chain_gateway(stack, logs)
    try:
        chained, replies = generate_all(gateway_stub(chain), ON)
    finally:
        chain.stop()
    assert chained == reference
    assert sum(r.spec.verify_steps for r in replies) > 0


def test_self_draft_accepts_everything(logs, reference):
    """A draft that is the target itself: every drafted token is accepted, output unchanged."""
    stack = start_stack(logs, ["--model", str(BUILTIN_TARGET)], gateway_args=CHAIN)
    try:
        with grpc.insecure_channel(stack[0].address) as channel:
            draft = draft_pb2_grpc.DraftStub(channel)
            before = draft.GetStatus(draft_pb2.GetDraftStatusRequest(), timeout=10).spec
            on, replies = generate_all(gateway_stub(stack[2]), ON, concurrency=16)
            after = draft.GetStatus(draft_pb2.GetDraftStatusRequest(), timeout=10).spec
    finally:
        for service in reversed(stack):
            service.stop()
    assert on == reference
    total = sum(r.spec.accepted_tokens for r in replies)
    assert total == sum(r.spec.drafted_tokens for r in replies) > 0
    assert all(r.spec.mean_accepted_length > 3.0 for r in replies)
    # The draft's own view (warmup's trees excluded): every chain it sent was committed in full.
    drafted = after.drafted_tokens - before.drafted_tokens
    assert after.accepted_tokens - before.accepted_tokens == drafted > 0


def test_fp8_draft_is_exact_and_still_accepts(logs, reference):
    """--quantize fp8 (the head's six projections in fp8; on CPU through torch's path): the
    output is still the target's alone, and the trees are still accepted (on this pair,
    2.45 per verify step against 2.43 unquantized: docs/benchmarks.md)."""
    stack = start_stack(logs, ["--quantize", "fp8"], gateway_args=TREE)
    try:
        on, replies = generate_all(gateway_stub(stack[2]), ON)
        log = stack[0].log
    finally:
        for service in reversed(stack):
            service.stop()
    assert on == reference
    assert "6 projections also in fp8" in log
    verify = sum(r.spec.verify_steps for r in replies)
    assert sum(r.spec.accepted_tokens for r in replies) / verify > 1.5


BAD_INPUTS = [
    (gateway_pb2.GenerateRequest(), "input"),
    (gateway_pb2.GenerateRequest(text=""), "empty"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5, 99999])), "99999"),
    (gateway_pb2.GenerateRequest(text="x " * 2000), "context"),
    (gateway_pb2.GenerateRequest(text="hi", stopping=gateway_pb2.StoppingParams(max_new_tokens=0)),
     "max_new_tokens"),
    (gateway_pb2.GenerateRequest(text="hi", stopping=gateway_pb2.StoppingParams(
        max_new_tokens=10**9)), "max_new_tokens"),
    (gateway_pb2.GenerateRequest(text="hi", speculation=7), "speculation"),
    (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(top_p=1.5)),
     "top_p"),
]


def test_bad_input_is_invalid_argument_and_gateway_keeps_serving(eagle_stack, reference):
    stub = gateway_stub(eagle_stack[2])
    for request, needle in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, info.value)
        assert needle in info.value.details(), (needle, info.value.details())
    text = PROMPTS[0]
    assert list(generate(stub, text, ON).token_ids) == reference[text]


def test_stream_stop_string_and_status(eagle_stack, reference, tokenizer):
    stub = gateway_stub(eagle_stack[2])
    text = PROMPTS[1]
    full = tokenizer.decode(reference[text])
    stop = full[len(full) // 2: len(full) // 2 + 3]
    chunks = list(stub.GenerateStream(gateway_pb2.GenerateRequest(
        text=text, speculation=ON, stopping=gateway_pb2.StoppingParams(
            max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop])), timeout=60))
    streamed = "".join(c.text for c in chunks)
    assert streamed == full[: full.index(stop)]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    status = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
    assert status.gateway.ok and status.target.ok and status.draft.ok
    assert status.running == 0 and status.queued == 0
    assert status.spec.verify_steps > 0


def test_every_service_serves_health_and_reflection(eagle_stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {"draft_service": "splitspec.v1.Draft", "target_service": "splitspec.v1.Target",
                "gateway": "splitspec.v1.Gateway"}
    for service in eagle_stack:
        assert service.health() == 1  # SERVING
        with grpc.insecure_channel(service.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = {s.name for r in replies for s in r.list_services_response.service}
        assert {expected[service.module], "grpc.health.v1.Health"} <= names, names


def test_malformed_trees_are_rejected_and_output_unchanged(logs, reference):
    """The draft corrupts every other tree: those steps decode plainly, output unchanged."""
    draft = Service("draft_service", [], logs,
                    env={"SPLITSPEC_INJECT_DRAFT_FAULT": "malformed_tree"}).wait_serving()
    target = gateway = None
    try:
        target = Service("target_service", ["--draft", draft.address], logs).wait_serving()
        gateway = Service("gateway", ["--target", target.address, *TREE], logs).wait_serving()
        on, replies = generate_all(gateway_stub(gateway), ON, concurrency=4)
    finally:
        for service in (gateway, target, draft):
            if service is not None:
                service.stop()
    assert on == reference
    assert sum(r.spec.rejected_trees for r in replies) > 0
    assert sum(r.spec.verify_steps for r in replies) > 0
    assert "rejected draft tree" in target.log


def test_client_going_away_frees_its_cache(logs):
    """The cache holds one long request at a time: after the first client goes away
    mid-stream, the second request must get its pages and finish."""
    stack = start_stack(logs, [], target_args=["--max-context", "256", "--num-pages", "20"],
                        gateway_args=TREE)
    try:
        stub = gateway_stub(stack[2])
        long_request = gateway_pb2.GenerateRequest(
            text="def main():\n", speculation=ON,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=150, ignore_eos=True))
        call = stub.GenerateStream(long_request, timeout=60)
        next(call)
        next(call)
        call.cancel()
        reply = stub.Generate(long_request, timeout=60)
        assert reply.usage.completion_tokens == 150
        status = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
        assert status.running == 0 and status.queued == 0
    finally:
        for service in reversed(stack):
            service.stop()


def test_trained_eagle3_head_reaches_minimum_acceptance_on_heldout_code(eagle_stack):
    """A broken head (or broken feature capture) fails here: held-out code, the live stack."""
    from splitspec.training import data

    heldout = data.split_corpus(data.collect_corpus([data.stdlib_source()],
                                                    show_progress=False)).heldout
    prompts = data.heldout_prompts(heldout, data.load_tokenizer(BUILTIN_TARGET), 6, 48)
    stub = gateway_stub(eagle_stack[2])
    verify = accepted = 0
    for prompt in prompts:
        reply = stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt.ids), speculation=ON,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=48, ignore_eos=True)), timeout=120)
        verify += reply.spec.verify_steps
        accepted += reply.spec.accepted_tokens
    # Measured 2.5 per verify step (docs/benchmarks.md); random weights give 0.
    assert accepted / verify > 1.5, (accepted, verify)


def test_seeded_sampling_reproduces_with_and_without_speculation(eagle_stack):
    stub = gateway_stub(eagle_stack[2])

    def sample(seed, mode=ON):
        return list(stub.Generate(gateway_pb2.GenerateRequest(
            text=PROMPTS[0], speculation=mode, include_token_ids=True,
            sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.95, seed=seed),
            stopping=gateway_pb2.StoppingParams(max_new_tokens=32, ignore_eos=True)),
            timeout=60).token_ids)

    # A seed fixes the draw at every position, so speculation cannot change the text.
    assert sample(7) == sample(7) == sample(7, OFF)
    assert len({tuple(sample(seed)) for seed in range(4)}) > 1


def test_sigterm_drains_the_target_the_stream_in_flight_finishes_new_requests_unavailable(logs):
    """The target alone restarted (docker compose restart target, a rollout): SIGTERM drains
    it. Its health and the gateway's turn NOT_SERVING, a request sent then gets UNAVAILABLE
    naming the stop (a client may try again), the stream in flight gets every token, and the
    target exits 0 once that stream has ended. Before, the stream was cut at once with UNAVAILABLE ("lost
    the target stream")."""
    stack = start_stack(logs, [], gateway_args=TREE)
    _, target, gateway = stack
    try:
        stub = gateway_stub(gateway)
        call = stub.GenerateStream(gateway_pb2.GenerateRequest(
            text=PROMPTS[0], speculation=OFF, include_token_ids=True,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=400, ignore_eos=True)),
            timeout=120)
        tokens = list(next(call).token_ids)
        target.proc.terminate()
        deadline = time.monotonic() + 10
        for service in (target, gateway):  # the gateway hears it from the target's stream
            while service.health() == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, f"{service.module} still SERVING"
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, PROMPTS[1], OFF, max_new=4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert "the target is stopping" in refused.value.details()
        chunks = list(call)
        tokens += [t for chunk in chunks for t in chunk.token_ids]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 400
        code, _ = target.wait_exit(timeout_s=30)
        assert code == 0, target.log
        assert "the requests in flight finished" in target.log
    finally:
        for service in stack:
            service.stop()


def test_the_target_writes_its_engine_threads_profile_when_it_stops(logs):
    """--profile-out: the engine thread runs under cProfile, and on a normal stop its
    statistics are written there, with the step's own functions in them."""
    out = logs / "engine.prof"
    stack = start_stack(logs, [], target_args=["--profile-out", str(out)], gateway_args=TREE)
    try:
        assert len(generate(gateway_stub(stack[2]), PROMPTS[0], ON, max_new=16).token_ids) == 16
    finally:
        for service in reversed(stack):
            service.stop()
    assert stack[1].proc.returncode == 0, stack[1].log
    functions = {(Path(file).as_posix(), name) for file, _, name in pstats.Stats(str(out)).stats}
    assert all(any(file.endswith("target_service/engine.py") and name == function
                   for file, name in functions) for function in ("step", "_forward", "_commit"))
    assert f"the engine thread's profile is in {out}" in stack[1].log


@pytest.mark.parametrize("first", ["target_service", "draft_service", "gateway"])
def test_each_service_stops_promptly_on_sigterm_with_its_streams_open(logs, first):
    """SIGTERM (docker compose stop, splitspec up's Ctrl-C) to one service of a live stack,
    its streams to the others still open: it exits 0 within seconds, and then so do the
    others. A handler thread still waiting for events of a stopped engine kept the target
    alive after its server stopped (the interpreter joins gRPC's worker threads at exit)."""
    stack = start_stack(logs, [], gateway_args=TREE)
    by_module = {service.module: service for service in stack}
    try:
        generate(gateway_stub(by_module["gateway"]), PROMPTS[0], ON)  # the streams in use
        order = [by_module[first], *(s for s in reversed(stack) if s.module != first)]
        for service in order:
            service.proc.terminate()
            code, _ = service.wait_exit(timeout_s=15)
            assert code == 0, f"{service.module} exited {code}:\n{service.log}"
    finally:
        for service in stack:
            service.stop()


def test_a_service_that_crashes_in_native_code_logs_every_threads_stack(logs):
    """SIGABRT (what a C++ std::terminate in gRPC or torch raises) to each service of a live
    stack: its log shows every thread's Python stack, the target's engine thread among them,
    not only the signal."""
    stack = start_stack(logs, [], gateway_args=TREE)
    try:
        generate(gateway_stub(stack[-1]), PROMPTS[0], ON)
        for service in reversed(stack):
            service.proc.send_signal(signal.SIGABRT)
            code, _ = service.wait_exit(timeout_s=15)
            assert code == -signal.SIGABRT, service.log
            log = service.log
            assert "Fatal Python error: Aborted" in log, log
            assert f"{service.module}/__main__.py" in log or "gateway/app.py" in log, log
            if service.module == "target_service":
                assert "target_service/engine.py" in log, log
    finally:
        for service in stack:
            service.stop()
