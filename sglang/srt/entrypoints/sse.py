"""Server-sent events shared by the native and the OpenAI streaming routes."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Optional

import orjson
from fastapi.responses import Response, StreamingResponse

from sglang.srt.managers.request_errors import RequestRefused

SSE_DONE = b"data: [DONE]\n\n"


def sse_json(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def open_stream(
    gen: AsyncGenerator[dict, None], error_response: Callable[[str], Response]
) -> tuple[Optional[AsyncIterator[dict]], Optional[Response]]:
    """Wait for the first output, so that request errors still become plain HTTP 400 responses.

    Returns (all outputs including the first, None) or (None, error response)."""
    try:
        first = await gen.__anext__()
    except ValueError as e:
        return None, error_response(str(e))

    async def outputs() -> AsyncIterator[dict]:
        yield first
        async for out in gen:
            yield out

    return outputs(), None


def sse_response(
    gen: AsyncGenerator[dict, None], events: AsyncIterator[bytes], error_event: Callable[[str, int], bytes]
) -> StreamingResponse:
    """Stream `events` (built from `gen`); errors become an SSE error event (message, HTTP status the error
    would have had); always ends with [DONE]."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except ValueError as e:
            yield error_event(str(e), 400)
        except RequestRefused as e:
            yield error_event(e.message, e.status_code)
        finally:
            await gen.aclose()
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")
