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


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
def test_every_command_line_parses(stack):
    services = load(GPU)["services"] if stack == "gpu" else merged()
    assert set(services) == set(PARSERS)
    for name, spec in services.items():
        argv = defaults(spec["command"])
        assert argv[:3] == ["python", "-m", {"draft": "draft_service", "target": "target_service",
                                             "gateway": "gateway"}[name]]
        PARSERS[name](argv[3:])  # argparse exits on an unknown flag or a bad value
        if stack == "cpu":
            assert "deploy" not in spec and "cuda" not in argv, name
