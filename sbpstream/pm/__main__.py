"""``python -m sbpstream.pm``: run one Placement Manager in the foreground.

Logs structured ``key=value`` lines to stderr. SIGINT/SIGTERM shut it down cleanly (in-flight
requests drain, soft state is flushed, the metadata file is closed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from sbpstream.auth.cli_args import add_security_args, security_from_args
from sbpstream.net.loop import run_server
from sbpstream.pm.config import (
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_NODE_TIMEOUT_MS,
    DEFAULT_PM_PORT,
    PmConfig,
)
from sbpstream.pm.server import run_pm

LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sbpstream.pm", description=__doc__)
    p.add_argument("--port", type=int, default=DEFAULT_PM_PORT,
                   help=f"port to listen on (0 = any free port; default {DEFAULT_PM_PORT})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--metadata", required=True,
                   help="metadata store: sqlite:PATH, or etcd://HOST:PORT[,HOST:PORT...]"
                   "[/PREFIX][?lease_ttl_s=3] for several PMs with one leader")
    p.add_argument("--advertise", default="", help="HOST:PORT others use to reach this PM")
    p.add_argument("--heartbeat-interval-ms", type=int, default=DEFAULT_HEARTBEAT_INTERVAL_MS,
                   help="expected heartbeat period; the liveness check runs at this period")
    p.add_argument("--node-timeout-ms", type=int, default=DEFAULT_NODE_TIMEOUT_MS,
                   help="a data node silent this long is dead; its writable ranges move")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus /metrics over HTTP on this port (-1: off, 0: any)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --auth, serve /metrics without credentials (else a scrape "
                   "needs a Bearer token or Basic)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_security_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> PmConfig:
    return PmConfig(
        metadata=args.metadata,
        port=args.port,
        host=args.host,
        advertise=args.advertise,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        node_timeout_ms=args.node_timeout_ms,
        metrics_port=args.metrics_port,
        public_metrics=args.public_metrics,
        security=security_from_args(args),
    )


async def _serve(config: PmConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_pm(config, stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    config = config_from_args(args)
    try:
        config.validate()
        config.security.validate(config.host)
    except ValueError as e:
        print(f"sbpstream pm: {e}", file=sys.stderr)
        return 2
    try:
        run_server(_serve(config))
    except Exception as e:  # a bind or metadata failure at start, reported once, clearly
        logging.getLogger("sbpstream.pm").error("event=pm_failed error=%r", str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
