"""Stream names: the rules every side checks (PM, SDK, CLI, Spark), in one place. No I/O.

A stream may carry one unique name (the ``name`` project field of CREATE_STREAMS and Stream).
The rules follow Kafka's topic names, so a name that works there works here:

- 1 to :data:`MAX_STREAM_NAME_LEN` characters of ``[a-zA-Z0-9._-]``;
- not ``.`` or ``..`` (they read as paths in tools and URLs);
- and, unlike Kafka, not all digits: wherever a stream is given as text (``--stream NAME|ID``,
  Spark's ``streams`` option, the sink's ``stream`` column) a string of digits is an id, so a
  name must not look like one.

Names are unique among live streams; deleting a stream releases its name.
"""

from __future__ import annotations

import re
from typing import Final

from sbpstream.protocol.errors import InvalidRequestError, InvalidStreamConfigError

MAX_STREAM_NAME_LEN: Final = 249
"""Kafka's bound on topic names (255 minus room for its partition-directory suffix); it keeps a
name usable as one path component and one etcd key segment everywhere."""

_NAME_CHARS: Final = re.compile(r"[a-zA-Z0-9._-]+")

StreamRef = int | str
"""A stream as the SDK takes it: its id, or its name."""


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid stream name, as one line; None when it is."""
    if not name:
        return "a stream name must not be empty"
    if len(name) > MAX_STREAM_NAME_LEN:
        return (f"stream name {name[:40]!r}... is {len(name)} characters; "
                f"at most {MAX_STREAM_NAME_LEN} are allowed")
    if _NAME_CHARS.fullmatch(name) is None:
        bad = sorted({c for c in name if _NAME_CHARS.fullmatch(c) is None})
        return (f"stream name {name!r} has invalid characters {''.join(bad)!r}; "
                "only a-z A-Z 0-9 . _ - are allowed")
    if name in (".", ".."):
        return f"stream name {name!r} is reserved"
    if name.isdigit():
        return f"stream name {name!r} is all digits, which reads as a stream id"
    return None


def validate_stream_name(name: str) -> str:
    """``name`` when valid; InvalidStreamConfigError (one line) otherwise."""
    problem = name_problem(name)
    if problem is not None:
        raise InvalidStreamConfigError(problem)
    return name


def validate_name_prefix(prefix: str) -> str:
    """A DESCRIBE_STREAMS ``name_prefix``: "" or characters a name may contain."""
    if len(prefix) > MAX_STREAM_NAME_LEN or (
            prefix and _NAME_CHARS.fullmatch(prefix) is None):
        raise InvalidRequestError(
            f"name prefix {prefix[:40]!r} is not a valid start of a stream name")
    return prefix


def prefix_upper_bound(prefix: str) -> str:
    """The smallest string above every valid name starting with ``prefix`` (names are ASCII
    below 0x7f), for range scans: ``prefix <= name < prefix_upper_bound(prefix)``."""
    return prefix + "\x7f"


def parse_stream_ref(text: str) -> StreamRef:
    """Text naming a stream (CLI, Spark options and columns): digits are an id, anything else
    a name (validated). InvalidStreamConfigError, one line, for neither."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    validate_stream_name(text)
    return text


MAX_GROUP_NAME: Final = 255
"""UTF-8 bytes of a consumer group's name."""


def validate_group_name(group: str) -> None:
    """A consumer group's name: 1..255 printable UTF-8 bytes without '/' (it is part of an etcd
    key); InvalidRequestError otherwise."""
    raw = group.encode()
    if not raw or len(raw) > MAX_GROUP_NAME or "/" in group or not group.isprintable():
        raise InvalidRequestError(f"bad group name {group!r}: 1-{MAX_GROUP_NAME} printable "
                                  "UTF-8 bytes without '/'")
