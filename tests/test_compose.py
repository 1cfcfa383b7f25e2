"""docker-compose.yml and its CPU override: the target's ranks match its GPUs, and every
service's command line is one its own parser accepts (so the files cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from draft_service.__main__ import parse_args as draft_args
from gateway.app import build_parser
from target_service.__main__ import parse_args as target_args

REPO = Path(__file__).resolve().parent.parent
GPU, CPU = REPO / "docker-compose.yml", REPO / "docker-compose.cpu.yml"


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: `!reset` clears a value in an override file."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": True})


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass


def merged() -> dict:
    """The CPU stack: the override's keys replace the base file's, service by service."""
    base, override = load(GPU), load(CPU)
    services = {name: dict(spec) for name, spec in base["services"].items()}
    for name, spec in override["services"].items():
        for key, value in spec.items():
            if value == {"!reset": True}:
                services[name].pop(key, None)
            elif isinstance(value, dict) and isinstance(services[name].get(key), dict):
                services[name][key] = {**services[name][key], **value}
            else:
                services[name][key] = value
    return services


def defaults(args: list[str]) -> list[str]:
    """Compose's ${VAR:-default} interpolation with every variable unset."""
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(a)) for a in args]


PARSERS = {"draft": draft_args, "target": target_args,
           "gateway": lambda argv: build_parser().parse_args(argv)}


def test_target_ranks_follow_its_gpu_count():
    target = load(GPU)["services"]["target"]
    command = target["command"]
    tp = command[command.index("--tp") + 1]
    (device,) = target["deploy"]["resources"]["reservations"]["devices"]
    assert tp == device["count"] == "${SPLITSPEC_TARGET_GPUS:-8}"
    assert defaults([tp]) == ["8"]
    assert target["ipc"] == "host"


@pytest.mark.parametrize("service", ["gateway", "target"])
@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_the_gateway_and_the_target_have_time_to_drain_before_compose_kills_them(stack, service):
    """compose SIGKILLs a service stop_grace_period after SIGTERM (10 s unless set): the
    gateway's and the target's must cover their drain and their server's grace after it."""
    from gateway.config import GatewayConfig
    from splitspec.grpc_server import STOP_GRACE_S

    spec = (load(GPU)["services"] if stack == "gpu" else merged())[service]
    argv = defaults(spec["command"][3:])
    drain_s = (GatewayConfig.from_args(build_parser().parse_args(argv)) if service == "gateway"
               else target_args(argv)).drain_timeout_s
    grace = re.fullmatch(r"(\d+)s", spec.get("stop_grace_period", "10s"))
    assert grace is not None, spec.get("stop_grace_period")
    assert int(grace.group(1)) >= drain_s + STOP_GRACE_S + 1


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_every_command_line_parses(stack):
    services = load(GPU)["services"] if stack == "gpu" else merged()
    assert set(PARSERS) <= set(services)
    for name in PARSERS:
        spec = services[name]
        argv = defaults(spec["command"])
        assert argv[:3] == ["python", "-m", {"draft": "draft_service", "target": "target_service",
                                             "gateway": "gateway"}[name]]
        PARSERS[name](argv[3:])  # argparse exits on an unknown flag or a bad value
        if stack == "cpu":
            assert "deploy" not in spec and "cuda" not in argv, name


# ---- the file's structure: the compose schema, references, health checks ---------------------


def compose_schema() -> dict:
    """The compose-spec JSON schema that check-jsonschema ships (validation needs no network)."""
    import json
    from importlib.resources import files

    return json.loads((files("check_jsonschema") / "builtin_schemas" / "vendor" /
                       "compose-spec.json").read_text())


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_the_compose_schema_accepts_the_stack(stack):
    import jsonschema

    document = load(GPU)
    if stack == "cpu":  # what compose validates: the base file with the override applied
        document = {**document, "services": merged()}
    jsonschema.validate(document, compose_schema())
    broken = {**document, "services": {**document["services"], "gateway": {
        **document["services"]["gateway"], "ports": "50051"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, compose_schema())

# ---- references and health checks ----------------------------------

SERVICE_KEYS = {"image", "build", "command", "environment", "depends_on", "deploy", "healthcheck",
                "ports", "ipc", "shm_size", "volumes", "stop_grace_period", "restart"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_structure_and_references(stack):
    top = load(GPU)
    assert set(top) - {"services", "volumes", "networks"} <= {k for k in top if k.startswith("x-")}
    services = top["services"] if stack == "gpu" else merged()
    assert {"gateway", "target", "draft", "otel-collector", "jaeger"} == set(services)
    for name, spec in services.items():
        assert set(spec) <= SERVICE_KEYS, (name, set(spec) - SERVICE_KEYS)
        assert "image" in spec, name
        for dependency, how in spec.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            assert how["condition"] in CONDITIONS
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], (name, dependency)
        for volume in spec.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./") and not host.startswith("./traces"):
                assert (REPO / host).exists(), (name, host)
    for name in ("gateway", "target", "draft"):  # grpc.health.v1 and the collector
        spec = services[name]
        assert spec["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "splitspec.healthcheck"]
        port = spec["command"][spec["command"].index("--port") + 1]
        assert spec["healthcheck"]["test"][4] == f"localhost:{port}"
        assert spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert spec["environment"]["OTEL_SERVICE_NAME"] == f"splitspec-{name}"
    assert services["target"]["healthcheck"]["start_period"] in ("300s", "600s")
    for name in ("gateway", "target", "draft"):  # a service that dies comes back (the target
        # reconnects to the draft, the gateway to the target), but not forever: one whose
        # start-up fails exits at once, each time
        assert re.fullmatch(r"on-failure:[1-9]", services[name]["restart"]), name


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_the_features_go_through_a_volume_the_draft_and_the_target_both_mount(stack):
    """The target's --feature-memory-dir is where a tmpfs volume is mounted in both the
    draft's container and its own: a memfd of the target's could not be opened from the
    draft's container, and its features would travel on the stream."""
    top = load(GPU)
    services = top["services"] if stack == "gpu" else merged()
    command = services["target"]["command"]
    directory = command[command.index("--feature-memory-dir") + 1]
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
              for name in ("draft", "target")}
    volume = mounts["target"][directory]
    assert mounts["draft"][directory] == volume
    assert top["volumes"][volume]["driver_opts"] == {"type": "tmpfs", "device": "tmpfs"}


# ---- the CPU stack's own command lines, run as local processes ------------------------------


@pytest.mark.slow
def test_cpu_stack_command_lines_run_and_generate(tmp_path):
    """Each service's command from the CPU stack, as written (service names resolve to this
    host, ports moved to free ones), started in dependency order; then a generation."""
    import grpc

    from splitspec.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.stack import Service, free_port

    services = merged()
    shared = tmp_path / "features"  # the tmpfs volume both mount: a directory here
    shared.mkdir()
    ports = {}
    for name in ("draft", "target", "gateway"):
        command = defaults(services[name]["command"])
        ports[command[command.index("--port") + 1]] = str(free_port())
    started = []
    try:
        for name in ("draft", "target", "gateway"):
            argv = defaults(services[name]["command"])[3:]
            local = []
            for i, arg in enumerate(argv):
                host, _, port = arg.rpartition(":")
                if i and argv[i - 1] == "--port":
                    arg = ports[arg]
                elif i and argv[i - 1] == "--feature-memory-dir":
                    arg = str(shared)
                elif host in services:  # compose's DNS name of a service: this host here
                    arg = f"127.0.0.1:{ports[port]}"
                local.append(arg)
            at = local.index("--port")
            port, args = int(local[at + 1]), local[:at] + local[at + 2:]
            started.append(Service(services[name]["command"][2], args, tmp_path,
                                   port=port).wait_serving(180))
        with grpc.insecure_channel(started[-1].address) as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                text="def add(a, b):\n", stopping=gateway_pb2.StoppingParams(
                    max_new_tokens=8, ignore_eos=True)), timeout=60)
        assert reply.usage.completion_tokens == 8
        target = started[1]
        assert f"draft features through shared memory {shared}/splitspec-features-" in target.log
        assert list(shared.iterdir()) == []  # its name went once the draft had opened it
    finally:
        for service in reversed(started):
            service.stop()
