"""The data node's side of quotas (issue 22): who the client is, what it owes, muting.

- **Who.** A connection is charged to the ``client_id`` it declared
  (:attr:`~sbpstream.net.server.ServerConnection.client_id`), set by a HEARTBEAT the SDK sends on
  each new data-node connection; a connection that declared none is the client ``""`` (the
  default quota applies to it). With auth on, also to the principal of the token it
  authenticated with (:func:`principal_of`): user and user+client-id quotas take precedence
  (:mod:`sbpstream.quota.enforcer`). Replication between data nodes is never charged, and a node
  token has no principal for quotas.
- **What.** APPEND charges its payload bytes (produce), FETCH the payload bytes it returns
  (fetch), each one request (requests/s), through :class:`~sbpstream.quota.enforcer.QuotaEnforcer`.
- **Then.** Over a quota, the response goes out at once with ``throttle_time_ms``, and the
  connection is muted for that long (KIP-219): a client that ignores the field is held anyway.
- **Cost.** A connection's client id and principal do not change between its requests, so its
  plan (:meth:`~sbpstream.quota.enforcer.QuotaEnforcer.plan`: its counters' meters) is kept on
  the connection (:class:`ConnectionPlan`) and used while the quota set, the client id and the
  claims it was resolved under are the ones in force; the clock is read once per request.
- **Which quotas.** The node pulls every quota from the PM (DESCRIBE_QUOTAS) at start and every
  heartbeat interval, and enforces each one in full for its own traffic (per node, like Kafka
  per broker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Final

from sbpstream.auth.gate import CONN_CLAIMS
from sbpstream.auth.tokens import Claims
from sbpstream.datanode.limits import PM_CALL_TIMEOUT_S
from sbpstream.datanode.pmclient import PmClient
from sbpstream.introspect.counters import connection_counters
from sbpstream.net.server import Request, Responder, ServerConnection
from sbpstream.protocol.messages import (
    DescribeQuotasRequest,
    DescribeQuotasResponse,
    Quota,
    QuotaCounter,
    QuotaCountersRequest,
    QuotaCountersResponse,
)
from sbpstream.quota.counters import TtlType
from sbpstream.quota.enforcer import DEFAULT_QUOTA_WINDOW_MS, Plan, QuotaEnforcer
from sbpstream.quota.model import QuotaKind, QuotaSpec

log = logging.getLogger("sbpstream.datanode.quota")

CONN_QUOTA_PLAN: Final = "quota.plan"
"""The key of a connection's :class:`ConnectionPlan` in its ``attributes``."""


def principal_of(conn: ServerConnection) -> str:
    """The user a connection authenticated as ("" without auth, or with a node token)."""
    claims = conn.attributes.get(CONN_CLAIMS)
    if isinstance(claims, Claims) and not claims.is_node:
        return claims.principal
    return ""


class ConnectionPlan:
    """A connection's resolved plan and what it was resolved under: the enforcer's quota-set
    version, the connection's client id and its claims (compared by identity: a HEARTBEAT that
    declares another client id, a new token or a new quota set makes it stale)."""

    __slots__ = ("claims", "client_id", "plan", "version")

    def __init__(self, version: int, client_id: str, claims: object, plan: Plan) -> None:
        self.version = version
        self.client_id = client_id
        self.claims = claims
        self.plan = plan


class NodeQuotas:
    def __init__(self, window_ms: int = DEFAULT_QUOTA_WINDOW_MS) -> None:
        self.enforcer = QuotaEnforcer(window_ms)
        self.loaded = 0  # quotas held, as last pulled
        self.specs: list[QuotaSpec] = []
        self._pulled: tuple[Quota, ...] = ()  # the PM's last answer, as received

    def charge(self, conn: ServerConnection, rate: int, amount: int,
               per_stream: Mapping[int, int]) -> int:
        """Count one request; over quota, mute ``conn``. Returns its throttle_time_ms."""
        enf = self.enforcer
        if enf.empty:
            return 0
        attrs = conn.attributes
        cp = attrs.get(CONN_QUOTA_PLAN)
        if (not isinstance(cp, ConnectionPlan) or cp.version != enf.version
                or cp.client_id is not conn.client_id or cp.claims is not attrs.get(CONN_CLAIMS)):
            cp = attrs[CONN_QUOTA_PLAN] = ConnectionPlan(
                enf.version, conn.client_id, attrs.get(CONN_CLAIMS),
                enf.plan(principal_of(conn), conn.client_id))
        ms = enf.charge_plan(cp.plan, rate, amount, per_stream, time.monotonic_ns())
        if ms:
            conn.mute(ms)
            connection_counters(attrs).throttle_time_ms += ms  # CONNECTIONS, WHOAMI
        return ms

    def fetch_round_bytes(self, conn: ServerConnection, stream_ids: Sequence[int]) -> int | None:
        """The fetch quota (bytes per window) a subscription round of ``conn`` may push: the
        smallest that applies to its client or streams; None when none applies."""
        return self.enforcer.fetch_round_bytes(conn.client_id, stream_ids, principal_of(conn))

    async def counters(self, req: Request, resp: Responder) -> None:
        """QUOTA_COUNTERS: every live counter, its quota left and TTL left (Throttr's QUERY)."""
        QuotaCountersRequest.decode(req.header)
        tab = self.enforcer.counters
        views = tab.query(time.monotonic_ns(), TtlType.MILLISECONDS)
        quotas = tuple(Quota(int(q.kind), q.name, *q.rates(), q.user) for q in self.specs)
        await resp.send(QuotaCountersResponse(
            counters=tuple(QuotaCounter(v.key, v.quota, int(v.ttl_type), v.ttl) for v in views),
            max_counters=tab.max_counters, overflowed=tab.overflowed,
            quotas=quotas).encode())

    async def pull(self, pm: PmClient) -> None:
        """Replace the quotas enforced here with the PM's."""
        r = await pm.call(DescribeQuotasRequest(timeout_ms=int(PM_CALL_TIMEOUT_S * 1000)),
                          DescribeQuotasResponse)
        r.status.raise_for_error()
        if r.quotas == self._pulled:  # unchanged (the usual case): nothing to rebuild
            return
        self._pulled = r.quotas
        specs = [QuotaSpec(QuotaKind(q.kind), q.name, q.produce_bytes_per_s,
                           q.fetch_bytes_per_s, q.requests_per_s, q.user) for q in r.quotas]
        self.enforcer.load(specs)
        self.specs = specs
        if len(specs) != self.loaded:
            log.info("event=quotas_loaded count=%d", len(specs))
        self.loaded = len(specs)
