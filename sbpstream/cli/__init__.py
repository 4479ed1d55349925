"""The ``sbpstream`` command line, one module per command family.

``app`` (global options and shared helpers), ``servers`` (up, pm, datanode, kafka-gateway),
``streams``, ``records`` (produce, consume), ``groups``, ``quotas``, ``security`` (certs, user,
acl), ``inspect`` (info, stats, connections, whoami, nodes, top), ``tools`` (bench, pipeline,
check) and ``nodes`` (node drain, status, remove, list). Importing the package registers
every command on :data:`app`, in the order ``--help`` lists them.
"""

from __future__ import annotations

from importlib import import_module

from sbpstream.cli.app import app, main

FAMILIES = ("servers", "streams", "security", "records", "groups", "tools", "inspect", "quotas",
            "nodes")
"""The command modules, in the order their commands are listed by ``sbpstream --help``."""

for _family in FAMILIES:
    import_module(f"sbpstream.cli.{_family}")
import_module("sbpstream.cli.security").add_commands(app)  # certs, user, acl

__all__ = ["FAMILIES", "app", "main"]
