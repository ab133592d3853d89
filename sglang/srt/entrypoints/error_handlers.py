"""Server-wide error handling: refusals that carry their own status (503, 504), oversized bodies (413), and a
last-resort handler so an unexpected exception is logged and answered in the API's error shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang.srt.entrypoints.openai.common import STATUS_ERROR_TYPES, error_response
from sglang.srt.entrypoints.server_state import native_error
from sglang.srt.managers.request_errors import RequestRefused
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

def api_error(path: str, message: str, status: int, headers: dict[str, str] | None = None):
    """The error body of `path`'s API: OpenAI's shape under /v1 and /invocations, the native one elsewhere."""
    if path.startswith(("/v1/", "/invocations")):
        response = error_response(message, status, STATUS_ERROR_TYPES.get(status, "BadRequestError"))
    else:
        response = native_error(message, status)
    response.headers.update(headers or {})
    return response


class BodySizeLimit:
    """413 for a request body over the limit, whether announced by Content-Length or streamed in chunks."""

    def __init__(self, app: ASGIApp, limit: int, files_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.files_limit = files_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.files_limit if path.rstrip("/") == "/v1/files" else self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, path, limit)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send, path, limit)

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, path: str, limit: int) -> None:
        response = api_error(path, f"The request body is larger than {limit} bytes (--max-request-body-bytes).", 413)
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def install_error_handlers(app: FastAPI, args: ServerArgs) -> None:
    async def refused(request: Request, exc: Exception):
        assert isinstance(exc, RequestRefused)
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
        return api_error(request.url.path, exc.message, exc.status_code, headers)

    app.add_exception_handler(RequestRefused, refused)
    app.add_middleware(BodySizeLimit, limit=args.max_request_body_bytes,
                       files_limit=max(args.max_request_body_bytes, args.max_file_size + (1 << 20)))
