from collections.abc import Callable, Sequence
from typing import Any

def read_results(
    data: Any,
    at: int,
    result_cls: type[Any],
    range_cls: type[Any],
    replica_cls: type[Any],
    node_cls: type[Any],
    default_node: Any,
    read_status: Callable[[Any, int], Any],
    buf: Any,
    ok: Any,
) -> tuple[Any, ...] | None: ...
def write_results(
    items: Sequence[Any], off0: int, vtables: dict[tuple[int, ...], int]
) -> tuple[bytes, int, bool]: ...
