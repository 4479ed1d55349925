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
