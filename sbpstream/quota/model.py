"""What a quota is: its entity (a client id, a stream, a user, a user's client id, or the
default) and three rates.

A quota sets any of produce bytes/s, fetch bytes/s and requests/s; an unset rate is
:data:`UNLIMITED` (-1 on the wire). The rules that refuse hostile values live here, once, and the
PM (:func:`sbpstream.pm.rules.set_quota`), the CLI and the SDK all call :func:`validate`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from sbpstream.auth.acl import check_principal
from sbpstream.protocol.errors import InvalidRequestError

UNLIMITED: Final = -1
"""An unset rate: this quota does not limit it (a client quota's unset rate falls back to the
default quota's)."""

MAX_BYTES_PER_S: Final = 1 << 40
"""Largest byte rate a quota may set (1 TiB/s): far above any data node, small enough that
``rate * window`` never overflows int64 and a typo of many digits is refused, not stored."""

MAX_REQUESTS_PER_S: Final = 1 << 30
"""Largest request rate a quota may set (about 10^9/s): the same reasoning."""

MAX_CLIENT_ID_CHARS: Final = 255
"""A client id is at most this long: Throttr's key size is one byte, and a counter key holds it."""

MAX_QUOTAS: Final = 10_000
"""Most quota records the PM stores: every data node holds them all in memory and pulls them in
one DESCRIBE_QUOTAS response, so the list stays far below one frame."""


class QuotaKind(enum.IntEnum):
    DEFAULT = 0  # applies to each client id that has no quota of its own
    CLIENT = 1  # one client id (with ``user``: that user's connections with that client id)
    STREAM = 2  # one stream, all clients together, on each data node
    USER = 3  # one authenticated principal (``user``), all its client ids together


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One quota record. ``name`` is the client id, the decimal stream id, or "" (default and
    user quotas); ``user`` the principal of a user quota or a user+client-id quota, else ""."""

    kind: QuotaKind
    name: str = ""
    produce_bytes_per_s: int = UNLIMITED
    fetch_bytes_per_s: int = UNLIMITED
    requests_per_s: int = UNLIMITED
    user: str = ""

    @property
    def key(self) -> str:
        """The record's identity: ``default``, ``client/<id>``, ``stream/<id>``,
        ``user/<principal>`` or ``user/<principal>,client/<id>`` (a principal holds no ``,``: the
        keys of different entities never collide)."""
        return entity_key(self.kind, self.name, self.user)

    def rates(self) -> tuple[int, int, int]:
        return self.produce_bytes_per_s, self.fetch_bytes_per_s, self.requests_per_s


def entity_key(kind: QuotaKind, name: str, user: str = "") -> str:
    if kind is QuotaKind.DEFAULT:
        return "default"
    if kind is QuotaKind.USER:
        return f"user/{user}"
    if kind is QuotaKind.CLIENT:
        return f"user/{user},client/{name}" if user else f"client/{name}"
    return f"stream/{name}"


def validate_entity(kind: int, name: str, user: str = "") -> tuple[QuotaKind, str, str]:
    """The entity as stored, or InvalidRequestError saying what is wrong with it."""
    try:
        k = QuotaKind(kind)
    except ValueError:
        raise InvalidRequestError(
            f"quota kind {kind} is unknown (0 default, 1 client, 2 stream, 3 user)") from None
    if user and k not in (QuotaKind.USER, QuotaKind.CLIENT):
        raise InvalidRequestError(
            f"a {k.name.lower()} quota takes no user (a user quota is for all its client "
            "ids, a user+client-id quota for one of them)")
    if k is QuotaKind.DEFAULT:
        if name:
            raise InvalidRequestError("the default quota takes no name")
        return k, "", ""
    if k is QuotaKind.USER:
        if not user:
            raise InvalidRequestError("a user quota needs a user (principal)")
        if name:
            raise InvalidRequestError(
                "a user quota takes no client id; a user+client-id quota is a client quota "
                "with a user")
        return k, "", check_principal(user)
    if k is QuotaKind.CLIENT:
        validate_client_id(name)
        if not name:
            raise InvalidRequestError("a client quota needs a non-empty client id")
        return k, name, check_principal(user) if user else ""
    if not name.isdigit() or int(name) <= 0 or int(name) >= 1 << 63:
        raise InvalidRequestError(f"a stream quota needs a positive stream id, not {name!r}")
    return k, str(int(name)), ""


def validate_client_id(client_id: str) -> str:
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        raise InvalidRequestError(
            f"client id of {len(client_id)} characters; at most {MAX_CLIENT_ID_CHARS}")
    if any(not c.isprintable() for c in client_id):
        raise InvalidRequestError("a client id must be printable characters")
    return client_id


def _check_rate(what: str, value: int, most: int) -> None:
    if value == UNLIMITED:
        return
    if value == 0:
        raise InvalidRequestError(
            f"{what} = 0 would stop all traffic; give a positive rate, or delete the quota")
    if value < 0:
        raise InvalidRequestError(f"{what} = {value} is negative; give a positive rate")
    if value > most:
        raise InvalidRequestError(f"{what} = {value} is above the largest accepted, {most}")


def validate(spec: QuotaSpec) -> QuotaSpec:
    """The spec as stored, or InvalidRequestError naming the first bad value."""
    kind, name, user = validate_entity(int(spec.kind), spec.name, spec.user)
    _check_rate("produce_bytes_per_s", spec.produce_bytes_per_s, MAX_BYTES_PER_S)
    _check_rate("fetch_bytes_per_s", spec.fetch_bytes_per_s, MAX_BYTES_PER_S)
    _check_rate("requests_per_s", spec.requests_per_s, MAX_REQUESTS_PER_S)
    if all(v == UNLIMITED for v in spec.rates()):
        raise InvalidRequestError(
            "a quota must set at least one of produce_bytes_per_s, fetch_bytes_per_s, "
            "requests_per_s")
    return QuotaSpec(kind, name, *spec.rates(), user=user)
