"""Routes of the OpenAI-compatible API, auth and error shapes, mounted on the server's FastAPI app."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from sglang.srt.entrypoints.openai.chat import ChatHandler
from sglang.srt.entrypoints.openai.common import error_response
from sglang.srt.entrypoints.openai.completions import CompletionHandler
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import model_card

logger = logging.getLogger(__name__)

UNPROTECTED_PREFIXES = ("/health", "/metrics")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a Jinja file path or a built-in template name; None keeps the tokenizer's own."""
    if value is None:
        return None
    from sglang.srt.entrypoints.openai.chat_templates import BUILTIN_CHAT_TEMPLATES

    if value in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[value]
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError:
        raise ValueError(
            f"--chat-template {value!r} is neither a file nor a built-in template "
            f"({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})"
        ) from None


def install_api_key_check(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable):
        if request.method == "OPTIONS" or request.url.path.startswith(UNPROTECTED_PREFIXES):
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return ORJSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into `model`; returns the model or an error response."""
    ctype = request.headers.get("content-type", "")
    if "application/json" not in ctype:
        return error_response("Unsupported Media Type: Only 'application/json' is allowed", 400, "Bad Request")
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return error_response(f"Invalid JSON body: {e}", 400, "Bad Request")
    if not isinstance(data, dict):
        return error_response("The request body must be a JSON object", 400, "Bad Request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        return error_response(_validation_message(e), 400, "Bad Request")


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


def register_openai_routes(app: FastAPI, state) -> None:
    tm = state.tm
    args = state.args
    defaults = state.model_info.generation_defaults if args.sampling_defaults == "model" else {}
    chat = ChatHandler(tm, load_chat_template(args.chat_template), defaults, args.tool_call_parser,
                       args.reasoning_parser)
    completions = CompletionHandler(tm)

    @app.post("/v1/chat/completions")
    @app.post("/invocations")
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatCompletionRequest)
        if not isinstance(req, ChatCompletionRequest):
            return req
        return await chat.handle(req)

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        req = await parse_body(request, CompletionRequest)
        if not isinstance(req, CompletionRequest):
            return req
        return await completions.handle(req)

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model != args.served_model_name:
            return ORJSONResponse({"error": {
                "message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}, status_code=404)
        return ORJSONResponse(model_card(state))

    from sglang.srt.batch.lines import generate_endpoint
    from sglang.srt.entrypoints.openai.batches import register_batch_routes

    register_batch_routes(app, state, {
        "/v1/chat/completions": generate_endpoint(ChatCompletionRequest, chat),
        "/v1/completions": generate_endpoint(CompletionRequest, completions),
    })
