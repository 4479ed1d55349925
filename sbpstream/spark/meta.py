"""Driver-side questions to the cluster: do the streams exist, where do they start and end,
which ranges hold them. Each failure becomes a one-line ValueError/RuntimeError naming the option
the user can fix (Spark shows it inside its PYTHON_DATA_SOURCE_ERROR)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sbpstream.client import Client
from sbpstream.client.types import Range
from sbpstream.protocol.errors import (
    NoPmReachableError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import StreamRef
from sbpstream.spark.offsets import PlannedRange
from sbpstream.spark.options import SecurityOptions


def replica_addresses(rng: Range) -> tuple[str, ...]:
    """Every replica's address, the primary first."""
    reps = sorted(rng.replica_nodes, key=lambda r: not r.is_primary)
    return tuple(r.data_node.advertise_addr for r in reps if r.data_node.advertise_addr)


def range_info(rng: Range) -> PlannedRange:
    return PlannedRange(
        rng.range_index,
        rng.start_offset,
        rng.end_offset if rng.sealed else -1,
        replica_addresses(rng),
    )


@dataclass(frozen=True, slots=True)
class StreamState:
    """Where one stream starts (its trim point) and ends (the next offset to be written)."""

    stream_id: int
    start_offset: int
    end_offset: int


@contextlib.contextmanager
def translated_errors(pm: Sequence[str]) -> Iterator[None]:
    """Turn SDK errors into the one-line errors users see, naming the option to fix."""
    try:
        yield
    except (StreamNotFoundError, StreamDeletedError) as e:
        raise ValueError(f"option 'streams': {e.message}") from None
    except NoPmReachableError:
        raise RuntimeError(
            f"option 'pm': no sbpstream placement manager reachable at {','.join(pm)}"
        ) from None
    except SbpError as e:
        if e.retriable:
            raise RuntimeError(
                f"option 'pm': the sbpstream cluster at {','.join(pm)} did not answer ({e})"
            ) from None
        raise


class DriverClient:
    """A lazily opened client on the driver. Not picklable state: drop it before pickling."""

    def __init__(self, pm: Sequence[str], timeout_ms: int,
                 security: SecurityOptions | None = None) -> None:
        self.pm = tuple(pm)
        self.timeout_ms = timeout_ms
        self.security = security or SecurityOptions()
        self._client: Client | None = None
        self.lookups = 0
        """PM requests made through this view (for the planning breakdown)."""

    @property
    def client(self) -> Client:
        self.lookups += 1
        if self._client is None:
            with translated_errors(self.pm):
                self._client = Client(
                    list(self.pm),
                    request_timeout_ms=min(self.timeout_ms, 10_000),
                    retry_deadline_ms=self.timeout_ms,
                    connect_timeout_ms=min(self.timeout_ms, 5_000),
                    **self.security.client_kwargs(),
                )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def resolve(self, refs: Sequence[StreamRef]) -> dict[StreamRef, int]:
        """Each stream name or id of option 'streams' -> its id (ValueError naming the option
        for an unknown name, or for two refs of one stream)."""
        with translated_errors(self.pm):
            ids = self.client.resolve_streams(list(refs))
        out = dict(zip(refs, ids, strict=True))
        seen: dict[int, StreamRef] = {}
        for ref, sid in out.items():
            if sid in seen:
                raise ValueError(f"option 'streams': {seen[sid]!r} and {ref!r} are the same "
                                 f"stream ({sid})")
            seen[sid] = ref
        return out

    def matching(self, pattern: str) -> list[int]:
        """Ids of the live streams whose whole name matches ``pattern``, ascending."""
        with translated_errors(self.pm):
            return [s.stream_id for s in self.client.find_streams(pattern=pattern)]

    def check_streams(self, streams: Sequence[int]) -> None:
        """Raise ValueError naming option 'streams' when one does not exist."""
        with translated_errors(self.pm):
            self.client.describe_streams(list(streams))

    def state(self, stream_id: int) -> StreamState:
        with translated_errors(self.pm):
            c = self.client
            self.lookups += 1  # two requests
            return StreamState(stream_id, c.start_offset(stream_id), c.end_offset(stream_id))

    def start_offset(self, stream_id: int) -> int:
        """The stream's first readable offset (its trim point)."""
        with translated_errors(self.pm):
            return self.client.start_offset(stream_id)

    def states(self, streams: Sequence[int]) -> dict[int, StreamState]:
        return {s: self.state(s) for s in streams}

    def ranges(self, stream_id: int) -> list[PlannedRange]:
        with translated_errors(self.pm):
            return [range_info(r) for r in self.client.list_ranges(stream_id)]
