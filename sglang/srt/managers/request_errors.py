"""Refusals that are not the client's fault, with the HTTP status each becomes (400s are plain ValueErrors).

The tokenizer manager raises them; the HTTP server turns them into its error shape with this status (see
`entrypoints/error_handlers.py`); a stream that already started reports them as an error event.
"""

from __future__ import annotations

import asyncio
from typing import Optional


class RequestRefused(Exception):
    status_code = 500

    def __init__(self, message: str, retry_after: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class ServerBusyError(RequestRefused):
    """The waiting queue is full (--max-queued-requests): 503 with a Retry-After header."""

    status_code = 503


class InternalRequestError(RequestRefused):
    """The request failed inside the server (a bug or a fault, not its input): 500. Other requests carry on."""

    status_code = 500


class WorkerDiedError(RequestRefused):
    """A worker process died while the request was in flight: 503 (the server is going down)."""

    status_code = 503


class RequestTimeoutError(RequestRefused):
    """The request ran past --request-timeout and was aborted: 504."""

    status_code = 504


def check_queue_capacity(in_flight: int, new: int, max_running: int, max_queued: Optional[int]) -> None:
    """ServerBusyError when admitting `new` requests would leave more than `max_queued` of them waiting for one
    of the `max_running` running slots."""
    if max_queued is None:
        return
    waiting = max(in_flight + new - max_running, 0)
    if waiting > max_queued:
        raise ServerBusyError(
            f"The server is busy: {in_flight} requests are in flight and at most {max_queued} may wait "
            f"(--max-queued-requests). Retry later.", retry_after=1,
        )


async def wait_until(event: asyncio.Event, deadline: Optional[float], timeout_s: Optional[float]) -> None:
    """Wait for `event`; RequestTimeoutError once the loop's clock passes `deadline` (None: no limit)."""
    if deadline is None:
        await event.wait()
        return
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(event.wait(), timeout=max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise RequestTimeoutError(f"The request timed out after {timeout_s:g} s (--request-timeout).") from None
