"""python -m target_service: start the target service (see --help).

With --tp N this process is rank 0: it starts ranks 1..N-1 itself
(target_service.ranks), or under torchrun finds its rank in RANK/WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from splitspec import compile_watch, telemetry
from splitspec.config_args import add_arguments, from_args
from splitspec.grpc_server import ServiceServer
from splitspec.init_report import InitFailed, Startup, fail_startup, write_report
from splitspec.signals import StopSignals, leave, report_fatal_signals
from target_service.config import TargetConfig
from target_service.engine import Engine
from target_service.ranks import RankSet, free_address
from target_service.startup import STEPS, Placement, build, run_rank

# How long a failed step waits for the rank watcher to report a rank that died, which is
# then the failure every stream reports (the collective's own error names no rank).
SETTLE_LOST_RANK_S = 2.0

log = logging.getLogger("target_service")


def parse_args(argv: list[str] | None) -> TargetConfig:
    parser = argparse.ArgumentParser(
        prog="python -m target_service",
        description="SplitSpec target service: serves the big model, verifies draft token trees.")
    add_arguments(parser, TargetConfig)
    cfg = from_args(TargetConfig, parser.parse_args(argv))
    if not cfg.drain_timeout_s >= 0:
        parser.error(f"--drain-timeout-s must be >= 0 (got {cfg.drain_timeout_s})")
    return cfg


def placement(cfg: TargetConfig) -> Placement:
    """Rank, group size and rendezvous: from torchrun's variables, else --tp (this is rank 0)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        size = int(os.environ["WORLD_SIZE"])
        if cfg.tp not in (1, size):
            raise SystemExit(f"--tp {cfg.tp} differs from torchrun's WORLD_SIZE {size}")
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return Placement(int(os.environ["RANK"]), size, address, torchrun=True)
    if cfg.tp < 1:
        raise SystemExit(f"--tp must be at least 1, got {cfg.tp}")
    return Placement(0, cfg.tp, free_address() if cfg.tp > 1 else "")


def drain(server: ServiceServer, engine: Engine, timeout_s: float, interrupt: threading.Event,
          crashed: threading.Event) -> None:
    """A signal asked the target to stop: health NOT_SERVING, new requests refused (the
    gateway answers them UNAVAILABLE), and the requests in flight get up to ``timeout_s`` to
    finish, unless ``interrupt`` (a second signal) or ``crashed`` cuts the wait short. Those
    still running then end with the target's stream (the gateway fails them UNAVAILABLE)."""
    server.set_not_serving()
    engine.drain()
    in_flight = engine.num_in_flight
    log.info("target stopping: NOT_SERVING, new requests refused; waiting up to %g s for the "
             "%d request(s) in flight (--drain-timeout-s; a second signal stops at once)",
             timeout_s, in_flight)
    deadline = time.monotonic() + timeout_s
    # (a request taken from the inbox in the instant this looks is refused, and its refusal
    # is sent before the engine's loop looks at its stop event again)
    while not engine.is_idle():
        if interrupt.is_set() or crashed.is_set() or time.monotonic() >= deadline:
            log.warning("target stopping: %d request(s) still in flight; they end with the "
                        "target's stream", engine.num_in_flight)
            return
        interrupt.wait(0.02)
    log.info("target stopping: the requests in flight finished")


def profiled(run: Callable[..., None], out: Path) -> Callable[..., None]:
    """``run`` (the engine's loop) under cProfile, its statistics written to ``out`` when it
    returns (--profile-out). Before Python 3.12 only this thread is profiled; from 3.12
    cProfile uses sys.monitoring, which sees every thread while it is on."""
    def run_profiled(*args: object) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            run(*args)
        finally:
            profile.disable()
            profile.dump_stats(out)
            log.info("the engine thread's profile is in %s (python -m pstats %s)", out, out)
    return run_profiled


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    where = placement(cfg)
    if where.rank != 0:  # a torchrun rank other than 0
        run_rank(where.rank, None, cfg, where)
        return 0
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s target %(levelname)s %(message)s")
    report_fatal_signals()
    telemetry.setup("target")
    compile_watch.watch()  # Triton variants first met while serving get logged
    stop = threading.Event()  # the engine's loop ends
    wake = threading.Event()  # main's wait ends: a signal, a crash or a lost rank
    crashed: list[BaseException] = []

    def on_crash(exc: BaseException) -> None:
        crashed.append(exc)
        stop.set()
        wake.set()

    engine_threads: list[threading.Thread] = []

    def start_engine(engine: Engine) -> None:
        run = engine.run if cfg.profile_out is None else profiled(engine.run, cfg.profile_out)
        thread = threading.Thread(target=run, args=(stop, on_crash), name="engine", daemon=True)
        thread.start()
        engine_threads.append(thread)

    startup = Startup("target", STEPS)
    ranks = None
    if where.size > 1 and not where.torchrun:
        ranks = RankSet(startup.report, where.size, run_rank, (cfg, where), cfg.init_report)
    try:
        built = build(cfg, startup, start_engine, where,
                      ranks.wait_ready if ranks is not None else lambda: None)
    except InitFailed as failed:
        stop.set()
        if ranks is not None:
            ranks.fail_startup()  # names the rank that failed first; does not return
        return fail_startup(failed, cfg.init_report)
    if ranks is not None:
        startup.report.ranks = [ranks.reports[r] for r in sorted(ranks.reports)]

        def rank_lost(message: str) -> None:
            built.server.set_not_serving()
            built.engine.abort(message)
            crashed.append(RuntimeError(message))
            stop.set()
            wake.set()

        ranks.on_lost = rank_lost
        ranks.serving = True
        built.engine.settle_failure = lambda: ranks.wait_lost(SETTLE_LOST_RANK_S)
    signals = StopSignals(wake)
    write_report(startup.report, cfg.init_report)
    built.server.set_serving()
    compile_watch.serving()
    log.info("target SERVING on %s (%d rank%s)", cfg.address, where.size,
             "s" if where.size > 1 else "")
    wake.wait()
    if not crashed:
        drain(built.server, built.engine, cfg.drain_timeout_s, signals.again, stop)
    stop.set()
    if ranks is not None and not crashed:
        ranks.stopping()  # the ranks exit when the engine releases them: not a failure
    built.server.stop()
    if built.draft is not None:
        built.draft.link.close()
    if crashed:
        log.error("target stopped: %s", crashed[0])
        if ranks is not None:  # the engine thread may be stuck in a collective: leave now
            ranks.kill()
            leave(1)
        return 1
    for thread in engine_threads:  # its last flush and the runner's stop, before we leave
        thread.join(10.0)
    if ranks is not None:
        ranks.join(10.0)
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    leave(main())
