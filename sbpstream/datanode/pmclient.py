"""The data node's calls to the Placement Manager: the shared PM caller
(:mod:`sbpstream.net.pmcaller`, which follows PM_NOT_LEADER redirects over every ``--pm``
address) configured for the node.

One round over the addresses per call, no backoff: the node's loops (registration, heartbeats,
reports) retry on their own schedule. A top-level error status other than a redirect is
returned as is: the node's code reads per-item and top-level statuses itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from sbpstream.datanode.limits import PM_CALL_TIMEOUT_S
from sbpstream.net.client import ConnectionPool
from sbpstream.net.pmcaller import PmCaller


class PmClient(PmCaller):
    """The node's PM caller: each attempt bounded by ``PM_CALL_TIMEOUT_S`` unless a call gives
    its own ``timeout_s``; unreachable PMs raise NoPmReachableError."""

    def __init__(self, addresses: Sequence[str], pool: ConnectionPool) -> None:
        super().__init__(addresses, pool, timeout_s=PM_CALL_TIMEOUT_S, retry=None,
                         raise_status=False)
