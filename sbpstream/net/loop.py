"""Event loop selection: uvloop when installed (it is a dependency), asyncio's otherwise."""

from __future__ import annotations

import asyncio
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
