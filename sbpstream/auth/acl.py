"""ACL rules and the permission check. No I/O.

A rule grants a principal some operations on a resource: a stream id (``stream:42``), a
stream-name prefix (``prefix:orders-``), a consumer group (``group:NAME``), a group-name prefix
(``group-prefix:etl-``) or everything (``*``). With auth on, what no rule grants is denied.
``admin`` (users, ACLs, quotas) is granted on ``*`` only.

``prefix:`` rules match stream **names**, never ids: an unnamed stream (name ``""``) is matched
only by ``stream:ID`` and ``*``. A stream's name is fixed at CREATE and never changes (deleting
releases it; ids are never reused), so the servers may remember id to name for good
(:mod:`sbpstream.auth.names`). CREATE is checked against the name of the stream to be created;
an unnamed stream has none, so creating one needs ``create`` on ``*``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
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

IMPLY_DESCRIBE: Final = frozenset({Op.DESCRIBE, Op.APPEND, Op.FETCH, Op.DELETE, Op.UPDATE,
                                   Op.TRIM})
"""As in Kafka (READ, WRITE, DELETE, ALTER imply DESCRIBE): whoever may append to, read, delete,
update or trim a stream (or read a group) may also describe it; a producer and a consumer look
their ranges up."""


def grants(ops: frozenset[Op], op: Op) -> bool:
    """Do a rule's operations grant ``op`` (``describe`` is implied, see IMPLY_DESCRIBE)?"""
    return op in ops or (op is Op.DESCRIBE and not ops.isdisjoint(IMPLY_DESCRIBE))


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


STREAM_KINDS: Final = ("stream", "prefix")
GROUP_KINDS: Final = ("group", "group-prefix")


def check_resource(resource: str) -> str:
    """The resource, validated: ``*``, ``stream:ID``, ``prefix:TEXT``, ``group:NAME`` or
    ``group-prefix:TEXT``."""
    if len(resource) > MAX_RESOURCE_CHARS:
        raise InvalidRequestError(f"ACL resource longer than {MAX_RESOURCE_CHARS} characters")
    if resource == ANY:
        return resource
    kind, sep, rest = resource.partition(":")
    if sep and kind == "stream" and rest.isdigit():
        return f"stream:{int(rest)}"
    if sep and kind in ("prefix", "group", "group-prefix") and rest:
        return resource
    raise InvalidRequestError(f"ACL resource {resource!r}: expected *, stream:ID, prefix:TEXT, "
                              "group:NAME or group-prefix:TEXT")


def check_principal(name: str) -> str:
    if not name or len(name) > MAX_PRINCIPAL_CHARS or not name.isprintable() or "," in name \
            or "=" in name or name != name.strip():
        raise InvalidRequestError(
            f"principal {name!r}: 1-{MAX_PRINCIPAL_CHARS} printable characters, no ',' or '=', "
            "no surrounding spaces")
    return name


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
        """Does this rule's resource cover the stream (``stream_id`` None: a stream to be created;
        ``name`` None or "": unnamed, or the name is not known)?"""
        if self.resource == ANY:
            return True
        kind, _, rest = self.resource.partition(":")
        if kind == "stream":
            return stream_id is not None and int(rest) == stream_id
        if kind == "prefix":
            return bool(name) and name is not None and name.startswith(rest)
        return False

    def covers_pattern(self, name_prefix: str) -> bool:
        """Does this rule cover every stream whose name starts with ``name_prefix``?"""
        if self.resource == ANY:
            return True
        kind, _, rest = self.resource.partition(":")
        return kind == "prefix" and name_prefix.startswith(rest)

    def matches_group(self, group: str) -> bool:
        if self.resource == ANY:
            return True
        kind, _, rest = self.resource.partition(":")
        return (kind == "group" and group == rest) or (
            kind == "group-prefix" and group.startswith(rest))

    @property
    def by_name(self) -> bool:
        return self.resource.startswith("prefix:")


class Permissions:
    """One principal's rules, with the answers per (operation, stream) remembered: a connection
    asks the same question for every APPEND of a stream (a stream's name never changes, so the
    answer for an id does not either)."""

    __slots__ = ("_cache", "_named_ops", "rules")

    def __init__(self, rules: Iterable[AclRule]) -> None:
        self.rules = tuple(rules)
        self._cache: dict[tuple[Op, int | None, str | None], bool] = {}
        self._named_ops = frozenset(o for r in self.rules if r.by_name for o in Op
                                    if grants(r.ops, o))

    def needs_name(self, op: Op, stream_id: int) -> bool:
        """True when only a ``prefix:`` rule could grant ``op`` on the stream: the caller looks
        its name up and asks :meth:`allows` with it. False: :meth:`allows` answers without."""
        return op in self._named_ops and op is not Op.ADMIN and not self.allows(op, stream_id)

    def allows(self, op: Op, stream_id: int | None = None, name: str | None = None) -> bool:
        """``stream_id`` None: a stream still to be created (named ``name``, or unnamed), or a
        question about every stream (ADMIN). ``name`` "" or None: matched by id and ``*`` only."""
        key = (op, stream_id, name)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if op is Op.ADMIN:
            ok = any(Op.ADMIN in r.ops and r.resource == ANY for r in self.rules)
        else:
            ok = any(grants(r.ops, op) and r.matches(stream_id, name) for r in self.rules)
        if len(self._cache) < 65_536:
            self._cache[key] = ok
        return ok

    def allows_pattern(self, op: Op, name_prefix: str) -> bool:
        """May ``op`` be done on every stream named ``name_prefix...`` (a group's pattern)?"""
        return any(grants(r.ops, op) and r.covers_pattern(name_prefix) for r in self.rules)

    def allows_group(self, op: Op, group: str) -> bool:
        return any(grants(r.ops, op) and r.matches_group(group) for r in self.rules)
