"""python -m draft_service: start the draft service (see --help)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from draft_service.config import DraftConfig
from draft_service.startup import STEPS, build
from splitspec import compile_watch, telemetry
from splitspec.config_args import add_arguments, from_args
from splitspec.init_report import InitFailed, Startup, fail_startup, write_report
from splitspec.signals import leave, report_fatal_signals

log = logging.getLogger("draft_service")


def parse_args(argv: list[str] | None) -> DraftConfig:
    parser = argparse.ArgumentParser(
        prog="python -m draft_service",
        description="SplitSpec draft service: holds per-sequence draft state and drafts token "
                    "trees (EAGLE-3 head or standalone causal LM) for the target, over one "
                    "long-lived gRPC stream per target. Env SPLITSPEC_INJECT_INIT_FAULT=<step> "
                    "fails a start-up step; SPLITSPEC_INJECT_DRAFT_FAULT=malformed_tree corrupts "
                    "every other tree sent, =slow delays every 8th reply by 0.5 s (tests).")
    add_arguments(parser, DraftConfig)
    return from_args(DraftConfig, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s draft %(levelname)s %(message)s")
    report_fatal_signals()
    telemetry.setup("draft")
    compile_watch.watch()  # Triton variants first met while serving get logged
    startup = Startup("draft", STEPS)
    try:
        built = build(cfg, startup)
    except InitFailed as failed:
        return fail_startup(failed, cfg.init_report)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    write_report(startup.report, cfg.init_report)
    built.server.set_serving()
    compile_watch.serving()
    log.info("draft SERVING on %s", cfg.address)
    stop.wait()
    log.info("draft stopping")
    built.server.stop()
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    leave(main())
