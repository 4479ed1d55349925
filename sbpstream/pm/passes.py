"""A leader's background job run one pass at a time (repair, drain): started by :meth:`kick`
from the liveness sweep, never two passes at once, cancelled by :meth:`close`; a pass that
fails is logged (``event=<name>_failed`` for an SbpError, ``<name>_crashed`` with the traceback
otherwise) and the next sweep starts another."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from sbpstream.protocol.errors import SbpError

log = logging.getLogger("sbpstream.pm")


class BackgroundPass:
    def __init__(self, name: str, run_once: Callable[[], Awaitable[int]]) -> None:
        self.name = name
        self._run_once = run_once
        self._task: asyncio.Task[int] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def kick(self) -> None:
        """Start a pass unless one is running."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._logged())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _logged(self) -> int:
        try:
            return await self._run_once()
        except SbpError as e:
            log.warning("event=%s_failed error=%r", self.name, str(e))
        except Exception:
            log.exception("event=%s_crashed", self.name)
        return 0
