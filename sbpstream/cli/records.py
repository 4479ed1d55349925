"""`sbpstream produce|consume`: records from stdin and to stdout."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any, BinaryIO, NoReturn, TypeVar

import typer

from sbpstream.cli.app import (
    CLIENT_ID,
    EXIT_USAGE,
    READ_CHUNK_BYTES,
    UNSET,
    CliError,
    LiveCount,
    PmOption,
    TimeoutOption,
    app,
    compression_of,
    err_console,
    explain,
    fail,
    interrupted,
    stream_ref,
    valid_pm,
)
from sbpstream.client import Client
from sbpstream.client._sync_support import RecordFuture
from sbpstream.client.producer import Offsets
from sbpstream.client.types import (
    ConsumedRecord,
    StartPosition,
    codec_of,
)
from sbpstream.protocol.errors import (
    OffsetOutOfRangeError,
    SbpError,
)
from sbpstream.records import RecordTooLargeError

# ----------------------------------------------------------------------------- produce / consume

T = TypeVar("T")


def _stdin_lines(chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[list[bytes]]:
    """Lines of stdin as bytes without their newline, a chunk's worth at a time."""
    fd = sys.stdin.fileno()
    rest = b""
    while True:
        chunk = os.read(fd, chunk_bytes)
        if not chunk:
            break
        lines = chunk.split(b"\n")
        if rest:  # the line cut at the end of the previous chunk (only it is copied again)
            lines[0] = rest + lines[0]
        rest = lines.pop()
        if lines:
            yield lines
    if rest:
        yield [rest]


@app.command()
def produce(
    stream: Annotated[str, typer.Option("--stream", help="Stream name or id to append to.",
                                        show_default=False)],
    pm: PmOption = "",
    key: Annotated[str | None, typer.Option("--key", help="Key of every record (UTF-8).")
                   ] = None,
    key_separator: Annotated[str | None, typer.Option(
        "--key-separator", help="Each line is KEY<SEP>VALUE, split at the first SEP "
        "(like kafka-console-producer's parse.key/key.separator).", show_default=False)] = None,
    compression: Annotated[str, typer.Option(
        "--compression", help="Batch compression: none, zstd or lz4.")] = "none",
    linger_ms: Annotated[float, typer.Option(
        "--linger-ms", help="How long a batch waits for more records.")] = 5.0,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Append each line of stdin as one record (value = the line without its newline).

    Binary-safe. Exits 0 only when every record was acknowledged.
    """
    # stdin is read 1 MiB at a time; the lines of a read go to the producer in one send_batch
    # call: one call into the client's loop thread and one future per read, not per line
    produce_chunk_bytes = 1 << 20
    try:
        codec_of(compression)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)
    key_bytes = key.encode() if key is not None else None
    if key_separator is not None and key is not None:
        fail("--key and --key-separator exclude each other", EXIT_USAGE)
    if key_separator == "":
        fail("--key-separator must not be empty", EXIT_USAGE)
    sep = key_separator.encode() if key_separator is not None else None
    valid_pm(pm)
    try:
        with Client(pm, retry_deadline_ms=timeout_ms, client_id=CLIENT_ID["id"]) as c:
            sid = c.resolve_stream(stream_ref(stream))
            c.describe_stream(sid)  # a clear error before reading any input
            p = c.producer(compression=compression_of(compression), linger_ms=linger_ms)
            batches: list[concurrent.futures.Future[Offsets]] = []
            singles: list[RecordFuture] = []
            live = LiveCount("produced")
            for lines in _stdin_lines(produce_chunk_bytes):
                live.add(len(lines))
                if sep is not None:  # a key per line: records one at a time
                    pairs = _split_keys(lines, sep, len(singles))
                    singles += [p.send(sid, v, key=k) for k, v in pairs]
                else:  # one call (one cross-thread hop) per chunk of stdin
                    batches.append(p.send_batch(sid, lines, key=key_bytes))
            p.close()
            live.clear()
            n = failed = 0
            first = last = -1
            first_error: BaseException | None = None
            for single in singles:
                n += 1
                error = single.exception()
                if error is not None:
                    failed += 1
                    first_error = first_error or error
                else:
                    off = single.result()
                    first = off if first < 0 else min(first, off)
                    last = max(last, off)
            for f in batches:
                offsets = f.result()
                n += len(offsets)
                if offsets.error is not None:
                    failed += offsets.failed
                    first_error = first_error or offsets.error
                for i in (0, len(offsets) - 1) if len(offsets) else ():
                    try:
                        off = offsets[i]
                    except SbpError:  # a failed record has no offset
                        continue
                    first = off if first < 0 else min(first, off)
                    last = max(last, off)
    except SbpError as exc:
        fail(explain(exc, pm))
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    except RecordTooLargeError as exc:
        fail(f"a line is too large for one record: {exc}")
    except KeyboardInterrupt:
        interrupted()
    if failed:
        why = explain(first_error, pm) if isinstance(first_error, SbpError) else first_error
        fail(f"{failed} of {n} records were not acknowledged: {why}")
    err_console.print(f"produced {n} records to stream {stream}"
                      + (f" (offsets {first}..{last})" if n else ""))




def _split_keys(lines: list[bytes], sep: bytes, first_line: int) -> list[tuple[bytes, bytes]]:
    """KEY<SEP>VALUE lines as (key, value); a line without SEP is an error naming it."""
    out = []
    for i, ln in enumerate(lines):
        k, found, v = ln.partition(sep)
        if not found:
            raise CliError(f"line {first_line + i + 1} has no key separator {sep.decode()!r} "
                           "(--key-separator)")
        out.append((k, v))
    return out





def _parse_from(value: str) -> StartPosition:
    if value == "earliest":
        return "earliest"
    if value == "latest":
        return "latest"
    try:
        off = int(value)
    except ValueError:
        fail(f"--from {value!r}: expected earliest, latest or an offset", EXIT_USAGE)
    if off < 0:
        fail(f"--from {off}: offsets are >= 0", EXIT_USAGE)
    return off


@app.command()
def consume(
    stream: Annotated[str, typer.Option("--stream", help="Stream name or id to read.",
                                        show_default=False)],
    pm: PmOption = "",
    start: Annotated[str, typer.Option(
        "--from", help="Where to start: earliest, latest or an offset.")] = "earliest",
    count: Annotated[int | None, typer.Option(
        "--count", min=0, help="Stop after this many records.", show_default=False)] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", help="Keep waiting for new records instead of exiting when caught up.")
                      ] = False,
    print_offset: Annotated[bool, typer.Option(
        "--print-offset", help="Prefix each value with Offset:N and a tab.")] = False,
    print_timestamp: Annotated[bool, typer.Option(
        "--print-timestamp", help="Prefix each value with CreateTime:MS and a tab.")] = False,
    print_key: Annotated[bool, typer.Option(
        "--print-key", help="Prefix each value with its key (null if none) and a tab.")
                         ] = False,
    output_format: Annotated[str, typer.Option(
        "--format", help="raw (the value, with the --print-* prefixes) or json (one object "
        "per record: stream, offset, timestamp_ms, key, value, headers; bytes that are not "
        "UTF-8 go in key_base64/value_base64).")] = "raw",
    group: Annotated[str | None, typer.Option(
        "--group", help="Read as a member of this consumer group: resume at its committed "
        "offset (--from only when it has none) and commit what was written.",
        show_default=False)] = None,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Write one record per line to stdout: its value as raw bytes, or JSON with --format json.

    Exits when caught up with the stream's end (unless --follow) or after --count records.
    --print-timestamp, --print-offset and --print-key prefix the value, tab-separated, in that
    order (as kafka-console-consumer's print.timestamp/print.offset/print.key). With --group
    the next run resumes after the last record written (offsets are committed every few
    seconds and at exit: a record may be written again after a crash, never skipped).
    """
    pos = _parse_from(start)
    if output_format not in ("raw", "json"):
        fail(f"--format {output_format!r}: expected raw or json", EXIT_USAGE)
    line_of = _record_formatter(output_format, print_timestamp, print_offset, print_key)
    valid_pm(pm)
    out = sys.stdout.buffer
    try:
        with Client(pm, retry_deadline_ms=timeout_ms) as c:
            sid = c.resolve_stream(stream_ref(stream))
            end = None
            if not follow:
                end = c.end_offset(sid)
                if isinstance(pos, int) and pos > end:
                    raise OffsetOutOfRangeError(
                        f"offset {pos} is beyond the end {end} of stream {stream}")
            else:
                c.describe_stream(sid)
            if count == 0:
                return
            if group is not None:
                _consume_group(c, group, sid, pos, end, count, line_of, out)
                return
            cons = c.consumer(sid, pos, end=end)
            live = LiveCount("consumed")
            for n, rec in enumerate(cons, 1):
                out.write(line_of(rec))
                live.add(1)
                if count is not None and n >= count:
                    break
                if follow and not cons.buffered:
                    out.flush()  # about to wait for more: show what we have
            live.clear()
            out.flush()
    except SbpError as exc:
        fail(explain(exc, pm))
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except KeyboardInterrupt:
        interrupted()


def _consume_group(c: Client, group: str, sid: int, pos: StartPosition, end: int | None,
                   count: int | None, line_of: Callable[[ConsumedRecord], bytes],
                   out: BinaryIO) -> None:
    """``consume --group``: a group member; without --follow it stops at ``end``."""
    if end is not None:
        done = c.committed_offsets(group, [sid]).get(sid)
        if done is not None and done >= end:
            return  # the group has read everything there is
    live = LiveCount("consumed")
    with c.consumer(sid, pos, group=group) as cons:
        for n, rec in enumerate(cons, 1):
            out.write(line_of(rec))
            live.add(1)
            if (count is not None and n >= count) or (end is not None and rec.offset + 1 >= end):
                break
            if end is None and not cons.buffered:
                out.flush()
        live.clear()
        out.flush()


def _record_formatter(fmt: str, timestamp: bool, offset: bool, key: bool
                      ) -> Callable[[ConsumedRecord], bytes]:
    """How ``consume`` turns a record into one output line (newline included)."""
    if fmt == "json":
        def as_json(rec: ConsumedRecord) -> bytes:
            obj: dict[str, Any] = {"stream": rec.stream_id, "offset": rec.offset,
                                   "timestamp_ms": rec.timestamp_ms}
            _put_bytes(obj, "key", rec.key)
            _put_bytes(obj, "value", rec.value)
            if rec.headers:
                obj["headers"] = [_put_bytes({"name": n}, "value", v) for n, v in rec.headers]
            return json.dumps(obj, ensure_ascii=False).encode() + b"\n"
        return as_json
    if not (timestamp or offset or key):
        return lambda rec: (rec.value or b"") + b"\n"

    def prefixed(rec: ConsumedRecord) -> bytes:
        parts = []
        if timestamp:
            parts.append(b"CreateTime:%d" % rec.timestamp_ms)
        if offset:
            parts.append(b"Offset:%d" % rec.offset)
        if key:
            parts.append(b"null" if rec.key is None else rec.key)
        parts.append(rec.value or b"")
        return b"\t".join(parts) + b"\n"
    return prefixed


def _put_bytes(obj: dict[str, Any], name: str, data: bytes | None) -> dict[str, Any]:
    """``obj[name]`` = the UTF-8 text of ``data`` (None: null), else ``obj[name_base64]``."""
    if data is None:
        obj[name] = None
    else:
        try:
            obj[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            obj[f"{name}_base64"] = base64.b64encode(data).decode("ascii")
    return obj


def _quiet_broken_pipe() -> NoReturn:
    # stdout's reader went away (e.g. `| head`): not an error; silence the flush at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0)


