"""The ``sbpstream`` PySpark data source: batch and streaming reads, batch and streaming writes.

Process topology (see docs/spark.md): Spark builds reader objects on the driver (a planner
process for batch, one long-lived runner process per streaming query) and pickles them into the
executors' read function. So every reader keeps its cluster client out of its pickled state, and
every :class:`SourcePartition` carries all a read needs: PM and replica addresses, stream, range
and [from, until).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from sbpstream.protocol.errors import SbpError
from sbpstream.protocol.names import StreamRef
from sbpstream.spark.fetch import SpanRequest, data_loss_message, read_span
from sbpstream.spark.meta import DriverClient
from sbpstream.spark.offsets import (
    Offsets,
    Span,
    next_offsets,
    offsets_from_json,
    offsets_to_json,
    spans_of_stream,
    split_spans,
)
from sbpstream.spark.options import (
    EARLIEST,
    LATEST,
    SecurityOptions,
    SourceOptions,
    parse_sink_options,
    parse_source_options,
)
from sbpstream.spark.profiling import phases, profiled
from sbpstream.spark.schema import (
    SOURCE_SCHEMA,
    arrow_schema,
    buffers_to_batch,
    check_source_schema,
)

log = logging.getLogger("sbpstream.spark")

FORMAT_NAME = "sbpstream"


@dataclass(frozen=True)
class SourcePartition(InputPartition):
    """Records [from_offset, until_offset) of one range of one stream, and how to reach them."""

    pm: tuple[str, ...]
    stream_id: int
    range_index: int
    from_offset: int
    until_offset: int
    replicas: tuple[str, ...]
    fail_on_data_loss: bool
    timeout_ms: int
    fetch_max_bytes: int
    security: SecurityOptions = field(default_factory=SecurityOptions)

    def request(self) -> SpanRequest:
        return SpanRequest(
            self.pm,
            self.stream_id,
            self.range_index,
            self.from_offset,
            self.until_offset,
            self.replicas,
            self.fail_on_data_loss,
            self.timeout_ms,
            self.fetch_max_bytes,
            self.security,
        )


def _partition(opts: SourceOptions, span: Span) -> SourcePartition:
    return SourcePartition(
        opts.pm,
        span.stream_id,
        span.range_index,
        span.from_offset,
        span.until_offset,
        span.replicas,
        opts.fail_on_data_loss,
        opts.timeout_ms,
        opts.fetch_max_bytes,
        opts.security,
    )


def _read(partition: InputPartition, schema: StructType) -> Iterator[Any]:
    if not isinstance(partition, SourcePartition):
        # Spark reads one default InputPartition(None) when partitions() returned none.
        if getattr(partition, "value", None) is None:
            return
        raise TypeError(f"not an sbpstream partition: {partition!r}")
    pa_schema = arrow_schema(schema)
    sid = partition.stream_id
    ph = phases("read")
    try:
        with profiled("read"):
            yield from read_span(partition.request(),
                                 lambda cols: buffers_to_batch(sid, cols, pa_schema), ph)
    finally:
        if ph is not None:
            ph.dump()


class _Planner:
    """Shared driver-side logic: data-loss checks and partition planning."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._view: DriverClient | None = None
        self._ids: dict[StreamRef, int] | None = None
        """Option 'streams' resolved (names to ids) once: a name keeps meaning that stream for
        the life of the query, as its offsets do."""
        self.initial: frozenset[int] = frozenset()
        """Streams the pattern matched when the query began (they follow startingOffsets; any
        matched later starts at its earliest, as Kafka's subscribePattern does)."""

    def streams(self) -> tuple[int, ...]:
        """The query's stream ids now: option 'streams' resolved, or what the pattern matches
        (looked up again at every call, so new streams join at the next trigger)."""
        if self.opts.pattern is not None:
            return tuple(self.view.matching(self.opts.pattern))
        if self._ids is None:
            self._ids = self.view.resolve(self.opts.streams)
        return tuple(self._ids.values())

    def spec(self, which: dict[StreamRef, int], sid: int, default: int) -> int:
        """The offset option ``which`` gives stream ``sid`` (keyed by name or id)."""
        if self.opts.pattern is not None:
            return self.opts.pattern_start if sid in self.initial else EARLIEST
        for ref, rid in (self._ids or {}).items():
            if rid == sid:
                return which.get(ref, default)
        return default

    @property
    def view(self) -> DriverClient:
        if self._view is None:
            self._view = DriverClient(self.opts.pm, self.opts.timeout_ms, self.opts.security)
        return self._view

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_view"] = None  # a live client (thread, sockets) never travels
        return state

    def readable_from(self, start: Offsets, trim_points: dict[int, int]) -> Offsets:
        """Where reading really begins per stream, after the data-loss check."""
        out: Offsets = {}
        for s, st in start.items():
            first = trim_points[s]
            if st == LATEST or st >= first:
                out[s] = st
                continue
            msg = data_loss_message(s, st, first, "trimmed")
            if self.opts.fail_on_data_loss:
                raise RuntimeError(msg)
            log.warning("%s; skipped (failOnDataLoss=false)", msg.removeprefix("failOnDataLoss: "))
            out[s] = first
        return out

    def plan(self, start: Offsets, end: Offsets) -> list[SourcePartition]:
        """Partitions for [start, end); a stream in ``end`` but not in ``start`` (matched by
        the pattern since) is read from its earliest record."""
        spans: list[Span] = []
        begin = {s: start.get(s, EARLIEST) for s in end}
        wanted = [s for s in end if begin[s] != LATEST]
        trims = {s: self.view.start_offset(s) for s in wanted}
        begin.update({s: trims[s] for s in wanted if begin[s] == EARLIEST})
        trims = {s: t for s, t in trims.items() if end[s] > begin[s]}
        froms = self.readable_from({s: begin[s] for s in trims}, trims)
        for s in trims:
            if end[s] > froms[s]:
                spans += spans_of_stream(s, self.view.ranges(s), froms[s], end[s])
        return [_partition(self.opts, sp) for sp in split_spans(spans, self.opts.min_partitions)]


class SbpstreamBatchReader(_Planner, DataSourceReader):
    """``spark.read.format("sbpstream")``: [startingOffsets, endingOffsets) of each stream."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        super().__init__(opts)
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        ph = phases("plan")
        t0 = time.perf_counter()
        try:
            ids = self.streams()
            self.initial = frozenset(ids)
            self.view.check_streams(ids)
            states = self.view.states(ids)
            start: Offsets = {}
            end: Offsets = {}
            for s in ids:
                st = self.spec(self.opts.starting, s, EARLIEST)
                want_end = LATEST if self.opts.pattern else self.spec(self.opts.ending, s, LATEST)
                start[s] = {EARLIEST: states[s].start_offset, LATEST: states[s].end_offset}.get(
                    st, st
                )
                end[s] = states[s].end_offset if want_end == LATEST else want_end
                if end[s] > states[s].end_offset:
                    raise ValueError(
                        f"option 'endingOffsets': offset {end[s]} of stream {s} is past its end "
                        f"{states[s].end_offset}"
                    )
                if start[s] > end[s]:
                    raise ValueError(
                        f"option 'startingOffsets': offset {start[s]} of stream {s} is after "
                        f"the ending offset {end[s]}"
                    )
            parts = self.plan(start, end)
        finally:
            if ph is not None:
                ph.add("plan", time.perf_counter() - t0)
                ph.add("pm_lookups", 0.0, self.view.lookups)
                ph.dump()
            self.view.close()
        return parts

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition, self.schema)


class SbpstreamStreamReader(_Planner, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("sbpstream")``, exactly once from the checkpointed offsets."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        super().__init__(opts)
        self.schema = schema
        self._cap: Offsets | None = None  # availableNow: the ends fetched once at its start
        self._latest: Offsets = {}  # the ends the last latestOffset saw (for progress)
        self._checked = False

    def _ends(self) -> Offsets:
        ids = self.streams()
        if not self._checked:
            self.view.check_streams(ids)
            self._checked = True
        return {s: self.view.state(s).end_offset for s in ids}

    def initialOffset(self) -> dict[str, int]:
        """Concrete offsets, or LATEST (-1) for "latest": resolved by the first batch (module
        docs of :mod:`sbpstream.spark.offsets`), so a restart replays the same first batch."""
        ids = self.streams()
        self.initial = frozenset(ids)
        self.view.check_streams(ids)
        self._checked = True
        out: Offsets = {}
        for s in ids:
            st = self.spec(self.opts.starting, s, LATEST)
            out[s] = self.view.state(s).start_offset if st == EARLIEST else st
        return offsets_to_json(out)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_offsets_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def prepareForTriggerAvailableNow(self) -> None:
        self._cap = self._ends()

    def _begin(self, start: dict[str, Any], ids: tuple[int, ...]) -> Offsets:
        """The checkpointed start; a stream that joined the query since starts at its spec
        (option 'streams') or its earliest (the pattern matched it later: EARLIEST)."""
        begin = offsets_from_json(start, None if self.opts.pattern else ids)
        for s in ids:
            spec = self.spec(self.opts.starting, s, LATEST)
            begin.setdefault(s, spec if spec >= 0 or spec == EARLIEST else LATEST)
        return {s: begin[s] for s in ids}  # a stream the pattern lost (deleted) leaves

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        ids = self.streams()
        if not self._checked:
            self.view.check_streams(ids)
            self._checked = True
        begin = self._begin(start, ids)
        states = self.view.states(ids)  # one look per stream: start and end
        begin.update({s: states[s].start_offset for s in ids if begin[s] == EARLIEST})
        self._latest = {s: st.end_offset for s, st in states.items()}
        ends = dict(self._latest)
        if self._cap is not None:  # availableNow: streams that joined since are read to now
            ends.update({s: e for s, e in self._cap.items() if s in ends})
        trims = {s: states[s].start_offset for s in begin if begin[s] != LATEST}
        froms = self.readable_from({s: begin[s] for s in trims}, trims)
        froms.update({s: LATEST for s in begin if s not in trims})
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return offsets_to_json(next_offsets(begin, froms, ends, max_rows))

    def reportLatestOffset(self) -> dict[str, int] | None:
        """The ends seen by the last latestOffset (no extra round trip)."""
        return offsets_to_json(self._latest) if self._latest else None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if start == end:
            return []
        end_offsets = offsets_from_json(end, None)
        return self.plan(offsets_from_json(start, None), end_offsets)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition, self.schema)

    def commit(self, end: dict[str, Any]) -> None:
        """The checkpoint is the only truth (as with Kafka). With option ``commitToGroup`` the
        batch's end offsets are also committed to that consumer group, so its lag shows in
        ``sbpstream group describe`` (Spark calls this when it plans the next batch: the group
        trails the query by one batch); a failed commit is logged, never fails the query."""
        group = self.opts.commit_group
        if group is None:
            return
        offsets: dict[int | str, int] = {
            s: o for s, o in offsets_from_json(end, None).items() if o >= 0}
        if not offsets:
            return
        try:
            self.view.client.commit_offsets(group, offsets)
        except SbpError as e:
            log.warning("event=spark_group_commit_failed group=%s error=%r", group, e.message)

    def stop(self) -> None:
        if self._view is not None:
            self._view.close()


class SbpstreamDataSource(DataSource):
    """``format("sbpstream")``: options as in Spark's Kafka source (see docs/spark.md)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> StructType:
        return SOURCE_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        check_source_schema(schema)
        return SbpstreamBatchReader(parse_source_options(self.options, streaming=False), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        check_source_schema(schema)
        return SbpstreamStreamReader(parse_source_options(self.options, streaming=True), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from sbpstream.spark.sink import SbpstreamBatchWriter, check_sink_schema

        if overwrite:
            raise ValueError("sbpstream streams are append-only: use mode('append')")
        opts = parse_sink_options(self.options)
        check_sink_schema(schema, routed=opts.stream is None)
        return SbpstreamBatchWriter(opts, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from sbpstream.spark.sink import SbpstreamStreamWriter, check_sink_schema

        if overwrite:
            raise ValueError("sbpstream streams are append-only: use outputMode('append')")
        opts = parse_sink_options(self.options)
        check_sink_schema(schema, routed=opts.stream is None)
        return SbpstreamStreamWriter(opts, schema)
