"""Start SplitSpec services as real processes for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.v1 import draft_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def serve_draft_in_process(servicer: object) -> tuple[grpc.Server, str]:
    """A draft servicer on a real gRPC server in this process, with the project's channel
    options and a health service that answers SERVING (a reconnecting DraftLink asks it):
    the server (to stop) and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=CHANNEL_OPTIONS)
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One service process; its output goes to a log file that failures print."""

    def __init__(self, module: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.module = module
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{module}-{self.port}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(self.port), *args],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> int | None:
        """The overall health status, or None when the server does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=0.5)
            except grpc.RpcError:  # not listening (yet, or any more)
                return None
            return reply.status

    def wait_serving(self, timeout_s: float = 90.0) -> Service:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log}")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.module} not SERVING after {timeout_s}s:\n{self.log}")

    def wait_exit(self, timeout_s: float = 60.0) -> tuple[int, list[int | None]]:
        """Wait for the process to end; returns its exit code and the health answers seen meanwhile."""
        seen = []
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            seen.append(self.health())
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.stop()
            raise TimeoutError(f"{self.module} still running after {timeout_s}s:\n{self.log}")
        return self.proc.returncode, seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
