"""Segment files of the shared log: creation, writes, memory maps, cutting a bad tail aside.

The active segment is created at its full size (``ftruncate``: a sparse file), so its size never
changes while it is written and ``fdatasync`` alone makes appended bytes durable; it is mapped
once at that size and reads take views of the map, which never needs remapping. When it is full
it is cut to its exact length (``ftruncate``) and fsynced; its map stays (we never touch bytes past
the valid end). Sealed segments are mapped lazily at their exact size.

Maps and exported views: ``mmap.close()`` raises BufferError while a memoryview over it lives
(a read result still being sent). A deleted segment's file is unlinked at once (the mapping stays
valid on POSIX) and its map is closed when the last view is released: ``release()`` tries, and the
store retries such "zombie" maps later and at close.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from sbpstream.private_files import open_private
from sbpstream.store.limits import ZERO_SCAN_CHUNK_BYTES

log = logging.getLogger(__name__)

SEGMENT_SUFFIX: Final = ".log"
SEGMENT_DIGITS: Final = 10

Buffer = bytes | bytearray | memoryview
# The write primitive; a module attribute so tests can inject a failing (ENOSPC) writer.
pwritev: Callable[[int, Sequence[Buffer], int], int] = os.pwritev


def segment_name(segment_id: int) -> str:
    return f"{segment_id:0{SEGMENT_DIGITS}d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem = name[: -len(SEGMENT_SUFFIX)]
    if name.endswith(SEGMENT_SUFFIX) and len(stem) == SEGMENT_DIGITS and stem.isdigit():
        return int(stem)
    return None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Segment:
    """One segment file. ``end`` is the end of its valid entries (the next write position)."""

    __slots__ = ("_map", "_map_size", "end", "fd", "file_size", "live_bytes", "path", "segment_id")

    def __init__(self, segment_id: int, path: Path, fd: int, file_size: int, end: int) -> None:
        self.segment_id = segment_id
        self.path = path
        self.fd = fd
        self.file_size = file_size
        self.end = end
        self.live_bytes = 0
        self._map: mmap.mmap | None = None
        self._map_size = 0

    @classmethod
    def create(cls, directory: Path, segment_id: int, size: int) -> Segment:
        """A new preallocated (sparse) segment. The caller fsyncs the directory before relying
        on it (the group-commit fsync does, see Store)."""
        path = directory / segment_name(segment_id)
        fd = open_private(path, os.O_RDWR | os.O_EXCL)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(segment_id, path, fd, size, 0)

    @classmethod
    def open(cls, path: Path, segment_id: int) -> Segment:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        return cls(segment_id, path, fd, size, size)

    # --- reading

    def buffer(self) -> mmap.mmap:
        """The map of this segment (created on first use). Only bytes below ``end`` are valid."""
        if self._map is None:
            if self.file_size == 0:
                raise ValueError(f"segment {self.path} is empty")
            self._map = mmap.mmap(self.fd, self.file_size, access=mmap.ACCESS_READ)
            self._map_size = self.file_size
        return self._map

    def view(self, position: int, length: int) -> memoryview:
        if position < 0 or position + length > min(self.end, self._mapped_size()):
            raise ValueError(f"view [{position}, +{length}) outside {self.path} end {self.end}")
        return memoryview(self.buffer())[position : position + length]

    def _mapped_size(self) -> int:
        return self._map_size if self._map is not None else self.file_size

    def pread(self, position: int, length: int) -> bytes:
        return os.pread(self.fd, length, position)

    # --- writing

    def write(self, parts: Sequence[Buffer], total: int) -> int:
        """Write ``parts`` at ``end``; return the position written. On any failure the partial
        write is undone (the region is zeroed again) and the error re-raised."""
        position = self.end
        try:
            done = 0
            pending: list[Buffer] = list(parts)
            while done < total:
                n = pwritev(self.fd, pending, position + done)
                if n <= 0:
                    raise OSError(f"pwritev wrote {n} bytes")
                done += n
                pending = _skip(pending, n)
        except BaseException:
            self.zero_from(position, log_errors=True)
            raise
        self.end = position + total
        return position

    def zero_from(self, position: int, *, log_errors: bool = False) -> None:
        """Give back the bytes from ``position`` to the preallocated size as zeros (a hole)."""
        try:
            os.ftruncate(self.fd, position)
            os.ftruncate(self.fd, self.file_size)
        except OSError:
            if not log_errors:
                raise
            log.exception("could not undo a partial write in %s at %d", self.path, position)

    def cut_to_end(self) -> None:
        """Shrink the file to its valid end (the segment is full or being cut); fsync it."""
        os.ftruncate(self.fd, self.end)
        self.file_size = self.end
        os.fsync(self.fd)

    def find_nonzero_end(self, start: int) -> int:
        """The end of the last non-zero byte at or after ``start`` (``start`` when all zero)."""
        last = start
        position = start
        while position < self.file_size:
            position = _next_data(self.fd, position, self.file_size)  # skip holes
            size = min(ZERO_SCAN_CHUNK_BYTES, self.file_size - position)
            if size <= 0:
                break
            chunk = os.pread(self.fd, size, position)
            if not chunk:
                break
            if chunk != _ZEROS[: len(chunk)]:  # memcmp first: rstrip is slow on long zero runs
                last = position + len(chunk.rstrip(b"\0"))
            position += len(chunk)
        return last

    def copy_aside(self, start: int, stop: int) -> Path:
        """Copy bytes [start, stop) to ``<segment>.corrupt-<start>`` (fsynced) before a cut."""
        side = self.path.with_name(f"{self.path.name}.corrupt-{start}")
        fd = open_private(side, os.O_WRONLY | os.O_TRUNC)
        try:
            position = start
            while position < stop:
                chunk = os.pread(self.fd, min(ZERO_SCAN_CHUNK_BYTES, stop - position), position)
                if not chunk:
                    break
                os.write(fd, chunk)
                position += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)
        return side

    # --- closing

    def release(self) -> bool:
        """Close the map and the file; False while views of the map are still alive (the map is
        kept and ``release`` should be retried)."""
        if self.fd >= 0:
            os.close(self.fd)  # the map holds its own descriptor
            self.fd = -1
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                return False
            self._map = None
        return True


_ZEROS: Final = bytes(ZERO_SCAN_CHUNK_BYTES)


def _next_data(fd: int, position: int, size: int) -> int:
    """The next position at or after ``position`` that may hold data (holes read as zeros)."""
    try:
        return os.lseek(fd, position, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return size  # only a hole remains
        return position  # SEEK_DATA unsupported here: read everything


def _skip(parts: list[Buffer], n: int) -> list[Buffer]:
    """``parts`` without its first ``n`` bytes (after a short write)."""
    out: list[Buffer] = []
    for part in parts:
        if n >= len(part):
            n -= len(part)
            continue
        out.append(memoryview(part)[n:] if n else part)
        n = 0
    return out
