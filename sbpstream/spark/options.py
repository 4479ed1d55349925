"""Options of the ``sbpstream`` Spark data source, named as in Spark's Kafka source. No I/O.

Spark hands options over case-insensitively and as strings (``{"startingoffsets": "latest"}``);
these functions turn them into typed values or raise ``ValueError`` with a one-line message that
names the option, which Spark shows inside its ``PYTHON_DATA_SOURCE_ERROR``.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypedDict

from sbpstream.net.client import parse_address
from sbpstream.protocol.errors import SbpError
from sbpstream.protocol.names import StreamRef, parse_stream_ref, validate_group_name

EARLIEST: Final = -2  # in startingOffsets JSON, as in Kafka
LATEST: Final = -1  # in startingOffsets/endingOffsets JSON, as in Kafka

DEFAULT_TIMEOUT_MS: Final = 15_000  # one client call, retries included (driver and executors)
DEFAULT_FETCH_MAX_BYTES: Final = 4 * 1024 * 1024  # bytes asked per FETCH item by read()
MAX_STREAMS: Final = 10_000  # one query reading more streams than this is a mistake, not a plan

SECURITY_OPTIONS: Final = ("user", "password", "tokenFile", "tlsCa")
"""Credentials and TLS (docs/security.md): a user and password, or a token file; a CA."""
SOURCE_OPTIONS: Final = ("pm", "streams", "streamPattern", "startingOffsets", "endingOffsets",
                         "maxOffsetsPerTrigger", "minPartitions", "failOnDataLoss", "timeoutMs",
                         "fetchMaxBytes", "commitToGroup", *SECURITY_OPTIONS)
SINK_OPTIONS: Final = ("pm", "stream", "timeoutMs", "compression", *SECURITY_OPTIONS)
# Spark's own options, which it hands to every data source as well
SPARK_OPTIONS: Final = frozenset({"path", "checkpointlocation", "queryname"})

# An offset spec per stream (its id, or its name as given): EARLIEST, LATEST or an offset >= 0.
OffsetSpec = dict[StreamRef, int]


class ClientSecurityKwargs(TypedDict):
    user: str
    password: str
    token_file: str
    tls_ca: str


@dataclass(frozen=True, slots=True)
class SecurityOptions:
    """How the driver and executors authenticate and verify servers (empty: plain, open)."""

    user: str = ""
    password: str = ""
    token_file: str = ""
    tls_ca: str = ""

    def client_kwargs(self) -> ClientSecurityKwargs:
        """Keyword arguments of AsyncClient/Client."""
        return {"user": self.user, "password": self.password, "token_file": self.token_file,
                "tls_ca": self.tls_ca}


def parse_security(options: Mapping[str, str]) -> SecurityOptions:
    user = (_get(options, "user") or "").strip()
    password = _get(options, "password") or ""
    token_file = (_get(options, "tokenFile") or "").strip()
    if user and token_file:
        raise ValueError("options 'user' and 'tokenFile' exclude each other: give one")
    if user and not password:
        raise ValueError("option 'user' needs option 'password'")
    if password and not user:
        raise ValueError("option 'password' needs option 'user'")
    return SecurityOptions(user, password, token_file, (_get(options, "tlsCa") or "").strip())


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """What a read (batch or streaming) was asked to do."""

    pm: tuple[str, ...]
    streams: tuple[StreamRef, ...]  # ids and names, as given; () with only a pattern
    starting: OffsetSpec  # per stream: EARLIEST, LATEST or an offset
    ending: OffsetSpec  # per stream: LATEST or an offset (batch only)
    max_offsets_per_trigger: int | None
    min_partitions: int | None
    fail_on_data_loss: bool
    timeout_ms: int
    fetch_max_bytes: int
    pattern: str | None = None
    """``streamPattern``: every live stream whose whole name matches (Kafka's subscribePattern),
    looked up again at every trigger."""
    pattern_start: int = EARLIEST
    """Where the streams the pattern matched at the query's start begin (startingOffsets
    'earliest' or 'latest'); streams it matches later always begin at their earliest."""
    security: SecurityOptions = SecurityOptions()
    commit_group: str | None = None
    """``commitToGroup``: after each finished micro-batch, commit its end offsets to this
    consumer group (for lag in ``sbpstream group describe``; the checkpoint stays the truth)."""


@dataclass(frozen=True, slots=True)
class SinkOptions:
    """What a write (batch or streaming) was asked to do."""

    pm: tuple[str, ...]
    stream: StreamRef | None
    """None: each row's ``stream`` column (a name or an id) routes it."""
    timeout_ms: int
    compression: str | None
    security: SecurityOptions = SecurityOptions()


def _get(options: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup (Spark lower-cases keys; plain dicts in tests may not)."""
    low = name.lower()
    for k, v in options.items():
        if k.lower() == low:
            return None if v is None else str(v)
    return None


def check_names(options: Mapping[str, str], valid: tuple[str, ...], what: str) -> None:
    """Refuse an unknown option, naming the closest valid one (a typo must not be ignored)."""
    by_lower = {v.lower(): v for v in valid}
    for key in options:
        low = key.lower()
        if low in by_lower or low in SPARK_OPTIONS:
            continue
        close = difflib.get_close_matches(low, list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean '{by_lower[close[0]]}'?" if close else ""
        raise ValueError(f"option '{key}' is not an option of the sbpstream {what}{hint} "
                         f"(valid: {', '.join(valid)})")


def parse_pm(options: Mapping[str, str]) -> tuple[str, ...]:
    raw = _get(options, "pm")
    if raw is None or not raw.strip():
        raise ValueError(
            "option 'pm' is required: the placement manager address(es), e.g. "
            ".option('pm', '127.0.0.1:12378')"
        )
    out = tuple(a.strip() for a in raw.split(",") if a.strip())
    for a in out:
        try:
            parse_address(a)
        except ValueError as e:
            raise ValueError(f"option 'pm': bad address {a!r} ({e})") from None
    return out


def _stream_ref(option: str, text: str) -> StreamRef:
    try:
        return parse_stream_ref(text)
    except SbpError as e:
        raise ValueError(f"option '{option}': {e.message}") from None


def parse_pattern(options: Mapping[str, str]) -> str | None:
    """``streamPattern``: a regular expression over whole stream names (checked here)."""
    raw = _get(options, "streamPattern")
    if raw is None:
        return None
    if not raw.strip():
        raise ValueError("option 'streamPattern' is empty")
    try:
        re.compile(raw)
    except re.error as e:
        raise ValueError(f"option 'streamPattern': bad regular expression {raw!r}: {e}"
                         ) from None
    return raw


def parse_streams(options: Mapping[str, str]) -> tuple[StreamRef, ...]:
    raw = _get(options, "streams")
    if raw is None or not raw.strip():
        if _get(options, "streamPattern") is not None:
            return ()
        raise ValueError(
            "option 'streams' (comma-separated stream names or ids, e.g. "
            ".option('streams', 'orders,7')) or option 'streamPattern' is required"
        )
    out: list[StreamRef] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        sid = _stream_ref("streams", part)
        if sid in out:
            raise ValueError(f"option 'streams': stream {sid} is listed twice")
        out.append(sid)
    if not out:
        raise ValueError("option 'streams' names no stream")
    if len(out) > MAX_STREAMS:
        raise ValueError(f"option 'streams': {len(out)} streams, more than {MAX_STREAMS}")
    return tuple(out)


def parse_offsets(
    name: str, raw: str | None, streams: tuple[StreamRef, ...], default: str, *, ending: bool
) -> OffsetSpec:
    """``earliest``, ``latest`` or JSON ``{"<stream>": offset}`` (-2 earliest, -1 latest).

    The JSON must name exactly the streams of option ``streams`` (as Kafka insists on every
    partition), so a typo cannot silently read from the default.
    """
    text = (raw if raw is not None else default).strip()
    low = text.lower()
    if low == "latest":
        return dict.fromkeys(streams, LATEST)
    if low == "earliest":
        if ending:
            raise ValueError(f"option '{name}': 'earliest' is not a valid ending offset")
        return dict.fromkeys(streams, EARLIEST)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"option '{name}': expected 'earliest', 'latest' or JSON like "
            f'{{"{streams[0]}": 0}}, got {text!r} ({e.msg})'
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"option '{name}': JSON must be an object {{\"<stream>\": offset}}")
    spec: OffsetSpec = {}
    for key, value in obj.items():
        sid = _stream_ref(name, str(key))
        if sid not in streams:
            raise ValueError(f"option '{name}': stream {sid} is not in option 'streams'")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"option '{name}': offset of stream {sid} must be an integer")
        low_bound = LATEST if ending else EARLIEST
        if value < low_bound:
            allowed = "-1 (latest) or an offset" if ending else "-2, -1 or an offset"
            raise ValueError(f"option '{name}': offset {value} of stream {sid}: use {allowed}")
        spec[sid] = value
    missing = [s for s in streams if s not in spec]
    if missing:
        raise ValueError(
            f"option '{name}': JSON must give every stream of option 'streams'; missing "
            + ", ".join(map(str, missing))
        )
    return {s: spec[s] for s in streams}


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    raw = _get(options, name)
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw.strip())
    except ValueError:
        raise ValueError(f"option '{name}': {raw!r} is not an integer") from None
    if n <= 0:
        raise ValueError(f"option '{name}' must be positive, not {n}")
    return n


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"option '{name}': {raw!r} is not true or false")


def parse_source_options(options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
    """Parse and check every read option (raises ValueError naming the bad option)."""
    check_names(options, SOURCE_OPTIONS, "source")
    pm = parse_pm(options)
    pattern = parse_pattern(options)
    streams = parse_streams(options)
    if pattern is not None and streams:
        raise ValueError("options 'streams' and 'streamPattern' exclude each other (as Kafka's "
                         "subscribe and subscribePattern): give one")
    pattern_start = EARLIEST
    if pattern is not None:
        low = (_get(options, "startingOffsets") or ("latest" if streaming else "earliest")
               ).strip().lower()
        if low not in ("earliest", "latest"):
            raise ValueError("option 'startingOffsets' with 'streamPattern': 'earliest' or "
                             "'latest' (per-stream JSON needs option 'streams')")
        pattern_start = EARLIEST if low == "earliest" else LATEST
        if _get(options, "endingOffsets") not in (None, "latest"):
            raise ValueError("option 'endingOffsets' with 'streamPattern': only 'latest'")
    starting = {} if pattern is not None else parse_offsets(
        "startingOffsets",
        _get(options, "startingOffsets"),
        streams,
        "latest" if streaming else "earliest",
        ending=False,
    )
    raw_ending = _get(options, "endingOffsets")
    if streaming and raw_ending is not None:
        raise ValueError("option 'endingOffsets' is for batch reads only, not readStream")
    ending = ({} if pattern is not None else
              parse_offsets("endingOffsets", raw_ending, streams, "latest", ending=True))
    max_per_trigger = _positive_int(options, "maxOffsetsPerTrigger")
    if max_per_trigger is not None and not streaming:
        raise ValueError("option 'maxOffsetsPerTrigger' is for readStream only, not batch reads")
    return SourceOptions(
        pm=pm,
        streams=streams,
        starting=starting,
        ending=ending,
        max_offsets_per_trigger=max_per_trigger,
        min_partitions=_positive_int(options, "minPartitions"),
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        timeout_ms=_positive_int(options, "timeoutMs") or DEFAULT_TIMEOUT_MS,
        fetch_max_bytes=_positive_int(options, "fetchMaxBytes") or DEFAULT_FETCH_MAX_BYTES,
        pattern=pattern,
        pattern_start=pattern_start,
        security=parse_security(options),
        commit_group=_group(options, streaming),
    )


def _group(options: Mapping[str, str], streaming: bool) -> str | None:
    raw = _get(options, "commitToGroup")
    if raw is None:
        return None
    if not streaming:
        raise ValueError("option 'commitToGroup' is for streaming reads (spark.readStream)")
    try:
        validate_group_name(raw.strip())
    except SbpError as e:
        raise ValueError(f"option 'commitToGroup': {e.message}") from None
    return raw.strip()


def parse_sink_options(options: Mapping[str, str]) -> SinkOptions:
    """Parse and check every write option (raises ValueError naming the bad option)."""
    pm = parse_pm(options)
    raw = _get(options, "stream")
    if raw is not None and not raw.strip():
        raise ValueError("option 'stream' is empty: give a stream name or id, or leave it out "
                         "and route each row by a 'stream' column")
    if _get(options, "streams") is not None:
        raise ValueError("option 'streams' is for reading: write with option 'stream' (a name "
                         "or id) or a 'stream' column")
    check_names(options, SINK_OPTIONS, "sink")
    stream = None if raw is None else _stream_ref("stream", raw)
    compression = _get(options, "compression")
    if compression is not None and compression.lower() not in ("none", "zstd", "lz4"):
        raise ValueError(f"option 'compression': {compression!r} is not none, zstd or lz4")
    return SinkOptions(
        pm=pm,
        stream=stream,
        timeout_ms=_positive_int(options, "timeoutMs") or DEFAULT_TIMEOUT_MS,
        compression=compression.lower() if compression else None,
        security=parse_security(options),
    )
