"""The producer's per-stream flow state, as a table (h2's ``_transitions`` pattern). No I/O.

A stream of an :class:`~sbpstream.client.producer.AsyncProducer` is in one of these states::

    SENDING --LOOKUP--> RESOLVING --LOOKUP_DONE--> SENDING
    SENDING --SEND_FAILED--> DRAINING --SEND_FAILED--> DRAINING
    DRAINING --ALL_FAILED--> RECOVERING --RECOVERY_DONE--> SENDING
    DRAINING --NONE_IN_FLIGHT--> SENDING

Only SENDING dispatches batches. Any other (state, event) pair is a bug in the producer: the
stream moves to BROKEN, which no event leaves, and :class:`ProducerFlowError` says which pair it
was (the producer then fails the stream's records instead of leaving them waiting).
"""

from __future__ import annotations

import enum


class Flow(enum.Enum):
    """Where a stream of a producer is in its flow."""

    SENDING = "sending"  # batches go out, up to max_in_flight_per_stream at once
    RESOLVING = "resolving"  # no writable range is cached and none is in flight: looking it up
    DRAINING = "draining"  # a send failed: nothing new goes until every batch in flight settles
    RECOVERING = "recovering"  # the recovery task runs (seal and settle, refresh or back off)
    BROKEN = "broken"  # an event the state does not allow arrived: terminal


class FlowEvent(enum.Enum):
    """What happens to a stream of a producer."""

    LOOKUP = "lookup"  # the dispatcher found no writable range, with nothing in flight
    LOOKUP_DONE = "lookup_done"  # the lookup ended (a range is cached, or the records failed)
    SEND_FAILED = "send_failed"  # the send of one of the stream's batches failed
    ALL_FAILED = "all_failed"  # draining, and every batch still in flight has failed
    NONE_IN_FLIGHT = "none_in_flight"  # draining, and nothing is in flight any more
    RECOVERY_DONE = "recovery_done"  # the recovery task ended (requeued or failed the batches)


TRANSITIONS: dict[tuple[Flow, FlowEvent], Flow] = {
    (Flow.SENDING, FlowEvent.LOOKUP): Flow.RESOLVING,
    (Flow.RESOLVING, FlowEvent.LOOKUP_DONE): Flow.SENDING,
    (Flow.SENDING, FlowEvent.SEND_FAILED): Flow.DRAINING,
    (Flow.DRAINING, FlowEvent.SEND_FAILED): Flow.DRAINING,
    (Flow.DRAINING, FlowEvent.ALL_FAILED): Flow.RECOVERING,
    (Flow.DRAINING, FlowEvent.NONE_IN_FLIGHT): Flow.SENDING,
    (Flow.RECOVERING, FlowEvent.RECOVERY_DONE): Flow.SENDING,
}


class ProducerFlowError(RuntimeError):
    """An event arrived in a state that does not allow it (a bug in the producer)."""


class FlowMachine:
    """The flow state of one stream of a producer; :meth:`process` applies an event."""

    __slots__ = ("error", "state")

    def __init__(self) -> None:
        self.state = Flow.SENDING
        self.error: ProducerFlowError | None = None  # set when the stream became BROKEN

    def process(self, event: FlowEvent) -> Flow:
        """Move by ``event``; return the new state. An unexpected pair moves to BROKEN (for
        good) and raises :class:`ProducerFlowError`."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            err = ProducerFlowError(
                f"producer flow: event {event.name} is not allowed in state {self.state.name}")
            if self.error is None:
                self.error = err  # the first one: what broke the stream
            self.state = Flow.BROKEN
            raise err
        self.state = new
        return new
