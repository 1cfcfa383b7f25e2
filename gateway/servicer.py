"""The Gateway gRPC servicer: proto in, GatewayCore call, proto out.

Registered when the server starts (health NOT_SERVING); it answers requests
with UNAVAILABLE "starting up" (and GetStatus with the init report so far)
until :meth:`GatewayServicer.attach` hands it the finished core after warmup.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from gateway.core import GatewayCore
from gateway.generation import Chunk, RequestRun
from splitspec.grpc_server import ServiceError
from splitspec.init_report import InitReport
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, report: InitReport) -> None:
        self._report = report
        self._core: GatewayCore | None = None

    def attach(self, core: GatewayCore) -> None:
        """Start serving requests with the finished core."""
        self._core = core

    def Generate(self, request: gateway_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> gateway_pb2.GenerateResponse:
        return collect(self._start(request, context))

    def GenerateStream(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.ServicerContext) -> Iterator[gateway_pb2.GenerateResponse]:
        for chunk in self._start(request, context):
            yield chunk_to_pb(chunk)

    def GetStatus(self, request: gateway_pb2.GetStatusRequest,
                  context: grpc.ServicerContext) -> gateway_pb2.StatusResponse:
        if self._core is None:
            return gateway_pb2.StatusResponse(gateway=self._report.to_pb())
        return self._core.status()

    def _start(self, request: gateway_pb2.GenerateRequest,
               context: grpc.ServicerContext) -> RequestRun:
        if self._core is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "the gateway is starting up; GetStatus shows its init report")
        parent = dict(context.invocation_metadata()).get("traceparent", "")
        run = self._core.start(request, parent.encode())
        if not context.add_callback(run.cancel):
            run.cancel()  # the RPC already ended
        return run


def chunk_to_pb(chunk: Chunk) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids)
    final = chunk.final
    if final is not None:
        response.finish_reason = final.finish_reason
        response.usage.prompt_tokens = final.prompt_tokens
        response.usage.completion_tokens = final.completion_tokens
        response.timings.queue_s = final.queue_s
        response.timings.time_to_first_token_s = final.time_to_first_token_s
        response.timings.total_s = final.total_s
        response.spec.CopyFrom(final.spec)
    return response


def collect(chunks: Iterable[Chunk]) -> gateway_pb2.GenerateResponse:
    """The whole completion as one response; CANCELLED if the run ended without a final chunk."""
    texts: list[str] = []
    token_ids: list[int] = []
    for chunk in chunks:
        texts.append(chunk.text)
        token_ids.extend(chunk.token_ids)
        if chunk.final is not None:
            return chunk_to_pb(Chunk("".join(texts), tuple(token_ids), chunk.final))
    raise ServiceError(grpc.StatusCode.CANCELLED, "the request was cancelled before it finished")

