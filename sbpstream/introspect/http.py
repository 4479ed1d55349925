"""The ``/v1/...`` JSON routes of the admin port, and the web console's files (PM only).

======================================  =====================================================
``/v1/info``                            INFO's payload (on the PM, with the cluster overview)
``/v1/stats?stream=1,2&top=N``          STATS's payload
``/v1/connections?limit=N``             CONNECTIONS's payload
``/v1/nodes``                           PM: nodes, under-replicated ranges, live clients
``/v1/streams?top=N``                   the top streams by rate (PM: across the cluster)
``/v1/streams/<id>``                    one stream (PM: with its ranges, replicas, per node)
``/v1/streams/<id>/tail?n=N``           PM: the stream's latest records, as text
``/`` and ``/console/<file>``           PM: the web console
======================================  =====================================================
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Final

from sbpstream.introspect.cluster import ClusterView
from sbpstream.introspect.figures import Introspector
from sbpstream.net.admin import HttpResponse, Route
from sbpstream.protocol.errors import SbpError

_STATIC_NAME: Final = re.compile(r"^[a-z0-9_-]+\.(html|js|css|png)$")
_TYPES: Final = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
                 "css": "text/css; charset=utf-8", "png": "image/png"}
_STREAM: Final = re.compile(r"^/v1/streams/(-?\d+)(/tail)?$")


class BadQuery(ValueError):
    pass


def _int(query: dict[str, list[str]], name: str, default: int) -> int:
    vals = query.get(name)
    if not vals:
        return default
    try:
        return int(vals[-1])
    except ValueError:
        raise BadQuery(f"{name}={vals[-1]!r} is not an integer") from None


def _ids(query: dict[str, list[str]]) -> list[int]:
    out: list[int] = []
    for v in query.get("stream", []):
        for part in v.split(","):
            if part.strip():
                try:
                    out.append(int(part))
                except ValueError:
                    raise BadQuery(f"stream={part!r} is not a stream id") from None
    return out


def static_file(name: str) -> HttpResponse | None:
    if not _STATIC_NAME.match(name):
        return None
    f = resources.files("sbpstream.console") / "static" / name
    if not f.is_file():
        return None
    return HttpResponse(200, _TYPES[name.rsplit(".", 1)[1]], f.read_bytes())


def routes(intro: Introspector, cluster: ClusterView | None = None) -> list[Route]:
    """The admin routes of a server: the data node's (no cluster) or the PM's."""

    async def v1(path: str, query: dict[str, list[str]]) -> HttpResponse | None:
        try:
            return await _v1(path, query)
        except BadQuery as exc:
            return HttpResponse.json({"error": str(exc)}, 400)
        except SbpError as exc:
            return HttpResponse.json({"error": str(exc), "code": int(exc.code)}, 502)

    async def _v1(path: str, query: dict[str, list[str]]) -> HttpResponse | None:
        if path == "/v1/info":
            return HttpResponse.json(await intro.info())
        if path == "/v1/stats":
            return HttpResponse.json(await intro.stats(_ids(query), _int(query, "top", 0)))
        if path == "/v1/connections":
            return HttpResponse.json(intro.connections(_int(query, "limit", 0)))
        if path == "/v1/streams":
            return HttpResponse.json(await intro.stats((), _int(query, "top", 0)))
        if path == "/v1/nodes" and cluster is not None:
            return HttpResponse.json(await cluster.overview())
        m = _STREAM.match(path)
        if m is None:
            return None
        sid = int(m.group(1))
        if cluster is None:
            if m.group(2):
                return None
            rows = (await intro.stats([sid]))["streams"]
            return HttpResponse.json(rows[0]) if rows else _no_stream(sid)
        got = (await cluster.tail(sid, _int(query, "n", 20)) if m.group(2)
               else await cluster.stream(sid))
        return HttpResponse.json(got) if got is not None else _no_stream(sid)

    async def console(path: str, query: dict[str, list[str]]) -> HttpResponse | None:
        if path in ("/", "/console", "/console/"):
            return static_file("index.html")
        if path.startswith("/console/"):
            return static_file(path[len("/console/"):])
        return None

    return [v1] if cluster is None else [v1, console]


def _no_stream(sid: int) -> HttpResponse:
    return HttpResponse.json({"error": f"stream {sid} not found"}, 404)
