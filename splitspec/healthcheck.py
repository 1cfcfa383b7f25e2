"""python -m splitspec.healthcheck HOST:PORT: exit 0 when the service's health is SERVING.

Used as the container health check in docker-compose.yml.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a SplitSpec service")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout_s)
        except grpc.RpcError as exc:  # becomes the exit status, reported on stderr
            print(f"{args.address}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
