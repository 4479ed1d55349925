"""Event loop selection: uvloop when installed (it is a dependency), asyncio's otherwise."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def run_server(main: Coroutine[Any, Any, T]) -> T:
    """:func:`run` for a server process (data node, PM, gateway), after freezing what startup
    allocated (``gc.freeze``).

    CPython's GIL switch interval stays at its 5 ms default: a 0.2 ms interval (so the store's
    fsync thread would hand a finished group commit back to a busy loop sooner) measured no
    better on a quiet machine (docs/benchmarks.md, "End-to-end latency")."""
    # What is alive now (modules, classes, the generated message code) lives as long as the
    # process: move it out of the collector's generations so a full collection, a pause in
    # every request in flight, does not walk it again and again.
    gc.freeze()
    return run(main)
