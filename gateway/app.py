"""Gateway start-up as named init steps, then serve until SIGTERM / SIGINT.

Steps: load_config, load_tokenizer, start_server, connect_target, open_stream,
warmup. Each component is built from finished step results; health turns
SERVING only after warmup ran real generations with speculation off and on.
Any failed step prints the JSON init report to stderr (and --init-report) and
the process exits 1.

On SIGTERM / SIGINT the gateway drains: health turns NOT_SERVING, new requests
get UNAVAILABLE, and those in flight run to their end for up to
--drain-timeout-s (a second signal cuts it short); any still running then end
with UNAVAILABLE saying why, and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig, build_parser
from gateway.core import GatewayCore, num_server_workers
from gateway.generation import Final, RequestRun
from gateway.policy import (
    AdaptivePolicy,
    ShapeOverride,
    adaptive_shapes,
    describe_policy,
    parse_table,
    resolve_shape,
    static_policy,
)
from gateway.servicer import GatewayServicer
from gateway.target_client import TargetClient, TargetPeer, connect_target
from splitspec import telemetry
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import (
    Detailed,
    InitFailed,
    InitReport,
    Startup,
    fail_startup,
    write_report,
)
from splitspec.signals import StopSignals, report_fatal_signals
from splitspec.tokenizer import ModelTokenizer, load_tokenizer
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("gateway")

STEPS = ["load_config", "load_tokenizer", "start_server", "connect_target", "open_stream", "warmup"]
WARMUP_PROMPT = "The quick brown fox"
WARMUP_NEW_TOKENS = 4


class HealthGate:
    """Health is SERVING exactly when warmup has succeeded and the target stream is up."""

    def __init__(self, server: ServiceServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._is_ready = False
        self._is_target_up = True
        self._is_stopping = False

    def mark_ready(self) -> None:
        with self._lock:
            self._is_ready = True
            self._update()

    def target_down(self) -> None:
        with self._lock:
            self._is_target_up = False
            self._update()

    def target_up(self) -> None:
        with self._lock:
            self._is_target_up = True
            self._update()

    def stopping(self) -> None:
        """NOT_SERVING from now on: the gateway is draining."""
        with self._lock:
            self._is_stopping = True
            self._update()

    def _update(self) -> None:
        if self._is_ready and self._is_target_up and not self._is_stopping:
            self._server.set_serving()
        else:
            self._server.set_not_serving()


@dataclass(frozen=True)
class RunningGateway:
    """A gateway that finished start-up and is SERVING."""

    server: ServiceServer
    target: TargetClient
    core: GatewayCore
    report: InitReport
    health: HealthGate
    drain_timeout_s: float

    @property
    def port(self) -> int:
        return self.server.port

    def drain(self, interrupt: threading.Event | None = None) -> int:
        """NOT_SERVING, then :meth:`GatewayCore.drain` for --drain-timeout-s; returns how
        many requests it aborted."""
        self.health.stopping()
        in_flight = self.core.num_in_flight
        log.info("gateway stopping: waiting up to %g s for the requests in flight (%d; "
                 "--drain-timeout-s; a second signal stops at once)", self.drain_timeout_s,
                 in_flight)
        aborted = self.core.drain(self.drain_timeout_s, interrupt)
        if aborted:
            log.warning("gateway stopping: %d of %d requests in flight did not finish; "
                        "they end with UNAVAILABLE", aborted, in_flight)
        return aborted

    def stop(self) -> None:
        self.server.stop()
        self.target.close()


def load_config(args: argparse.Namespace) -> Detailed:
    config = GatewayConfig.from_args(args)
    return Detailed(config, f"target {config.target}, model {config.model}")


def load_model_tokenizer(config: GatewayConfig) -> Detailed:
    tokenizer = load_tokenizer(config.model)
    return Detailed(tokenizer, f"{tokenizer.path}: {tokenizer.vocab_size} ids, "
                               f"sha {tokenizer.sha256[:12]}")


def start_server(config: GatewayConfig, report: InitReport) -> Detailed:
    """Bind and start the server with health NOT_SERVING; the servicer answers 'starting up'."""
    workers = num_server_workers(config)
    service_name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    server = ServiceServer(config.address, workers, [service_name])
    servicer = GatewayServicer(report)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server.server)
    server.start()
    return Detailed((server, servicer), f"listening on {config.host}:{server.port} "
                                        f"with {workers} workers, NOT_SERVING until warmup")


def connect(config: GatewayConfig, tokenizer: ModelTokenizer) -> Detailed:
    peer = connect_target(config.target, config.connect_timeout_s, tokenizer)
    info = peer.info
    draft = f"draft {info.draft_model_name or 'yes'}" if info.has_draft else "no draft"
    return Detailed(peer, f"{info.model_name or '(unnamed)'} at {config.target}: vocab {info.vocab_size}, "
                          f"max_context {info.max_context}, max_running {info.max_running}, "
                          f"tp {info.tp_size}, {draft}")


def open_stream(config: GatewayConfig, tokenizer: ModelTokenizer, peer: TargetPeer,
                health: HealthGate) -> Detailed:
    override = ShapeOverride(config.num_draft_tokens, config.topk, config.num_steps)
    shape = resolve_shape(override, peer.info.default_shape)
    adaptive = None
    if config.spec_policy == "table":
        policy = parse_table(config.spec_policy_table, shape)
    elif config.spec_policy == "adaptive":
        adaptive = AdaptivePolicy(adaptive_shapes(config.spec_adaptive_shapes, shape))
        policy = adaptive.policy
    else:
        policy = static_policy(config.spec_disable_batch_threshold, shape)
    target = TargetClient(peer, tokenizer, policy, health,
                          on_step=adaptive.observe if adaptive else None)
    return Detailed(target, f"Serve open; {config.spec_policy} policy: {describe_policy(policy)}")


def run_to_end(run: RequestRun, timeout_s: float) -> Final:
    """Drain a run; raise TimeoutError if it has no final chunk within timeout_s."""
    watchdog = threading.Timer(timeout_s, run.cancel)
    watchdog.start()
    try:
        chunks = list(run)
    finally:
        watchdog.cancel()
    if not chunks or chunks[-1].final is None:
        raise TimeoutError(f"warmup request {run.request_id} did not finish within {timeout_s:.0f}s")
    return chunks[-1].final


def warmup(core: GatewayCore, timeout_s: float) -> Detailed:
    """Two real generations through the target stream: speculation off, then on."""
    done = []
    for mode in (common_pb2.SPECULATION_MODE_OFF, common_pb2.SPECULATION_MODE_ON):
        request = gateway_pb2.GenerateRequest(
            text=WARMUP_PROMPT, speculation=mode,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=WARMUP_NEW_TOKENS))
        final = run_to_end(core.start(request), timeout_s)
        mode_name = common_pb2.SpeculationMode.Name(mode)
        reason = common_pb2.FinishReason.Name(final.finish_reason)
        if final.finish_reason not in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS):
            raise RuntimeError(f"warmup generation with {mode_name} finished with {reason}, "
                               f"expected LENGTH or EOS")
        done.append(f"{mode_name}: {final.completion_tokens} tokens {reason} in "
                    f"{final.total_s:.2f}s, {final.spec.verify_steps} verify steps")
    return Detailed(None, "; ".join(done))


def start(startup: Startup, args: argparse.Namespace) -> RunningGateway:
    """Run every start-up step; raise InitFailed (after cleaning up) when one fails."""
    with contextlib.ExitStack() as cleanup:
        config = startup.step("load_config", load_config, args)
        tokenizer = startup.step("load_tokenizer", load_model_tokenizer, config)
        server, servicer = startup.step("start_server", start_server, config, startup.report)
        cleanup.callback(server.stop, 0)
        health = HealthGate(server)
        peer = startup.step("connect_target", connect, config, tokenizer)
        cleanup.callback(peer.channel.close)
        target = startup.step("open_stream", open_stream, config, tokenizer, peer, health)
        cleanup.callback(target.close)
        core = GatewayCore(config, tokenizer, target, startup.report)
        startup.step("warmup", warmup, core, config.connect_timeout_s)
        servicer.attach(core)
        health.mark_ready()
        cleanup.pop_all()
    return RunningGateway(server=server, target=target, core=core, report=startup.report,
                          health=health, drain_timeout_s=config.drain_timeout_s)


def start_gateway(argv: Sequence[str]) -> RunningGateway:
    """Start a gateway in this process from command-line flags (for tests); raises InitFailed."""
    return start(Startup("gateway", STEPS), build_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.getLevelName(str(args.log_level).upper())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report_fatal_signals()
    telemetry.setup("gateway")
    startup = Startup("gateway", STEPS)
    try:
        gateway = start(startup, args)
    except InitFailed as exc:
        return fail_startup(exc, args.init_report)
    write_report(startup.report, args.init_report)
    signals = StopSignals()  # during start-up a signal stops the process at once
    log.info("gateway SERVING on %s:%d", args.host, gateway.port)
    signals.first.wait()
    gateway.drain(signals.again)
    gateway.stop()
    telemetry.shutdown()
    return 0
