"""`sbpstream node ...`: draining and removing data nodes (docs/operations.md, "Draining a data
node"), and the node list."""

from __future__ import annotations

import asyncio
from typing import Annotated, Final

import typer
from rich.table import Table

from sbpstream.cli.app import (
    EXIT_USAGE,
    UNSET,
    PmOption,
    TimeoutOption,
    app,
    fail,
    out_console,
    run_command,
)
from sbpstream.client import AsyncClient
from sbpstream.client.types import DrainStatus

WAIT_POLL_S: Final = 1.0
"""How often ``node drain --wait`` asks the PM how many ranges are left (one cheap request;
the PM moves ranges once per liveness sweep)."""

node_app = typer.Typer(
    help="Data nodes: drain one (move every range off it), cancel, status, remove, list.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(node_app, name="node")

NodeArg = Annotated[str, typer.Argument(metavar="NODE",
                                        help="The data node: its id, or its HOST:PORT.")]


def _ref(node: str) -> int | str:
    return int(node) if node.isdigit() else node


def _line(s: DrainStatus) -> str:
    state = "live" if s.live else "not live"
    if not s.draining:
        return f"data node {s.node_id} ({s.address}, {state}): not draining, {s.ranges_left} " \
               "range(s)"
    if s.complete:
        return (f"data node {s.node_id} ({s.address}, {state}) is drained: no range lists it; "
                f"stop it, then `sbpstream node remove {s.node_id}`")
    return (f"data node {s.node_id} ({s.address}, {state}) draining: {s.ranges_left} "
            f"range(s) left ({s.writable_left} writable)")


@node_app.command("drain")
def drain(
    node: NodeArg,
    pm: PmOption = "",
    wait: Annotated[bool, typer.Option(
        "--wait", help="Print the ranges left as they move until the drain completes.")] = False,
    cancel: Annotated[bool, typer.Option(
        "--cancel", help="Cancel the node's drain (moved ranges stay moved).")] = False,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Drain a data node: the PM places nothing new on it, seals its writable ranges and
    reopens them on other nodes, copies its sealed ranges elsewhere and then drops it from
    their replica sets. Complete when no range lists it: then stop it and `node remove` it."""
    if wait and cancel:
        fail("--wait and --cancel do not go together", EXIT_USAGE)
    ref = _ref(node)

    async def body(c: AsyncClient) -> DrainStatus:
        if cancel:
            return await c.admin.cancel_drain(ref)
        st = await c.admin.drain_node(ref)
        out_console.print(_line(st), markup=False)
        if not wait:
            return st
        last = (st.ranges_left, st.writable_left)
        while not st.complete:
            await asyncio.sleep(WAIT_POLL_S)
            (st,) = await c.admin.drain_status(st.node_id)
            if not st.draining:
                fail(f"the drain of data node {st.node_id} was cancelled with "
                     f"{st.ranges_left} range(s) left")
            if (st.ranges_left, st.writable_left) != last or st.complete:
                last = (st.ranges_left, st.writable_left)
                out_console.print(_line(st), markup=False)
        return st

    st = run_command(pm, timeout_ms, body)
    if cancel:
        out_console.print(f"data node {st.node_id}: drain cancelled ({st.ranges_left} range(s) "
                          "on it)", markup=False)


@node_app.command("status")
def status(
    node: Annotated[str, typer.Argument(
        metavar="NODE", help="A data node (id or HOST:PORT); default: every draining node.")
    ] = "",
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Drain state: the named node, or every draining node."""
    ref: int | str | None = _ref(node) if node else None
    states = run_command(pm, timeout_ms, lambda c: c.admin.drain_status(ref))
    if not states:
        out_console.print("no data node is draining", markup=False)
        return
    t = Table("NODE", "ADDRESS", "LIVE", "DRAINING", "RANGES LEFT", "WRITABLE LEFT", box=None)
    for s in states:
        t.add_row(str(s.node_id), s.address, "yes" if s.live else "no",
                  ("drained" if s.complete else "yes") if s.draining else "no",
                  str(s.ranges_left), str(s.writable_left))
    out_console.print(t)


@node_app.command("remove")
def remove(node: NodeArg, pm: PmOption = "", timeout_ms: TimeoutOption = UNSET) -> None:
    """Forget a stopped data node that no range lists (after its drain, or a dead node whose
    replicas were re-created elsewhere). Refused while it runs or holds a range."""
    ref = _ref(node)
    run_command(pm, timeout_ms, lambda c: c.admin.remove_node(ref))
    out_console.print(f"data node {node} removed", markup=False)


@node_app.command("list")
def node_list(pm: PmOption = "", as_json: Annotated[bool, typer.Option(
        "--json", help="The PM's JSON.")] = False, timeout_ms: TimeoutOption = UNSET) -> None:
    """Every data node: liveness, ranges, load, and draining state (`sbpstream nodes`)."""
    from sbpstream.cli.inspect import nodes

    nodes(pm=pm, as_json=as_json, timeout_ms=timeout_ms)
