"""Routes of pooled models (--is-embedding): /encode and /classify (native shape), /v1/rerank (cross-encoders)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from sglang.srt.entrypoints.body_schemas import EmbeddingBody, RerankBody, body_openapi, check_body
from sglang.srt.entrypoints.openai.common import error_response
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import native_error, read_json, server_state
from sglang.srt.managers.embedding_input import EmbeddingReqInput
from sglang.srt.managers.embedding_manager import NOT_GENERATION_MODEL, encode_request

router = APIRouter()


@router.api_route("/encode", methods=["POST", "PUT"], openapi_extra=body_openapi(EmbeddingBody))
async def encode(request: Request):
    return await _pool_native(request)


@router.api_route("/classify", methods=["POST", "PUT"], openapi_extra=body_openapi(EmbeddingBody))
async def classify(request: Request):
    """Reward models: `embedding` is the list of scores (one element for a scalar reward)."""
    return await _pool_native(request)


async def _pool_native(request: Request):
    state = server_state(request)
    try:
        body = await read_json(request)
        obj = EmbeddingReqInput.from_json(body)
        obj.items()  # the field checks with the contract's messages first
        check_body(EmbeddingBody, body)  # then what they leave open (id ranges, rid types)
        outputs = await encode_request(state.tm, obj)
    except (ValueError, TypeError) as e:
        return native_error(str(e))
    return ORJSONResponse(outputs[0] if obj.is_single() else outputs)


def validate_rerank(body: Any) -> tuple[str, list[str], Any]:
    """(query, documents, top_n) of a /v1/rerank body; ValueError with the contract's messages otherwise."""
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ValueError("Query cannot be empty")
    if not query.strip():
        raise ValueError("Query cannot be empty or whitespace only")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise ValueError("Documents cannot be empty")
    for doc in documents:
        if not isinstance(doc, str) or not doc:
            raise ValueError("Each document must be a non-empty string")
        if not doc.strip():
            raise ValueError("Each document cannot be empty or whitespace only")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n <= 0):
        raise ValueError("top_n must be a positive integer")
    return query, documents, top_n


@router.api_route("/v1/rerank", methods=["POST", "PUT"], openapi_extra=body_openapi(RerankBody))
async def rerank(request: Request):
    """Score each (query, document) pair with a cross-encoder; results sorted by score, best first."""
    state = server_state(request)
    try:
        query, documents, top_n = validate_rerank(await read_json(request))
        if state.args.is_embedding:
            archs = list(getattr(state.model_info.hf_config, "architectures", None) or [])
            if not any(a.endswith("ForSequenceClassification") for a in archs):
                raise ValueError(f"/v1/rerank needs a cross-encoder (a *ForSequenceClassification model); this "
                                 f"model is {', '.join(archs) or 'not one'}. Use /encode or /v1/embeddings.")
        obj = EmbeddingReqInput(text=[[query, doc] for doc in documents])
        outputs = await encode_request(state.tm, obj)
    except (ValueError, TypeError) as e:
        return error_response(str(e))
    results = [
        {"score": _relevance(out["embedding"]), "document": doc, "index": i, "meta_info": out["meta_info"]}
        for i, (doc, out) in enumerate(zip(documents, outputs))
    ]
    results.sort(key=lambda r: r["score"], reverse=True)
    return ORJSONResponse(results[:top_n] if top_n else results)


def _relevance(row: list[float]) -> float:
    """A one-logit cross-encoder's relevance is sigmoid(logit), as sentence-transformers' CrossEncoder reports it;
    with several labels the last one is taken as 'relevant'."""
    if len(row) == 1:
        return 1.0 / (1.0 + math.exp(-row[0]))
    return float(row[-1])


# OpenAI generation routes that tokenize with a chat template or sample: refused up front on an embedding server,
# before any template or sampling parameter is looked at.
_OPENAI_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations", "/v1/score"})


class GenerationGuard:
    """ASGI middleware of an --is-embedding server: the OpenAI generation routes answer a 400 saying why.

    A plain ASGI class rather than `@app.middleware("http")`, whose wrapper hides client disconnects from the
    routes behind it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _OPENAI_GENERATION_PATHS:
            await error_response(NOT_GENERATION_MODEL)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def install_generation_guard(app: FastAPI, is_embedding: bool) -> None:
    if is_embedding:
        app.add_middleware(GenerationGuard)
