from collections.abc import Callable
from typing import Any

def decode_section(
    data: bytes,
    count: int,
    base_offset: int,
    first_ts: int,
    cls: type[tuple[Any, ...]],
    stream_id: int | None,
    decode_headers: Callable[[bytes, int, int], tuple[tuple[tuple[str, Any], ...], int]],
) -> list[tuple[Any, ...]] | None: ...

class ColumnSink:
    rows: int
    key_nulls: int
    value_nulls: int
    headers: list[tuple[int, tuple[tuple[str, Any], ...]]]
    def __init__(self, ts_scale: int = 1) -> None: ...
    def add_section(
        self,
        data: bytes,
        count: int,
        base_offset: int,
        first_ts: int,
        lo: int,
        hi: int,
        decode_headers: Callable[[bytes, int, int], tuple[tuple[tuple[str, Any], ...], int]],
    ) -> bool: ...
    def buffers(self) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes, bytes, bytes]: ...

def encode_rows(
    values: tuple[Any, Any, Any, int],
    keys: tuple[Any, Any, Any, int] | None,
    stamps: tuple[Any, Any, int, int] | None,
    default_ts: int,
    start: int,
    stop: int,
    room: int,
    max_count: int,
    first_ts: int,
    has_first: bool,
) -> tuple[bytes, int, int, int]: ...
