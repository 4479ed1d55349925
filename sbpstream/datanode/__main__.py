"""``python -m sbpstream.datanode --dir DIR --port PORT --pm HOST:PORT[,...] ...``"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from sbpstream.auth.cli_args import add_security_args, security_from_args
from sbpstream.datanode.config import DEFAULT_HOST, DEFAULT_PM, DataNodeConfig
from sbpstream.datanode.limits import DEFAULT_COMPACTION_INTERVAL_MS, DEFAULT_RETENTION_INTERVAL_MS
from sbpstream.datanode.node import run_datanode
from sbpstream.net.loop import run_server
from sbpstream.store import FsyncPolicy

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def parse_args(argv: Sequence[str] | None = None) -> DataNodeConfig:
    p = argparse.ArgumentParser(prog="python -m sbpstream.datanode",
                                description="Run an sbpstream data node.")
    p.add_argument("--dir", required=True, type=Path, help="data directory")
    p.add_argument("--port", type=int, default=0, help="listen port (0: any free port)")
    p.add_argument("--host", default=DEFAULT_HOST, help="listen address")
    p.add_argument("--pm", default=DEFAULT_PM, help="PM addresses, comma-separated host:port")
    p.add_argument("--advertise", default="", help="host:port clients use (default host:port)")
    p.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    p.add_argument("--metrics-interval-ms", type=int, default=5000)
    p.add_argument("--fsync", choices=[f.value for f in FsyncPolicy], default="always")
    p.add_argument("--fsync-interval-ms", type=int, default=10)
    p.add_argument("--retention-interval-ms", type=int, default=DEFAULT_RETENTION_INTERVAL_MS,
                   help="how often retention runs and stream configs are refreshed")
    p.add_argument("--compaction-interval-ms", type=int, default=DEFAULT_COMPACTION_INTERVAL_MS,
                   help="how often compaction looks for segments to reclaim")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus /metrics over HTTP on this port (-1: off, 0: any)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --auth, serve /metrics without credentials (else a scrape "
                   "needs a Bearer token or Basic)")
    p.add_argument("--log-level", default="INFO")
    add_security_args(p)
    a = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=a.log_level.upper(), format=LOG_FORMAT)
    try:
        return DataNodeConfig(
            directory=a.dir, port=a.port, host=a.host, pm=DataNodeConfig.parse_pm_list(a.pm),
            advertise=a.advertise, heartbeat_interval_ms=a.heartbeat_interval_ms,
            metrics_interval_ms=a.metrics_interval_ms, fsync=FsyncPolicy(a.fsync),
            fsync_interval_ms=a.fsync_interval_ms,
            retention_interval_ms=a.retention_interval_ms,
            compaction_interval_ms=a.compaction_interval_ms, metrics_port=a.metrics_port,
            public_metrics=a.public_metrics,
            security=security_from_args(a))
    except ValueError as exc:
        p.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:  # files, modes, auth in clear: refused before anything starts, in one line
        config.security.validate(config.host)
    except ValueError as exc:
        print(f"sbpstream datanode: {exc}", file=sys.stderr)
        return 2
    try:
        run_server(run_datanode(config))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        logging.getLogger("sbpstream.datanode").critical("event=fatal error=%r", str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
