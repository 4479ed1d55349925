"""Compression of a batch's records section (zstd, lz4 frame), with bounded decompression.

No I/O. Every failure of a decompressor, whatever type its library raises, becomes BatchError.
"""

from __future__ import annotations

import threading
from typing import Final

import lz4.frame
import zstandard

from sbpstream.records.header import (
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_ZSTD,
    MAX_BATCH_BYTES,
    BatchError,
)

# Why 64 MiB: BatchBuilder caps the *uncompressed* records at the batch size bound (at most
# MAX_BATCH_BYTES, ~16 MiB), so a batch from our SDK never decompresses past that. Producers
# that bound only the compressed size may legitimately reach a few times more; beyond 4x the
# wire limit it is a decompression bomb, and a consumer must not allocate gigabytes for one.
MAX_DECOMPRESSED_BYTES: Final = 4 * MAX_BATCH_BYTES

ZSTD_LEVEL: Final = 3  # zstd's default: good ratio at several hundred MB/s
_DECOMPRESS_ERRORS: Final = (zstandard.ZstdError, RuntimeError, ValueError, OverflowError)

_local = threading.local()  # zstd contexts are reusable but not thread-safe


def _zstd_compressor() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def compress(codec: int, data: bytes) -> bytes:
    if codec == CODEC_ZSTD:
        return bytes(_zstd_compressor().compress(data))
    if codec == CODEC_LZ4:
        return bytes(lz4.frame.compress(data, store_size=True))
    if codec == CODEC_NONE:
        return data
    raise ValueError(f"unknown codec {codec}")


def decompress(codec: int, data: memoryview) -> bytes:
    """Decompress one records section, refusing output beyond MAX_DECOMPRESSED_BYTES."""
    try:
        if codec == CODEC_ZSTD:
            return _zstd_decompress(data)
        if codec == CODEC_LZ4:
            return _lz4_decompress(data)
    except _DECOMPRESS_ERRORS as e:
        raise BatchError(f"cannot decompress records (codec {codec}): {e}") from None
    raise BatchError(f"unknown codec {codec}")


def _check_size(size: int) -> None:
    if size > MAX_DECOMPRESSED_BYTES:
        raise BatchError(
            f"records decompress to {size} bytes, over MAX_DECOMPRESSED_BYTES "
            f"({MAX_DECOMPRESSED_BYTES})"
        )


def _zstd_decompress(data: memoryview) -> bytes:
    size = zstandard.frame_content_size(data)
    if size >= 0:
        # zstd checks the frame really holds `size` bytes, so the bound is checked before work.
        _check_size(size)
    # With a known content size max_output_size is ignored (the size was checked above);
    # without one the output buffer is bounded by it and a longer frame fails.
    out = _zstd_decompressor().decompress(
        data, max_output_size=MAX_DECOMPRESSED_BYTES, allow_extra_data=False
    )
    return bytes(out)


def _lz4_decompress(data: memoryview) -> bytes:
    content_size = int(lz4.frame.get_frame_info(data)["content_size"] or 0)
    _check_size(content_size)
    # Ask for one byte more than allowed (or than announced) to tell "exactly" from "more".
    limit = (content_size if content_size else MAX_DECOMPRESSED_BYTES) + 1
    d = lz4.frame.LZ4FrameDecompressor()
    out = bytes(d.decompress(data, max_length=limit))
    if content_size and len(out) != content_size:
        raise BatchError(f"lz4 frame holds {len(out)} bytes, header says {content_size}")
    _check_size(len(out))
    if not d.eof:
        raise BatchError("truncated lz4 frame")
    if d.unused_data:
        raise BatchError(f"{len(d.unused_data)} bytes after the lz4 frame")
    return out
