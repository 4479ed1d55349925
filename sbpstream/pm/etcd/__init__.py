"""etcd v3 backend of :class:`~sbpstream.pm.metadata.MetadataStore`: several PMs, one leader.

Split by concern: :mod:`.url` (the ``--metadata`` URL), :mod:`.keys` (key layout),
:mod:`.codec` (JSON values), :mod:`.client` (the gRPC calls), :mod:`.cache` (the watched
in-memory copy), :mod:`.txn` (staged writes as one etcd transaction) and :mod:`.store` (the
store: leadership fencing, the watch, packing items into transactions). The rules themselves
are in :mod:`sbpstream.pm.rules`. Importing this package needs the optional aetcd dependency.
"""

from sbpstream.pm.etcd.client import EtcdClient
from sbpstream.pm.etcd.codec import decode_leader, encode_leader
from sbpstream.pm.etcd.keys import Keys
from sbpstream.pm.etcd.store import EtcdMetadataStore
from sbpstream.pm.etcd.txn import MAX_TXN_BYTES
from sbpstream.pm.etcd.url import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_TXN_OPS,
    EtcdSettings,
    is_etcd_url,
    parse_etcd_url,
)

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_TXN_OPS",
    "MAX_TXN_BYTES",
    "EtcdClient",
    "EtcdMetadataStore",
    "EtcdSettings",
    "Keys",
    "decode_leader",
    "encode_leader",
    "is_etcd_url",
    "parse_etcd_url",
]
