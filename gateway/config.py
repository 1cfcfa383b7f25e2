"""The gateway's configuration: one frozen dataclass; the command line is built from it."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from gateway.policy import adaptive_shapes, parse_table
from splitspec.builtin import BUILTIN_TARGET
from splitspec.config_args import add_arguments, from_args
from splitspec.config_args import option as _flag
from splitspec.v1 import common_pb2


@dataclass(frozen=True)
class GatewayConfig:
    """Every gateway setting. Invariant: a constructed config is valid (checked in __post_init__)."""

    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(50051, "port to listen on (0 = any free port)")
    target: str = _flag("localhost:50052", "address of the target service")
    model: Path = _flag(BUILTIN_TARGET,
                        "checkpoint folder holding tokenizer.json; must be the target's tokenizer")
    max_running: int = _flag(0, "requests admitted to the target at once "
                                "(0 = the target's max_running)")
    max_queued: int = _flag(256, "requests waiting at the gateway when max_running are running; "
                                 "beyond that requests fail with RESOURCE_EXHAUSTED")
    default_max_new_tokens: int = _flag(128, "max_new_tokens of requests that do not set it "
                                             "(lowered to fit the target's max_context)")
    spec_policy: str = _flag("adaptive", "speculation policy: adaptive (off or a draft budget "
                             "per batch size, from measured step times and acceptance), static "
                             "(--spec-disable-batch-threshold) or table (--spec-policy-table)",
                             ("adaptive", "static", "table"))
    spec_policy_table: str = _flag("", "with --spec-policy table: MAX_BATCH:NODES[/TOPK/STEPS],... "
                                       "e.g. '4:8/4/4,16:4/1/4,*:0' (0 = off, * = any batch size)")
    spec_adaptive_shapes: str = _flag("", "with --spec-policy adaptive: the draft budgets it "
                                          "chooses among besides off, NODES[/TOPK/STEPS],... "
                                          "(empty = the draft shape and a chain of 3 nodes; the "
                                          "target's --graph-tree-sizes should hold each size)")
    spec_disable_batch_threshold: int = _flag(
        0, "with --spec-policy static: turn speculation off when the decode batch is larger "
           "than this (0 = never off)")
    num_draft_tokens: int = _flag(0, "draft tree nodes to verify per step (0 = the target's default)")
    topk: int = _flag(0, "draft tree branching per level, 1 = chain (0 = the target's default)")
    num_steps: int = _flag(0, "draft tree depth (0 = the target's default)")
    connect_timeout_s: float = _flag(120.0, "seconds to wait for the target to be SERVING at "
                                            "start-up, and for each warmup generation")
    drain_timeout_s: float = _flag(25.0, "on SIGTERM / SIGINT: seconds to let requests in flight "
                                         "finish (new ones get UNAVAILABLE) before stopping; a "
                                         "second signal stops at once")
    init_report: Path | None = _flag(None, "also write the JSON init report to this file")
    log_level: str = _flag("INFO", "logging level (DEBUG, INFO, WARNING, ERROR)")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (got {self.port})")
        for name in ("max_running", "max_queued", "spec_disable_batch_threshold",
                     "num_draft_tokens", "topk", "num_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if self.default_max_new_tokens < 1:
            raise ValueError(
                f"--default-max-new-tokens must be >= 1 (got {self.default_max_new_tokens})")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"--log-level must be DEBUG, INFO, WARNING or ERROR (got {self.log_level!r})")
        own_flags = (("spec-disable-batch-threshold", self.spec_disable_batch_threshold, "static"),
                     ("spec-policy-table", self.spec_policy_table, "table"),
                     ("spec-adaptive-shapes", self.spec_adaptive_shapes, "adaptive"))
        for flag, value, policy in own_flags:
            if value and self.spec_policy != policy:  # a flag the chosen policy would ignore
                raise ValueError(f"--{flag} applies to --spec-policy {policy} "
                                 f"(the policy is {self.spec_policy})")
        some_shape = common_pb2.DraftShape(num_draft_tokens=8, topk=1, num_steps=1)
        if self.spec_policy == "table":  # a bad table fails load_config, saying what is wrong
            parse_table(self.spec_policy_table, some_shape)
        if self.spec_policy == "adaptive":  # the same for the adaptive policy's budgets
            adaptive_shapes(self.spec_adaptive_shapes, some_shape)
        if not self.connect_timeout_s > 0:
            raise ValueError(f"--connect-timeout-s must be > 0 (got {self.connect_timeout_s})")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout-s must be >= 0 (got {self.drain_timeout_s})")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return from_args(cls, args)


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field, defaults taken from the dataclass."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="SplitSpec gateway: validates, tokenizes, queues and admits requests, "
                    "streams text back, matches stop strings and sets the speculation policy.",
    )
    add_arguments(parser, GatewayConfig)
    return parser
