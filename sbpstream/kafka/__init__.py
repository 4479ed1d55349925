"""A Kafka wire-protocol gateway: unchanged Kafka clients produce to and consume from sbpstream.

:mod:`~sbpstream.kafka.codec` (the binary protocol, schema driven), :mod:`~sbpstream.kafka.schemas`
(the messages and versions served), :mod:`~sbpstream.kafka.records` (record batch v2 to and from
sbpstream records) and :mod:`~sbpstream.kafka.errors` do no I/O (importing this package imports
none of the server); :mod:`~sbpstream.kafka.sasl` (listeners, limits, PLAIN) likewise;
:mod:`~sbpstream.kafka.gateway` is the asyncio server over the SDK, with its connections
(:mod:`~sbpstream.kafka.connections`), per-principal sessions (:mod:`~sbpstream.kafka.session`)
and consumer groups (:mod:`~sbpstream.kafka.group_handlers`). See
docs/kafka.md.
"""
