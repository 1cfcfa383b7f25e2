"""``splitspec up``, the README's first command, as a user runs it: the three services as
processes, text generated, and Ctrl-C stopping them in order (the gateway drains first)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.stack import REPO, free_port

pytestmark = pytest.mark.slow


def up(*flags: str) -> tuple[list[str], dict[str, int]]:
    ports = {"gateway": free_port(), "target": free_port(), "draft": free_port()}
    argv = [sys.executable, "-m", "splitspec.cli", "up", *flags,
            *(arg for name, port in ports.items() for arg in (f"--{name}-port", str(port)))]
    return argv, ports


def listening(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
        except grpc.FutureTimeoutError:
            return False
    return True


def test_up_generate_prints_text_and_stops_every_service():
    """On one terminal (stdout and stderr together) the completion comes out whole: the
    services' log lines from while it streamed are held back and printed after it, none
    lost. (The adaptive policy's first probe comes mid-stream, after 16 speculative steps,
    about 40 tokens, and the gateway and the target log the table that starts it.)"""
    argv, ports = up("--generate", "def fibonacci(n):", "--max-new-tokens", "96")
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    _, serving, rest = out.partition("splitspec up: SERVING at")
    assert serving, out[-3000:]
    completion, finish, after = rest.split("\n", 1)[1].partition("\n--- finish: ")
    assert completion.strip() and finish, out[-3000:]
    log_line = re.compile(r"(draft|target|gateway) \| \d{4}-\d\d-\d\d ")
    assert not log_line.search(completion), out[-3000:]
    assert "speculation policy now" in after, out[-3000:]
    assert not any(listening(port) for port in ports.values()), out[-3000:]


def test_ctrl_c_lets_a_stream_in_flight_finish_then_stops_every_service(tmp_path):
    argv, ports = up()
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while "SERVING at" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.2)
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}"))
        call = stub.GenerateStream(gateway_pb2.GenerateRequest(
            text="class Stack:", include_token_ids=True,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=200, ignore_eos=True)), timeout=120)
        first = next(call)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "up.log").read_text()
    assert "stopping the gateway" in text and "ignored SIGTERM" not in text, text[-3000:]
    assert not any(listening(port) for port in ports.values()), text[-3000:]


def test_up_passes_each_service_its_flags_and_stops_when_one_refuses_them():
    """--target-flag / --gateway-flag / --draft-flag reach that service's command line (the
    target defers catch-ups from warmup's end, the gateway runs the static policy); a flag
    a service does not know stops it at start, and ``up`` with it, naming which."""
    argv, _ = up("--generate", "import os", "--max-new-tokens", "8",
                 "--target-flag=--defer-catch-up=16", "--gateway-flag=--spec-policy=static",
                 "--draft-flag=--cpu-threads=1")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from now on a catch-up of over 16 tokens is deferred" in done.stderr
    assert "static policy: any batch" in done.stderr
    argv, _ = up("--generate", "import os", "--target-flag=--no-such-flag")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1
    assert "unrecognized arguments: --no-such-flag" in done.stderr
    assert "the target service exited with code 2" in done.stderr


def test_up_serves_your_target_with_a_head_that_has_no_embedding_of_its_own(tmp_path):
    """A published EAGLE-3 head carries no embed_tokens: the draft reads the target's, from
    the --target-model that ``up`` hands it beside --draft-model (it failed at load_model,
    asking for that flag, when ``up`` did not)."""
    from safetensors.torch import load_file, save_file

    from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text((BUILTIN_EAGLE3 / "config.json").read_text())
    tensors = load_file(BUILTIN_EAGLE3 / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, head / "model.safetensors")
    argv, _ = up("--target-model", str(BUILTIN_TARGET), "--draft-model", str(head),
                 "--generate", "def add(a, b):", "--max-new-tokens", "16", "--speculation", "on")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--model {head} --target-model {BUILTIN_TARGET}" in done.stderr
    assert done.stdout.strip(), done.stderr[-3000:]
    # the head drafts with the target's embedding, which is its own: trees are accepted
    accepted = re.search(r"speculation: \d+ verify steps, \d+ drafted, (\d+) accepted", done.stderr)
    assert accepted and int(accepted.group(1)) > 0, done.stderr[-3000:]
