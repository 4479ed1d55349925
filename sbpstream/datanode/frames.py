"""FramePacker: a FETCH's results and record batches packed into response frames.

Every read (pull FETCH, push subscription, fetch session; datanode/reader.py) sends through one
packer per request: results accumulate with their payload views (memoryviews over the segment
maps, no copies) and a frame goes out when the next batch would not fit, one FetchResult per
batch in the frame's header, in payload order. The packer also adds up the payload bytes served
per stream, which the fetch quota is charged with (:meth:`ItemReader.charge`).
"""

from __future__ import annotations

from sbpstream.datanode.limits import MAX_BATCHES_PER_FETCH_FRAME
from sbpstream.net.server import Responder
from sbpstream.protocol.messages import FetchResponse, FetchResult, Status


class FramePacker:
    """Accumulates results and payload views; sends a frame when the next batch would not fit.

    With ``first_frame_bytes`` (subscriptions) the first frame closes at that size and each
    next one may be four times the last, up to ``frame_bytes``: the consumer starts decoding
    after a few streams were read instead of after a whole frame's worth (a 1 MiB frame of
    100 B records is ~100 streams read, encoded and checksummed before it can go), while the
    node goes on filling the next frames."""

    __slots__ = ("frame_bytes", "frame_payload", "frames", "max_frame_bytes", "parts", "resp",
                 "results", "session_id", "status", "stream_bytes", "throttle_ms",
                 "total_bytes")

    def __init__(self, resp: Responder, frame_bytes: int,
                 first_frame_bytes: int | None = None) -> None:
        self.resp = resp
        self.status = Status()  # the response's top-level status (sent in every frame)
        self.max_frame_bytes = frame_bytes
        self.frame_bytes = min(frame_bytes, first_frame_bytes or frame_bytes)
        self.results: list[FetchResult] = []
        self.parts: list[memoryview] = []
        self.frame_payload = 0
        self.total_bytes = 0
        self.frames = 0
        self.stream_bytes: dict[int, int] = {}  # quotas: bytes served per stream, not charged
        self.throttle_ms = 0  # quotas: carried once, by the next frame
        self.session_id = 0  # the fetch session served (in every frame's header)

    async def add(self, result: FetchResult, view: memoryview | None = None) -> None:
        size = 0 if view is None else len(view)
        if self.results and (self.frame_payload + size > self.frame_bytes
                             or len(self.results) >= MAX_BATCHES_PER_FETCH_FRAME):
            await self.flush(end=False)
        self.results.append(result)
        if view is not None:
            self.parts.append(view)
            self.frame_payload += size
            self.total_bytes += size
            sid = result.stream_id
            self.stream_bytes[sid] = self.stream_bytes.get(sid, 0) + size

    async def flush(self, *, end: bool) -> None:
        if not end and not self.results:
            return
        # throttle_ms: set before the END frame of a long poll, or after a subscription's round
        # went over its quota; carried once, by the next frame
        header = FetchResponse(self.throttle_ms, status=self.status, items=tuple(self.results),
                               session_id=self.session_id).encode()
        self.throttle_ms = 0
        parts, self.parts, self.results, self.frame_payload = self.parts, [], [], 0
        await self.resp.send(header, parts, end=end)
        self.frames += 1
        if self.frame_bytes < self.max_frame_bytes:
            self.frame_bytes = min(self.max_frame_bytes, self.frame_bytes * 4)


__all__ = ["FramePacker"]
