"""What the HTTP routes share (`ServerState`, on `app.state.server`) and the helpers every route uses."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Optional

import orjson
from fastapi import Request

from sglang.srt.entrypoints.launch import Subprocesses
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.server_args import ServerArgs

if TYPE_CHECKING:
    from sglang.srt.entrypoints.openai.batch_serving import BatchServing
    from sglang.srt.entrypoints.openai.routes import OpenAIServing


class ServerState:
    """Args, subprocesses, the tokenizer manager and readiness of one running server."""

    def __init__(self, server_args: ServerArgs, subs: Subprocesses) -> None:
        self.args = server_args
        self.subs = subs
        self.tm = subs.tokenizer_manager
        self.model_info = subs.model_info
        self.created = time.time()
        # Set once the warm-up request has run; /health answers 503 until then.
        self.ready = threading.Event()
        # Built when the OpenAI routes are mounted (entrypoints/openai/routes.attach_openai).
        self.openai: Optional[OpenAIServing] = None
        self.batches: Optional[BatchServing] = None


def server_state(request: Request) -> ServerState:
    return request.app.state.server


Handler = Callable[[Request], Awaitable[Any]]


def timed_handler(name: str) -> Callable[[Handler], Handler]:
    """Time a route handler into `sglang:func_latency_seconds{name=...}` when metrics are on, as SGLang times its
    generate, completion, chat and embedding handlers (a streaming handler counts until its response starts)."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def timed(request: Request) -> Any:
            start = time.monotonic()
            try:
                return await handler(request)
            finally:
                metrics = getattr(server_state(request).tm, "metrics", None)
                if metrics is not None:
                    metrics.on_handler(name, time.monotonic() - start)

        return timed

    return wrap


def native_error(message: str, status: int = 400) -> ORJSONResponse:
    return ORJSONResponse({"error": {"message": message}}, status_code=status)


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON body: {e}") from None


def model_card(state: ServerState) -> dict:
    name = state.args.served_model_name
    return {
        "id": name, "object": "model", "created": int(state.created),
        "owned_by": "sglang", "root": name, "max_model_len": state.tm.context_len,
    }
