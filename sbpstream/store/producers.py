"""Idempotent-producer bookkeeping of a range: duplicate detection, fencing, sequence checks.

A range keeps, per producer id, its epoch, last sequence and last few batches (``Producer`` in
index.py; ``StoredRange.producers`` is None until the range sees an idempotent batch). Appends ask
``check`` before writing and call ``record`` after; replay calls ``record`` for every batch it
indexes; a truncation (seal below the local end) calls ``rebuild`` to forget what was cut. No
I/O except through the ``header_at`` callable ``rebuild`` is given.
"""

from __future__ import annotations

from collections.abc import Callable

from sbpstream.protocol.errors import OutOfOrderSequenceError, ProducerFencedError
from sbpstream.protocol.limits import (
    SEQUENCE_WRAP,  # producer sequences are int32 and wrap (as Kafka's)
)
from sbpstream.records.header import BatchHeader
from sbpstream.store.index import Producer, StoredRange


def check(r: StoredRange, h: BatchHeader) -> int | None:
    """The original base offset when ``h`` duplicates a stored batch; None when it is new.
    Raises on a stale epoch or a sequence gap."""
    p = r.producers.get(h.producer_id) if r.producers and h.is_idempotent else None
    if p is None:
        return None
    if h.producer_epoch < p.epoch:
        raise ProducerFencedError(
            f"producer {h.producer_id} epoch {h.producer_epoch} < current {p.epoch}"
        )
    if h.producer_epoch > p.epoch:
        return None
    for base_seq, base_offset, count in p.recent:
        if base_seq == h.base_sequence and count == h.record_count:
            return base_offset
    if h.base_sequence == (p.last_sequence + 1) % SEQUENCE_WRAP:
        return None
    raise OutOfOrderSequenceError(
        f"producer {h.producer_id}: sequence {h.base_sequence} after {p.last_sequence}"
    )


def record(r: StoredRange, pid: int, epoch: int, seq: int, base: int, count: int) -> None:
    """Note a stored batch of producer ``pid``; a batch of an older epoch changes nothing."""
    if r.producers is None:
        r.producers = {}
    p = r.producers.get(pid)
    if p is None:
        p = r.producers[pid] = Producer(epoch, seq + count - 1, base)
    elif epoch < p.epoch:
        return
    p.record(epoch, seq, base, count)


def rebuild(r: StoredRange, end_offset: int, header_at: Callable[[int], BatchHeader]) -> None:
    """After a truncation at ``end_offset``, forget producer batches past it and find each
    affected producer's last surviving batch (``header_at`` reads a batch header by location)."""
    if not r.producers:
        return
    lost = {pid for pid, p in r.producers.items() if p.last_base_offset >= end_offset}
    for pid in lost:
        del r.producers[pid]
    for i in range(len(r) - 1, -1, -1):
        if not lost:
            break
        h = header_at(r.loc(i))
        if h.producer_id in lost and h.base_sequence >= 0:
            lost.discard(h.producer_id)
            record(r, h.producer_id, h.producer_epoch, h.base_sequence, h.base_offset,
                   h.record_count)
