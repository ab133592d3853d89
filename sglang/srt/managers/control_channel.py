"""The tokenizer manager's control exchanges with the schedulers: a message to every replica, one reply from each.

Control messages (flush, internal state, weight updates, expert records) are not requests: their replies come
back through the detokenizer's socket like outputs, are told apart by type, and carry no request id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sglang.srt.managers.data_parallel.dispatcher import merge_replies


class ControlChannel:
    def __init__(self, send: Callable[[Any], Any], replicas: int, ensure_receiving: Callable[[], None]) -> None:
        self._send = send
        self._replicas = replicas
        self._ensure_receiving = ensure_receiving
        self._waiters: dict[type, asyncio.Queue] = {}
        self._locks: dict[type, asyncio.Lock] = {}

    def deliver(self, msg: Any) -> None:
        """A reply arrived (called by the receive loop); replies nobody waits for are dropped."""
        queue = self._waiters.get(type(msg))
        if queue is not None:
            queue.put_nowait(msg)

    async def request(self, req: Any, reply_type: type) -> Any:
        """Send `req` to every replica; their replies folded into one (see merge_replies)."""
        return merge_replies(await self.request_all(req, reply_type))

    async def request_all(self, req: Any, reply_type: type) -> list[Any]:
        """Send `req` to every scheduler replica and gather their replies (one per replica, in arrival order)."""
        self._ensure_receiving()
        queue = self._waiters.setdefault(reply_type, asyncio.Queue())
        # One exchange of a type at a time: replies carry no request id, so two concurrent gathers could
        # otherwise each take two replies of the same replica. The gathering task, not the caller, releases
        # the lock once every reply is in, so a caller that gives up leaves no stale reply for the next one.
        lock = self._locks.setdefault(reply_type, asyncio.Lock())
        await lock.acquire()
        try:
            self._send(req)
        except BaseException:
            lock.release()
            raise
        return await asyncio.shield(asyncio.ensure_future(self._gather(queue, lock)))

    async def _gather(self, queue: asyncio.Queue, lock: asyncio.Lock) -> list[Any]:
        try:
            return [await queue.get() for _ in range(self._replicas)]
        finally:
            lock.release()
