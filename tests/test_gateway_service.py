"""The gateway as a gRPC service in this process, in front of an in-process fake target:
start-up steps, generation, stop strings, cancellation, admission, stream loss."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import RunningGateway, start_gateway
from gateway.policy import OFF, static_policy
from gateway.target_client import TargetClient, connect_target
from splitspec.builtin import BUILTIN_TARGET
from splitspec.init_report import InitFailed, StepState
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2
from tests.fake_target import FakeTarget, serve_fake_target
from tests.stack import Service

pytestmark = pytest.mark.skipif(not (BUILTIN_TARGET / "tokenizer.json").is_file(),
                                reason="needs the built-in tokenizer")

SCRIPT = "Hello world! héllo 世界 🙂 STOP here, then more text follows."
STEPS = ["load_config", "load_tokenizer", "start_server", "connect_target", "open_stream", "warmup"]


@pytest.fixture
def fake() -> Iterator[tuple[FakeTarget, int]]:
    tokenizer = load_tokenizer(BUILTIN_TARGET)
    target = FakeTarget(BUILTIN_TARGET, tokenizer.encode(SCRIPT))
    server = serve_fake_target(target)
    yield target, server.port
    server.stop(0)


def _start(port: int, *flags: str) -> RunningGateway:
    return start_gateway(["--port", "0", "--target", f"127.0.0.1:{port}",
                          "--model", str(BUILTIN_TARGET), "--connect-timeout-s", "10", *flags])


@pytest.fixture
def gateway(fake: tuple[FakeTarget, int]) -> Iterator[RunningGateway]:
    running = _start(fake[1], "--max-running", "2", "--max-queued", "1")
    yield running
    running.stop()


def _stub(gateway: RunningGateway) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))


def _health(gateway: RunningGateway) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"))
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _request(max_new_tokens: int = 8, **kwargs: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        text="Say hello", stopping=gateway_pb2.StoppingParams(max_new_tokens=max_new_tokens),
        **kwargs)


def _wait_until(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_startup_report_policy_and_health(gateway: RunningGateway,
                                          fake: tuple[FakeTarget, int]) -> None:
    target, _ = fake
    assert [s.name for s in gateway.report.steps] == STEPS
    assert all(s.state is StepState.OK for s in gateway.report.steps)
    assert _health(gateway) == health_pb2.HealthCheckResponse.SERVING
    assert len(target.policies) == 1 and target.policies[0].entries[0].max_batch_size == 2**32 - 1
    modes = [a.speculation for a in target.admits[:2]]
    assert modes == [common_pb2.SPECULATION_MODE_OFF, common_pb2.SPECULATION_MODE_ON]
    status = _stub(gateway).GetStatus(gateway_pb2.GetStatusRequest())
    assert status.gateway.ok and status.target.service == "target" and status.draft.service == "draft"
    assert status.model_name == "fake" and status.spec.verify_steps >= 4
    assert status.policy == target.policies[0]


def test_generate_and_stream_agree(gateway: RunningGateway) -> None:
    tokenizer = load_tokenizer(BUILTIN_TARGET)
    n = len(tokenizer.encode(SCRIPT))
    stub = _stub(gateway)
    whole = stub.Generate(_request(n, include_token_ids=True))
    assert whole.text == SCRIPT
    assert whole.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert whole.usage.completion_tokens == n == len(whole.token_ids)
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Say hello"))
    assert whole.spec.verify_steps == 2 and whole.timings.total_s >= whole.timings.time_to_first_token_s
    chunks = list(stub.GenerateStream(_request(n, include_token_ids=True)))
    assert "".join(c.text for c in chunks) == SCRIPT
    assert [i for c in chunks for i in c.token_ids] == list(whole.token_ids)
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(c.finish_reason == 0 for c in chunks[:-1])


def test_stop_string_truncates_and_cancels(gateway: RunningGateway,
                                           fake: tuple[FakeTarget, int]) -> None:
    stub = _stub(gateway)
    request = _request(100)
    request.stopping.stop.append("STOP")
    chunks = list(stub.GenerateStream(request))
    assert "".join(c.text for c in chunks) == SCRIPT[:SCRIPT.index("STOP")]
    final = chunks[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert 0 < final.usage.completion_tokens < 100
    target, _ = fake
    _wait_until(lambda: target.admits[-1].request_id in target.cancels)
    _wait_until(lambda: gateway.core.admission.num_running == 0)


def test_invalid_request_keeps_gateway_healthy(gateway: RunningGateway) -> None:
    stub = _stub(gateway)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(sampling=common_pb2.SamplingParams(temperature=-0.5)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be a finite number >= 0" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(
            ids=[1, 999999]))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "999999" in info.value.details()
    assert _health(gateway) == health_pb2.HealthCheckResponse.SERVING
    assert stub.Generate(_request(2)).usage.completion_tokens == 2


def test_full_gateway_is_resource_exhausted(gateway: RunningGateway,
                                            fake: tuple[FakeTarget, int]) -> None:
    target, _ = fake
    target.is_paused.set()
    stub = _stub(gateway)
    calls = [stub.GenerateStream(_request(4)) for _ in range(3)]
    _wait_until(lambda: gateway.core.admission.num_queued == 1)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(4))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-running 2" in info.value.details()
    target.is_paused.clear()
    for call in calls:
        assert list(call)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert gateway.core.admission.num_running == 0


def test_client_cancel_reaches_target_and_frees_slot(gateway: RunningGateway,
                                                     fake: tuple[FakeTarget, int]) -> None:
    target, _ = fake
    target.step_s = 0.02
    stub = _stub(gateway)
    call = stub.GenerateStream(_request(200))
    next(call)
    num_admits = len(target.admits)
    call.cancel()
    _wait_until(lambda: target.admits[num_admits - 1].request_id in target.cancels)
    _wait_until(lambda: gateway.core.admission.num_running == 0)


def test_queued_cancel_leaves_queue(gateway: RunningGateway, fake: tuple[FakeTarget, int]) -> None:
    target, _ = fake
    target.is_paused.set()
    stub = _stub(gateway)
    running = [stub.GenerateStream(_request(4)) for _ in range(2)]
    _wait_until(lambda: gateway.core.admission.num_running == 2)
    queued = stub.GenerateStream(_request(4))
    _wait_until(lambda: gateway.core.admission.num_queued == 1)
    queued.cancel()
    _wait_until(lambda: gateway.core.admission.num_queued == 0)
    target.is_paused.clear()
    for call in running:
        list(call)


def test_stream_loss_fails_inflight_and_reconnects(gateway: RunningGateway,
                                                   fake: tuple[FakeTarget, int]) -> None:
    target, _ = fake
    target.step_s = 0.02
    stub = _stub(gateway)
    call = stub.GenerateStream(_request(200))
    next(call)
    target.break_streams()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "lost the target stream" in info.value.details()
    _wait_until(lambda: target.num_streams == 2 and gateway.target.is_connected)
    _wait_until(lambda: _health(gateway) == health_pb2.HealthCheckResponse.SERVING)
    _wait_until(lambda: len(target.policies) == 2)
    assert gateway.core.admission.num_running == 0
    target.step_s = 0.002
    assert stub.Generate(_request(3)).finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("step", STEPS)
def test_injected_fault_fails_each_step(step: str, fake: tuple[FakeTarget, int],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSPEC_INJECT_INIT_FAULT", step)
    with pytest.raises(InitFailed) as info:
        _start(fake[1])
    assert info.value.report.failed_step.name == step
    assert not info.value.report.ok


def test_tokenizer_mismatch_says_what_to_change(fake: tuple[FakeTarget, int],
                                                tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(
        (BUILTIN_TARGET / "tokenizer.json").read_bytes() + b"\n")
    with pytest.raises(InitFailed) as info:
        start_gateway(["--port", "0", "--target", f"127.0.0.1:{fake[1]}", "--model", str(tmp_path)])
    failed = info.value.report.failed_step
    assert failed.name == "connect_target" and "pass --model <target checkpoint>" in failed.error_message


def test_taken_port_fails_start_server(gateway: RunningGateway, fake: tuple[FakeTarget, int]) -> None:
    with pytest.raises(InitFailed) as info:
        start_gateway(["--port", str(gateway.port), "--target", f"127.0.0.1:{fake[1]}",
                       "--model", str(BUILTIN_TARGET)])
    assert info.value.report.failed_step.name == "start_server"


def test_threshold_policy(fake: tuple[FakeTarget, int]) -> None:
    target, port = fake
    running = _start(port, "--spec-policy", "static", "--spec-disable-batch-threshold", "4",
                     "--topk", "2")
    try:
        entry = target.policies[-1].entries[0]
        assert entry.max_batch_size == 4
        assert (entry.shape.num_draft_tokens, entry.shape.topk, entry.shape.num_steps) == (4, 2, 4)
    finally:
        running.stop()


def test_cli_generate_and_status(gateway: RunningGateway, capsys: pytest.CaptureFixture[str]) -> None:
    from splitspec.cli import main

    address = f"127.0.0.1:{gateway.port}"
    assert main(["generate", "hi", "--address", address, "--max-new-tokens", "40",
                 "--stop", "STOP"]) == 0
    out, err = capsys.readouterr()
    assert out == SCRIPT[:SCRIPT.index("STOP")] + "\n"
    assert "finish: STOP" in err and "speculation:" in err
    assert main(["status", "--address", address]) == 0
    out, _ = capsys.readouterr()
    assert "model: fake" in out and "connect_target" in out and "load_model" in out


def test_cli_generate_sends_the_sampling_flags(gateway: RunningGateway,
                                              fake: tuple[FakeTarget, int]) -> None:
    from splitspec.cli import main

    target, _ = fake
    assert main(["generate", "hi", "--address", f"127.0.0.1:{gateway.port}", "--max-new-tokens",
                 "4", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9", "--seed", "7"]) == 0
    sampling = target.admits[-1].sampling
    assert (sampling.temperature, sampling.top_k, sampling.seed) == (0.5, 3, 7)
    assert sampling.top_p == pytest.approx(0.9)


def test_cli_generate_reads_the_prompt_from_stdin(gateway: RunningGateway,
                                                 fake: tuple[FakeTarget, int],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate -` takes a prompt with its newlines (a chat template's output) from stdin;
    --no-special-tokens reaches the gateway, which on the built-in tokenizer adds none anyway."""
    import io

    from splitspec.cli import main

    target, _ = fake
    prompt = "def f():\n    return 1\n\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    assert main(["generate", "-", "--address", f"127.0.0.1:{gateway.port}",
                 "--max-new-tokens", "4", "--no-special-tokens"]) == 0
    assert list(target.admits[-1].prompt_ids) == load_tokenizer(BUILTIN_TARGET).encode(prompt)


def test_cli_generate_deadline_cancels_and_keeps_the_text(
        gateway: RunningGateway, fake: tuple[FakeTarget, int],
        capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --timeout-s`: a stream still running at its deadline exits 1 with a message
    naming it, the text so far printed, and the request cancelled at the target."""
    from splitspec.cli import main

    target, _ = fake
    target.step_s = 0.1  # 60 tokens, 2 a step: about 3 s, well past the 1-s deadline
    num_admits = len(target.admits)
    assert main(["generate", "hi", "--address", f"127.0.0.1:{gateway.port}",
                 "--max-new-tokens", "60", "--timeout-s", "1"]) == 1
    out, err = capsys.readouterr()
    assert out and SCRIPT.startswith(out.rstrip("\n")) and len(out.rstrip("\n")) < len(SCRIPT)
    assert "DEADLINE_EXCEEDED" in err and "no answer within the deadline, 1 s" in err
    _wait_until(lambda: target.admits[num_admits].request_id in target.cancels)
    _wait_until(lambda: gateway.core.admission.num_running == 0)


def test_cli_generate_ctrl_c_cancels_and_keeps_the_text(
        gateway: RunningGateway, fake: tuple[FakeTarget, int]) -> None:
    """Ctrl-C in `splitspec generate` (a real process): the text so far stays, a line says
    the request was cancelled (no traceback), the exit code is 130, and the gateway cancels
    the request at the target."""
    target, _ = fake
    target.step_s = 0.1  # 60 tokens, 2 a step: about 3 s
    num_admits = len(target.admits)
    # Ctrl-C's KeyboardInterrupt, also where this test runs with SIGINT ignored (a background
    # job's children inherit that, and Python then installs no handler of its own)
    command = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from splitspec.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", command, "generate", "hi", "--address",
         f"127.0.0.1:{gateway.port}", "--max-new-tokens", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
        cwd=Path(__file__).resolve().parent.parent)
    first = proc.stdout.read(1)  # the first text streamed
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "splitspec: interrupted: the request was cancelled" in err and "Traceback" not in err
    text = (first + out).rstrip("\n")
    assert text and SCRIPT.startswith(text) and len(text) < len(SCRIPT)
    _wait_until(lambda: target.admits[num_admits].request_id in target.cancels)
    _wait_until(lambda: gateway.core.admission.num_running == 0)


def test_drain_lets_requests_in_flight_finish_and_refuses_new_ones(
        fake: tuple[FakeTarget, int]) -> None:
    """SIGTERM's drain (RunningGateway.drain): NOT_SERVING, a new request UNAVAILABLE, the
    stream in flight runs to its last token, and the drain returns when it has ended."""
    target, port = fake
    running = _start(port, "--drain-timeout-s", "30")
    try:
        target.step_s = 0.02  # 60 tokens, 2 a step: about 0.6 s
        stub = _stub(running)
        call = stub.GenerateStream(_request(60, include_token_ids=True))
        first = next(call)
        drained = []
        drain = threading.Thread(target=lambda: drained.append(running.drain()))
        drain.start()
        _wait_until(lambda: _health(running) == health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(_request(3))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the gateway is stopping" in info.value.details()
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 60
        drain.join(timeout=5)
        assert not drain.is_alive() and drained == [0]
        assert running.core.num_in_flight == 0
    finally:
        running.stop()


@pytest.mark.parametrize(("retryable", "code", "says"), [
    (True, grpc.StatusCode.UNAVAILABLE, "the target refused request"),
    (False, grpc.StatusCode.INTERNAL, "the target failed request")])
def test_a_request_the_target_refuses_while_stopping_is_unavailable_other_failures_internal(
        gateway: RunningGateway, fake: tuple[FakeTarget, int], retryable: bool,
        code: grpc.StatusCode, says: str) -> None:
    """A stopping target refuses new requests with an error delta marked retryable: the
    client gets UNAVAILABLE (try again later), not INTERNAL, which a target's failure of
    the request itself still gets; the gateway stays SERVING either way."""
    target, _ = fake
    target.refusal = target_pb2.TokenDelta(
        finish_reason=common_pb2.FINISH_REASON_ERROR, error="stopping, or broken",
        retryable=retryable)
    with pytest.raises(grpc.RpcError) as info:
        _stub(gateway).Generate(_request(3), timeout=10)
    assert info.value.code() == code
    assert says in info.value.details() and "stopping, or broken" in info.value.details()
    assert _health(gateway) == health_pb2.HealthCheckResponse.SERVING


def test_a_draining_target_turns_the_gateway_not_serving_until_it_is_back(
        gateway: RunningGateway, fake: tuple[FakeTarget, int]) -> None:
    """A target that says it stops (its SIGTERM drain): the gateway turns NOT_SERVING (a load
    balancer stops sending to it), answers new requests UNAVAILABLE itself without sending
    them, lets the request in flight finish, and is SERVING again once it has reconnected
    to the target come back."""
    target, _ = fake
    target.step_s = 0.02  # 40 tokens, 2 a step: about 0.4 s
    stub = _stub(gateway)
    call = stub.GenerateStream(_request(40, include_token_ids=True))
    first = next(call)
    target.drain()
    _wait_until(lambda: _health(gateway) == health_pb2.HealthCheckResponse.NOT_SERVING)
    sent = len(target.admits)
    with pytest.raises(grpc.RpcError) as info:
        _stub(gateway).Generate(_request(3), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the target is stopping" in info.value.details() and len(target.admits) == sent
    rest = list(call)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 40
    target.drain(False)
    target.break_streams()  # the old target's stream ends; the gateway reconnects
    _wait_until(lambda: _health(gateway) == health_pb2.HealthCheckResponse.SERVING, 10)
    assert stub.Generate(_request(3), timeout=10).finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("cut", ["timeout", "second signal"])
def test_drain_ends_what_is_left_with_unavailable_saying_why(
        cut: str, fake: tuple[FakeTarget, int]) -> None:
    """Requests still running (or queued) when the drain's time is up, or when a second
    signal cuts it short, end with UNAVAILABLE naming the cause; those at the target are
    cancelled there."""
    target, port = fake
    timeout_s = "0.3" if cut == "timeout" else "30"
    running = _start(port, "--max-running", "2", "--max-queued", "1", "--drain-timeout-s", timeout_s)
    try:
        target.is_paused.set()
        stub = _stub(running)
        num_admits = len(target.admits)  # (the gateway's warmup generated already)
        calls = [stub.GenerateStream(_request(8)) for _ in range(3)]
        _wait_until(lambda: running.core.admission.num_queued == 1)
        # the target reads its stream between steps: both admits must have reached it, or
        # admits[-2:] would take a warmup's, which nothing cancels (a CI run failed so)
        _wait_until(lambda: len(target.admits) == num_admits + 2)
        admitted = [admit.request_id for admit in target.admits[-2:]]
        again = threading.Event()
        if cut == "second signal":
            threading.Timer(0.3, again.set).start()
        started = time.monotonic()
        assert running.drain(again) == 3
        assert time.monotonic() - started < 5
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            details = info.value.details()
            assert "the gateway stopped before request" in details
            assert ("--drain-timeout-s 0.3" if cut == "timeout" else "stopped again") in details
        target.is_paused.clear()
        _wait_until(lambda: set(admitted) <= set(target.cancels))
        _wait_until(lambda: running.core.admission.num_running == 0)
    finally:
        running.stop()


def test_sigterm_drains_the_gateway_process(fake: tuple[FakeTarget, int], tmp_path: Path) -> None:
    """The gateway as its own process (python -m gateway): SIGTERM with a stream in flight,
    the stream still gets every token, and the process then exits 0."""
    target, port = fake
    gateway = Service("gateway", ["--target", f"127.0.0.1:{port}", "--model", str(BUILTIN_TARGET),
                                  "--drain-timeout-s", "30"], tmp_path)
    try:
        gateway.wait_serving()
        target.step_s = 0.1  # 60 tokens, 2 a step: about 3 s, beyond the server's 2 s grace
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway.address))
        call = stub.GenerateStream(_request(60, include_token_ids=True))
        first = next(call)
        gateway.proc.terminate()
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 60
        code, _ = gateway.wait_exit(timeout_s=15)
        assert code == 0, gateway.log
        assert "gateway stopping: waiting up to 30 s for the requests in flight (1;" in gateway.log
    finally:
        gateway.stop()


def test_each_step_reaches_the_policy_with_the_requests_still_in_flight(
        fake: tuple[FakeTarget, int]) -> None:
    """The adaptive policy counts a request's steps out of the batch from the requests in
    flight the gateway tells it with each step: those sent and not yet ended once that
    step's final deltas are handed out. Two requests of 4 and 8 tokens, 2 a step: at steps
    1-4 the policy hears 2, 1 (the first ended there), 1 and 0."""
    target, port = fake
    tokenizer = load_tokenizer(BUILTIN_TARGET)
    target.is_paused.set()  # both admitted before the first step
    seen: list[tuple[int, int, int]] = []
    ended = threading.Event()

    def on_step(stats: target_pb2.StepStats, in_flight: int) -> None:
        seen.append((stats.step, stats.batch_size, in_flight))

    def sink(item: object) -> None:
        if getattr(item, "request_id", 0) == 2 and item.finish_reason:  # type: ignore[union-attr]
            ended.set()

    client = TargetClient(connect_target(f"127.0.0.1:{port}", 10, tokenizer), tokenizer,
                          static_policy(1, OFF), _Listener(), on_step=on_step)
    try:
        for request_id, max_new in ((1, 4), (2, 8)):
            client.submit(target_pb2.Admit(request_id=request_id, prompt_ids=[5, 6],
                                           max_new_tokens=max_new, ignore_eos=True), sink)
        _wait_until(lambda: len(target.admits) == 2)
        target.is_paused.clear()
        assert ended.wait(5)
        _wait_until(lambda: len(seen) == 4)
    finally:
        client.close()
    assert seen == [(1, 2, 2), (2, 2, 1), (3, 1, 1), (4, 1, 0)]


class _Listener:
    def target_down(self) -> None:
        pass

    def target_up(self) -> None:
        pass
