"""What every SplitSpec gRPC server shares: health, reflection, error mapping.

Servicers raise :class:`ServiceError` for errors a client caused or should
see; the :class:`ErrorInterceptor` is the one place that turns exceptions into
gRPC statuses and logs them. Health starts NOT_SERVING (grpcio's servicer
starts with the overall service SERVING, so it is set explicitly before the
server starts) and turns SERVING only when the service says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Messages above gRPC's default 4 MiB carry hidden states and long prompts.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that went away and came back is found within a second: gRPC's default
    # reconnect backoff grows to two minutes, and RPCs fail at once until it reconnects.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# wait_for_serving logs its progress this often (a peer may take minutes to load).
WAIT_REPORT_S = 10.0
STOP_GRACE_S = 2.0  # a stopping server's calls get this long to end before they are cancelled


class ServiceError(Exception):
    """An error to return to the caller as a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, ServiceError):
        log.info("%s -> %s: %s", method, exc.code.name, exc.message)
        context.abort(exc.code, exc.message)
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _is_abort(context: grpc.ServicerContext) -> bool:
    # context.abort() raises an exception grpc itself handles; let it through.
    return context.code() is not None and context.code() != grpc.StatusCode.OK


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions raised by handlers into gRPC statuses, logging each."""

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(fn: Callable) -> Callable:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return fn(request, context)
                except Exception as exc:  # becomes a gRPC status, logged in _abort
                    if _is_abort(context):
                        raise
                    _abort(context, method, exc)
                    raise

            return call

        def wrap_stream(fn: Callable) -> Callable:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from fn(request, context)
                except Exception as exc:  # becomes a gRPC status, logged in _abort
                    if _is_abort(context):
                        raise
                    _abort(context, method, exc)
                    raise

            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(handler.stream_stream),
            handler.request_deserializer, handler.response_serializer)


class ServiceServer:
    """A gRPC server with health (NOT_SERVING until :meth:`set_serving`) and reflection."""

    def __init__(self, address: str, max_workers: int, service_names: Iterable[str]) -> None:
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[ErrorInterceptor()],
            # Without so_reuseport=0 gRPC binds a port another server already holds.
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [*service_names, health.SERVICE_NAME]
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME],
                                            self.server)
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        taken = (f"cannot listen on {address}: another process holds the port, or the "
                 "address is invalid; choose another with --port (under splitspec up: "
                 "--gateway-port, --target-port, --draft-port)")
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # (grpcio's generic message; older grpcio returned 0)
            raise OSError(taken) from exc
        if self.port == 0:
            raise OSError(taken)
        self.address = address
        self._started = False

    def _set_all(self, status: int) -> None:
        self.health.set("", status)
        for name in self._service_names:
            self.health.set(name, status)

    def start(self) -> None:
        self._started = True  # first: a start that raised is not tried again by release
        self.server.start()

    def set_serving(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.set_not_serving()
        self.server.stop(grace_s).wait()

    def release(self) -> None:
        """Give back the port of a server that never started (start-up failed after binding
        it): gRPC keeps such a port until the process exits, so it is started and stopped at
        once (health says NOT_SERVING meanwhile)."""
        if not self._started:
            self.start()
        self.stop(0)


def wait_for_serving(address: str, timeout_s: float, what: str,
                     alive: Callable[[], bool] | None = None,
                     report_every_s: float = WAIT_REPORT_S) -> grpc.Channel:
    """Open a channel to address and wait until its health says SERVING, logging every
    ``report_every_s`` what it has seen so far (a peer still loading, or none there).

    Raises TimeoutError naming ``what`` and the last status seen, or RuntimeError as
    soon as ``alive`` (the serving process's liveness, when given) returns False.
    """
    import time

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)
    started = time.monotonic()
    deadline, report_at = started + timeout_s, started + report_every_s
    last = "no answer"
    while (now := time.monotonic()) < deadline:
        if now >= report_at:
            log.info("waiting for the %s at %s to be SERVING: %.0f of %.0f s, last: %s",
                     what, address, now - started, timeout_s, last)
            report_at = now + report_every_s
        if alive is not None and not alive():
            channel.close()
            raise RuntimeError(f"{what} at {address} exited before it was SERVING (last: {last})")
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError as exc:  # not up yet: keep waiting, remember why
            last = f"{exc.code().name}: {exc.details()}"
        else:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return channel
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        time.sleep(0.1)
    channel.close()
    raise TimeoutError(f"{what} at {address} was not SERVING within {timeout_s:.0f}s (last: {last})")
