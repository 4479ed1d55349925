"""``rich`` renderings of the introspection figures, for the CLI (``sbpstream info`` ... ``top``).

Every cell is plain text (``Text``), never console markup: a client id or peer cannot style, or
break, the output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sbpstream.introspect.figures import JSON


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for h in headers:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*(Text("" if c is None else str(c)) for c in r))
    return t


def info_view(body: JSON) -> Group:
    headers = ["role", "version", "node id", "address", "uptime (s)", "connections"]
    row = [body["role"], body["version"], body["node_id"], body["address"],
           round(body["uptime_ms"] / 1000, 1), body["connections_open"]]
    if "records_fetched" in body:  # a data node: what it served to readers, all streams
        headers += ["records out", "bytes out (records)"]
        row += [body["records_fetched"], body["bytes_fetched"]]
    head = _table("server", headers, [row])
    rows = [[op, f["requests"], f["per_minute"]["requests"], f["bytes_in"], f["bytes_out"],
             f["per_minute"]["bytes_in"], f["per_minute"]["bytes_out"], f["errors"],
             f["per_minute"]["errors"]]
            for op, f in [("TOTAL", body["totals"]), *body["opcodes"].items()]]
    ops = _table("requests by opcode", ["opcode", "requests", "/min", "bytes in", "bytes out",
                                        "in/min", "out/min", "errors", "errors/min"], rows)
    return Group(head, ops)


def when(epoch_ms: int | None) -> str:
    """An epoch-milliseconds time as local ``YYYY-MM-DD HH:MM:SS`` ("" for none/0)."""
    if not epoch_ms:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_ms / 1000))


def stats_view(body: JSON) -> Table:
    """Per-stream traffic; a row's ``name`` (added by the CLI when the stream has one) shown."""
    rows = [[s["stream_id"], s.get("name") or "", s["records_appended"],
             s["per_minute"]["records_appended"],
             s["bytes_appended"], s["per_minute"]["bytes_appended"], s["records_fetched"],
             s["per_minute"]["records_fetched"], s["start_offset"], s["next_offset"],
             s["ranges"] if isinstance(s["ranges"], int) else len(s["ranges"]),
             when(s["last_append_ms"])]
            for s in body["streams"]]
    return _table("streams", ["stream", "name", "records in", "/min", "bytes in", "/min",
                              "records out",
                              "/min", "start", "next", "ranges", "last append"], rows)


def connection_rows(conns: Sequence[JSON]) -> list[list[Any]]:
    return [[c["id"], c["peer"], c["client_id"], c["client_role"], c["age_s"], c["bytes_in"],
             c["bytes_out"], c["requests"], c["requests_in_flight"], c["subscriptions"],
             c["sessions"], c["throttle_time_ms"]] for c in conns]


CONNECTION_HEADERS = ["id", "peer", "client id", "role", "age (s)", "bytes in", "bytes out",
                      "requests", "in flight", "subs", "sessions", "throttle ms"]


def connections_view(body: JSON) -> Table:
    return _table(f"connections ({body['connection_count']} open)", CONNECTION_HEADERS,
                  connection_rows(body["connections"]))


def whoami_view(body: JSON) -> Table:
    return _table("this connection", CONNECTION_HEADERS, connection_rows([body]))


def nodes_view(body: JSON) -> Group:
    rows = []
    for n in body["nodes"]:
        m = n["metrics"] or {}
        state = "live" if n["live"] else ("dead" if n["dead"] else "silent")
        if n.get("draining"):  # pm/drain.py: how many ranges still list it
            left = n.get("ranges_left")
            state += " draining" if left else " drained"
            state += f" ({left} left)" if left else ""
        rows.append([n["node_id"], n["address"], state, n["last_heartbeat_s"], n["ranges"],
                     n["writable_ranges"], n["primary_ranges"], m.get("network_append_rate", ""),
                     m.get("disk_in_rate", ""), m.get("disk_free_space", ""),
                     m.get("memory_used", "")])
    nodes = _table("data nodes", ["node", "address", "state", "heartbeat (s ago)", "ranges",
                                  "writable", "primary", "append/s", "disk in B/s",
                                  "disk free", "memory"], rows)
    under = _table(f"under-replicated ranges ({len(body['under_replicated'])})",
                   ["stream", "name", "range", "replicas", "live", "wanted"],
                   [[u["stream_id"], u.get("name") or "", u["range_index"], u["replicas"],
                     u["live_replicas"],
                     u["replica_nums"]] for u in body["under_replicated"]])
    clients = _table(f"clients ({len(body['clients'])})", CONNECTION_HEADERS,
                     connection_rows(body["clients"]))
    return Group(nodes, under, clients)


def top_view(info: JSON, stats: JSON, conns: JSON) -> Group:
    """``sbpstream top``: nodes, the top streams by rate, connections."""
    return Group(nodes_view(info), stats_view(stats), connections_view(conns))
