"""Routes of the OpenAI-compatible API (chat, completions, models; files and batches in their own modules) and the
API-key check, mounted on the server's FastAPI app by `attach_openai`."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request

from sglang.srt.batch.lines import generate_endpoint
from sglang.srt.entrypoints.body_schemas import body_openapi
from sglang.srt.entrypoints.openai.batch_serving import attach_batch_serving
from sglang.srt.entrypoints.openai.batches import router as batches_router
from sglang.srt.entrypoints.openai.chat import ChatHandler
from sglang.srt.entrypoints.openai.common import parse_body
from sglang.srt.entrypoints.openai.completions import CompletionHandler
from sglang.srt.entrypoints.openai.embeddings import embeddings_batch_endpoint
from sglang.srt.entrypoints.openai.files import router as files_router
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import ServerState, model_card, server_state, timed_handler
from sglang.srt.lora.client import adapter_model_cards

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


@dataclass
class OpenAIServing:
    """The request handlers the OpenAI routes share, built once per server."""

    chat: ChatHandler
    completions: CompletionHandler


def attach_openai(app: FastAPI, state: ServerState) -> None:
    """Build the handlers and the batch store and runner, and mount every OpenAI-compatible route."""
    args = state.args
    defaults = state.model_info.generation_defaults if args.sampling_defaults == "model" else {}
    chat = ChatHandler(state.tm, load_chat_template(args.chat_template), defaults, args.tool_call_parser,
                       args.reasoning_parser)
    completions = CompletionHandler(state.tm)
    state.openai = OpenAIServing(chat, completions)
    # Batch files run the endpoints this server serves: embeddings on an --is-embedding server, else generation.
    endpoints = {"/v1/embeddings": embeddings_batch_endpoint(state)} if args.is_embedding else {
        "/v1/chat/completions": generate_endpoint(ChatCompletionRequest, chat),
        "/v1/completions": generate_endpoint(CompletionRequest, completions),
    }
    attach_batch_serving(app, state, endpoints)
    app.include_router(router)
    app.include_router(files_router)
    app.include_router(batches_router)


def openai_serving(request: Request) -> OpenAIServing:
    return server_state(request).openai


router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=body_openapi(ChatCompletionRequest))
@router.post("/invocations", openapi_extra=body_openapi(ChatCompletionRequest))
@timed_handler("openai_v1_chat_completions")
async def chat_completions(request: Request):
    req = await parse_body(request, ChatCompletionRequest)
    if not isinstance(req, ChatCompletionRequest):
        return req
    return await openai_serving(request).chat.handle(req)


@router.post("/v1/completions", openapi_extra=body_openapi(CompletionRequest))
@timed_handler("openai_v1_completions")
async def v1_completions(request: Request):
    req = await parse_body(request, CompletionRequest)
    if not isinstance(req, CompletionRequest):
        return req
    return await openai_serving(request).completions.handle(req)


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str):
    state = server_state(request)
    card = model_card(state)
    adapter = next((c for c in adapter_model_cards(card, state.tm.lora_adapters) if c["id"] == model), None)
    if adapter is not None:
        return ORJSONResponse(adapter)
    if model != state.args.served_model_name:
        return ORJSONResponse({"error": {
            "message": f"The model '{model}' does not exist", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}}, status_code=404)
    return ORJSONResponse(card)
