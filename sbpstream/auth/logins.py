"""Failed SCRAM logins, per source address: how long the next login from there waits.

Each failed login from a source (the peer's IP address, not its port) makes that source's next
logins wait :func:`login_delay_s` of its failure count: 0.1 s after the first, doubling per
failure, at most ``LOGIN_DELAY_MAX_S``. Logins from one source are also spaced by that delay when
they come at once (several connections), so parallel guesses do not get around it. The wait is
an ``asyncio.sleep`` in the login's own handler: the event loop, other connections and other
sources go on. A source whose last failure is ``LOGIN_FAILURES_FORGET_S`` old starts from zero;
a success does not reset it (a valid account must not launder guesses at another one). Pure
bookkeeping: the caller sleeps and logs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

LOGIN_DELAY_BASE_S: Final = 0.1
"""The wait after one failure: a mistyped password costs a person nothing noticeable."""
LOGIN_DELAY_MAX_S: Final = 5.0
"""The longest wait per login: a guesser gets at most one try per 5 s per source address,
while a client that retries a bad password in a loop is still answered, not hung."""
LOGIN_QUEUE_MAX_S: Final = 8.0
"""A source whose waiting logins would start more than this far ahead is refused at once
instead of queued: a flood of parallel attempts ties up no more than this of waiting, and a
queued login is still answered within the SDK's 10 s AUTHENTICATE timeout."""
LOGIN_FAILURES_FORGET_S: Final = 300.0
"""A source with no failure for this long is forgotten (back to no delay)."""
LOGIN_SOURCES_MAX: Final = 10_000
"""Sources remembered at most (least recently failed forgotten first): bounds the memory an
attacker with many addresses can make the PM spend."""


def login_delay_s(failures: int) -> float:
    """The wait before a login from a source with ``failures`` recent failures."""
    if failures <= 0:
        return 0.0
    return min(LOGIN_DELAY_MAX_S, LOGIN_DELAY_BASE_S * 2.0 ** min(failures - 1, 32))


def source_of(peer: str) -> str:
    """``1.2.3.4:5678`` or ``::1:5678`` -> the address without the port."""
    host, sep, _port = peer.rpartition(":")
    return host if sep else peer


@dataclass(slots=True)
class _Source:
    failures: int = 0
    last_failure: float = 0.0
    next_at: float = 0.0  # no login from this source starts before this time


class LoginThrottle:
    """Per-source failure counts and login spacing; times are the caller's monotonic clock."""

    def __init__(self) -> None:
        self._sources: OrderedDict[str, _Source] = OrderedDict()

    def _get(self, source: str, now: float) -> _Source | None:
        s = self._sources.get(source)
        if s is not None and now - s.last_failure >= LOGIN_FAILURES_FORGET_S:
            del self._sources[source]
            return None
        return s

    def failures(self, source: str, now: float) -> int:
        s = self._get(source, now)
        return s.failures if s is not None else 0

    def admit(self, source: str, now: float) -> float | None:
        """A login from ``source`` starts: the seconds it must wait first (0.0 for a source
        without failures), or None when it would wait more than ``LOGIN_QUEUE_MAX_S``."""
        s = self._get(source, now)
        if s is None:
            return 0.0
        start = max(now, s.next_at)
        if start - now > LOGIN_QUEUE_MAX_S:
            return None
        s.next_at = start + login_delay_s(s.failures)  # the one after this waits its turn
        return start - now

    def failed(self, source: str, now: float) -> tuple[int, float]:
        """A login from ``source`` failed: its failure count and the delay its next login
        waits."""
        s = self._get(source, now) or _Source()
        s.failures += 1
        s.last_failure = now
        delay = login_delay_s(s.failures)
        s.next_at = max(s.next_at, now + delay)
        self._sources[source] = s
        self._sources.move_to_end(source)
        while len(self._sources) > LOGIN_SOURCES_MAX:
            self._sources.popitem(last=False)
        return s.failures, delay
