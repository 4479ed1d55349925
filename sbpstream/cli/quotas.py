"""`sbpstream quota ...`: quotas and live counters."""

from __future__ import annotations

from typing import Annotated, TypeVar

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
from sbpstream.protocol.errors import (
    SbpError,
)
from sbpstream.protocol.messages import QuotaCountersResponse
from sbpstream.quota.counters import TtlType
from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec
from sbpstream.quota.model import validate as validate_quota

# ------------------------------------------------------------------------------------ quotas

T = TypeVar("T")

quota_app = typer.Typer(
    help="Quotas per user, user+client id, client id, stream, or default: set, list, delete; "
    "live counters.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(quota_app, name="quota")

def _entity(client_id: str | None, stream: int | None, default: bool,
            user: str | None) -> tuple[QuotaKind, str, str]:
    """The quota entity the options name: (kind, client id or stream id, principal)."""
    if user is not None and stream is None and not default:
        if client_id is not None:
            return QuotaKind.CLIENT, client_id, user  # that user's connections with that id
        return QuotaKind.USER, "", user
    given = [x for x in (client_id is not None, stream is not None, default) if x]
    if len(given) != 1 or user is not None:
        fail("name exactly one of --user NAME [--client-id ID], --client-id ID, --stream S, "
             "--default", EXIT_USAGE)
    if client_id is not None:
        return QuotaKind.CLIENT, client_id, ""
    if stream is not None:
        return QuotaKind.STREAM, str(stream), ""
    return QuotaKind.DEFAULT, "", ""


QUserOption = Annotated[str | None, typer.Option(
    "--user", help="A user's (principal's) quota, for all its client ids; with --client-id, "
    "for that client id of the user only. (Authenticate with the global --user before "
    "'quota', or $SBPSTREAM_USER.)")]
QClientOption = Annotated[str | None, typer.Option("--client-id", help="A client id's quota.")]
QStreamOption = Annotated[int | None, typer.Option("--stream", help="A stream's quota.")]
QDefaultOption = Annotated[bool, typer.Option(
    "--default", help="The default quota (each client id without its own).")]


def _rate(n: int | None) -> str:
    return "-" if n is None or n == UNLIMITED else f"{n:,}"


@quota_app.command("set")
def quota_set(
    pm: PmOption = "",
    user: QUserOption = None,
    client_id: QClientOption = None,
    stream: QStreamOption = None,
    default: QDefaultOption = False,
    produce_bytes_per_s: Annotated[int | None, typer.Option(
        "--produce-bytes-per-s", help="Bytes/s a client (or all, for a stream) may append.")
                                   ] = None,
    fetch_bytes_per_s: Annotated[int | None, typer.Option(
        "--fetch-bytes-per-s", help="Bytes/s it may fetch.")] = None,
    requests_per_s: Annotated[int | None, typer.Option(
        "--requests-per-s", help="APPEND and FETCH requests/s.")] = None,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Create or replace a quota (each data node enforces it for its own traffic). Which one
    applies, per rate: --user with --client-id, then --user, then --client-id, then --default."""
    kind, name, principal = _entity(client_id, stream, default, user)
    spec = QuotaSpec(kind, name,
                     UNLIMITED if produce_bytes_per_s is None else produce_bytes_per_s,
                     UNLIMITED if fetch_bytes_per_s is None else fetch_bytes_per_s,
                     UNLIMITED if requests_per_s is None else requests_per_s, principal)
    try:
        validate_quota(spec)
    except SbpError as exc:
        fail(exc.message, EXIT_USAGE)
    q = run_command(pm, timeout_ms, lambda c: c.set_quota(spec))
    out_console.print(f"quota {q.key}: produce {_rate(q.produce_bytes_per_s)} B/s, fetch "
                      f"{_rate(q.fetch_bytes_per_s)} B/s, requests {_rate(q.requests_per_s)}/s",
                      markup=False)


@quota_app.command("list")
def quota_list(pm: PmOption = "", timeout_ms: TimeoutOption = UNSET,
               ) -> None:
    """Every quota the PM stores (- = not limited by this quota)."""
    quotas = run_command(pm, timeout_ms, lambda c: c.list_quotas())
    t = Table("QUOTA", "PRODUCE B/S", "FETCH B/S", "REQUESTS/S", box=None)
    for q in quotas:
        t.add_row(q.key, _rate(q.produce_bytes_per_s), _rate(q.fetch_bytes_per_s),
                  _rate(q.requests_per_s))
    out_console.print(t)


@quota_app.command("delete")
def quota_delete(
    pm: PmOption = "",
    user: QUserOption = None,
    client_id: QClientOption = None,
    stream: QStreamOption = None,
    default: QDefaultOption = False,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Delete a quota."""
    kind, name, principal = _entity(client_id, stream, default, user)
    q = run_command(pm, timeout_ms, lambda c: c.delete_quota(kind, name, principal))
    out_console.print(f"deleted quota {q.key}", markup=False)


@quota_app.command("counters")
def quota_counters(
    pm: PmOption = "",
    node: Annotated[list[str] | None, typer.Option(
        "--node", help="A data node HOST:PORT (repeatable); default: every node holding a "
        "range of some stream.")] = None,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """The live Throttr-style counters of the data nodes: quota left in the window and the
    TTL left (Throttr's QUERY)."""
    async def body(c: AsyncClient) -> list[tuple[str, QuotaCountersResponse]]:
        nodes = node or await c.data_node_addresses()
        return [(a, await c.quota_counters(a)) for a in nodes]

    t = Table("NODE", "COUNTER", "QUOTA LEFT", "TTL LEFT", box=None)
    for addr, resp in run_command(pm, timeout_ms, body):
        for k in resp.counters:
            unit = TtlType(k.ttl_type).name.lower() if k.ttl_type in range(1, 7) else "?"
            t.add_row(addr, k.key, f"{k.quota:,}", f"{k.ttl} {unit}")
    out_console.print(t)


