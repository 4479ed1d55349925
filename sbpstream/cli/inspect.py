"""`sbpstream info|stats|connections|whoami|nodes|top`: introspection.

Without ``--node`` they ask the PM leader, found through the SDK's PM caller: every ``--pm``
address is tried, a follower's redirect is followed, and the whole search retries until
``--timeout-ms`` (so ``--pm dead,live`` works). Stream ids are shown with their names.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import typer

from sbpstream.cli.app import (
    EXIT_USAGE,
    UNSET,
    ClientIntrospection,
    PmOption,
    TimeoutOption,
    app,
    explain,
    fail,
    make_client,
    out_console,
    pm_leader,
    stream_names,
)
from sbpstream.client import AsyncClient
from sbpstream.client.types import pm_addresses
from sbpstream.introspect.wire import CALL_TIMEOUT_S
from sbpstream.net.loop import run
from sbpstream.protocol.errors import SbpError

T = TypeVar("T")

NodeOption = Annotated[str, typer.Option(
    "--node", help="Ask this server (a data node's HOST:PORT) instead of the PM leader.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")]


def _introspect(pm: str, node: str, timeout_ms: int,
                body: Callable[[ClientIntrospection, AsyncClient], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(introspection, client)`` against ``--node`` or the PM leader, on a connection
    of the command's client (``make_client``: TLS and credentials as every other command)."""
    try:
        pm_addresses(pm)
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)
    client = make_client(pm, timeout_ms)
    where = {"address": node or pm}

    async def main() -> T:
        async with client:
            address = node or await pm_leader(client)
            where["address"] = address
            timeout_s = min(CALL_TIMEOUT_S, max(1.0, timeout_ms / 1000))
            async with ClientIntrospection(client, address, timeout_s) as i:
                return await body(i, client)

    try:
        return run(main())
    except SbpError as exc:
        fail(f"{where['address']}: {explain(exc, pm)}")
    except TimeoutError:
        fail(f"{where['address']}: no answer within --timeout-ms {timeout_ms}")


async def _named(client: AsyncClient, rows: list[dict[str, Any]]) -> None:
    """Add each row's stream ``name`` (rows with a ``stream_id``), when the stream has one."""
    names = await stream_names(client, sorted({int(r["stream_id"]) for r in rows}))
    for r in rows:
        name = names.get(int(r["stream_id"]))
        if name:
            r["name"] = name


def _show(data: Any, as_json: bool, view: Callable[[Any], Any]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        out_console.print(view(data))


@app.command()
def info(pm: PmOption = "", node: NodeOption = "", as_json: JsonOption = False,
         timeout_ms: TimeoutOption = UNSET) -> None:
    """Server figures (INFO): uptime, version, role, requests, bytes and errors by opcode."""
    from sbpstream.introspect.views import info_view

    async def body(i: ClientIntrospection, c: AsyncClient) -> Any:
        return (await i.info())[1]

    _show(_introspect(pm, node, timeout_ms, body), as_json, info_view)


@app.command()
def stats(
    pm: PmOption = "", node: NodeOption = "", as_json: JsonOption = False,
    stream: Annotated[list[int] | None, typer.Option(
        "--stream", help="Only this stream (repeatable).")] = None,
    top: Annotated[int, typer.Option("--top", help="Without --stream: this many streams, "
                                     "highest rates first (0: the server's default).")] = 0,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Per-stream traffic (STATS): records and bytes in and out, per-minute rates, offsets,
    the last append's time."""
    from sbpstream.introspect.views import stats_view

    async def body(i: ClientIntrospection, c: AsyncClient) -> Any:
        figures = (await i.stats(stream or (), top))[1]
        await _named(c, figures.get("streams", []))
        return figures

    _show(_introspect(pm, node, timeout_ms, body), as_json, stats_view)


@app.command()
def connections(
    pm: PmOption = "", node: NodeOption = "", as_json: JsonOption = False,
    limit: Annotated[int, typer.Option("--limit", help="List at most this many.")] = 0,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """The server's open connections (CONNECTIONS)."""
    from sbpstream.introspect.views import connections_view

    async def body(i: ClientIntrospection, c: AsyncClient) -> Any:
        return (await i.connections(limit))[1]

    _show(_introspect(pm, node, timeout_ms, body), as_json, connections_view)


@app.command()
def whoami(pm: PmOption = "", node: NodeOption = "", as_json: JsonOption = False,
           timeout_ms: TimeoutOption = UNSET) -> None:
    """This CLI's own connection as the server sees it (WHOAMI)."""
    from sbpstream.introspect.views import whoami_view

    async def body(i: ClientIntrospection, c: AsyncClient) -> Any:
        return (await i.whoami())[1]

    _show(_introspect(pm, node, timeout_ms, body), as_json, whoami_view)


NODES_KEYS = ("nodes", "under_replicated", "clients", "stream_count", "streams_truncated")


@app.command()
def nodes(pm: PmOption = "", as_json: JsonOption = False,
          timeout_ms: TimeoutOption = UNSET) -> None:
    """The PM's cluster view: data nodes (liveness, heartbeat, reported load, ranges),
    under-replicated ranges, live clients."""
    from sbpstream.introspect.views import nodes_view

    async def body(i: ClientIntrospection, c: AsyncClient) -> Any:
        info = (await i.info())[1]
        if "nodes" not in info:
            return None
        await _named(c, info["under_replicated"])
        return {k: info[k] for k in NODES_KEYS}

    view = _introspect(pm, "", timeout_ms, body)
    if view is None:
        fail("the server is not a PM (no cluster view)")
    _show(view, as_json, nodes_view)


@app.command()
def top(
    pm: PmOption = "",
    streams: Annotated[int, typer.Option("--streams", help="Streams shown.")] = 10,
    interval_s: Annotated[float, typer.Option("--interval-s", help="Refresh period.")] = 1.0,
    iterations: Annotated[int, typer.Option(
        "--iterations", help="Stop after this many refreshes (0: until Ctrl-C).")] = 0,
    once: Annotated[bool, typer.Option("--once", help="One snapshot, then exit.")] = False,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """A live view of the cluster, refreshed every second: nodes, top streams, connections.

    On a terminal the view is redrawn in place; otherwise (a pipe, a file) one snapshot is
    printed per interval."""
    from rich.live import Live

    from sbpstream.introspect.views import top_view

    limit = 1 if once else iterations

    async def snapshots(i: ClientIntrospection, c: AsyncClient,
                        show: Callable[[Any], None]) -> None:
        n = 0
        while True:
            info = (await i.info())[1]
            figures = (await i.stats((), streams))[1]
            conns = (await i.connections())[1]
            await _named(c, figures.get("streams", []) + info.get("under_replicated", []))
            show(top_view(info, figures, conns))
            n += 1
            if limit and n >= limit:
                return
            await asyncio.sleep(interval_s)

    async def body(i: ClientIntrospection, c: AsyncClient) -> None:
        if out_console.is_terminal:
            with Live(console=out_console, auto_refresh=False) as live:
                await snapshots(i, c, lambda v: live.update(v, refresh=True))
        else:
            def printed(view: Any) -> None:
                out_console.print(view)
                out_console.file.flush()

            await snapshots(i, c, printed)

    _introspect(pm, "", timeout_ms, body)
