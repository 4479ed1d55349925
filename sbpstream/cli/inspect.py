"""`sbpstream info|stats|connections|whoami|nodes|top`: introspection."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import typer

from sbpstream.cli.app import (
    DEFAULT_TIMEOUT_MS,
    EXIT_USAGE,
    ClientIntrospection,
    PmOption,
    _client,
    app,
    explain,
    fail,
    out_console,
)
from sbpstream.client.types import (
    DEFAULT_PM,
    pm_addresses,
)
from sbpstream.net.loop import run
from sbpstream.protocol.errors import (
    SbpError,
)

# ----------------------------------------------------------------------------- introspection

T = TypeVar("T")

NodeOption = Annotated[str, typer.Option(
    "--node", help="Ask this server (a data node's HOST:PORT) instead of the PM.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")]


def _introspect(pm: str, node: str, body: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(Introspection)`` against ``--node`` or the first PM address, on a connection
    of the command's client (``_client``: TLS and credentials as every other command)."""
    try:
        address = node or pm_addresses(pm)[0]
    except ValueError as exc:
        fail(f"--pm/--node: {exc}", EXIT_USAGE)
    client = _client(pm, DEFAULT_TIMEOUT_MS)

    async def main() -> T:
        async with client, ClientIntrospection(client, address) as i:
            return await body(i)

    try:
        return run(main())
    except SbpError as exc:
        fail(f"{address}: {explain(exc, pm)}")


def _show(data: Any, as_json: bool, view: Callable[[Any], Any]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        out_console.print(view(data))


@app.command()
def info(pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False) -> None:
    """Server figures (INFO): uptime, version, role, requests, bytes and errors by opcode."""
    from sbpstream.introspect.views import info_view

    _show(_introspect(pm, node, lambda i: i.info())[1], as_json, info_view)


@app.command()
def stats(
    pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False,
    stream: Annotated[list[int] | None, typer.Option(
        "--stream", help="Only this stream (repeatable).")] = None,
    top: Annotated[int, typer.Option("--top", help="Without --stream: this many streams, "
                                     "highest rates first (0: the server's default).")] = 0,
) -> None:
    """Per-stream traffic (STATS): records and bytes in and out, per-minute rates, offsets."""
    from sbpstream.introspect.views import stats_view

    _show(_introspect(pm, node, lambda i: i.stats(stream or (), top))[1], as_json, stats_view)


@app.command()
def connections(
    pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False,
    limit: Annotated[int, typer.Option("--limit", help="List at most this many.")] = 0,
) -> None:
    """The server's open connections (CONNECTIONS)."""
    from sbpstream.introspect.views import connections_view

    _show(_introspect(pm, node, lambda i: i.connections(limit))[1], as_json, connections_view)


@app.command()
def whoami(pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False) -> None:
    """This CLI's own connection as the server sees it (WHOAMI)."""
    from sbpstream.introspect.views import whoami_view

    _show(_introspect(pm, node, lambda i: i.whoami())[1], as_json, whoami_view)


@app.command()
def nodes(pm: PmOption = DEFAULT_PM, as_json: JsonOption = False) -> None:
    """The PM's cluster view: data nodes (liveness, heartbeat, reported load, ranges),
    under-replicated ranges, live clients."""
    from sbpstream.introspect.views import nodes_view

    body = _introspect(pm, "", lambda i: i.info())[1]
    keys = ("nodes", "under_replicated", "clients", "stream_count", "streams_truncated")
    if "nodes" not in body:
        fail("the server is not a PM (no cluster view)")
    _show({k: body[k] for k in keys}, as_json, nodes_view)


@app.command()
def top(
    pm: PmOption = DEFAULT_PM,
    streams: Annotated[int, typer.Option("--streams", help="Streams shown.")] = 10,
    interval_s: Annotated[float, typer.Option("--interval-s", help="Refresh period.")] = 1.0,
    iterations: Annotated[int, typer.Option(
        "--iterations", help="Stop after this many refreshes (0: until Ctrl-C).")] = 0,
) -> None:
    """A live view of the cluster, refreshed every second: nodes, top streams, connections."""
    from rich.live import Live

    from sbpstream.introspect.views import top_view

    async def body(i: Any) -> None:
        with Live(console=out_console, auto_refresh=False) as live:
            n = 0
            while True:
                info = (await i.info())[1]
                figures = (await i.stats((), streams))[1]
                conns = (await i.connections())[1]
                live.update(top_view(info, figures, conns), refresh=True)
                n += 1
                if iterations and n >= iterations:
                    return
                await asyncio.sleep(interval_s)

    _introspect(pm, "", body)


