"""An asyncio readers-writer lock that prefers writers: generation requests read, a weight update writes.

While a writer holds or waits for the lock no new reader gets in, so an update waits only for the requests that
were already running, and no generation starts until the new weights serve.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RWLock:
    def __init__(self) -> None:
        self.readers = 0
        self.writer_active = False
        self.waiting_writers = 0
        self._changed: asyncio.Event | None = None

    async def _wait_for_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        # Wake every waiter once; each re-checks its own condition (single-threaded, so nothing races the check).
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def acquire_reader(self) -> None:
        while self.writer_active or self.waiting_writers:
            await self._wait_for_change()
        self.readers += 1

    def release_reader(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._notify()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        self.waiting_writers += 1
        acquired = False
        try:
            while self.writer_active or self.readers:
                await self._wait_for_change()
            acquired = True
        finally:
            self.waiting_writers -= 1
            if not acquired:  # cancelled while waiting: let the readers it held back in
                self._notify()
        self.writer_active = True
        try:
            yield
        finally:
            self.writer_active = False
            self._notify()
