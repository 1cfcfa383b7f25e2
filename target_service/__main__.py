"""python -m target_service: start the target service (see --help)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from splitspec.config_args import add_arguments, from_args
from splitspec.init_report import InitFailed, Startup, fail_startup, write_report
from target_service.config import TargetConfig
from target_service.engine import Engine
from target_service.startup import STEPS, build

log = logging.getLogger("target_service")


def parse_args(argv: list[str] | None) -> TargetConfig:
    parser = argparse.ArgumentParser(
        prog="python -m target_service",
        description="SplitSpec target service: serves the big model, verifies draft token trees.")
    add_arguments(parser, TargetConfig)
    return from_args(TargetConfig, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s target %(levelname)s %(message)s")
    stop = threading.Event()
    crashed: list[BaseException] = []

    def on_crash(exc: BaseException) -> None:
        crashed.append(exc)
        stop.set()

    def start_engine(engine: Engine) -> None:
        threading.Thread(target=engine.run, args=(stop, on_crash), name="engine", daemon=True).start()

    startup = Startup("target", STEPS)
    try:
        built = build(cfg, startup, start_engine)
    except InitFailed as failed:
        stop.set()
        return fail_startup(failed, cfg.init_report)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    write_report(startup.report, cfg.init_report)
    built.server.set_serving()
    log.info("target SERVING on %s", cfg.address)
    stop.wait()
    built.server.stop()
    if built.draft is not None:
        built.draft.link.close()
    if crashed:
        log.error("target stopped: the engine failed (%s)", crashed[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
