"""The ``/v1/...`` JSON routes of the admin port, and the web console's files (PM only).

======================================  =====================================================
``/v1/info``                            INFO's payload (on the PM, with the cluster overview)
``/v1/stats?stream=1,2&top=N``          STATS's payload
``/v1/connections?limit=N``             CONNECTIONS's payload
``/v1/nodes``                           PM: nodes, under-replicated ranges, live clients
``/v1/streams?top=N``                   the top streams by rate (PM: across the cluster)
``/v1/streams/<id>``                    one stream (PM: with its ranges, replicas, per node)
``/v1/streams/<id>/tail?n=N``           PM: the stream's latest records, as text
``POST /v1/login``                      auth on: ``{"user", "password"}`` to a token (HTTPS)
``/`` and ``/console/<file>``           PM: the web console
======================================  =====================================================

With auth on (:mod:`sbpstream.auth.http`), every path but the console's files and the login
authenticates; ``/metrics`` too unless ``--public-metrics``. What a caller sees:

- ``/v1/info``, ``/v1/nodes``, ``/v1/connections``, ``/metrics``: ``describe`` on ``*`` or
  ``admin``, else 403;
- ``/v1/streams``, ``/v1/stats``: only the streams the caller may ``describe``;
- ``/v1/streams/<id>``: ``describe`` on it, ``/tail``: ``fetch`` on it (403 whether or not the
  stream exists); the tail is read with the caller's token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Final, Protocol

from sbpstream.auth.acl import Op
from sbpstream.introspect.figures import DEFAULT_TOP, JSON, MAX_TOP, Introspector, Visible
from sbpstream.net.admin import Gate, HttpRequest, HttpResponse, Route
from sbpstream.protocol.errors import ErrorCode, SbpError

if TYPE_CHECKING:
    from sbpstream.auth.http import Caller, HttpAuth

_STATIC_NAME: Final = re.compile(r"^[a-z0-9_-]+\.(html|js|css|png)$")
_TYPES: Final = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
                 "css": "text/css; charset=utf-8", "png": "image/png"}
_STREAM: Final = re.compile(r"^/v1/streams/(-?\d+)(/tail)?$")
LOGIN_PATH: Final = "/v1/login"


class ClusterViews(Protocol):
    """The PM's cluster-wide views (``pm.overview.ClusterOverview``), for the PM's routes."""

    async def overview(self) -> JSON: ...

    async def stats(self, stream_ids: Sequence[int], top: int,
                    visible: Visible | None = None) -> list[JSON]: ...

    async def stream(self, stream_id: int) -> JSON | None: ...

    async def tail(self, stream_id: int, n: int, token: str | None = None) -> JSON | None: ...


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


def is_console_path(path: str) -> bool:
    return path in ("/", "/console", "/console/") or path.startswith("/console/")


def _top(top: int) -> int:
    return min(top if top > 0 else DEFAULT_TOP, MAX_TOP)


def admin_gate(auth: HttpAuth, *, public_metrics: bool = False) -> Gate:
    """Auth on: authenticate every request (the console's files, the login itself and, with
    ``public_metrics``, ``/metrics`` excepted); ``/metrics`` needs the cluster's ``describe``."""
    from sbpstream.auth.http import HttpDenied

    async def gate(req: HttpRequest) -> HttpResponse | None:
        if req.path == LOGIN_PATH or is_console_path(req.path) or (
                public_metrics and req.path == "/metrics"):
            return None  # the login checks the password itself; the console's files hold no data
        try:
            req.caller = await auth.authenticate(req)
            if req.path == "/metrics":
                auth.require_cluster(req.caller, "/metrics")
        except HttpDenied as d:
            return d.response()
        return None

    return gate


def routes(intro: Introspector, cluster: ClusterViews | None = None,
           auth: HttpAuth | None = None) -> list[Route]:
    """The admin routes of a server: the data node's (no cluster) or the PM's. ``auth``: auth
    is on, and every request's ``caller`` was set by :func:`admin_gate`."""

    async def v1(req: HttpRequest) -> HttpResponse | None:
        from sbpstream.auth.http import HttpDenied

        try:
            if req.path == LOGIN_PATH:
                return await _login(req)
            if req.method == "POST":
                return HttpResponse.json({"error": f"POST {req.path}: use GET"}, 405) \
                    if req.path.startswith("/v1/") else None
            return await _v1(req.path, req.query, req.caller)
        except BadQuery as exc:
            return HttpResponse.json({"error": str(exc)}, 400)
        except HttpDenied as d:
            return d.response()
        except SbpError as exc:
            if exc.code == ErrorCode.AUTHORIZATION_FAILED:
                return HttpResponse.json({"error": "forbidden", "reason": exc.message}, 403)
            return HttpResponse.json({"error": str(exc), "code": int(exc.code)}, 502)

    async def _login(req: HttpRequest) -> HttpResponse:
        if req.method != "POST":
            return HttpResponse.json({"error": f"{req.method} {LOGIN_PATH}: use POST"}, 405)
        if auth is None:
            return HttpResponse.json({"error": "auth is off: nothing to log in to"}, 404)
        from sbpstream.auth.http import forbidden

        if not req.tls:
            raise forbidden("a login sends the password: it is taken over HTTPS only (serve "
                            "the admin port with --tls-cert)")
        try:
            body = json.loads(req.body)
            user, password = body["user"], body["password"]
            if not isinstance(user, str) or not isinstance(password, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise BadQuery('expected a JSON body {"user": ..., "password": ...}') from None
        caller = await auth.login(req, user, password, "login", fresh=True)
        return HttpResponse.json({"token": caller.token, "principal": caller.principal,
                                  "expires_at_ms": caller.claims.expires_ms})

    def _visible(caller: Caller | None) -> Visible | None:
        """The caller's describe filter; None when it sees every stream (or auth is off)."""
        if caller is None or auth is None or auth.sees_cluster(caller):
            return None
        a, c = auth, caller

        async def visible(keys: Sequence[tuple[int, str | None]]) -> list[bool]:
            return await a.allowed(c, Op.DESCRIBE, keys)

        return visible

    def _cluster_only(caller: Caller | None, what: str) -> None:
        if caller is not None and auth is not None:
            auth.require_cluster(caller, what)

    async def _stream_rows(caller: Caller | None, ids: list[int], top: int) -> list[JSON]:
        visible = _visible(caller)
        if cluster is not None:
            return await cluster.stats(ids, _top(top), visible)
        if visible is None:
            got: list[JSON] = (await intro.stats(ids, top))["streams"]
            return got
        rows: list[JSON] = (await intro.stats(ids, MAX_TOP))["streams"]
        shown = await visible([(int(r["stream_id"]), None) for r in rows])
        rows = [r for r, ok in zip(rows, shown, strict=True) if ok]
        return rows if ids else rows[:_top(top)]

    async def _v1(path: str, query: dict[str, list[str]],
                  caller: Caller | None) -> HttpResponse | None:
        if path == "/v1/info":
            _cluster_only(caller, "the server's INFO")
            return HttpResponse.json(await intro.info())
        if path == "/v1/stats":
            rows = await _stream_rows(caller, _ids(query), _int(query, "top", 0))
            return HttpResponse.json({"streams": rows})
        if path == "/v1/connections":
            _cluster_only(caller, "the connections")
            return HttpResponse.json(intro.connections(_int(query, "limit", 0)))
        if path == "/v1/streams":
            return HttpResponse.json({"streams": await _stream_rows(
                caller, [], _int(query, "top", 0))})
        if path == "/v1/nodes" and cluster is not None:
            _cluster_only(caller, "the nodes")
            return HttpResponse.json(await cluster.overview())
        m = _STREAM.match(path)
        if m is None:
            return None
        sid = int(m.group(1))
        tail = bool(m.group(2))
        if tail and cluster is None:
            return None
        if caller is not None and auth is not None:
            await auth.require_stream(caller, Op.FETCH if tail else Op.DESCRIBE, sid)
        if cluster is None:
            rows = (await intro.stats([sid]))["streams"]
            return HttpResponse.json(rows[0]) if rows else _no_stream(sid)
        got = (await cluster.tail(sid, _int(query, "n", 20),
                                  None if caller is None else caller.token) if tail
               else await cluster.stream(sid))
        return HttpResponse.json(got) if got is not None else _no_stream(sid)

    async def console(req: HttpRequest) -> HttpResponse | None:
        path = req.path
        if not is_console_path(path):
            return None
        if req.method == "POST":
            return HttpResponse.json({"error": f"POST {path}: use GET"}, 405)
        if path in ("/", "/console", "/console/"):
            return static_file("index.html")
        return static_file(path[len("/console/"):])

    return [v1] if cluster is None else [v1, console]


def _no_stream(sid: int) -> HttpResponse:
    return HttpResponse.json({"error": f"stream {sid} not found"}, 404)
