from collections.abc import Callable
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
