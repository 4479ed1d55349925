"""Event loop selection: uvloop when installed (it is a dependency), asyncio's otherwise."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# How long a thread may hold the GIL while another waits for it (CPython's default is 5 ms).
# A server's event loop thread runs Python almost all the time under load, and its helper
# threads (the store's group-commit fsync, SQLite commits on the PM) need the GIL back for a
# moment when their blocking call returns, to hand the result to the loop. With the default, an
# fsync-acknowledged append could wait up to 5 ms for that hand-off after a 0.1 ms fsync: that
# was the p99 of end-to-end latency (bench/bench_subscribe.py). 0.2 ms bounds the wait well
# under the 1 ms p99 goal; the cost is a GIL switch check every 0.2 ms, paid only while another
# thread is actually waiting for the GIL.
SERVER_SWITCH_INTERVAL_S = 0.0002


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
    """:func:`run` for a server process (data node, PM, gateway): also shortens the GIL switch
    interval to ``SERVER_SWITCH_INTERVAL_S`` for the whole process, so a helper thread's result
    reaches the event loop without waiting out the default 5 ms, and freezes what startup
    allocated (``gc.freeze``)."""
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    # What is alive now (modules, classes, the generated message code) lives as long as the
    # process: move it out of the collector's generations so a full collection, a pause in
    # every request in flight, does not walk it again and again.
    gc.freeze()
    return run(main)
