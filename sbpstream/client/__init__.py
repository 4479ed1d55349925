"""The sbpstream SDK: :class:`AsyncClient` (asyncio, written by hand) and :class:`Client`
(synchronous, generated from it), with batching idempotent producers and consumers.

Example::

    from sbpstream.client import Client

    with Client("127.0.0.1:12378") as c:
        sid = c.create_stream()
        with c.producer() as p:
            fut = p.send(sid, b"hello")
        print(fut.result())  # the record's offset
        for rec in c.consumer(sid, "earliest", end=c.end_offset(sid)):
            print(rec.offset, rec.value)
"""


from sbpstream.client.aclient import AsyncClient
from sbpstream.client.admin import AsyncAdmin
from sbpstream.client.consumer import AsyncConsumer, iter_columns
from sbpstream.client.producer import AsyncProducer
from sbpstream.client.sync import Admin, Client, Consumer, Producer
from sbpstream.client.types import (
    DEFAULT_PM,
    DEFAULT_RETENTION_MS,
    PM_ENV,
    ColumnBatch,
    Compression,
    ConsumedRecord,
    Range,
    Record,
    RetryPolicy,
    StartPosition,
    Stream,
    pm_addresses,
)
from sbpstream.protocol.errors import ClientClosedError, ProducerClosedError, SbpError

__all__ = [
    "DEFAULT_PM",
    "DEFAULT_RETENTION_MS",
    "PM_ENV",
    "Admin",
    "AsyncAdmin",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "Client",
    "ClientClosedError",
    "ColumnBatch",
    "Compression",
    "ConsumedRecord",
    "Consumer",
    "Producer",
    "ProducerClosedError",
    "Range",
    "Record",
    "RetryPolicy",
    "SbpError",
    "StartPosition",
    "Stream",
    "iter_columns",
    "pm_addresses",
]
