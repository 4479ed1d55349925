"""``python -m sbpstream.kafka``: the Kafka gateway process (what ``sbpstream up`` starts)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

from sbpstream.kafka.gateway import KafkaGateway, run_gateway
from sbpstream.net.loop import run_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sbpstream.kafka")
    ap.add_argument("--pm", default=None, help="placement manager address(es)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9092)
    ap.add_argument("--advertise", default=None, help="host:port told to clients")
    ap.add_argument("--partitions", type=int, default=1, help="partitions of auto-created topics")
    ap.add_argument("--replicas", type=int, default=1, help="replicas of streams it creates")
    ap.add_argument("--no-auto-create", action="store_true")
    args = ap.parse_args(argv)
    ap_level = os.environ.get("SBPSTREAM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=ap_level, format="%(asctime)s %(name)s %(message)s")
    gw = KafkaGateway(args.pm, host=args.host, port=args.port, advertised=args.advertise,
                      auto_create=not args.no_auto_create, default_partitions=args.partitions,
                      replicas=args.replicas)
    with contextlib.suppress(KeyboardInterrupt):
        run_server(run_gateway(gw))


if __name__ == "__main__":
    main()
