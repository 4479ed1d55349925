"""Stream names for ``prefix:`` ACL rules, on servers that hold only ids.

A data node stores ranges by stream id; the name lives in the PM's metadata. A request of a
principal whose only grant for the stream is a ``prefix:`` rule needs the stream's name:
:class:`StreamNames` asks for it (the data node: DESCRIBE_STREAMS at the PM with its node token,
one request for every id of a batch that is not known yet; the PM: its own metadata) and
remembers it. A stream's name never changes after CREATE and ids are never reused, so a name once
learned stays right for good; only the memory is bounded (least recently used dropped first).
Ids the lookup does not answer (no such stream, deleted) are not remembered: they read as
unnamed, which ``prefix:`` rules never match.

Only principals relying on ``prefix:`` rules pay for this, once per stream per server; the
connection's :class:`~sbpstream.auth.acl.Permissions` remembers the answer per stream after that.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

MAX_NAMES: Final = 100_000
"""Names a server remembers: about 100 bytes each, 10 MB at most."""

Lookup = Callable[[Sequence[int]], Awaitable[Mapping[int, str]]]
"""Ids to names ("" for an unnamed stream); ids left out are unknown (never created, deleted)."""


class StreamNames:
    def __init__(self, lookup: Lookup, max_names: int = MAX_NAMES) -> None:
        self._lookup = lookup
        self._max = max_names
        self._names: OrderedDict[int, str] = OrderedDict()
        self._inflight: dict[int, asyncio.Future[str | None]] = {}
        self.lookups = 0  # lookup calls made: what the cache saves is visible in tests

    def __len__(self) -> int:
        return len(self._names)

    def remember(self, stream_id: int, name: str) -> None:
        self._names[stream_id] = name
        self._names.move_to_end(stream_id)
        while len(self._names) > self._max:
            self._names.popitem(last=False)

    async def resolve(self, stream_ids: Sequence[int]) -> dict[int, str]:
        """The names of those streams that exist ("" when unnamed). Errors of the lookup (the PM
        unreachable) propagate: the caller answers the items that needed a name with them."""
        out: dict[int, str] = {}
        missing: list[int] = []
        waits: list[tuple[int, asyncio.Future[str | None]]] = []
        for sid in dict.fromkeys(stream_ids):
            name = self._names.get(sid)
            if name is not None:
                self._names.move_to_end(sid)
                out[sid] = name
            elif sid in self._inflight:
                waits.append((sid, self._inflight[sid]))
            else:
                missing.append(sid)
        if missing:
            loop = asyncio.get_running_loop()
            futs = {sid: loop.create_future() for sid in missing}
            self._inflight.update(futs)
            try:
                self.lookups += 1
                got = await self._lookup(missing)
            except BaseException as e:
                for f in futs.values():
                    f.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
                    f.exception()  # retrieved: waiters re-raise it, nobody else must
                raise
            finally:
                for sid in missing:
                    self._inflight.pop(sid, None)
            for sid, f in futs.items():
                name = got.get(sid)
                if name is not None:
                    self.remember(sid, name)
                    out[sid] = name
                f.set_result(name)
        for sid, f in waits:
            name = await asyncio.shield(f)
            if name is not None:
                out[sid] = name
        return out
