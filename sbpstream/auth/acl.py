"""ACL rules and the permission check. No I/O.

A rule grants a principal some operations on a resource: a stream id (``stream:42``), a
stream-name prefix (``prefix:orders-``) or every stream (``*``). With auth on, what no rule grants
is denied. ``admin`` (users, ACLs, quotas) is granted on ``*`` only.

Stream names: streams on main have no name yet, so a stream's name is its decimal id for now
(``prefix:12`` matches streams 12, 120, 1234, ...); when named streams land, :func:`stream_name`
is the one place to change. CREATE is checked against the name of the stream to be created; an
unnamed stream has none yet, so creating needs ``create`` on ``*``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from sbpstream.protocol.errors import InvalidRequestError

MAX_RESOURCE_CHARS: Final = 256
MAX_PRINCIPAL_CHARS: Final = 128
"""Bounds on what a rule may name: far above real names, small enough to keep tokens small."""


class Op(enum.StrEnum):
    CREATE = "create"
    DELETE = "delete"
    UPDATE = "update"
    TRIM = "trim"
    DESCRIBE = "describe"
    APPEND = "append"
    FETCH = "fetch"
    ADMIN = "admin"


ALL_OPS: Final = frozenset(Op)
ANY: Final = "*"


def parse_ops(text: str) -> frozenset[Op]:
    """``append,fetch`` (or ``all``) to the set; InvalidRequestError for an unknown name."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise InvalidRequestError("an ACL names at least one operation")
    if names == ["all"]:
        return ALL_OPS
    try:
        return frozenset(Op(n) for n in names)
    except ValueError:
        raise InvalidRequestError(
            f"unknown operation in {text!r}; known: {', '.join(o.value for o in Op)}, all"
        ) from None


def format_ops(ops: Iterable[Op]) -> str:
    return ",".join(o.value for o in Op if o in set(ops))


def check_resource(resource: str) -> str:
    """The resource, validated: ``*``, ``stream:ID`` or ``prefix:TEXT``."""
    if len(resource) > MAX_RESOURCE_CHARS:
        raise InvalidRequestError(f"ACL resource longer than {MAX_RESOURCE_CHARS} characters")
    if resource == ANY:
        return resource
    kind, sep, rest = resource.partition(":")
    if sep and kind == "stream" and rest.isdigit():
        return f"stream:{int(rest)}"
    if sep and kind == "prefix" and rest:
        return resource
    raise InvalidRequestError(f"ACL resource {resource!r}: expected *, stream:ID or prefix:TEXT")


def check_principal(name: str) -> str:
    if not name or len(name) > MAX_PRINCIPAL_CHARS or not name.isprintable() or "," in name \
            or "=" in name or name != name.strip():
        raise InvalidRequestError(
            f"principal {name!r}: 1-{MAX_PRINCIPAL_CHARS} printable characters, no ',' or '=', "
            "no surrounding spaces")
    return name


def stream_name(stream_id: int) -> str:
    """What ``prefix:`` rules match: the decimal id until streams have names."""
    return str(stream_id)


@dataclass(frozen=True, slots=True)
class AclRule:
    principal: str
    ops: frozenset[Op]
    resource: str

    def to_json(self) -> list[str]:
        return [self.principal, format_ops(self.ops), self.resource]

    @classmethod
    def from_json(cls, v: object) -> AclRule:
        if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, str) for x in v):
            raise ValueError(f"bad ACL rule {v!r}")
        return cls(v[0], parse_ops(v[1]), check_resource(v[2]))

    def matches(self, stream_id: int | None, name: str | None) -> bool:
        if self.resource == ANY:
            return True
        kind, _, rest = self.resource.partition(":")
        if kind == "stream":
            return stream_id is not None and int(rest) == stream_id
        return name is not None and name.startswith(rest)


class Permissions:
    """One principal's rules, with the answers per (operation, stream) remembered: a connection
    asks the same question for every APPEND of a stream."""

    __slots__ = ("_cache", "rules")

    def __init__(self, rules: Iterable[AclRule]) -> None:
        self.rules = tuple(rules)
        self._cache: dict[tuple[Op, int | None], bool] = {}

    def allows(self, op: Op, stream_id: int | None = None) -> bool:
        """``stream_id`` None asks about every stream (CREATE of an unnamed stream, ADMIN)."""
        key = (op, stream_id)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        name = None if stream_id is None else stream_name(stream_id)
        ok = any(op in r.ops and (r.resource == ANY if stream_id is None
                                  else r.matches(stream_id, name)) for r in self.rules)
        if op is Op.ADMIN:
            ok = any(Op.ADMIN in r.ops and r.resource == ANY for r in self.rules)
        if len(self._cache) < 65_536:
            self._cache[key] = ok
        return ok


def rules_by_principal(rules: Iterable[AclRule]) -> Mapping[str, list[AclRule]]:
    out: dict[str, list[AclRule]] = {}
    for r in rules:
        out.setdefault(r.principal, []).append(r)
    return out
