"""The etcd key layout under one prefix (docs/etcd.md); numbers zero-padded so keys sort
numerically."""

from __future__ import annotations

from typing import Final

from sbpstream.pm.metadata import FIRST_NODE_ID, FIRST_STREAM_ID
from sbpstream.pm.rules import COUNTER_NODE, COUNTER_STREAM
from sbpstream.pm.staging import ALL_RANGES

_SID_W: Final = 20  # digits of an int64
_IDX_W: Final = 10  # digits of an int32 range index / node id


class Keys:
    """The key layout under one prefix (docs/etcd.md)."""

    def __init__(self, prefix: str) -> None:
        p = prefix.rstrip("/").encode()
        self.root = p + b"/"
        self.root_end = prefix_end(self.root)
        self.leader = p + b"/leader"
        self.schema = p + b"/meta/schema_version"
        self._counter = p + b"/meta/"
        self._stream = p + b"/streams/"
        self._range = p + b"/ranges/"
        self._producers = p + b"/seal_producers/"
        self._node = p + b"/nodes/"
        self._name = p + b"/names/"
        self._quota = p + b"/quotas/"
        self._offsets = p + b"/offsets/"

    def counter(self, name: str) -> bytes:
        return self._counter + name.encode()

    def stream(self, sid: int) -> bytes:
        return self._stream + b"%020d" % sid

    def range(self, sid: int, idx: int) -> bytes:
        return self._range + b"%020d/%010d" % (sid, idx)

    def ranges_below(self, sid: int, bound: int) -> tuple[bytes, bytes]:
        """[start, end) of the range keys of ``sid`` with index < bound (ALL_RANGES: every one)."""
        start = self._range + b"%020d/" % sid
        end = prefix_end(start) if bound >= ALL_RANGES else self.range(sid, bound)
        return start, end

    def producers(self, sid: int, idx: int) -> bytes:
        return self._producers + b"%020d/%010d" % (sid, idx)

    def producers_below(self, sid: int, bound: int) -> tuple[bytes, bytes]:
        start = self._producers + b"%020d/" % sid
        end = prefix_end(start) if bound >= ALL_RANGES else self.producers(sid, bound)
        return start, end

    def node(self, nid: int) -> bytes:
        return self._node + b"%010d" % nid

    def name(self, name: str) -> bytes:
        """The name index: ``P/names/<name>`` holds the id of the live stream of that name."""
        return self._name + name.encode()

    def offset(self, group: str, sid: int) -> bytes:
        """A committed offset: ``P/offsets/<group>/<stream id>`` (group names hold no '/')."""
        return self._offsets + group.encode() + b"/%020d" % sid

    def offset_of(self, key: bytes) -> tuple[str, int] | None:
        """(group, stream id) of a committed-offset key; None for any other key."""
        if not key.startswith(self._offsets):
            return None
        group, _, sid = key[len(self._offsets):].rpartition(b"/")
        try:
            return group.decode(errors="replace"), int(sid)
        except ValueError:
            return None

    def name_of(self, key: bytes) -> str | None:
        """The stream name of a name-index key; None for any other key."""
        if key.startswith(self._name):
            return key[len(self._name):].decode(errors="replace")
        return None

    def quota(self, key: str) -> bytes:
        """A quota record (issue 22): ``quotas/default``, ``quotas/client/<id>``, ..."""
        return self._quota + key.encode()

    def parse(self, key: bytes) -> tuple[str, tuple[int, ...]] | None:
        """(kind, ids) for a key under the root; None for anything else."""
        if key.startswith(self._quota):
            return "quota:" + key[len(self._quota):].decode(errors="replace"), ()
        for kind, head in (("stream", self._stream), ("range", self._range),
                           ("node", self._node), ("producers", self._producers)):
            if key.startswith(head):
                try:
                    return kind, tuple(int(x) for x in key[len(head):].split(b"/"))
                except ValueError:
                    return None
        if key == self.leader:
            return "leader", ()
        if key == self.schema:
            return "schema", ()
        if key.startswith(self._counter):
            return "counter:" + key[len(self._counter):].decode(errors="replace"), ()
        return None


COUNTER_FIRST: Final = {COUNTER_STREAM: FIRST_STREAM_ID, COUNTER_NODE: FIRST_NODE_ID}


def prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
