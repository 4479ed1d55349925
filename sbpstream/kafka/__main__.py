"""``python -m sbpstream.kafka``: the Kafka gateway process (what ``sbpstream up`` starts)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from sbpstream.kafka.gateway import KafkaGateway, run_gateway
from sbpstream.kafka.sasl import LISTENERS, PLAINTEXT
from sbpstream.net.loop import run_server


def add_listener_args(ap: argparse.ArgumentParser) -> None:
    """The listener and TLS flags (docs/kafka.md, Security)."""
    g = ap.add_argument_group("security (docs/kafka.md)")
    g.add_argument("--listener", default=PLAINTEXT, choices=LISTENERS,
                   help="Kafka security protocol of the listener")
    g.add_argument("--tls-cert", default="", help="PEM certificate chain (SSL, SASL_SSL)")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="",
                   help="PEM CA verifying the PM and data nodes (TLS to the cluster)")
    g.add_argument("--allow-sasl-plaintext", action="store_true",
                   help="allow SASL_PLAINTEXT on an address beyond loopback")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sbpstream.kafka")
    ap.add_argument("--pm", default=None, help="placement manager address(es)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9092)
    ap.add_argument("--advertise", default=None, help="host:port told to clients")
    ap.add_argument("--partitions", type=int, default=1, help="partitions of auto-created topics")
    ap.add_argument("--replicas", type=int, default=1, help="replicas of streams it creates")
    ap.add_argument("--no-auto-create", action="store_true")
    add_listener_args(ap)
    args = ap.parse_args(argv)
    ap_level = os.environ.get("SBPSTREAM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=ap_level, format="%(asctime)s %(name)s %(message)s")
    try:
        gw = KafkaGateway(args.pm, host=args.host, port=args.port, advertised=args.advertise,
                          auto_create=not args.no_auto_create,
                          default_partitions=args.partitions, replicas=args.replicas,
                          listener=args.listener, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          tls_ca=args.tls_ca, allow_sasl_plaintext=args.allow_sasl_plaintext)
    except ValueError as exc:
        sys.exit(f"kafka gateway: {exc}")
    with contextlib.suppress(KeyboardInterrupt):
        run_server(run_gateway(gw))


if __name__ == "__main__":
    main()
